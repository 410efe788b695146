//! The two superblocks at blocks 0 and 1. Commit `g` writes slot `g % 2`; recovery takes the
//! valid one with the higher generation.

use super::codec::{Dec, Enc};
use super::header::{payload, seal, unseal, BlockHeader, BlockKind, BlockRef, Owner, StreamTag, HEADER_LEN};
use crate::error::{BlockFault, Error};

pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"ctxfs-sb";
/// The version every commit writes.
pub const FORMAT_VERSION: u32 = 2;
/// The oldest version still read: version 1 lacks only parent links, which it decodes as absent.
pub const OLDEST_READABLE_VERSION: u32 = 1;
pub const SUPERBLOCK_SLOTS: u64 = 2;
const PAYLOAD_LEN: usize = 104;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    /// The version this superblock was written with; commits write [`FORMAT_VERSION`].
    pub format_version: u32,
    pub block_size: u32,
    pub total_blocks: u64,
    pub generation: u64,
    pub store_id: [u8; 16],
    pub catalog: BlockRef,
    pub alloc: BlockRef,
    pub allocated_blocks: u64,
    pub next_context_id: u32,
    pub commit_unix_ms: u64,
}

impl Superblock {
    pub fn slot(&self) -> u64 {
        self.generation % SUPERBLOCK_SLOTS
    }

    pub fn encode_into(&self, block: &mut [u8]) -> u32 {
        debug_assert!((OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&self.format_version));
        let mut e = Enc::default();
        e.bytes(&SUPERBLOCK_MAGIC)
            .u32(self.format_version)
            .u32(self.block_size)
            .u64(self.total_blocks)
            .u64(self.generation)
            .bytes(&self.store_id);
        self.catalog.encode(&mut e);
        self.alloc.encode(&mut e);
        e.u64(self.allocated_blocks).u32(self.next_context_id).u32(0).u64(self.commit_unix_ms);
        debug_assert_eq!(e.0.len(), PAYLOAD_LEN);
        let header = BlockHeader {
            kind: BlockKind::Superblock,
            stream: StreamTag::Meta,
            owner: Owner::SYSTEM,
            payload_len: PAYLOAD_LEN as u32,
            logical: self.slot(),
            generation: self.generation,
        };
        seal(block, &header, &e.0)
    }

    /// Whether a device's first bytes carry a ctxfs block magic where either superblock slot
    /// would start (slot 1 at every possible block size): what tells a damaged store from
    /// something that never was one.
    pub fn magic_in(prefix: &[u8]) -> bool {
        let magic_at =
            |at: usize| prefix.get(at..at + 4) == Some(&crate::format::header::BLOCK_MAGIC.to_le_bytes()[..]);
        let mut bs = crate::device::MIN_BLOCK_SIZE;
        let mut found = magic_at(0);
        while bs <= crate::device::MAX_BLOCK_SIZE {
            found |= magic_at(bs);
            bs *= 2;
        }
        found
    }

    /// The block size a slot claims, read without checking anything, to know how much to read.
    pub fn peek_block_size(prefix: &[u8]) -> Option<u32> {
        let at = HEADER_LEN + 12;
        let raw = prefix.get(at..at + 4)?;
        Some(u32::from_le_bytes(raw.try_into().ok()?))
    }

    /// Decodes and checks one superblock slot (`block` is exactly one block). The 40-byte
    /// header and its CRC rule are the same in every format version, so the checksum is
    /// checked first; a store of another version is then refused with a clear message.
    pub fn decode(block: &[u8], slot: u64) -> Result<Superblock, Error> {
        let damaged = |fault| Error::damaged(slot, "superblock", "system", fault);
        let (h, _) = unseal(block).map_err(damaged)?;
        let mut d = Dec::new(payload(block, &h), "superblock");
        if d.bytes(8).map_err(damaged)? != SUPERBLOCK_MAGIC || h.kind != BlockKind::Superblock {
            return Err(damaged(BlockFault::Malformed(format!("{} block where a superblock belongs", h.kind.name()))));
        }
        let format_version = d.u32().map_err(damaged)?;
        if !(OLDEST_READABLE_VERSION..=FORMAT_VERSION).contains(&format_version) {
            return Err(Error::UnsupportedVersion {
                found: format_version,
                oldest: OLDEST_READABLE_VERSION,
                newest: FORMAT_VERSION,
                hint: "open it with a ctxfs release that reads that version",
            });
        }
        if h.logical != slot
            || h.owner != Owner::SYSTEM
            || h.stream != StreamTag::Meta
            || h.payload_len as usize != PAYLOAD_LEN
        {
            return Err(damaged(BlockFault::Malformed(format!(
                "header says slot {} owner {} stream {} payload {} bytes; expected slot {slot}, system, meta, {PAYLOAD_LEN}",
                h.logical,
                h.owner,
                h.stream.name(),
                h.payload_len
            ))));
        }
        let sb = Superblock {
            format_version,
            block_size: d.u32().map_err(damaged)?,
            total_blocks: d.u64().map_err(damaged)?,
            generation: d.u64().map_err(damaged)?,
            store_id: d.bytes(16).map_err(damaged)?.try_into().expect("16 bytes"),
            catalog: BlockRef::decode(&mut d).map_err(damaged)?,
            alloc: BlockRef::decode(&mut d).map_err(damaged)?,
            allocated_blocks: d.u64().map_err(damaged)?,
            next_context_id: d.u32().map_err(damaged)?,
            commit_unix_ms: {
                let _reserved = d.u32().map_err(damaged)?;
                d.u64().map_err(damaged)?
            },
        };
        let bad = |what: String| Err(damaged(BlockFault::Malformed(what)));
        if sb.generation != h.generation || sb.slot() != slot {
            return bad(format!("generation {} does not belong in slot {slot}", sb.generation));
        }
        if sb.block_size as usize != block.len() {
            return bad(format!("block size {} but the slot was read as {} bytes", sb.block_size, block.len()));
        }
        if sb.total_blocks < crate::txn::MIN_STORE_BLOCKS
            || sb.catalog.block >= sb.total_blocks
            || sb.alloc.block >= sb.total_blocks
        {
            return bad("block counts or roots out of range".into());
        }
        if sb.catalog.block < SUPERBLOCK_SLOTS || sb.alloc.block < SUPERBLOCK_SLOTS {
            return bad("a root points at a superblock slot".into());
        }
        Ok(sb)
    }
}
