//! Quest (Tang et al., 2024): the keys in pages of P consecutive tokens; per page, each
//! channel's minimum and maximum key. For a query q the page's score
//! Σ_i max(q_i · min_i, q_i · max_i) bounds q · k from above for every key k in the page,
//! whatever the signs of q's components; the best pages are attended whole.
//!
//! The score is computed as one dot product over 2d elements: a page record holds the max
//! row then the min row, and the query becomes (max(q, 0), min(q, 0)), so each channel
//! contributes q_i · max_i when q_i ≥ 0 and q_i · min_i otherwise, which is the larger of the
//! two since min_i ≤ max_i.
//!
//! # Payloads
//!
//! Meta block (magic `CXQS`):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `CXQS` |
//! | 4..8 | version (1) |
//! | 8..12 | tokens |
//! | 12..16 | dim (head dimension d) |
//! | 16..20 | page_tokens (P) |
//! | 20..24 | pages_per_block (R) |
//! | 24..28 | pages = ⌈tokens / P⌉ |
//!
//! Then ⌈pages / R⌉ page blocks: page `p` is record `p % R` of page block `p / R` (block
//! `1 + p / R` of the run). A record is 4·d bytes: d f16 channel maxima, then d f16 channel
//! minima, over the page's tokens `p·P .. min((p+1)·P, tokens)`.

use super::{check_query, check_run, decode_meta, encode_meta, limit, pack, read_meta, take_units};
use super::{run_blocks, Coarse, CoarseResult, MemRecords, PagedRecords, Records, Section, COARSE_VERSION};
use crate::flat::GroupScan;
use crate::mem::MemKeys;
use crate::source::Keys;
use crate::stats::SearchStats;
use ctxfs_buffer::{Blocks, BufferError, BufferPool};
use half::f16;

pub(super) const MAGIC: &[u8; 4] = b"CXQS";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuestParams {
    /// Tokens per page (P).
    pub page_tokens: u32,
}

impl Default for QuestParams {
    /// The page size of the Quest paper's evaluation.
    fn default() -> Self {
        QuestParams { page_tokens: 16 }
    }
}

/// The meta block of a stored Quest index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuestMeta {
    pub tokens: u32,
    pub dim: u32,
    pub page_tokens: u32,
    pub pages_per_block: u32,
}

impl QuestMeta {
    pub fn pages(&self) -> u32 {
        self.tokens.div_ceil(self.page_tokens)
    }
    pub fn encode(&self) -> Vec<u8> {
        encode_meta(
            MAGIC,
            COARSE_VERSION,
            &[self.tokens, self.dim, self.page_tokens, self.pages_per_block, self.pages()],
        )
    }
    pub fn decode(b: &[u8]) -> Result<QuestMeta, String> {
        let (_, f) = decode_meta(b, MAGIC, "quest", COARSE_VERSION, 5)?;
        let m = QuestMeta { tokens: f[0], dim: f[1], page_tokens: f[2], pages_per_block: f[3] };
        if m.dim == 0 || m.page_tokens == 0 || m.pages_per_block == 0 || f[4] != m.pages() {
            return Err(format!("quest meta block: inconsistent fields {m:?}, {} pages", f[4]));
        }
        Ok(m)
    }
    /// Blocks of the whole run, the meta block included.
    pub fn run_blocks(&self) -> usize {
        run_blocks(&self.sections())
    }
    fn sections(&self) -> [Section; 1] {
        [Section {
            records: self.pages() as usize,
            size: record_bytes(self.dim as usize),
            per_block: self.pages_per_block as usize,
        }]
    }
}

/// Bytes of one page's record for keys of `dim` elements: its max row and min row, f16.
pub fn record_bytes(dim: usize) -> usize {
    4 * dim
}

/// Page bounds in memory: what the import builds and encodes.
#[derive(Debug, Clone, PartialEq)]
pub struct Quest {
    tokens: u32,
    dim: usize,
    page_tokens: u32,
    /// Per page, the max row then the min row.
    records: Vec<f16>,
}

