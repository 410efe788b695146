//! In-memory keys and graphs: what the build produces and tests search.

use crate::search::SEED_STRIDE;
use crate::source::{score_strided_rows, Graph, Keys, SourceResult};
use crate::stats::SearchStats;
use half::f16;

/// How many rows ahead of the one it scores a scattered scoring prefetches: enough misses in
/// flight to hide memory latency (a 128-element f16 row is 4 cache lines).
pub const PREFETCH_AHEAD: usize = 8;

/// Keys stored row after row, and, as an index stores them, a seed table: a copy of every
/// [`SEED_STRIDE`]-th row.
#[derive(Debug, Clone)]
pub struct MemKeys {
    dim: usize,
    data: Vec<f16>,
    seeds: Vec<f16>,
}

impl MemKeys {
    pub fn new(dim: usize, data: Vec<f16>) -> MemKeys {
        assert!(dim > 0 && data.len().is_multiple_of(dim), "{} elements are not rows of {dim}", data.len());
        assert!(data.len() / dim <= u32::MAX as usize);
        let seeds = data.chunks(dim).step_by(SEED_STRIDE as usize).flatten().copied().collect();
        MemKeys { dim, data, seeds }
    }
    pub fn row(&self, id: u32) -> &[f16] {
        &self.data[id as usize * self.dim..(id as usize + 1) * self.dim]
    }
    pub fn data(&self) -> &[f16] {
        &self.data
    }
}

impl Keys for MemKeys {
    fn dim(&self) -> usize {
        self.dim
    }
    fn len(&self) -> u32 {
        (self.data.len() / self.dim) as u32
    }
    fn score(&self, ids: &[u32], q: &[f32], out: &mut [f32], stats: &mut SearchStats) -> SourceResult {
        for &id in &ids[..ids.len().min(PREFETCH_AHEAD)] {
            ctxfs_kernels::prefetch(self.row(id));
        }
        for (i, (o, &id)) in out.iter_mut().zip(ids).enumerate() {
            if let Some(&ahead) = ids.get(i + PREFETCH_AHEAD) {
                ctxfs_kernels::prefetch(self.row(ahead));
            }
            *o = ctxfs_kernels::dot(self.row(id), q);
        }
        stats.keys_scored += ids.len() as u64;
        Ok(())
    }
    fn score_range(&self, first: u32, q: &[f32], out: &mut [f32], stats: &mut SearchStats) -> SourceResult {
        let at = first as usize * self.dim;
        ctxfs_kernels::scores(&self.data[at..at + out.len() * self.dim], q, 1.0, out);
        stats.keys_scored += out.len() as u64;
        Ok(())
    }
    fn score_strided(
        &self,
        stride: u32,
        limit: u32,
        q: &[f32],
        out: &mut Vec<f32>,
        stats: &mut SearchStats,
    ) -> SourceResult {
        if stride != SEED_STRIDE {
            return score_strided_rows(self, stride, limit, q, out, stats);
        }
        out.resize(limit.min(self.len()).div_ceil(stride) as usize, 0.0);
        ctxfs_kernels::scores(&self.seeds[..out.len() * self.dim], q, 1.0, out);
        stats.keys_scored += out.len() as u64;
        Ok(())
    }
}

/// Adjacency lists of bounded degree, stored flat (the on-disk form is fixed-size records).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemGraph {
    pub degree: usize,
    /// `degree` slots per node; unused slots hold [`NO_NODE`].
    pub adjacency: Vec<u32>,
    pub entry: u32,
}

/// An empty adjacency slot.
pub const NO_NODE: u32 = u32::MAX;

impl MemGraph {
    pub fn from_lists(degree: usize, lists: &[Vec<u32>], entry: u32) -> MemGraph {
        let mut adjacency = vec![NO_NODE; lists.len() * degree];
        for (n, list) in lists.iter().enumerate() {
            assert!(list.len() <= degree, "node {n} has {} neighbours, degree is {degree}", list.len());
            adjacency[n * degree..n * degree + list.len()].copy_from_slice(list);
        }
        MemGraph { degree, adjacency, entry }
    }
    pub fn nodes(&self) -> usize {
        self.adjacency.len() / self.degree.max(1)
    }
    pub fn list(&self, node: u32) -> impl Iterator<Item = u32> + '_ {
        let at = node as usize * self.degree;
        self.adjacency[at..at + self.degree].iter().copied().take_while(|&n| n != NO_NODE)
    }
}

impl Graph for MemGraph {
    fn neighbors(&self, node: u32, out: &mut Vec<u32>, _stats: &mut SearchStats) -> SourceResult {
        out.extend(self.list(node));
        Ok(())
    }
    fn entry(&self) -> u32 {
        self.entry
    }
    fn prefetch(&self, node: u32) {
        let at = node as usize * self.degree;
        ctxfs_kernels::prefetch(&self.adjacency[at..at + self.degree]);
    }
}
