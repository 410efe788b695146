//! Catalog, context records, stream roots, extent blocks and the allocator directory.
//! Larger structures are encoded to a byte string (a "blob") and stored as a chain of blocks.

use super::codec::{Dec, Enc};
use super::header::{BlockRef, HEADER_LEN, REF_LEN};
use crate::error::BlockFault;

/// Longest context name, in bytes.
pub const MAX_NAME_LEN: usize = 255;
/// Upper bounds that keep a damaged record from describing absurd shapes.
pub const MAX_LAYERS: u16 = 1024;
pub const MAX_HEADS: u16 = 1024;
pub const MAX_HEAD_DIM: u16 = 4096;

/// Bytes of blob a chain block carries: the payload less the `next` reference.
pub fn chain_capacity(block_size: usize) -> usize {
    block_size - HEADER_LEN - REF_LEN
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F16 = 1,
    Bf16 = 2,
}

impl DType {
    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
        }
    }
    pub fn size(self) -> usize {
        2
    }
}

impl std::str::FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f16" => Ok(DType::F16),
            "bf16" => Ok(DType::Bf16),
            _ => Err(format!("unknown dtype {s:?} (expected f16 or bf16)")),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelShape {
    pub layers: u16,
    pub q_heads: u16,
    pub kv_heads: u16,
    pub head_dim: u16,
    pub dtype: DType,
}

impl ModelShape {
    pub fn validate(&self) -> Result<(), String> {
        let ModelShape { layers, q_heads, kv_heads, head_dim, .. } = *self;
        if layers == 0 || layers > MAX_LAYERS {
            return Err(format!("layers must be 1..={MAX_LAYERS}, got {layers}"));
        }
        if kv_heads == 0 || q_heads == 0 || q_heads > MAX_HEADS || kv_heads > MAX_HEADS {
            return Err(format!("heads must be 1..={MAX_HEADS}, got {q_heads} q heads and {kv_heads} kv heads"));
        }
        if q_heads % kv_heads != 0 {
            return Err(format!("q heads ({q_heads}) must be a multiple of kv heads ({kv_heads})"));
        }
        if head_dim == 0 || head_dim > MAX_HEAD_DIM {
            return Err(format!("head dim must be 1..={MAX_HEAD_DIM}, got {head_dim}"));
        }
        Ok(())
    }

    /// Number of vector files: one per (layer, kv head).
    pub fn files(&self) -> usize {
        self.layers as usize * self.kv_heads as usize
    }

    fn encode(&self, e: &mut Enc) {
        e.u16(self.layers).u16(self.q_heads).u16(self.kv_heads).u16(self.head_dim).u8(self.dtype as u8).u8(0).u16(0);
    }

    fn decode(d: &mut Dec<'_>) -> Result<Self, BlockFault> {
        let layers = d.u16()?;
        let q_heads = d.u16()?;
        let kv_heads = d.u16()?;
        let head_dim = d.u16()?;
        let dtype = match d.u8()? {
            1 => DType::F16,
            2 => DType::Bf16,
            other => return Err(BlockFault::Malformed(format!("unknown dtype code {other}"))),
        };
        let _reserved = (d.u8()?, d.u16()?);
        let shape = ModelShape { layers, q_heads, kv_heads, head_dim, dtype };
        shape.validate().map_err(BlockFault::Malformed)?;
        Ok(shape)
    }
}

/// The persisted root of one stream: how many blocks, how many payload bytes, and the extent
/// blocks that map its logical blocks to device blocks.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StreamRoot {
    pub blocks: u64,
    pub bytes: u64,
    pub extents: Vec<BlockRef>,
}

impl StreamRoot {
    fn encode(&self, e: &mut Enc) {
        e.u64(self.blocks).u64(self.bytes).u32(self.extents.len() as u32);
        for r in &self.extents {
            r.encode(e);
        }
    }
    fn decode(d: &mut Dec<'_>) -> Result<Self, BlockFault> {
        let blocks = d.u64()?;
        let bytes = d.u64()?;
        let n = d.count(REF_LEN)?;
        let extents = (0..n).map(|_| BlockRef::decode(d)).collect::<Result<_, _>>()?;
        Ok(StreamRoot { blocks, bytes, extents })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileRoots {
    pub index: StreamRoot,
    pub data: StreamRoot,
}

/// A context's token sequence begins with the first `prefix_tokens` tokens of context `id`
/// (whose own sequence may begin with its parent's, and so on); the context's own streams
/// hold only what follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ParentLink {
    pub id: u32,
    pub prefix_tokens: u64,
}

/// Everything stored about one context, as one blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContextRecord {
    pub id: u32,
    pub name: String,
    pub shape: ModelShape,
    pub created_unix_ms: u64,
    pub parent: Option<ParentLink>,
    /// Deleted by name, kept because live descendants read its blocks.
    pub retired: bool,
    /// Only this context's own tokens, not its parent's prefix.
    pub tokens: StreamRoot,
    /// Layer-major: file `layer * kv_heads + head`.
    pub files: Vec<FileRoots>,
}

