//! PQCache (Zhang et al., 2025): product quantisation of one kv head's keys. The d channels
//! split into m subspaces of d/m; k-means in each gives 2^b centroids; every token keeps,
//! per subspace, the code of its nearest centroid. For a query, `LUT[j][c]` = q_j · centroid
//! (j, c) (q_j the query's part in subspace j), and a token's approximate score is
//! `Σ_j LUT[j][code(t, j)]` = q · (the token's reconstructed key). The best `budget` tokens by
//! approximate score are selected; the caller computes their exact attention.
//!
//! The paper's two settings are [`PqParams::M2B6`] (LongBench: m = 2, b = 6) and
//! [`PqParams::M4B8`] (InfiniteBench: m = 4, b = 8). Codes take one byte per subspace
//! (b ≤ 8; the paper packs b bits, which at b = 6 would save a quarter of the codes), and
//! centroids are stored in f16, like the keys they summarise.
//!
//! **k-means**, per subspace, deterministic for a seed: on at most 256 · 2^b keys sampled
//! without replacement (all of them when there are fewer; more barely moves centroids and
//! costs linear time), k-means++ seeding, then at most `iters` Lloyd iterations, stopping
//! early when no key changes cluster. A cluster left empty is re-seeded with the key
//! farthest from its centroid. The final codes assign every key to the nearest of the
//! f16-rounded centroids, the ones stored and scored.
//!
//! # Payloads
//!
//! Meta block (magic `CXPQ`):
//!
//! | bytes | field |
//! |---|---|
//! | 0..4 | magic `CXPQ` |
//! | 4..8 | version ([`PQ_VERSION`], 4; 3: no residual codes; 2: also no sample blocks; 1: also token-major code blocks) |
//! | 8..12 | tokens |
//! | 12..16 | dim (d) |
//! | 16..20 | m (subspaces; d is a multiple of m) |
//! | 20..24 | bits (b, 1..=8) |
//! | 24..28 | iters (the build's iteration cap, for the record) |
//! | 28..32 | seed, low 32 bits |
//! | 32..36 | seed, high 32 bits |
//! | 36..40 | centroids_per_block (C) |
//! | 40..44 | codes_per_block (T, tokens) |
//! | 44..48 | sample_stride (s: [`SAMPLE_STRIDE`]; version 3 on) |
//! | 48..52 | residual subspaces (m_r: [`PqParams::residual`]; version 4; 0: none) |
//! | 52..56 | residual_centroids_per_block (C_r; version 4; 0 without residual codes) |
//! | 56..60 | residual_codes_per_block (T_r, tokens; version 4; 0 without residual codes) |
//!
//! Then ⌈m · 2^b / C⌉ centroid blocks: centroid `c` of subspace `j` is row `j · 2^b + c`,
//! record `row % C` of centroid block `row / C`, d/m f16 (2·d/m bytes). Then
//! ⌈tokens / T⌉ code blocks of one u8 code per token and subspace: code block `i` holds the
//! `r` tokens `i·T ..` (`r` = T, fewer in the last block) **subspace-major**: token
//! `i·T + u`'s code in subspace `j` is byte `j·r + u`. A scan looks a subspace's codes up 64
//! at a time ([`ctxfs_kernels::pq_scores`]). Version 1 blocks hold the same bytes token-major
//! (token `i·T + u`'s m codes at byte `m·u`); they are read, transposed as they are scanned.
//! Version 3 follows the code blocks with ⌈⌈tokens / s⌉ / T⌉ **sample blocks**: the codes of
//! tokens `0, s, 2s, …`, packed as the code blocks are (sample `i` where token `i` would be).
//! A scan keeping only each query's best ([`PagedPq::token_best_many`]) scores them for its
//! cut; reading every `s`-th token's codes out of the code blocks would touch most of their
//! cache lines. Version 4 follows them, where `m_r > 0`, with the residual codes
//! (`coarse/residual.rs`): ⌈m_r · 2^b / C_r⌉ residual centroid blocks (row `i · 2^b + c`,
//! d/m_r f16), then ⌈tokens / T_r⌉ residual code blocks, token-major (token `t`'s m_r codes
//! at byte `m_r · (t mod T_r)` of block `t / T_r`): [`PagedPq::refine`].
//!
//! **Scores** come from the query's tables quantised to a byte per entry
//! ([`ctxfs_kernels::PqLut`]): within half a table step per subspace of the reconstructed
//! keys' inner products ([`ctxfs_kernels::PqLut::max_error`]).

pub use super::residual::ResidualTable;
use super::residual::{self, PagedResidual, Residual, ResidualShape};
use super::{best_pairs, check_queries, check_query, check_run, cut_of_sample, decode_meta, encode_meta, limit, pack};
use super::{cut_rank, read_meta, take_tokens};
use super::{records_per_block, run_blocks, Coarse, CoarseResult, MemRecords, PagedRecords, Records, Section};
use crate::flat::{fold_run_best, GroupScan, BEST_RUN};
use crate::mem::MemKeys;
use crate::source::Keys;
use crate::stats::SearchStats;
use crate::synth::Rng;
use ctxfs_buffer::{Blocks, BufferError, BufferPool, ResidentBlocks};
use ctxfs_kernels::{PqLut, Reached, SumCut};
use half::f16;

pub(super) const MAGIC: &[u8; 4] = b"CXPQ";

/// The layout version PQ runs are written with: code blocks subspace-major, the sample
/// blocks, then the residual codes' blocks (`coarse/residual.rs`).
pub const PQ_VERSION: u32 = 4;

/// Every how many tokens a run's sample codes are taken: the seed table's stride, so that a
/// sample's scores are the codes' scores of the seeds, which the codes' error margin needs.
pub const SAMPLE_STRIDE: u32 = crate::search::SEED_STRIDE;

/// How a run of tokens' codes is laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeLayout {
    /// A token's m codes side by side (version 1 code blocks).
    TokenMajor,
    /// Per block of tokens, a subspace's codes side by side (version 2 code blocks; in
    /// memory, one block of all tokens).
    SubspaceMajor,
}

/// Keys sampled per centroid to train k-means (FAISS's default cap)...
const TRAIN_PER_CENTROID: usize = 256;
/// ...and in all: at 256 centroids, 64 keys each. Training is most of a long context's
/// build at `PqParams::scan_codes` (d/4 subspaces), and the codes' score error on real
/// attention is no larger trained on this many (`ctxfs bench search`, `pq target`).
const TRAIN_POINTS: usize = 16_384;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PqParams {
    /// Subspaces (m); the head dimension must be a multiple of it.
    pub m: u32,
    /// Bits per code (b, 1..=8): 2^b centroids per subspace.
    pub bits: u32,
    /// Lloyd iterations at most.
    pub iters: u32,
    pub seed: u64,
    /// Subspaces of the residual codes (`coarse/residual.rs`; the head dimension must be a
    /// multiple of it), `b` bits each as the codes; 0: none.
    pub residual: u32,
}

impl PqParams {
    /// PQCache's LongBench setting.
    pub const M2B6: PqParams = PqParams { m: 2, bits: 6, iters: 25, seed: 0, residual: 0 };
    /// PQCache's InfiniteBench setting.
    pub const M4B8: PqParams = PqParams { m: 4, bits: 8, iters: 25, seed: 0, residual: 0 };

    /// Codes that stand in for the keys of a scan ([`crate::approx`]): a subspace of 4
    /// dimensions per byte, `d / 4` bytes per token, a sixteenth of a token's keys and values
    /// in f16.
    /// Ten Lloyd iterations: on SmolLM2's code at 32K tokens the codes' score error is 2%
    /// above 25's, and a 131,072-token head at d = 128 builds in 1.6 s instead of 2.7.
    /// Residual codes of 8 dimensions per byte (`d / 8` bytes per token, where d is a
    /// multiple of 8) rank the candidates the scan chooses before their keys are read; a
    /// build makes them from 32,768 tokens, where their centroids weigh at most an eighth of
    /// them. A head dimension that is not a multiple of 4 takes the most subspaces that
    /// divide it with at least 4 dimensions each (d = 130: 26 of 5), and no residual codes.
    pub fn scan_codes(dim: usize) -> PqParams {
        let residual = if dim.is_multiple_of(8) { dim / 8 } else { 0 };
        let m = (1..=(dim / 4).max(1)).rev().find(|&m| dim.is_multiple_of(m)).unwrap_or(1);
        PqParams { m: m as u32, bits: 8, iters: 10, seed: 0, residual: residual as u32 }
    }
}

