//! How an index lives in a vector file, and searching it directly on buffered pages.
//!
//! Index stream (layout version 4, see docs/format.md §19):
//! * logical block 0: the meta block;
//! * then the adjacency blocks: fixed-size records of `degree` u32 node ids (unused slots
//!   hold `u32::MAX`), `records_per_block` per block, node `i` in block `1 + i / records`;
//! * then the key blocks: `rows_per_block` key rows of `dim` 2-byte elements per block;
//! * then the seed table: a copy of the key rows of tokens `0, s, 2s, …` (`s` the seed
//!   stride), packed the same way, so DIPRS scores its seeds in one sequential scan;
//! * then the seed values (layout 4): a copy of the same tokens' value rows, from which
//!   attention estimates the part of the softmax that retrieval leaves out.
//!
//! Data stream: value rows, `rows_per_block` per block, token `t` in block `t / rows`.

use crate::mem::{MemGraph, MemKeys, PREFETCH_AHEAD};
use crate::search::SEED_STRIDE;
use crate::source::{score_strided_rows, Graph, Keys, SourceResult};
use crate::stats::SearchStats;
use ctxfs_buffer::{BlockClass, BlockRequest, Blocks, BufferError, BufferPool, FrameHint, PageGuard, ResidentBlocks};
use ctxfs_vfs::{BlockFault, DType};
use half::{bf16, f16};
use std::cell::RefCell;
use std::sync::Arc;

/// Version 2 added the element type of the key rows (version 1: always f16); version 3 the
/// seed table (versions 1 and 2 are read as having none); version 4 the seed values
/// (versions 1 to 3 are read as having none).
pub const LAYOUT_VERSION: u32 = 4;
const META_MAGIC: &[u8; 4] = b"CXIX";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub tokens: u32,
    pub dim: u32,
    pub degree: u32,
    pub entry: u32,
    pub records_per_block: u32,
    pub rows_per_block: u32,
    /// The element type of the key rows (and of the data stream's value rows).
    pub dtype: DType,
    /// Every how many tokens the seed table holds a key row; 0: no seed table.
    pub seed_stride: u32,
    /// The seed table's tokens' value rows follow it (layout 4).
    pub seed_values: bool,
}

impl Layout {
    pub fn new(tokens: u32, dim: u32, degree: u32, entry: u32, dtype: DType, payload: usize) -> Layout {
        Layout {
            tokens,
            dim,
            degree,
            entry,
            dtype,
            records_per_block: (payload / (degree as usize * 4)).max(1) as u32,
            rows_per_block: (payload / (dim as usize * 2)).max(1) as u32,
            seed_stride: SEED_STRIDE,
            seed_values: true,
        }
    }
    pub fn adjacency_blocks(&self) -> u32 {
        self.tokens.div_ceil(self.records_per_block)
    }
    pub fn key_blocks(&self) -> u32 {
        self.tokens.div_ceil(self.rows_per_block)
    }
    /// Rows of the seed table: tokens `0, s, 2s, … < tokens`.
    pub fn seed_rows(&self) -> u32 {
        if self.seed_stride == 0 {
            0
        } else {
            self.tokens.div_ceil(self.seed_stride)
        }
    }
    /// The stride a search takes this index's seeds at: its seed table's, so that they are
    /// read in one scan of it (an index written with another stride than [`SEED_STRIDE`] is
    /// served at its own), or [`SEED_STRIDE`] where it has none.
    pub fn search_stride(&self) -> u32 {
        if self.seed_stride == 0 {
            SEED_STRIDE
        } else {
            self.seed_stride
        }
    }
    pub fn seed_blocks(&self) -> u32 {
        self.seed_rows().div_ceil(self.rows_per_block)
    }
    pub fn seed_value_blocks(&self) -> u32 {
        if self.seed_values {
            self.seed_blocks()
        } else {
            0
        }
    }
    /// The first logical block of the seed table.
    fn first_seed_block(&self) -> u32 {
        1 + self.adjacency_blocks() + self.key_blocks()
    }
    /// Blocks of the index stream: meta, adjacency, keys, seeds, seed values.
    pub fn index_blocks(&self) -> u32 {
        self.first_seed_block() + self.seed_blocks() + self.seed_value_blocks()
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
            self.dtype as u32,
            self.seed_stride,
        ] {
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }
    pub fn decode(b: &[u8]) -> Result<Layout, String> {
        if b.len() < 32 || &b[..4] != META_MAGIC {
            return Err("bad magic or length".into());
        }
        let f = |i: usize| u32::from_le_bytes(b[4 + 4 * i..8 + 4 * i].try_into().expect("4 bytes"));
        let element = || match f(7) {
            1 => Ok(DType::F16),
            2 => Ok(DType::Bf16),
            code => Err(format!("unknown element type {code}")),
        };
        let (dtype, seed_stride, seed_values) = match f(0) {
            1 => (DType::F16, 0, false),
            2 if b.len() >= 36 => (element()?, 0, false),
            3 if b.len() >= 40 => (element()?, f(8), false),
            4 if b.len() >= 40 => (element()?, f(8), f(8) > 0),
            v => return Err(format!("index layout version {v} (this build reads 1 to {LAYOUT_VERSION})")),
        };
        let l = Layout {
            tokens: f(1),
            dim: f(2),
            degree: f(3),
            entry: f(4),
            records_per_block: f(5),
            rows_per_block: f(6),
            dtype,
            seed_stride,
            seed_values,
        };
        if l.dim == 0
            || l.degree == 0
            || l.records_per_block == 0
            || l.rows_per_block == 0
            || (l.tokens > 0 && l.entry >= l.tokens)
        {
            return Err(format!("inconsistent layout {l:?}"));
        }
        // The stream's block count (computed in u32 by the accessors) must fit a u32.
        let (tokens, seed_rows) = (l.tokens as u64, l.seed_rows() as u64);
        let blocks = 1
            + tokens.div_ceil(l.records_per_block as u64)
            + tokens.div_ceil(l.rows_per_block as u64)
            + (1 + l.seed_values as u64) * seed_rows.div_ceil(l.rows_per_block as u64);
        if blocks > u32::MAX as u64 {
            return Err(format!("a layout of {blocks} blocks {l:?}"));
        }
        Ok(l)
    }

