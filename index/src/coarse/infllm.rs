//! InfLLM (Xiao et al., 2024), as the AlayaDB paper describes it: adjacent tokens grouped
//! into blocks of B tokens, each block represented by r of its own keys; a query scores the
//! representatives, and the best blocks are attended whole.
//!
//! **Which tokens represent a block.** InfLLM picks the r tokens of a block that receive the
//! largest attention scores from the block's local queries, r_t = Σ_j q_j · k_t over the
//! queries of the sliding window that saw token t. A stored context has no per-token
//! queries: its prefill queries (`layers.{l}.q`) are a sample without positions. So:
//!
//! * with prefill queries ([`RepRule::MeanQuery`]): the score of token t is q̄ · k_t, q̄ the
//!   mean of all the prefill queries given, i.e. (1/n) Σ_j q_j · k_t, the same ranking as
//!   InfLLM's sum with the whole sample standing in for the local window;
//! * without ([`RepRule::MeanKey`]): the score is k̄_b · k_t, k̄_b the mean key of the
//!   block, so the representatives are the block's most typical keys.
//!
//! The r tokens of the block with the highest score (ties: the earlier token) are its
//! representatives, stored best first; a block of fewer than r tokens repeats its last one.
//!
//! **Block score: the maximum of q · representative.** (InfLLM sums over representatives;
//! for one decode query that ranks blocks by q · mean(representatives), which dilutes a
//! block whose one relevant token matches. The maximum follows what attention rewards,
//! the best key, as Quest's bound does.) With a prefix, representatives at or beyond it do
//! not count; a block whose representatives all lie beyond it scores −∞.
//!
//! # Payloads
//!
//! Meta block (magic `CXIL`):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `CXIL` |
//! | 4..8 | version (1) |
//! | 8..12 | tokens |
//! | 12..16 | dim (d) |
//! | 16..20 | block_tokens (B, 1..=65536) |
//! | 20..24 | reps (r) |
//! | 24..28 | records_per_block (R) |
//! | 28..32 | blocks = ⌈tokens / B⌉ |
//! | 32..36 | rule: 0 block mean key, 1 mean prefill query |
//!
//! Then ⌈blocks / R⌉ record blocks: block `b`'s record is record `b % R` of record block
//! `b / R`. A record is 2·r·d + 2·r bytes: r representative keys (d f16 each, best first),
//! then r u16 offsets of those tokens within the block (token = b·B + offset).

use super::{check_query, check_run, decode_meta, encode_meta, limit, pack, read_meta, take_units};
use super::{run_blocks, Coarse, CoarseResult, MemRecords, PagedRecords, Records, Section, COARSE_VERSION};
use crate::mem::MemKeys;
use crate::source::Keys;
use crate::stats::SearchStats;
use ctxfs_buffer::{Blocks, BufferError, BufferPool};
use half::f16;

pub(super) const MAGIC: &[u8; 4] = b"CXIL";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InfllmParams {
    /// Tokens per block (B), at most 65,536 (offsets are u16).
    pub block_tokens: u32,
    /// Representatives per block (r).
    pub reps: u32,
}

impl InfllmParams {
    /// Bytes of one block's record for keys of `dim` elements.
    pub fn record_bytes(&self, dim: usize) -> usize {
        Shape { tokens: 0, dim, block_tokens: self.block_tokens, reps: self.reps as usize }.record()
    }
}

impl Default for InfllmParams {
    /// InfLLM's defaults: blocks of 128 tokens, 4 representatives.
    fn default() -> Self {
        InfllmParams { block_tokens: 128, reps: 4 }
    }
}

/// How representatives were chosen (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RepRule {
    MeanKey = 0,
    MeanQuery = 1,
}

/// The meta block of a stored InfLLM index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InfllmMeta {
    pub tokens: u32,
    pub dim: u32,
    pub block_tokens: u32,
    pub reps: u32,
    pub records_per_block: u32,
    pub rule: RepRule,
}

impl InfllmMeta {
    pub fn blocks(&self) -> u32 {
        self.tokens.div_ceil(self.block_tokens)
    }
    pub fn encode(&self) -> Vec<u8> {
        let f = [self.tokens, self.dim, self.block_tokens, self.reps, self.records_per_block, self.blocks()];
        encode_meta(MAGIC, COARSE_VERSION, &[&f[..], &[self.rule as u32]].concat())
    }
    pub fn decode(b: &[u8]) -> Result<InfllmMeta, String> {
        let (_, f) = decode_meta(b, MAGIC, "infllm", COARSE_VERSION, 7)?;
        let rule = match f[6] {
            0 => RepRule::MeanKey,
            1 => RepRule::MeanQuery,
            r => return Err(format!("infllm meta block: unknown representative rule {r}")),
        };
        let m = InfllmMeta { tokens: f[0], dim: f[1], block_tokens: f[2], reps: f[3], records_per_block: f[4], rule };
        if m.dim == 0
            || !(1..=1 << 16).contains(&m.block_tokens)
            || m.reps == 0
            || m.reps as u64 * m.dim as u64 > u32::MAX as u64
            || m.records_per_block == 0
            || f[5] != m.blocks()
        {
            return Err(format!("infllm meta block: inconsistent fields {m:?}, {} blocks", f[5]));
        }
        Ok(m)
    }
    /// Blocks of the whole run, the meta block included.
    pub fn run_blocks(&self) -> usize {
        run_blocks(&self.sections())
    }
    fn sections(&self) -> [Section; 1] {
        let per_block = self.records_per_block as usize;
        [Section { records: self.blocks() as usize, size: self.shape().record(), per_block }]
    }
    fn shape(&self) -> Shape {
        Shape { tokens: self.tokens, dim: self.dim as usize, block_tokens: self.block_tokens, reps: self.reps as usize }
    }
}

