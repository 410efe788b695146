//! How an index lives in a vector file, and searching it directly on buffered pages.
//!
//! Index stream (layout version 1, see docs/format.md "Index and data streams"):
//! * logical block 0: the meta block;
//! * then the adjacency blocks: fixed-size records of `degree` u32 node ids (unused slots
//!   hold `u32::MAX`), `records_per_block` per block, node `i` in block `1 + i / records`;
//! * then the key blocks: `rows_per_block` key rows of `dim` 2-byte elements per block.
//!
//! Data stream: value rows, `rows_per_block` per block, token `t` in block `t / rows`.

use crate::mem::{MemGraph, MemKeys};
use crate::source::{Graph, Keys, SourceResult};
use crate::stats::SearchStats;
use ctxfs_buffer::{BlockRequest, BufferError, BufferPool, PageGuard};
use half::f16;

pub const LAYOUT_VERSION: u32 = 1;
const META_MAGIC: &[u8; 4] = b"CXIX";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub tokens: u32,
    pub dim: u32,
    pub degree: u32,
    pub entry: u32,
    pub records_per_block: u32,
    pub rows_per_block: u32,
}

impl Layout {
    pub fn new(tokens: u32, dim: u32, degree: u32, entry: u32, payload: usize) -> Layout {
        Layout {
            tokens,
            dim,
            degree,
            entry,
            records_per_block: (payload / (degree as usize * 4)).max(1) as u32,
            rows_per_block: (payload / (dim as usize * 2)).max(1) as u32,
        }
    }
    pub fn adjacency_blocks(&self) -> u32 {
        self.tokens.div_ceil(self.records_per_block)
    }
    pub fn key_blocks(&self) -> u32 {
        self.tokens.div_ceil(self.rows_per_block)
    }
    /// Blocks of the index stream: meta, adjacency, keys.
    pub fn index_blocks(&self) -> u32 {
        1 + self.adjacency_blocks() + self.key_blocks()
    }
    pub fn encode(&self) -> Vec<u8> {
        let mut out = META_MAGIC.to_vec();
        for v in [
            LAYOUT_VERSION,
            self.tokens,
            self.dim,
            self.degree,
            self.entry,
            self.records_per_block,
            self.rows_per_block,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }
    pub fn decode(b: &[u8]) -> Result<Layout, String> {
        if b.len() < 32 || &b[..4] != META_MAGIC {
            return Err("index meta block: bad magic or length".into());
        }
        let f = |i: usize| u32::from_le_bytes(b[4 + 4 * i..8 + 4 * i].try_into().expect("4 bytes"));
        if f(0) != LAYOUT_VERSION {
            return Err(format!("index layout version {} (this build reads {LAYOUT_VERSION})", f(0)));
        }
        let l = Layout {
            tokens: f(1),
            dim: f(2),
            degree: f(3),
            entry: f(4),
            records_per_block: f(5),
            rows_per_block: f(6),
        };
        if l.dim == 0
            || l.degree == 0
            || l.records_per_block == 0
            || l.rows_per_block == 0
            || (l.tokens > 0 && l.entry >= l.tokens)
        {
            return Err(format!("index meta block: inconsistent layout {l:?}"));
        }
        Ok(l)
    }
}

/// The payloads of an index stream, in logical order.
pub fn index_payloads(keys: &MemKeys, graph: &MemGraph, payload: usize) -> (Layout, Vec<Vec<u8>>) {
    let layout = Layout::new(keys.len(), keys.dim() as u32, graph.degree as u32, graph.entry, payload);
    let mut blocks = vec![layout.encode()];
    let rec = graph.degree;
    for chunk in graph.adjacency.chunks(rec * layout.records_per_block as usize) {
        blocks.push(chunk.iter().flat_map(|x| x.to_le_bytes()).collect());
    }
    blocks.extend(row_payloads(keys.data(), keys.dim(), payload));
    (layout, blocks)
}

/// Rows packed whole into block payloads (the data stream's values, or keys).
pub fn row_payloads(rows: &[f16], dim: usize, payload: usize) -> Vec<Vec<u8>> {
    let per = (payload / (dim * 2)).max(1);
    rows.chunks(per * dim).map(|c| bytemuck::cast_slice::<f16, u8>(c).to_vec()).collect()
}

/// An index searched through the buffer pool: adjacency and key blocks are read on demand
/// (and stay resident in the pool's index area); nothing is copied into another structure.
pub struct PagedIndex<'p> {
    pool: &'p BufferPool,
    layout: Layout,
    /// Where each logical block of the index stream is.
    blocks: &'p [BlockRequest],
}

fn wrap(e: BufferError) -> String {
    e.to_string()
}