impl Default for PqParams {
    fn default() -> Self {
        PqParams::M2B6
    }
}

/// The meta block of a stored PQ index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PqMeta {
    /// The run's layout version (1 to [`PQ_VERSION`]).
    pub version: u32,
    pub tokens: u32,
    pub dim: u32,
    pub params: PqParams,
    pub centroids_per_block: u32,
    pub codes_per_block: u32,
    /// Version 3: the sample blocks hold the codes of every `sample_stride`-th token (0:
    /// none). Versions 1 and 2 have none.
    pub sample_stride: u32,
    /// Version 4, with `params.residual` > 0: residual centroid rows per block...
    pub residual_centroids_per_block: u32,
    /// ...and residual codes per block (tokens). Both 0 without residual codes.
    pub residual_codes_per_block: u32,
}

/// Meta fields after the version, by version: 9 (1, 2), 10 (3: the sample stride), 13 (4:
/// the residual codes' subspaces, centroids per block and codes per block).
fn meta_fields(version: u32) -> usize {
    match version {
        ..=2 => 9,
        3 => 10,
        _ => 13,
    }
}

impl PqMeta {
    pub fn encode(&self) -> Vec<u8> {
        let p = &self.params;
        encode_meta(
            MAGIC,
            self.version,
            &[
                self.tokens,
                self.dim,
                p.m,
                p.bits,
                p.iters,
                p.seed as u32,
                (p.seed >> 32) as u32,
                self.centroids_per_block,
                self.codes_per_block,
                self.sample_stride,
                p.residual,
                self.residual_centroids_per_block,
                self.residual_codes_per_block,
            ][..meta_fields(self.version)],
        )
    }
    pub fn decode(b: &[u8]) -> Result<PqMeta, String> {
        let (version, _) = decode_meta(b, MAGIC, "pq", PQ_VERSION, 9)?;
        let (_, f) = decode_meta(b, MAGIC, "pq", PQ_VERSION, meta_fields(version))?;
        let field = |i: usize| f.get(i).copied().unwrap_or(0);
        let seed = f[5] as u64 | (f[6] as u64) << 32;
        let params = PqParams { m: f[2], bits: f[3], iters: f[4], seed, residual: field(10) };
        let m = PqMeta {
            version,
            tokens: f[0],
            dim: f[1],
            params,
            centroids_per_block: f[7],
            codes_per_block: f[8],
            sample_stride: field(9),
            residual_centroids_per_block: field(11),
            residual_codes_per_block: field(12),
        };
        // Both residual fields are nonzero exactly when there are residual subspaces.
        let residual_fields = [m.residual_centroids_per_block, m.residual_codes_per_block];
        let residual_consistent = match params.residual {
            0 => residual_fields == [0, 0],
            _ => residual_fields.iter().all(|&f| f > 0),
        };
        if check_params(m.dim as usize, &params).is_err()
            || m.centroids_per_block == 0
            || m.codes_per_block == 0
            || !residual_consistent
        {
            return Err(format!("pq meta block: inconsistent fields {m:?}"));
        }
        Ok(m)
    }
    /// Blocks of the whole run, the meta block included.
    pub fn run_blocks(&self) -> usize {
        run_blocks(&self.sections())
    }
    /// Blocks of the residual codes at the run's end (centroids and codes; 0 without them).
    pub fn residual_blocks(&self) -> usize {
        self.sections().iter().skip(3).map(Section::blocks).sum()
    }
    /// The centroid rows, the codes, then the sample codes (packed as the codes are; none
    /// before version 3), then, where the run has them, the residual centroid rows and codes.
    fn sections(&self) -> Vec<Section> {
        let s = self.shape();
        let codes = |records| Section { records, size: s.m, per_block: self.codes_per_block as usize };
        let mut sections = vec![
            Section { records: s.m * s.k, size: 2 * s.sub(), per_block: self.centroids_per_block as usize },
            codes(self.tokens as usize),
            codes(s.samples()),
        ];
        if let Some(r) = self.residual_shape() {
            sections.extend(r.sections(self.residual_centroids_per_block, self.residual_codes_per_block));
        }
        sections
    }
    /// The residual codes' shape, where the run has them.
    fn residual_shape(&self) -> Option<ResidualShape> {
        ResidualShape::of(self.tokens as usize, self.dim as usize, &self.params)
    }
    fn shape(&self) -> Shape {
        let layout = if self.version >= 2 { CodeLayout::SubspaceMajor } else { CodeLayout::TokenMajor };
        let per_block = self.codes_per_block as usize;
        Shape {
            tokens: self.tokens,
            dim: self.dim as usize,
            m: self.params.m as usize,
            k: 1 << self.params.bits,
            layout,
            per_block,
            sample_stride: self.sample_stride as usize,
        }
    }
}

fn check_params(dim: usize, p: &PqParams) -> Result<(), String> {
    let splits = |m: u32| m > 0 && dim.is_multiple_of(m as usize);
    if dim == 0 || !splits(p.m) || !(1..=8).contains(&p.bits) || (p.residual > 0 && !splits(p.residual)) {
        return Err(format!(
            "pq: {dim} channels cannot be split by {p:?} (m and a residual's subspaces must divide d, 1 ≤ bits ≤ 8)"
        ));
    }
    Ok(())
}

/// What scoring needs to know about the records.
#[derive(Clone, Copy)]
struct Shape {
    tokens: u32,
    dim: usize,
    m: usize,
    /// Centroids per subspace.
    k: usize,
    layout: CodeLayout,
    /// Tokens per code block (subspace-major codes are scanned a whole block at a time).
    per_block: usize,
    /// The sample codes' stride (0: none).
    sample_stride: usize,
}

impl Shape {
    fn sub(&self) -> usize {
        self.dim / self.m
    }
    /// Bytes of all centroids.
    fn centroid_bytes(&self) -> usize {
        self.m * self.k * self.sub() * 2
    }
    /// The codes' and centroids' bytes per token (the sample codes, a `sample_stride`-th
    /// of the codes, are left out).
    fn per_token(&self) -> f64 {
        self.m as f64 + self.centroid_bytes() as f64 / self.tokens.max(1) as f64
    }
    /// Sample codes: one per `sample_stride` tokens.
    fn samples(&self) -> usize {
        match self.sample_stride {
            0 => 0,
            stride => (self.tokens as usize).div_ceil(stride),
        }
    }
    /// Of `records` packed as code blocks are, the whole blocks holding the first `wanted`:
    /// subspace-major blocks are read whole.
    fn whole_blocks(&self, wanted: usize, records: usize) -> usize {
        (wanted.div_ceil(self.per_block) * self.per_block).min(records)
    }
}

/// Codes and centroids in memory: what the import builds and encodes.
#[derive(Debug, Clone, PartialEq)]
pub struct Pq {
    tokens: u32,
    dim: usize,
    params: PqParams,
    /// `m · 2^b` rows of `d / m`: subspace `j`'s centroid `c` is row `j · 2^b + c`.
    centroids: Vec<f16>,
    /// Subspace-major over all tokens: subspace `j`'s code of token `t` is byte `j · n + t`,
    /// so that a scan looks codes up without transposing them.
    codes: Vec<u8>,
    /// The codes of every [`SAMPLE_STRIDE`]-th token, subspace-major as `codes` are.
    samples: Vec<u8>,
    /// The residual codes, where `params.residual` asks for them.
    residual: Option<Residual>,
}

