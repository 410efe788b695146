//! Property tests of the searches and the build on small random data, against flat scans.

use ctxfs_index::search::{diprs, diprs_from, topk};
use ctxfs_index::synth::Rng;
use ctxfs_index::Pair;
use ctxfs_index::{build, flat, BuildParams, DiprsParams, MassTarget, MemGraph, MemKeys};
use half::f16;
use std::collections::BTreeSet;

/// Keys in passages of a few topics (neighbouring tokens alike), and queries drawn from a
/// shifted distribution, each aimed at one topic.
fn data(n: usize, d: usize, queries: usize, seed: u64) -> (MemKeys, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let topics: Vec<Vec<f32>> = (0..12).map(|_| (0..d).map(|_| rng.normal() * 1.5).collect()).collect();
    let mut keys = Vec::with_capacity(n * d);
    for t in 0..n {
        let topic = &topics[(t / 64 + t / 640) % topics.len()];
        keys.extend(topic.iter().map(|c| f16::from_f32(c + rng.normal())));
    }
    let shift: Vec<f32> = (0..d).map(|i| if i < 4 { 3.0 } else { 0.0 }).collect();
    let mut qs = Vec::with_capacity(queries * d);
    for _ in 0..queries {
        let topic = &topics[(rng.next_u64() % topics.len() as u64) as usize];
        qs.extend((0..d).map(|i| shift[i] + 0.8 * topic[i] + 0.5 * rng.normal()));
    }
    (MemKeys::new(d, keys), qs)
}

fn set(ids: &[u32]) -> BTreeSet<u32> {
    ids.iter().copied().collect()
}

fn built(n: usize, d: usize, seed: u64) -> (MemKeys, Vec<f32>, MemGraph) {
    let (keys, queries) = data(n, d, 4 * n + 200, seed);
    let train = &queries[200 * d..];
    let params = BuildParams { degree: 16, extra_degree: 8, nq: 32, ..Default::default() };
    let (graph, _) = build(&keys, train, &params);
    (keys, queries[..200 * d].to_vec(), graph)
}

#[test]
fn diprs_with_l0_at_least_n_returns_exactly_the_flat_dipr_set() {
    let (keys, queries, graph) = built(600, 16, 1);
    let idx = Pair { keys: &keys, graph: &graph };
    for q in queries.chunks(16).take(20) {
        for beta in [0.5, 2.0, 8.0, 1e9] {
            let got = diprs(&idx, q, &DiprsParams { beta, l0: 600, ..Default::default() }).unwrap();
            let want = flat::dipr(&keys, q, beta, f32::NEG_INFINITY, None).unwrap();
            assert_eq!(set(&got.ids), set(&want.ids), "beta {beta}");
            assert_eq!(got.ids, want.ids, "same order, best first");
        }
    }
}

/// Starting from earlier results changes where the search begins, not what it may return:
/// exhaustive searches still give the exact set, and a filtered one nothing at or beyond P,
/// whatever the starting tokens (repeated, beyond the prefix or beyond the keys).
#[test]
fn diprs_from_earlier_tokens_returns_the_same_exact_set_and_respects_the_prefix() {
    let (keys, queries, graph) = built(600, 16, 3);
    let idx = Pair { keys: &keys, graph: &graph };
    let mut rng = Rng::new(7);
    for q in queries.chunks(16).take(20) {
        let previous: Vec<u32> = (0..40).map(|_| (rng.next_u64() % 700) as u32).chain([5, 5, u32::MAX]).collect();
        for beta in [0.5, 2.0, 8.0, 1e9] {
            let p = DiprsParams { beta, l0: 600, ..Default::default() };
            let got = diprs_from(&idx, q, &p, &previous).unwrap();
            let want = flat::dipr(&keys, q, beta, f32::NEG_INFINITY, None).unwrap();
            assert_eq!(got.ids, want.ids, "beta {beta}");
        }
        for prefix in [0, 1, 10, 160, 400] {
            let p = DiprsParams { beta: 3.0, l0: 32, prefix: Some(prefix), ..Default::default() };
            let got = diprs_from(&idx, q, &p, &previous).unwrap();
            assert!(got.ids.iter().all(|&id| id < prefix), "prefix {prefix}: {:?}", got.ids);
            let mut unique = got.ids.clone();
            unique.dedup();
            assert_eq!(unique.len(), got.ids.len(), "a token returned twice");
        }
    }
}

