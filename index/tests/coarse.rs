//! The coarse indexes: Quest's bound is an upper bound, PQ scores are inner products with the
//! reconstructed keys, InfLLM picks what its rule says, the prefix filter holds, the paged
//! readers answer exactly as the in-memory forms, and damaged metadata is an error.

use ctxfs_buffer::{BlockRequest, BufferPool, DeviceSource, PoolConfig};
use ctxfs_index::coarse::infllm::{Infllm, InfllmMeta, InfllmParams, PagedInfllm, RepRule};
use ctxfs_index::coarse::pq::{
    AboveGroup, KeepCodes, KeptGroup, PagedPq, Pq, PqMeta, PqParams, PQ_VERSION, SAMPLE_STRIDE,
};
use ctxfs_index::coarse::quest::{PagedQuest, Quest, QuestMeta, QuestParams};
use ctxfs_index::coarse::{reaching, run_of, take_tokens, CoarseKind};
use ctxfs_index::flat::{QueryScores, BEST_RUN};
use ctxfs_index::synth::{head, Rng, SynthParams};
use ctxfs_index::{Coarse, Keys, MemKeys, SearchStats};
use ctxfs_kernels::Reached;
use ctxfs_vfs::{max_payload, BlockDevice, DType, DeviceChoice, FileStream, ModelShape, Store};
use half::f16;
use std::sync::Arc;

const PAYLOAD: usize = 4096 - 40;

fn random_keys(n: usize, d: usize, rng: &mut Rng) -> MemKeys {
    MemKeys::new(d, (0..n * d).map(|_| f16::from_f32(rng.normal() * 2.0)).collect())
}

fn random_queries(count: usize, d: usize, rng: &mut Rng) -> Vec<f32> {
    (0..count * d).map(|_| rng.normal() * 1.5).collect()
}

/// A generated head: keys, prefill queries and decode queries.
fn synth(tokens: usize, d: usize) -> (MemKeys, Vec<f32>, Vec<f32>) {
    let h = head(&SynthParams { tokens, head_dim: d, group: 2, seed: 3 }, 1, 0, 256, 6);
    (MemKeys::new(d, h.keys), h.prefill.concat(), h.decode.concat())
}

fn dot64(k: &[f16], q: &[f32]) -> f64 {
    k.iter().zip(q).map(|(a, b)| a.to_f64() * *b as f64).sum()
}

#[test]
fn quest_bound_is_never_below_the_best_key_of_its_page() {
    let mut rng = Rng::new(1);
    let d = 32;
    // Ordinary keys, keys at the edges of f16's range, and tiny ones; queries with negative
    // components, zeros and large magnitudes.
    let extreme = |rng: &mut Rng| match rng.below(4) {
        0 => 65504.0 * if rng.uniform() < 0.5 { 1.0 } else { -1.0 },
        1 => rng.normal() * 1e-4,
        _ => rng.normal() * 3.0,
    };
    for (n, page) in [(500, 16), (333, 1), (257, 7), (1000, 64)] {
        let keys = MemKeys::new(d, (0..n * d).map(|_| f16::from_f32(extreme(&mut rng))).collect());
        let quest = Quest::build(&keys, &QuestParams { page_tokens: page }).unwrap();
        for trial in 0..20 {
            let q: Vec<f32> = (0..d)
                .map(|_| match trial % 3 {
                    0 => rng.normal(),
                    1 => -rng.uniform() * 1e3,
                    _ => {
                        if rng.uniform() < 0.3 {
                            0.0
                        } else {
                            rng.normal() * 1e3
                        }
                    }
                })
                .collect();
            let bounds = quest.page_scores(&q, None).unwrap();
            assert_eq!(bounds.len(), n.div_ceil(page as usize));
            for (p, &bound) in bounds.iter().enumerate() {
                let tokens = p * page as usize..((p + 1) * page as usize).min(n);
                let (mut best, mut scale) = (f64::NEG_INFINITY, 0.0f64);
                for t in tokens {
                    let row = keys.row(t as u32);
                    best = best.max(dot64(row, &q));
                    scale = scale.max(row.iter().zip(&q).map(|(a, b)| (a.to_f64() * *b as f64).abs()).sum());
                }
                // The bound is exact in real arithmetic; f32 rounding is all the slack.
                assert!(bound as f64 >= best - 1e-5 * scale - 1e-6, "page {p}: bound {bound} < best {best}");
            }
        }
    }
}

#[test]
fn quest_selects_the_best_pages_whole_within_the_budget() {
    let mut rng = Rng::new(2);
    let keys = random_keys(1000, 16, &mut rng);
    let quest = Quest::build(&keys, &QuestParams { page_tokens: 16 }).unwrap();
    for q in random_queries(10, 16, &mut rng).chunks(16) {
        let bounds = quest.page_scores(q, None).unwrap();
        let mut order: Vec<usize> = (0..bounds.len()).collect();
        order.sort_by(|&a, &b| bounds[b].total_cmp(&bounds[a]).then(a.cmp(&b)));
        for budget in [0, 15, 16, 100, 1000, 5000] {
            let got = quest.select(q, budget, None).unwrap();
            // Best first while the whole next page fits (the last page holds 8 tokens).
            let (mut pages, mut used) = (Vec::new(), 0);
            for &p in &order {
                let len = if p == 62 { 8 } else { 16 };
                if used + len > budget {
                    break;
                }
                used += len;
                pages.push(p);
            }
            pages.sort_unstable();
            let want: Vec<u32> = pages.iter().flat_map(|&p| p as u32 * 16..((p as u32 + 1) * 16).min(1000)).collect();
            assert_eq!(got.ids, want, "budget {budget}");
            assert!(got.ids.len() <= budget);
            assert_eq!(got.stats.keys_scored, 63);
            assert_eq!(got.metadata_bytes, 63 * 4 * 16);
        }
    }
    assert_eq!(quest.metadata_bytes_per_token(), 4.0);
}

#[test]
fn pq_scores_are_inner_products_with_the_reconstructed_keys() {
    let mut rng = Rng::new(3);
    let keys = random_keys(3000, 32, &mut rng);
    for params in [PqParams::M2B6, PqParams::M4B8, PqParams { m: 8, bits: 3, iters: 5, seed: 7, residual: 0 }] {
        let pq = Pq::build(&keys, &params).unwrap();
        for q in random_queries(5, 32, &mut rng).chunks(32) {
            let scores = pq.token_scores(q, None).unwrap();
            assert_eq!(scores.len(), 3000);
            // The tables are quantised to bytes: half a step per subspace, a step being the
            // widest table's range over 255. A centroid is a mean of keys, so no entry
            // exceeds the query's subspace norm times the longest key's there.
            let (m, sub) = (params.m as usize, 32 / params.m as usize);
            let norm = |x: &mut dyn Iterator<Item = f32>| x.map(|v| v * v).sum::<f32>().sqrt() as f64;
            let widest = (0..m)
                .map(|j| {
                    let part = |t: u32| norm(&mut keys.row(t)[j * sub..(j + 1) * sub].iter().map(|x| x.to_f32()));
                    let longest = (0..3000).map(part).fold(0.0, f64::max);
                    2.0 * norm(&mut q[j * sub..(j + 1) * sub].iter().copied()) * longest
                })
                .fold(0.0, f64::max);
            let quantised = m as f64 * widest / 255.0 / 2.0;
            for (t, &s) in scores.iter().enumerate() {
                let r = pq.reconstruct(t as u32);
                let exact: f64 = r.iter().zip(q).map(|(a, b)| *a as f64 * *b as f64).sum();
                let scale: f64 = r.iter().zip(q).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum();
                let bound = quantised * 1.01 + 1e-5 * scale + 1e-6;
                assert!((s as f64 - exact).abs() <= bound, "{params:?} token {t}: {s} vs {exact}");
            }
            // Selection is the top of those scores.
            let got = pq.select(q, 100, None).unwrap();
            let mut order: Vec<u32> = (0..3000).collect();
            order.sort_by(|&a, &b| scores[b as usize].total_cmp(&scores[a as usize]).then(a.cmp(&b)));
            let mut want = order[..100].to_vec();
            want.sort_unstable();
            assert_eq!(got.ids, want);
            assert_eq!(got.stats.keys_scored, 3000);
        }
    }
}