    /// Checks that an adjacency record and a key row fit a block payload of `payload` bytes
    /// as many times as the layout packs them into one, so that no record or row offset the
    /// meta block implies lies beyond a block (or overflows).
    pub fn check_fits(&self, payload: usize) -> Result<(), String> {
        let record = (self.records_per_block as u64 * self.degree as u64).saturating_mul(4);
        let rows = (self.rows_per_block as u64 * self.dim as u64).saturating_mul(2);
        if record > payload as u64 || rows > payload as u64 {
            return Err(format!(
                "{} records of degree {} or {} rows of dimension {} do not fit a block payload of {payload} bytes",
                self.records_per_block, self.degree, self.rows_per_block, self.dim
            ));
        }
        Ok(())
    }
}

/// Rows of 2-byte elements, as stored: keys in the index stream, values in the data stream.
#[derive(Debug, Clone, Copy)]
pub enum Rows<'a> {
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

impl Rows<'_> {
    pub fn dtype(&self) -> DType {
        match self {
            Rows::F16(_) => DType::F16,
            Rows::Bf16(_) => DType::Bf16,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Rows::F16(r) => r.len(),
            Rows::Bf16(r) => r.len(),
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `q · row`, through the SIMD kernels.
    pub fn dot(&self, q: &[f32]) -> f32 {
        match self {
            Rows::F16(r) => ctxfs_kernels::dot(r, q),
            Rows::Bf16(r) => ctxfs_kernels::dot(r, q),
        }
    }
    /// [`Rows::scores`] on the kernels of `isa`.
    pub fn scores_on(&self, isa: ctxfs_kernels::Isa, q: &[f32], out: &mut [f32]) {
        match self {
            Rows::F16(r) => ctxfs_kernels::scores_on(isa, r, q, 1.0, out),
            Rows::Bf16(r) => ctxfs_kernels::scores_on(isa, r, q, 1.0, out),
        }
    }
    /// `out[i] = q · row i` for each row, in one kernel call (each score `dot`'s to the bit).
    pub fn scores(&self, q: &[f32], out: &mut [f32]) {
        match self {
            Rows::F16(r) => ctxfs_kernels::scores(r, q, 1.0, out),
            Rows::Bf16(r) => ctxfs_kernels::scores(r, q, 1.0, out),
        }
    }
    /// Starts loading the row into the CPU caches (see [`ctxfs_kernels::prefetch`]).
    fn prefetch(&self) {
        match self {
            Rows::F16(r) => ctxfs_kernels::prefetch(r),
            Rows::Bf16(r) => ctxfs_kernels::prefetch(r),
        }
    }
    /// `acc += Σ weights[i] · row i`, one kernel call for the rows.
    pub fn accumulate_rows(&self, acc: &mut [f32], weights: &[f32]) {
        match self {
            Rows::F16(r) => ctxfs_kernels::weighted_sum(acc, weights, r),
            Rows::Bf16(r) => ctxfs_kernels::weighted_sum(acc, weights, r),
        }
    }
    fn extend_f32(&self, out: &mut Vec<f32>) {
        match self {
            Rows::F16(r) => out.extend(r.iter().map(|x| x.to_f32())),
            Rows::Bf16(r) => out.extend(r.iter().map(|x| x.to_f32())),
        }
    }
    pub fn bytes(&self) -> &[u8] {
        match self {
            Rows::F16(r) => bytemuck::cast_slice(r),
            Rows::Bf16(r) => bytemuck::cast_slice(r),
        }
    }
    /// Rows `from .. to` of a block payload of packed rows of `dim` elements of `dtype`, or
    /// why the payload does not hold them (a block shorter than its layout says).
    fn of(dtype: DType, payload: &[u8], from: usize, to: usize, dim: usize) -> Result<Rows<'_>, String> {
        let Some(bytes) = payload.get(from * dim * 2..to * dim * 2) else {
            return Err(format!(
                "a block of {} payload bytes lacks rows {from}..{to} of dimension {dim}",
                payload.len()
            ));
        };
        Ok(match dtype {
            DType::F16 => Rows::F16(bytemuck::cast_slice(bytes)),
            DType::Bf16 => Rows::Bf16(bytemuck::cast_slice(bytes)),
        })
    }
}