#[test]
fn filtered_search_never_returns_a_token_beyond_the_prefix() {
    let (keys, queries, graph) = built(800, 16, 2);
    let idx = Pair { keys: &keys, graph: &graph };
    let (mut hit, mut total) = (0, 0);
    // Searches that missed the best key, so their range reached below the exact one.
    let (mut overshoot, mut searches) = (0, 0);
    for q in queries.chunks(16).take(20) {
        for prefix in [0, 1, 10, 160, 400, 800, 5000] {
            let p = DiprsParams { beta: 3.0, l0: 32, prefix: Some(prefix), ..Default::default() };
            let got = diprs(&idx, q, &p).unwrap();
            assert!(got.ids.iter().all(|&id| id < prefix), "prefix {prefix}: {:?}", got.ids);
            let exact = flat::dipr(&keys, q, 3.0, f32::NEG_INFINITY, Some(prefix)).unwrap();
            overshoot += usize::from(got.ids.len() > exact.ids.len());
            searches += 1;
            let k = topk(&idx, q, 10, 40, Some(prefix)).unwrap();
            assert!(k.ids.iter().all(|&id| id < prefix));
            // Exhaustive filtered DIPRS (l0 ≥ n) finds the exact set whenever a realistic share
            // of the context is reused; a tiny prefix may not be reachable in two hops.
            let full = diprs(&idx, q, &DiprsParams { l0: 800, ..p }).unwrap();
            let want = set(&exact.ids);
            assert!(set(&full.ids).is_subset(&want));
            if prefix >= 160 {
                hit += full.ids.len();
                total += want.len();
            }
        }
    }
    assert!(overshoot * 20 <= searches, "{overshoot} of {searches} filtered searches missed the best key");
    let recall = hit as f64 / total as f64;
    assert!(recall >= 0.95, "filtered recall {recall}");
}

#[test]
fn topk_with_a_beam_covering_the_graph_equals_flat_topk() {
    let (keys, queries, graph) = built(500, 16, 3);
    let idx = Pair { keys: &keys, graph: &graph };
    for q in queries.chunks(16).take(20) {
        for k in [1, 10, 100] {
            let got = topk(&idx, q, k, 500, None).unwrap();
            let want = flat::topk(&keys, q, k, None).unwrap();
            assert_eq!(got.ids, want.ids, "k {k}");
        }
    }
}

#[test]
fn the_build_reaches_every_key_within_its_degree_and_is_deterministic() {
    let (keys, queries) = data(3000, 32, 6000, 4);
    let base = BuildParams { degree: 16, extra_degree: 8, nq: 32, threads: 1, ..Default::default() };
    let (g1, report) = build(&keys, &queries, &base);
    let (g3, _) = build(&keys, &queries, &BuildParams { threads: 3, ..base.clone() });
    assert_eq!(g1, g3, "the graph must not depend on the thread count");
    assert_eq!(g1.nodes(), 3000);
    assert_eq!(g1.degree, 24);
    let mut reached = vec![false; 3000];
    let mut stack = vec![g1.entry];
    reached[g1.entry as usize] = true;
    while let Some(x) = stack.pop() {
        for y in g1.list(x) {
            if !reached[y as usize] {
                reached[y as usize] = true;
                stack.push(y);
            }
        }
    }
    assert!(reached.iter().all(|&r| r), "{} keys unreachable", reached.iter().filter(|r| !**r).count());
    for x in 0..3000 {
        let l: Vec<u32> = g1.list(x).collect();
        assert!(l.len() <= 24 && !l.contains(&x) && set(&l).len() == l.len(), "node {x}: {l:?}");
    }
    println!("build: {report:?}");
    assert!(report.queries == 6000);
}

