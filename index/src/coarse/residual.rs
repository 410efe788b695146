//! Residual codes: a second product quantiser, of what a PQ run's codes leave of each key
//! (the key less its reconstruction), stored with the run from layout version 4
//! ([`super::pq::PqParams::residual`]).
//!
//! A scan of the codes chooses candidates by approximate score; their keys are then read to
//! score them exactly, and on a compact context each read is a random block read. The
//! residual codes take a candidate's approximate score most of the way to its exact one
//! before that read: `score = Σ_j LUT[j][code(t, j)] + Σ_i R[i][residual(t, i)]`, the second
//! sum over the residual quantiser's subspaces with f32 tables `R[i][c]` = q_i · residual
//! centroid (i, c). They are looked up per candidate, not scanned, so they are stored
//! token-major (a token's codes side by side): `m_r` bytes per token where the scan's codes
//! take `m`.
//!
//! Residual subspace `i` covers channels `i·d/m_r ..`; its `2^b` centroids are trained by the
//! same k-means as the codes' ([`super::pq`]), on the residuals of its channels.

use super::{check_query, invalid, MemRecords, PagedRecords, Records, Section};
use crate::coarse::pq::{centroid_runs, PqParams};
use crate::stats::SearchStats;
use ctxfs_buffer::{Blocks, BufferError, BufferPool, ResidentBlocks};
use half::f16;

/// The most the residual centroids may weigh against the residual codes, as a divisor: an
/// eighth. Below that many tokens (32,768 at b = 8 and 8 channels a subspace) a context
/// would hold more centroid bytes per token than the codes save it reads; the resident
/// budget (`DbConfig::resident_budget`) is what a compact context's codes must fit.
const CENTROID_SHARE: usize = 8;

/// The residual codes' dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct ResidualShape {
    pub tokens: usize,
    pub dim: usize,
    /// Subspaces.
    pub m: usize,
    /// Centroids per subspace.
    pub k: usize,
}

impl ResidualShape {
    /// The shape of `p`'s residual codes over `tokens` keys of `dim` channels; `None` where
    /// `p` has none.
    pub fn of(tokens: usize, dim: usize, p: &PqParams) -> Option<ResidualShape> {
        (p.residual > 0).then(|| ResidualShape { tokens, dim, m: p.residual as usize, k: 1 << p.bits })
    }

    /// Whether the codes are worth their centroids: a build makes residual codes only where
    /// the centroids weigh at most [`CENTROID_SHARE`] of the codes.
    pub fn amortised(&self) -> bool {
        self.centroid_bytes() * CENTROID_SHARE <= self.tokens * self.m
    }

    fn centroid_bytes(&self) -> usize {
        self.m * self.k * self.sub() * 2
    }

    /// The codes' and centroids' bytes per token.
    pub fn per_token(&self) -> f64 {
        self.m as f64 + self.centroid_bytes() as f64 / self.tokens.max(1) as f64
    }

    /// Channels per subspace.
    pub fn sub(&self) -> usize {
        self.dim / self.m
    }

    /// The centroid rows (`2·d/m_r` bytes each), then the codes (`m_r` bytes per token), packed
    /// so many to a block.
    pub fn sections(&self, centroids_per_block: u32, codes_per_block: u32) -> [Section; 2] {
        [
            Section { records: self.m * self.k, size: 2 * self.sub(), per_block: centroids_per_block as usize },
            Section { records: self.tokens, size: self.m, per_block: codes_per_block as usize },
        ]
    }
}

/// Residual codes in memory, as a build makes them.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Residual {
    pub shape: ResidualShape,
    /// `m_r · 2^b` rows of `d / m_r`: subspace `i`'s centroid `c` is row `i · 2^b + c`.
    pub centroids: Vec<f16>,
    /// Token-major: token `t`'s code in subspace `i` is byte `t · m_r + i`.
    pub codes: Vec<u8>,
}

impl Residual {
    /// The centroid rows and the codes as records.
    pub fn records(&self) -> (MemRecords<'_>, MemRecords<'_>) {
        let s = self.shape;
        (
            MemRecords { bytes: bytemuck::cast_slice(&self.centroids), size: 2 * s.sub() },
            MemRecords { bytes: &self.codes, size: s.m },
        )
    }
}

/// Residual codes stored in a PQ run, read through the buffer pool.
pub(super) struct PagedResidual<'p> {
    pub shape: ResidualShape,
    pub centroids: PagedRecords<'p>,
    pub codes: PagedRecords<'p>,
}