/// The payloads of an index stream for f16 keys and values, in logical order.
pub fn index_payloads(keys: &MemKeys, values: &[f16], graph: &MemGraph, payload: usize) -> (Layout, Vec<Vec<u8>>) {
    index_payloads_of(Rows::F16(keys.data()), Rows::F16(values), keys.dim(), graph, payload)
}

/// The payloads of an index stream whose key rows are `keys` and whose tokens' values are
/// `values` (the graph may have been built on a rescaled copy of the keys: inner-product
/// order does not change with a positive scale).
pub fn index_payloads_of(
    keys: Rows<'_>,
    values: Rows<'_>,
    dim: usize,
    graph: &MemGraph,
    payload: usize,
) -> (Layout, Vec<Vec<u8>>) {
    assert_eq!(keys.len(), values.len(), "as many values as keys");
    assert_eq!(keys.dtype(), values.dtype(), "keys and values of one element type");
    let tokens = (keys.len() / dim.max(1)) as u32;
    let layout = Layout::new(tokens, dim as u32, graph.degree as u32, graph.entry, keys.dtype(), payload);
    let mut blocks = vec![layout.encode()];
    let rec = graph.degree;
    for chunk in graph.adjacency.chunks(rec * layout.records_per_block as usize) {
        blocks.push(chunk.iter().flat_map(|x| x.to_le_bytes()).collect());
    }
    blocks.extend(row_payloads(keys, dim, payload));
    let row_bytes = 2 * dim;
    for rows in [keys, values] {
        let seeds: Vec<u8> =
            rows.bytes().chunks(row_bytes).step_by(layout.seed_stride as usize).flatten().copied().collect();
        blocks.extend(packed(&seeds, row_bytes, payload));
    }
    debug_assert_eq!(blocks.len(), layout.index_blocks() as usize);
    (layout, blocks)
}

/// Rows packed whole into block payloads (the data stream's values, or keys).
pub fn row_payloads(rows: Rows<'_>, dim: usize, payload: usize) -> Vec<Vec<u8>> {
    packed(rows.bytes(), 2 * dim, payload)
}

/// Rows of `row_bytes` each, as many whole rows per payload as fit.
fn packed(bytes: &[u8], row_bytes: usize, payload: usize) -> Vec<Vec<u8>> {
    let per = (payload / row_bytes).max(1);
    bytes.chunks(per * row_bytes).map(<[u8]>::to_vec).collect()
}

/// An index searched through the buffer pool: adjacency and key blocks are read on demand
/// (and stay in the pool's index area); nothing is copied into another structure. A served
/// context's blocks are held resident ([`with_resident`](Self::with_resident)) and read
/// without pins.
pub struct PagedIndex<'p> {
    pool: &'p BufferPool,
    layout: Layout,
    /// Where each logical block of the index stream is.
    blocks: Blocks<'p>,
    /// Per logical block, the frame it was last found in (shared by every search of it).
    hints: &'p [FrameHint],
    /// The stream's blocks, held resident, in logical order.
    resident: Option<&'p ResidentBlocks>,
    /// Where each value block of the file's data stream is, when its reads may ride along
    /// with the key blocks' ([`with_values`](Self::with_values)).
    values: Blocks<'p>,
    pins: RefCell<Pins<'p>>,
}

/// Most key blocks a [`PagedIndex`] whose blocks are not resident pins for one batch beyond
/// its pin cache: a range-phase batch scores up to 8 neighbour lists, a flat scan a whole
/// prefix, and the index area may be mostly held resident by other files.
const PIN_BATCH: usize = 64;

/// Share of the pool's index area one [`PagedIndex`] may keep pinned: with 2 threads per
/// session, 8 concurrent sessions hold at most half of it.
const PIN_SHARE: usize = 32;

/// Index blocks a [`PagedIndex`] keeps pinned while it lives. Its searches touch the same
/// blocks again and again (a block holds 20 adjacency records or 15 key rows, and a range is
/// runs of neighbouring tokens; one index serves a GQA group's 4 searches), and the index
/// area keeps them resident anyway: a block already pinned here costs a vector index, not a
/// page-table lookup and two latches. At most `cap` are kept; past that, blocks are pinned
/// for one batch, as without the cache.
struct Pins<'p> {
    /// Per logical block of the index stream: 1 + its position in `guards`, or 0.
    slot: Vec<u32>,
    guards: Vec<PageGuard<'p>>,
    cap: usize,
}