/// A scan's score buffer is reused by the thread's next scan without zeroing: every score
/// of a scan, whatever the earlier scans on its thread held, equals a scan on a fresh thread
/// (a larger scan first, then smaller ones, prefixes and fewer queries; and the flat scan).
#[test]
fn reused_score_buffers_hold_only_the_scan_s_own_scores() {
    let mut rng = Rng::new(11);
    let (n, d) = (5000, 32);
    let keys = random_keys(n, d, &mut rng);
    let pq = Pq::build(&keys, &PqParams::M4B8).unwrap();
    let queries = random_queries(4, d, &mut rng);
    let cases: [(usize, Option<u32>); 4] = [(4, None), (4, Some(1234)), (1, None), (3, Some(4999))];
    let fresh = |pq: &Pq, keys: &MemKeys| {
        std::thread::scope(|s| {
            s.spawn(|| {
                cases
                    .iter()
                    .map(|&(m, prefix)| {
                        let codes = pq.token_scores_many(&queries[..m * d], prefix).unwrap();
                        let exact = ctxfs_index::flat::scan_many(keys, &queries[..m * d], prefix.unwrap_or(n as u32));
                        (
                            (0..m).flat_map(|t| codes.scores(t).to_vec()).collect::<Vec<f32>>(),
                            (0..m).flat_map(|t| exact.as_ref().unwrap().scores(t).to_vec()).collect::<Vec<f32>>(),
                        )
                    })
                    .collect::<Vec<_>>()
            })
            .join()
            .unwrap()
        })
    };
    let want = fresh(&pq, &keys);
    // This thread's buffer first holds other scores: a full scan of other queries.
    let other = random_queries(4, d, &mut rng);
    drop(pq.token_scores_many(&other, None).unwrap());
    for (&(m, prefix), (codes, exact)) in cases.iter().zip(&want) {
        let got = pq.token_scores_many(&queries[..m * d], prefix).unwrap();
        let got: Vec<f32> = (0..m).flat_map(|t| got.scores(t).to_vec()).collect();
        assert_eq!(&got, codes, "codes, {m} queries, prefix {prefix:?}");
        drop(ctxfs_index::flat::scan_many(&keys, &other, n as u32).unwrap());
        let got = ctxfs_index::flat::scan_many(&keys, &queries[..m * d], prefix.unwrap_or(n as u32)).unwrap();
        let got: Vec<f32> = (0..m).flat_map(|t| got.scores(t).to_vec()).collect();
        assert_eq!(&got, exact, "flat, {m} queries, prefix {prefix:?}");
    }
}

#[test]
fn pq_kmeans_is_deterministic_for_a_seed_and_more_centroids_reconstruct_better() {
    let (keys, _, _) = synth(4000, 64);
    let a = Pq::build(&keys, &PqParams::M4B8).unwrap();
    let b = Pq::build(&keys, &PqParams::M4B8).unwrap();
    assert_eq!(a, b, "same seed, same codes and centroids");
    assert_eq!(a.payloads(PAYLOAD).unwrap(), b.payloads(PAYLOAD).unwrap());
    let other = Pq::build(&keys, &PqParams { seed: 99, ..PqParams::M4B8 }).unwrap();
    assert_ne!(a, other, "another seed, other centroids");

    let error = |pq: &Pq| -> f64 {
        (0..keys.len())
            .map(|t| {
                pq.reconstruct(t).iter().zip(keys.row(t)).map(|(r, k)| (*r as f64 - k.to_f64()).powi(2)).sum::<f64>()
            })
            .sum::<f64>()
            / keys.len() as f64
    };
    let errors: Vec<f64> = (1..=8)
        .map(|bits| error(&Pq::build(&keys, &PqParams { m: 4, bits, iters: 25, seed: 0, residual: 0 }).unwrap()))
        .collect();
    for w in errors.windows(2) {
        assert!(w[1] < w[0], "reconstruction error by bits 1..=8: {errors:?}");
    }
    // More subspaces at the same bits reconstruct better too.
    let m2 = error(&Pq::build(&keys, &PqParams { m: 2, bits: 6, iters: 25, seed: 0, residual: 0 }).unwrap());
    let m8 = error(&Pq::build(&keys, &PqParams { m: 8, bits: 6, iters: 25, seed: 0, residual: 0 }).unwrap());
    assert!(m8 < m2, "m=8 {m8} vs m=2 {m2}");
}

#[test]
fn scan_codes_split_every_head_dimension() {
    let split = |d: usize| {
        let p = PqParams::scan_codes(d);
        (p.m, p.residual)
    };
    assert_eq!([split(128), split(64), split(36), split(130), split(7)], [(32, 16), (16, 8), (9, 0), (26, 0), (1, 0)]);
    // The codes of a head dimension that is not a multiple of 4 score as they reconstruct.
    let (keys, _, decode) = synth(600, 130);
    let pq = Pq::build(&keys, &PqParams::scan_codes(130)).unwrap();
    let q = &decode[..130];
    let scores = pq.token_scores(q, None).unwrap();
    let parts: Vec<Vec<f32>> = (0..600)
        .map(|t| {
            pq.reconstruct(t)
                .chunks(5)
                .zip(q.chunks(5))
                .map(|(k, q)| k.iter().zip(q).map(|(a, b)| a * b).sum())
                .collect()
        })
        .collect();
    // The tables are quantised to bytes: at most half a step per subspace, a step being the
    // widest subspace's range of scores over 255.
    let range = |j: usize| {
        let (lo, hi) = parts.iter().fold((f32::MAX, f32::MIN), |(lo, hi), p| (lo.min(p[j]), hi.max(p[j])));
        hi - lo
    };
    let step = (0..26).map(range).fold(0.0, f32::max) / 255.0;
    for (t, p) in parts.iter().enumerate() {
        let want: f32 = p.iter().sum();
        assert!((scores[t] - want).abs() <= 26.0 * step / 2.0 * 1.01 + 1e-3, "token {t}: {} vs {want}", scores[t]);
    }
}

