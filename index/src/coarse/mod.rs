//! Coarse-grained indexes: per (layer, kv head) metadata much smaller than the keys, scored
//! against a decode query to choose the tokens whose exact attention the caller computes.
//!
//! * [`quest`]: per page of P tokens, each channel's minimum and maximum key (Quest);
//! * [`infllm`]: per block of B tokens, r representative keys (InfLLM);
//! * [`pq`]: per token, product-quantisation codes against per-subspace centroids (PQCache).
//!
//! Each method has an in-memory form (`build`, `payloads`) and a paged reader (`open`) that
//! scores directly on buffer-pool pages. Both run the same scoring code over the same record
//! layout (only where the bytes come from differs), so they answer identically. All of them
//! implement [`Coarse`]: `select(q, budget_tokens, prefix)` returns the chosen token ids in
//! ascending order.
//!
//! # On-disk payloads (shared rules)
//!
//! A method's payloads are a run of blocks, meant to be appended to the index stream after
//! the graph index; its reader takes the slice of block requests of that run. Block 0 of the
//! run is the **meta block**: a 4-byte magic, the layout version ([`COARSE_VERSION`], PQ's
//! [`pq::PQ_VERSION`]) as a little-endian u32 at byte 4, then the method's fields, each a little-endian u32, from
//! byte 8 (each module documents its fields). The other blocks hold fixed-size records,
//! `per_block` of them to a block (the last block may hold fewer), record `i` in block
//! `i / per_block` of its section at byte `(i % per_block) · record_size`. f16 values are
//! IEEE binary16, little-endian. A record never spans two blocks.

pub mod infllm;
pub mod pq;
pub mod quest;
mod residual;

use crate::flat::QueryScores;
use crate::stats::SearchStats;
use ctxfs_buffer::{BlockRequest, Blocks, BufferError, BufferPool, PageGuard, ResidentBlocks};
use ctxfs_vfs::BlockFault;
use std::ops::Range;
use std::sync::Arc;

/// The layout version of the Quest and InfLLM payloads, and the oldest of PQ's
/// ([`pq::PQ_VERSION`]).
pub const COARSE_VERSION: u32 = 1;

/// What a coarse selection chose, and what choosing it cost.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CoarseResult {
    /// The selected tokens, ascending (pages and blocks become runs of consecutive ids).
    pub ids: Vec<u32>,
    /// `keys_scored`: metadata entries scored (page bounds, representative keys, PQ codes);
    /// `blocks_touched` and `blocks_read`: metadata blocks pinned and read (paged readers).
    pub stats: SearchStats,
    /// Bytes of metadata the selection scored (the same for the in-memory and paged forms).
    pub metadata_bytes: u64,
}

/// A coarse index, in memory or on buffered pages.
pub trait Coarse {
    /// Tokens the index covers.
    fn tokens(&self) -> u32;
    /// Metadata stored per token: per-token records, with fixed parts (PQ centroids)
    /// amortised over the tokens; the meta block and block headers are left out.
    fn metadata_bytes_per_token(&self) -> f64;
    /// The tokens to attend for `q` (`dim` elements): at most `budget_tokens`, only tokens
    /// below `prefix` when one is given. Pages and blocks are taken whole, best first, until
    /// the next one would not fit (so up to a unit less than the budget); PQ takes exactly
    /// the budget's count of best tokens. Fails on a storage error, a block that contradicts
    /// its meta block (the error names it), or a query of another dimension.
    fn select(&self, q: &[f32], budget_tokens: usize, prefix: Option<u32>) -> Result<CoarseResult, BufferError>;
}

/// Called with each run of records: its first record's index and its bytes. An `Err` says
/// the bytes are malformed.
type Visitor<'a> = dyn FnMut(usize, &[u8]) -> Result<(), String> + 'a;

/// Called with each block visited: its index in the run and its payload.
type BlockVisitor<'a> = dyn FnMut(usize, &[u8]) -> Result<(), BufferError> + 'a;

/// Called with each record asked for: its position among the ids and its bytes. An `Err`
/// says the bytes are malformed.
type RecordVisitor<'a> = dyn FnMut(usize, &[u8]) -> Result<(), String> + 'a;