impl<'p> Pins<'p> {
    fn get(&self, block: u32) -> Option<&PageGuard<'p>> {
        match self.slot[block as usize] {
            0 => None,
            at => Some(&self.guards[at as usize - 1]),
        }
    }

    /// Pins the blocks of `wanted` (logical, sorted, distinct) not pinned yet, as one batch;
    /// those beyond the cap come back in the returned vector (sorted, with their blocks)
    /// instead of staying pinned.
    fn pin(
        &mut self,
        pool: &'p BufferPool,
        (blocks, hints): (Blocks<'_>, &[FrameHint]),
        wanted: &[u32],
        stats: &mut SearchStats,
    ) -> Result<Vec<(u32, PageGuard<'p>)>, BufferError> {
        stats.blocks_touched += wanted.len() as u64;
        let mut spill = Vec::new();
        let mut missing = Vec::new();
        for &b in wanted {
            if self.slot[b as usize] != 0 {
                continue;
            }
            match pool.get_at_hint(&blocks.at(b as usize), &hints[b as usize]) {
                Some(g) => self.keep(b, g, &mut spill),
                None => missing.push(b),
            }
        }
        if missing.is_empty() {
            return Ok(spill);
        }
        let reqs: Vec<BlockRequest> = missing.iter().map(|&b| blocks.at(b as usize)).collect();
        for (b, g) in missing.into_iter().zip(pool.get_many(&reqs)) {
            let g = g?;
            stats.blocks_read += u64::from(g.read_here());
            hints[b as usize].remember(&g);
            self.keep(b, g, &mut spill);
        }
        spill.sort_unstable_by_key(|s| s.0);
        Ok(spill)
    }

    /// Keeps `g` pinned, or, past the cap, hands it to `spill` for one batch.
    fn keep(&mut self, b: u32, g: PageGuard<'p>, spill: &mut Vec<(u32, PageGuard<'p>)>) {
        if self.guards.len() < self.cap {
            self.guards.push(g);
            self.slot[b as usize] = self.guards.len() as u32;
        } else {
            spill.push((b, g));
        }
    }
}

fn wrap(e: BufferError) -> String {
    e.to_string()
}

/// A block whose contents contradict the index's meta block, as a storage error naming it.
fn malformed(req: &BlockRequest, why: String) -> BufferError {
    BufferError::Block(Arc::new(ctxfs_vfs::Error::mismatch(req.block, &req.expect, BlockFault::Malformed(why))))
}

/// A request the index cannot answer (a token beyond it), as an error rather than a panic.
fn invalid(why: String) -> BufferError {
    BufferError::Block(Arc::new(ctxfs_vfs::Error::InvalidArgument(why)))
}

/// A block the closure of [`PagedIndex::with_blocks`] found malformed: its logical block in
/// the stream (or the position of its request), and why.
type Bad = (u32, String);