impl Quest {
    pub fn build(keys: &MemKeys, p: &QuestParams) -> Result<Quest, String> {
        if p.page_tokens == 0 {
            return Err("quest: pages must hold at least one token".into());
        }
        let (d, n) = (keys.dim(), keys.len());
        let mut records = Vec::with_capacity(n.div_ceil(p.page_tokens) as usize * 2 * d);
        let mut first = 0;
        while first < n {
            let last = (first + p.page_tokens).min(n);
            let (mut hi, mut lo) = (vec![f32::NEG_INFINITY; d], vec![f32::INFINITY; d]);
            for t in first..last {
                for (i, x) in keys.row(t).iter().enumerate() {
                    hi[i] = hi[i].max(x.to_f32());
                    lo[i] = lo[i].min(x.to_f32());
                }
            }
            // Keys are f16, so their extremes are too: the stored bounds are exact.
            records.extend(hi.iter().chain(&lo).map(|&x| f16::from_f32(x)));
            first = last;
        }
        Ok(Quest { tokens: n, dim: d, page_tokens: p.page_tokens, records })
    }

    /// The meta block, then the page blocks, for blocks of `payload` bytes.
    pub fn payloads(&self, payload: usize) -> Result<Vec<Vec<u8>>, String> {
        let (per, blocks) = pack(bytemuck::cast_slice(&self.records), record_bytes(self.dim), payload, "quest page")?;
        let meta = QuestMeta {
            tokens: self.tokens,
            dim: self.dim as u32,
            page_tokens: self.page_tokens,
            pages_per_block: per,
        };
        Ok(std::iter::once(meta.encode()).chain(blocks).collect())
    }

    /// The bound of every page below the prefix (the scores [`Coarse::select`] ranks).
    pub fn page_scores(&self, q: &[f32], prefix: Option<u32>) -> Result<Vec<f32>, BufferError> {
        let recs = MemRecords { bytes: bytemuck::cast_slice(&self.records), size: record_bytes(self.dim) };
        Ok(page_scores(&recs, self.dim, self.page_tokens, self.tokens, q, prefix)?.scores(0).to_vec())
    }
}

impl Coarse for Quest {
    fn tokens(&self) -> u32 {
        self.tokens
    }
    fn metadata_bytes_per_token(&self) -> f64 {
        record_bytes(self.dim) as f64 / self.page_tokens as f64
    }
    fn select(&self, q: &[f32], budget_tokens: usize, prefix: Option<u32>) -> Result<CoarseResult, BufferError> {
        let recs = MemRecords { bytes: bytemuck::cast_slice(&self.records), size: record_bytes(self.dim) };
        select(&recs, self.dim, self.page_tokens, self.tokens, q, budget_tokens, prefix)
    }
}

/// A stored Quest index read through the buffer pool.
pub struct PagedQuest<'p> {
    meta: QuestMeta,
    records: PagedRecords<'p>,
}

impl<'p> PagedQuest<'p> {
    /// Opens a Quest index from the block requests of its run (meta block first).
    pub fn open(pool: &'p BufferPool, blocks: impl Into<Blocks<'p>>) -> Result<PagedQuest<'p>, String> {
        let blocks = blocks.into();
        let meta = QuestMeta::decode(&read_meta(pool, blocks, "quest index")?)?;
        let [s] = meta.sections();
        check_run(pool, blocks.len(), &[s], "quest index")?;
        Ok(PagedQuest { meta, records: PagedRecords::new(pool, blocks.skip(1), s.size, s.per_block) })
    }

    pub fn meta(&self) -> &QuestMeta {
        &self.meta
    }

    /// The bound of every page below the prefix, as [`Quest::page_scores`].
    pub fn page_scores(&self, q: &[f32], prefix: Option<u32>) -> Result<Vec<f32>, BufferError> {
        let m = &self.meta;
        Ok(page_scores(&self.records, m.dim as usize, m.page_tokens, m.tokens, q, prefix)?.scores(0).to_vec())
    }

    /// The page bounds of each of `queries` (rows of the head dimension: a GQA group's q
    /// heads) in one pass over the page records, each to the bit what it would get alone.
    pub fn page_scores_many(&self, queries: &[f32], prefix: Option<u32>) -> Result<GroupScan, BufferError> {
        let m = &self.meta;
        page_scores(&self.records, m.dim as usize, m.page_tokens, m.tokens, queries, prefix)
    }

    /// [`Coarse::select`] given the query's page bounds (from [`page_scores_many`]) and the
    /// work that computed them.
    ///
    /// [`page_scores_many`]: Self::page_scores_many
    pub fn select_scored(
        &self,
        scores: &[f32],
        stats: SearchStats,
        budget_tokens: usize,
        prefix: Option<u32>,
    ) -> CoarseResult {
        let m = &self.meta;
        select_scored(m.dim as usize, m.page_tokens, m.tokens, scores, stats, budget_tokens, prefix)
    }
}

