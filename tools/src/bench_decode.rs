//! `ctxfs bench decode`: decode steps of a Llama-3-8B-shaped context (32 q heads, 8 kv
//! heads, d = 128) stored on disk, side by side in one run with exact attention over the same
//! store and with "load the full KV from disk, then attend" (what KV-cache stores such as
//! LMCache do).
//!
//! The buffer pool holds every index block plus a data-block cache (10% of the data blocks by
//! default). Layers not built are extrapolated from the layers measured: layer 0 (a flat scan)
//! once, the others by their mean; `extrapolated_from_layers` says how many were measured.

use crate::bench::median;
use crate::bench::Serving;
use crate::decode_queries::DecodeQueries;
use crate::mkfs::format_store;
use crate::{gen, progress};
use anyhow::{ensure, Result};
use ctxfs_attention::{Attention, AttentionOptions, Db, DbConfig, HeadTiming, Plan, SafetensorsKv};
use ctxfs_kernels::Partial;
use ctxfs_vfs::{DType, DeviceChoice, FileStream, Store};
use half::f16;
use serde_json::json;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// Where the bench store and its generated context live; a store already holding the
    /// same context is reused.
    #[arg(long, default_value = "./ctxfs-bench-decode")]
    dir: PathBuf,
    #[arg(long, default_value_t = 131072)]
    tokens: usize,
    /// Layers built and measured (the model has 32; the rest are extrapolated).
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Decode steps (one query per q head each, at consecutive positions).
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Data-block cache as a share of the data blocks.
    #[arg(long, default_value_t = 0.10)]
    data_cache: f64,
    /// Block size of the bench store, in bytes (a store of another block size is rebuilt).
    #[arg(long, default_value_t = 4096)]
    block_size: usize,
    #[arg(long)]
    json: bool,
}