impl<'p> PagedIndex<'p> {
    /// Opens an index stream given the location of each of its logical blocks and a frame
    /// hint for each (kept by the caller across opens: see [`FrameHint`]).
    pub fn open(
        pool: &'p BufferPool,
        blocks: impl Into<Blocks<'p>>,
        hints: &'p [FrameHint],
    ) -> Result<PagedIndex<'p>, String> {
        let blocks = blocks.into();
        if hints.len() < blocks.len() {
            return Err(format!("{} frame hints for {} index blocks", hints.len(), blocks.len()));
        }
        let first = blocks.first().ok_or("empty index stream")?;
        let meta = pool.get(&first).map_err(wrap)?;
        let bad_meta = |e: String| format!("index meta block {}: {e}", first.block);
        let layout = Layout::decode(meta.payload()).map_err(bad_meta)?;
        drop(meta);
        layout.check_fits(ctxfs_vfs::max_payload(pool.block_size())).map_err(bad_meta)?;
        // Coarse indexes (quest, infllm, pq runs) may follow the graph index in the stream.
        if blocks.len() < layout.index_blocks() as usize {
            return Err(format!(
                "index stream has {} blocks, its layout needs {}",
                blocks.len(),
                layout.index_blocks()
            ));
        }
        let blocks = blocks.range(0..layout.index_blocks() as usize);
        let cap = pool.pinnable(BlockClass::Index) / PIN_SHARE;
        let pins = Pins { slot: vec![0; blocks.len()], guards: Vec::new(), cap };
        Ok(PagedIndex {
            pool,
            layout,
            blocks,
            hints: &hints[..blocks.len()],
            resident: None,
            values: Blocks::Listed(&[]),
            pins: RefCell::new(pins),
        })
    }

    /// Reads the index from `resident`, the stream's blocks held resident in logical order
    /// (at least the index's), instead of pinning them.
    pub fn with_resident(mut self, resident: &'p ResidentBlocks) -> Result<PagedIndex<'p>, String> {
        if resident.len() < self.blocks.len() {
            return Err(format!("{} resident blocks for an index of {}", resident.len(), self.blocks.len()));
        }
        self.resident = Some(resident);
        Ok(self)
    }

    /// Reads value block `j` (of `values`, the file's data stream in logical order) with key
    /// block `j` when the pool lacks both and they lie side by side on the device: the read
    /// of two adjacent blocks costs about one (a disk's random reads are bound by their
    /// count, not their bytes), and a candidate whose key is read is mostly one whose value
    /// is read next.
    pub fn with_values(mut self, values: impl Into<Blocks<'p>>) -> PagedIndex<'p> {
        self.values = values.into();
        self
    }

    /// Calls `f` with a lookup from logical block to payload for the blocks `wanted()`
    /// (logical, sorted, distinct, below the stream's length), pinning them first unless the
    /// index is resident. An `Err((block, why))` from `f` (a malformed block) comes back as an
    /// error naming that block.
    fn with_blocks<R>(
        &self,
        wanted: impl FnOnce() -> Vec<u32>,
        stats: &mut SearchStats,
        f: impl for<'a> FnOnce(&'a dyn Fn(u32) -> &'a [u8]) -> Result<R, Bad>,
    ) -> Result<R, BufferError> {
        let named = |(b, why): Bad| malformed(&self.blocks.at(b as usize), format!("index block {b}: {why}"));
        if let Some(resident) = self.resident {
            return f(&|b| resident.payload(b as usize)).map_err(named);
        }
        let mut pins = self.pins.borrow_mut();
        let spill = pins.pin(self.pool, (self.blocks, self.hints), &wanted(), stats)?;
        let pins = &*pins;
        let spill = &spill;
        f(&|b| {
            pins.get(b)
                .unwrap_or_else(|| &spill[spill.binary_search_by_key(&b, |s| s.0).expect("pinned above")].1)
                .payload()
        })
        .map_err(named)
    }

    /// Refuses token ids beyond the index (a caller's, or another index's that disagrees).
    fn check_ids(&self, ids: &[u32]) -> Result<(), BufferError> {
        match ids.iter().find(|&&t| t >= self.layout.tokens) {
            Some(t) => Err(invalid(format!("token {t} of an index of {} tokens", self.layout.tokens))),
            None => Ok(()),
        }
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The key rows of `ids`, in their order and stored type (a session's window's keys).
    pub fn gather_keys(&self, ids: &[u32]) -> Result<(StoredRows, BatchIo), BufferError> {
        self.check_ids(ids)?;
        let first = 1 + self.layout.adjacency_blocks() as usize;
        gather_rows(self.pool, self.blocks.skip(first), &self.layout, ids)
    }

    /// Where `node`'s adjacency record is: its logical block, and its bytes in the payload.
    fn record_of(&self, node: u32) -> (u32, std::ops::Range<usize>) {
        let (per, bytes) = (self.layout.records_per_block, self.layout.degree as usize * 4);
        let at = (node % per) as usize * bytes;
        (1 + node / per, at..at + bytes)
    }

    /// For each query `i`, adds `Σ weights[i][j] · value(token j · seed_stride)` into
    /// `accs[i]`, from the seed values (`weights[i]`: one per seed row). Each block is read
    /// once for all the queries (a GQA group's), and skipped where all their weights are 0.
    /// `None` when the stream has no seed values (layouts 1 to 3).
    pub fn sum_seed_values(
        &self,
        weights: &[&[f32]],
        accs: &mut [&mut [f32]],
        stats: &mut SearchStats,
    ) -> Option<SourceResult> {
        let l = &self.layout;
        if !l.seed_values {
            return None;
        }
        assert!(
            weights.len() == accs.len() && weights.iter().all(|w| w.len() == l.seed_rows() as usize),
            "one weight per seed row, one accumulator per query"
        );
        let (rows, dim) = (l.rows_per_block as usize, l.dim as usize);
        let first = l.first_seed_block() + l.seed_blocks();
        let span = |from: usize| from..(from + rows).min(l.seed_rows() as usize);
        let wanted: Vec<(u32, usize)> = (0..l.seed_blocks())
            .map(|i| (i, i as usize * rows))
            .filter(|&(_, from)| weights.iter().any(|w| w[span(from)].iter().any(|&x| x != 0.0)))
            .collect();
        // At most PIN_BATCH blocks pinned at a time, as a scan.
        Some(wanted.chunks(PIN_BATCH).try_for_each(|chunk| {
            self.with_blocks(
                || chunk.iter().map(|&(i, _)| first + i).collect(),
                stats,
                |block| {
                    for &(i, from) in chunk {
                        let b = first + i;
                        let values = Rows::of(l.dtype, block(b), 0, span(from).len(), dim).map_err(|e| (b, e))?;
                        for (w, acc) in weights.iter().zip(accs.iter_mut()) {
                            values.accumulate_rows(acc, &w[span(from)]);
                        }
                    }
                    Ok(())
                },
            )
        }))
    }

    /// The spread of the seed values ([`crate::target::ValueSpread`]). A tail estimate that
    /// rests on few seeds errs by about this over their effective number
    /// ([`crate::target::estimate`]). `None` when the stream has no seed values.
    pub fn seed_value_spread(&self, stats: &mut SearchStats) -> Option<Result<f64, BufferError>> {
        let l = &self.layout;
        if !l.seed_values || l.seed_rows() == 0 {
            return None;
        }
        let (rows, dim, n) = (l.rows_per_block as usize, l.dim as usize, l.seed_rows() as usize);
        let first = l.first_seed_block() + l.seed_blocks();
        let (mut spread, mut row) = (crate::target::ValueSpread::new(dim), Vec::with_capacity(dim * rows));
        let blocks: Vec<u32> = (0..l.seed_blocks()).collect();
        let read = blocks.chunks(PIN_BATCH).try_for_each(|chunk| {
            self.with_blocks(
                || chunk.iter().map(|&i| first + i).collect(),
                stats,
                |block| {
                    for &i in chunk {
                        let b = first + i;
                        let len = (n - i as usize * rows).min(rows);
                        row.clear();
                        Rows::of(l.dtype, block(b), 0, len, dim).map_err(|e| (b, e))?.extend_f32(&mut row);
                        row.chunks_exact(dim).for_each(|v| spread.add(v));
                    }
                    Ok(())
                },
            )
        });
        Some(read.map(|()| spread.spread()))
    }

    /// Reads the key blocks (logical blocks from `first`) that hold `ids` and that the pool
    /// lacks, in one submission, so that rows pinned batch by batch next do not wait for one
    /// batch's reads before the next's are asked for (a thousand candidates' key blocks: one
    /// round trip to the device, not sixteen), each with the value block beside it
    /// ([`with_values`](Self::with_values)). Not when the blocks would take more than a
    /// sixteenth of the index area (the values: of the data area).
    fn read_ahead(&self, ids: &[u32], first: u32, stats: &mut SearchStats) {
        let wanted = blocks_holding(&self.layout, ids, first);
        if wanted.len() <= self.pool.frames(BlockClass::Index) / 16 {
            let mut reqs: Vec<BlockRequest> = wanted.iter().map(|&b| self.blocks.at(b as usize)).collect();
            if wanted.len() <= self.pool.frames(BlockClass::Data) / 16 {
                let values: Vec<BlockRequest> =
                    wanted.iter().zip(&reqs).filter_map(|(&b, key)| self.value_beside(key, b - first)).collect();
                reqs.extend(values);
            }
            stats.blocks_read += self.pool.prefetch(&reqs).len() as u64;
        }
    }

    /// Value block `j`, the one beside key block `key` (its request), when it lies right
    /// after it on the device and the pool holds neither.
    fn value_beside(&self, key: &BlockRequest, j: u32) -> Option<BlockRequest> {
        let value = self.values.get(j as usize)?;
        (value.block == key.block + 1 && !self.pool.will_use(key.block) && !self.pool.will_use(value.block))
            .then_some(value)
    }

    /// Pins the key blocks holding `ids` (one batch) and calls `f` with each run of ids that
    /// are consecutive rows of one block: the run's first position in `ids` and its rows.
    /// Pins at most [`PIN_BATCH`] ids' blocks at a time (none when resident).
    fn with_row_runs(&self, ids: &[u32], stats: &mut SearchStats, mut f: impl FnMut(usize, Rows<'_>)) -> SourceResult {
        self.check_ids(ids)?;
        let first = 1 + self.layout.adjacency_blocks();
        let rows = self.layout.rows_per_block;
        let batch = if self.resident.is_some() { ids.len().max(1) } else { PIN_BATCH };
        if ids.len() > batch {
            self.read_ahead(ids, first, stats);
        }
        for (c, ids) in ids.chunks(batch).enumerate() {
            let wanted = || blocks_holding(&self.layout, ids, first);
            self.with_blocks(wanted, stats, |block| {
                visit_row_runs(&self.layout, ids, |t| block(first + t / rows), |i, run| f(c * batch + i, run))
                    .map_err(|(t, why)| (first + t / rows, why))
            })?;
        }
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
        self.with_row_runs(ids, stats, |i, run| {
            let n = run.len() / q.len();
            run.scores(q, &mut out[i..i + n])
        })?;
        stats.keys_scored += ids.len() as u64;
        Ok(())
    }
    /// Scores each key block's rows in one streaming kernel call (a flat scan's path).
    fn score_range(&self, first: u32, q: &[f32], out: &mut [f32], stats: &mut SearchStats) -> SourceResult {
        let len = out.len();
        let (keys, tokens) = (1 + self.layout.adjacency_blocks(), self.layout.tokens);
        self.scan_rows((keys, tokens), first, q, Strided { out, stride: len, len }, stats)
    }
    fn score_range_many(
        &self,
        first: u32,
        queries: &[f32],
        out: &mut [f32],
        stride: usize,
        len: usize,
        stats: &mut SearchStats,
    ) -> SourceResult {
        let (keys, tokens) = (1 + self.layout.adjacency_blocks(), self.layout.tokens);
        self.scan_rows((keys, tokens), first, queries, Strided { out, stride, len }, stats)
    }
    /// With a seed table of this stride, one sequential scan of it.
    fn score_strided(
        &self,
        stride: u32,
        limit: u32,
        q: &[f32],
        out: &mut Vec<f32>,
        stats: &mut SearchStats,
    ) -> SourceResult {
        self.score_strided_many(stride, limit, q, out, stats).map(|_| ())
    }
}

impl PagedIndex<'_> {
    /// [`Keys::score_strided`] of several queries (a GQA group's q heads), query after query
    /// in `out`: with a seed table of this stride, one scan of it for all of them (each score
    /// what one query's scan gives, to the bit), else each query's scattered rows. Returns the
    /// scores per query. Counts in `stats` what one query's scan counts.
    pub fn score_strided_many(
        &self,
        stride: u32,
        limit: u32,
        queries: &[f32],
        out: &mut Vec<f32>,
        stats: &mut SearchStats,
    ) -> Result<usize, BufferError> {
        let (l, dim) = (&self.layout, self.layout.dim as usize);
        out.clear();
        if stride == 0 || stride != l.seed_stride {
            let (mut one, mut len, mut others) = (Vec::new(), 0, SearchStats::default());
            for (t, q) in queries.chunks_exact(dim).enumerate() {
                score_strided_rows(self, stride, limit, q, &mut one, if t == 0 { &mut *stats } else { &mut others })?;
                len = one.len();
                out.extend_from_slice(&one);
            }
            return Ok(len);
        }
        let len = limit.min(l.tokens).div_ceil(stride) as usize;
        out.resize(queries.len() / dim * len, 0.0);
        self.scan_rows((l.first_seed_block(), l.seed_rows()), 0, queries, Strided { out, stride: len, len }, stats)?;
        Ok(len)
    }
}

/// Scores laid out query after query: query `t`'s score of row `first + i` goes to
/// `out[t · stride + i]`, for `i < len`.
struct Strided<'o> {
    out: &'o mut [f32],
    stride: usize,
    len: usize,
}

impl PagedIndex<'_> {
    /// The scores of `queries` (rows of `dim`) against rows `first .. first + out.len` of the
    /// `rows` packed rows starting at logical block `first_block` (the keys, or the seed
    /// table), each block's rows in one kernel call for all the queries.
    fn scan_rows(
        &self,
        (first_block, rows_in): (u32, u32),
        first: u32,
        queries: &[f32],
        out: Strided<'_>,
        stats: &mut SearchStats,
    ) -> SourceResult {
        let (rows, dim) = (self.layout.rows_per_block, self.layout.dim as usize);
        assert!(queries.len().is_multiple_of(dim), "{} query elements of dimension {dim}", queries.len());
        let m = queries.len() / dim;
        assert!(m == 0 || (out.len <= out.stride && out.out.len() >= (m - 1) * out.stride + out.len));
        if first as u64 + out.len as u64 > rows_in as u64 {
            return Err(invalid(format!("rows {first}..{} of {rows_in}", first as u64 + out.len as u64)));
        }
        let end = first + out.len as u32;
        // At most PIN_BATCH blocks pinned at a time: a flat scan streams a whole prefix.
        let mut t = first;
        while t < end {
            let to = end.min((t / rows + PIN_BATCH as u32) * rows);
            let span = first_block + t / rows..first_block + to.div_ceil(rows);
            self.with_blocks(
                || span.clone().collect(),
                stats,
                |block| {
                    for b in span.clone() {
                        let block_first = t / rows * rows;
                        let (from, upto) =
                            ((t - block_first) as usize, (to.min(block_first + rows) - block_first) as usize);
                        let scores = &mut out.out[(t - first) as usize..];
                        match Rows::of(self.layout.dtype, block(b), from, upto, dim).map_err(|e| (b, e))? {
                            Rows::F16(r) => ctxfs_kernels::scores_many(r, queries, dim, scores, out.stride),
                            Rows::Bf16(r) => ctxfs_kernels::scores_many(r, queries, dim, scores, out.stride),
                        }
                        t = block_first + upto as u32;
                    }
                    Ok(())
                },
            )?;
            debug_assert_eq!(t, to);
        }
        stats.keys_scored += out.len as u64;
        Ok(())
    }
}