#[test]
fn pq_handles_fewer_or_identical_keys_than_centroids() {
    let mut rng = Rng::new(4);
    // Fewer keys than centroids: every key becomes a centroid (up to f16 rounding).
    let keys = random_keys(10, 16, &mut rng);
    let pq = Pq::build(&keys, &PqParams::M4B8).unwrap();
    for t in 0..10 {
        let r = pq.reconstruct(t);
        assert!(r.iter().zip(keys.row(t)).all(|(a, b)| (a - b.to_f32()).abs() < 1e-3));
    }
    // All keys alike, and no keys at all.
    let same = MemKeys::new(16, [f16::from_f32(0.5); 16 * 300].to_vec());
    let pq = Pq::build(&same, &PqParams::M2B6).unwrap();
    assert!(pq.reconstruct(299).iter().all(|&x| x == 0.5));
    let none = Pq::build(&MemKeys::new(16, Vec::new()), &PqParams::M2B6).unwrap();
    assert!(none.select(&[0.0; 16], 10, None).unwrap().ids.is_empty());
    // Parameters that cannot split the keys.
    assert!(Pq::build(&same, &PqParams { m: 3, ..PqParams::M2B6 }).is_err());
    assert!(Pq::build(&same, &PqParams { bits: 9, ..PqParams::M2B6 }).is_err());
    assert!(Pq::build(&same, &PqParams { bits: 0, ..PqParams::M2B6 }).is_err());
}

/// InfLLM's rule, written out directly: representatives by q̄ · k (or the block's mean key),
/// block score the best q · representative, blocks best first while they fit.
fn infllm_by_hand(
    keys: &MemKeys,
    queries: &[f32],
    b: u32,
    r: usize,
    q: &[f32],
    budget: usize,
) -> (Vec<Vec<u32>>, Vec<u32>) {
    let (d, n) = (keys.dim(), keys.len());
    let mean = |rows: Vec<&[f32]>| -> Vec<f32> {
        let mut acc = vec![0.0f64; d];
        for row in &rows {
            acc.iter_mut().zip(*row).for_each(|(a, &x)| *a += x as f64);
        }
        acc.iter().map(|a| (a / rows.len().max(1) as f64) as f32).collect()
    };
    let qbar = mean(queries.chunks(d).collect());
    let mut reps = Vec::new();
    let mut scores = Vec::new();
    for first in (0..n).step_by(b as usize) {
        let ids: Vec<u32> = (first..(first + b).min(n)).collect();
        let dir = if queries.is_empty() {
            let rows: Vec<Vec<f32>> = ids.iter().map(|&t| keys.row(t).iter().map(|x| x.to_f32()).collect()).collect();
            mean(rows.iter().map(|r| r.as_slice()).collect())
        } else {
            qbar.clone()
        };
        let mut ranked = ids.clone();
        ranked.sort_by(|&x, &y| {
            ctxfs_kernels::dot(keys.row(y), &dir).total_cmp(&ctxfs_kernels::dot(keys.row(x), &dir)).then(x.cmp(&y))
        });
        let chosen: Vec<u32> = (0..r).map(|i| ranked[i.min(ranked.len() - 1)]).collect();
        scores.push(chosen.iter().map(|&t| ctxfs_kernels::dot(keys.row(t), q)).fold(f32::NEG_INFINITY, f32::max));
        reps.push(chosen);
    }
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&x, &y| scores[y].total_cmp(&scores[x]).then(x.cmp(&y)));
    let (mut taken, mut used) = (Vec::new(), 0);
    for blk in order {
        let len = ((blk as u32 + 1) * b).min(n) - blk as u32 * b;
        if used + len as usize > budget {
            break;
        }
        used += len as usize;
        taken.push(blk as u32);
    }
    taken.sort_unstable();
    (reps, taken.iter().flat_map(|&blk| blk * b..((blk + 1) * b).min(n)).collect())
}

#[test]
fn infllm_picks_the_blocks_its_rule_says() {
    let (keys, prefill, decode) = synth(3000, 64);
    for (queries, rule) in [(&prefill[..], RepRule::MeanQuery), (&[][..], RepRule::MeanKey)] {
        for (b, r) in [(128, 4), (100, 3), (7, 16)] {
            let idx = Infllm::build(&keys, queries, &InfllmParams { block_tokens: b, reps: r }).unwrap();
            assert_eq!(idx.rule(), rule);
            for q in decode.chunks(64).take(4) {
                for budget in [0, 256, 1000, 4000] {
                    let (reps, want) = infllm_by_hand(&keys, queries, b, r as usize, q, budget);
                    for (blk, rep) in reps.iter().enumerate() {
                        assert_eq!(&idx.representatives(blk as u32), rep, "block {blk}");
                    }
                    let got = idx.select(q, budget, None).unwrap();
                    assert_eq!(got.ids, want, "blocks of {b}, {r} representatives, budget {budget}");
                    assert_eq!(got.stats.keys_scored, 3000u64.div_ceil(b as u64) * r as u64);
                }
            }
        }
    }
    assert!(Infllm::build(&keys, &[], &InfllmParams { block_tokens: 0, reps: 4 }).is_err());
    assert!(Infllm::build(&keys, &[1.0; 3], &InfllmParams::default()).is_err());
}

/// The in-memory forms of every method on one head.
struct All {
    quest: Quest,
    quest1: Quest,
    infllm: Infllm,
    pq26: Pq,
    pq48: Pq,
}

fn all(keys: &MemKeys, prefill: &[f32]) -> All {
    All {
        quest: Quest::build(keys, &QuestParams::default()).unwrap(),
        quest1: Quest::build(keys, &QuestParams { page_tokens: 1 }).unwrap(),
        infllm: Infllm::build(keys, prefill, &InfllmParams::default()).unwrap(),
        pq26: Pq::build(keys, &PqParams::M2B6).unwrap(),
        pq48: Pq::build(keys, &PqParams::M4B8).unwrap(),
    }
}

#[test]
fn prefix_filter_never_returns_a_token_at_or_beyond_the_prefix() {
    let (keys, prefill, decode) = synth(2000, 64);
    let a = all(&keys, &prefill);
    let methods: [&dyn Coarse; 5] = [&a.quest, &a.quest1, &a.infllm, &a.pq26, &a.pq48];
    for q in decode.chunks(64).take(3) {
        for prefix in [0, 1, 15, 16, 17, 127, 128, 129, 1000, 1999, 2000, 5000] {
            for budget in [0, 10, 100, 512, 3000] {
                for m in methods {
                    let got = m.select(q, budget, Some(prefix)).unwrap();
                    assert!(got.ids.iter().all(|&t| t < prefix), "prefix {prefix}");
                    assert!(got.ids.len() <= budget);
                    assert!(got.ids.windows(2).all(|w| w[0] < w[1]), "ascending, no repeats");
                    if budget >= 2000.min(prefix as usize) {
                        assert_eq!(got.ids.len(), 2000.min(prefix as usize), "a budget beyond the prefix takes it all");
                    }
                }
            }
        }
    }
}

/// Field `i` after the version of a PQ run's meta block (docs/format.md §19).
fn meta_field(run: &[Vec<u8>], i: usize) -> usize {
    u32::from_le_bytes(run[0][8 + 4 * i..12 + 4 * i].try_into().unwrap()) as usize
}

