//! Exact answers by scanning every key: the reference every approximate search is measured
//! against, and the optimizer's plan for layer 0.

use crate::coarse::{reaching, reaching_into};
use crate::source::Keys;
use crate::stats::{SearchResult, SearchStats};
use crate::target::MassTarget;
use ctxfs_buffer::BufferError;

/// q · key for every key below `limit`.
pub fn scan<K: Keys>(keys: &K, q: &[f32], limit: u32, stats: &mut SearchStats) -> Result<Vec<f32>, BufferError> {
    let mut group = scan_many(keys, q, limit)?;
    *stats += group.stats;
    Ok(std::mem::take(&mut group.scores))
}

/// Tokens per run whose best score a scan of codes records beside the scores
/// ([`QueryScores`]): a pass for the scores that reach a cut near the top (a DIPR range's,
/// a budget's) then reads only the runs whose best reaches it, not every score.
pub const BEST_RUN: usize = 64;

/// Every key's score for each query of a group, from one pass over the keys.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupScan {
    /// Query after query, `keys` scores each.
    scores: Vec<f32>,
    keys: usize,
    /// Query after query, the best score of each run of [`BEST_RUN`] keys; empty when the
    /// scan did not record them.
    run_best: Vec<f32>,
    /// What each query's scan counts (the same for all of them).
    pub stats: SearchStats,
}

/// The scores' buffer goes back to this thread for its next scan (`scratch`).
impl Drop for GroupScan {
    fn drop(&mut self) {
        crate::scratch::give_back(std::mem::take(&mut self.scores));
    }
}

impl GroupScan {
    /// `scores` of `m` queries over `keys` items each, query after query.
    pub(crate) fn new(scores: Vec<f32>, keys: usize, stats: SearchStats) -> GroupScan {
        debug_assert!(keys == 0 || scores.len().is_multiple_of(keys));
        GroupScan { scores, keys, run_best: Vec::new(), stats }
    }

    /// [`GroupScan::new`] with the best score of each run ([`fold_run_best`]).
    pub(crate) fn with_run_best(scores: Vec<f32>, run_best: Vec<f32>, keys: usize, stats: SearchStats) -> GroupScan {
        debug_assert_eq!(run_best.len() * keys, scores.len() * keys.div_ceil(BEST_RUN));
        let mut scan = GroupScan::new(scores, keys, stats);
        scan.run_best = run_best;
        scan
    }

    /// Query `t`'s score of every key scanned.
    pub fn scores(&self, t: usize) -> &[f32] {
        &self.scores[t * self.keys..(t + 1) * self.keys]
    }

    /// Query `t`'s scores with the best of each run, where the scan recorded them.
    pub fn query(&self, t: usize) -> QueryScores<'_> {
        let runs = self.keys.div_ceil(BEST_RUN);
        let run_best = if self.run_best.is_empty() { &[][..] } else { &self.run_best[t * runs..(t + 1) * runs] };
        QueryScores { scores: self.scores(t), run_best }
    }
}

/// Folds `scores`, of keys `first..`, into `run_best`, the best score of each run of
/// [`BEST_RUN`] keys. The scores are numbers (the codes' sums of table entries).
pub(crate) fn fold_run_best(scores: &[f32], first: usize, run_best: &mut [f32]) {
    let mut at = 0;
    while at < scores.len() {
        let run = (first + at) / BEST_RUN;
        let end = ((run + 1) * BEST_RUN - first).min(scores.len());
        run_best[run] = run_best[run].max(ctxfs_kernels::max(&scores[at..end]));
        at = end;
    }
}

/// One query's score of every key, and the best score of each run of [`BEST_RUN`] keys
/// where the scan recorded them. The scores are numbers: a run's best is a vector maximum,
/// which a NaN would not order.
#[derive(Debug, Clone, Copy)]
pub struct QueryScores<'a> {
    pub scores: &'a [f32],
    run_best: &'a [f32],
}

impl<'a> QueryScores<'a> {
    /// Scores without their runs' best: every pass reads them all.
    pub fn plain(scores: &'a [f32]) -> QueryScores<'a> {
        QueryScores { scores, run_best: &[] }
    }

    /// The best of each run of [`BEST_RUN`] keys; empty when the scan did not record them.
    pub fn run_best(&self) -> &'a [f32] {
        self.run_best
    }

    /// The best score (−∞ over none).
    pub fn best(&self) -> f32 {
        ctxfs_kernels::max(if self.run_best.is_empty() { self.scores } else { self.run_best })
    }

    /// The keys whose score reaches `cut`, ascending ([`crate::coarse::reaching`]), looking
    /// only inside the runs whose best reaches it.
    pub fn reaching(&self, cut: f32) -> Vec<u32> {
        if self.run_best.is_empty() {
            return reaching(self.scores, cut);
        }
        let mut ids = Vec::new();
        for (run, _) in self.run_best.iter().enumerate().filter(|(_, &b)| b >= cut) {
            let from = run * BEST_RUN;
            reaching_into(&self.scores[from..(from + BEST_RUN).min(self.scores.len())], from as u32, cut, &mut ids);
        }
        ids
    }
}

/// [`scan`] for each of `queries` (rows of the keys' dimension) in one pass over the keys. A
/// flat plan scores a GQA group's q heads against the same keys: each key is read and
/// widened once for all of them, and the memory traffic of a 128K-token head is 32 MiB, not
/// 4 × 32 MiB. The scores equal [`scan`]'s to the bit.
pub fn scan_many<K: Keys>(keys: &K, queries: &[f32], limit: u32) -> Result<GroupScan, BufferError> {
    let d = keys.dim();
    let n = limit.min(keys.len()) as usize;
    let m = queries.len() / d;
    // `score_range_many` writes every score.
    let mut scores = crate::scratch::scores(m * n);
    let mut stats = SearchStats::default();
    keys.score_range_many(0, &queries[..m * d], &mut scores, n, n, &mut stats)?;
    Ok(GroupScan::new(scores, n, stats))
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
    range_of(scores, best_of(scores, window_max) - beta, stats)
}

/// The best of `scores` and `window_max` (a vector pass).
fn best_of(scores: &[f32], window_max: f32) -> f32 {
    ctxfs_kernels::max(scores).max(window_max)
}

/// The keys scoring at least `cut`.
fn range_of(scores: &[f32], cut: f32, stats: SearchStats) -> SearchResult {
    let pairs = scores.iter().enumerate().filter(|(_, &s)| s >= cut).map(|(i, &s)| (i as u32, s)).collect();
    SearchResult::from_pairs(pairs, stats)
}

/// [`dipr_of`], or with a mass target, the exact range that meets it: β chosen from every
/// key's score ([`MassTarget::exact_cut`]), reported as the result's `chosen_beta`, and the
/// share it leaves out as `missing_share`.
pub fn dipr_or_target(
    scores: &[f32],
    beta: f32,
    window_max: f32,
    target: Option<&MassTarget>,
    stats: SearchStats,
) -> SearchResult {
    let Some(t) = target else {
        return dipr_of(scores, beta, window_max, stats);
    };
    let best = best_of(scores, window_max);
    let cut = t.exact_cut(scores, best);
    let mut r = range_of(scores, best - cut.beta, stats);
    r.missing_share = Some(cut.missing as f32);
    r.chosen_beta = Some(cut.beta);
    r
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
