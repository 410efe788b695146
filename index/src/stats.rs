//! What a search did: the counts the benchmarks and regression baselines track.

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SearchStats {
    /// Inner products computed.
    pub keys_scored: u64,
    /// Nodes whose neighbour lists were expanded.
    pub hops: u64,
    /// Storage blocks read (index and data), for sources backed by blocks.
    pub blocks_touched: u64,
    /// Of those, the blocks this search read from the device (buffer pool misses it paid for).
    pub blocks_read: u64,
}

impl std::ops::AddAssign for SearchStats {
    fn add_assign(&mut self, o: SearchStats) {
        self.keys_scored += o.keys_scored;
        self.hops += o.hops;
        self.blocks_touched += o.blocks_touched;
        self.blocks_read += o.blocks_read;
    }
}

/// Tokens selected by a search, best first, with their inner products.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SearchResult {
    pub ids: Vec<u32>,
    pub scores: Vec<f32>,
    pub stats: SearchStats,
}

impl SearchResult {
    /// Sorts (id, score) pairs best first (ties by id, so results are deterministic).
    pub fn from_pairs(mut pairs: Vec<(u32, f32)>, stats: SearchStats) -> SearchResult {
        pairs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        SearchResult { ids: pairs.iter().map(|p| p.0).collect(), scores: pairs.iter().map(|p| p.1).collect(), stats }
    }
}
