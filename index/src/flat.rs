//! Exact answers by scanning every key: the reference every approximate search is measured
//! against, and the optimizer's plan for layer 0.

use crate::source::Keys;
use crate::stats::{SearchResult, SearchStats};
use ctxfs_buffer::BufferError;

/// Keys scored per kernel call.
const SCAN_BATCH: usize = 1024;

/// q · key for every key below `limit`.
pub fn scan<K: Keys>(keys: &K, q: &[f32], limit: u32, stats: &mut SearchStats) -> Result<Vec<f32>, BufferError> {
    let (scores, scanned) = scan_many(keys, q, limit)?.pop().expect("one query");
    *stats += scanned;
    Ok(scores)
}

/// [`scan`] for each of `queries` (rows of the keys' dimension) in one pass over the keys:
/// each batch of keys is scored for every query while it is in cache. A flat plan scores
/// a GQA group's q heads against the same keys; one pass instead of one per q head cuts
/// the memory traffic of a 128K-token head from 4 × 32 MiB to 32 MiB.
pub fn scan_many<K: Keys>(keys: &K, queries: &[f32], limit: u32) -> Result<Vec<(Vec<f32>, SearchStats)>, BufferError> {
    let d = keys.dim();
    let n = limit.min(keys.len()) as usize;
    let mut out: Vec<(Vec<f32>, SearchStats)> =
        queries.chunks_exact(d).map(|_| (vec![0.0; n], SearchStats::default())).collect();
    for first in (0..n).step_by(SCAN_BATCH) {
        let len = SCAN_BATCH.min(n - first);
        for (q, (scores, stats)) in queries.chunks_exact(d).zip(&mut out) {
            keys.score_range(first as u32, q, &mut scores[first..first + len], stats)?;
        }
    }
    Ok(out)
}

/// The exact DIPR set: every key (below `prefix`, if given) whose inner product is within
/// `beta` of the maximum, the maximum also taking `window_max` (the window's best score).
pub fn dipr<K: Keys>(
    keys: &K,
    q: &[f32],
    beta: f32,
    window_max: f32,
    prefix: Option<u32>,
) -> Result<SearchResult, BufferError> {
    let mut stats = SearchStats::default();
    let scores = scan(keys, q, prefix.unwrap_or(u32::MAX), &mut stats)?;
    Ok(dipr_of(&scores, beta, window_max, stats))
}

/// The exact DIPR set given every key's score (from [`scan`] or [`scan_many`], whose work
/// `stats` reports).
pub fn dipr_of(scores: &[f32], beta: f32, window_max: f32, stats: SearchStats) -> SearchResult {
    let best = scores.iter().copied().fold(window_max, f32::max);
    let pairs = scores.iter().enumerate().filter(|(_, &s)| s >= best - beta).map(|(i, &s)| (i as u32, s)).collect();
    SearchResult::from_pairs(pairs, stats)
}

/// The exact top-k keys (below `prefix`, if given).
pub fn topk<K: Keys>(keys: &K, q: &[f32], k: usize, prefix: Option<u32>) -> Result<SearchResult, BufferError> {
    let mut stats = SearchStats::default();
    let scores = scan(keys, q, prefix.unwrap_or(u32::MAX), &mut stats)?;
    let mut pairs: Vec<(u32, f32)> = scores.into_iter().enumerate().map(|(i, s)| (i as u32, s)).collect();
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if k < pairs.len() {
        pairs.select_nth_unstable_by(k, order);
        pairs.truncate(k);
    }
    Ok(SearchResult::from_pairs(pairs, stats))
}