impl<'p> PagedResidual<'p> {
    /// The residual codes in `blocks`, the run's blocks after its sample blocks; read from
    /// the held blocks where `held` holds them (the held blocks, and where `blocks`' first
    /// is among them).
    pub fn open(
        pool: &'p BufferPool,
        blocks: Blocks<'p>,
        shape: ResidualShape,
        [c, t]: [Section; 2],
        held: Option<(&'p ResidentBlocks, usize)>,
    ) -> Self {
        let split = c.blocks();
        let records =
            |at: usize, blocks, s: Section| PagedRecords::new(pool, blocks, s.size, s.per_block).held_in_run(held, at);
        PagedResidual {
            shape,
            centroids: records(0, blocks.range(0..split), c),
            codes: records(split, blocks.skip(split), t),
        }
    }
}

/// A query's residual tables: row `i · 2^b + c` = q_i · residual centroid (i, c), in f32.
#[derive(Debug, Clone, PartialEq)]
pub struct ResidualTable(Vec<f32>);

/// The query's [`ResidualTable`], from one pass over the centroids, a subspace's rows in a
/// block at a time. Rows of a multiple of 4 channels are read as rows of 4, which the PQ
/// table kernel scores four to a vector ([`ctxfs_kernels::pq_table`]): each quarter of the
/// query against every such row, of which the rows' own quarters are summed.
pub(super) fn table(
    centroids: &dyn Records,
    s: ResidualShape,
    q: &[f32],
    stats: &mut SearchStats,
) -> Result<ResidualTable, BufferError> {
    check_query(q, s.dim)?;
    let sub = s.sub();
    let mut table = vec![0.0f32; s.m * s.k];
    let mut quarters = Vec::new();
    centroid_runs(centroids, s.m, s.k, sub, stats, &mut |j, rows, part| {
        let (qj, out) = (&q[j * sub..(j + 1) * sub], &mut table[rows]);
        if sub.is_multiple_of(4) {
            let parts = sub / 4;
            quarters.resize(part.len() / 4, 0.0);
            for (p, qp) in qj.chunks_exact(4).enumerate() {
                ctxfs_kernels::pq_table(part, qp, &mut quarters);
                for (o, row) in out.iter_mut().zip(quarters.chunks_exact(parts)) {
                    *o += row[p];
                }
            }
        } else {
            ctxfs_kernels::scores(part, qj, 1.0, out);
        }
    })?;
    Ok(ResidualTable(table))
}

/// Adds to `scores[i]` the residual codes' part of token `ids[i]`'s score by the query whose
/// tables `table` are: each token's `m_r` lookups, reading the code blocks that hold ids in
/// ascending order. `ids` must ascend.
pub(super) fn refine(
    codes: &dyn Records,
    s: ResidualShape,
    table: &ResidualTable,
    ids: &[u32],
    scores: &mut [f32],
    stats: &mut SearchStats,
) -> Result<(), BufferError> {
    if ids.len() != scores.len() || ids.windows(2).any(|w| w[0] >= w[1]) {
        return Err(invalid(format!("{} residual scores asked for {} ids, not ascending", scores.len(), ids.len())));
    }
    if table.0.len() != s.m * s.k {
        return Err(invalid(format!("residual tables of {} entries for codes of {}", table.0.len(), s.m * s.k)));
    }
    let Some(&last) = ids.last() else { return Ok(()) };
    if last as usize >= s.tokens {
        return Err(invalid(format!("token {last} asked of residual codes of {} tokens", s.tokens)));
    }
    // With 2^8 centroids every byte names one: no code to check, no index to bound.
    let full: Option<Vec<&[f32; 256]>> =
        (s.k == 256).then(|| table.0.chunks_exact(256).filter_map(|t| t.try_into().ok()).collect());
    let lookup = |t: u32, row: &[u8]| -> Result<f32, String> {
        if let Some(full) = &full {
            return Ok(row.iter().zip(full).map(|(&c, sub)| sub[c as usize]).sum());
        }
        let mut add = 0.0f32;
        for (j, &c) in row.iter().enumerate() {
            if c as usize >= s.k {
                return Err(format!("residual code {c} of token {t} exceeds the {} centroids", s.k));
            }
            add += table.0[j * s.k + c as usize];
        }
        Ok(add)
    };
    // Only the blocks holding ids are read.
    codes.visit_records(ids, stats, &mut |i, row| {
        scores[i] += lookup(ids[i], row)?;
        Ok(())
    })?;
    Ok(())
}