impl Pq {
    /// Trains the centroids and encodes every key (subspaces in parallel; the result does
    /// not depend on the thread count).
    pub fn build(keys: &MemKeys, p: &PqParams) -> Result<Pq, String> {
        let (d, n) = (keys.dim(), keys.len() as usize);
        check_params(d, p)?;
        let (m, k) = (p.m as usize, 1usize << p.bits);
        let sub = d / m;
        let channels = |t: u32, from: usize, to: usize| keys.row(t)[from..to].iter().map(|x| x.to_f32());
        let (centroids, codes) = quantise(n, m, sub, k, p, 0, &|j| {
            (0..n as u32).flat_map(|t| channels(t, j * sub, (j + 1) * sub)).collect()
        });
        let samples =
            codes.chunks(n.max(1)).flat_map(|sub| sub.iter().step_by(SAMPLE_STRIDE as usize)).copied().collect();
        let mut pq = Pq { tokens: n as u32, dim: d, params: *p, centroids, codes, samples, residual: None };
        pq.residual = ResidualShape::of(n, d, p).filter(ResidualShape::amortised).map(|shape| {
            // Residual subspace `i`'s channels of every key, less the codes' reconstruction.
            let (sub_r, pq) = (shape.sub(), &pq);
            let (centroids, by_subspace) = quantise(n, shape.m, sub_r, shape.k, p, m as u64, &|i| {
                (0..n as u32)
                    .flat_map(|t| {
                        let rebuilt = (i * sub_r..(i + 1) * sub_r).map(move |c| pq.channel(t, c));
                        channels(t, i * sub_r, (i + 1) * sub_r).zip(rebuilt).map(|(x, r)| x - r)
                    })
                    .collect()
            });
            // Token-major: a candidate's codes are looked up together.
            let mut codes = vec![0u8; n * shape.m];
            for (i, column) in by_subspace.chunks(n.max(1)).enumerate() {
                for (t, &c) in column.iter().enumerate() {
                    codes[t * shape.m + i] = c;
                }
            }
            Residual { shape, centroids, codes }
        });
        // What was built: no residual subspaces where none were.
        pq.params.residual = pq.residual.as_ref().map_or(0, |r| r.shape.m as u32);
        Ok(pq)
    }

    pub fn params(&self) -> &PqParams {
        &self.params
    }

    /// Channel `c` of token `t`'s key as its codes reconstruct it.
    fn channel(&self, t: u32, c: usize) -> f32 {
        let s = self.shape();
        let (j, within) = (c / s.sub(), c % s.sub());
        let row = j * s.k + self.codes[j * self.tokens as usize + t as usize] as usize;
        self.centroids[row * s.sub() + within].to_f32()
    }

    /// Whether the codes carry residual codes ([`Pq::refine`]).
    pub fn has_residual(&self) -> bool {
        self.residual.is_some()
    }

    /// The residual codes' tables of `q` ([`Pq::refine`]); `None` where the codes have no
    /// residual codes.
    pub fn residual_table(&self, q: &[f32]) -> Result<Option<ResidualTable>, BufferError> {
        let Some(r) = &self.residual else { return Ok(None) };
        residual::table(&r.records().0, r.shape, q, &mut SearchStats::default()).map(Some)
    }

    /// Adds to `scores[i]` the residual codes' part of token `ids[i]`'s score (`ids`
    /// ascending) by the query whose tables `table` are ([`Pq::residual_table`]): an
    /// approximate score plus it is the score of the key the codes and the residual codes
    /// together reconstruct.
    pub fn refine(&self, table: &ResidualTable, ids: &[u32], scores: &mut [f32]) -> Result<(), BufferError> {
        let Some(r) = &self.residual else { return Err(super::invalid("pq codes without residual codes".into())) };
        residual::refine(&r.records().1, r.shape, table, ids, scores, &mut SearchStats::default())
    }

    /// Token `t`'s key as its codes reconstruct it.
    pub fn reconstruct(&self, t: u32) -> Vec<f32> {
        (0..self.dim).map(|c| self.channel(t, c)).collect()
    }

    /// Every approximate score below the prefix (what [`Coarse::select`] ranks).
    pub fn token_scores(&self, q: &[f32], prefix: Option<u32>) -> Result<Vec<f32>, BufferError> {
        let (c, k, _) = self.mem();
        one_query(&c, &k, self.shape(), q, prefix)
    }

    /// [`Pq::token_scores`] of each query of `queries` (rows of the index's dimension), in
    /// one pass over the codes.
    pub fn token_scores_many(&self, queries: &[f32], prefix: Option<u32>) -> Result<GroupScan, BufferError> {
        let (c, k, _) = self.mem();
        token_scores(&c, &k, self.shape(), queries, prefix)
    }

    /// [`PagedPq::token_scores_many_by`] of the codes in memory.
    pub fn token_scores_many_by<E>(&self, queries: &[f32], prefix: Option<u32>, scan: impl ScanCodes<E>) -> ScanBy<E> {
        scores_by(&self.mem().0, self.shape(), queries, prefix, scan)
    }

    /// [`PagedPq::token_best_many_by`] of the codes in memory.
    pub fn token_best_many_by<E>(
        &self,
        queries: &[f32],
        prefix: Option<u32>,
        k: usize,
        stride: u32,
        keep: &mut impl KeepCodes<E>,
    ) -> KeptBy<E> {
        kept_by(&self.mem().0, self.shape(), queries, prefix, (k, stride), keep)
    }

    /// [`PagedPq::token_best_many`] of the codes in memory.
    pub fn token_best_many(
        &self,
        queries: &[f32],
        prefix: Option<u32>,
        k: usize,
        stride: u32,
    ) -> Result<Option<KeptGroup>, BufferError> {
        let (c, codes, samples) = self.mem();
        kept_here(&c, (&codes, Some(&samples)), self.shape(), queries, prefix, (k, stride))
    }

    /// [`PagedPq::token_above_many`] of the codes in memory.
    pub fn token_above_many(
        &self,
        queries: &[f32],
        prefix: Option<u32>,
        stride: u32,
        cut: &dyn Fn(usize, &[f32]) -> Option<f32>,
    ) -> Result<Option<AboveGroup>, BufferError> {
        let (c, codes, samples) = self.mem();
        above_here(&c, (&codes, Some(&samples)), self.shape(), queries, prefix, stride, cut)
    }

    /// The codes as one block of every token, subspace-major.
    pub fn code_bytes(&self) -> &[u8] {
        &self.codes
    }

    /// The meta block, the centroid blocks, then the code blocks, for blocks of `payload`
    /// bytes.
    pub fn payloads(&self, payload: usize) -> Result<Vec<Vec<u8>>, String> {
        let s = self.shape();
        let (cper, cblocks) = pack(bytemuck::cast_slice(&self.centroids), 2 * s.sub(), payload, "pq centroid")?;
        let tper = records_per_block(s.m, payload, "pq code")?;
        // Sample blocks only where the sample fills one: below that, a mostly empty block
        // would weigh a fifth of a 4,096-token run's codes, whose every score is soon scanned.
        let sample_stride = if s.samples() >= tper as usize { SAMPLE_STRIDE } else { 0 };
        let (mut rcper, mut rtper, mut residual) = (0, 0, Vec::new());
        if let Some(r) = &self.residual {
            let (c, blocks) =
                pack(bytemuck::cast_slice(&r.centroids), 2 * r.shape.sub(), payload, "pq residual centroid")?;
            let (t, codes) = pack(&r.codes, r.shape.m, payload, "pq residual code")?;
            (rcper, rtper) = (c, t);
            residual = blocks.into_iter().chain(codes).collect();
        }
        let meta = PqMeta {
            version: PQ_VERSION,
            tokens: self.tokens,
            dim: self.dim as u32,
            params: self.params,
            centroids_per_block: cper,
            codes_per_block: tper,
            sample_stride,
            residual_centroids_per_block: rcper,
            residual_codes_per_block: rtper,
        };
        let codes = code_blocks(&self.codes, s.m, tper);
        let samples = if sample_stride > 0 { code_blocks(&self.samples, s.m, tper) } else { Vec::new() };
        Ok(std::iter::once(meta.encode()).chain(cblocks).chain(codes).chain(samples).chain(residual).collect())
    }

    fn shape(&self) -> Shape {
        Shape {
            tokens: self.tokens,
            dim: self.dim,
            m: self.params.m as usize,
            k: 1 << self.params.bits,
            layout: CodeLayout::SubspaceMajor,
            // One block of every token (at least one, so that no context divides by zero).
            per_block: (self.tokens as usize).max(1),
            sample_stride: SAMPLE_STRIDE as usize,
        }
    }
    /// The centroids, the codes and the sample codes as records.
    fn mem(&self) -> (MemRecords<'_>, MemRecords<'_>, MemRecords<'_>) {
        let s = self.shape();
        (
            MemRecords { bytes: bytemuck::cast_slice(&self.centroids), size: 2 * s.sub() },
            MemRecords { bytes: &self.codes, size: s.m },
            MemRecords { bytes: &self.samples, size: s.m },
        )
    }
}

