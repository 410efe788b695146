//! The 40-byte header every block starts with, and block references. See docs/format.md.

use super::codec::{Dec, Enc};
use crate::error::BlockFault;

pub const BLOCK_MAGIC: u32 = u32::from_le_bytes(*b"CXFB");
pub const HEADER_LEN: usize = 40;
/// Byte range the CRC covers starts here (everything after the CRC field).
const CRC_FROM: usize = 8;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockKind {
    Superblock = 1,
    Catalog = 2,
    Alloc = 3,
    Extent = 4,
    Index = 5,
    Data = 6,
}

impl BlockKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => BlockKind::Superblock,
            2 => BlockKind::Catalog,
            3 => BlockKind::Alloc,
            4 => BlockKind::Extent,
            5 => BlockKind::Index,
            6 => BlockKind::Data,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            BlockKind::Superblock => "superblock",
            BlockKind::Catalog => "catalog",
            BlockKind::Alloc => "alloc",
            BlockKind::Extent => "extent",
            BlockKind::Index => "index",
            BlockKind::Data => "data",
        }
    }
}

/// Which stream of its owner a block belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum StreamTag {
    /// Metadata that is not a stream: superblocks, catalog and allocator structures.
    Meta = 0,
    Tokens = 1,
    Index = 2,
    Data = 3,
}

impl StreamTag {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => StreamTag::Meta,
            1 => StreamTag::Tokens,
            2 => StreamTag::Index,
            3 => StreamTag::Data,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            StreamTag::Meta => "meta",
            StreamTag::Tokens => "tokens",
            StreamTag::Index => "index",
            StreamTag::Data => "data",
        }
    }
}

/// Who a block belongs to: the system (context 0), a context (layer and head `ALL`), or one
/// vector file (context, layer, kv head).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner {
    pub context: u32,
    pub layer: u16,
    pub head: u16,
}

impl Owner {
    pub const ALL: u16 = u16::MAX;
    pub const SYSTEM: Owner = Owner { context: 0, layer: 0, head: 0 };

