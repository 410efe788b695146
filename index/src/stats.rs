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
    /// The scores of the seeds a DIPRS search scored (empty for other searches): a sample of
    /// the keys, every `stride`-th, from which attention estimates what it did not retrieve.
    pub seeds: SeedScores,
    /// The β the range was cut at, when DIPRS chose it: narrowed from the caller's for a
    /// diffuse range ([`crate::search::DiprsParams::range_target`]), or to meet a mass
    /// target ([`crate::search::DiprsParams::target`]).
    pub chosen_beta: Option<f32>,
    /// With a mass target: the share of the softmax mass the search estimates it left out
    /// (the window's counted in the whole).
    pub missing_share: Option<f32>,
}

/// Scores of every `stride`-th qualifying token: `scores[j]` is token `j · stride`'s.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SeedScores {
    pub stride: u32,
    pub scores: Vec<f32>,
}

impl SearchResult {
    /// (id, score) pairs as they are, ascending by id: for a caller that takes a search's
    /// tokens in token order (attention, which merges segments by token), and not best first
    /// as [`SearchResult::from_pairs`] puts them. Sorting thousands of candidates best first,
    /// only to sort them back by token, took about a fifth of the CPU of a compact query of
    /// SmolLM2's 32K attention (`ctxfs query … --resident-budget 0.125`).
    pub fn by_id(pairs: Vec<(u32, f32)>, stats: SearchStats) -> SearchResult {
        debug_assert!(pairs.windows(2).all(|w| w[0].0 < w[1].0), "pairs ascending by id");
        let (ids, scores) = pairs.into_iter().unzip();
        SearchResult { ids, scores, stats, ..Default::default() }
    }

    /// Sorts (id, score) pairs best first (ties by id, so results are deterministic).
    pub fn from_pairs(pairs: Vec<(u32, f32)>, stats: SearchStats) -> SearchResult {
        // One integer sort: the score's bits mapped to an order-preserving (total order)
        // integer and flipped, so ascending is best first, then the id. With a comparison
        // sort calling `total_cmp`, turning the keys found into the result took 16 µs per
        // search at 131,072 tokens (means from cold caches); with this, 11 µs.
        let mut keys: Vec<u64> =
            pairs.iter().map(|&(id, sc)| u64::from(!total_order_bits(sc)) << 32 | u64::from(id)).collect();
        keys.sort_unstable();
        let ids = keys.iter().map(|&k| k as u32).collect();
        let scores = keys.iter().map(|&k| from_total_order_bits(!((k >> 32) as u32))).collect();
        SearchResult { ids, scores, stats, ..Default::default() }
    }
}

/// `f32::total_cmp`'s order as an unsigned integer's: negative scores have all their bits
/// flipped, the others only the sign.
fn total_order_bits(x: f32) -> u32 {
    let b = x.to_bits();
    if b >> 31 == 1 {
        !b
    } else {
        b | 1 << 31
    }
}

fn from_total_order_bits(k: u32) -> f32 {
    f32::from_bits(if k >> 31 == 1 { k & !(1 << 31) } else { !k })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn from_pairs_sorts_as_total_cmp_best_first_then_by_id() {
        let scores = [3.5, -0.0, 0.0, f32::NEG_INFINITY, -2.25, 3.5, f32::INFINITY, 1e-40, -1e-40, f32::NAN, -7.0, 3.5];
        let pairs: Vec<(u32, f32)> = scores.iter().enumerate().map(|(i, &s)| (100 - i as u32, s)).collect();
        let mut expected = pairs.clone();
        expected.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let r = SearchResult::from_pairs(pairs, SearchStats::default());
        assert_eq!(r.ids, expected.iter().map(|p| p.0).collect::<Vec<_>>());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&r.scores), bits(&expected.iter().map(|p| p.1).collect::<Vec<_>>()));
        assert_eq!(r.ids[..5], [91, 94, 89, 95, 100]);
    }
}