impl Coarse for Pq {
    fn tokens(&self) -> u32 {
        self.tokens
    }
    fn metadata_bytes_per_token(&self) -> f64 {
        self.shape().per_token() + self.residual.as_ref().map_or(0.0, |r| r.shape.per_token())
    }
    fn select(&self, q: &[f32], budget_tokens: usize, prefix: Option<u32>) -> Result<CoarseResult, BufferError> {
        let (c, k, samples) = self.mem();
        select(&c, (&k, Some(&samples)), self.shape(), q, budget_tokens, prefix)
    }
}

/// A stored PQ index read through the buffer pool.
pub struct PagedPq<'p> {
    meta: PqMeta,
    centroids: PagedRecords<'p>,
    codes: PagedRecords<'p>,
    /// The sample codes (version 3 on).
    samples: Option<PagedRecords<'p>>,
    /// The residual codes (version 4 on, where the run has them).
    residual: Option<PagedResidual<'p>>,
}

impl<'p> PagedPq<'p> {
    /// Opens a PQ index from the block requests of its run (meta block first).
    pub fn open(pool: &'p BufferPool, blocks: impl Into<Blocks<'p>>) -> Result<PagedPq<'p>, String> {
        Self::open_held(pool, blocks, None)
    }

    /// [`PagedPq::open`], reading the run's blocks from `held` where it holds them resident:
    /// the run's block `b` is `held`'s block `from + b` (a compact context's holds). Sections
    /// past the held blocks' end (residual codes a lean compact context streams) go through
    /// the pool.
    pub fn open_held(
        pool: &'p BufferPool,
        blocks: impl Into<Blocks<'p>>,
        held: Option<(&'p ResidentBlocks, usize)>,
    ) -> Result<PagedPq<'p>, String> {
        let blocks = blocks.into();
        let meta = PqMeta::decode(&read_meta(pool, blocks, "pq index")?)?;
        let sections = meta.sections();
        check_run(pool, blocks.len(), &sections, "pq index")?;
        let (c, t, samples) = (sections[0], sections[1], sections[2]);
        let split = 1 + c.blocks();
        let samples_at = split + t.blocks();
        let residual_at = samples_at + samples.blocks();
        let records = |at: usize, to: usize, s: Section| {
            PagedRecords::new(pool, blocks.range(at..to), s.size, s.per_block).held_in_run(held, at)
        };
        let residual = meta.residual_shape().map(|shape| {
            let held = held.map(|(h, from)| (h, from + residual_at));
            PagedResidual::open(pool, blocks.skip(residual_at), shape, [sections[3], sections[4]], held)
        });
        Ok(PagedPq {
            meta,
            centroids: records(1, split, c),
            codes: records(split, samples_at, t),
            samples: (samples.records > 0).then(|| records(samples_at, residual_at, samples)),
            residual,
        })
    }

    /// The codes and, from version 3 on, the sample codes.
    fn code_records(&self) -> (&dyn Records, Option<&dyn Records>) {
        (&self.codes, self.samples.as_ref().map(|s| s as &dyn Records))
    }

    pub fn meta(&self) -> &PqMeta {
        &self.meta
    }

    /// [`Pq::residual_table`] of the stored codes; the blocks read count in `stats`.
    pub fn residual_table(&self, q: &[f32], stats: &mut SearchStats) -> Result<Option<ResidualTable>, BufferError> {
        let Some(r) = &self.residual else { return Ok(None) };
        residual::table(&r.centroids, r.shape, q, stats).map(Some)
    }

    /// [`Pq::refine`] of the stored codes; the blocks read count in `stats`.
    pub fn refine(
        &self,
        table: &ResidualTable,
        ids: &[u32],
        scores: &mut [f32],
        stats: &mut SearchStats,
    ) -> Result<(), BufferError> {
        let Some(r) = &self.residual else { return Err(super::invalid("pq codes without residual codes".into())) };
        residual::refine(&r.codes, r.shape, table, ids, scores, stats)
    }

    /// Every approximate score below the prefix, as [`Pq::token_scores`].
    pub fn token_scores(&self, q: &[f32], prefix: Option<u32>) -> Result<Vec<f32>, BufferError> {
        one_query(&self.centroids, &self.codes, self.meta.shape(), q, prefix)
    }

    /// [`PagedPq::token_scores`] of each query of `queries` (rows of the index's dimension),
    /// in one pass over the codes.
    pub fn token_scores_many(&self, queries: &[f32], prefix: Option<u32>) -> Result<GroupScan, BufferError> {
        token_scores(&self.centroids, &self.codes, self.meta.shape(), queries, prefix)
    }

    /// [`PagedPq::token_scores_many`] with the lookups done by `scan` (a device holding the
    /// codes, say) instead of the pool's code blocks. The centroids are read through the pool.
    pub fn token_scores_many_by<E>(&self, queries: &[f32], prefix: Option<u32>, scan: impl ScanCodes<E>) -> ScanBy<E> {
        scores_by(&self.centroids, self.meta.shape(), queries, prefix, scan)
    }

    /// Each query's `k` best tokens and every `stride`-th score ([`KeptScores`]), the scan and
    /// the passes over its scores done by `keep` (a device holding the codes), which reads back
    /// only those. The centroids are read through the pool. `None` where a sample cannot bound
    /// the best: the caller then reads every score ([`PagedPq::token_scores_many_by`]).
    pub fn token_best_many_by<E>(
        &self,
        queries: &[f32],
        prefix: Option<u32>,
        k: usize,
        stride: u32,
        keep: &mut impl KeepCodes<E>,
    ) -> KeptBy<E> {
        kept_by(&self.centroids, self.meta.shape(), queries, prefix, (k, stride), keep)
    }

    /// Each query's `k` best tokens and every `stride`-th score ([`KeptScores`]), as
    /// [`PagedPq::token_best_many_by`] gives them, scanned on this core: the cut comes from
    /// the run's sample codes, and the scores of the tokens reaching it are made, not every
    /// token's. `None` where the run has no sample codes of `stride` (versions 1 and 2, short
    /// runs) or a sample cannot bound the best: the caller then takes
    /// [`PagedPq::token_scores_many`].
    pub fn token_best_many(
        &self,
        queries: &[f32],
        prefix: Option<u32>,
        k: usize,
        stride: u32,
    ) -> Result<Option<KeptGroup>, BufferError> {
        kept_here(&self.centroids, self.code_records(), self.meta.shape(), queries, prefix, (k, stride))
    }

    /// Each query's tokens whose score reaches a cut, and every `stride`-th score
    /// ([`ScoresAbove`]), scanned on this core as [`PagedPq::token_best_many`] scans: `cut`
    /// gives query `i`'s cut from its sample. `None` where the run has no sample codes of
    /// `stride`: the caller then takes [`PagedPq::token_scores_many`]. A query for which `cut`
    /// gives none, or whose cut more than a quarter of the tokens reach, has none: the caller
    /// scans its every score.
    pub fn token_above_many(
        &self,
        queries: &[f32],
        prefix: Option<u32>,
        stride: u32,
        cut: &dyn Fn(usize, &[f32]) -> Option<f32>,
    ) -> Result<Option<AboveGroup>, BufferError> {
        above_here(&self.centroids, self.code_records(), self.meta.shape(), queries, prefix, stride, cut)
    }

    /// Every code block's bytes in order, checked, for a copy the scan can read elsewhere
    /// ([`PagedPq::token_scores_many_by`]; blocks of `codes_per_block` tokens); `None` for
    /// token-major codes (version 1), which only the pool's scan transposes.
    pub fn code_bytes(&self) -> Result<Option<Vec<u8>>, BufferError> {
        code_bytes(&self.codes, self.meta.shape())
    }
}

impl Coarse for PagedPq<'_> {
    fn tokens(&self) -> u32 {
        self.meta.tokens
    }
    fn metadata_bytes_per_token(&self) -> f64 {
        self.meta.shape().per_token() + self.meta.residual_shape().map_or(0.0, |r| r.per_token())
    }
    fn select(&self, q: &[f32], budget_tokens: usize, prefix: Option<u32>) -> Result<CoarseResult, BufferError> {
        select(&self.centroids, self.code_records(), self.meta.shape(), q, budget_tokens, prefix)
    }
}