/// `run` as layout `version` wrote it: its last `blocks` blocks gone, and its meta block
/// the same fields up to the `fields`-th.
fn as_version(mut run: Vec<Vec<u8>>, version: u32, fields: usize, blocks: usize) -> Vec<Vec<u8>> {
    run.truncate(run.len() - blocks);
    run[0][4..8].copy_from_slice(&version.to_le_bytes());
    run[0].truncate(8 + 4 * fields);
    run
}

/// A PQ run as layout version 3 wrote it: the same meta fields up to the sample stride, its
/// centroid, code and sample blocks, and no residual codes.
fn version_3(run: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let field = |i: usize| meta_field(&run, i);
    let (tokens, k, residual) = (field(0), 1 << field(3), field(10));
    let blocks = if residual == 0 { 0 } else { (residual * k).div_ceil(field(11)) + tokens.div_ceil(field(12)) };
    as_version(run, 3, 10, blocks)
}

/// A PQ run as layout version 2 wrote it: the same meta fields, centroid and code blocks,
/// and no sample blocks.
fn version_2(run: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let run = version_3(run);
    let field = |i: usize| meta_field(&run, i);
    let (tokens, per_block, stride) = (field(0), field(8), field(9));
    let samples = if stride == 0 { 0 } else { tokens.div_ceil(stride).div_ceil(per_block) };
    as_version(run, 2, 9, samples)
}

/// A PQ run as layout version 1 wrote it: version 2's, code blocks token-major.
fn token_major(run: Vec<Vec<u8>>) -> Vec<Vec<u8>> {
    let mut run = as_version(version_2(run), 1, 9, 0);
    let field = |i: usize| meta_field(&run, i);
    let (m, k, per_block) = (field(2), 1 << field(3), field(7));
    for block in &mut run[1 + (m * k).div_ceil(per_block)..] {
        let r = block.len() / m;
        *block = (0..r * m).map(|i| block[(i % m) * r + i / m]).collect();
    }
    run
}

/// Formats a store on `dev` and appends each run of payloads to one index stream, one run
/// after another (as the graph index and its coarse indexes will be); returns each run's
/// block requests.
fn store_runs(dev: Arc<dyn BlockDevice>, d: usize, runs: &[Vec<Vec<u8>>]) -> (Store, Vec<Vec<BlockRequest>>) {
    let store = ctxfs_vfs::format(dev).unwrap();
    let shape = ModelShape { layers: 1, q_heads: 2, kv_heads: 1, head_dim: d as u16, dtype: DType::F16 };
    let mut txn = store.begin().unwrap();
    txn.create_context("c", shape, &[]).unwrap();
    for run in runs {
        for b in run {
            txn.append_block("c", 0, 0, FileStream::Index, b).unwrap();
        }
    }
    txn.commit().unwrap();
    let snap = store.snapshot();
    let s = snap.context("c").unwrap().stream(0, 0, FileStream::Index).unwrap();
    let all: Vec<BlockRequest> = (0..s.blocks()).map(|l| BlockRequest::new(s.locate(l).unwrap())).collect();
    drop(snap);
    let mut at = 0;
    let out = runs
        .iter()
        .map(|run| {
            at += run.len();
            all[at - run.len()..at].to_vec()
        })
        .collect();
    (store, out)
}

fn file_device(dir: &tempfile::TempDir) -> Arc<dyn BlockDevice> {
    let path = dir.path().join("coarse.img");
    std::fs::File::create(&path).unwrap().set_len(32 << 20).unwrap();
    Arc::from(ctxfs_vfs::device::open_path(&path, DeviceChoice::Uring, 4096, ctxfs_vfs::Access::Write).unwrap())
}

