//! The regression baseline: hops and keys scored by DIPRS and top-k for a fixed seed, checked
//! in as `tests/baseline.json`. A change that makes either grow by more than 10% fails here.
//! After an intended change, rerun with `CTXFS_UPDATE_BASELINE=1` and commit the new file.

use ctxfs_index::search::{diprs, topk};
use ctxfs_index::synth::{head, SynthParams};
use ctxfs_index::Pair;
use ctxfs_index::{build, BuildParams, DiprsParams, MemKeys, SearchStats};

fn measure() -> Vec<(String, u64)> {
    let (n, d) = (8192, 64);
    let p = SynthParams { tokens: n, head_dim: d, group: 2, seed: 2024 };
    let mut out = Vec::new();
    for kv in 0..2 {
        let h = head(&p, 1, kv, 2048, 8);
        let keys = MemKeys::new(d, h.keys.clone());
        let (graph, _) = build(&keys, &h.prefill.concat(), &BuildParams { threads: 2, ..Default::default() });
        let idx = Pair { keys: &keys, graph: &graph };
        let (mut dipr, mut top) = (SearchStats::default(), SearchStats::default());
        for q in h.decode.concat().chunks(d) {
            dipr += diprs(&idx, q, &DiprsParams { beta: 5.0 * 8.0, ..Default::default() }).unwrap().stats;
            top += topk(&idx, q, 100, 128, None).unwrap().stats;
        }
        out.push((format!("head{kv}.diprs.hops"), dipr.hops));
        out.push((format!("head{kv}.diprs.keys_scored"), dipr.keys_scored));
        out.push((format!("head{kv}.topk.hops"), top.hops));
        out.push((format!("head{kv}.topk.keys_scored"), top.keys_scored));
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