const MODEL_LAYERS: usize = 32;
const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const NAME: &str = "bench-book";
/// 1/sqrt(head_dim).
const SCALE: f32 = 0.088_388_35;

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    let (n, layers, steps) = (args.tokens, args.layers, args.steps);
    ensure!(n >= 4096 && (1..=MODEL_LAYERS).contains(&layers) && steps > 0, "--tokens ≥ 4096, --layers 1..=32");
    ctxfs_vfs::device::check_block_size(args.block_size).map_err(|e| anyhow::anyhow!("--block-size: {e}"))?;
    std::fs::create_dir_all(&args.dir)?;
    let path = args.dir.join("store.ctxfs");
    let book = args.dir.join("book.safetensors");
    let kv_bytes = (n * layers * KV_HEADS * HEAD_DIM * 2 * 2) as u64;
    let reusable = Store::open_path(&path, choice).ok().is_some_and(|s| {
        s.snapshot().context(NAME).is_ok_and(|c| {
            let sh = c.record().shape;
            c.token_count() == n as u64 && sh.layers as usize == layers && sh.kv_heads as usize == KV_HEADS
        }) && s.device().block_size() == args.block_size
    }) && book.with_extension("queries.safetensors").exists();
    let mut import = None;
    if !reusable {
        format_store(&path, Some(kv_bytes * 3 + (256 << 20)), args.block_size, true, choice)?;
        gen::generate(&gen::Args {
            out: book.clone(),
            tokens: n,
            layers,
            q_heads: Q_HEADS,
            kv_heads: KV_HEADS,
            head_dim: HEAD_DIM,
            queries: Some(512),
            decode_queries: steps,
            seed: 3,
            json: false,
        })?;
        let db = Db::open(&path, choice, DbConfig { pool_bytes: 16 << 20, ..Default::default() })?;
        let source = SafetensorsKv::open(&book, DType::F16)?;
        source.check_values(|_| {})?;
        let bar = progress::bar(kv_bytes, "import");
        import = Some(db.import(NAME, &source, |b| bar.inc(b))?);
        bar.finish_and_clear();
        // The generated file is only needed for its decode queries from here on.
    }

    let serving = Serving::size(&path, choice, args.data_cache)?;
    let (pool_bytes, index_bytes, cache) = (serving.config.pool_bytes, serving.index_bytes, serving.cache_bytes);
    let config = serving.config;
    drop_page_cache(&path);
    // Opening maps the pool's memory (a serving pool), so first reads pay no page faults.
    let t = Instant::now();
    let db = Db::open(&path, choice, config)?;
    let db_open_s = t.elapsed().as_secs_f64();
    let queries = DecodeQueries::read(&book.with_extension("queries.safetensors"), layers, Q_HEADS, HEAD_DIM)?;
    ensure!(queries.steps >= steps, "the query file has {} decode queries per head; --steps {steps}", queries.steps);
    let step_q = |l: usize, s: usize| queries.step(l, s);

    // A serving DB keeps the index resident (read once when the context is first served);
    // sessions then search memory and read value blocks.
    let t = Instant::now();
    let warmed = db.warm(NAME)?;
    let warm_s = t.elapsed().as_secs_f64();
    // ctxfs: session open, then decode steps through the optimizer's plans.
    let t = Instant::now();
    let session = db.open_session(NAME, None)?;
    let open_s = t.elapsed().as_secs_f64();
    let mut layer_secs = vec![Vec::new(); layers];
    // Per layer, per step: the step's time split (see `split_of`).
    let mut layer_split = vec![Vec::new(); layers];
    let (mut ios, mut plans) = (Vec::new(), Vec::new());
    let before = db.pool_stats();
    let disk = crate::disk_stat::Disk::of(&path);
    let mut disk_from = None;
    for s in 0..steps {
        if s == 1 {
            disk_from = disk.as_ref().and_then(|d| d.read());
        }
        let mut io = 0;
        for (l, secs) in layer_secs.iter_mut().enumerate() {
            let t = Instant::now();
            let a = session.attention(l, &step_q(l, s))?;
            let wall = t.elapsed().as_secs_f64();
            secs.push(wall);
            layer_split[l].push(split_of(&a, wall));
            io += a.heads.iter().map(|h| h.stats.blocks_read).sum::<u64>();
            if s == 0 {
                plans.push(a.plan());
            }
        }
        ios.push(io);
    }
    let after = db.pool_stats();
    // The disk's side of the steady steps' reads (the counters are the whole device's).
    let disk_steady = match (&disk, &disk_from) {
        (Some(d), Some(from)) => d.since(from, (steps - 1) as f64),
        _ => serde_json::Value::Null,
    };
    let step = |s: usize| -> f64 { extrapolate(&layer_secs.iter().map(|v| v[s]).collect::<Vec<_>>()) };
    let cold = step(0);
    let steady = median((1..steps).map(step).collect());
    let steady_ios = median(ios[1..].iter().map(|&x| x as f64).collect());
    // The split of the cold step, then the medians of the steady steps'.
    let cold_split = [0, 1, 2, 3].map(|i| extrapolate(&layer_split.iter().map(|v| v[0][i]).collect::<Vec<_>>()));
    let split = [0, 1, 2, 3].map(|i| {
        extrapolate(&layer_split.iter().map(|v| median(v[1..].iter().map(|p| p[i]).collect())).collect::<Vec<_>>())
    });
    let split_json = |[search, values, wait, rest]: [f64; 4]| json!({"search": search, "value_read_and_sum": values, "value_wait": wait, "window_and_merge": rest});

    // Exact attention over the same store (one step, measured layers).
    let full = AttentionOptions { plan: Some(Plan::Full), ..Default::default() };
    let exact_layers: Vec<f64> = (0..layers)
        .map(|l| -> Result<f64> {
            let t = Instant::now();
            session.attention_with(l, &step_q(l, steps - 1), &full)?;
            Ok(t.elapsed().as_secs_f64())
        })
        .collect::<Result<_>>()?;
    let exact_step = exact_layers.iter().sum::<f64>() / layers as f64 * MODEL_LAYERS as f64;
    drop(session);
    let stored = store_on_top(&db, layers, n)?;
    drop(db);

    // Load the full KV from disk, then attend.
    drop_page_cache(&path);
    let (load_s, attend_s) = full_load(&path, choice, layers, &step_q)?;
    let per_layer = |x: f64| x / layers as f64 * MODEL_LAYERS as f64;
    let full_load_step = per_layer(load_s + attend_s);
    // Session open to the first step's output over all 32 layers (the cold step).
    let ttft = open_s + cold;
    let v = json!({
        "tokens": n, "q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "layers_built": layers, "extrapolated_from_layers": layers, "model_layers": MODEL_LAYERS, "steps": steps,
        "decode_step_seconds": steady, "cold_step_seconds": cold,
        "layer_cold_seconds": layer_secs.iter().map(|v| v[0]).collect::<Vec<_>>(),
        "layer_steady_seconds": layer_secs.iter().map(|v| median(v[1..].to_vec())).collect::<Vec<_>>(),
        "ios_per_step": steady_ios, "bytes_per_step": steady_ios * args.block_size as f64, "cold_step_ios": ios[0],
        "hit_ratio": after.hit_ratio_since(&before), "disk_per_steady_step": disk_steady,
        "plans": plans, "pool_bytes": pool_bytes, "index_bytes": index_bytes, "data_cache_bytes": cache,
        "step_split_seconds": split_json(split), "cold_step_split_seconds": split_json(cold_split),
        "db_open_seconds": db_open_s, "index_warm_seconds": warm_s, "index_warm_blocks": warmed.blocks, "index_held_blocks": warmed.held, "index_warm_extrapolated_seconds": per_layer(warm_s),
        "session_open_seconds": open_s, "time_to_first_output_seconds": ttft,
        "exact_step_seconds": exact_step, "full_load_seconds": per_layer(load_s), "full_load_attend_seconds": per_layer(attend_s),
        "store_1k_on_top": {"tokens": stored.tokens, "seconds": stored.seconds, "blocks": stored.blocks, "build_seconds": stored.build_seconds()},
        "import": import.as_ref().map(|r| json!({"seconds": r.seconds, "build_seconds_per_head": r.build_seconds() / r.heads.max(1) as f64})),
        "ratios": {
            "reuse_vs_full_load": full_load_step / ttft,
            "step_vs_exact": exact_step / steady,
            "step_vs_full_load": full_load_step / steady,
        },
    });
    if args.json {
        println!("{v}");
        return Ok(());
    }
    println!(
        "bench decode: {n} tokens, {Q_HEADS} q heads / {KV_HEADS} kv heads, d={HEAD_DIM}; {layers} of {MODEL_LAYERS} layers built, the rest extrapolated"
    );
    println!(
        "buffer pool {} MiB: index {} MiB + data cache {} MiB ({:.0}% of the data blocks)",
        pool_bytes >> 20,
        index_bytes >> 20,
        cache >> 20,
        args.data_cache * 100.0
    );
    println!("{:<44} {:>12}", "32-layer decode step", "seconds");
    println!("{:<44} {:>12.4}", "ctxfs, cold (first step)", cold);
    println!("{:<44} {:>12.4}", "ctxfs, steady state (median)", steady);
    println!("{:<44} {:>12.4}", "exact attention over the same store", exact_step);
    println!("{:<44} {:>12.4}", "load full KV from disk, then attend", full_load_step);
    println!(
        "I/O per steady step: {:.0} blocks ({:.1} MiB), cold step {} blocks; hit ratio {:.3}; plans {}",
        steady_ios,
        steady_ios * args.block_size as f64 / (1 << 20) as f64,
        ios[0],
        v["hit_ratio"].as_f64().unwrap_or(0.0),
        plans.join(", ")
    );
    println!(
        "steady step split (32 layers, median): search {:.4} s, value reads and sums {:.4} s (waiting for reads {:.4} s), window and merge {:.4} s",
        split[0], split[1], split[2], split[3]
    );
    if let Some(d) = disk_steady.as_object() {
        println!(
            "disk {} per steady step ({} layers): {:.0} reads ({:.0} more merged into them), {:.2} ms per read, busy {:.0}% of the time",
            d["device"].as_str().unwrap_or("?"),
            layers,
            d["reads"].as_f64().unwrap_or(0.0),
            d["read_merges"].as_f64().unwrap_or(0.0),
            d["read_latency_ms"].as_f64().unwrap_or(0.0),
            d["busy_fraction"].as_f64().unwrap_or(0.0) * 100.0
        );
    }
    println!(
        "store_session of {} new tokens on top of the {n}-token book: {:.2} s, {} blocks written ({} layers)",
        stored.tokens, stored.seconds, stored.blocks, layers
    );
    println!(
        "DB open (maps the {} MiB pool) {db_open_s:.2} s; index made resident once per DB open: {} of {} blocks held, read in {warm_s:.2} s ({:.2} s for 32 layers)",
        pool_bytes >> 20,
        warmed.held,
        warmed.blocks,
        per_layer(warm_s)
    );
    println!(
        "session open → first output: {:.4} s vs full KV load + attend {:.4} s: {:.1}×",
        ttft,
        full_load_step,
        full_load_step / ttft
    );
    Ok(())
}