#[test]
fn paged_readers_answer_exactly_as_memory() {
    let (keys, prefill, decode) = synth(3000, 64);
    let a = all(&keys, &prefill);
    let payload = max_payload(4096);
    let runs = vec![
        a.quest.payloads(payload).unwrap(),
        a.quest1.payloads(payload).unwrap(),
        a.infllm.payloads(payload).unwrap(),
        a.pq26.payloads(payload).unwrap(),
        a.pq48.payloads(payload).unwrap(),
        token_major(a.pq48.payloads(payload).unwrap()),
    ];
    assert!(runs.iter().flatten().all(|b| b.len() <= payload));
    // Each run's meta block names its kind and length, so runs stored back to back can be
    // walked.
    let kinds =
        [CoarseKind::Quest, CoarseKind::Quest, CoarseKind::Infllm, CoarseKind::Pq, CoarseKind::Pq, CoarseKind::Pq];
    for (run, kind) in runs.iter().zip(kinds) {
        assert_eq!(run_of(&run[0]).unwrap(), (kind, run.len()));
    }
    assert!(run_of(&runs[0][1]).is_err(), "a page block is not a meta block");
    assert!(runs[1].len() > 64, "page size 1 needs more blocks than one pinned batch");
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (store, reqs) = store_runs(file_device(&dir), 64, &runs);
    // An index area of 80 frames: the page-size-1 scan (200 blocks) must pin in batches.
    let config = PoolConfig { budget_bytes: 100 * 4096, data_fraction: 0.2, ..Default::default() };
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), config).unwrap();
    let quest = PagedQuest::open(&pool, &reqs[0]).unwrap();
    let quest1 = PagedQuest::open(&pool, &reqs[1]).unwrap();
    let infllm = PagedInfllm::open(&pool, &reqs[2]).unwrap();
    let pq26 = PagedPq::open(&pool, &reqs[3]).unwrap();
    let pq48 = PagedPq::open(&pool, &reqs[4]).unwrap();
    let pq48_v1 = PagedPq::open(&pool, &reqs[5]).unwrap();
    assert_eq!((pq48.meta().version, pq48_v1.meta().version), (PQ_VERSION, 1));
    assert_eq!(quest.meta().pages(), 188);
    assert_eq!(infllm.meta().rule, RepRule::MeanQuery);
    assert_eq!(pq48.meta().params, PqParams::M4B8);
    let pairs: [(&dyn Coarse, &dyn Coarse); 6] = [
        (&a.quest, &quest),
        (&a.quest1, &quest1),
        (&a.infllm, &infllm),
        (&a.pq26, &pq26),
        (&a.pq48, &pq48),
        (&a.pq48, &pq48_v1),
    ];
    // A GQA group's page bounds in one pass: each query's to the bit, and the same selection.
    for (prefix, group) in [(None, &decode[..4 * 64]), (Some(1000), &decode[64..3 * 64])] {
        let many = quest.page_scores_many(group, prefix).unwrap();
        for (t, q) in group.chunks(64).enumerate() {
            assert_eq!(many.scores(t), &quest.page_scores(q, prefix).unwrap()[..], "query {t} of the group");
            let one = quest.select(q, 1024, prefix).unwrap();
            let from_group = quest.select_scored(many.scores(t), many.stats, 1024, prefix);
            assert_eq!((one.ids, one.metadata_bytes), (from_group.ids, from_group.metadata_bytes));
        }
    }
    // A group's scan of the codes records the best of each run of keys: a pass near the top
    // looks only inside the runs that reach its cut, and finds what a pass over every score
    // finds.
    for (codes, prefix) in [(&pq48, None), (&pq48, Some(1500)), (&pq48_v1, Some(2999))] {
        let many = codes.token_scores_many(&decode[..4 * 64], prefix).unwrap();
        for t in 0..4 {
            let (all, scored) = (many.scores(t), many.query(t));
            let runs: Vec<f32> =
                all.chunks(BEST_RUN).map(|run| run.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
            assert_eq!(scored.run_best(), &runs[..]);
            assert_eq!(scored.best(), runs.iter().copied().fold(f32::NEG_INFINITY, f32::max));
            let mut sorted = all.to_vec();
            sorted.sort_by(|a, b| b.total_cmp(a));
            for rank in [0, 1, 10, 100, sorted.len() - 1] {
                assert_eq!(scored.reaching(sorted[rank]), reaching(all, sorted[rank]), "query {t}, rank {rank}");
            }
        }
    }
    // The scan done elsewhere (a GPU holding the codes): the code blocks' bytes, scanned block
    // by block as stored, give the pool's scan's scores and runs' best; token-major codes
    // have no such copy.
    let per_block = pq48.meta().codes_per_block as usize;
    let bytes = pq48.code_bytes().unwrap().expect("subspace-major codes");
    assert_eq!(bytes.len(), 3000 * 4);
    assert_eq!(a.pq48.code_bytes().len(), 3000 * 4);
    assert!(pq48_v1.code_bytes().unwrap().is_none());
    let blockwise = |luts: &[ctxfs_kernels::PqLut], lim: usize, out: &mut [f32]| {
        for (lut, out) in luts.iter().zip(out.chunks_exact_mut(lim)) {
            for first in (0..lim).step_by(per_block) {
                let r = per_block.min(3000 - first);
                let upto = (first + r).min(lim);
                ctxfs_kernels::pq_scores(lut, &bytes[first * 4..(first + r) * 4], r, 0, &mut out[first..upto]);
            }
        }
        Ok::<(), ()>(())
    };
    for prefix in [None, Some(1500), Some(1)] {
        let group = &decode[..4 * 64];
        let (pool_scan, by) = (
            pq48.token_scores_many(group, prefix).unwrap(),
            pq48.token_scores_many_by(group, prefix, blockwise).unwrap().unwrap(),
        );
        let mem_by = a.pq48.token_scores_many_by(group, prefix, |luts, lim, out| {
            for (lut, out) in luts.iter().zip(out.chunks_exact_mut(lim)) {
                ctxfs_kernels::pq_scores(lut, a.pq48.code_bytes(), 3000, 0, out);
            }
            Ok::<(), ()>(())
        });
        let mem_by = mem_by.unwrap().unwrap();
        for t in 0..4 {
            assert_eq!(by.scores(t), pool_scan.scores(t), "prefix {prefix:?}, query {t}");
            assert_eq!(by.query(t).run_best(), pool_scan.query(t).run_best());
            assert_eq!(mem_by.scores(t), pool_scan.scores(t));
        }
        assert_eq!(by.stats.keys_scored, pool_scan.stats.keys_scored);
    }
    assert_eq!(
        pq48.token_scores_many_by(&decode[..64], None, |_, _, _| Err("refused")).unwrap().unwrap_err(),
        "refused"
    );
    for q in decode.chunks(64) {
        assert_eq!(a.quest.page_scores(q, None).unwrap(), quest.page_scores(q, None).unwrap());
        assert_eq!(a.infllm.block_scores(q, Some(1000)).unwrap(), infllm.block_scores(q, Some(1000)).unwrap());
        assert_eq!(a.pq48.token_scores(q, None).unwrap(), pq48.token_scores(q, None).unwrap());
        assert_eq!(pq48_v1.token_scores(q, Some(1500)).unwrap(), pq48.token_scores(q, Some(1500)).unwrap());
        for (mem, paged) in pairs {
            assert_eq!(mem.tokens(), paged.tokens());
            assert_eq!(mem.metadata_bytes_per_token(), paged.metadata_bytes_per_token());
            for (budget, prefix) in [(256, None), (1024, None), (1024, Some(1500)), (5000, Some(2999)), (0, None)] {
                let (m, p) = (mem.select(q, budget, prefix).unwrap(), paged.select(q, budget, prefix).unwrap());
                assert_eq!(m.ids, p.ids);
                assert_eq!((m.stats.keys_scored, m.metadata_bytes), (p.stats.keys_scored, p.metadata_bytes));
                assert_eq!(m.stats.blocks_touched, 0);
                assert!(p.stats.blocks_touched > 0 || (m.stats.keys_scored == 0 && budget == 0));
            }
        }
    }
    // With room for them, the indexes stay resident: a second pass reads nothing.
    let roomy = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), PoolConfig::default()).unwrap();
    let paged: Vec<Box<dyn Coarse>> = vec![
        Box::new(PagedQuest::open(&roomy, &reqs[1]).unwrap()),
        Box::new(PagedInfllm::open(&roomy, &reqs[2]).unwrap()),
        Box::new(PagedPq::open(&roomy, &reqs[4]).unwrap()),
    ];
    for pass in 0..2 {
        for q in decode.chunks(64) {
            for p in &paged {
                let r = p.select(q, 1024, None).unwrap();
                assert!(pass == 0 || r.stats.blocks_read == 0);
            }
        }
    }
}

#[test]
fn damaged_meta_blocks_are_errors_never_panics() {
    let mut rng = Rng::new(5);
    let keys = random_keys(500, 32, &mut rng);
    let metas = [
        Quest::build(&keys, &QuestParams::default()).unwrap().payloads(PAYLOAD).unwrap().remove(0),
        Infllm::build(&keys, &[], &InfllmParams::default()).unwrap().payloads(PAYLOAD).unwrap().remove(0),
        Pq::build(&keys, &PqParams::M2B6).unwrap().payloads(PAYLOAD).unwrap().remove(0),
    ];
    let decode = |i: usize, b: &[u8]| -> bool {
        let ok = match i {
            0 => QuestMeta::decode(b).is_ok(),
            1 => InfllmMeta::decode(b).is_ok(),
            _ => PqMeta::decode(b).is_ok(),
        };
        assert_eq!(
            ok,
            run_of(b).is_ok_and(|(kind, _)| kind == [CoarseKind::Quest, CoarseKind::Infllm, CoarseKind::Pq][i])
        );
        ok
    };
    for (i, meta) in metas.iter().enumerate() {
        assert!(decode(i, meta));
        for len in 0..meta.len() {
            assert!(!decode(i, &meta[..len]), "method {i}: {len} bytes decoded");
        }
        for other in (0..3).filter(|&o| o != i) {
            assert!(!decode(other, meta), "method {other} decoded method {i}'s meta");
        }
        // A version this build does not read (Quest and InfLLM read 1, PQ 1 to 4).
        let mut bad = meta.clone();
        bad[4] = if i == 2 { 5 } else { 2 };
        assert!(!decode(i, &bad));
        // Every single-byte corruption decodes or fails, and never panics.
        for at in 0..meta.len() {
            for v in [0u8, 1, 0x7F, 0xFF, meta[at] ^ 0x10] {
                let mut bad = meta.clone();
                bad[at] = v;
                decode(i, &bad);
            }
        }
        // Random fields.
        for _ in 0..2000 {
            let mut bad = meta.clone();
            for x in bad[8..].iter_mut() {
                if rng.uniform() < 0.3 {
                    *x = rng.next_u64() as u8;
                }
            }
            decode(i, &bad);
        }
    }
}