/// Fixed-size records, read in runs of whole records: how every coarse index reaches its
/// metadata, whether it lies in one array or across pinned pages.
trait Records {
    /// Calls `f(first, bytes)` for the records of `range`, in order, in runs of whole records
    /// (`first` is the run's first record). An error from `f` (malformed contents) or from
    /// the storage ends the visit. Counts pinned blocks in `stats`.
    fn visit(&self, range: Range<usize>, stats: &mut SearchStats, f: &mut Visitor<'_>) -> Result<(), BufferError>;
    /// Calls `f(i, record)` for each record `ids[i]` (ascending, all below the records'
    /// count), in order. Pins the blocks that hold them in batches, and prefetches records a
    /// few ids ahead: a sparse read of a few records in each of many blocks (the residual codes
    /// of scattered tokens) costs one pool call per batch and overlaps its cache misses.
    fn visit_records(&self, ids: &[u32], stats: &mut SearchStats, f: &mut RecordVisitor<'_>)
        -> Result<(), BufferError>;
}

/// Records in one array (the in-memory form of every method).
struct MemRecords<'a> {
    bytes: &'a [u8],
    size: usize,
}

impl Records for MemRecords<'_> {
    fn visit(&self, range: Range<usize>, _stats: &mut SearchStats, f: &mut Visitor<'_>) -> Result<(), BufferError> {
        f(range.start, &self.bytes[range.start * self.size..range.end * self.size]).map_err(invalid)
    }
    fn visit_records(
        &self,
        ids: &[u32],
        _stats: &mut SearchStats,
        f: &mut RecordVisitor<'_>,
    ) -> Result<(), BufferError> {
        let record = |t: u32| self.bytes.get(t as usize * self.size..(t as usize + 1) * self.size);
        for (i, &t) in ids.iter().enumerate() {
            if let Some(ahead) = ids.get(i + PREFETCH_RECORDS_AHEAD).and_then(|&a| record(a)) {
                ctxfs_kernels::prefetch(ahead);
            }
            f(i, record(t).ok_or_else(|| invalid(format!("record {t} beyond the records in memory")))?)
                .map_err(invalid)?;
        }
        Ok(())
    }
}

/// A request the index cannot answer (a query of the wrong dimension, or in-memory records
/// that contradict their own parameters), as an error rather than a panic.
fn invalid(why: String) -> BufferError {
    BufferError::Block(Arc::new(ctxfs_vfs::Error::InvalidArgument(why)))
}

/// Checks the query's dimension against the index's (which may come from a meta block).
fn check_query(q: &[f32], dim: usize) -> Result<(), BufferError> {
    if q.len() != dim {
        return Err(invalid(format!("a query of {} elements for an index of dimension {dim}", q.len())));
    }
    Ok(())
}

/// Checks that `queries` is one or more whole queries of the index's dimension.
fn check_queries(queries: &[f32], dim: usize) -> Result<(), BufferError> {
    if queries.is_empty() || !queries.len().is_multiple_of(dim) {
        return Err(invalid(format!("{} query elements for an index of dimension {dim}", queries.len())));
    }
    Ok(())
}

/// Blocks pinned per batch: a scan of a long context's metadata must not ask for more frames
/// than the pool's index area has at once.
const PIN_BATCH: usize = 64;

/// How many records ahead of the one it visits a sparse visit prefetches
/// ([`Records::visit_records`]): enough misses in flight to hide memory latency.
const PREFETCH_RECORDS_AHEAD: usize = 8;

/// Records packed `per_block` to a block in a run of blocks read through the pool, or,
/// where the run is held resident, straight from the held frames.
struct PagedRecords<'p> {
    pool: &'p BufferPool,
    blocks: Blocks<'p>,
    size: usize,
    per_block: usize,
    /// Where every block of the run is held: block `b` is the held block `from + b`.
    held: Option<Held<'p>>,
}

/// Blocks of a run held resident: the run's block `b` is `blocks`' block `from + b`.
#[derive(Clone, Copy)]
struct Held<'p> {
    blocks: &'p ResidentBlocks,
    from: usize,
}

impl<'p> PagedRecords<'p> {
    fn new(pool: &'p BufferPool, blocks: Blocks<'p>, size: usize, per_block: usize) -> Self {
        PagedRecords { pool, blocks, size, per_block, held: None }
    }

