//! Query-guided graph build (RoarGraph-style), per (layer, kv head):
//!
//! 1. **kNN**: for sampled prefill queries (from every q head of the GQA group), the exact
//!    top-`nq` keys by inner product;
//! 2. **projection**: each query's best keys (the pivots) are linked to the query's other top
//!    keys, pruned by occlusion to `degree` edges (a candidate is dropped when it is more
//!    similar to an already kept neighbour than to the pivot); reverse edges fill spare slots;
//! 3. **sequence edges** (optional, on by default): each token links to its neighbours in the
//!    sequence, since critical tokens cluster in passages;
//! 4. **connectivity enhancement**: every key not reachable from the entry point is found by
//!    a search on the graph so far, linked from the most similar reachable key with room (or
//!    from the previously linked key), and given edges back to the keys the search found.
//!
//! Steps 1 and 2 run in parallel; the result does not depend on the thread count.

use crate::mem::{MemGraph, MemKeys};
use crate::search;
use crate::source::{Graph, Keys, Pair, SourceResult};
use crate::stats::SearchStats;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct BuildParams {
    /// Out-degree of the projected graph (M).
    pub degree: usize,
    /// Out-edges connectivity enhancement may add beyond `degree`.
    pub extra_degree: usize,
    /// Top keys each training query links (N_q).
    pub nq: usize,
    /// How many of each query's best keys act as pivots, linked to the query's other keys.
    pub pivots: usize,
    /// Training queries used at most; more are sampled evenly.
    pub max_queries: usize,
    /// Chooses which queries are sampled when there are more than `max_queries`.
    pub seed: u64,
    /// Beam of the searches that link unreachable keys.
    pub enhance_ef: usize,
    /// Also link each token to the tokens before and after it (two edges beyond `degree`).
    /// Not in the paper: it exploits the locality of critical tokens, and measurably raises
    /// DIPRS recall on passage-structured data at the same work.
    pub sequence_edges: bool,
    pub threads: usize,
}

impl Default for BuildParams {
    fn default() -> Self {
        BuildParams {
            degree: 32,
            extra_degree: 16,
            nq: 100,
            pivots: 8,
            max_queries: 16384,
            seed: 0,
            enhance_ef: 32,
            sequence_edges: true,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

/// How long each phase took, and what it did.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuildReport {
    pub knn: Duration,
    pub projection: Duration,
    pub enhancement: Duration,
    pub queries: usize,
    /// Keys that were unreachable after projection and got an enhancement edge.
    pub enhanced: usize,
}

/// Training queries scored together against each block of keys.
const KNN_QUERY_BATCH: usize = 32;
/// Keys per block in the kNN (512 keys of d = 128 in f16: 128 KiB, an L2-resident block).
const KNN_KEY_BLOCK: usize = 512;

/// The `k` best ids by score, best first (ties: lower id first). One pass with a heap of the
/// `k` best so far: most keys are rejected by one comparison with the worst of them.
fn top(scores: &[f32], k: usize) -> Vec<u32> {
    use crate::search::Scored;
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let k = k.min(scores.len());
    if k == 0 {
        return Vec::new();
    }
    // A min-heap by rank: its top is the worst of the best k so far.
    let mut heap: BinaryHeap<Reverse<Scored>> = BinaryHeap::with_capacity(k + 1);
    // The worst kept score once the heap is full: a later id with a score no higher ranks
    // below it, so one comparison rejects it.
    let mut worst = f32::NEG_INFINITY;
    for (i, &s) in scores.iter().enumerate() {
        if heap.len() == k {
            if s.total_cmp(&worst).is_le() {
                continue;
            }
            heap.pop();
        }
        heap.push(Reverse(Scored(s, i as u32)));
        if heap.len() == k {
            worst = heap.peek().map_or(f32::NEG_INFINITY, |w| w.0 .0);
        }
    }
    let mut best: Vec<Scored> = heap.into_iter().map(|r| r.0).collect();
    best.sort_by(|a, b| b.cmp(a));
    best.into_iter().map(|r| r.1).collect()
}

/// Indices of up to `max` of `m` queries, evenly spaced from an offset the seed picks.
fn sample(m: usize, max: usize, seed: u64) -> Vec<usize> {
    if m <= max {
        return (0..m).collect();
    }
    let stride = m as f64 / max as f64;
    let offset = (seed % 1024) as f64 / 1024.0 * stride;
    (0..max).map(|i| ((offset + i as f64 * stride) as usize).min(m - 1)).collect()
}

/// Runs `f` over `0..n` split across `threads`, collecting results in order.
fn parallel<T: Send>(n: usize, threads: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let chunk = n.div_ceil(threads.max(1)).max(1);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (0..n)
            .step_by(chunk)
            .map(|start| s.spawn(move || (start..(start + chunk).min(n)).map(f).collect::<Vec<T>>()))
            .collect();
        handles.into_iter().flat_map(|h| h.join().expect("build thread panicked")).collect()
    })
}