#[test]
fn damaged_runs_are_errors_never_panics() {
    let (keys, prefill, decode) = synth(2000, 64);
    let payload = max_payload(4096);
    let quest = Quest::build(&keys, &QuestParams::default()).unwrap().payloads(payload).unwrap();
    let infllm = Infllm::build(&keys, &prefill, &InfllmParams::default()).unwrap().payloads(payload).unwrap();
    let pq = Pq::build(&keys, &PqParams::M4B8).unwrap().payloads(payload).unwrap();
    // Short last blocks; an InfLLM offset beyond its block; a PQ code beyond 2^b (bits = 6).
    let mut short_quest = quest.clone();
    short_quest.last_mut().unwrap().truncate(100);
    let mut bad_offset = infllm.clone();
    let rec = 2 * 4 * 64 + 2 * 4;
    bad_offset[1][2 * 4 * 64..2 * 4 * 64 + 2].copy_from_slice(&200u16.to_le_bytes());
    assert!(bad_offset[1].len() >= rec);
    let pq26 = Pq::build(&keys, &PqParams::M2B6).unwrap().payloads(payload).unwrap();
    let mut bad_code = pq26.clone();
    *bad_code.last_mut().unwrap().last_mut().unwrap() = 64;
    let runs = vec![short_quest, bad_offset, bad_code, quest.clone(), pq];
    let mem = Arc::new(ctxfs_vfs::device::MemDevice::new(4096, 4096));
    let (store, reqs) = store_runs(mem, 64, &runs);
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), PoolConfig::default()).unwrap();
    let q = &decode[..64];
    let e = PagedQuest::open(&pool, &reqs[0]).unwrap().select(q, 1000, None).unwrap_err();
    assert_eq!(e.block(), reqs[0].last().unwrap().block.into(), "{e}");
    let e = PagedInfllm::open(&pool, &reqs[1]).unwrap().select(q, 1000, None).unwrap_err();
    assert_eq!(e.block(), Some(reqs[1][1].block), "{e}");
    let e = PagedPq::open(&pool, &reqs[2]).unwrap().select(q, 1000, None).unwrap_err();
    assert_eq!(e.block(), Some(reqs[2].last().unwrap().block), "{e}");
    // Runs of the wrong length, the wrong method, and queries of the wrong dimension.
    assert!(PagedQuest::open(&pool, &reqs[3][..reqs[3].len() - 1]).is_err());
    assert!(PagedQuest::open(&pool, &[][..]).is_err());
    assert!(PagedPq::open(&pool, &reqs[3]).is_err());
    assert!(PagedInfllm::open(&pool, &reqs[4]).is_err());
    assert!(PagedQuest::open(&pool, &reqs[3]).unwrap().select(&[0.0; 32], 10, None).is_err());
    assert!(PagedPq::open(&pool, &reqs[4]).unwrap().select(&[0.0; 65], 10, None).is_err());
    // Two queries' worth where one is asked for is refused too; the batched pass takes them.
    let pq = PagedPq::open(&pool, &reqs[4]).unwrap();
    assert!(pq.select(&[0.0; 128], 10, None).is_err() && pq.token_scores(&[0.0; 128], None).is_err());
    assert_eq!(pq.token_scores_many(&[0.0; 128], None).unwrap().scores(1).len(), pq.tokens() as usize);
}

#[test]
fn on_generated_attention_every_method_beats_evenly_spaced_tokens() {
    let (keys, prefill, decode) = synth(8192, 64);
    let a = all(&keys, &prefill);
    let scale = 1.0 / 8.0;
    let mass = |ids: &[u32], z: &[f32]| -> f64 {
        let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let total: f64 = z.iter().map(|&x| ((x - m) * scale).exp() as f64).sum();
        ids.iter().map(|&t| ((z[t as usize] - m) * scale).exp() as f64).sum::<f64>() / total
    };
    let budget = 1024;
    let even: Vec<u32> = (0..8192).step_by(8).collect();
    let methods: [(&str, &dyn Coarse); 4] =
        [("quest", &a.quest), ("infllm", &a.infllm), ("pq m2b6", &a.pq26), ("pq m4b8", &a.pq48)];
    for (name, m) in methods {
        let (mut got, mut base) = (0.0, 0.0);
        for q in decode.chunks(64) {
            let mut z = vec![0.0f32; 8192];
            ctxfs_kernels::scores(keys.data(), q, 1.0, &mut z);
            got += mass(&m.select(q, budget, None).unwrap().ids, &z);
            base += mass(&even, &z);
        }
        assert!(got > base * 1.5, "{name}: attention mass {got} vs {base} for evenly spaced tokens");
    }
}

/// A scan done elsewhere that keeps only the best ([`KeepCodes`]): here the CPU's scan of a
/// memory index's codes, with `over_room` reporting more tokens reaching the cut than fit.
struct KeptOnCpu<'a> {
    pq: &'a Pq,
    scores: Vec<Vec<f32>>,
    over_room: bool,
}

impl KeepCodes<()> for KeptOnCpu<'_> {
    fn scan_sampled(&mut self, luts: &[ctxfs_kernels::PqLut], lim: usize, stride: usize) -> Result<Vec<f32>, ()> {
        let n = self.pq.tokens() as usize;
        self.scores = luts
            .iter()
            .map(|lut| {
                let mut out = vec![0.0; lim];
                ctxfs_kernels::pq_scores(lut, self.pq.code_bytes(), n, 0, &mut out);
                out
            })
            .collect();
        Ok(self.scores.iter().flat_map(|s| s.iter().step_by(stride).copied()).collect())
    }

    fn reaching(&mut self, _: &[ctxfs_kernels::PqLut], _: usize, cuts: &[f32], cap: usize) -> Result<Vec<Reached>, ()> {
        Ok(self
            .scores
            .iter()
            .zip(cuts)
            .map(|(scores, cut)| {
                let ids = reaching(scores, *cut);
                let count = if self.over_room { cap + 1 } else { ids.len() };
                Reached { count, tokens: ids.iter().take(cap).map(|&t| (t, scores[t as usize])).collect() }
            })
            .collect())
    }
}

#[test]
fn kept_scores_are_the_best_the_full_scan_would_take() {
    let (keys, _, decode) = synth(20_000, 64);
    let pq = Pq::build(&keys, &PqParams::scan_codes(64)).unwrap();
    let group = &decode[..4 * 64];
    for (k, prefix) in [(64, None), (1024, None), (64, Some(1500)), (300, Some(19_999))] {
        let mut keep = KeptOnCpu { pq: &pq, scores: Vec::new(), over_room: false };
        let kept = pq.token_best_many_by(group, prefix, k, SAMPLE_STRIDE, &mut keep).unwrap().unwrap().expect("a cut");
        let full = pq.token_scores_many(group, prefix).unwrap();
        assert_eq!(kept.stats.keys_scored, full.stats.keys_scored);
        for (t, kept) in kept.queries.iter().enumerate() {
            let scores = full.scores(t);
            let best = take_tokens(QueryScores::plain(scores), k);
            assert_eq!(kept.best.iter().map(|p| p.0).collect::<Vec<_>>(), best, "k {k}, prefix {prefix:?}");
            assert!(kept.best.iter().all(|&(id, s)| s.to_bits() == scores[id as usize].to_bits()));
            assert_eq!(kept.samples, scores.iter().step_by(SAMPLE_STRIDE as usize).copied().collect::<Vec<_>>());
        }
    }
    // A sample too short to cut at (k near the tokens), or more reaching the cut than there is
    // room for: no kept scores, so that the caller reads them all.
    let mut keep = KeptOnCpu { pq: &pq, scores: Vec::new(), over_room: false };
    assert!(pq.token_best_many_by(group, None, 10_000, SAMPLE_STRIDE, &mut keep).unwrap().unwrap().is_none());
    let mut keep = KeptOnCpu { pq: &pq, scores: Vec::new(), over_room: true };
    assert!(pq.token_best_many_by(group, None, 64, SAMPLE_STRIDE, &mut keep).unwrap().unwrap().is_none());
}