/// What scoring needs to know about the records.
#[derive(Clone, Copy)]
struct Shape {
    tokens: u32,
    dim: usize,
    block_tokens: u32,
    reps: usize,
}

impl Shape {
    /// Bytes of one block's record.
    fn record(&self) -> usize {
        2 * self.reps * self.dim + 2 * self.reps
    }
    fn per_token(&self) -> f64 {
        self.record() as f64 / self.block_tokens as f64
    }
}

/// Block representatives in memory: what the import builds and encodes.
#[derive(Debug, Clone, PartialEq)]
pub struct Infllm {
    tokens: u32,
    dim: usize,
    block_tokens: u32,
    reps: usize,
    rule: RepRule,
    /// Per block, r key rows then r offsets (u16 bit patterns stored in f16 slots).
    records: Vec<f16>,
}

impl Infllm {
    /// Chooses every block's representatives. `queries` are prefill queries (row after row,
    /// any number, possibly none), which select the rule.
    pub fn build(keys: &MemKeys, queries: &[f32], p: &InfllmParams) -> Result<Infllm, String> {
        let (d, n) = (keys.dim(), keys.len());
        if !(1..=1 << 16).contains(&p.block_tokens) || p.reps == 0 {
            return Err(format!("infllm: blocks of 1 to 65,536 tokens and at least one representative, not {p:?}"));
        }
        if !queries.len().is_multiple_of(d) {
            return Err(format!("infllm: {} query elements are not rows of {d}", queries.len()));
        }
        let r = p.reps as usize;
        let rule = if queries.is_empty() { RepRule::MeanKey } else { RepRule::MeanQuery };
        let mean_query = mean(queries, d);
        let blocks = n.div_ceil(p.block_tokens);
        let mut records = Vec::with_capacity(blocks as usize * (r * d + r));
        for b in 0..blocks {
            let first = b * p.block_tokens;
            let ids: Vec<u32> = (first..(first + p.block_tokens).min(n)).collect();
            let block_mean;
            let dir: &[f32] = match rule {
                RepRule::MeanQuery => &mean_query,
                RepRule::MeanKey => {
                    let rows: Vec<f32> = ids.iter().flat_map(|&t| keys.row(t).iter().map(|x| x.to_f32())).collect();
                    block_mean = mean(&rows, d);
                    &block_mean
                }
            };
            let mut scored: Vec<(u32, f32)> = ids.iter().map(|&t| (t, ctxfs_kernels::dot(keys.row(t), dir))).collect();
            scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let chosen: Vec<u32> = (0..r).map(|i| scored[i.min(scored.len() - 1)].0).collect();
            for &t in &chosen {
                records.extend_from_slice(keys.row(t));
            }
            records.extend(chosen.iter().map(|&t| f16::from_bits((t - first) as u16)));
        }
        Ok(Infllm { tokens: n, dim: d, block_tokens: p.block_tokens, reps: r, rule, records })
    }

    pub fn rule(&self) -> RepRule {
        self.rule
    }

    /// The representatives of block `b` (token ids, best first; repeated in a short block).
    pub fn representatives(&self, b: u32) -> Vec<u32> {
        let rec = &self.records[b as usize * (self.reps * self.dim + self.reps)..][..self.reps * self.dim + self.reps];
        rec[self.reps * self.dim..].iter().map(|x| b * self.block_tokens + x.to_bits() as u32).collect()
    }

    /// The meta block, then the record blocks, for blocks of `payload` bytes.
    pub fn payloads(&self, payload: usize) -> Result<Vec<Vec<u8>>, String> {
        let (per, blocks) = pack(bytemuck::cast_slice(&self.records), self.shape().record(), payload, "infllm block")?;
        let meta = InfllmMeta {
            tokens: self.tokens,
            dim: self.dim as u32,
            block_tokens: self.block_tokens,
            reps: self.reps as u32,
            records_per_block: per,
            rule: self.rule,
        };
        Ok(std::iter::once(meta.encode()).chain(blocks).collect())
    }

    /// Every block's score below the prefix (what [`Coarse::select`] ranks).
    pub fn block_scores(&self, q: &[f32], prefix: Option<u32>) -> Result<Vec<f32>, BufferError> {
        Ok(block_scores(&self.mem(), self.shape(), q, prefix)?.0)
    }

