//! Graph searches, written once over [`Keys`] and [`Graph`]: DIPRS (Algorithm 1 of the
//! AlayaDB paper, window-enhanced), top-k beam search, and the prefix filter (only tokens
//! below P qualify; the search walks two hops through tokens that do not, so the graph stays
//! connected).

use crate::source::{Graph, Keys, SourceResult};
use crate::stats::{SearchResult, SearchStats, SeedScores};
use crate::target::MassTarget;
use ctxfs_buffer::BufferError;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DiprsParams {
    /// The range below the best inner product, in inner-product units.
    pub beta: f32,
    /// The width of a best-first climb through the graph from the best seeds (and the
    /// previous tokens) to the best keys, before the range phase; 0: no climb, the seed runs
    /// start the range. As wide as the keys, the climb is exhaustive: the search returns the
    /// exact DIPR set. 16 by default: on real attention the seed runs alone miss critical
    /// keys that lie away from the best seeds, which the climb reaches through the graph
    /// (`ctxfs bench search --data`, SmolLM2-135M at 8K and 32K tokens, β = 5√d: output error
    /// 1.17–1.73× the exact DIPR set's without the climb, 1.09–1.17× with it, DIPR recall
    /// 0.85–0.90 against 0.88–0.93, for 0.2–1.8 points more of the keys scored; at 8K, widths
    /// 8 and 32 gave 1.12–1.14× and 1.06–1.08×). On the generator at 131,072 tokens it costs
    /// ~14% of the median search.
    pub l0: usize,
    /// The best score of the caller's window (−∞ without one): DIPRS prunes against it from
    /// the start instead of discovering a high score late.
    pub window_max: f32,
    /// Only tokens below this qualify (partial-prefix reuse).
    pub prefix: Option<u32>,
    /// The range phase follows keys within `reach · β` of the best, not just β: passages of
    /// critical tokens are chained through keys just below the range, and stopping at β cuts
    /// those chains. Keys within β are expanded along the sequence (`range_run`) and the best
    /// of them through the graph (`graph_band`); keys in the band below them only along the
    /// sequence (`sequence_run`), which is where a passage continues. Only keys within β are
    /// returned. 1.2 by default (`ctxfs bench search`, 128K tokens): against 1.25 the diffuse
    /// heads score 17% fewer keys at nearly the same recall; 1.1 loses recall (0.965 at 1.96%
    /// of the keys, against 0.976 at 2.24%) and is no faster.
    pub reach: f32,
    /// How many tokens before and after a key in the band are scored: consecutive rows are
    /// one sequential read, so a run costs little more than a neighbour, and a passage is
    /// crossed in a few steps instead of one token per step. On `ctxfs bench search`'s
    /// 128K-token heads (β = 5√d; DIPR recall, keys scored): runs of 12 with reach 1.25 gave
    /// 0.959 at 2.64% and a mean search of 354 µs (p90 602), where single tokens with reach
    /// 1.7 gave 0.951 at 3.08% and 437 µs (p90 957); runs of 16 (0.955 at 2.54%) and of 2
    /// (0.943 at 2.67%) did worse. At 16,384 tokens: 0.980 at 8.6% of the keys against 0.975
    /// at 9.9% for single tokens.
    pub sequence_run: u32,
    /// Stop expanding once this many keys have been admitted to the range (a diffuse head's
    /// range can hold most of the context: past a caller's token budget, more exploring only
    /// finds keys the budget drops). `None`: the whole range.
    pub expand_limit: Option<usize>,
    /// Also start from every `seed_stride`-th token. A query that attends to several
    /// separate passages has its range in several regions of the graph, and one climb from
    /// the entry finds the nearest; a seed in each passage finds the others (at 128K tokens,
    /// far misses are 25% of the misses with seeds, 69% without). Passages are 64–512 tokens
    /// long, and wider strides miss short passages the query attends to whole (`ctxfs bench
    /// search`: DIPR recall 0.937 at stride 128 and 0.927 at 192, against 0.976 at 96); about
    /// 100 costs 1% of the keys, and 64 adds ~0.001 of recall. `None`: the entry point only.
    /// Indexes store a seed table of their stride (docs/format.md §19, [`SEED_STRIDE`] as
    /// written), which the seeds of that stride are scored from in one sequential scan.
    pub seed_stride: Option<u32>,
    /// How many of the best seeds have the `range_run` tokens before and after them scored
    /// before the range phase. A seed is one token of its passage: a passage the query
    /// attends to may have its seed score below the reach while the tokens next to it score
    /// within β. Consecutive rows are one sequential read, and the runs' first rows are read
    /// together, so eight runs cost about what 100 scattered rows do (`ctxfs bench search`:
    /// six runs reach DIPR recall 0.973, against 0.976 with eight, and are no faster).
    pub seed_runs: usize,
    /// How many tokens before and after a key within β the range phase scores (and each seed
    /// run): critical tokens come in passages, which consecutive rows cross in a few reads.
    pub range_run: u32,
    /// Keys within `graph_band · β` of the best are also expanded through the graph, which
    /// finds what their passage does not hold (the queries that trained the graph linked
    /// them); the rest of the range is crossed along the sequence. On `ctxfs bench search`'s
    /// 128K-token heads: 0.5, DIPR recall 0.980 at 2.34% of the keys; 0.25 (the default),
    /// 0.976 at 2.24% and ~10% faster; 0.15, 0.974 and no faster; 0 (the sequence only),
    /// 0.966 at 2.25%.
    pub graph_band: f32,
    /// Narrow β for a diffuse range: when the seeds within β of the best say the range holds
    /// more than this many tokens (each seed standing for `seed_stride`), β shrinks to the
    /// score of the best `range_target / seed_stride` seeds, so the search explores and
    /// returns about this many. For a caller that estimates the rest of the softmax from the
    /// seeds (what sessions do): a diffuse head's range is mostly tail, and retrieving it
    /// token by token costs a search, reads and sums for little of its mass. `None`: β as
    /// given.
    pub range_target: Option<usize>,
    /// Choose β per query instead: widen the range until the softmax mass the seed sample
    /// estimates below it is at most the target's share ([`crate::target`]). β is then
    /// ignored, and so is `range_target`. Needs seeds.
    pub target: Option<MassTarget>,
}