/// The best as this core keeps them, scanning only for the tokens reaching each query's
/// cut (`token_best_many`), from memory and from code blocks read through a pool on a real
/// device: the tokens `take_tokens` takes from every score, with the same score bits, and
/// the samples those of the seeds' tokens.
#[test]
fn the_best_kept_on_this_core_are_those_of_every_score() {
    // d = 128: 126 codes to a block, so the 207 samples of 20,000 tokens fill sample blocks.
    let (keys, _, decode) = synth(20_000, 128);
    let pq = Pq::build(&keys, &PqParams::scan_codes(128)).unwrap();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let payload = max_payload(4096);
    let v4 = pq.payloads(payload).unwrap();
    // 64 centroids a subspace: a code of 64 in a sample block is beyond them.
    let pq6 = Pq::build(&keys, &PqParams { bits: 6, ..PqParams::scan_codes(128) }).unwrap();
    let mut bad_sample = version_3(pq6.payloads(payload).unwrap());
    *bad_sample.last_mut().unwrap().last_mut().unwrap() = 64;
    let small = Pq::build(&synth(4_096, 128).0, &PqParams::scan_codes(128)).unwrap();
    let runs = vec![v4.clone(), version_2(v4.clone()), token_major(v4), bad_sample, small.payloads(payload).unwrap()];
    let (store, reqs) = store_runs(file_device(&dir), 128, &runs);
    let config = PoolConfig { budget_bytes: 200 * 4096, data_fraction: 0.2, ..Default::default() };
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), config).unwrap();
    let paged = PagedPq::open(&pool, &reqs[0]).unwrap();
    assert!(reqs[0].len() > 150, "the codes span many blocks");
    assert_eq!(reqs[0].len(), reqs[1].len() + 2, "two sample blocks");
    let group = &decode[..4 * 128];
    for (k, prefix) in [(64, None), (1024, None), (64, Some(1500)), (300, Some(19_999)), (500, Some(7_777))] {
        let full = pq.token_scores_many(group, prefix).unwrap();
        let here = pq.token_best_many(group, prefix, k, SAMPLE_STRIDE).unwrap().expect("a cut");
        let read = paged.token_best_many(group, prefix, k, SAMPLE_STRIDE).unwrap().expect("a cut");
        assert_eq!(here, KeptGroup { stats: here.stats, ..read.clone() });
        assert_eq!(read.stats.keys_scored, full.stats.keys_scored);
        assert!(read.stats.blocks_touched > 0);
        for (t, kept) in read.queries.iter().enumerate() {
            let scores = full.scores(t);
            let best = take_tokens(QueryScores::plain(scores), k);
            assert_eq!(kept.best.iter().map(|p| p.0).collect::<Vec<_>>(), best, "k {k}, prefix {prefix:?}");
            assert!(kept.best.iter().all(|&(id, s)| s.to_bits() == scores[id as usize].to_bits()));
            let samples: Vec<f32> = scores.iter().step_by(SAMPLE_STRIDE as usize).copied().collect();
            let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&kept.samples), bits(&samples));
        }
        // A coarse selection of one query keeps its best the same way.
        let q = &group[..128];
        assert_eq!(paged.select(q, k, prefix).unwrap().ids, take_tokens(full.query(0), k));
        assert_eq!(pq.select(q, k, prefix).unwrap().ids, take_tokens(full.query(0), k));
    }
    // A sample too short to cut at, a stride other than the samples', and runs without
    // sample codes (versions 2 and 1, read as ever): none kept, the caller scans every score.
    assert!(paged.token_best_many(group, None, 10_000, SAMPLE_STRIDE).unwrap().is_none());
    assert!(paged.token_best_many(group, None, 64, 48).unwrap().is_none());
    for (run, version) in [(&reqs[1], 2), (&reqs[2], 1)] {
        let old = PagedPq::open(&pool, run).unwrap();
        assert_eq!(old.meta().version, version);
        assert!(old.token_best_many(group, None, 64, SAMPLE_STRIDE).unwrap().is_none());
        assert_eq!(
            old.token_scores_many(group, None).unwrap().scores(0),
            pq.token_scores_many(group, None).unwrap().scores(0)
        );
    }
    let e = PagedPq::open(&pool, &reqs[3]).unwrap().token_best_many(group, None, 64, SAMPLE_STRIDE).unwrap_err();
    assert_eq!(e.block(), Some(reqs[3].last().unwrap().block), "{e}");
    // The last of the 207 samples: token 206 · 97.
    assert!(e.to_string().contains("of token 19982 "), "{e}");
    // A run whose 43 samples would not fill a block has none: scanned from every score.
    let small = PagedPq::open(&pool, &reqs[4]).unwrap();
    assert_eq!((small.meta().version, small.meta().sample_stride), (PQ_VERSION, 0));
    assert!(small.token_best_many(group, None, 64, SAMPLE_STRIDE).unwrap().is_none());
}

#[test]
fn the_scores_kept_above_a_cut_are_every_score_reaching_it() {
    let (keys, _, decode) = synth(20_000, 128);
    let pq = Pq::build(&keys, &PqParams::scan_codes(128)).unwrap();
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let v3 = pq.payloads(max_payload(4096)).unwrap();
    let (store, reqs) = store_runs(file_device(&dir), 128, &[v3.clone(), version_2(v3)]);
    let config = PoolConfig { budget_bytes: 200 * 4096, data_fraction: 0.2, ..Default::default() };
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), config).unwrap();
    let paged = PagedPq::open(&pool, &reqs[0]).unwrap();
    let group = &decode[..4 * 128];
    // Query 0 cuts at its sample's 5th best, query 1 at its best tenth's least; query 2 has
    // no cut; all of query 3's tokens reach its cut, more than a quarter of them.
    let cut = |q: usize, sample: &[f32]| {
        let mut sorted = sample.to_vec();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        match q {
            0 => Some(sorted[5]),
            1 => Some(sorted[sorted.len() / 10]),
            2 => None,
            _ => Some(f32::MIN),
        }
    };
    for prefix in [None, Some(7_777)] {
        let full = pq.token_scores_many(group, prefix).unwrap();
        let here = pq.token_above_many(group, prefix, SAMPLE_STRIDE, &cut).unwrap().expect("sample codes");
        let read = paged.token_above_many(group, prefix, SAMPLE_STRIDE, &cut).unwrap().expect("sample codes");
        assert_eq!(here, AboveGroup { stats: here.stats, ..read.clone() });
        assert_eq!(read.stats.keys_scored, full.stats.keys_scored);
        assert!(read.queries[2..].iter().all(Option::is_none), "no cut, or too many reaching it");
        for (q, kept) in read.queries[..2].iter().enumerate() {
            let (kept, scores) = (kept.as_ref().expect("a cut"), full.scores(q));
            let bits = |v: &[f32]| v.iter().map(|s| s.to_bits()).collect::<Vec<_>>();
            let samples: Vec<f32> = scores.iter().step_by(SAMPLE_STRIDE as usize).copied().collect();
            assert_eq!(bits(&kept.samples), bits(&samples));
            assert_eq!(Some(kept.floor), cut(q, &samples));
            let reaching: Vec<(u32, u32)> = (0..scores.len() as u32)
                .filter(|&t| scores[t as usize] >= kept.floor)
                .map(|t| (t, scores[t as usize].to_bits()))
                .collect();
            assert_eq!(kept.tokens.iter().map(|&(t, s)| (t, s.to_bits())).collect::<Vec<_>>(), reaching);
            assert!(reaching.len() > SAMPLE_STRIDE as usize * 3, "{} reach query {q}'s cut", reaching.len());
        }
    }
    // A run without sample codes (version 2): none kept, the caller scans every score.
    assert!(PagedPq::open(&pool, &reqs[1])
        .unwrap()
        .token_above_many(group, None, SAMPLE_STRIDE, &cut)
        .unwrap()
        .is_none());
}

