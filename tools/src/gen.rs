//! `ctxfs gen`: a synthetic context (KV cache, prefill queries, token ids) and a file of
//! held-out decode queries, with the statistics the generator achieved.

use crate::progress;
use crate::st_write::{Dtype, StreamWriter, TensorSpec};
use anyhow::{ensure, Result};
use ctxfs_index::synth::{head, stats, HeadStats, SynthParams};
use half::f16;
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// Output file; the decode queries go to OUT.queries.safetensors beside it.
    pub out: PathBuf,
    /// Tokens of the context.
    #[arg(long)]
    pub tokens: usize,
    /// Layers.
    #[arg(long, default_value_t = 2)]
    pub layers: usize,
    /// Query heads per layer.
    #[arg(long, default_value_t = 8)]
    pub q_heads: usize,
    /// Key-value heads per layer (q heads are grouped over them).
    #[arg(long, default_value_t = 2)]
    pub kv_heads: usize,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Prefill queries per q head (they train the index). Default: tokens / 4, at most 4096.
    #[arg(long)]
    pub queries: Option<usize>,
    /// Held-out decode queries per q head, at consecutive decode steps.
    #[arg(long, default_value_t = 16)]
    pub decode_queries: usize,
    /// Generator seed: the same seed and sizes give the same file.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Replace OUT and its query file when they exist (regular files only).
    #[arg(long)]
    pub force: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    pub json: bool,
}

/// What one generated (layer, kv head) achieved.
pub struct Generated {
    pub layer: usize,
    pub kv_head: usize,
    pub sharpness: f32,
    pub stats: HeadStats,
}

fn f16_bytes(v: &[f16]) -> &[u8] {
    bytemuck::cast_slice(v)
}

pub fn run(a: Args) -> Result<()> {
    let per_head = generate(&a)?;
    report(&a, &per_head)?;
    Ok(())
}

/// Writes the context file and its decode-query file.
pub fn generate(a: &Args) -> Result<Vec<Generated>> {
    ensure!(
        a.tokens > 0 && a.layers > 0 && a.kv_heads > 0 && a.q_heads > 0,
        "tokens, layers, q heads and kv heads must be positive"
    );
    use ctxfs_vfs::format::records::{MAX_HEADS, MAX_HEAD_DIM, MAX_LAYERS};
    ensure!(
        a.layers <= MAX_LAYERS as usize && a.q_heads <= MAX_HEADS as usize,
        "a store holds at most {MAX_LAYERS} layers and {MAX_HEADS} heads"
    );
    let most = MAX_HEAD_DIM as usize;
    ensure!(
        (2..=most).contains(&a.head_dim),
        "--head-dim must be 2..={most}: the generator pairs dimensions, and a store holds at most {most}"
    );
    ensure!(a.decode_queries > 0, "--decode-queries must be at least 1: the statistics printed are measured on them");
    ensure!(
        a.q_heads.is_multiple_of(a.kv_heads),
        "q heads ({}) must be a multiple of kv heads ({})",
        a.q_heads,
        a.kv_heads
    );
    ensure!(a.tokens <= u32::MAX as usize, "at most {} tokens", u32::MAX);
    let group = a.q_heads / a.kv_heads;
    let m = a.queries.unwrap_or((a.tokens / 4).clamp(1, 4096));
    let (d, n) = (a.head_dim, a.tokens);
    let queries_path = a.out.with_extension("queries.safetensors");
    let mut specs = Vec::new();
    for l in 0..a.layers {
        specs.push(TensorSpec { name: format!("layers.{l}.k"), dtype: Dtype::F16, shape: vec![a.kv_heads, n, d] });
        specs.push(TensorSpec { name: format!("layers.{l}.v"), dtype: Dtype::F16, shape: vec![a.kv_heads, n, d] });
        specs.push(TensorSpec { name: format!("layers.{l}.q"), dtype: Dtype::F16, shape: vec![a.q_heads, m, d] });
    }
    specs.push(TensorSpec { name: "tokens".into(), dtype: Dtype::I64, shape: vec![n] });
    let qspecs: Vec<TensorSpec> = (0..a.layers)
        .map(|l| TensorSpec {
            name: format!("layers.{l}.q"),
            dtype: Dtype::F32,
            shape: vec![a.q_heads, a.decode_queries, d],
        })
        .collect();
    let meta = [("generator", "ctxfs gen".to_string()), ("seed", a.seed.to_string())];
    let mut out = StreamWriter::create(&a.out, &specs, &meta, a.force)?;
    let mut qout = StreamWriter::create(&queries_path, &qspecs, &meta, a.force)?;
    let p = SynthParams { tokens: n, head_dim: d, group, seed: a.seed };
    let bar = progress::bar((a.layers * a.kv_heads * n * d * 4) as u64, "generate");
    let mut per_head = Vec::new();
    for l in 0..a.layers {
        let heads: Vec<_> = (0..a.kv_heads).map(|h| head(&p, l, h, m, a.decode_queries)).collect();
        for h in &heads {
            out.write(f16_bytes(&h.keys))?;
        }
        for h in &heads {
            out.write(f16_bytes(&h.values))?;
            bar.inc((n * d * 4) as u64);
        }
        for h in &heads {
            for q in &h.prefill {
                let halves: Vec<f16> = q.iter().map(|&x| f16::from_f32(x)).collect();
                out.write(f16_bytes(&halves))?;
            }
        }
        for h in &heads {
            for q in &h.decode {
                qout.write(bytemuck::cast_slice(q))?;
            }
        }
        for (kv, h) in heads.iter().enumerate() {
            per_head.push(Generated { layer: l, kv_head: kv, sharpness: h.sharpness, stats: stats(h, d) });
        }
    }
    let tokens: Vec<i64> = (0..n as i64).map(|t| (t * 2_654_435_761) % 128_000).collect();
    out.write(bytemuck::cast_slice(&tokens))?;
    StreamWriter::finish_together(vec![out, qout])?;
    bar.finish_and_clear();
    Ok(per_head)
}