    fn shape(&self) -> Shape {
        Shape { tokens: self.tokens, dim: self.dim, block_tokens: self.block_tokens, reps: self.reps }
    }
    fn mem(&self) -> MemRecords<'_> {
        MemRecords { bytes: bytemuck::cast_slice(&self.records), size: self.shape().record() }
    }
}

/// The mean of rows of `d` elements (zeros for none).
fn mean(rows: &[f32], d: usize) -> Vec<f32> {
    let mut acc = vec![0.0f64; d];
    for row in rows.chunks_exact(d) {
        acc.iter_mut().zip(row).for_each(|(a, &x)| *a += x as f64);
    }
    let n = (rows.len() / d).max(1) as f64;
    acc.iter().map(|a| (a / n) as f32).collect()
}

impl Coarse for Infllm {
    fn tokens(&self) -> u32 {
        self.tokens
    }
    fn metadata_bytes_per_token(&self) -> f64 {
        self.shape().per_token()
    }
    fn select(&self, q: &[f32], budget_tokens: usize, prefix: Option<u32>) -> Result<CoarseResult, BufferError> {
        select(&self.mem(), self.shape(), q, budget_tokens, prefix)
    }
}

/// A stored InfLLM index read through the buffer pool.
pub struct PagedInfllm<'p> {
    meta: InfllmMeta,
    records: PagedRecords<'p>,
}

impl<'p> PagedInfllm<'p> {
    /// Opens an InfLLM index from the block requests of its run (meta block first).
    pub fn open(pool: &'p BufferPool, blocks: impl Into<Blocks<'p>>) -> Result<PagedInfllm<'p>, String> {
        let blocks = blocks.into();
        let meta = InfllmMeta::decode(&read_meta(pool, blocks, "infllm index")?)?;
        let [s] = meta.sections();
        check_run(pool, blocks.len(), &[s], "infllm index")?;
        Ok(PagedInfllm { meta, records: PagedRecords::new(pool, blocks.skip(1), s.size, s.per_block) })
    }

    pub fn meta(&self) -> &InfllmMeta {
        &self.meta
    }

    /// Every block's score below the prefix, as [`Infllm::block_scores`].
    pub fn block_scores(&self, q: &[f32], prefix: Option<u32>) -> Result<Vec<f32>, BufferError> {
        Ok(block_scores(&self.records, self.meta.shape(), q, prefix)?.0)
    }
}

impl Coarse for PagedInfllm<'_> {
    fn tokens(&self) -> u32 {
        self.meta.tokens
    }
    fn metadata_bytes_per_token(&self) -> f64 {
        self.meta.shape().per_token()
    }
    fn select(&self, q: &[f32], budget_tokens: usize, prefix: Option<u32>) -> Result<CoarseResult, BufferError> {
        select(&self.records, self.meta.shape(), q, budget_tokens, prefix)
    }
}

/// The score of every block holding tokens below the prefix.
fn block_scores(
    recs: &dyn Records,
    s: Shape,
    q: &[f32],
    prefix: Option<u32>,
) -> Result<(Vec<f32>, SearchStats), BufferError> {
    check_query(q, s.dim)?;
    let lim = limit(s.tokens, prefix);
    let blocks = lim.div_ceil(s.block_tokens) as usize;
    let mut out = vec![f32::NEG_INFINITY; blocks];
    let mut z = vec![0.0f32; s.reps];
    let mut stats = SearchStats::default();
    let rows = 2 * s.reps * s.dim;
    recs.visit(0..blocks, &mut stats, &mut |first, bytes| {
        for (i, rec) in bytes.chunks_exact(s.record()).enumerate() {
            let b = (first + i) as u32;
            ctxfs_kernels::scores::<f16>(bytemuck::cast_slice(&rec[..rows]), q, 1.0, &mut z);
            for (j, off) in rec[rows..].chunks_exact(2).enumerate() {
                let off = u16::from_le_bytes([off[0], off[1]]) as u32;
                let t = b as u64 * s.block_tokens as u64 + off as u64;
                if off >= s.block_tokens || t >= s.tokens as u64 {
                    return Err(format!("infllm block {b}: representative offset {off} lies outside the block"));
                }
                if t < lim as u64 {
                    out[b as usize] = out[b as usize].max(z[j]);
                }
            }
        }
        Ok(())
    })?;
    stats.keys_scored = (blocks * s.reps) as u64;
    Ok((out, stats))
}

fn select(
    recs: &dyn Records,
    s: Shape,
    q: &[f32],
    budget: usize,
    prefix: Option<u32>,
) -> Result<CoarseResult, BufferError> {
    let (scores, stats) = block_scores(recs, s, q, prefix)?;
    Ok(CoarseResult {
        ids: take_units(&scores, s.block_tokens, limit(s.tokens, prefix), budget),
        metadata_bytes: (scores.len() * s.record()) as u64,
        stats,
    })
}