/// Every token's approximate score for each query of `queries` (rows of `dim`): a lookup
/// table per query (one pass over the centroids), then one pass over the codes for all of
/// them, as the flat plan scores a GQA group's q heads in one pass over the keys.
fn token_scores(
    centroids: &dyn Records,
    codes: &dyn Records,
    s: Shape,
    queries: &[f32],
    prefix: Option<u32>,
) -> Result<GroupScan, BufferError> {
    check_queries(queries, s.dim)?;
    let mut stats = SearchStats::default();
    let tables = tables(centroids, s, queries, &mut stats)?;
    let lim = limit(s.tokens, prefix) as usize;
    let nq = tables.len();
    // Every score below `lim` of every query is written by the scan below.
    let mut out = crate::scratch::scores(nq * lim);
    // The best of each run, taken from each slice's scores while they are in the cache.
    let runs = lim.div_ceil(BEST_RUN);
    let mut run_best = vec![f32::NEG_INFINITY; nq * runs];
    // Subspace-major blocks are scanned whole (the last one's tokens past the prefix are
    // scored and dropped); token-major codes are transposed a run at a time.
    let end = match s.layout {
        CodeLayout::SubspaceMajor => (lim.div_ceil(s.per_block) * s.per_block).min(s.tokens as usize),
        CodeLayout::TokenMajor => lim,
    };
    let slice = scan_slice(s);
    codes.visit(0..end, &mut stats, &mut |first, bytes| {
        let tokens = bytes.len() / s.m;
        check_codes(bytes, s, first, tokens)?;
        let run = match s.layout {
            CodeLayout::SubspaceMajor => tokens.max(1),
            CodeLayout::TokenMajor => TRANSPOSED_RUN,
        };
        for (i, part) in bytes.chunks(run * s.m).enumerate() {
            let at = first + i * run;
            let r = part.len() / s.m;
            let transposed;
            let sub = match s.layout {
                CodeLayout::SubspaceMajor => part,
                CodeLayout::TokenMajor => {
                    transposed = subspace_major(part, s.m);
                    &transposed[..]
                }
            };
            let wanted = lim.saturating_sub(at).min(r);
            // A slice of the run's tokens at a time for every query: the slice's codes stay in
            // the core's cache from one query to the next.
            for from in (0..wanted).step_by(slice) {
                let to = (from + slice).min(wanted);
                for (t, lut) in tables.iter().enumerate() {
                    let scores = &mut out[t * lim + at + from..t * lim + at + to];
                    ctxfs_kernels::pq_scores(lut, sub, r, from, scores);
                    fold_run_best(scores, at + from, &mut run_best[t * runs..(t + 1) * runs]);
                }
            }
        }
        Ok(())
    })?;
    stats.keys_scored = lim as u64;
    Ok(GroupScan::with_run_best(out, run_best, lim, stats))
}

/// A scan of codes held elsewhere (a GPU's copy, say): `scan(tables, lim, out)` writes query
/// `i`'s scores of tokens `0..lim` to `out[i·lim..(i + 1)·lim]`, as
/// [`ctxfs_kernels::pq_scores`] computes them from the code blocks, or fails with `E`.
pub trait ScanCodes<E>: FnOnce(&[PqLut], usize, &mut [f32]) -> Result<(), E> {}
impl<E, F: FnOnce(&[PqLut], usize, &mut [f32]) -> Result<(), E>> ScanCodes<E> for F {}

/// A group scan by [`ScanCodes`]: the outer error is the pool's (reading the centroids), the
/// inner one the scan's.
pub type ScanBy<E> = Result<Result<GroupScan, E>, BufferError>;

/// Scores as [`token_scores`] gives them, the lookups done by `scan`.
fn scores_by<E>(
    centroids: &dyn Records,
    s: Shape,
    queries: &[f32],
    prefix: Option<u32>,
    scan: impl ScanCodes<E>,
) -> ScanBy<E> {
    check_queries(queries, s.dim)?;
    let mut stats = SearchStats::default();
    let tables = tables(centroids, s, queries, &mut stats)?;
    let lim = limit(s.tokens, prefix) as usize;
    let mut out = crate::scratch::scores(tables.len() * lim);
    if let Err(e) = scan(&tables, lim, &mut out) {
        crate::scratch::give_back(out);
        return Ok(Err(e));
    }
    let runs = lim.div_ceil(BEST_RUN);
    let mut run_best = vec![f32::NEG_INFINITY; tables.len() * runs];
    for (scores, best) in out.chunks_exact(lim.max(1)).zip(run_best.chunks_exact_mut(runs.max(1))) {
        fold_run_best(scores, 0, best);
    }
    stats.keys_scored = lim as u64;
    Ok(Ok(GroupScan::with_run_best(out, run_best, lim, stats)))
}

/// A scan that makes only each query's best ([`PagedPq::token_best_many_by`]): a device's,
/// which keeps every score and reads back only these, or this core's
/// ([`PagedPq::token_best_many`]), which makes no other.
pub trait KeepCodes<E> {
    /// Every `stride`-th score of tokens `0..lim` by each query's tables `luts` (⌈lim / stride⌉
    /// per query, query after query). A device scans every token here and keeps the scores.
    fn scan_sampled(&mut self, luts: &[PqLut], lim: usize, stride: usize) -> Result<Vec<f32>, E>;
    /// Each query's tokens below `lim` whose score by `luts[q]` reaches `cuts[q]` (in
    /// [`f32::total_cmp`]'s order): how many, and the first `cap` found. A device takes them
    /// from the scores it kept.
    fn reaching(&mut self, luts: &[PqLut], lim: usize, cuts: &[f32], cap: usize) -> Result<Vec<Reached>, E>;
}

/// One query's codes' scores where the scan kept only its best: every `stride`-th token's
/// score for the `stride` the caller gave (a sample, at the seeds' tokens when `stride` is
/// theirs), and the `k` best tokens by score (ties: the lower token), as (token, score),
/// ascending by token: what [`take_tokens`] would take from every score.
#[derive(Debug, Clone, PartialEq)]
pub struct KeptScores {
    pub samples: Vec<f32>,
    pub best: Vec<(u32, f32)>,
}

/// A GQA group's [`KeptScores`], query after query, and the work the scan counts.
#[derive(Debug, Clone, PartialEq)]
pub struct KeptGroup {
    pub queries: Vec<KeptScores>,
    pub stats: SearchStats,
}

/// A group's kept scores by [`KeepCodes`]: the outer error is the pool's (reading the
/// centroids), the inner one the scan's; `None` where a sample cannot bound the best.
pub type KeptBy<E> = Result<Result<Option<KeptGroup>, E>, BufferError>;

/// [`PagedPq::token_best_many_by`] and, by [`KeptHere`], [`PagedPq::token_best_many`]: each
/// query's cut from its sample (as [`take_tokens`] cuts), the tokens reaching it
/// ([`reaching_by`]), of which the `k` best. A query whose cut leaves fewer than `k`, or more
/// than there is room for, gives `None` for the group.
fn kept_by<E>(
    centroids: &dyn Records,
    s: Shape,
    queries: &[f32],
    prefix: Option<u32>,
    (k, stride): (usize, u32),
    keep: &mut impl KeepCodes<E>,
) -> KeptBy<E> {
    let cut = |_: usize, sample: &[f32]| cut_of_sample(sample.to_vec(), stride.max(1) as usize, k);
    let room = kept_room(stride.max(1) as usize, k);
    let group = match reaching_by(centroids, s, queries, prefix, stride, &cut, room, keep)? {
        Ok(Some(group)) => group,
        other => return Ok(other.map(|_| None)),
    };
    let mut kept = Vec::with_capacity(group.queries.len());
    for q in group.queries {
        match q {
            Some(q) if q.tokens.len() >= k => {
                kept.push(KeptScores { samples: q.samples, best: best_pairs(q.tokens, k) })
            }
            _ => return Ok(Ok(None)),
        }
    }
    Ok(Ok(Some(KeptGroup { queries: kept, stats: group.stats })))
}

/// One query's codes' scores where the scan kept those reaching a cut: every `stride`-th
/// token's score (the sample, as in [`KeptScores`]), the cut (`floor`) and every token whose
/// score reaches it, as (token, score), ascending by token.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoresAbove {
    pub samples: Vec<f32>,
    pub floor: f32,
    pub tokens: Vec<(u32, f32)>,
}

/// A GQA group's [`ScoresAbove`], query after query (`None` for a query that had no cut or
/// whose cut more tokens reached than there was room for), and the work the scan counts.
#[derive(Debug, Clone, PartialEq)]
pub struct AboveGroup {
    pub queries: Vec<Option<ScoresAbove>>,
    pub stats: SearchStats,
}