    /// Reads its blocks from the held blocks where a run's blocks are held (`held`: the held
    /// blocks and where the run's first is among them) and they hold all of this one's,
    /// which starts at the run's block `at` (a compact context's codes): no pin, no
    /// page-table lookup, no latch.
    fn held_in_run(mut self, held: Option<(&'p ResidentBlocks, usize)>, at: usize) -> Self {
        if let Some((blocks, from)) = held.filter(|&(h, from)| from + at + self.blocks.len() <= h.len()) {
            self.held = Some(Held { blocks, from: from + at });
        }
        self
    }

    /// Calls `f(b, payload)` for each block `b` of `wanted` (ascending), read through the
    /// pool in batches of [`PIN_BATCH`], or straight from the held frames. With `whole`, the
    /// next block is prefetched whole while one is visited (a scan reads all of it).
    fn each_block(
        &self,
        wanted: impl Iterator<Item = usize>,
        whole: bool,
        stats: &mut SearchStats,
        f: &mut BlockVisitor<'_>,
    ) -> Result<(), BufferError> {
        if let Some(h) = self.held {
            let mut wanted = wanted.peekable();
            while let Some(b) = wanted.next() {
                // As below: the next block's lines on their way while this one is visited.
                if let Some(&next) = wanted.peek().filter(|_| whole) {
                    ctxfs_kernels::prefetch(h.blocks.payload(h.from + next));
                }
                stats.blocks_touched += 1;
                f(b, h.blocks.payload(h.from + b))?;
            }
            return Ok(());
        }
        let wanted: Vec<usize> = wanted.collect();
        for batch in wanted.chunks(PIN_BATCH) {
            let reqs: Vec<BlockRequest> = batch.iter().map(|&b| self.blocks.at(b)).collect();
            let guards: Vec<PageGuard<'_>> = self.pool.get_many(&reqs).into_iter().collect::<Result<_, _>>()?;
            stats.blocks_touched += guards.len() as u64;
            stats.blocks_read += guards.iter().filter(|g| g.read_here()).count() as u64;
            for (i, (g, &b)) in guards.iter().zip(batch).enumerate() {
                // The next block's lines are on their way while this one is visited: blocks
                // lie in scattered frames, where the CPU's own prefetcher stops at the page.
                if let Some(next) = guards.get(i + 1).filter(|_| whole) {
                    ctxfs_kernels::prefetch(next.payload());
                }
                f(b, g.payload())?;
            }
        }
        Ok(())
    }

    /// The records `lo..hi` of block `b`'s payload `p`, or an error naming the block.
    fn records_of<'a>(&self, b: usize, p: &'a [u8], lo: usize, hi: usize) -> Result<&'a [u8], BufferError> {
        p.get(lo * self.size..hi * self.size).ok_or_else(|| {
            malformed(
                &self.blocks.at(b),
                format!("coarse index block holds {} bytes, its records need {}", p.len(), hi * self.size),
            )
        })
    }
}

/// A block whose contents contradict its index's meta block, as a storage error naming it.
fn malformed(req: &BlockRequest, why: String) -> BufferError {
    BufferError::Block(Arc::new(ctxfs_vfs::Error::mismatch(req.block, &req.expect, BlockFault::Malformed(why))))
}

impl Records for PagedRecords<'_> {
    fn visit(&self, range: Range<usize>, stats: &mut SearchStats, f: &mut Visitor<'_>) -> Result<(), BufferError> {
        if range.is_empty() {
            return Ok(());
        }
        let per = self.per_block;
        let wanted = range.start / per..(range.end - 1) / per + 1;
        self.each_block(wanted, true, stats, &mut |b, p| {
            let first = range.start.max(b * per);
            let last = range.end.min((b + 1) * per);
            let bytes = self.records_of(b, p, first - b * per, last - b * per)?;
            f(first, bytes).map_err(|why| malformed(&self.blocks.at(b), why))
        })
    }
    fn visit_records(
        &self,
        ids: &[u32],
        stats: &mut SearchStats,
        f: &mut RecordVisitor<'_>,
    ) -> Result<(), BufferError> {
        let per = self.per_block;
        let mut blocks: Vec<usize> = ids.iter().map(|&t| t as usize / per).collect();
        blocks.dedup();
        let held = self.held;
        // The bytes of record `t` in the held frames, where they are there.
        let held_record = |t: u32| -> Option<&[u8]> {
            let h = held?;
            let at = (t as usize % per) * self.size;
            h.blocks.payload(h.from + t as usize / per).get(at..at + self.size)
        };
        let mut i = 0;
        self.each_block(blocks.into_iter(), false, stats, &mut |b, p| {
            let to = i + ids[i..].partition_point(|&t| (t as usize) < (b + 1) * per);
            for (j, &t) in ids.iter().enumerate().take(to).skip(i) {
                if let Some(ahead) = ids.get(j + PREFETCH_RECORDS_AHEAD).and_then(|&a| held_record(a)) {
                    ctxfs_kernels::prefetch(ahead);
                }
                let lo = t as usize - b * per;
                f(j, self.records_of(b, p, lo, lo + 1)?).map_err(|why| malformed(&self.blocks.at(b), why))?;
            }
            i = to;
            Ok(())
        })
    }
}