    pub fn context(context: u32) -> Owner {
        Owner { context, layer: Self::ALL, head: Self::ALL }
    }
    pub fn file(context: u32, layer: u16, head: u16) -> Owner {
        Owner { context, layer, head }
    }
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if *self == Owner::SYSTEM {
            write!(f, "system")
        } else if self.layer == Owner::ALL {
            write!(f, "context {}", self.context)
        } else {
            write!(f, "context {} layer {} head {}", self.context, self.layer, self.head)
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockHeader {
    pub kind: BlockKind,
    pub stream: StreamTag,
    pub owner: Owner,
    pub payload_len: u32,
    pub logical: u64,
    pub generation: u64,
}

/// A pointer to a block, carrying the CRC the block must have. A lost write (the block still
/// holds older contents) or a misdirected one (another block's contents) fails this check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockRef {
    pub block: u64,
    pub crc: u32,
}

pub const REF_LEN: usize = 16;

impl BlockRef {
    pub fn encode(&self, e: &mut Enc) {
        e.u64(self.block).u32(self.crc).u32(0);
    }
    pub fn decode(d: &mut Dec<'_>) -> Result<Self, BlockFault> {
        let block = d.u64()?;
        let crc = d.u32()?;
        let _reserved = d.u32()?;
        Ok(BlockRef { block, crc })
    }
}

fn crc_of(block: &[u8]) -> u32 {
    crc32fast::hash(&block[CRC_FROM..])
}

/// Writes `header` and `payload` into `block` (zero-filling the rest) and returns the CRC.
pub fn seal(block: &mut [u8], header: &BlockHeader, payload: &[u8]) -> u32 {
    assert!(HEADER_LEN + payload.len() <= block.len(), "payload of {} bytes overflows the block", payload.len());
    assert_eq!(header.payload_len as usize, payload.len());
    block[HEADER_LEN..HEADER_LEN + payload.len()].copy_from_slice(payload);
    block[HEADER_LEN + payload.len()..].fill(0);
    let mut e = Enc(Vec::with_capacity(HEADER_LEN));
    e.u32(BLOCK_MAGIC)
        .u32(0)
        .u8(header.kind as u8)
        .u8(header.stream as u8)
        .u16(0)
        .u32(header.owner.context)
        .u16(header.owner.layer)
        .u16(header.owner.head)
        .u32(header.payload_len)
        .u64(header.logical)
        .u64(header.generation);
    debug_assert_eq!(e.0.len(), HEADER_LEN);
    block[..HEADER_LEN].copy_from_slice(&e.0);
    let crc = crc_of(block);
    block[4..8].copy_from_slice(&crc.to_le_bytes());
    crc
}

/// Decodes a header and checks the block's own checksum. Returns the header and the CRC.
pub fn unseal(block: &[u8]) -> Result<(BlockHeader, u32), BlockFault> {
    if block.len() < HEADER_LEN {
        return Err(BlockFault::Malformed("block shorter than its header".into()));
    }
    let mut d = Dec::new(&block[..HEADER_LEN], "block header");
    let magic = d.u32()?;
    if magic != BLOCK_MAGIC {
        return Err(BlockFault::BadMagic { found: magic });
    }
    let stored = d.u32()?;
    let computed = crc_of(block);
    if stored != computed {
        return Err(BlockFault::ChecksumMismatch { stored, computed });
    }
    let kind_raw = d.u8()?;
    let kind =
        BlockKind::from_u8(kind_raw).ok_or_else(|| BlockFault::Malformed(format!("unknown block kind {kind_raw}")))?;
    let stream_raw = d.u8()?;
    let stream = StreamTag::from_u8(stream_raw)
        .ok_or_else(|| BlockFault::Malformed(format!("unknown stream tag {stream_raw}")))?;
    let _reserved = d.u16()?;
    let owner = Owner { context: d.u32()?, layer: d.u16()?, head: d.u16()? };
    let payload_len = d.u32()?;
    if HEADER_LEN + payload_len as usize > block.len() {
        return Err(BlockFault::Malformed(format!("payload length {payload_len} overflows the block")));
    }
    let logical = d.u64()?;
    let generation = d.u64()?;
    Ok((BlockHeader { kind, stream, owner, payload_len, logical, generation }, stored))
}

/// The generation a block's header claims, without its checksum: `None` unless the magic is
/// intact. A hint about a block that fails [`unseal`], whose damage may lie there too.
pub fn claimed_generation(block: &[u8]) -> Option<u64> {
    let field = |at: usize, len: usize| block.get(at..at + len);
    let generation = u64::from_le_bytes(field(HEADER_LEN - 8, 8)?.try_into().expect("8 bytes"));
    (field(0, 4)? == BLOCK_MAGIC.to_le_bytes()).then_some(generation)
}

/// What a reference says a block must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Expect {
    pub kind: BlockKind,
    pub stream: StreamTag,
    pub owner: Owner,
    pub logical: u64,
    pub crc: u32,
    /// The generation of the superblock the reference was reached from.
    pub max_generation: u64,
}

/// Checks a block read through a reference: its own checksum, then every header field the
/// reference implies. Returns the header on success.
pub fn verify(block: &[u8], expect: &Expect) -> Result<BlockHeader, BlockFault> {
    let (h, crc) = unseal(block)?;
    if crc != expect.crc {
        return Err(BlockFault::ReferenceMismatch { expected: expect.crc, found: crc });
    }
    let mismatch = |field, expected: u64, found: u64| Err(BlockFault::HeaderMismatch { field, expected, found });
    if h.kind != expect.kind {
        return mismatch("kind", expect.kind as u64, h.kind as u64);
    }
    if h.stream != expect.stream {
        return mismatch("stream", expect.stream as u64, h.stream as u64);
    }
    if h.owner.context != expect.owner.context {
        return mismatch("owner.context", expect.owner.context.into(), h.owner.context.into());
    }
    if h.owner.layer != expect.owner.layer {
        return mismatch("owner.layer", expect.owner.layer.into(), h.owner.layer.into());
    }
    if h.owner.head != expect.owner.head {
        return mismatch("owner.head", expect.owner.head.into(), h.owner.head.into());
    }
    if h.logical != expect.logical {
        return mismatch("logical", expect.logical, h.logical);
    }
    if h.generation > expect.max_generation {
        return mismatch("generation", expect.max_generation, h.generation);
    }
    Ok(h)
}

/// The payload bytes of a block whose header has been checked.
pub fn payload<'a>(block: &'a [u8], header: &BlockHeader) -> &'a [u8] {
    &block[HEADER_LEN..HEADER_LEN + header.payload_len as usize]
}
