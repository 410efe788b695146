//! Query-guided graph build (RoarGraph-style), per (layer, kv head):
//!
//! 1. **kNN**: for sampled prefill queries (from every q head of the GQA group), the exact
//!    top-`nq` keys by inner product, on a CUDA GPU when one opens (`ctxfs_kernels::gpu`),
//!    else on the CPU;
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
use crate::threads::parallel;
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
    /// Run the kNN on a CUDA GPU when one opens (`CTXFS_GPU=off` keeps it on the CPU). The
    /// GPU's scores are each one fused multiply-add chain; the CPU's group some sums
    /// differently, so near-ties at the `nq`-th key may resolve differently.
    pub gpu: bool,
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
            gpu: true,
        }
    }
}

/// How long each phase took, and what it did.
#[derive(Debug, Clone, Copy, Default)]
pub struct BuildReport {
    pub knn: Duration,
    /// Whether the kNN ran on a GPU.
    pub knn_on_gpu: bool,
    pub projection: Duration,
    pub enhancement: Duration,
    pub queries: usize,
    /// Keys that were unreachable after projection and got an enhancement edge.
    pub enhanced: usize,
}

/// Training queries scored together against each block of keys, at most: each key block is
/// read from memory once per batch, and at 128K keys of d = 128 a batch of 32 left the kNN
/// bound by memory (1.07 s per head of 2,048 queries; 0.46 s at 256). Fewer when the
/// queries would not give every build thread a batch.
const KNN_QUERY_BATCH: usize = 256;
/// Keys per block in the kNN (512 keys of d = 128 in f32: 256 KiB, an L2-resident block).
const KNN_KEY_BLOCK: usize = 512;

/// The `k` best ids by score (ties: lower id first), offered block by block in id order.
/// A heap of the `k` best so far: most keys are rejected by one comparison with the worst of
/// them, and a run of 16 scores all below it by one test.
struct Best {
    k: usize,
    /// A min-heap by rank: its top is the worst of the best k so far.
    heap: std::collections::BinaryHeap<std::cmp::Reverse<crate::search::Scored>>,
    /// The worst kept score once the heap is full: a later id with a score no higher ranks
    /// below it.
    worst: f32,
}

impl Best {
    fn new(k: usize) -> Best {
        Best { k, heap: std::collections::BinaryHeap::with_capacity(k + 1), worst: f32::NEG_INFINITY }
    }

    /// Offers ids `first..first + scores.len()`, above every id offered before.
    fn offer(&mut self, first: u32, scores: &[f32]) {
        for (c, run) in scores.chunks(16).enumerate() {
            // `s < worst` is false for a NaN or an equal score, which the heap then ranks.
            let worst = self.worst;
            if self.heap.len() == self.k && run.iter().fold(true, |all, &s| all & (s < worst)) {
                continue;
            }
            for (i, &s) in run.iter().enumerate() {
                self.push(crate::search::Scored(s, first + (c * 16 + i) as u32));
            }
        }
    }

    fn push(&mut self, s: crate::search::Scored) {
        if self.k == 0 {
            return;
        }
        if self.heap.len() == self.k {
            if s.0.total_cmp(&self.worst).is_le() {
                return;
            }
            self.heap.pop();
        }
        self.heap.push(std::cmp::Reverse(s));
        if self.heap.len() == self.k {
            self.worst = self.heap.peek().map_or(f32::NEG_INFINITY, |w| w.0 .0);
        }
    }