/// Fails, saying which, when a record of the coarse indexes an import builds (with default
/// parameters) for keys of `dim` elements does not fit a block payload of `payload` bytes:
/// checked before anything is built or written.
pub fn check_records_fit(dim: usize, payload: usize) -> Result<(), String> {
    records_per_block(quest::record_bytes(dim), payload, "quest page")?;
    records_per_block(infllm::InfllmParams::default().record_bytes(dim), payload, "infllm block")?;
    Ok(())
}

/// Packs records (`size` bytes each) into block payloads: how many fit a block, and the blocks.
fn pack(bytes: &[u8], size: usize, payload: usize, what: &str) -> Result<(u32, Vec<Vec<u8>>), String> {
    let per = records_per_block(size, payload, what)?;
    Ok((per, bytes.chunks(per as usize * size).map(<[u8]>::to_vec).collect()))
}

/// How many records of `size` bytes a block payload of `payload` bytes holds (at least one,
/// or why not).
fn records_per_block(size: usize, payload: usize, what: &str) -> Result<u32, String> {
    match payload / size {
        0 => Err(format!("{what} records of {size} bytes do not fit a block payload of {payload} bytes")),
        per => Ok(per as u32),
    }
}

/// A meta block: magic, version, then `fields` as little-endian u32.
fn encode_meta(magic: &[u8; 4], version: u32, fields: &[u32]) -> Vec<u8> {
    let mut out = magic.to_vec();
    for v in std::iter::once(version).chain(fields.iter().copied()) {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// The version and the `n` fields of a meta block written by [`encode_meta`] with a version
/// from [`COARSE_VERSION`] to `newest`, or why it is not one.
fn decode_meta(b: &[u8], magic: &[u8; 4], what: &str, newest: u32, n: usize) -> Result<(u32, Vec<u32>), String> {
    if b.len() < 8 + 4 * n || &b[..4] != magic {
        return Err(format!("{what} meta block: bad magic or length ({} bytes)", b.len()));
    }
    let word = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    if !(COARSE_VERSION..=newest).contains(&word(4)) {
        return Err(format!("{what} layout version {} (this build reads {COARSE_VERSION} to {newest})", word(4)));
    }
    Ok((word(4), (0..n).map(|i| word(8 + 4 * i)).collect()))
}

/// Reads the meta block of a run of coarse-index blocks.
fn read_meta(pool: &BufferPool, blocks: Blocks<'_>, what: &str) -> Result<Vec<u8>, String> {
    let first = blocks.first().ok_or_else(|| format!("empty {what} block run"))?;
    Ok(pool.get(&first).map_err(|e| e.to_string())?.payload().to_vec())
}

/// A run of record blocks: `records` of `size` bytes, `per_block` to a block.
#[derive(Clone, Copy)]
struct Section {
    records: usize,
    size: usize,
    per_block: usize,
}

impl Section {
    fn blocks(&self) -> usize {
        self.records.div_ceil(self.per_block.max(1))
    }
}

/// Blocks of a whole run: the meta block and every section's blocks.
fn run_blocks(sections: &[Section]) -> usize {
    1 + sections.iter().map(Section::blocks).sum::<usize>()
}

/// Checks that a run holds exactly the meta block and the sections' blocks, and that a
/// section's records fit the pool's blocks (so the meta block cannot make a reader allocate
/// more than the blocks it has could hold).
fn check_run(pool: &BufferPool, have: usize, sections: &[Section], what: &str) -> Result<(), String> {
    let payload = ctxfs_vfs::max_payload(pool.block_size());
    for s in sections {
        if s.per_block == 0 || s.size == 0 || s.per_block.saturating_mul(s.size) > payload {
            return Err(format!("{what} meta block: {} records of {} bytes do not fit a block", s.per_block, s.size));
        }
    }
    let need = run_blocks(sections);
    if have != need {
        return Err(format!("{what} has {have} blocks, its meta block needs {need}"));
    }
    Ok(())
}

/// Which coarse index a meta block begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CoarseKind {
    Quest,
    Infllm,
    Pq,
}

/// The kind of coarse index whose meta block is `meta`, and how many blocks its run holds
/// (the meta block included): what a reader needs to walk runs stored one after another.
pub fn run_of(meta: &[u8]) -> Result<(CoarseKind, usize), String> {
    match meta.get(..4) {
        Some(m) if m == quest::MAGIC => Ok((CoarseKind::Quest, quest::QuestMeta::decode(meta)?.run_blocks())),
        Some(m) if m == infllm::MAGIC => Ok((CoarseKind::Infllm, infllm::InfllmMeta::decode(meta)?.run_blocks())),
        Some(m) if m == pq::MAGIC => Ok((CoarseKind::Pq, pq::PqMeta::decode(meta)?.run_blocks())),
        _ => Err("not the meta block of a coarse index (unknown magic)".into()),
    }
}

/// Units (pages or blocks of `unit` tokens covering `0..limit`) best first by `scores`
/// (ties: the lower unit), taken while the whole next unit fits the budget; their tokens,
/// ascending.
fn take_units(scores: &[f32], unit: u32, limit: u32, budget: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..scores.len() as u32).collect();
    let best_first = |a: &u32, b: &u32| scores[*b as usize].total_cmp(&scores[*a as usize]).then(a.cmp(b));
    // Every unit but the last holds `unit` tokens, so at most budget / unit + 1 are taken, and
    // the one that stops the taking is among the next: only those need ordering.
    let looked_at = (budget / unit.max(1) as usize).saturating_add(2);
    if looked_at < order.len() {
        order.select_nth_unstable_by(looked_at, best_first);
        order.truncate(looked_at);
    }
    order.sort_unstable_by(best_first);
    let mut taken = Vec::new();
    let mut used = 0usize;
    for u in order {
        let len = ((u + 1).saturating_mul(unit)).min(limit) - u * unit;
        if used + len as usize > budget {
            break;
        }
        used += len as usize;
        taken.push(u);
    }
    taken.sort_unstable();
    taken.iter().flat_map(|&u| u * unit..((u + 1).saturating_mul(unit)).min(limit)).collect()
}

