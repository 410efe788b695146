//! Graph searches, written once over [`Keys`] and [`Graph`]: DIPRS (Algorithm 1 of the
//! AlayaDB paper, window-enhanced), top-k beam search, and the prefix filter (only tokens
//! below P qualify; the search walks two hops through tokens that do not, so the graph stays
//! connected).

use crate::source::{Graph, Keys, SourceResult};
use crate::stats::{SearchResult, SearchStats};
use ctxfs_buffer::BufferError;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiprsParams {
    /// The range below the best inner product, in inner-product units.
    pub beta: f32,
    /// The candidate list grows without pruning until it holds this many keys.
    pub l0: usize,
    /// The best score of the caller's window (−∞ without one): DIPRS prunes against it from
    /// the start instead of discovering a high score late.
    pub window_max: f32,
    /// Only tokens below this qualify (partial-prefix reuse).
    pub prefix: Option<u32>,
    /// The range phase follows keys within `reach · β` of the best, not just β: passages of
    /// critical tokens are chained through keys just below the range, and stopping at β cuts
    /// those chains. Keys within β are expanded through the graph; keys in the band below
    /// them only along the sequence (the tokens before and after), which is where a passage
    /// continues, at two keys scored instead of a neighbour list. Only keys within β are
    /// returned. At 131,072 generated tokens (4 heads, seeds every 96 tokens, per-query
    /// mean DIPR recall): reach 1.65 → 0.942 at 2.77% of keys scored, 1.7 → 0.950 at 3.06%,
    /// 1.8 → 0.959 at 3.88%, 2.0 → 0.982 at 6.65%. Graph expansion of the whole band had
    /// reached 0.91 (summed recall) at 2.9% with reach 1.25 on two of those heads.
    pub reach: f32,
    /// Stop expanding once this many keys have been admitted to the range (a diffuse head's
    /// range can hold most of the context: past a caller's token budget, more exploring only
    /// finds keys the budget drops). `None`: the whole range.
    pub expand_limit: Option<usize>,
    /// Also start from every `seed_stride`-th token. A query that attends to several
    /// separate passages has its range in several regions of the graph, and one climb from
    /// the entry finds the nearest; a seed in each passage finds the others (far misses fell
    /// from 69% to 25% of the misses at 128K). Passages are 64–512 tokens long: at 256 and
    /// 128, short passages the query attends to were missed whole; 96 costs 1% of the keys
    /// (recall 0.905 → 0.942 against 128, at reach 1.65; 64 added 0.001). `None`: the entry
    /// point only. Indexes store a seed table of [`SEED_STRIDE`] (docs/format.md §19), which
    /// the seeds of that stride are scored from in one sequential scan.
    pub seed_stride: Option<u32>,
    /// Greedy climbs from the best seeds the beam did not expand, those within
    /// [`SEED_CLIMB_WINDOW`]` · β` of the best: a passage whose seed scores below the reach
    /// is found through its best keys.
    pub seed_climbs: usize,
}

/// How far below the best a seed may score and still be climbed from, in units of β.
pub const SEED_CLIMB_WINDOW: f32 = 3.0;

/// How far ahead in its queue the range phase prefetches adjacency records.
const PREFETCH_NODES_AHEAD: usize = 4;

/// Nodes of the range phase expanded together before their neighbours are scored.
const RANGE_BATCH: usize = 8;

/// The default seed stride, and the stride of the seed table indexes store.
pub const SEED_STRIDE: u32 = 96;

impl Default for DiprsParams {
    fn default() -> Self {
        DiprsParams {
            beta: 4.0,
            l0: 64,
            window_max: f32::NEG_INFINITY,
            prefix: None,
            reach: 1.7,
            expand_limit: None,
            seed_stride: Some(SEED_STRIDE),
            seed_climbs: 8,
        }
    }
}

/// Visited nodes, one bit each.
struct Visited(Vec<u64>);