    /// The ids, best first.
    fn into_ids(self) -> Vec<u32> {
        let mut best: Vec<crate::search::Scored> = self.heap.into_iter().map(|r| r.0).collect();
        best.sort_by(|a, b| b.cmp(a));
        best.into_iter().map(|r| r.1).collect()
    }
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
    let rows: Vec<f32> = picked.iter().flat_map(|&q| queries[q * d..(q + 1) * d].iter().copied()).collect();
    let (knn, on_gpu) = knn(keys, &rows, nq, p.threads, p.gpu);
    report.knn_on_gpu = on_gpu;
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

/// The exact top-`k` keys of each query (rows of the keys' dimension), best first (among
/// equal scores the lower id): on a CUDA GPU when `gpu` is set and one opens, else (or when
/// the GPU fails) in `threads` CPU threads. Says whether the GPU ran it. The GPU's scores are
/// each one fused multiply-add chain; the CPU groups some sums differently, so near-ties at
/// the `k`-th key may resolve differently.
pub fn knn(keys: &MemKeys, queries: &[f32], k: usize, threads: usize, gpu: bool) -> (Vec<Vec<u32>>, bool) {
    let on_gpu = gpu
        .then(ctxfs_kernels::gpu::Gpu::open)
        .and_then(Result::ok)
        .and_then(|device| device.knn(keys.data(), keys.dim(), queries, k).ok());
    match on_gpu {
        Some(lists) => (lists, true),
        None => (knn_on_cpu(keys, queries, k, threads), false),
    }
}

/// The kNN on the CPU: the exact top-`nq` keys of each query, in `threads` threads.
fn knn_on_cpu(keys: &MemKeys, queries: &[f32], nq: usize, threads: usize) -> Vec<Vec<u32>> {
    let (d, n) = (keys.dim(), keys.len() as usize);
    let count = queries.len() / d;
    // Queries go in batches against blocks of keys small enough to stay in cache: each key
    // block is read from memory once per batch, not once per query.
    let per_batch = count.div_ceil(threads.max(1)).clamp(8, KNN_QUERY_BATCH);
    let batches = count.div_ceil(per_batch);
    // The keys in f32, dimension-major by block, converted once for every batch: the kernel
    // then scores eight queries per key load with no horizontal sum per score.
    let blocks: Vec<Vec<f32>> = parallel(n.div_ceil(KNN_KEY_BLOCK), threads, |b| {
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
    parallel(batches, threads, |b| {
        let qbuf = &queries[b * per_batch * d..((b + 1) * per_batch).min(count) * d];
        let mut best: Vec<Best> = qbuf.chunks_exact(d).map(|_| Best::new(nq)).collect();
        let mut out = vec![0.0f32; best.len() * KNN_KEY_BLOCK];
        for (kt, start) in blocks.iter().zip((0..n).step_by(KNN_KEY_BLOCK)) {
            let nk = kt.len() / d;
            ctxfs_kernels::scores_dim_major(kt, nk, qbuf, &mut out[..best.len() * nk]);
            // Each block's scores go to the queries' best while still in cache.
            for (b, s) in best.iter_mut().zip(out.chunks_exact(nk)) {
                b.offer(start as u32, s);
            }
        }
        best.into_iter().map(Best::into_ids).collect::<Vec<_>>()
    })
    .into_iter()
    .flatten()
    .collect()
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

#[cfg(test)]
mod tests {
    use super::{knn, Best};
    use crate::mem::MemKeys;
    use crate::synth::Rng;

    /// The kNN on the CPU, and on a GPU where one opens, against a sort of scores taken in
    /// f64, on keys whose scores have no near-ties: the same lists, best first.
    #[test]
    fn knn_finds_the_exact_best_keys_on_every_device() {
        let mut rng = Rng::new(5);
        let (n, d, m, k) = (3000, 48, 37, 100);
        let keys = MemKeys::new(d, (0..n * d).map(|_| half::f16::from_f32(rng.normal())).collect());
        let queries: Vec<f32> = (0..m * d).map(|_| rng.normal()).collect();
        let want: Vec<Vec<u32>> = queries
            .chunks_exact(d)
            .map(|q| {
                let s: Vec<f64> = keys
                    .data()
                    .chunks_exact(d)
                    .map(|key| key.iter().zip(q).map(|(a, b)| f64::from(a.to_f32()) * f64::from(*b)).sum())
                    .collect();
                let mut ids: Vec<u32> = (0..n as u32).collect();
                ids.sort_by(|&a, &b| s[b as usize].total_cmp(&s[a as usize]));
                ids.truncate(k);
                ids
            })
            .collect();
        for gpu in [false, true] {
            let (got, on_gpu) = knn(&keys, &queries, k, 3, gpu);
            assert!(gpu || !on_gpu);
            assert_eq!(got, want, "gpu asked: {gpu}, ran there: {on_gpu}");
        }
        assert_eq!(knn(&keys, &queries[..0], k, 2, false).0, Vec::<Vec<u32>>::new());
    }

    /// The best k by a full sort (score descending, then id ascending; NaN above all, as
    /// `total_cmp` ranks a positive NaN).
    fn sorted(scores: &[f32], k: usize) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..scores.len() as u32).collect();
        ids.sort_by(|&a, &b| scores[b as usize].total_cmp(&scores[a as usize]).then(a.cmp(&b)));
        ids.truncate(k);
        ids
    }

    #[test]
    fn best_offered_in_blocks_equals_a_full_sort() {
        let mut x = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for (n, k, block) in [(1000, 10, 512), (1000, 0, 64), (37, 100, 16), (5000, 100, 333), (64, 64, 7)] {
            // Few distinct values, so ties are common; a NaN and ±0 among them.
            let mut scores: Vec<f32> = (0..n).map(|_| (next() % 50) as f32 - 25.0).collect();
            scores[n / 2] = f32::NAN;
            scores[n / 3] = -0.0;
            scores[n / 4] = 0.0;
            let mut best = Best::new(k);
            for (b, run) in scores.chunks(block).enumerate() {
                best.offer((b * block) as u32, run);
            }
            assert_eq!(best.into_ids(), sorted(&scores, k), "n={n} k={k} block={block}");
        }
    }
}