/// The tables, the scan of `keep` with its sample, each query's cut from its index and its
/// sample (`cut`), then every token reaching it. `None` for a query without a cut or whose
/// cut more than `room` tokens reach, and for the group where the sample is not whole.
#[allow(clippy::too_many_arguments)]
fn reaching_by<E>(
    centroids: &dyn Records,
    s: Shape,
    queries: &[f32],
    prefix: Option<u32>,
    stride: u32,
    cut: &dyn Fn(usize, &[f32]) -> Option<f32>,
    room: usize,
    keep: &mut impl KeepCodes<E>,
) -> Result<Result<Option<AboveGroup>, E>, BufferError> {
    check_queries(queries, s.dim)?;
    let mut stats = SearchStats::default();
    let tables = tables(centroids, s, queries, &mut stats)?;
    let (lim, stride) = (limit(s.tokens, prefix) as usize, stride.max(1) as usize);
    stats.keys_scored = lim as u64;
    let samples = match keep.scan_sampled(&tables, lim, stride) {
        Ok(samples) => samples,
        Err(e) => return Ok(Err(e)),
    };
    let per = lim.div_ceil(stride);
    if per == 0 || samples.len() != per * tables.len() {
        return Ok(Ok(None));
    }
    let cuts: Vec<Option<f32>> = samples.chunks_exact(per).enumerate().map(|(q, sample)| cut(q, sample)).collect();
    // No token reaches +∞: a query without a cut costs the scan nothing.
    let reaching: Vec<f32> = cuts.iter().map(|c| c.unwrap_or(f32::INFINITY)).collect();
    let reached = match keep.reaching(&tables, lim, &reaching, room) {
        Ok(reached) => reached,
        Err(e) => return Ok(Err(e)),
    };
    let mut above = Vec::with_capacity(reached.len());
    for ((mut reached, samples), floor) in reached.into_iter().zip(samples.chunks_exact(per)).zip(cuts) {
        let whole = reached.count <= room && reached.tokens.len() == reached.count;
        above.push(floor.filter(|_| whole).map(|floor| {
            reached.tokens.sort_unstable_by_key(|p| p.0);
            ScoresAbove { samples: samples.to_vec(), floor, tokens: reached.tokens }
        }));
    }
    Ok(Ok((above.len() == tables.len()).then_some(AboveGroup { queries: above, stats })))
}

/// [`KeepCodes`] on this core: the sample is the scores of the sample codes (every
/// [`SAMPLE_STRIDE`]-th token's codes, stored apart), and the scan of the code blocks makes
/// the scores only of the tokens reaching each query's cut ([`ctxfs_kernels::pq_reaching`]),
/// not every token's for passes over them.
struct KeptHere<'a> {
    codes: &'a dyn Records,
    samples: &'a dyn Records,
    s: Shape,
    /// The blocks both visits touch.
    stats: SearchStats,
}

impl<'a> KeptHere<'a> {
    /// The kept scan of a run with sample codes of `stride`; `None` where it has none.
    fn of(codes: &'a dyn Records, samples: Option<&'a dyn Records>, s: Shape, stride: u32) -> Option<KeptHere<'a>> {
        let sampled = stride as usize == s.sample_stride && s.layout == CodeLayout::SubspaceMajor;
        let samples = samples.filter(|_| sampled)?;
        Some(KeptHere { codes, samples, s, stats: SearchStats::default() })
    }
}

impl KeepCodes<BufferError> for KeptHere<'_> {
    fn scan_sampled(&mut self, luts: &[PqLut], lim: usize, stride: usize) -> Result<Vec<f32>, BufferError> {
        let (s, per) = (self.s, lim.div_ceil(stride));
        // Subspace-major blocks are visited whole; their records past `per` are not scored.
        let mut samples = vec![0.0; luts.len() * per];
        self.samples.visit(0..s.whole_blocks(per, s.samples()), &mut self.stats, &mut |first, bytes| {
            let r = bytes.len() / s.m;
            check_samples(bytes, s, first, r)?;
            let wanted = per.saturating_sub(first).min(r);
            for (q, lut) in luts.iter().enumerate() {
                ctxfs_kernels::pq_scores(lut, bytes, r, 0, &mut samples[q * per + first..q * per + first + wanted]);
            }
            Ok(())
        })?;
        Ok(samples)
    }

    fn reaching(&mut self, luts: &[PqLut], lim: usize, cuts: &[f32], cap: usize) -> Result<Vec<Reached>, BufferError> {
        let (s, slice) = (self.s, scan_slice(self.s));
        // A cut no sum reaches is reached by no token (`u32::MAX`).
        let sum_cuts: Vec<SumCut> = luts
            .iter()
            .zip(cuts)
            .map(|(lut, &cut)| SumCut { least: lut.least_sum_reaching(cut).unwrap_or(u32::MAX), cap })
            .collect();
        let mut reached = vec![Reached::default(); luts.len()];
        self.codes.visit(0..s.whole_blocks(lim, s.tokens as usize), &mut self.stats, &mut |first, bytes| {
            let tokens = bytes.len() / s.m;
            check_codes(bytes, s, first, tokens)?;
            let run = ctxfs_kernels::CodeRun { codes: bytes, tokens, first: first as u32 };
            let wanted = lim.saturating_sub(first).min(tokens);
            // A slice of the run's tokens at a time for every query, as `token_scores` scans.
            for from in (0..wanted).step_by(slice) {
                ctxfs_kernels::pq_reaching(luts, run, from..(from + slice).min(wanted), &sum_cuts, &mut reached);
            }
            Ok(())
        })?;
        Ok(reached)
    }
}

/// [`kept_by`] on this core ([`KeptHere`]); `None` also where there are no sample codes of
/// `stride` (token-major codes, runs of version 2, short runs): the caller then scans every
/// score.
fn kept_here(
    centroids: &dyn Records,
    (codes, samples): (&dyn Records, Option<&dyn Records>),
    s: Shape,
    queries: &[f32],
    prefix: Option<u32>,
    (k, stride): (usize, u32),
) -> Result<Option<KeptGroup>, BufferError> {
    let Some(mut keep) = KeptHere::of(codes, samples, s, stride) else {
        return Ok(None);
    };
    let kept = kept_by(centroids, s, queries, prefix, (k, stride), &mut keep)??;
    Ok(kept.map(|mut group| {
        group.stats += keep.stats;
        group
    }))
}

/// [`reaching_by`] on this core ([`KeptHere`]), with room for [`above_room`] tokens per
/// query; `None` also where there are no sample codes of `stride`, as for [`kept_here`].
fn above_here(
    centroids: &dyn Records,
    (codes, samples): (&dyn Records, Option<&dyn Records>),
    s: Shape,
    queries: &[f32],
    prefix: Option<u32>,
    stride: u32,
    cut: &dyn Fn(usize, &[f32]) -> Option<f32>,
) -> Result<Option<AboveGroup>, BufferError> {
    let Some(mut keep) = KeptHere::of(codes, samples, s, stride) else {
        return Ok(None);
    };
    let room = above_room(limit(s.tokens, prefix) as usize);
    let above = reaching_by(centroids, s, queries, prefix, stride, cut, room, &mut keep)??;
    Ok(above.map(|mut group| {
        group.stats += keep.stats;
        group
    }))
}

/// The most tokens of `lim` a scan keeping those above a cut keeps for a query: a quarter.
/// Kept as (token, score) they take half the bytes of every score.
fn above_room(lim: usize) -> usize {
    lim.div_ceil(4)
}

/// The most tokens a scan keeping each query's best keeps for it, cutting at the sample's
/// cut for `k`: that cut's rank + 1 samples reach it, so about that many times `stride`
/// tokens do; twice that is over 5 standard deviations of the sample's error at a rank of
/// 30. More reaching it gives up the kept scan for every score.
fn kept_room(stride: usize, k: usize) -> usize {
    2 * (cut_rank(stride, k) + 1) * stride
}

/// Code blocks of `per` records each, subspace-major within a block (PQ layout version 2
/// on), cut from `codes`: `m` bytes per record, held subspace-major over all of them.
fn code_blocks(codes: &[u8], m: usize, per: u32) -> Vec<Vec<u8>> {
    let n = codes.len() / m.max(1);
    (0..n)
        .step_by(per as usize)
        .map(|first| {
            let last = (first + per as usize).min(n);
            codes.chunks_exact(n).flat_map(|sub| &sub[first..last]).copied().collect()
        })
        .collect()
}