/// Stores 1,024 new tokens on top of the whole book as a child context (random vectors stand
/// in for the engine's KV): only they are written and indexed, not the book.
fn store_on_top(db: &Db, layers: usize, n: usize) -> Result<ctxfs_attention::WriteReport> {
    const ADDED: usize = 1024;
    let child = format!("{NAME}+1k");
    if db.store().snapshot().context(&child).is_ok() {
        db.delete(&child)?;
    }
    let mut session = db.open_session(NAME, None)?;
    let mut rng = ctxfs_vfs::SplitMix64::new(17);
    for l in 0..layers {
        let mut gen = |len: usize| (0..len).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect::<Vec<f32>>();
        let (q, k, v) =
            (gen(Q_HEADS * ADDED * HEAD_DIM), gen(KV_HEADS * ADDED * HEAD_DIM), gen(KV_HEADS * ADDED * HEAD_DIM));
        session.update(l, &q, &k, &v)?;
    }
    session.append_tokens(&(0..ADDED as u32).map(|i| 3_000_000 + i).collect::<Vec<_>>());
    let report = db.store_session(&session, &child)?;
    ensure!(report.tokens == ADDED && n > ADDED, "stored {} tokens", report.tokens);
    Ok(report)
}

/// A 32-layer step from the measured layers: layer 0 once, the others by their mean.
fn extrapolate(per_layer: &[f64]) -> f64 {
    match per_layer {
        [] => 0.0,
        [only] => only * MODEL_LAYERS as f64,
        [first, rest @ ..] => first + rest.iter().sum::<f64>() / rest.len() as f64 * (MODEL_LAYERS - 1) as f64,
    }
}