/// The `k` best tokens by `scored` (ties: the lower id), ascending.
pub fn take_tokens(scored: QueryScores<'_>, k: usize) -> Vec<u32> {
    let scores = scored.scores;
    // The k best are among the scores that reach any cut at least k of them reach: a cut
    // from a sample leaves a few times k to choose from instead of every score.
    let mut ids = match sample_cut(scores, k).map(|cut| scored.reaching(cut)) {
        Some(ids) if ids.len() >= k => ids,
        _ => (0..scores.len() as u32).collect(),
    };
    let order = |a: &u32, b: &u32| scores[*b as usize].total_cmp(&scores[*a as usize]).then(a.cmp(b));
    if k < ids.len() {
        ids.select_nth_unstable_by(k, order);
        ids.truncate(k);
    }
    ids.sort_unstable();
    ids
}

/// The tokens whose score reaches `cut` in [`f32::total_cmp`]'s order, ascending. A run of
/// 16 scores is tested in one branch-free pass (total order as integers), and only a run
/// that holds a score reaching the cut is looked at score by score.
pub fn reaching(scores: &[f32], cut: f32) -> Vec<u32> {
    let mut ids = Vec::new();
    reaching_into(scores, 0, cut, &mut ids);
    ids
}

/// [`reaching`] of the scores of tokens `first..`, appended to `ids`.
pub(crate) fn reaching_into(scores: &[f32], first: u32, cut: f32, ids: &mut Vec<u32>) {
    let cut = total_order_key(cut);
    for (r, run) in scores.chunks(16).enumerate() {
        if run.iter().fold(false, |any, &s| any | (total_order_key(s) >= cut)) {
            let first = first + (r * 16) as u32;
            ids.extend((first..).zip(run).filter(|(_, &s)| total_order_key(s) >= cut).map(|(t, _)| t));
        }
    }
}

/// `x` as an integer that orders as [`f32::total_cmp`] orders floats.
fn total_order_key(x: f32) -> i32 {
    let bits = x.to_bits() as i32;
    bits ^ (((bits >> 31) as u32) >> 1) as i32
}