impl Visited {
    fn new(n: u32) -> Visited {
        Visited(vec![0; (n as usize).div_ceil(64)])
    }
    /// Marks `id`; true when it was not marked before.
    fn insert(&mut self, id: u32) -> bool {
        let (w, b) = ((id / 64) as usize, id % 64);
        let fresh = self.0[w] >> b & 1 == 0;
        self.0[w] |= 1 << b;
        fresh
    }
}

/// Expands `node`: the unvisited qualifying neighbours, and, when filtering, the qualifying
/// neighbours of neighbours that do not qualify.
struct Expander {
    limit: u32,
    filtered: bool,
    visited: Visited,
    neighbors: Vec<u32>,
    second: Vec<u32>,
}

impl Expander {
    fn new(n: u32, prefix: Option<u32>) -> Expander {
        Expander {
            limit: prefix.map_or(n, |p| p.min(n)),
            filtered: prefix.is_some_and(|p| p < n),
            visited: Visited::new(n),
            neighbors: Vec::new(),
            second: Vec::new(),
        }
    }

    fn qualifies(&self, id: u32) -> bool {
        id < self.limit
    }

    /// The start node: the graph's entry if it qualifies, else token 0 (the first token,
    /// which every prefix contains).
    fn start<G: Graph>(&mut self, g: &G) -> Option<u32> {
        if self.limit == 0 {
            return None;
        }
        let s = if self.qualifies(g.entry()) { g.entry() } else { 0 };
        self.visited.insert(s);
        Some(s)
    }

    /// Expands `node`, then scores the fresh neighbours: `scores[i]` is `q · key(fresh[i])`.
    fn expand_scored<S: Keys + Graph>(
        &mut self,
        s: &S,
        node: u32,
        q: &[f32],
        (fresh, scores): (&mut Vec<u32>, &mut Vec<f32>),
        stats: &mut SearchStats,
    ) -> Result<(), BufferError> {
        self.expand(s, node, fresh, stats)?;
        score_all(s, q, (fresh, scores), stats)
    }

    /// The unvisited qualifying tokens just before and after `node`.
    fn expand_along_sequence(&mut self, node: u32, fresh: &mut Vec<u32>, stats: &mut SearchStats) {
        fresh.clear();
        stats.hops += 1;
        for k in [node.checked_sub(1), node.checked_add(1)].into_iter().flatten() {
            if self.qualifies(k) && self.visited.insert(k) {
                fresh.push(k);
            }
        }
    }

    fn expand<G: Graph>(
        &mut self,
        g: &G,
        node: u32,
        fresh: &mut Vec<u32>,
        stats: &mut SearchStats,
    ) -> Result<(), BufferError> {
        fresh.clear();
        self.neighbors.clear();
        g.neighbors(node, &mut self.neighbors, stats)?;
        stats.hops += 1;
        for i in 0..self.neighbors.len() {
            let k = self.neighbors[i];
            if self.qualifies(k) {
                if self.visited.insert(k) {
                    fresh.push(k);
                }
            } else if self.filtered && self.visited.insert(k) {
                self.second.clear();
                g.neighbors(k, &mut self.second, stats)?;
                stats.hops += 1;
                for &k2 in &self.second {
                    if self.qualifies(k2) && self.visited.insert(k2) {
                        fresh.push(k2);
                    }
                }
            }
        }
        Ok(())
    }
}