fn to_f32(row: &[half::f16]) -> Vec<f32> {
    row.iter().map(|x| x.to_f32()).collect()
}

/// Builds the graph of `keys` trained on `queries` (rows of the key dimension).
pub fn build(keys: &MemKeys, queries: &[f32], p: &BuildParams) -> (MemGraph, BuildReport) {
    let d = keys.dim();
    let n = keys.len() as usize;
    assert!(queries.len().is_multiple_of(d), "queries are not rows of {d}");
    assert!(p.degree > 0 && p.nq > 1);
    let mut report = BuildReport::default();
    if n == 0 {
        return (MemGraph::from_lists(p.degree, &[], 0), report);
    }

    // 1. The exact top-nq keys of each sampled query.
    let t = Instant::now();
    let picked = sample(queries.len() / d, p.max_queries, p.seed);
    report.queries = picked.len();
    let nq = p.nq.min(n);
    // Queries go in batches against blocks of keys small enough to stay in cache: each key
    // block is read from memory once per batch, not once per query.
    let batches = picked.len().div_ceil(KNN_QUERY_BATCH);
    // The keys in f32, dimension-major by block, converted once for every batch: the kernel
    // then scores four queries per key load with no horizontal sum per score.
    let blocks: Vec<Vec<f32>> = parallel(n.div_ceil(KNN_KEY_BLOCK), p.threads, |b| {
        let start = b * KNN_KEY_BLOCK;
        let nk = (start + KNN_KEY_BLOCK).min(n) - start;
        let mut kt = vec![0.0f32; nk * d];
        for (k, row) in keys.data()[start * d..(start + nk) * d].chunks_exact(d).enumerate() {
            for (j, x) in row.iter().enumerate() {
                kt[j * nk + k] = x.to_f32();
            }
        }
        kt
    });
    let knn: Vec<Vec<u32>> = parallel(batches, p.threads, |b| {
        let batch = &picked[b * KNN_QUERY_BATCH..((b + 1) * KNN_QUERY_BATCH).min(picked.len())];
        let mut scores = vec![vec![0.0f32; n]; batch.len()];
        let qbuf: Vec<f32> = batch.iter().flat_map(|&q| queries[q * d..(q + 1) * d].iter().copied()).collect();
        let mut out = vec![0.0f32; batch.len() * KNN_KEY_BLOCK];
        for (kt, start) in blocks.iter().zip((0..n).step_by(KNN_KEY_BLOCK)) {
            let nk = kt.len() / d;
            ctxfs_kernels::scores_dim_major(kt, nk, &qbuf, &mut out[..batch.len() * nk]);
            for (qi, s) in scores.iter_mut().enumerate() {
                s[start..start + nk].copy_from_slice(&out[qi * nk..(qi + 1) * nk]);
            }
        }
        scores.iter().map(|s| top(s, nq)).collect::<Vec<_>>()
    })
    .into_iter()
    .flatten()
    .collect();
    report.knn = t.elapsed();

    // 2. Projection onto key–key edges with occlusion pruning.
    let t = Instant::now();
    let mut candidates: Vec<Vec<u32>> = vec![Vec::new(); n];
    for list in &knn {
        for &pivot in list.iter().take(p.pivots.max(1)) {
            candidates[pivot as usize].extend(list.iter().copied().filter(|&c| c != pivot));
        }
    }
    let pruned: Vec<Vec<u32>> = parallel(n, p.threads, |node| prune(keys, node as u32, &candidates[node], p.degree));
    let mut lists = pruned.clone();
    // Reverse edges into spare slots, most similar first.
    let mut reverse: Vec<Vec<u32>> = vec![Vec::new(); n];
    for (from, outs) in pruned.iter().enumerate() {
        for &to in outs {
            reverse[to as usize].push(from as u32);
        }
    }
    let filled: Vec<Vec<u32>> = parallel(n, p.threads, |node| {
        let mut out = lists[node].clone();
        let room = p.degree.saturating_sub(out.len());
        if room > 0 && !reverse[node].is_empty() {
            let me = to_f32(keys.row(node as u32));
            let mut extra: Vec<(f32, u32)> = reverse[node]
                .iter()
                .filter(|r| !out.contains(r))
                .map(|&r| (ctxfs_kernels::dot(keys.row(r), &me), r))
                .collect();
            extra.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            extra.dedup_by_key(|e| e.1);
            out.extend(extra.into_iter().take(room).map(|e| e.1));
        }
        out
    });
    lists = filled;
    if p.sequence_edges {
        // Sequence neighbours: critical tokens cluster in passages, so a walk that reaches a
        // passage can follow it. It also chains every key to the rest.
        for (t, list) in lists.iter_mut().enumerate() {
            for nb in [t.wrapping_sub(1), t + 1] {
                if nb < n && !list.contains(&(nb as u32)) {
                    list.push(nb as u32);
                }
            }
        }
    }
    report.projection = t.elapsed();

    // 3. Connectivity from the entry point: the key best for the average training query.
    let t = Instant::now();
    let mut mean = vec![0.0f32; d];
    for &qi in &picked {
        for (m, x) in mean.iter_mut().zip(&queries[qi * d..(qi + 1) * d]) {
            *m += x;
        }
    }
    let mut scores = vec![0.0; n];
    ctxfs_kernels::scores(keys.data(), &mean, 1.0, &mut scores);
    let entry = (0..n).max_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(b.cmp(&a))).expect("n > 0") as u32;
    report.enhanced = enhance(keys, &mut lists, entry, p);
    report.enhancement = t.elapsed();
    (MemGraph::from_lists(p.degree + p.extra_degree, &lists, entry), report)
}

