//! The regression baseline: hops and keys scored by graph DIPRS and top-k, and keys scored by
//! DIPRS on the PQ scan codes (the seeds and the range's candidates, scored exactly), per
//! dataset, checked in as `tests/baseline.json`: the generator at a fixed seed, and real attention (SmolLM2-135M,
//! layer 15, 4,096 tokens of prose: `tests/data/smollm2-prose-4k.safetensors` at the
//! repository root, written by `python -m ctxfs.capture`). A change that makes either grow by
//! more than 10% on any dataset fails here. After an intended change, rerun with
//! `CTXFS_UPDATE_BASELINE=1` and commit the new file.

use ctxfs_index::approx;
use ctxfs_index::coarse::pq::{Pq, PqParams};
use ctxfs_index::flat::QueryScores;
use ctxfs_index::search::{diprs, topk, SEED_STRIDE};
use ctxfs_index::synth::{head, SynthParams};
use ctxfs_index::{build, BuildParams, DiprsParams, Keys, MemKeys, Pair, SearchStats};
use half::f16;
use safetensors::{Dtype, SafeTensors};

/// One head: keys, prefill queries (to train the graph), decode queries.
struct Head {
    keys: Vec<f16>,
    prefill: Vec<f32>,
    decode: Vec<f32>,
}

fn generator() -> Vec<Head> {
    let p = SynthParams { tokens: 8192, head_dim: 64, group: 2, seed: 2024 };
    (0..2)
        .map(|kv| {
            let h = head(&p, 1, kv, 2048, 8);
            Head { keys: h.keys, prefill: h.prefill.concat(), decode: h.decode.concat() }
        })
        .collect()
}

fn f16s(st: &SafeTensors<'_>, name: &str) -> (Vec<usize>, Vec<f16>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.dtype(), Dtype::F16, "{name}");
    (t.shape().to_vec(), t.data().chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]])).collect())
}

/// Every kv head of the captured layer, with its GQA group's queries.
fn smollm2_prose() -> Vec<Head> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/smollm2-prose-4k.safetensors");
    let bytes = std::fs::read(path).expect("tests/data/smollm2-prose-4k.safetensors");
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (ks, keys) = f16s(&st, "layers.0.k");
    let (qs, prefill) = f16s(&st, "layers.0.q");
    let (ds, decode) = f16s(&st, "layers.0.decode_q");
    let (kv, n, d) = (ks[0], ks[1], ks[2]);
    let group = qs[0] / kv;
    let rows = |x: &[f16], per_head: usize, h: usize| -> Vec<f32> {
        x[h * group * per_head * d..(h + 1) * group * per_head * d].iter().map(|x| x.to_f32()).collect()
    };
    (0..kv)
        .map(|h| Head {
            keys: keys[h * n * d..(h + 1) * n * d].to_vec(),
            prefill: rows(&prefill, qs[1], h),
            decode: rows(&decode, ds[1], h),
        })
        .collect()
}

/// DIPRS on the codes, as sessions with the keys in memory run it: the seeds scored exactly, the codes' margin on
/// them, then the range's candidates scored exactly. `approx`: every key's approximate score.
fn on_codes(keys: &MemKeys, q: &[f32], scored: QueryScores<'_>, beta: f32) -> SearchStats {
    let mut stats = SearchStats::default();
    let mut seeds = Vec::new();
    keys.score_strided(SEED_STRIDE, keys.len(), q, &mut seeds, &mut stats).unwrap();
    let margin = approx::seed_margin(&seeds, scored.scores, SEED_STRIDE);
    let known = seeds.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Keys in memory: the candidates are not refined first (`approx::RangeRefine`).
    approx::in_range(&scored, known, beta, margin, SEED_STRIDE, &mut approx::Unrefined, |ids| {
        let mut scores = vec![0.0; ids.len()];
        keys.score(ids, q, &mut scores, &mut stats).map(|()| scores)
    })
    .unwrap()
    .expect("every score reaches any cut");
    stats
}

fn measure() -> Vec<(String, u64)> {
    let d = 64;
    let beta = 5.0 * 8.0;
    let mut out = Vec::new();
    for (set, heads) in [("generator", generator()), ("smollm2-prose-4k", smollm2_prose())] {
        for (kv, h) in heads.iter().enumerate() {
            let keys = MemKeys::new(d, h.keys.clone());
            let (graph, _) = build(&keys, &h.prefill, &BuildParams { threads: 2, ..Default::default() });
            let idx = Pair { keys: &keys, graph: &graph };
            let codes = Pq::build(&keys, &PqParams::scan_codes(d)).unwrap();
            let scan = codes.token_scores_many(&h.decode, None).unwrap();
            let (mut walk, mut coded, mut top) =
                (SearchStats::default(), SearchStats::default(), SearchStats::default());
            for (i, q) in h.decode.chunks(d).enumerate() {
                walk += diprs(&idx, q, &DiprsParams { beta, ..Default::default() }).unwrap().stats;
                coded += on_codes(&keys, q, scan.query(i), beta);
                top += topk(&idx, q, 100, 128, None).unwrap().stats;
            }
            out.push((format!("{set}.head{kv}.graph_diprs.hops"), walk.hops));
            out.push((format!("{set}.head{kv}.graph_diprs.keys_scored"), walk.keys_scored));
            out.push((format!("{set}.head{kv}.diprs.keys_scored"), coded.keys_scored));
            out.push((format!("{set}.head{kv}.topk.hops"), top.hops));
            out.push((format!("{set}.head{kv}.topk.keys_scored"), top.keys_scored));
        }
    }
    out
}

#[test]
fn hops_and_keys_scored_do_not_regress() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/baseline.json");
    let now = measure();
    if std::env::var("CTXFS_UPDATE_BASELINE").is_ok() {
        let map: serde_json::Map<String, serde_json::Value> =
            now.iter().map(|(k, v)| (k.clone(), (*v).into())).collect();
        std::fs::write(path, serde_json::to_string_pretty(&map).unwrap() + "\n").unwrap();
        return;
    }
    let base: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("tests/baseline.json")).unwrap();
    for (k, v) in &now {
        let b = base[k].as_u64().unwrap_or_else(|| panic!("baseline has no {k}"));
        println!("{k}: {v} (baseline {b})");
        assert!(*v as f64 <= b as f64 * 1.10, "{k} regressed: {v} against a baseline of {b} (over 10%)");
    }
}