/// DIPRS through the graph alone: no seed runs, and every key within β expanded through the
/// graph, not along the sequence. For keys whose critical tokens do not come in passages
/// (this file's hard data: ~6 scattered keys per DIPR set).
fn graph_only() -> DiprsParams {
    DiprsParams { seed_runs: 0, range_run: 0, graph_band: 1.0, ..Default::default() }
}

/// A quality floor on hard synthetic data (clustered keys, shifted queries, DIPR sets of ~6
/// keys out of 20,000, not in passages): the graph alone reaches recall 0.99 scoring 3.3%
/// of the keys. The 128K-token goals (recall ≥ 0.95 at ≤ 3%) are measured by `ctxfs bench
/// search` on the realistic generator; this test keeps the build and search from regressing
/// meanwhile.
#[test]
fn diprs_recall_and_work_on_hard_synthetic_data_do_not_regress() {
    let n = 20_000;
    let d = 32;
    let (keys, queries) = data(n, d, 20_200, 5);
    let (graph, report) = build(&keys, &queries[200 * d..], &BuildParams { max_queries: 8192, ..Default::default() });
    let idx = Pair { keys: &keys, graph: &graph };
    let (mut hit, mut total, mut scored) = (0usize, 0usize, 0u64);
    for q in queries[..200 * d].chunks(d) {
        let want = flat::dipr(&keys, q, 6.0, f32::NEG_INFINITY, None).unwrap();
        let got = diprs(&idx, q, &DiprsParams { beta: 6.0, l0: 64, ..graph_only() }).unwrap();
        let got_set = set(&got.ids);
        hit += want.ids.iter().filter(|id| got_set.contains(id)).count();
        total += want.ids.len();
        scored += got.stats.keys_scored;
        assert!(got.stats.hops > 0);
    }
    let recall = hit as f64 / total as f64;
    let fraction = scored as f64 / (200 * n) as f64;
    println!(
        "recall {recall:.3}, keys scored {:.1}%, avg DIPR size {}, build {report:?}",
        fraction * 100.0,
        total / 200
    );
    assert!(recall >= 0.95, "recall {recall}");
    assert!(fraction < 0.04, "scored {:.1}% of keys", fraction * 100.0);
}

#[test]
fn window_max_prunes_from_the_start() {
    let (keys, queries, graph) = built(600, 16, 6);
    let idx = Pair { keys: &keys, graph: &graph };
    let q = &queries[..16];
    let exact = flat::dipr(&keys, q, 2.0, f32::NEG_INFINITY, None).unwrap();
    // A window whose best beats every stored key: nothing stored is within β of it.
    let above = exact.scores[0] + 10.0;
    let none = diprs(&idx, q, &DiprsParams { beta: 2.0, l0: 8, window_max: above, ..Default::default() }).unwrap();
    assert!(none.ids.is_empty());
    assert!(flat::dipr(&keys, q, 2.0, above, None).unwrap().ids.is_empty());
}