/// DIPRS: the keys within β of the best inner product (which starts at the window's best).
///
/// Two phases. A best-first beam of width `l0` first climbs from the entry point and the
/// seeds to the region of the best keys (the unpruned exploration of Algorithm 1, but
/// directed: a breadth-first start spends its `l0` keys around the entry point, far from the
/// range). Then every key found within `reach · β` of the best so far is expanded,
/// breadth-first, admitting only neighbours within that reach; keys that fall out of it as
/// the best rises are not expanded.
pub fn diprs<S: Keys + Graph>(s: &S, q: &[f32], p: &DiprsParams) -> Result<SearchResult, BufferError> {
    let mut stats = SearchStats::default();
    let mut ex = Expander::new(s.len(), p.prefix);
    let Some(start) = ex.start(s) else {
        return Ok(SearchResult::default());
    };
    let mut score = [0.0f32];
    s.score(&[start], q, &mut score, &mut stats)?;
    let mut best = score[0].max(p.window_max);
    let mut seen: Vec<(u32, f32)> = vec![(start, score[0])];
    let mut expanded = Visited::new(s.len());
    let (mut fresh, mut scores) = (Vec::new(), Vec::new());
    let mut beam = Beam::new(p.l0, Scored(score[0], start));
    let mut seeds = Vec::new();
    if let Some(stride) = p.seed_stride.map(|s| s.max(1)) {
        s.score_strided(stride, ex.limit, q, &mut scores, &mut stats)?;
        for (j, &sc) in scores.iter().enumerate() {
            let k = j as u32 * stride;
            if !ex.visited.insert(k) {
                continue; // the start node
            }
            seen.push((k, sc));
            seeds.push(Scored(sc, k));
            best = best.max(sc);
        }
    }
    // Only the beam's width of best seeds can ever be expanded by it (a key enters the
    // frontier only to be popped after every better one, and the climb ends at the first
    // popped key worse than all it keeps), so only those enter it: a selection, not a sort.
    let width = p.l0.max(1);
    if seeds.len() > width {
        seeds.select_nth_unstable_by(width - 1, |a, b| b.cmp(a));
    }
    for &seed in seeds.iter().take(width) {
        beam.add(seed);
    }
    while let Some(Scored(_, node)) = beam.next() {
        expanded.insert(node);
        ex.expand_scored(s, node, q, (&mut fresh, &mut scores), &mut stats)?;
        for (&k, &sc) in fresh.iter().zip(&scores) {
            seen.push((k, sc));
            best = best.max(sc);
            beam.offer(Scored(sc, k));
        }
    }
    // The beam fills with the best passage's keys; a seed in another passage the query
    // attends to may score below the reach until a climb finds that passage's best keys.
    let floor = best - SEED_CLIMB_WINDOW * p.beta;
    let mut candidates: Vec<Scored> = seeds.into_iter().filter(|s| s.0 >= floor).collect();
    candidates.sort_unstable_by(|a, b| b.cmp(a));
    let mut climbs = 0;
    for &Scored(sc, seed) in &candidates {
        if climbs == p.seed_climbs || sc < best - SEED_CLIMB_WINDOW * p.beta {
            break;
        }
        let (mut node, mut at) = (seed, sc);
        if !expanded.insert(node) {
            continue;
        }
        climbs += 1;
        loop {
            ex.expand_scored(s, node, q, (&mut fresh, &mut scores), &mut stats)?;
            let mut next = (node, at);
            for (&k, &sc) in fresh.iter().zip(&scores) {
                seen.push((k, sc));
                best = best.max(sc);
                if sc > next.1 {
                    next = (k, sc);
                }
            }
            if next.0 == node || !expanded.insert(next.0) {
                break;
            }
            (node, at) = next;
        }
    }
    let reach = p.beta * p.reach.max(1.0);
    let mut queue: Vec<(u32, f32)> = seen.iter().copied().filter(|&(_, sc)| sc >= best - reach).collect();
    let mut i = 0;
    let limit = p.expand_limit.unwrap_or(usize::MAX);
    let mut batch = Vec::new();
    while i < queue.len() && queue.len() < limit {
        // Up to RANGE_BATCH nodes are expanded before their neighbours are scored, in one
        // batch: the scoring pipelines its memory reads across them.
        batch.clear();
        let mut taken = 0;
        while i < queue.len() && taken < RANGE_BATCH {
            let (node, sc) = queue[i];
            if let Some(&(ahead, _)) = queue.get(i + PREFETCH_NODES_AHEAD) {
                s.prefetch(ahead);
            }
            i += 1;
            if sc < best - reach || !expanded.insert(node) {
                continue;
            }
            taken += 1;
            if sc < best - p.beta {
                ex.expand_along_sequence(node, &mut fresh, &mut stats);
            } else {
                ex.expand(s, node, &mut fresh, &mut stats)?;
            }
            batch.extend_from_slice(&fresh);
        }
        score_all(s, q, (&batch, &mut scores), &mut stats)?;
        for (&k, &sc) in batch.iter().zip(&scores) {
            seen.push((k, sc));
            best = best.max(sc);
            if sc >= best - reach {
                queue.push((k, sc));
            }
        }
    }
    let pairs = seen.into_iter().filter(|&(_, sc)| sc >= best - p.beta).collect();
    Ok(SearchResult::from_pairs(pairs, stats))
}

