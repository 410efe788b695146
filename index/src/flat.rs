//! Exact answers by scanning every key: the reference every approximate search is measured
//! against, and the optimizer's plan for layer 0.

use crate::source::Keys;
use crate::stats::{SearchResult, SearchStats};
use ctxfs_buffer::BufferError;

/// Keys scored per kernel call.
const SCAN_BATCH: usize = 1024;

/// q · key for every key below `limit`.
pub fn scan<K: Keys>(keys: &K, q: &[f32], limit: u32, stats: &mut SearchStats) -> Result<Vec<f32>, BufferError> {
    let n = limit.min(keys.len()) as usize;
    let mut out = vec![0.0; n];
    for (i, chunk) in out.chunks_mut(SCAN_BATCH).enumerate() {
        keys.score_range((i * SCAN_BATCH) as u32, q, chunk, stats)?;
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
    let best = scores.iter().copied().fold(window_max, f32::max);
    let pairs = scores.iter().enumerate().filter(|(_, &s)| s >= best - beta).map(|(i, &s)| (i as u32, s)).collect();
    Ok(SearchResult::from_pairs(pairs, stats))
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