/// Keeps up to `degree` of `candidates` for `node`: most similar first, dropping any that is
/// more similar to an already kept neighbour than to `node` (occlusion).
fn prune(keys: &MemKeys, node: u32, candidates: &[u32], degree: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = candidates.iter().copied().filter(|&c| c != node).collect();
    ids.sort_unstable();
    ids.dedup();
    let me = to_f32(keys.row(node));
    let mut ranked: Vec<(f32, u32)> = ids.into_iter().map(|c| (ctxfs_kernels::dot(keys.row(c), &me), c)).collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut kept: Vec<(u32, Vec<f32>)> = Vec::with_capacity(degree);
    for (sim, c) in ranked {
        if kept.len() == degree {
            break;
        }
        if kept.iter().all(|(_, k)| ctxfs_kernels::dot(keys.row(c), k) <= sim) {
            kept.push((c, to_f32(keys.row(c))));
        }
    }
    kept.into_iter().map(|(c, _)| c).collect()
}

/// A graph under construction.
struct Lists<'a> {
    lists: &'a [Vec<u32>],
    entry: u32,
}

impl Graph for Lists<'_> {
    fn neighbors(&self, node: u32, out: &mut Vec<u32>, _: &mut SearchStats) -> SourceResult {
        out.extend_from_slice(&self.lists[node as usize]);
        Ok(())
    }
    fn entry(&self) -> u32 {
        self.entry
    }
}

/// Marks everything reachable from `from` (already marked nodes stop the walk).
fn mark_reachable(lists: &[Vec<u32>], from: u32, reached: &mut [bool]) {
    let mut stack = vec![from];
    reached[from as usize] = true;
    while let Some(x) = stack.pop() {
        for &y in &lists[x as usize] {
            if !reached[y as usize] {
                reached[y as usize] = true;
                stack.push(y);
            }
        }
    }
}

/// Links every key unreachable from `entry` into the graph. Edges are only ever added, never
/// taken away, so no path the projection made is lost. Returns how many keys needed a link.
fn enhance(keys: &MemKeys, lists: &mut [Vec<u32>], entry: u32, p: &BuildParams) -> usize {
    let n = lists.len();
    let mut reached = vec![false; n];
    mark_reachable(lists, entry, &mut reached);
    let max_degree = p.degree + p.extra_degree;
    let mut linked = 0;
    // A reachable key with room, used when every key a search finds is full.
    let mut spare = (0..n as u32).find(|&v| reached[v as usize] && lists[v as usize].len() < max_degree);
    for u in 0..n as u32 {
        if reached[u as usize] {
            continue;
        }
        let q = to_f32(keys.row(u));
        let found = search::topk(&Pair { keys, graph: &Lists { lists, entry } }, &q, p.enhance_ef, p.enhance_ef, None)
            .expect("an in-memory graph cannot fail to read");
        let from = found.ids.iter().copied().find(|&v| lists[v as usize].len() < max_degree).or(spare);
        let Some(from) = from else {
            // Every reachable key is full: a degree bound this tight cannot connect the graph.
            continue;
        };
        lists[from as usize].push(u);
        // Edges back to the keys found, so walks through `u` return to the well-linked core.
        let room = p.degree.saturating_sub(lists[u as usize].len());
        let back: Vec<u32> = found
            .ids
            .iter()
            .copied()
            .filter(|&v| v != u && !lists[u as usize].contains(&v))
            .take(room.min(4))
            .collect();
        lists[u as usize].extend(back);
        linked += 1;
        mark_reachable(lists, u, &mut reached);
        if lists[u as usize].len() < max_degree {
            spare = Some(u);
        } else if spare.is_some_and(|s| lists[s as usize].len() >= max_degree) {
            spare = (0..n as u32).find(|&v| reached[v as usize] && lists[v as usize].len() < max_degree);
        }
    }
    linked
}