/// Version 1 records, written before parent links existed; still read.
const CONTEXT_MAGIC_V1: &[u8; 4] = b"CCTX";
const CONTEXT_MAGIC: &[u8; 4] = b"CCX2";
const CATALOG_MAGIC: &[u8; 4] = b"CCAT";
const ALLOC_MAGIC: &[u8; 4] = b"CALC";
const FLAG_RETIRED: u32 = 1;

impl ContextRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.bytes(CONTEXT_MAGIC).u32(self.id).str(&self.name);
        self.shape.encode(&mut e);
        e.u64(self.created_unix_ms);
        let link = self.parent.unwrap_or(ParentLink { id: 0, prefix_tokens: 0 });
        e.u32(if self.retired { FLAG_RETIRED } else { 0 }).u32(link.id).u64(link.prefix_tokens);
        self.tokens.encode(&mut e);
        e.u32(self.files.len() as u32);
        for f in &self.files {
            f.index.encode(&mut e);
            f.data.encode(&mut e);
        }
        e.0
    }

    /// Decodes a version 2 record, or a version 1 record as one without parent or retirement.
    pub fn decode(blob: &[u8]) -> Result<Self, BlockFault> {
        let mut d = Dec::new(blob, "context record");
        let v1 = blob.starts_with(CONTEXT_MAGIC_V1);
        d.expect_magic(if v1 { CONTEXT_MAGIC_V1 } else { CONTEXT_MAGIC })?;
        let id = d.u32()?;
        let name = d.str()?;
        let shape = ModelShape::decode(&mut d)?;
        let created_unix_ms = d.u64()?;
        let (parent, retired) = if v1 { (None, false) } else { Self::decode_links(&mut d)? };
        let tokens = StreamRoot::decode(&mut d)?;
        let n = d.count(2 * 20)?;
        if n != shape.files() {
            return Err(BlockFault::Malformed(format!("{n} vector files, shape says {}", shape.files())));
        }
        let files = (0..n)
            .map(|_| Ok(FileRoots { index: StreamRoot::decode(&mut d)?, data: StreamRoot::decode(&mut d)? }))
            .collect::<Result<_, BlockFault>>()?;
        d.finish()?;
        Ok(ContextRecord { id, name, shape, created_unix_ms, parent, retired, tokens, files })
    }

    fn decode_links(d: &mut Dec<'_>) -> Result<(Option<ParentLink>, bool), BlockFault> {
        let flags = d.u32()?;
        if flags & !FLAG_RETIRED != 0 {
            // An unknown flag could change what the record means; guessing is worse than refusing.
            return Err(BlockFault::Malformed(format!("context record: unknown flags {flags:#x}")));
        }
        let (id, prefix_tokens) = (d.u32()?, d.u64()?);
        let parent = match (id, prefix_tokens) {
            (0, 0) => None,
            (0, n) => return Err(BlockFault::Malformed(format!("context record: {n} prefix tokens but no parent"))),
            (id, prefix_tokens) => Some(ParentLink { id, prefix_tokens }),
        };
        Ok((parent, flags & FLAG_RETIRED != 0))
    }

    /// Tokens of this context's own token stream.
    pub fn own_token_count(&self) -> u64 {
        self.tokens.bytes / 4
    }

    /// Length of the whole token sequence: the parent's prefix, then the own tokens.
    pub fn token_count(&self) -> u64 {
        self.parent.map_or(0, |p| p.prefix_tokens).saturating_add(self.own_token_count())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatalogEntry {
    pub id: u32,
    pub name: String,
    pub record: BlockRef,
}

pub fn encode_catalog(entries: &[CatalogEntry]) -> Vec<u8> {
    let mut e = Enc::default();
    e.bytes(CATALOG_MAGIC).u32(entries.len() as u32);
    for c in entries {
        e.u32(c.id).str(&c.name);
        c.record.encode(&mut e);
    }
    e.0
}

pub fn decode_catalog(blob: &[u8]) -> Result<Vec<CatalogEntry>, BlockFault> {
    let mut d = Dec::new(blob, "catalog");
    d.expect_magic(CATALOG_MAGIC)?;
    let n = d.count(4 + 2 + REF_LEN)?;
    let entries = (0..n)
        .map(|_| Ok(CatalogEntry { id: d.u32()?, name: d.str()?, record: BlockRef::decode(&mut d)? }))
        .collect::<Result<Vec<_>, BlockFault>>()?;
    d.finish()?;
    Ok(entries)
}

/// The allocator directory: the bitmap chunk blocks, in order.
pub fn encode_alloc_dir(total_blocks: u64, chunks: &[BlockRef]) -> Vec<u8> {
    let mut e = Enc::default();
    e.bytes(ALLOC_MAGIC).u64(total_blocks).u32(chunks.len() as u32);
    for c in chunks {
        c.encode(&mut e);
    }
    e.0
}

pub fn decode_alloc_dir(blob: &[u8]) -> Result<(u64, Vec<BlockRef>), BlockFault> {
    let mut d = Dec::new(blob, "allocator directory");
    d.expect_magic(ALLOC_MAGIC)?;
    let total = d.u64()?;
    let n = d.count(REF_LEN)?;
    let chunks = (0..n).map(|_| BlockRef::decode(&mut d)).collect::<Result<_, _>>()?;
    d.finish()?;
    Ok((total, chunks))
}

/// Bits of allocator bitmap one chunk block holds.
pub fn bits_per_chunk(block_size: usize) -> u64 {
    ((block_size - HEADER_LEN) * 8) as u64
}

/// A run of consecutive device blocks holding consecutive logical blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Run {
    pub start: u64,
    pub len: u32,
}

