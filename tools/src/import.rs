//! `ctxfs import`: a safetensors context into the store, with one graph index per (layer,
//! kv head), through `Db::import`. The input is memory-mapped and read one head at a time;
//! its values are checked in one pass before anything is written, and nothing is visible in
//! the store until the single commit at the end.

use crate::progress;
use anyhow::{Context, Result};
use ctxfs_attention::{Db, DbConfig, KvSource, SafetensorsKv};
use ctxfs_vfs::{DType, DeviceChoice};
use serde_json::json;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    store: PathBuf,
    input: PathBuf,
    /// The new context's name.
    #[arg(long)]
    name: String,
    /// Element type stored: f16, or bf16 for magnitudes beyond f16's range.
    #[arg(long, default_value = "f16")]
    dtype: DType,
    /// The model's query heads, for a file without prefill queries (`layers.{l}.q`), which
    /// cannot say; without it such a file is taken as one per kv head.
    #[arg(long)]
    q_heads: Option<usize>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    let block_size = ctxfs_vfs::probe_block_size(&args.store)?;
    let db = Db::open(&args.store, choice, DbConfig::streaming(block_size))?;
    if db.store().snapshot().context(&args.name).is_ok() {
        anyhow::bail!("a context named {:?} already exists", args.name);
    }
    let source = SafetensorsKv::open_with_q_heads(&args.input, args.dtype, args.q_heads)?;
    let check = progress::bar(source.tensor_bytes(), "check input");
    source.check_values(|b| check.inc(b)).with_context(|| format!("{} holds bad values", args.input.display()))?;
    check.finish_and_clear();
    let s = source.shape();
    let n = source.token_count();
    let bar = progress::bar((s.files() * n * s.head_dim as usize * 4) as u64, "import");
    let report = db.import(&args.name, &source, |b| {
        bar.inc(b);
        Ok(())
    })?;
    bar.finish_and_clear();
    let mib = (s.files() * n * s.head_dim as usize * 4) as f64 / (1 << 20) as f64;
    let phases = report.phases_per_head();
    if args.json {
        let v = json!({
            "context": args.name, "tokens": n, "layers": s.layers, "q_heads": s.q_heads, "kv_heads": s.kv_heads,
            "head_dim": s.head_dim, "dtype": s.dtype.name(), "seconds": report.seconds, "mib_per_second": mib / report.seconds,
            "blocks": report.blocks,
            "seconds_per_head": phases_json(&report), "knn_gpu_heads": report.knn_gpu_heads,
        });
        outln!("{v}")?;
    } else {
        outln!(
            "imported {:?}: {}, {} × {} ({}), head dim {}",
            args.name,
            crate::units::count(n as u64, "token"),
            crate::units::count(s.layers, "layer"),
            crate::units::count(s.kv_heads, "kv head"),
            crate::units::count(s.q_heads, "q head"),
            s.head_dim
        )?;
        let phases: Vec<String> = phases.iter().map(|(k, v)| format!("{k} {v:.2}")).collect();
        outln!(
            "{:.1} s, {:.0} MiB/s of KV; seconds per head: {}",
            report.seconds,
            mib / report.seconds,
            phases.join(", ")
        )?;
        if report.knn_gpu_heads > 0 {
            outln!("kNN on the GPU for {} of {} heads", report.knn_gpu_heads, report.heads)?;
        }
    }
    Ok(())
}

/// An import's seconds per head by phase (`WriteReport::phases_per_head`), as JSON.
pub fn phases_json(report: &ctxfs_attention::WriteReport) -> serde_json::Value {
    report.phases_per_head().iter().map(|&(k, v)| (k.to_string(), json!(v))).collect::<serde_json::Map<_, _>>().into()
}
