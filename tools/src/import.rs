//! `ctxfs import`: a safetensors context into the store, with one graph index per (layer,
//! kv head). The input is memory-mapped and read one head at a time; nothing is visible in
//! the store until the single commit at the end.

use crate::progress;
use crate::tensors::{f16s, f32s, shape, tokens};
use anyhow::{bail, ensure, Context, Result};
use ctxfs_index::paged::{index_payloads, row_payloads};
use ctxfs_index::{build, BuildParams, MemKeys};
use ctxfs_vfs::{max_payload, DType, DeviceChoice, FileStream, ModelShape, Store};
use safetensors::SafeTensors;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    store: PathBuf,
    input: PathBuf,
    #[arg(long)]
    name: String,
    /// Element type stored: f16 (bf16 arrives with the attention layer's import).
    #[arg(long, default_value = "f16")]
    dtype: String,
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    ensure!(
        args.dtype == "f16",
        "--dtype {}: this import stores f16 (bf16 storage is not implemented yet)",
        args.dtype
    );
    let store = Store::open_path(&args.store, choice)?;
    if store.snapshot().context(&args.name).is_ok() {
        bail!("a context named {:?} already exists", args.name);
    }
    let file = std::fs::File::open(&args.input).with_context(|| format!("cannot open {}", args.input.display()))?;
    // SAFETY: the file is mapped read-only and not modified while mapped; a concurrent
    // truncation by another process would fault the read, the usual caveat of mapped input.
    let map = unsafe { memmap2::Mmap::map(&file)? };
    let st = SafeTensors::deserialize(&map)
        .with_context(|| format!("{} is not a safetensors file", args.input.display()))?;
    let layers = (0..).take_while(|l| st.tensor(&format!("layers.{l}.k")).is_ok()).count();
    ensure!(layers > 0, "{} has no layers.0.k tensor", args.input.display());
    let k0 = shape(&st, "layers.0.k", &[None, None, None])?;
    let (kv, n, d) = (k0[0], k0[1], k0[2]);
    let q_heads = match st.tensor("layers.0.q") {
        Ok(t) => t.shape().first().copied().unwrap_or(0),
        Err(_) => kv,
    };
    ensure!(q_heads % kv == 0 && q_heads > 0, "{q_heads} q heads are not a multiple of {kv} kv heads");
    let model = ModelShape {
        layers: layers as u16,
        q_heads: q_heads as u16,
        kv_heads: kv as u16,
        head_dim: d as u16,
        dtype: DType::F16,
    };
    model.validate().map_err(anyhow::Error::msg)?;
    for l in 0..layers {
        shape(&st, &format!("layers.{l}.k"), &[Some(kv), Some(n), Some(d)])?;
        shape(&st, &format!("layers.{l}.v"), &[Some(kv), Some(n), Some(d)])?;
        if st.tensor(&format!("layers.{l}.q")).is_ok() {
            shape(&st, &format!("layers.{l}.q"), &[Some(q_heads), None, Some(d)])?;
        }
    }
    let ids = if st.tensor("tokens").is_ok() { tokens(&st, n)? } else { (0..n as u32).collect() };
    let payload = max_payload(store.device().block_size());
    let group = q_heads / kv;
    let bar = progress::bar((layers * kv * n * d * 4) as u64, "import");
    let started = Instant::now();
    let mut txn = store.begin()?;
    txn.create_context(&args.name, model, &ids)?;
    let (mut knn, mut projection, mut enhancement) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for l in 0..layers {
        let qname = format!("layers.{l}.q");
        let m = st.tensor(&qname).map(|t| t.shape()[1]).unwrap_or(0);
        for h in 0..kv {
            let keys = MemKeys::new(d, f16s(&st, &format!("layers.{l}.k"), h * n * d..(h + 1) * n * d)?);
            let values = f16s(&st, &format!("layers.{l}.v"), h * n * d..(h + 1) * n * d)?;
            // GQA: every q head of the group trains the group's one graph. Without prefill
            // queries, the keys themselves train it.
            let train = if m > 0 {
                f32s(&st, &qname, h * group * m * d..(h + 1) * group * m * d)?
            } else {
                keys.data().iter().map(|x| x.to_f32()).collect()
            };
            let (graph, report) = build(&keys, &train, &BuildParams::default());
            knn += report.knn;
            projection += report.projection;
            enhancement += report.enhancement;
            let (_, index) = index_payloads(&keys, &graph, payload);
            for b in &index {
                txn.append_block(&args.name, l as u16, h as u16, FileStream::Index, b)?;
            }
            for b in row_payloads(&values, d, payload) {
                txn.append_block(&args.name, l as u16, h as u16, FileStream::Data, &b)?;
            }
            bar.inc((n * d * 4) as u64);
        }
    }
    txn.commit()?;
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    let heads = layers * kv;
    let mib = (heads * n * d * 4) as f64 / (1 << 20) as f64;
    if args.json {
        let v = json!({
            "context": args.name, "tokens": n, "layers": layers, "q_heads": q_heads, "kv_heads": kv, "head_dim": d,
            "seconds": secs, "mib_per_second": mib / secs,
            "build_seconds_per_head": {"knn": knn.as_secs_f64() / heads as f64, "projection": projection.as_secs_f64() / heads as f64, "enhancement": enhancement.as_secs_f64() / heads as f64},
        });
        println!("{v}");
    } else {
        println!(
            "imported {:?}: {n} tokens, {layers} layers × {kv} kv heads ({q_heads} q heads), head dim {d}",
            args.name
        );
        println!(
            "{:.1} s, {:.0} MiB/s of KV; index build per head: kNN {:.2} s, projection {:.2} s, enhancement {:.2} s",
            secs,
            mib / secs,
            knn.as_secs_f64() / heads as f64,
            projection.as_secs_f64() / heads as f64,
            enhancement.as_secs_f64() / heads as f64
        );
    }
    Ok(())
}