/// Scores every key of `ids`: `scores[i]` is `q · key(ids[i])`.
fn score_all<S: Keys>(
    s: &S,
    q: &[f32],
    (ids, scores): (&[u32], &mut Vec<f32>),
    stats: &mut SearchStats,
) -> SourceResult {
    scores.resize(ids.len(), 0.0);
    s.score(ids, q, scores, stats)
}

/// The best-first climb both searches share: a frontier of keys to expand, best first, and
/// the `width` best keys found. It ends when the best unexpanded key is worse than all of
/// those.
struct Beam {
    frontier: BinaryHeap<Scored>,
    kept: BinaryHeap<Reverse<Scored>>,
    width: usize,
}

impl Beam {
    fn new(width: usize, first: Scored) -> Beam {
        Beam { frontier: BinaryHeap::from([first]), kept: BinaryHeap::from([Reverse(first)]), width: width.max(1) }
    }

    /// Queues `key` for expansion and keeps it among the best, whatever it scores.
    fn add(&mut self, key: Scored) {
        self.frontier.push(key);
        self.kept.push(Reverse(key));
        if self.kept.len() > self.width {
            self.kept.pop();
        }
    }

    /// Adds `key` when the beam has room or it beats the worst key kept.
    fn offer(&mut self, key: Scored) {
        if self.kept.len() < self.width || self.kept.peek().is_some_and(|w| key.0 > w.0 .0) {
            self.add(key);
        }
    }

    /// The next key to expand, or `None` once the climb is over.
    fn next(&mut self) -> Option<Scored> {
        let key = self.frontier.pop()?;
        let worse_than_all_kept = self.kept.len() >= self.width && self.kept.peek().is_some_and(|w| key.0 < w.0 .0);
        (!worse_than_all_kept).then_some(key)
    }

    /// The best keys kept, in no order.
    fn into_kept(self) -> impl Iterator<Item = Scored> {
        self.kept.into_iter().map(|Reverse(k)| k)
    }
}

/// A (score, id) pair ordered best first: higher score, then lower id.
#[derive(Clone, Copy, PartialEq)]
pub(crate) struct Scored(pub f32, pub u32);
impl Eq for Scored {}
impl PartialOrd for Scored {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Scored {
    /// Higher score first; among equal scores, the lower id.
    fn cmp(&self, o: &Self) -> Ordering {
        self.0.total_cmp(&o.0).then(o.1.cmp(&self.1))
    }
}

/// Best-first beam search for the `k` keys with the largest inner products, keeping a beam
/// of `ef ≥ k`.
pub fn topk<S: Keys + Graph>(
    s: &S,
    q: &[f32],
    k: usize,
    ef: usize,
    prefix: Option<u32>,
) -> Result<SearchResult, BufferError> {
    let ef = ef.max(k).max(1);
    let mut stats = SearchStats::default();
    let mut ex = Expander::new(s.len(), prefix);
    let Some(start) = ex.start(s) else {
        return Ok(SearchResult::default());
    };
    let mut score = [0.0f32];
    s.score(&[start], q, &mut score, &mut stats)?;
    let mut beam = Beam::new(ef, Scored(score[0], start));
    let (mut fresh, mut scores) = (Vec::new(), Vec::new());
    while let Some(Scored(_, node)) = beam.next() {
        ex.expand_scored(s, node, q, (&mut fresh, &mut scores), &mut stats)?;
        for (&id, &sc) in fresh.iter().zip(&scores) {
            beam.offer(Scored(sc, id));
        }
    }
    let mut pairs: Vec<(u32, f32)> = beam.into_kept().map(|Scored(s, id)| (id, s)).collect();
    pairs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    pairs.truncate(k);
    Ok(SearchResult::from_pairs(pairs, stats))
}