/// One extent block: the device location and CRC of logical blocks
/// `first_logical .. first_logical + crcs.len()` of a stream.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExtentBlock {
    pub first_logical: u64,
    pub runs: Vec<Run>,
    pub crcs: Vec<u32>,
}

pub const EXTENT_FIXED: usize = 16;
pub const RUN_LEN: usize = 16;

impl ExtentBlock {
    pub fn encoded_len(runs: usize, entries: usize) -> usize {
        EXTENT_FIXED + runs * RUN_LEN + entries * 4
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u64(self.first_logical).u32(self.crcs.len() as u32).u32(self.runs.len() as u32);
        for r in &self.runs {
            e.u64(r.start).u32(r.len).u32(0);
        }
        for c in &self.crcs {
            e.u32(*c);
        }
        e.0
    }

    pub fn decode(payload: &[u8], total_blocks: u64) -> Result<Self, BlockFault> {
        let mut d = Dec::new(payload, "extent block");
        let first_logical = d.u64()?;
        let entries = d.u32()? as usize;
        let nruns = d.u32()? as usize;
        if Self::encoded_len(nruns, entries) != payload.len() {
            return Err(BlockFault::Malformed(format!(
                "{nruns} runs and {entries} entries do not fill {} bytes",
                payload.len()
            )));
        }
        let mut runs = Vec::with_capacity(nruns);
        let mut covered = 0u64;
        for _ in 0..nruns {
            let run = Run { start: d.u64()?, len: d.u32()? };
            let _reserved = d.u32()?;
            if run.len == 0
                || run.start.checked_add(run.len as u64).is_none_or(|end| end > total_blocks)
                || run.start < 2
            {
                return Err(BlockFault::Malformed(format!("run {}+{} lies outside the device", run.start, run.len)));
            }
            covered += run.len as u64;
            runs.push(run);
        }
        if covered != entries as u64 {
            return Err(BlockFault::Malformed(format!("runs cover {covered} blocks, {entries} entries")));
        }
        let crcs = (0..entries).map(|_| d.u32()).collect::<Result<_, _>>()?;
        Ok(ExtentBlock { first_logical, runs, crcs })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(parent: Option<ParentLink>, retired: bool) -> ContextRecord {
        let shape = ModelShape { layers: 1, q_heads: 2, kv_heads: 1, head_dim: 8, dtype: DType::Bf16 };
        let root = StreamRoot { blocks: 1, bytes: 12, extents: vec![BlockRef { block: 9, crc: 7 }] };
        ContextRecord {
            id: 3,
            name: "child".into(),
            shape,
            created_unix_ms: 5,
            parent,
            retired,
            tokens: root.clone(),
            files: vec![FileRoots { index: root.clone(), data: StreamRoot::default() }],
        }
    }

    #[test]
    fn parent_links_and_retirement_round_trip() {
        for (parent, retired) in [(None, false), (Some(ParentLink { id: 1, prefix_tokens: 40 }), true)] {
            let r = record(parent, retired);
            assert_eq!(&r.encode()[..4], b"CCX2");
            assert_eq!(ContextRecord::decode(&r.encode()).unwrap(), r);
        }
        let r = record(Some(ParentLink { id: 1, prefix_tokens: 40 }), false);
        assert_eq!((r.own_token_count(), r.token_count()), (3, 43));
    }

    #[test]
    fn unknown_flags_and_a_prefix_without_parent_are_refused() {
        let blob = record(None, false).encode();
        // The flags follow magic 4, id 4, name 2 + 5, shape 12 and created_unix_ms 8.
        let flags = 4 + 4 + 2 + 5 + 12 + 8;
        let mut bad = blob.clone();
        bad[flags] = 2;
        assert!(ContextRecord::decode(&bad).unwrap_err().to_string().contains("unknown flags"));
        let mut bad = blob;
        bad[flags + 8] = 1;
        assert!(ContextRecord::decode(&bad).unwrap_err().to_string().contains("no parent"));
    }
}