/// How far ahead in its queue the range phase prefetches adjacency records.
const PREFETCH_NODES_AHEAD: usize = 4;

/// Keys the beam expands together: their adjacency records, then their neighbours' rows,
/// are read in parallel instead of one hop after another. On `ctxfs bench search`'s
/// 128K-token heads, a climb of 16 took 53 µs from cold caches expanding 4 keys at a time
/// against 63 µs expanding one, for 0.6% more keys scored (2 and 8 gained less).
const BEAM_BATCH: usize = 4;

/// Nodes of the range phase expanded together before their neighbours are scored: more
/// reads in flight per batch, and the best is known later, so slightly more keys enter the
/// reach (`ctxfs bench search`, 128K tokens: DIPR recall 0.961 with batches of 32 against
/// 0.957 with 8, at 0.1% more keys).
const RANGE_BATCH: usize = 32;

/// The default seed stride, and the stride of the seed table an index is written with (a
/// reader takes the stride its index stores: [`crate::paged::Layout::search_stride`]).
/// Prime: text that repeats every `p` tokens (a template, a table's rows, a log's lines)
/// puts the seeds on every phase of its period for any `p` below it, where a stride with
/// divisors samples only the phases its common factor with `p` leaves, and the tail
/// estimate, each seed standing for its stride's tokens, is biased (at 96 on SmolLM2's
/// prose repeated every 96 tokens, every seed fell on one phase).
pub const SEED_STRIDE: u32 = 97;

