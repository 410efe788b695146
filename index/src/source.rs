//! The small storage traits every search is written against: the same search code runs over
//! in-memory arrays at build time and over buffered pages at query time.

use crate::stats::SearchStats;
use ctxfs_buffer::BufferError;

/// What reading a source can fail with: the storage below it.
pub type SourceResult = Result<(), BufferError>;

/// Scores keys: inner products with a query (unscaled; β is in inner-product units).
pub trait Keys {
    fn dim(&self) -> usize;
    /// Number of keys; node ids are `0..len`, which are also token positions.
    fn len(&self) -> u32;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// `out[i] = q · key(ids[i])`. Counts keys scored (and blocks touched) in `stats`.
    fn score(&self, ids: &[u32], q: &[f32], out: &mut [f32], stats: &mut SearchStats) -> SourceResult;
    /// `out[i] = q · key(first + i)`: a scan of consecutive keys, which a source can do
    /// faster than scattered scoring.
    fn score_range(&self, first: u32, q: &[f32], out: &mut [f32], stats: &mut SearchStats) -> SourceResult {
        let ids: Vec<u32> = (first..first + out.len() as u32).collect();
        self.score(&ids, q, out, stats)
    }
    /// `out[t · stride + i] = queries_t · key(first + i)` for `i < len`: one scan of
    /// consecutive keys for several queries (a GQA group's q heads). A source that widens
    /// each key once for all of them does so; the scores equal [`score_range`]'s to the bit.
    /// Counts in `stats` what one query's scan counts.
    ///
    /// [`score_range`]: Keys::score_range
    fn score_range_many(
        &self,
        first: u32,
        queries: &[f32],
        out: &mut [f32],
        stride: usize,
        len: usize,
        stats: &mut SearchStats,
    ) -> SourceResult {
        let mut others = SearchStats::default();
        for (t, q) in queries.chunks_exact(self.dim()).enumerate() {
            let counted = if t == 0 { &mut *stats } else { &mut others };
            self.score_range(first, q, &mut out[t * stride..t * stride + len], counted)?;
        }
        Ok(())
    }
    /// `out[j] = q · key(j · stride)` for every `j · stride < limit` (resizing `out`): the
    /// seeds of DIPRS. A source holding those rows contiguously (a seed table of this
    /// stride) scans them; otherwise the scattered rows are scored.
    fn score_strided(
        &self,
        stride: u32,
        limit: u32,
        q: &[f32],
        out: &mut Vec<f32>,
        stats: &mut SearchStats,
    ) -> SourceResult {
        score_strided_rows(self, stride, limit, q, out, stats)
    }
}

/// [`Keys::score_strided`] without a seed table: the scattered rows.
pub fn score_strided_rows<K: Keys + ?Sized>(
    keys: &K,
    stride: u32,
    limit: u32,
    q: &[f32],
    out: &mut Vec<f32>,
    stats: &mut SearchStats,
) -> SourceResult {
    let ids: Vec<u32> = (0..limit.min(keys.len())).step_by(stride.max(1) as usize).collect();
    out.resize(ids.len(), 0.0);
    keys.score(&ids, q, out, stats)
}

/// A proximity graph over the keys.
pub trait Graph {
    /// Appends the out-neighbours of `node` to `out`. Counts blocks touched in `stats`.
    fn neighbors(&self, node: u32, out: &mut Vec<u32>, stats: &mut SearchStats) -> SourceResult;
    /// Where searches start.
    fn entry(&self) -> u32;
    /// A hint that `node`'s neighbours will be asked for soon (see
    /// [`ctxfs_kernels::prefetch`]); sources that cannot reach the record cheaply ignore it.
    fn prefetch(&self, _node: u32) {}
}

/// Keys and a graph over them, searchable together.
pub struct Pair<'a, K, G> {
    pub keys: &'a K,
    pub graph: &'a G,
}

impl<K: Keys, G> Keys for Pair<'_, K, G> {
    fn dim(&self) -> usize {
        self.keys.dim()
    }
    fn len(&self) -> u32 {
        self.keys.len()
    }
    fn score(&self, ids: &[u32], q: &[f32], out: &mut [f32], stats: &mut SearchStats) -> SourceResult {
        self.keys.score(ids, q, out, stats)
    }
    fn score_range(&self, first: u32, q: &[f32], out: &mut [f32], stats: &mut SearchStats) -> SourceResult {
        self.keys.score_range(first, q, out, stats)
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
        self.keys.score_range_many(first, queries, out, stride, len, stats)
    }
    fn score_strided(
        &self,
        stride: u32,
        limit: u32,
        q: &[f32],
        out: &mut Vec<f32>,
        stats: &mut SearchStats,
    ) -> SourceResult {
        self.keys.score_strided(stride, limit, q, out, stats)
    }
}

impl<K, G: Graph> Graph for Pair<'_, K, G> {
    fn neighbors(&self, node: u32, out: &mut Vec<u32>, stats: &mut SearchStats) -> SourceResult {
        self.graph.neighbors(node, out, stats)
    }
    fn entry(&self) -> u32 {
        self.graph.entry()
    }
    fn prefetch(&self, node: u32) {
        self.graph.prefetch(node)
    }
}