/// Every code block's bytes in order, checked; `None` for token-major codes.
fn code_bytes(codes: &dyn Records, s: Shape) -> Result<Option<Vec<u8>>, BufferError> {
    if s.layout != CodeLayout::SubspaceMajor {
        return Ok(None);
    }
    let mut all = Vec::with_capacity(s.tokens as usize * s.m);
    codes.visit(0..s.tokens as usize, &mut SearchStats::default(), &mut |first, bytes| {
        check_codes(bytes, s, first, bytes.len() / s.m)?;
        all.extend_from_slice(bytes);
        Ok(())
    })?;
    Ok(Some(all))
}

/// Each query's lookup tables (rows of `dim` in `queries`), from one pass over the centroids.
fn tables(
    centroids: &dyn Records,
    s: Shape,
    queries: &[f32],
    stats: &mut SearchStats,
) -> Result<Vec<PqLut>, BufferError> {
    let sub = s.sub();
    let nq = queries.len() / s.dim;
    let mut luts = vec![0.0f32; nq * s.m * s.k];
    centroid_runs(centroids, s.m, s.k, sub, stats, &mut |j, rows, part| {
        for (t, q) in queries.chunks_exact(s.dim).enumerate() {
            let lut = &mut luts[t * s.m * s.k..(t + 1) * s.m * s.k];
            ctxfs_kernels::pq_table(part, &q[j * sub..(j + 1) * sub], &mut lut[rows.clone()]);
        }
    })?;
    Ok(luts.chunks_exact(s.m * s.k).map(|lut| PqLut::quantise(lut, s.k)).collect())
}

/// Called with a run of one subspace's centroid rows: the subspace, the rows' numbers, their
/// channels.
pub(super) type CentroidRun<'a> = dyn FnMut(usize, std::ops::Range<usize>, &[f16]) + 'a;

/// Walks `m` subspaces' centroid rows (`k` each, `sub` f16 channels a row) a block at a time,
/// calling `f(j, rows, part)` for each run of subspace `j`'s rows in a block: their row
/// numbers and their channels.
pub(super) fn centroid_runs(
    centroids: &dyn Records,
    m: usize,
    k: usize,
    sub: usize,
    stats: &mut SearchStats,
    f: &mut CentroidRun<'_>,
) -> Result<(), BufferError> {
    centroids.visit(0..m * k, stats, &mut |first, bytes| {
        let rows: &[f16] = bytemuck::cast_slice(bytes);
        let end = first + rows.len() / sub;
        let mut at = first;
        while at < end {
            let j = at / k;
            let upto = end.min((j + 1) * k);
            f(j, at..upto, &rows[(at - first) * sub..(upto - first) * sub]);
            at = upto;
        }
        Ok(())
    })
}

/// Tokens of token-major codes transposed at a time for the scan.
const TRANSPOSED_RUN: usize = 256;

/// Bytes of codes a group's scan takes for all its queries at a time (a multiple of 256
/// tokens, the kernel's unit): within a core's L1 data cache.
const SCAN_SLICE_BYTES: usize = 32 << 10;

/// Tokens of a run a scan takes at a time for every query: [`SCAN_SLICE_BYTES`] of codes,
/// in whole chunks of 256.
fn scan_slice(s: Shape) -> usize {
    (SCAN_SLICE_BYTES / s.m.max(1)).max(256) / 256 * 256
}

/// A run of tokens' codes (`m` per token, token-major) subspace-major.
fn subspace_major(codes: &[u8], m: usize) -> Vec<u8> {
    let r = codes.len() / m;
    let mut out = vec![0u8; codes.len()];
    for (u, token) in codes.chunks_exact(m).enumerate() {
        for (j, &c) in token.iter().enumerate() {
            out[j * r + u] = c;
        }
    }
    out
}

/// A code beyond the centroids is a malformed block (with 2^8 centroids every byte is one),
/// named by the token it is of.
fn check_codes(bytes: &[u8], s: Shape, first: usize, tokens: usize) -> Result<(), String> {
    check_records(bytes, s, first, tokens, 1)
}

/// [`check_codes`] of sample codes: record `i` is token `i · stride`'s.
fn check_samples(bytes: &[u8], s: Shape, first: usize, records: usize) -> Result<(), String> {
    check_records(bytes, s, first, records, s.sample_stride)
}

/// Checks that every code of a block of `records` records (the first is record `first`)
/// names one of the centroids; record `i` holds token `i · stride`'s codes.
fn check_records(bytes: &[u8], s: Shape, first: usize, records: usize, stride: usize) -> Result<(), String> {
    // The largest code first, a vectorised pass at the memory's speed: a scan checks every
    // block it reads, and a sound one holds no code beyond the centroids.
    if s.k > u8::MAX as usize || (bytes.iter().fold(0u8, |a, &c| a.max(c)) as usize) < s.k {
        return Ok(());
    }
    match bytes.iter().position(|&c| c as usize >= s.k) {
        None => Ok(()),
        Some(at) => {
            let record = first
                + match s.layout {
                    CodeLayout::SubspaceMajor => at % records.max(1),
                    CodeLayout::TokenMajor => at / s.m,
                };
            let token = record * stride;
            Err(format!("pq code {} of token {token} exceeds the {} centroids", bytes[at], s.k))
        }
    }
}

/// [`token_scores`] of one query (of exactly the index's dimension).
fn one_query(
    centroids: &dyn Records,
    codes: &dyn Records,
    s: Shape,
    q: &[f32],
    prefix: Option<u32>,
) -> Result<Vec<f32>, BufferError> {
    check_query(q, s.dim)?;
    Ok(token_scores(centroids, codes, s, q, prefix)?.scores(0).to_vec())
}

fn select(
    centroids: &dyn Records,
    (codes, samples): (&dyn Records, Option<&dyn Records>),
    s: Shape,
    q: &[f32],
    budget: usize,
    prefix: Option<u32>,
) -> Result<CoarseResult, BufferError> {
    check_query(q, s.dim)?;
    let metadata_bytes = (s.centroid_bytes() + limit(s.tokens, prefix) as usize * s.m) as u64;
    // The best alone where the sample codes bound them (at the stride the run stores them):
    // the tokens `take_tokens` takes.
    let stride = if s.sample_stride > 0 { s.sample_stride as u32 } else { SAMPLE_STRIDE };
    if let Some(mut kept) = kept_here(centroids, (codes, samples), s, q, prefix, (budget, stride))? {
        let best = kept.queries.pop().map(|q| q.best).unwrap_or_default();
        return Ok(CoarseResult { ids: best.into_iter().map(|p| p.0).collect(), metadata_bytes, stats: kept.stats });
    }
    let scan = token_scores(centroids, codes, s, q, prefix)?;
    Ok(CoarseResult { ids: take_tokens(scan.query(0), budget), metadata_bytes, stats: scan.stats })
}