impl Default for DiprsParams {
    fn default() -> Self {
        DiprsParams {
            beta: 4.0,
            l0: 16,
            window_max: f32::NEG_INFINITY,
            prefix: None,
            reach: 1.2,
            sequence_run: 12,
            expand_limit: None,
            seed_stride: Some(SEED_STRIDE),
            seed_runs: 8,
            range_run: 24,
            graph_band: 0.25,
            range_target: None,
            target: None,
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

    fn contains(&self, id: u32) -> bool {
        self.0[(id / 64) as usize] >> (id % 64) & 1 == 1
    }

    /// Marks every id of `from..to` (`to` at most the length), appending those not marked
    /// before to `fresh` in ascending order: a word of the bitmap at a time.
    fn insert_range(&mut self, from: u32, to: u32, fresh: &mut Vec<u32>) {
        let mut at = from;
        while at < to {
            let (w, b) = ((at / 64) as usize, at % 64);
            let span = (to - at).min(64 - b);
            let mask = if span == 64 { u64::MAX } else { ((1u64 << span) - 1) << b };
            let mut new = mask & !self.0[w];
            self.0[w] |= mask;
            while new != 0 {
                fresh.push(w as u32 * 64 + new.trailing_zeros());
                new &= new - 1;
            }
            at += span;
        }
    }
}

/// The fresh neighbours of several expanded nodes and their scores: node `i`'s are
/// `keys[ends[i - 1]..ends[i]]`.
#[derive(Default)]
struct Batch {
    keys: Vec<u32>,
    scores: Vec<f32>,
    ends: Vec<usize>,
    fresh: Vec<u32>,
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

    /// Where a climb starts: the graph's entry if it qualifies, else token 0 (the first
    /// token, which every prefix contains).
    fn entry<G: Graph>(&self, g: &G) -> u32 {
        if self.qualifies(g.entry()) {
            g.entry()
        } else {
            0
        }
    }

    /// The start node ([`Expander::entry`]), marked visited; `None` when nothing qualifies.
    fn start<G: Graph>(&mut self, g: &G) -> Option<u32> {
        if self.limit == 0 {
            return None;
        }
        let s = self.entry(g);
        self.visited.insert(s);
        Some(s)
    }

    /// Marks the `run` tokens before and after each of `seeds` visited and appends those
    /// not visited before to `batch.keys`, interleaved (every run's first token, then every
    /// run's second, ...): each run starts on a page the search has not read, and
    /// interleaved, those first reads are in flight together instead of one after another.
    fn seed_runs(&mut self, seeds: &[Scored], run: u32, batch: &mut Batch, stats: &mut SearchStats) {
        batch.fresh.clear();
        // Each run's fresh tokens, as a span of `batch.fresh`.
        let mut spans = Vec::with_capacity(seeds.len());
        for &Scored(_, seed) in seeds {
            let to = seed.saturating_add(run).saturating_add(1).min(self.limit);
            let from = batch.fresh.len();
            self.visited.insert_range(seed.saturating_sub(run), to, &mut batch.fresh);
            spans.push(from..batch.fresh.len());
            stats.hops += 1;
        }
        let longest = spans.iter().map(|span| span.len()).max().unwrap_or(0);
        for i in 0..longest {
            for span in &spans {
                if i < span.len() {
                    batch.keys.push(batch.fresh[span.start + i]);
                }
            }
        }
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

    /// Expands each of `nodes`, then scores all their fresh neighbours in one call, so the
    /// reads of every node's rows overlap.
    fn expand_batch<S: Keys + Graph>(
        &mut self,
        s: &S,
        nodes: impl Iterator<Item = u32>,
        q: &[f32],
        batch: &mut Batch,
        stats: &mut SearchStats,
    ) -> SourceResult {
        batch.keys.clear();
        batch.ends.clear();
        for node in nodes {
            self.expand(s, node, &mut batch.fresh, stats)?;
            batch.keys.extend_from_slice(&batch.fresh);
            batch.ends.push(batch.keys.len());
        }
        score_all(s, q, (&batch.keys, &mut batch.scores), stats)
    }

    /// The unvisited qualifying tokens among the `run` before and the `run` after `node`
    /// (which is visited): those before it walking back, then those after it.
    fn expand_along_sequence(&mut self, node: u32, run: u32, fresh: &mut Vec<u32>, stats: &mut SearchStats) {
        fresh.clear();
        stats.hops += 1;
        debug_assert!(self.visited.contains(node), "node {node} is expanded before it is visited");
        let to = node.saturating_add(run).saturating_add(1).min(self.limit);
        self.visited.insert_range(node.saturating_sub(run), to, fresh);
        // Nearest first on each side: the tokens before `node` walking back, then after.
        let before = fresh.partition_point(|&k| k < node);
        fresh[..before].reverse();
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
/// The seeds (every `seed_stride`-th token, one sequential scan of the index's seed table)
/// say where the best keys lie; the tokens around the best seeds are scored next (the seed
/// runs); an optional best-first climb of width `l0` through the graph follows. Then every
/// key found within `reach · β` of the best so far is expanded, breadth-first, admitting only
/// neighbours within that reach; keys that fall out of it as the best rises are not
/// expanded.
pub fn diprs<S: Keys + Graph>(s: &S, q: &[f32], p: &DiprsParams) -> Result<SearchResult, BufferError> {
    diprs_from(s, q, p, &[])
}

/// [`diprs`], also starting from `previous`: tokens a search for a nearby query returned
/// (the last decode step's, for the same q head; critical tokens repeat from step to step).
/// They are scored with the seed runs and enter the range like them. A climb (`l0 > 0`) is
/// skipped when the best of them scores at least the best seed: they already lie in the
/// best region. `ctxfs bench search`'s warm row (each q head's decode queries as
/// consecutive steps, each from the last's 64 best): 74–82 µs against 77–86 µs afresh, DIPR
/// recall 0.975 at 2.15% of the keys against 0.976 at 2.24%. With a climb the previous
/// tokens matter more: they let it be skipped.
pub fn diprs_from<S: Keys + Graph>(
    s: &S,
    q: &[f32],
    p: &DiprsParams,
    previous: &[u32],
) -> Result<SearchResult, BufferError> {
    let mut stats = SearchStats::default();
    let mut ex = Expander::new(s.len(), p.prefix);
    if ex.limit == 0 {
        return Ok(SearchResult::default());
    }
    let mut seen: Vec<(u32, f32)> = Vec::with_capacity(SEEN_CAPACITY.min(s.len() as usize));
    // The keys a climb expanded, which the range phase does not expand again (every other
    // key enters its queue once: a key is scored once). Sorted once the climb ends.
    let mut climbed: Vec<u32> = Vec::new();
    let seeds = match p.seed_stride {
        Some(stride) => Seeds::score(s, stride.max(1), &mut ex, q, &mut stats)?,
        None => Seeds::default(),
    };
    let mut best = p.window_max.max(seeds.best());
    let target = p.target.filter(|_| !seeds.scores.is_empty());
    let mut beta = match (target, p.range_target, p.seed_stride) {
        (Some(t), _, _) => seeds.target_beta(&t, 0.0, f32::INFINITY, best),
        (None, Some(target), Some(stride)) => seeds.narrowed(p.beta, best, target / stride.max(1) as usize),
        _ => p.beta,
    };
    // The previous tokens and the seed runs, scored in one batch so their reads overlap.
    let mut batch = Batch::default();
    batch.keys.extend(previous.iter().copied().filter(|&k| ex.qualifies(k) && ex.visited.insert(k)));
    let from_previous = batch.keys.len();
    ex.seed_runs(&seeds.best_of(p.seed_runs), p.range_run, &mut batch, &mut stats);
    score_all(s, q, (&batch.keys, &mut batch.scores), &mut stats)?;
    let warm_best = batch.scores[..from_previous].iter().copied().fold(f32::NEG_INFINITY, f32::max);
    seen.extend(batch.keys.iter().copied().zip(batch.scores.iter().copied()));
    best = seen.iter().map(|k| k.1).fold(best, f32::max);
    // A climb as wide as the keys is exhaustive (it returns the exact set): the caller asked
    // for it, so it runs whatever the previous tokens score.
    let exhaustive = p.l0 >= s.len() as usize;
    // Without seeds or previous tokens only a climb from the entry can start the range.
    let width = if seen.is_empty() && seeds.scores.is_empty() { p.l0.max(1) } else { p.l0 };
    if width > 0 && (from_previous == 0 || exhaustive || warm_best < seeds.best()) {
        let entry = ex.entry(s);
        let first = if ex.visited.insert(entry) {
            let mut score = [0.0f32];
            s.score(&[entry], q, &mut score, &mut stats)?;
            seen.push((entry, score[0]));
            best = best.max(score[0]);
            Scored(score[0], entry)
        } else {
            // A seed, or a token scored above.
            let sc = seeds.score_of(entry).or_else(|| seen.iter().find(|k| k.0 == entry).map(|k| k.1));
            Scored(sc.unwrap_or(f32::NEG_INFINITY), entry)
        };
        let mut beam = Beam::new(width, first);
        // Only the beam's width of best seeds can ever be expanded by it (a key enters the
        // frontier only to be popped after every better one, and the climb ends at the first
        // popped key worse than all it keeps), so only those enter it.
        for seed in seeds.best_of(width) {
            if seed.1 != entry {
                s.prefetch(seed.1);
                beam.add(seed);
            }
        }
        for &(k, sc) in &seen {
            if k != entry {
                beam.offer(Scored(sc, k));
            }
        }
        let mut nodes = Vec::with_capacity(BEAM_BATCH);
        loop {
            // Up to BEAM_BATCH of the best unexpanded keys are expanded together: their
            // records and then their neighbours' rows are read in parallel, not one hop
            // after another.
            nodes.clear();
            while nodes.len() < BEAM_BATCH {
                let Some(Scored(_, node)) = beam.next() else { break };
                s.prefetch(node);
                climbed.push(node);
                nodes.push(node);
            }
            if nodes.is_empty() {
                break;
            }
            ex.expand_batch(s, nodes.iter().copied(), q, &mut batch, &mut stats)?;
            for (&k, &sc) in batch.keys.iter().zip(&batch.scores) {
                seen.push((k, sc));
                best = best.max(sc);
                beam.offer(Scored(sc, k));
            }
        }
    }
    // Keys the range phase (or the climb) expanded: each is expanded once, however often a
    // wider range queues it again.
    let mut expanded = Visited::new(s.len());
    for &node in &climbed {
        expanded.insert(node);
    }
    let limit = p.expand_limit.unwrap_or(usize::MAX);
    let mut admitted = 0;
    let mut missing = None;
    for round in 0.. {
        range_phase(
            s,
            q,
            p,
            beta,
            &mut best,
            (&mut ex, &mut expanded),
            (&seeds, &mut seen),
            &mut batch,
            (&mut admitted, limit),
            &mut stats,
        )?;
        let Some(t) = target else { break };
        let cut = best - beta;
        let inside: f64 = seen
            .iter()
            .copied()
            .chain(seeds.pairs())
            .filter(|&(_, sc)| sc >= cut)
            .map(|(_, sc)| t.weight(sc, best))
            .sum();
        let below = seeds.below(cut);
        let m = t.missing_share(inside, &below, seeds.stride, best);
        missing = Some(m as f32);
        if m <= f64::from(t.share) || admitted >= limit || round == MAX_TARGET_ROUNDS {
            break;
        }
        let wider = t.sampled_beta(inside, &below, seeds.stride, best);
        if wider <= beta {
            break;
        }
        beta = wider;
    }
    let pairs = seen.into_iter().chain(seeds.pairs()).filter(|&(_, sc)| sc >= best - beta).collect();
    let mut result = SearchResult::from_pairs(pairs, stats);
    result.chosen_beta = (target.is_some() || beta < p.beta).then_some(beta);
    result.missing_share = missing;
    result.seeds = seeds.into_scores();
    Ok(result)
}

/// Widenings of a range a mass target may ask for: each costs a pass over the keys found.
const MAX_TARGET_ROUNDS: usize = 16;

/// DIPRS's range phase at `beta`: every key scored within `reach · β` of the best and not
/// yet expanded is expanded, breadth-first, and its neighbours within the reach queued.
#[allow(clippy::too_many_arguments)]
fn range_phase<S: Keys + Graph>(
    s: &S,
    q: &[f32],
    p: &DiprsParams,
    beta: f32,
    best: &mut f32,
    (ex, expanded): (&mut Expander, &mut Visited),
    (seeds, seen): (&Seeds, &mut Vec<(u32, f32)>),
    batch: &mut Batch,
    (admitted, limit): (&mut usize, usize),
    stats: &mut SearchStats,
) -> SourceResult {
    let reach = beta * p.reach.max(1.0);
    let graph_floor = beta * p.graph_band.clamp(0.0, 1.0);
    // In the order the keys were scored: the seeds, then the rest.
    let mut queue: Vec<(u32, f32)> = seeds
        .pairs()
        .chain(seen.iter().copied())
        .filter(|&(k, sc)| sc >= *best - reach && !expanded.contains(k))
        .collect();
    *admitted += queue.len();
    let mut i = 0;
    while i < queue.len() && *admitted < limit {
        // Up to RANGE_BATCH nodes are expanded before their neighbours are scored, in one
        // batch: the scoring pipelines its memory reads across them.
        batch.keys.clear();
        let mut taken = 0;
        while i < queue.len() && taken < RANGE_BATCH {
            let (node, sc) = queue[i];
            if let Some(&(ahead, _)) = queue.get(i + PREFETCH_NODES_AHEAD) {
                s.prefetch(ahead);
            }
            i += 1;
            if sc < *best - reach || !expanded.insert(node) {
                continue;
            }
            taken += 1;
            if sc >= *best - beta {
                if p.range_run > 0 {
                    ex.expand_along_sequence(node, p.range_run, &mut batch.fresh, stats);
                    batch.keys.extend_from_slice(&batch.fresh);
                }
                if sc >= *best - graph_floor {
                    ex.expand(s, node, &mut batch.fresh, stats)?;
                    batch.keys.extend_from_slice(&batch.fresh);
                }
            } else {
                ex.expand_along_sequence(node, p.sequence_run, &mut batch.fresh, stats);
                batch.keys.extend_from_slice(&batch.fresh);
            }
        }
        score_all(s, q, (&batch.keys, &mut batch.scores), stats)?;
        for (&k, &sc) in batch.keys.iter().zip(&batch.scores) {
            seen.push((k, sc));
            *best = best.max(sc);
            if sc >= *best - reach {
                queue.push((k, sc));
                *admitted += 1;
            }
        }
    }
    Ok(())
}

/// Keys scored besides the seeds, sized so a typical search never grows it.
const SEEN_CAPACITY: usize = 4096;

/// The seeds' scores, kept apart from the other keys scored: a thousand pushes of keys
/// that mostly score far below the range cost a tenth of a search.
#[derive(Default)]
struct Seeds {
    stride: u32,
    /// `scores[j]` is the score of token `j · stride`; −∞ for the start node, scored first.
    scores: Vec<f32>,
}

impl Seeds {
    /// Scores every `stride`-th qualifying token and marks it visited.
    fn score<S: Keys>(
        s: &S,
        stride: u32,
        ex: &mut Expander,
        q: &[f32],
        stats: &mut SearchStats,
    ) -> Result<Seeds, BufferError> {
        let mut scores = Vec::new();
        s.score_strided(stride, ex.limit, q, &mut scores, stats)?;
        for j in 0..scores.len() as u32 {
            ex.visited.insert(j * stride);
        }
        Ok(Seeds { stride, scores })
    }

    /// The score of `token`, when it is a seed.
    fn score_of(&self, token: u32) -> Option<f32> {
        if self.stride == 0 || !token.is_multiple_of(self.stride) {
            return None;
        }
        self.scores.get((token / self.stride) as usize).copied()
    }

    fn best(&self) -> f32 {
        self.scores.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }

    /// The scores of the seeds below `cut`, ascending.
    fn below(&self, cut: f32) -> Vec<f32> {
        let mut below: Vec<f32> = self.scores.iter().copied().filter(|&sc| sc < cut).collect();
        below.sort_unstable_by(f32::total_cmp);
        below
    }

    /// The β a mass target asks for, given the weight of the keys scored within the range
    /// cut at `cut` (`inside`) and the seeds below it.
    fn target_beta(&self, t: &MassTarget, inside: f64, cut: f32, best: f32) -> f32 {
        t.sampled_beta(inside, &self.below(cut), self.stride, best)
    }

    /// `beta`, or less when more than `keep` seeds (at least 1) score within it of `best`:
    /// then the β that keeps the best `keep` of them.
    fn narrowed(&self, beta: f32, best: f32, keep: usize) -> f32 {
        let keep = keep.max(1);
        let mut within: Vec<f32> = self.pairs().map(|(_, sc)| sc).filter(|&sc| sc >= best - beta).collect();
        if within.len() <= keep {
            return beta;
        }
        let (_, &mut kth, _) = within.select_nth_unstable_by(keep - 1, |a, b| b.total_cmp(a));
        (best - kth).min(beta)
    }

    fn into_scores(self) -> SeedScores {
        SeedScores { stride: self.stride, scores: self.scores }
    }

    /// (token, score) of every seed.
    fn pairs(&self) -> impl Iterator<Item = (u32, f32)> + '_ {
        self.scores.iter().enumerate().map(|(j, &sc)| (j as u32 * self.stride, sc))
    }

    /// The `width` best seeds (the lower ids among equal scores), best first: one pass that
    /// keeps them in order. Most seeds fail the first comparison, so this costs about a read
    /// of the scores (a selection over all 1,366 seeds of 131,072 tokens took 10 µs, from
    /// cold caches).
    fn best_of(&self, width: usize) -> Vec<Scored> {
        let mut kept: Vec<Scored> = Vec::with_capacity(width + 1);
        let mut floor = f32::NEG_INFINITY;
        for (j, &sc) in self.scores.iter().enumerate() {
            if width == 0 || sc <= floor {
                continue;
            }
            let key = Scored(sc, j as u32 * self.stride);
            kept.insert(kept.partition_point(|k| *k > key), key);
            kept.truncate(width);
            if kept.len() == width {
                floor = kept[width - 1].0;
            }
        }
        kept
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_of_is_a_full_sort_truncated() {
        // Scores from a small range, so ties (broken by the lower id) are common.
        let stride = 3;
        let scores: Vec<f32> = (0..500u32).map(|i| (i.wrapping_mul(2_654_435_761) % 37) as f32 - 18.0).collect();
        let seeds = Seeds { stride, scores: scores.clone() };
        for n in [0, 1, 7, 24, 499, 500, 800] {
            let mut sorted: Vec<Scored> =
                scores.iter().enumerate().map(|(j, &sc)| Scored(sc, j as u32 * stride)).collect();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            sorted.truncate(n);
            let pairs = |v: &[Scored]| v.iter().map(|k| (k.0.to_bits(), k.1)).collect::<Vec<_>>();
            assert_eq!(pairs(&seeds.best_of(n)), pairs(&sorted), "n = {n}");
        }
    }
}