/// The residual codes (`PqParams::scan_codes`, from 32,768 tokens) take the codes'
/// approximate scores nearer the exact ones, read the same from memory and through a pool on
/// a real device, and a run without them (version 3, or fewer tokens) says so; a bad residual
/// code is an error naming its block.
#[test]
fn residual_codes_bring_the_codes_scores_nearer_the_exact_ones() {
    let (n, d) = (32_768, 128);
    let (keys, _, decode) = synth(n, d);
    let pq = Pq::build(&keys, &PqParams::scan_codes(d)).unwrap();
    assert!(pq.has_residual());
    let short = MemKeys::new(d, (0..(n - 1) as u32).flat_map(|t| keys.row(t).to_vec()).collect());
    assert!(!Pq::build(&short, &PqParams::scan_codes(d)).unwrap().has_residual(), "centroids beyond an eighth");
    let payload = max_payload(4096);
    let v4 = pq.payloads(payload).unwrap();
    // The last residual code block: token n − 1's last code is beyond 2^6 centroids.
    let pq6 = Pq::build(&keys, &PqParams { bits: 6, ..PqParams::scan_codes(d) }).unwrap();
    let mut bad6 = pq6.payloads(payload).unwrap();
    *bad6.last_mut().unwrap().last_mut().unwrap() = 64;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let (store, reqs) = store_runs(file_device(&dir), d, &[v4.clone(), version_3(v4), bad6]);
    let config = PoolConfig { budget_bytes: 2400 * 4096, data_fraction: 0.2, ..Default::default() };
    let pool = Arc::new(BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), config).unwrap());
    let paged = PagedPq::open(&pool, &reqs[0]).unwrap();
    // The same run held resident (as a compact context holds it), read without pins.
    let held = pool.make_resident(&reqs[0]).unwrap().expect("room to hold the run");
    let from_held = PagedPq::open_held(&pool, &reqs[0], Some((&held, 0))).unwrap();
    let ids: Vec<u32> = (0..n as u32).step_by(7).collect();
    let (mut approx_err, mut refined_err) = (0.0f64, 0.0f64);
    for q in decode.chunks_exact(d).take(8) {
        let approx = pq.token_scores(q, None).unwrap();
        let table = pq.residual_table(q).unwrap().expect("residual codes");
        let mut stats = Default::default();
        assert_eq!(paged.residual_table(q, &mut stats).unwrap().as_ref(), Some(&table));
        // The table: each residual centroid's inner product with the query's part.
        let mut refined: Vec<f32> = ids.iter().map(|&t| approx[t as usize]).collect();
        pq.refine(&table, &ids, &mut refined).unwrap();
        let mut read: Vec<f32> = ids.iter().map(|&t| approx[t as usize]).collect();
        paged.refine(&table, &ids, &mut read, &mut stats).unwrap();
        assert_eq!(read, refined, "the stored residual codes refine as those in memory");
        assert!(stats.blocks_touched > 0);
        let mut held_stats = SearchStats::default();
        let mut from_frames: Vec<f32> = ids.iter().map(|&t| approx[t as usize]).collect();
        from_held.refine(&table, &ids, &mut from_frames, &mut held_stats).unwrap();
        assert_eq!(from_frames, refined, "the held residual codes refine as those in memory");
        assert_eq!((held_stats.blocks_read, held_stats.blocks_touched > 0), (0, true));
        let group = &decode[..4 * d];
        let kept = |p: &PagedPq<'_>| p.token_best_many(group, None, 256, SAMPLE_STRIDE).unwrap().expect("kept");
        assert_eq!(kept(&from_held).queries, kept(&paged).queries, "held codes scan as pinned ones");
        for (&t, r) in ids.iter().zip(&refined) {
            let exact = dot64(keys.row(t), q);
            approx_err += (approx[t as usize] as f64 - exact).powi(2);
            refined_err += (*r as f64 - exact).powi(2);
        }
    }
    // The residual codes take out over half of the codes' squared error.
    assert!(refined_err < 0.5 * approx_err, "{refined_err} against {approx_err}");
    // Ids must ascend and lie within the run; a run without residual codes has no tables.
    let q = &decode[..d];
    let table = pq.residual_table(q).unwrap().unwrap();
    assert!(pq.refine(&table, &[5, 3], &mut [0.0, 0.0]).is_err());
    assert!(pq.refine(&table, &[n as u32], &mut [0.0]).is_err());
    let v3 = PagedPq::open(&pool, &reqs[1]).unwrap();
    assert_eq!(v3.meta().version, 3);
    assert!(v3.residual_table(q, &mut Default::default()).unwrap().is_none());
    assert!(v3.refine(&table, &[1, 2], &mut [1.0, 1.0], &mut Default::default()).is_err());
    assert!(Pq::build(&keys, &PqParams::M4B8).unwrap().residual_table(q).unwrap().is_none());
    let bad = PagedPq::open(&pool, &reqs[2]).unwrap();
    let table6 = bad.residual_table(q, &mut Default::default()).unwrap().unwrap();
    let e = bad.refine(&table6, &[n as u32 - 1], &mut [0.0], &mut Default::default()).unwrap_err();
    assert_eq!(e.block(), Some(reqs[2].last().unwrap().block), "{e}");
    assert!(e.to_string().contains(&format!("of token {} ", n - 1)), "{e}");
    // Held, the bad code is the same error naming the same block.
    let held_bad = pool.make_resident(&reqs[2]).unwrap().expect("room to hold the run");
    let bad = PagedPq::open_held(&pool, &reqs[2], Some((&held_bad, 0))).unwrap();
    let held_e = bad.refine(&table6, &[n as u32 - 1], &mut [0.0], &mut Default::default()).unwrap_err();
    assert_eq!(held_e.to_string(), e.to_string());
}
