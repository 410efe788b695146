//! `ctxfs bench search`: every search method side by side on generated attention, against
//! exact attention over all tokens. Every method attends the same window (128 + 512 tokens).

use crate::bench::{median, ratio};
use anyhow::{ensure, Result};
use ctxfs_index::search::{diprs, topk};
use ctxfs_index::synth::{head, SynthParams};
use ctxfs_index::Pair;
use ctxfs_index::{build, flat, BuildParams, DiprsParams, MemKeys};
use ctxfs_kernels::Partial;
use half::f16;
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Tokens per head.
    #[arg(long, default_value_t = 131072)]
    tokens: usize,
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// kv heads generated (each with its own sparsity).
    #[arg(long, default_value_t = 2)]
    heads: usize,
    /// Decode queries per q head (4 q heads per kv head).
    #[arg(long, default_value_t = 8)]
    queries: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[arg(long)]
    json: bool,
}

const WINDOW: (usize, usize) = (128, 512);
const GROUP: usize = 4;

#[derive(Default, Clone)]
struct Row {
    name: String,
    recall: Vec<f64>,
    recovery: Vec<f64>,
    error: Vec<f64>,
    exact_dipr_error: Vec<f64>,
    scored: Vec<f64>,
    micros: Vec<f64>,
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn p99(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s.get(((s.len() as f64 * 0.99).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0.0)
}

/// Attention over `ids` (scores `z` in inner-product units), as a partial.
fn attend(ids: &[u32], z: &[f32], values: &[f16], d: usize, scale: f32) -> Partial {
    let rows: Vec<f16> =
        ids.iter().flat_map(|&t| values[t as usize * d..(t as usize + 1) * d].iter().copied()).collect();
    let mut zs: Vec<f32> = z.iter().map(|x| x * scale).collect();
    Partial::from_scores_on(ctxfs_kernels::active(), &mut zs, &rows, d)
}

fn err(o: &[f32], exact: &[f32]) -> f64 {
    let num: f64 = o.iter().zip(exact).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum::<f64>().sqrt();
    num / exact.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt().max(1e-30)
}

pub fn run(a: Args) -> Result<()> {
    ensure!(
        a.tokens > WINDOW.0 + WINDOW.1 && a.heads > 0 && a.queries > 0,
        "--tokens must exceed the 640-token window; --heads and --queries must be positive"
    );
    let (n, d) = (a.tokens, a.head_dim);
    let scale = 1.0 / (d as f32).sqrt();
    let sqrt_d = (d as f32).sqrt();
    let reference_beta = 5.0 * sqrt_d;
    let mut rows: Vec<Row> = Vec::new();
    let mut builds = Vec::new();
    let bar = crate::progress::bar((a.heads * n) as u64, "bench search");
    for kv in 0..a.heads {
        let p = SynthParams { tokens: n, head_dim: d, group: GROUP, seed: a.seed };
        let h = head(&p, 1, kv, (n / 4 / GROUP).clamp(64, 4096), a.queries);
        let keys = MemKeys::new(d, h.keys.clone());
        let started = Instant::now();
        let (graph, report) = build(&keys, &h.prefill.concat(), &BuildParams::default());
        builds.push(json!({
            "kv_head": kv, "sharpness": h.sharpness, "seconds": started.elapsed().as_secs_f64(),
            "knn_seconds": report.knn.as_secs_f64(), "projection_seconds": report.projection.as_secs_f64(),
            "enhancement_seconds": report.enhancement.as_secs_f64(), "training_queries": report.queries,
        }));
        let idx = Pair { keys: &keys, graph: &graph };
        for q in h.decode.concat().chunks(d) {
            let mut all = vec![0.0f32; n];
            ctxfs_kernels::scores(keys.data(), q, 1.0, &mut all);
            let all_ids: Vec<u32> = (0..n as u32).collect();
            let exact = attend(&all_ids, &all, &h.values, d, scale);
            let lse_full = exact.lse() as f64;
            let methods: Vec<(String, f32, Option<u32>)> = vec![
                ("flat".into(), reference_beta, None),
                ("topk k=100".into(), reference_beta, None),
                ("topk k=2000".into(), reference_beta, None),
                ("diprs beta=2·√d".into(), 2.0 * sqrt_d, None),
                ("diprs beta=3·√d".into(), 3.0 * sqrt_d, None),
                ("diprs beta=5·√d".into(), reference_beta, None),
                ("diprs filtered 20%".into(), reference_beta, Some((n / 5) as u32)),
                ("diprs filtered 50%".into(), reference_beta, Some((n / 2) as u32)),
                ("diprs filtered 100%".into(), reference_beta, Some(n as u32)),
            ];
            for (mi, (name, beta, prefix)) in methods.iter().enumerate() {
                let p_len = prefix.map_or(n, |p| p as usize);
                let window =
                    ctxfs_attention::Window { init: WINDOW.0 as u32, recent: WINDOW.1 as u32 }.tokens(p_len as u32);
                let win_set: BTreeSet<u32> = window.iter().copied().collect();
                let win_max = window.iter().map(|&t| all[t as usize]).fold(f32::NEG_INFINITY, f32::max);
                let t = Instant::now();
                let found = match mi {
                    0 => flat::dipr(&keys, q, *beta, win_max, *prefix)?,
                    1 => topk(&idx, q, 100 + window.len(), 128 + window.len(), None)?,
                    2 => topk(&idx, q, 2000 + window.len(), 2000 + window.len(), None)?,
                    _ => diprs(
                        &idx,
                        q,
                        &DiprsParams {
                            beta: *beta,
                            l0: 64,
                            window_max: win_max,
                            prefix: *prefix,
                            ..Default::default()
                        },
                    )?,
                };
                let micros = t.elapsed().as_secs_f64() * 1e6;
                let mut retrieved: Vec<u32> = found.ids.iter().copied().filter(|t| !win_set.contains(t)).collect();
                if mi == 1 {
                    retrieved.truncate(100);
                } else if mi == 2 {
                    retrieved.truncate(2000);
                }
                let selected: Vec<u32> = window.iter().copied().chain(retrieved.iter().copied()).collect();
                let z: Vec<f32> = selected.iter().map(|&t| all[t as usize]).collect();
                let part = attend(&selected, &z, &h.values, d, scale);
                // The reference for this row: over the prefix, exact attention and the exact DIPR set.
                let pz = &all[..p_len];
                let p_ids: Vec<u32> = (0..p_len as u32).collect();
                let exact_p = if p_len == n { exact.clone() } else { attend(&p_ids, pz, &h.values, d, scale) };
                let best = pz.iter().copied().fold(win_max, f32::max);
                let dipr: Vec<u32> = p_ids.iter().copied().filter(|&t| pz[t as usize] >= best - beta).collect();
                let got: BTreeSet<u32> = selected.iter().copied().collect();
                let recall = dipr.iter().filter(|t| got.contains(t)).count() as f64 / dipr.len().max(1) as f64;
                let dipr_sel: Vec<u32> =
                    win_set.iter().copied().chain(dipr.iter().copied().filter(|t| !win_set.contains(t))).collect();
                let dz: Vec<f32> = dipr_sel.iter().map(|&t| all[t as usize]).collect();
                let exact_dipr = attend(&dipr_sel, &dz, &h.values, d, scale);
                let lse_ref = if p_len == n { lse_full } else { exact_p.lse() as f64 };
                if rows.len() <= mi {
                    rows.push(Row { name: name.clone(), ..Default::default() });
                }
                let r = &mut rows[mi];
                r.recall.push(recall);
                r.recovery.push((part.lse() as f64 - lse_ref).exp());
                r.error.push(err(&part.o, &exact_p.o));
                r.exact_dipr_error.push(err(&exact_dipr.o, &exact_p.o));
                r.scored.push(found.stats.keys_scored as f64 / p_len as f64);
                r.micros.push(micros);
            }
        }
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    let flat_lat = median(rows[0].micros.clone());
    let lat = |name: &str| rows.iter().find(|r| r.name == name).map_or(0.0, |r| median(r.micros.clone()));
    let out_rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            json!({
                "method": r.name, "dipr_recall": mean(&r.recall), "recovery": mean(&r.recovery), "output_error": mean(&r.error),
                "exact_dipr_output_error": mean(&r.exact_dipr_error), "keys_scored_fraction": mean(&r.scored),
                "latency_median_us": median(r.micros.clone()), "latency_p99_us": p99(&r.micros),
                "speedup_vs_flat": ratio(flat_lat, median(r.micros.clone())),
            })
        })
        .collect();
    let ratios = json!({
        "diprs_vs_flat_speedup": ratio(flat_lat, lat("diprs beta=5·√d")),
        "filtered20_vs_unfiltered_latency": ratio(lat("diprs filtered 20%"), lat("diprs filtered 100%")),
    });
    if a.json {
        println!(
            "{}",
            json!({"tokens": n, "head_dim": d, "heads": a.heads, "queries_per_head": GROUP * a.queries, "ratios": ratios, "rows": out_rows, "build": builds})
        );
        return Ok(());
    }
    println!(
        "bench search: {n} tokens per head, d={d}, {} kv heads × {} decode queries, window 128+512; β in q·k/√d units",
        a.heads,
        GROUP * a.queries
    );
    println!(
        "{:<22} {:>7} {:>9} {:>9} {:>10} {:>9} {:>10} {:>10} {:>8}",
        "method", "recall", "recovery", "out err", "DIPR err", "scored", "median µs", "p99 µs", "vs flat"
    );
    for r in &out_rows {
        println!(
            "{:<22} {:>7.3} {:>9.3} {:>9.4} {:>10.4} {:>8.2}% {:>10.0} {:>10.0} {:>7.1}×",
            r["method"].as_str().unwrap_or(""),
            r["dipr_recall"].as_f64().unwrap_or(0.0),
            r["recovery"].as_f64().unwrap_or(0.0),
            r["output_error"].as_f64().unwrap_or(0.0),
            r["exact_dipr_output_error"].as_f64().unwrap_or(0.0),
            r["keys_scored_fraction"].as_f64().unwrap_or(0.0) * 100.0,
            r["latency_median_us"].as_f64().unwrap_or(0.0),
            r["latency_p99_us"].as_f64().unwrap_or(0.0),
            r["speedup_vs_flat"].as_f64().unwrap_or(0.0)
        );
    }
    for b in &builds {
        println!(
            "build kv head {}: {:.1} s (kNN {:.1} s, projection {:.2} s, enhancement {:.2} s), {} training queries",
            b["kv_head"],
            b["seconds"].as_f64().unwrap_or(0.0),
            b["knn_seconds"].as_f64().unwrap_or(0.0),
            b["projection_seconds"].as_f64().unwrap_or(0.0),
            b["enhancement_seconds"].as_f64().unwrap_or(0.0),
            b["training_queries"]
        );
    }
    println!(
        "DIPRS (β=5) vs flat: {:.1}× faster; filtered at 20% reuse vs unfiltered latency: {:.2}×",
        ratios["diprs_vs_flat_speedup"].as_f64().unwrap_or(0.0),
        ratios["filtered20_vs_unfiltered_latency"].as_f64().unwrap_or(0.0)
    );
    Ok(())
}