/// A layer's wall time split in the shares its heads' threads spent searching, reading and
/// summing values (of which waiting for the value blocks the prefetch thread was reading),
/// and on the rest (the window's attention, the merge): (search, values, wait, rest) in
/// seconds.
fn split_of(a: &Attention, wall: f64) -> [f64; 4] {
    let sum = |f: fn(&HeadTiming) -> Duration| a.heads.iter().map(|h| f(&h.timing).as_secs_f64()).sum::<f64>();
    let (search, wait, values, total) = (sum(|t| t.search), sum(|t| t.value_wait), sum(|t| t.values), sum(|t| t.total));
    if total <= 0.0 {
        return [0.0, 0.0, 0.0, wall];
    }
    let share = |x: f64| wall * x / total;
    let (s, v) = (share(search), share(values));
    [s, v, share(wait), (wall - s - v).max(0.0)]
}

/// Reads every key and value of the measured layers from the store (sequential reads of the
/// index and data streams, as a KV-cache loader would), then attends one step exactly.
/// Returns (load seconds, attend seconds).
fn full_load(
    path: &std::path::Path,
    choice: DeviceChoice,
    layers: usize,
    step_q: &dyn Fn(usize, usize) -> Vec<f32>,
) -> Result<(f64, f64)> {
    let store = Store::open_path(path, choice)?;
    let snap = store.snapshot();
    let ctx = snap.context(NAME)?;
    let t = Instant::now();
    let mut kv: Vec<(Vec<f16>, Vec<f16>)> = Vec::new();
    for l in 0..layers {
        for h in 0..KV_HEADS {
            let mut both = [Vec::new(), Vec::new()];
            for (i, which) in [FileStream::Index, FileStream::Data].into_iter().enumerate() {
                let s = ctx.stream(l as u16, h as u16, which)?;
                for b in s.read_range(0, s.blocks()) {
                    both[i].extend_from_slice(bytemuck::cast_slice::<u8, f16>(b?.payload()));
                }
            }
            let [index, data] = both;
            // The keys are the index stream's tail (after the meta and adjacency blocks); a
            // loader of a plain KV file reads the same bytes.
            let n = data.len() / HEAD_DIM;
            let keys = index[index.len().saturating_sub(n * HEAD_DIM)..].to_vec();
            kv.push((keys, data));
        }
    }
    let load = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let group = Q_HEADS / KV_HEADS;
    for l in 0..layers {
        let q = step_q(l, 0);
        for h in 0..Q_HEADS {
            let (k, v) = &kv[l * KV_HEADS + h / group];
            let rows = k.len().min(v.len()) / HEAD_DIM * HEAD_DIM;
            std::hint::black_box(Partial::attend(&q[h * HEAD_DIM..(h + 1) * HEAD_DIM], &k[..rows], &v[..rows], SCALE));
        }
    }
    Ok((load, t.elapsed().as_secs_f64()))
}

/// Evicts the store file from the page cache, so "cold" means read from the device (O_DIRECT
/// reads bypass it anyway; buffered readers of the full-load baseline would not).
fn drop_page_cache(path: &std::path::Path) {
    if let Ok(f) = std::fs::File::open(path) {
        use std::os::fd::AsRawFd;
        // SAFETY: fadvise on a valid open descriptor; it only drops clean cached pages.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
}