/// The same floor on the realistic generator (passages, sinks, out-of-distribution queries):
/// DIPRS at β = 5 (in q·k/√d units) against the exact DIPR set, over sharp and diffuse heads.
#[test]
fn diprs_recall_on_generated_attention_does_not_regress() {
    use ctxfs_index::synth::{head, SynthParams};
    let (n, d) = (8192, 64);
    let p = SynthParams { tokens: n, head_dim: d, group: 2, seed: 11 };
    let beta = 5.0 * (d as f32).sqrt();
    for (kv, floor) in RECALL_FLOOR.iter().enumerate() {
        let h = head(&p, 1, kv, n / 2, 16);
        let keys = MemKeys::new(d, h.keys.clone());
        let (graph, _) = build(&keys, &h.prefill.concat(), &BuildParams { max_queries: 4096, ..Default::default() });
        let idx = Pair { keys: &keys, graph: &graph };
        let (mut hit, mut total, mut scored, mut dipr) = (0usize, 0usize, 0u64, 0usize);
        let queries = h.decode.concat();
        for q in queries.chunks(d) {
            let want = flat::dipr(&keys, q, beta, f32::NEG_INFINITY, None).unwrap();
            let got = diprs(&idx, q, &DiprsParams { beta, ..Default::default() }).unwrap();
            let s = set(&got.ids);
            hit += want.ids.iter().filter(|id| s.contains(id)).count();
            total += want.ids.len();
            scored += got.stats.keys_scored;
            dipr += want.ids.len();
        }
        let m = queries.len() / d;
        let recall = hit as f64 / total as f64;
        let excess = scored as f64 / dipr as f64;
        println!(
            "kv {kv} (sharpness {:.1}): recall {recall:.3}, keys scored {:.1}% (DIPR set {:.1}%, {excess:.2}x it)",
            h.sharpness,
            scored as f64 / (m * n) as f64 * 100.0,
            dipr as f64 / (m * n) as f64 * 100.0
        );
        assert!(recall >= *floor, "kv {kv}: recall {recall}");
        assert!(excess <= MAX_EXCESS, "kv {kv}: scored {excess:.2}x the DIPR set");
    }
}

/// The defaults (seed runs and sequence runs, no climb) reach 0.992 and 0.987 on these two
/// heads, scoring 5.7× and 8.3× the DIPR set (at a seed stride of 96: 0.995 and 0.980 at 5.6×
/// and 7.3×; a climb of width 16 instead of the seed runs: 0.985 and 0.913 at 5.8× and 6.6×);
/// the floors sit about 0.05 below. At this size the
/// seeds are most of the keys scored; `ctxfs bench search` measures the goals (recall 0.95,
/// at most 3% scored) at 128K, where the runs score fewer keys, not more.
const RECALL_FLOOR: [f64; 2] = [0.945, 0.93];

/// Keys scored over the size of the DIPR set: the defaults score up to 8.3×, and the cap
/// leaves them ~7% headroom.
const MAX_EXCESS: f64 = 8.8;

/// A range target narrows β to the score of the best `target / stride` seeds when more seeds
/// than that lie within β, and only then: an exhaustive search then returns exactly the flat
/// DIPR set at the narrowed β. The seed scores it reports are every stride-th key's.
#[test]
fn diprs_narrows_a_wide_range_to_its_target_from_the_seeds() {
    let (keys, queries, graph) = built(600, 16, 5);
    let idx = Pair { keys: &keys, graph: &graph };
    let stride = 8;
    let mut narrowed = 0;
    for q in queries.chunks(16).take(20) {
        let all = flat::scan(&keys, q, 600, &mut Default::default()).unwrap();
        for beta in [2.0, 8.0, 1e9] {
            let p =
                DiprsParams { beta, l0: 600, seed_stride: Some(stride), range_target: Some(80), ..Default::default() };
            let got = diprs(&idx, q, &p).unwrap();
            let seeds: Vec<f32> = all.iter().step_by(stride as usize).copied().collect();
            assert_eq!((got.seeds.stride, &got.seeds.scores), (stride, &seeds));
            let best = all.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let within = seeds.iter().filter(|&&s| s >= best - beta).count();
            let plain = diprs(&idx, q, &DiprsParams { range_target: None, ..p }).unwrap();
            match got.chosen_beta {
                None => {
                    assert!(within <= 10, "{within} seeds within β {beta}, not narrowed");
                    assert_eq!(got.ids, plain.ids);
                }
                Some(b) => {
                    narrowed += 1;
                    // The 10th best seed bounds the range, below the best known when the
                    // seeds were scored: at least the best seed, at most the best key.
                    let mut sorted = seeds.clone();
                    sorted.sort_by(|a, b| b.total_cmp(a));
                    let (low, high) = (sorted[0] - sorted[9], best - sorted[9]);
                    assert!(b < beta && low <= b && b <= high, "β {beta} narrowed to {b}, not in [{low}, {high}]");
                    let want = flat::dipr(&keys, q, b, f32::NEG_INFINITY, None).unwrap();
                    assert_eq!(got.ids, want.ids, "β {beta} narrowed to {b}");
                    assert!(got.ids.len() <= plain.ids.len());
                }
            }
        }
    }
    assert!(narrowed >= 20, "only {narrowed} searches narrowed");
}