/// A score that about `CUT_SPARE` × `k` of `scores` reach, read off every `stride`-th score;
/// none when the scores are too few for a sample to save work.
fn sample_cut(scores: &[f32], k: usize) -> Option<f32> {
    let stride = scores.len() / (8 * k.max(1));
    if stride < 4 {
        return None;
    }
    cut_of_sample(scores.iter().step_by(stride).copied().collect(), stride, k)
}

/// A score that about `CUT_SPARE` × `k` of a query's scores reach, read off `sample`, every
/// `stride`-th of them; none when the sample is too short to tell.
pub(crate) fn cut_of_sample(mut sample: Vec<f32>, stride: usize, k: usize) -> Option<f32> {
    let rank = cut_rank(stride, k);
    if rank >= sample.len() {
        return None;
    }
    Some(*sample.select_nth_unstable_by(rank, |a, b| b.total_cmp(a)).1)
}

/// The rank in a sample of every `stride`-th score at which [`cut_of_sample`] cuts: about
/// `CUT_SPARE` × `k` scores reach it, and `rank + 1` samples do.
pub(crate) fn cut_rank(stride: usize, k: usize) -> usize {
    (CUT_SPARE * k).div_ceil(stride) + 8
}

/// The `k` best of `pairs` (token, score), ascending by token, by score (ties: the lower
/// token), in their order: the tokens and order [`take_tokens`] gives. A selection of the
/// `k`-th best score, then one pass: no sort.
pub fn best_pairs(mut pairs: Vec<(u32, f32)>, k: usize) -> Vec<(u32, f32)> {
    debug_assert!(pairs.windows(2).all(|w| w[0].0 < w[1].0), "pairs ascend by token");
    if k == 0 {
        pairs.clear();
    } else if k < pairs.len() {
        let mut scores: Vec<f32> = pairs.iter().map(|p| p.1).collect();
        let cut = *scores.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a)).1;
        // Those above the cut, and of those at it the lowest tokens, to make `k`.
        let mut at_cut = k - scores[..k].iter().filter(|s| s.total_cmp(&cut).is_gt()).count();
        pairs.retain(|p| match p.1.total_cmp(&cut) {
            std::cmp::Ordering::Greater => true,
            std::cmp::Ordering::Equal if at_cut > 0 => {
                at_cut -= 1;
                true
            }
            _ => false,
        });
    }
    pairs
}

/// How many times `k` a sampled cut aims to leave: enough that the sample's error rarely
/// leaves fewer than `k` (then every score is ranked).
const CUT_SPARE: usize = 2;

/// Tokens a selection may return: those below the prefix, if one is given.
fn limit(tokens: u32, prefix: Option<u32>) -> u32 {
    prefix.map_or(tokens, |p| p.min(tokens))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::Rng;

    #[test]
    fn best_pairs_are_the_best_by_score_then_token_in_token_order() {
        let mut rng = Rng::new(4);
        for (n, k) in [(0usize, 3usize), (5, 0), (5, 5), (5, 9), (1000, 1), (1000, 64), (1000, 999), (20_000, 2048)] {
            // Few distinct values, so that ties straddle the cut.
            let pairs: Vec<(u32, f32)> =
                (0..n as u32).map(|t| (3 * t + 1, (rng.below(32) as f32 - 16.0) * 0.25)).collect();
            let mut expected = pairs.clone();
            expected.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            expected.truncate(k);
            expected.sort_by_key(|p| p.0);
            assert_eq!(best_pairs(pairs, k), expected, "n {n} k {k}");
        }
    }

    #[test]
    fn take_tokens_is_the_best_by_score_then_id() {
        let mut rng = Rng::new(9);
        for n in [0usize, 1, 50, 1000, 40_000] {
            // Few distinct values, so that ties straddle the cut; a NaN ranks first (total order).
            let mut scores: Vec<f32> = (0..n).map(|_| (rng.below(64) as f32 - 32.0) * 0.5).collect();
            if n > 10 {
                scores[7] = f32::NAN;
            }
            for k in [0, 1, 3, 100, 999, 1000, 1001, 5000, 50_000] {
                let mut want: Vec<u32> = (0..n as u32).collect();
                want.sort_by(|&a, &b| scores[b as usize].total_cmp(&scores[a as usize]).then(a.cmp(&b)));
                want.truncate(k);
                want.sort_unstable();
                assert_eq!(take_tokens(QueryScores::plain(&scores), k), want, "n {n} k {k}");
            }
        }
    }
}