impl Graph for PagedIndex<'_> {
    fn neighbors(&self, node: u32, out: &mut Vec<u32>, stats: &mut SearchStats) -> SourceResult {
        let (block, at) = self.record_of(node);
        self.with_blocks(
            || vec![block],
            stats,
            |payload| {
                let p = payload(block);
                let Some(record) = p.get(at.clone()) else {
                    let why = format!("a block of {} payload bytes lacks the record of node {node}", p.len());
                    return Err((block, why));
                };
                let record: &[u32] = bytemuck::cast_slice(record);
                let from = out.len();
                out.extend(record.iter().copied().take_while(|&n| n != u32::MAX));
                match out[from..].iter().find(|&&n| n >= self.layout.tokens) {
                    Some(n) => {
                        Err((block, format!("node {node} links to node {n}, beyond the {} tokens", self.layout.tokens)))
                    }
                    None => Ok(()),
                }
            },
        )
    }
    fn entry(&self) -> u32 {
        self.layout.entry
    }
    /// Only a record in a block this index holds resident or pinned (pinning is not a hint).
    fn prefetch(&self, node: u32) {
        if node >= self.layout.tokens {
            return;
        }
        let (block, at) = self.record_of(node);
        match self.resident {
            Some(r) => ctxfs_kernels::prefetch(r.payload(block as usize).get(at).unwrap_or_default()),
            None => {
                if let Some(g) = self.pins.borrow().get(block) {
                    ctxfs_kernels::prefetch(g.payload().get(at).unwrap_or_default());
                }
            }
        }
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

/// Pins, in one batch, the blocks of packed rows (`layout.rows_per_block` rows of
/// `layout.dim` elements of `layout.dtype`, row `t` in block `t / rows_per_block` of
/// `blocks`) that hold `ids`, and calls `f` once per run of ids that are consecutive rows
/// of one block: with the run's first position in `ids` and its rows. A
/// kernel then sums a run's rows in one call rather than one call per row.
pub fn for_row_runs<'b>(
    pool: &BufferPool,
    blocks: impl Into<Blocks<'b>>,
    layout: &Layout,
    ids: &[u32],
    f: impl FnMut(usize, Rows<'_>),
) -> Result<BatchIo, BufferError> {
    let blocks = blocks.into();
    let rows_per_block = layout.rows_per_block;
    let wanted = blocks_holding(layout, ids, 0);
    if let Some(&last) = wanted.last().filter(|&&b| b as usize >= blocks.len()) {
        let t = ids.iter().max().copied().unwrap_or(0);
        return Err(invalid(format!("token {t} lies in block {last} of a stream of {} blocks", blocks.len())));
    }
    let reqs: Vec<BlockRequest> = wanted.iter().map(|&b| blocks.at(b as usize)).collect();
    let guards: Vec<PageGuard<'_>> = pool.get_many(&reqs).into_iter().collect::<Result<_, _>>()?;
    let payload = |t: u32| guards[wanted.binary_search(&(t / rows_per_block)).expect("fetched above")].payload();
    visit_row_runs(layout, ids, payload, f).map_err(|(t, why)| {
        let b = t / rows_per_block;
        malformed(&blocks.at(b as usize), format!("block {b} of packed rows: {why}"))
    })?;
    Ok(BatchIo { pinned: guards.len(), read: guards.iter().filter(|g| g.read_here()).count() })
}

/// The distinct blocks, ascending, of packed rows (row `t` in block `first + t /
/// rows_per_block`) that hold `ids`.
fn blocks_holding(layout: &Layout, ids: &[u32], first: u32) -> Vec<u32> {
    let mut blocks: Vec<u32> = ids.iter().map(|&t| first + t / layout.rows_per_block).collect();
    // Ids in token order (a compact plan's candidates) need no sort.
    if !blocks.is_sorted() {
        blocks.sort_unstable();
    }
    blocks.dedup();
    blocks
}

/// Calls `f` with each run of ids that are consecutive rows of one block (the block of
/// token `t` being `block(t)`): the run's first position in `ids` and its rows, so that a
/// kernel scores a run in one call (a candidate's block-mates are such runs). The row a few
/// ids past each run is prefetched, so that scattered rows' cache misses overlap. Stops at
/// the first run whose block lacks its rows: `Err((token, why))`.
fn visit_row_runs<'g>(
    layout: &Layout,
    ids: &[u32],
    block: impl Fn(u32) -> &'g [u8],
    mut f: impl FnMut(usize, Rows<'_>),
) -> Result<(), Bad> {
    let (rows_per_block, dim) = (layout.rows_per_block, layout.dim as usize);
    let rows = |t: u32, n: usize| {
        let slot = (t % rows_per_block) as usize;
        Rows::of(layout.dtype, block(t), slot, slot + n, dim).map_err(|why| (t, why))
    };
    for &t in &ids[..ids.len().min(PREFETCH_AHEAD)] {
        if let Ok(r) = rows(t, 1) {
            r.prefetch();
        }
    }
    let mut from = 0;
    while from < ids.len() {
        let (t, b) = (ids[from], ids[from] / rows_per_block);
        let mut to = from + 1;
        while to < ids.len() && ids[to] == ids[to - 1] + 1 && ids[to] / rows_per_block == b {
            to += 1;
        }
        if let Some(Ok(r)) = ids.get(to + PREFETCH_AHEAD).map(|&ahead| rows(ahead, 1)) {
            r.prefetch();
        }
        f(from, rows(t, to - from)?);
        from = to;
    }
    Ok(())
}

/// The rows of `ids` from a stream of packed rows laid out as `layout` says (the data
/// stream's values), read through the pool in one batch. Returns them as f32 in the order of
/// `ids`, and the batch's I/O.
pub fn gather_rows<'b>(
    pool: &BufferPool,
    blocks: impl Into<Blocks<'b>>,
    layout: &Layout,
    ids: &[u32],
) -> Result<(StoredRows, BatchIo), BufferError> {
    let mut out = StoredRows::with_capacity(layout.dtype, ids.len() * layout.dim as usize);
    let io = for_row_runs(pool, blocks, layout, ids, |_, rows| out.extend(rows))?;
    Ok((out, io))
}