impl<'p> PagedIndex<'p> {
    /// Opens an index stream given the location of each of its logical blocks.
    pub fn open(pool: &'p BufferPool, blocks: &'p [BlockRequest]) -> Result<PagedIndex<'p>, String> {
        let meta = pool.get(blocks.first().ok_or("empty index stream")?).map_err(wrap)?;
        let layout = Layout::decode(meta.payload())?;
        drop(meta);
        // Coarse indexes (quest, infllm, pq runs) may follow the graph index in the stream.
        if blocks.len() < layout.index_blocks() as usize {
            return Err(format!(
                "index stream has {} blocks, its layout needs {}",
                blocks.len(),
                layout.index_blocks()
            ));
        }
        Ok(PagedIndex { pool, layout, blocks: &blocks[..layout.index_blocks() as usize] })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The key rows of `ids`, in their order (the window cache's keys).
    pub fn gather_keys(&self, ids: &[u32]) -> Result<(Vec<f16>, BatchIo), BufferError> {
        let first = 1 + self.layout.adjacency_blocks() as usize;
        gather_rows(self.pool, &self.blocks[first..], self.layout.rows_per_block, self.layout.dim as usize, ids)
    }

    /// Pins the key blocks holding `ids` (one batch) and calls `f` with each key's row.
    fn with_rows(&self, ids: &[u32], stats: &mut SearchStats, f: impl FnMut(usize, &[f16])) -> SourceResult {
        let first = 1 + self.layout.adjacency_blocks() as usize;
        let io =
            for_rows(self.pool, &self.blocks[first..], self.layout.rows_per_block, self.layout.dim as usize, ids, f)?;
        io.add_to(stats);
        Ok(())
    }
}

impl Keys for PagedIndex<'_> {
    fn dim(&self) -> usize {
        self.layout.dim as usize
    }
    fn len(&self) -> u32 {
        self.layout.tokens
    }
    fn score(&self, ids: &[u32], q: &[f32], out: &mut [f32], stats: &mut SearchStats) -> SourceResult {
        self.with_rows(ids, stats, |i, row| out[i] = ctxfs_kernels::dot(row, q))?;
        stats.keys_scored += ids.len() as u64;
        Ok(())
    }
}

impl Graph for PagedIndex<'_> {
    fn neighbors(&self, node: u32, out: &mut Vec<u32>, stats: &mut SearchStats) -> SourceResult {
        let per = self.layout.records_per_block;
        let g = self.pool.get(&self.blocks[(1 + node / per) as usize])?;
        stats.blocks_touched += 1;
        stats.blocks_read += g.read_here() as u64;
        let deg = self.layout.degree as usize;
        let at = (node % per) as usize * deg;
        out.extend(g.as_u32()[at..at + deg].iter().copied().take_while(|&n| n != u32::MAX));
        Ok(())
    }
    fn entry(&self) -> u32 {
        self.layout.entry
    }
}

/// The blocks one batch pinned, and how many of them it read from the device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchIo {
    pub pinned: usize,
    pub read: usize,
}

impl BatchIo {
    pub fn add_to(self, stats: &mut SearchStats) {
        stats.blocks_touched += self.pinned as u64;
        stats.blocks_read += self.read as u64;
    }
}

/// Pins, in one batch, the blocks of packed rows (`rows_per_block` rows of `dim` elements,
/// row `t` in block `t / rows_per_block` of `blocks`) that hold `ids`, and calls `f` with each
/// id's position and row.
fn for_rows(
    pool: &BufferPool,
    blocks: &[BlockRequest],
    rows_per_block: u32,
    dim: usize,
    ids: &[u32],
    mut f: impl FnMut(usize, &[f16]),
) -> Result<BatchIo, BufferError> {
    let mut wanted: Vec<u32> = ids.iter().map(|&t| t / rows_per_block).collect();
    wanted.sort_unstable();
    wanted.dedup();
    let reqs: Vec<BlockRequest> = wanted.iter().map(|&b| blocks[b as usize]).collect();
    let guards: Vec<PageGuard<'_>> = pool.get_many(&reqs).into_iter().collect::<Result<_, _>>()?;
    for (i, &t) in ids.iter().enumerate() {
        let g = &guards[wanted.binary_search(&(t / rows_per_block)).expect("fetched above")];
        let slot = (t % rows_per_block) as usize;
        f(i, &g.as_f16()[slot * dim..(slot + 1) * dim]);
    }
    Ok(BatchIo { pinned: guards.len(), read: guards.iter().filter(|g| g.read_here()).count() })
}

/// The rows of `ids` from a stream of packed rows (the data stream's values), read through
/// the pool in one batch. Returns them in the order of `ids`, and the batch's I/O.
pub fn gather_rows(
    pool: &BufferPool,
    blocks: &[BlockRequest],
    rows_per_block: u32,
    dim: usize,
    ids: &[u32],
) -> Result<(Vec<f16>, BatchIo), BufferError> {
    let mut out = Vec::with_capacity(ids.len() * dim);
    let io = for_rows(pool, blocks, rows_per_block, dim, ids, |_, row| out.extend_from_slice(row))?;
    Ok((out, io))
}