impl Coarse for PagedQuest<'_> {
    fn tokens(&self) -> u32 {
        self.meta.tokens
    }
    fn metadata_bytes_per_token(&self) -> f64 {
        (4 * self.meta.dim as usize) as f64 / self.meta.page_tokens as f64
    }
    fn select(&self, q: &[f32], budget_tokens: usize, prefix: Option<u32>) -> Result<CoarseResult, BufferError> {
        let m = &self.meta;
        select(&self.records, m.dim as usize, m.page_tokens, m.tokens, q, budget_tokens, prefix)
    }
}

/// The bounds of the pages holding tokens below the prefix, for each of `queries` (rows of
/// `dim`) in one pass over the records: a GQA group's q heads read each page once. A page
/// straddling the prefix keeps its whole-page bound: still an upper bound for its qualifying
/// tokens.
fn page_scores(
    recs: &dyn Records,
    dim: usize,
    page_tokens: u32,
    tokens: u32,
    queries: &[f32],
    prefix: Option<u32>,
) -> Result<GroupScan, BufferError> {
    if queries.is_empty() {
        check_query(queries, dim)?;
    }
    for q in queries.chunks(dim) {
        check_query(q, dim)?;
    }
    let pages = limit(tokens, prefix).div_ceil(page_tokens) as usize;
    let split: Vec<f32> = queries
        .chunks_exact(dim)
        .flat_map(|q| q.iter().map(|&x| x.max(0.0)).chain(q.iter().map(|&x| x.min(0.0))))
        .collect();
    let mut out = vec![0.0f32; queries.len() / dim * pages];
    let mut stats = SearchStats::default();
    recs.visit(0..pages, &mut stats, &mut |first, bytes| {
        let rows: &[f16] = bytemuck::cast_slice(bytes);
        ctxfs_kernels::scores_many(rows, &split, 2 * dim, &mut out[first..], pages);
        Ok(())
    })?;
    stats.keys_scored = pages as u64;
    Ok(GroupScan::new(out, pages, stats))
}

fn select(
    recs: &dyn Records,
    dim: usize,
    page_tokens: u32,
    tokens: u32,
    q: &[f32],
    budget: usize,
    prefix: Option<u32>,
) -> Result<CoarseResult, BufferError> {
    let scan = page_scores(recs, dim, page_tokens, tokens, q, prefix)?;
    Ok(select_scored(dim, page_tokens, tokens, scan.scores(0), scan.stats, budget, prefix))
}

/// The pages a query's bounds `scores` choose within `budget` tokens, whole.
fn select_scored(
    dim: usize,
    page_tokens: u32,
    tokens: u32,
    scores: &[f32],
    stats: SearchStats,
    budget: usize,
    prefix: Option<u32>,
) -> CoarseResult {
    CoarseResult {
        ids: take_units(scores, page_tokens, limit(tokens, prefix), budget),
        metadata_bytes: (scores.len() * 4 * dim) as u64,
        stats,
    }
}