/// Rows copied out of their blocks in the type they are stored in: half the bytes of f32,
/// the same values (a session's window keeps its keys and values so).
#[derive(Debug, Clone, PartialEq)]
pub enum StoredRows {
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl StoredRows {
    pub fn with_capacity(dtype: DType, elements: usize) -> StoredRows {
        match dtype {
            DType::F16 => StoredRows::F16(Vec::with_capacity(elements)),
            DType::Bf16 => StoredRows::Bf16(Vec::with_capacity(elements)),
        }
    }

    /// Appends `rows`, widened or narrowed through f32 where their type differs (it does
    /// not within one stream; a context and the prefix it stands on may differ).
    pub fn extend(&mut self, rows: Rows<'_>) {
        match (self, rows) {
            (StoredRows::F16(out), Rows::F16(r)) => out.extend_from_slice(r),
            (StoredRows::Bf16(out), Rows::Bf16(r)) => out.extend_from_slice(r),
            (StoredRows::F16(out), Rows::Bf16(r)) => out.extend(r.iter().map(|x| f16::from_f32(x.to_f32()))),
            (StoredRows::Bf16(out), Rows::F16(r)) => out.extend(r.iter().map(|x| bf16::from_f32(x.to_f32()))),
        }
    }

    pub fn rows(&self) -> Rows<'_> {
        match self {
            StoredRows::F16(r) => Rows::F16(r),
            StoredRows::Bf16(r) => Rows::Bf16(r),
        }
    }

    /// Appends the rows widened to f32 to `out`.
    pub fn extend_f32(&self, out: &mut Vec<f32>) {
        self.rows().extend_f32(out)
    }
}