/// Trains `m` quantisers of `sub` channels and `k` centroids each, subspace `j` on the `n`
/// rows `points(j)` gives, and codes every row (subspaces in parallel; the result does not
/// depend on the thread count): the f16 centroids, row `j · k + c`, and the codes,
/// subspace-major (`j · n + t`). `salt` sets the subspaces' seeds apart from another
/// quantiser's built with the same `p`.
fn quantise(
    n: usize,
    m: usize,
    sub: usize,
    k: usize,
    p: &PqParams,
    salt: u64,
    points: &(dyn Fn(usize) -> Vec<f32> + Sync),
) -> (Vec<f16>, Vec<u8>) {
    let encode = |j: usize| {
        let points = points(j);
        let mut rng = Rng::new(p.seed ^ (salt + j as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let trained = kmeans(&points, sub, k, p.iters, &mut rng);
        let centroids: Vec<f16> = trained.iter().map(|&x| f16::from_f32(x)).collect();
        let rounded: Vec<f32> = centroids.iter().map(|x| x.to_f32()).collect();
        let nearest = Nearest::new(&rounded, sub);
        let codes: Vec<u8> = points.chunks_exact(sub).map(|x| nearest.find(x) as u8).collect();
        debug_assert_eq!(codes.len(), n);
        (centroids, codes)
    };
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get()).min(m);
    let parts = crate::threads::parallel(m, threads, encode);
    let centroids = parts.iter().flat_map(|part| part.0.iter().copied()).collect();
    (centroids, parts.into_iter().flat_map(|part| part.1).collect())
}

/// Nearest-centroid search for many points. The centroids are kept transposed (channel
/// after channel), so a point's scores against all of them are one weighted sum of rows:
/// k-wide vector work, with no horizontal sum per centroid as dot products would need.
struct Nearest {
    transposed: Vec<f32>,
    /// −½‖c‖² per centroid.
    neg_half_norms: Vec<f32>,
}

impl Nearest {
    fn new(centroids: &[f32], dim: usize) -> Nearest {
        let k = centroids.len() / dim;
        let mut transposed = vec![0.0; k * dim];
        for (c, row) in centroids.chunks_exact(dim).enumerate() {
            for (i, &x) in row.iter().enumerate() {
                transposed[i * k + c] = x;
            }
        }
        let neg_half_norms = centroids.chunks_exact(dim).map(|c| -0.5 * c.iter().map(|x| x * x).sum::<f32>()).collect();
        Nearest { transposed, neg_half_norms }
    }

    /// The centroid nearest to `x` (ties: the lower index): the largest x · c − ½‖c‖², in
    /// one vector pass.
    fn find(&self, x: &[f32]) -> u32 {
        ctxfs_kernels::argmax_weighted_sum(&self.neg_half_norms, x, &self.transposed) as u32
    }
}

fn sq_dist(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum()
}

/// k-means of `points` (rows of `dim`) into `k` centroids, as the module describes.
fn kmeans(points: &[f32], dim: usize, k: usize, iters: u32, rng: &mut Rng) -> Vec<f32> {
    let n = points.len() / dim;
    if n == 0 {
        return vec![0.0; k * dim];
    }
    let train = (TRAIN_PER_CENTROID * k).min(TRAIN_POINTS.max(k));
    let sample: Vec<f32> = if n > train {
        let mut ids: Vec<usize> = (0..n).collect();
        for i in 0..train {
            let pick = i + rng.below(n - i);
            ids.swap(i, pick);
        }
        ids[..train].iter().flat_map(|&i| points[i * dim..(i + 1) * dim].iter().copied()).collect()
    } else {
        points.to_vec()
    };
    let rows: Vec<&[f32]> = sample.chunks_exact(dim).collect();
    let mut centroids = plus_plus(&rows, k, rng);
    let mut assigned = vec![u32::MAX; rows.len()];
    let mut far = vec![0.0f32; rows.len()];
    for _ in 0..iters {
        let nearest = Nearest::new(&centroids, dim);
        let mut changed = 0;
        for (i, x) in rows.iter().enumerate() {
            let c = nearest.find(x);
            changed += (assigned[i] != c) as usize;
            assigned[i] = c;
            far[i] = sq_dist(x, &centroids[c as usize * dim..(c as usize + 1) * dim]);
        }
        if changed == 0 {
            break;
        }
        let mut sums = vec![0.0f64; k * dim];
        let mut counts = vec![0usize; k];
        for (x, &c) in rows.iter().zip(&assigned) {
            counts[c as usize] += 1;
            sums[c as usize * dim..(c as usize + 1) * dim].iter_mut().zip(*x).for_each(|(s, &v)| *s += v as f64);
        }
        for c in 0..k {
            let centroid = &mut centroids[c * dim..(c + 1) * dim];
            if counts[c] > 0 {
                let sum = &sums[c * dim..(c + 1) * dim];
                centroid.iter_mut().zip(sum).for_each(|(x, s)| *x = (s / counts[c] as f64) as f32);
            } else {
                // Re-seed with the key its centroid serves worst, and take it out of the
                // running so a second empty cluster gets another.
                let worst = (0..rows.len()).fold(0, |w, i| if far[i] > far[w] { i } else { w });
                centroid.copy_from_slice(rows[worst]);
                far[worst] = -1.0;
            }
        }
    }
    centroids
}

/// Points per partial sum of k-means++'s distances: a pick walks the partial sums, then
/// one run of distances.
const SEED_RUN: usize = 256;

/// k-means++ seeding: the first centroid uniformly, each next one with probability
/// proportional to its squared distance from the nearest chosen so far (uniformly once
/// every point coincides with a centroid, as when there are fewer distinct points than k).
/// The distances are updated dimension by dimension over all points (one vector pass each)
/// and summed by runs of [`SEED_RUN`] points.
fn plus_plus(rows: &[&[f32]], k: usize, rng: &mut Rng) -> Vec<f32> {
    let (n, dim) = (rows.len(), rows[0].len());
    let mut columns = vec![0.0f32; n * dim];
    for (p, x) in rows.iter().enumerate() {
        for (i, &v) in x.iter().enumerate() {
            columns[i * n + p] = v;
        }
    }
    let mut d2 = vec![f32::INFINITY; n];
    let mut run_sums = vec![0.0f64; n.div_ceil(SEED_RUN)];
    let mut centroids = Vec::with_capacity(k * dim);
    let mut chosen = rows[rng.below(n)];
    for _ in 1..k {
        centroids.extend_from_slice(chosen);
        nearer(&columns, chosen, &mut d2);
        for (sum, run) in run_sums.iter_mut().zip(d2.chunks(SEED_RUN)) {
            *sum = sum_f64(run);
        }
        let total: f64 = run_sums.iter().sum();
        let pick = if total > 0.0 {
            // The first point whose running sum passes the target; rounding can leave the
            // target unpassed, and then the last point not yet a centroid is taken.
            let target = rng.uniform() as f64 * total;
            let mut acc = 0.0;
            let passed = run_sums.iter().position(|&s| {
                let next = acc + s;
                let passes = next > target;
                if !passes {
                    acc = next;
                }
                passes
            });
            // (The run's sum and the walk through it may round apart: then its last point
            // not yet a centroid.)
            let within = passed.and_then(|r| {
                let run = &d2[r * SEED_RUN..((r + 1) * SEED_RUN).min(n)];
                let at = run.iter().position(|&x| {
                    acc += x as f64;
                    x > 0.0 && acc > target
                });
                at.or_else(|| run.iter().rposition(|&x| x > 0.0)).map(|i| r * SEED_RUN + i)
            });
            within.or_else(|| d2.iter().rposition(|&x| x > 0.0)).unwrap_or(0)
        } else {
            rng.below(n)
        };
        chosen = rows[pick];
    }
    centroids.extend_from_slice(chosen);
    centroids
}

/// Lowers each point's squared distance `d2[p]` to that from `c` where nearer; `columns`:
/// the points dimension-major (`columns[i · n + p]`).
fn nearer(columns: &[f32], c: &[f32], d2: &mut [f32]) {
    let n = d2.len();
    let mut dist = vec![0.0f32; n];
    for (i, &ci) in c.iter().enumerate() {
        for (d, &x) in dist.iter_mut().zip(&columns[i * n..(i + 1) * n]) {
            *d += (x - ci) * (x - ci);
        }
    }
    for (d, &x) in d2.iter_mut().zip(&dist) {
        *d = d.min(x);
    }
}

/// A sum in eight independent lanes (one vector of f64), then across them.
fn sum_f64(xs: &[f32]) -> f64 {
    let mut lanes = [0.0f64; 8];
    let mut runs = xs.chunks_exact(8);
    for run in &mut runs {
        for (l, &x) in lanes.iter_mut().zip(run) {
            *l += x as f64;
        }
    }
    lanes.iter().sum::<f64>() + runs.remainder().iter().map(|&x| x as f64).sum::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A meta block reads back as written, and one whose residual fields disagree with its
    /// residual subspaces is refused, whichever of them is set.
    #[test]
    fn a_meta_block_with_residual_fields_out_of_step_is_refused() {
        let meta = |residual: u32, c: u32, t: u32| PqMeta {
            version: PQ_VERSION,
            tokens: 40_000,
            dim: 128,
            params: PqParams { residual, ..PqParams::scan_codes(128) },
            centroids_per_block: 15,
            codes_per_block: 126,
            sample_stride: SAMPLE_STRIDE,
            residual_centroids_per_block: c,
            residual_codes_per_block: t,
        };
        for good in [meta(16, 15, 253), meta(0, 0, 0)] {
            assert_eq!(PqMeta::decode(&good.encode()), Ok(good));
        }
        for bad in [meta(0, 15, 0), meta(0, 0, 253), meta(16, 0, 253), meta(16, 15, 0)] {
            let err = PqMeta::decode(&bad.encode()).unwrap_err();
            assert!(err.contains("inconsistent fields"), "{err}");
        }
    }
}