/// Without seeds and without a climb asked for, a climb of one from the entry starts the
/// range (nothing else would): the search still finds the range.
#[test]
fn diprs_without_seeds_climbs_from_the_entry() {
    let (keys, queries, graph) = built(600, 16, 7);
    let idx = Pair { keys: &keys, graph: &graph };
    let (mut hit, mut total) = (0usize, 0usize);
    for q in queries.chunks(16).take(20) {
        let want = flat::dipr(&keys, q, 3.0, f32::NEG_INFINITY, None).unwrap();
        let got = diprs(&idx, q, &DiprsParams { beta: 3.0, seed_stride: None, ..Default::default() }).unwrap();
        assert!(got.seeds.scores.is_empty() && !got.ids.is_empty());
        let got_set = set(&got.ids);
        hit += want.ids.iter().filter(|id| got_set.contains(id)).count();
        total += want.ids.len();
    }
    let recall = hit as f64 / total as f64;
    println!("recall without seeds {recall:.3}");
    assert!(recall >= RECALL_WITHOUT_SEEDS, "recall {recall}");
}

/// Measured 0.729, less about 0.05: a regression floor.
const RECALL_WITHOUT_SEEDS: f64 = 0.68;

/// The mass a range at `beta` below the best leaves out, as a share of the whole (scores in
/// inner-product units, weights exp(scale · score)).
fn left_out_share(keys: &MemKeys, q: &[f32], beta: f32, scale: f32) -> f64 {
    let scores = flat::scan(keys, q, u32::MAX, &mut Default::default()).unwrap();
    let best = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let w = |s: f32| (f64::from(scale) * f64::from(s - best)).exp();
    let total: f64 = scores.iter().map(|&s| w(s)).sum();
    scores.iter().filter(|&&s| s < best - beta).map(|&s| w(s)).sum::<f64>() / total
}

/// With a mass target, the scan cuts where exactly the share is left out, and DIPRS widens
/// its range until its seed estimate says so; an exhaustive climb makes DIPRS's range the
/// scan's range or wider.
#[test]
fn a_mass_target_chooses_beta_per_query() {
    let (keys, queries, graph) = built(2000, 16, 5);
    let idx = Pair { keys: &keys, graph: &graph };
    let scale = 0.25;
    for q in queries.chunks(16).take(20) {
        for share in [0.001f32, 0.05, 0.3] {
            let t = MassTarget { share, scale, window_lse: f32::NEG_INFINITY };
            let scores = flat::scan(&keys, q, u32::MAX, &mut Default::default()).unwrap();
            let exact = flat::dipr_or_target(&scores, 1.0, f32::NEG_INFINITY, Some(&t), Default::default());
            let beta = exact.chosen_beta.expect("a target reports its β");
            let out = left_out_share(&keys, q, beta, scale);
            assert!(out <= f64::from(share) + 1e-9, "the scan left out {out} > {share}");
            assert!((exact.missing_share.unwrap() as f64 - out).abs() < 1e-4);
            let p = DiprsParams { target: Some(t), seed_stride: Some(16), ..Default::default() };
            let found = diprs(&idx, q, &p).unwrap();
            let estimate = found.missing_share.expect("DIPRS reports its estimate");
            assert!(found.chosen_beta.is_some() && (0.0..=1.0).contains(&estimate));
            let exhaustive = diprs(&idx, q, &DiprsParams { l0: 2000, ..p }).unwrap();
            assert!(
                set(&exhaustive.ids).is_subset(&set(&flat::dipr(&keys, q, 1e9, f32::NEG_INFINITY, None).unwrap().ids))
            );
            assert!(
                exhaustive.ids.len() >= exact.ids.len() || estimate <= share,
                "DIPRS stopped early: {estimate} > {share}"
            );
        }
    }
}
