//! Eviction policies, kept apart from the pool's mechanics (as foyer does). A policy only
//! proposes candidates; the pool decides whether a candidate can be taken (unpinned).

use crate::frame::{Frame, NO_CONTEXT};
use crate::sync::Ordering;
use std::collections::{BTreeMap, VecDeque};

/// Scan-resistant policy for data frames (2Q with CLOCK second chances). A newly loaded block
/// enters *probation*; only a block hit again while there is promoted to *protected*. A
/// one-pass stream of blocks flows through probation without displacing protected blocks.
pub(crate) struct TwoQueue {
    probation: VecDeque<usize>,
    protected: VecDeque<usize>,
    /// Probation is drained first while it holds more than this many frames.
    probation_target: usize,
}

impl TwoQueue {
    pub fn new(frames: usize) -> Self {
        TwoQueue { probation: VecDeque::new(), protected: VecDeque::new(), probation_target: (frames / 4).max(1) }
    }

    pub fn loaded(&mut self, frame: usize) {
        self.probation.push_back(frame);
    }

    /// The next candidate to evict, or `None` when every frame has had its chance.
    /// `rounds` bounds the work: each frame may be passed over a few times per call.
    pub fn candidate(&mut self, frames: &[Frame]) -> Option<usize> {
        let budget = 3 * (self.probation.len() + self.protected.len()) + 1;
        for _ in 0..budget {
            let from_probation = self.probation.len() > self.probation_target || self.protected.is_empty();
            let queue = if from_probation { &mut self.probation } else { &mut self.protected };
            let f = queue.pop_front()?;
            if frames[f].referenced.swap(false, Ordering::Relaxed) {
                // Second chance: a hit in probation promotes, a hit in protected recycles.
                self.protected.push_back(f);
            } else {
                return Some(f);
            }
        }
        None
    }

    /// A candidate that could not be taken (pinned) goes back where it came from.
    pub fn keep(&mut self, frame: usize) {
        self.protected.push_back(frame);
    }
}

/// Index frames: evict the coldest context first (by its most recent hit), and within it the
/// least recently used frames. Hits update recency concurrently, so the ranking is made from
/// one snapshot of it (sorting by live atomics would see keys change mid-sort). Only the
/// `first` coldest are ranked (a selection, then a sort of those): an eviction wants a batch,
/// not the order of the whole area.
pub(crate) fn coldest_context(frames: &[Frame], area: std::ops::Range<usize>, first: usize) -> Vec<usize> {
    let snapshot: Vec<(u64, u64, usize)> = area
        .filter_map(|f| {
            let ctx = frames[f].context.load(Ordering::Relaxed);
            // Resident frames cannot be evicted: ranking them would only be passed over.
            (ctx != NO_CONTEXT && frames[f].resident.load(Ordering::Relaxed) == 0)
                .then(|| (ctx, frames[f].last_use.load(Ordering::Relaxed), f))
        })
        .collect();
    let mut recency: BTreeMap<u64, u64> = BTreeMap::new();
    for &(ctx, t, _) in &snapshot {
        let e = recency.entry(ctx).or_insert(0);
        *e = (*e).max(t);
    }
    let mut ranked: Vec<(u64, u64, u64, usize)> =
        snapshot.into_iter().map(|(ctx, t, f)| (recency[&ctx], ctx, t, f)).collect();
    // Coldest context first, its frames together, least recently used first.
    if ranked.len() > first {
        ranked.select_nth_unstable(first);
        ranked.truncate(first);
    }
    ranked.sort_unstable();
    ranked.into_iter().map(|(_, _, _, f)| f).collect()
}