fn report(a: &Args, per_head: &[Generated]) -> Result<(), crate::OutputLost> {
    let (n, d, m) = (a.tokens, a.head_dim, a.queries.unwrap_or((a.tokens / 4).clamp(1, 4096)));
    let queries_path = a.out.with_extension("queries.safetensors");
    let ratio: Vec<f64> = per_head.iter().map(|h| h.stats.mahalanobis_ratio).collect();
    let mean_ratio = ratio.iter().sum::<f64>() / ratio.len() as f64;
    if a.json {
        let heads: Vec<_> = per_head
            .iter()
            .map(|h| json!({"layer": h.layer, "kv_head": h.kv_head, "sharpness": h.sharpness, "mahalanobis_ratio": h.stats.mahalanobis_ratio, "tokens_for_90_percent": h.stats.tokens_for_90, "sink_mass": h.stats.sink_mass}))
            .collect();
        outln!(
            "{}",
            json!({"out": a.out, "queries": queries_path, "tokens": n, "mahalanobis_ratio": mean_ratio, "heads": heads})
        )?;
        return Ok(());
    }
    outln!("wrote {} and {}", a.out.display(), queries_path.display())?;
    outln!(
        "{}, {}, {} / {}, head dim {d}; {m} prefill and {} decode queries per q head",
        crate::units::count(n as u64, "token"),
        crate::units::count(a.layers as u64, "layer"),
        crate::units::count(a.q_heads as u64, "q head"),
        crate::units::count(a.kv_heads as u64, "kv head"),
        a.decode_queries
    )?;
    match mean_ratio.is_finite() {
        true => outln!("Mahalanobis distance of queries to the key distribution: {mean_ratio:.1}× that of the keys")?,
        // Too few keys to have a spread to measure the queries' distance in.
        false => outln!("Mahalanobis distance of queries to the key distribution: n/a (too few keys)")?,
    }
    outln!("{:>6} {:>8} {:>10} {:>22} {:>10}", "layer", "kv head", "sharpness", "tokens for 90% mass", "sink mass")?;
    for h in per_head {
        outln!(
            "{:>6} {:>8} {:>10.2} {:>22} {:>9.1}%",
            h.layer,
            h.kv_head,
            h.sharpness,
            h.stats.tokens_for_90,
            h.stats.sink_mass * 100.0
        )?;
    }
    Ok(())
}
