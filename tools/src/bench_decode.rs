//! `ctxfs bench decode`: decode steps of a Llama-3-8B-shaped context (32 q heads, 8 kv
//! heads, d = 128) stored on disk, side by side in one run with exact attention over the same
//! store, with exact attention over the KV held in DRAM, and with loading the KV from disk
//! and attending (what KV-cache stores such as LMCache do), each step's DIPR recall and
//! output error measured against exact attention.
//!
//! The loader baseline reads exactly the K+V bytes of the measured layers (f16, from a plain
//! file beside the store) with raw O_DIRECT io_uring at queue depth [`RAW_QUEUE_DEPTH`] of 1 MiB
//! reads, and attends each kv head's GQA group (one batched scan for its 4 q heads) as soon as
//! its bytes arrive, on as many threads as a session uses. Its output is checked against
//! exact attention. ctxfs's time to first output for a context not yet resident counts the
//! DB open, reading the index resident and the first step.
//!
//! The buffer pool holds every index block plus a data-block cache (10% of the data blocks by
//! default). Layers not built are extrapolated from the layers measured: layer 0 (a flat scan)
//! once, the others by their mean; `extrapolated_from_layers` says how many were measured.
//! The baselines (the loader, exact attention over DRAM and over the store) and the quality
//! replay run on the first [`BASELINE_LAYERS`] layers at most and are extrapolated the same
//! way, so that `--layers 32` (a whole model's context, served under a resident budget)
//! needs neither its KV in DRAM nor a second copy of it on disk.

use crate::bench::median;
use crate::bench::Serving;
use crate::decode_queries::DecodeQueries;
use crate::raw_uring::RawFile;
use crate::{gen, progress};
use anyhow::{ensure, Result};
use ctxfs_attention::{Attention, AttentionOptions, Db, DbConfig, HeadTiming, KvSource, Plan, SafetensorsKv};
use ctxfs_kernels::Partial;
use ctxfs_vfs::device::AlignedBuf;
use ctxfs_vfs::mkfs::format_path;
use ctxfs_vfs::{DType, DeviceChoice, Store};
use half::f16;
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Args)]
pub struct Args {
    /// Where the bench store and its generated context live; a store already holding the
    /// same context is reused.
    #[arg(long, default_value = "./ctxfs-bench-decode")]
    dir: PathBuf,
    /// Tokens of the generated context.
    #[arg(long, default_value_t = 131072)]
    tokens: usize,
    /// Layers built and measured (the model has 32; the rest are extrapolated). The baselines
    /// and the quality replay take the first two.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Decode steps (one query per q head each, at consecutive positions; the first is the
    /// cold one, the others the steady steps, so at least 2).
    #[arg(long, default_value_t = 16, value_parser = crate::values::at_least::<2>)]
    steps: usize,
    /// Data-block cache as a share of the data blocks.
    #[arg(long, default_value_t = 0.10)]
    data_cache: f64,
    /// Block size of the bench store, in bytes (a store of another block size is rebuilt).
    #[arg(long, default_value_t = 4096, value_parser = crate::values::block_size)]
    block_size: usize,
    /// Serve under a resident budget (`DbConfig::resident_budget`, e.g. 0.125): the context
    /// is served compact from its PQ codes, and the pool holds the budget plus the data cache's
    /// share of the index and data streams, half of it caching the key blocks read on demand
    /// and half the value blocks.
    #[arg(long, value_name = "F")]
    resident_budget: Option<f64>,
    /// Time the decode steps and the first output only, without the baselines (exact
    /// attention over the store and over DRAM, the quality replay, the loader, the store on
    /// top): at 1M tokens on 2 cores those take minutes, the steps seconds.
    #[arg(long)]
    steps_only: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

const MODEL_LAYERS: usize = 32;
/// Layers the baselines and the quality replay measure at most.
const BASELINE_LAYERS: usize = 2;
const Q_HEADS: usize = 32;
const KV_HEADS: usize = 8;
const HEAD_DIM: usize = 128;
const NAME: &str = "bench-book";
/// Reads the loader baseline keeps in flight, of 1 MiB each: enough to stream the device.
const RAW_QUEUE_DEPTH: usize = 32;
const RAW_OP: usize = 1 << 20;
/// 1/sqrt(head_dim).
const SCALE: f32 = 0.088_388_35;

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    let (n, layers, steps) = (args.tokens, args.layers, args.steps);
    ensure!(n >= 4096 && (1..=MODEL_LAYERS).contains(&layers), "--tokens ≥ 4096, --layers 1..=32");
    std::fs::create_dir_all(&args.dir)?;
    let path = args.dir.join("store.ctxfs");
    let book = args.dir.join("book.safetensors");
    let kv_bytes = (n * layers * KV_HEADS * HEAD_DIM * 2 * 2) as u64;
    let reusable = Store::open_path_read_only(&path, choice).ok().is_some_and(|s| {
        s.snapshot().context(NAME).is_ok_and(|c| {
            let sh = c.record().shape;
            c.token_count() == n as u64 && sh.layers as usize == layers && sh.kv_heads as usize == KV_HEADS
        }) && s.device().block_size() == args.block_size
    }) && DecodeQueries::read(&book.with_extension("queries.safetensors"), layers, Q_HEADS, HEAD_DIM)
        .is_ok_and(|q| q.steps >= steps);
    let mut import = None;
    if !reusable {
        format_path(&path, Some(kv_bytes * 3 + (256 << 20)), args.block_size, true, choice)?;
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
            force: true,
            json: false,
        })?;
        let db = Db::open(&path, choice, DbConfig::streaming(ctxfs_vfs::probe_block_size(&path)?))?;
        let source = SafetensorsKv::open(&book, DType::F16)?;
        source.check_values(|_| {})?;
        let bar = progress::bar(kv_bytes, "import");
        crate::bench::reset_peak_rss();
        import = Some((
            db.import(NAME, &source, |b| {
                bar.inc(b);
                Ok(())
            })?,
            crate::bench::peak_rss_bytes(),
        ));
        bar.finish_and_clear();
        // The generated file is only needed for its decode queries from here on.
    }

    let serving = match args.resident_budget {
        None => Serving::size(&path, choice, args.data_cache)?,
        Some(budget) => Serving::compact(&path, choice, args.data_cache, budget, kv_bytes)?,
    };
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
    let footprint = db.footprint(NAME)?;
    // ctxfs: session open, then decode steps through the optimizer's plans.
    let t = Instant::now();
    let session = db.open_session(NAME, None)?;
    let open_s = t.elapsed().as_secs_f64();
    let mut layer_secs = vec![Vec::new(); layers];
    // Per layer, per step: the process's CPU time over it (every thread's).
    let mut layer_cpu = vec![Vec::new(); layers];
    // Per layer, per step: the step's time split (see `split_of`).
    let mut layer_split = vec![Vec::new(); layers];
    let (mut ios, mut plans) = (Vec::new(), Vec::new());
    let before = db.pool_stats();
    let disk = crate::disk_stat::Disk::of(&path);
    let (mut disk_from, mut steady_from) = (None, None);
    for s in 0..steps {
        if s == 1 {
            disk_from = disk.as_ref().and_then(|d| d.read());
            steady_from = Some(db.pool_stats());
        }
        let mut io = 0;
        for (l, secs) in layer_secs.iter_mut().enumerate() {
            let (t, cpu) = (Instant::now(), crate::bench::process_cpu_seconds());
            let a = session.attention(l, &step_q(l, s))?;
            let wall = t.elapsed().as_secs_f64();
            secs.push(wall);
            layer_cpu[l].push(crate::bench::process_cpu_seconds() - cpu);
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
    // Step `s` of 32 layers, from the times of the first `of` layers.
    let step_from =
        |of: usize, s: usize| -> f64 { extrapolate(&layer_secs[..of].iter().map(|v| v[s]).collect::<Vec<_>>()) };
    let cold = step_from(layers, 0);
    let steady = median((1..steps).map(|s| step_from(layers, s)).collect());
    // The steady step's CPU time, extrapolated as its time is; over the threads it ran on, the
    // step it would take without any wait on the disk.
    let steady_cpu =
        median((1..steps).map(|s| extrapolate(&layer_cpu.iter().map(|v| v[s]).collect::<Vec<_>>())).collect());
    let cpu_bound = steady_cpu / attention_threads() as f64;
    // With more layers built than the baselines take: the step as their layers alone would
    // extrapolate it, beside the one measured.
    let base = layers.min(BASELINE_LAYERS);
    let steady_from_base = (layers > base).then(|| median((1..steps).map(|s| step_from(base, s)).collect()));
    let steady_ios = median(ios[1..].iter().map(|&x| x as f64).collect());
    let pool_steady = steady_from.map_or(serde_json::Value::Null, |from| pool_reads(&from, &after, steps - 1));
    // The split of the cold step, then the medians of the steady steps'.
    let cold_split = [0, 1, 2, 3].map(|i| extrapolate(&layer_split.iter().map(|v| v[0][i]).collect::<Vec<_>>()));
    let split = [0, 1, 2, 3].map(|i| {
        extrapolate(&layer_split.iter().map(|v| median(v[1..].iter().map(|p| p[i]).collect())).collect::<Vec<_>>())
    });
    let split_json = |[search, values, wait, rest]: [f64; 4]| json!({"search": search, "value_read_and_sum": values, "value_wait": wait, "window_and_merge": rest});

    let gpu_codes = db.gpu_codes_bytes();
    let gpu_status = db.gpu_status().to_string();
    let per_layer = |x: f64| x / layers as f64 * MODEL_LAYERS as f64;
    let per_base_layer = |x: f64| x / base as f64 * MODEL_LAYERS as f64;
    // On the baselines' layers: exact attention over the same store (one step), the quality
    // replay, the loader and exact attention over DRAM.
    let baselines = if args.steps_only {
        None
    } else {
        let full = AttentionOptions { plan: Some(Plan::Full), ..Default::default() };
        let exact_layers: Vec<f64> = (0..base)
            .map(|l| -> Result<f64> {
                let t = Instant::now();
                session.attention_with(l, &step_q(l, steps - 1), &full)?;
                Ok(t.elapsed().as_secs_f64())
            })
            .collect::<Result<_>>()?;
        drop(session);
        let quality = quality(&db, base, steps, &step_q)?;
        let stored = store_on_top(&db, layers, n)?;
        drop(db);

        // The loader baseline: the K+V bytes from disk, attended as they arrive.
        let raw = RawKv::write(&args.dir, &book, base, n, !reusable)?;
        drop_page_cache(&raw.path);
        let loaded = raw.load_and_attend(base, n, &|l| step_q(l, 0))?;
        let loader_error =
            loaded.outputs.iter().zip(&quality.exact_first_step).map(|(o, want)| rel_err(o, want)).fold(0.0, f64::max);
        ensure!(loader_error <= 1e-3, "the loader baseline's output is {loader_error:.2e} from exact attention");
        // Exact attention over the KV held in DRAM, as a server that keeps it resident does.
        let t = Instant::now();
        std::hint::black_box(loaded.attend(base, n, &|l| step_q(l, steps - 1)));
        let dram_layers = t.elapsed().as_secs_f64();
        Some(Baselines {
            exact_step: extrapolate(&exact_layers),
            dram_step: per_base_layer(dram_layers),
            quality,
            stored,
            raw_first_output: per_base_layer(loaded.seconds),
            raw_kv_bytes: raw.kv_bytes(base, n),
            loader_error,
        })
    };
    // First output of a context not yet resident: open the DB, read its index resident, open
    // a session and run the first step; of one already resident: the session and the step.
    let first_output = db_open_s + per_layer(warm_s) + open_s + cold;
    let resident_first_output = open_s + cold;
    let mut v = json!({
        "tokens": n, "q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "layers_built": layers, "extrapolated_from_layers": layers, "model_layers": MODEL_LAYERS, "steps": steps,
        "decode_step_seconds": steady, "cold_step_seconds": cold,
        "layer_cold_seconds": layer_secs.iter().map(|v| v[0]).collect::<Vec<_>>(),
        "layer_steady_seconds": layer_secs.iter().map(|v| median(v[1..].to_vec())).collect::<Vec<_>>(),
        "ios_per_step": steady_ios, "bytes_per_step": steady_ios * args.block_size as f64, "cold_step_ios": ios[0],
        "hit_ratio": after.hit_ratio_since(&before), "disk_per_steady_step": disk_steady,
        "pool_reads_per_steady_step": pool_steady,
        "plans": plans, "pool_bytes": pool_bytes, "index_bytes": index_bytes, "data_cache_bytes": cache,
        "step_split_seconds": split_json(split), "cold_step_split_seconds": split_json(cold_split),
        "db_open_seconds": db_open_s, "index_warm_seconds": warm_s, "index_warm_blocks": warmed.blocks, "index_held_blocks": warmed.held, "index_warm_extrapolated_seconds": per_layer(warm_s),
        "session_open_seconds": open_s,
        "time_to_first_output_seconds": first_output, "resident_time_to_first_output_seconds": resident_first_output,
    });
    // Beside the object above: one more field there exceeds json!'s recursion limit.
    v["footprint"] = footprint.to_json();
    v["resident_bytes"] = json!(warmed.resident_bytes);
    v["resident_over_kv"] = json!(warmed.resident_over_kv());
    v["compact"] = json!(warmed.compact);
    // Where the codes' scans ran: the codes the GPU holds (none: every scan on a core).
    v["gpu_codes"] = json!(gpu_codes.map(|(held, budget)| json!({"held_bytes": held, "budget_bytes": budget})));
    // Null with --steps-only.
    let b = baselines.as_ref();
    v["quality"] = json!(b.map(|b| {
        let q = &b.quality;
        json!({
            "dipr_recall": q.recall, "output_error": q.error, "exact_dipr_output_error": q.exact_dipr_error,
            "recovery": q.recovery, "heads_measured": q.heads, "keys_scored_fraction": q.keys_scored_fraction,
        })
    }));
    v["exact_step_seconds"] = json!(b.map(|b| b.exact_step));
    v["dram_exact_step_seconds"] = json!(b.map(|b| b.dram_step));
    v["raw_load"] = json!(b.map(|b| json!({
        "seconds": b.raw_first_output, "kv_bytes": b.raw_kv_bytes, "extrapolated_from_layers": base,
        "queue_depth": RAW_QUEUE_DEPTH, "op_bytes": RAW_OP, "threads": attention_threads(),
        "output_error_vs_exact": b.loader_error,
    })));
    v["store_1k_on_top"] = json!(b.map(|b| json!({
        "tokens": b.stored.tokens, "seconds": b.stored.seconds, "blocks": b.stored.blocks,
        "build_seconds": b.stored.build_seconds(),
    })));
    v["ratios"] = json!(b.map(|b| json!({
        "first_output_vs_raw_load": b.raw_first_output / first_output,
        "resident_first_output_vs_dram_exact": b.dram_step / resident_first_output,
        "step_vs_dram_exact": b.dram_step / steady,
        "step_vs_exact": b.exact_step / steady,
    })));
    v["peak_rss_bytes"] = json!(crate::bench::peak_rss_bytes());
    v["baseline_layers"] = json!(base);
    v["decode_step_seconds_from_baseline_layers"] = json!(steady_from_base);
    v["step_cpu"] = json!({"seconds": steady_cpu, "threads": attention_threads(), "bound_seconds": cpu_bound});
    v["import"] = json!(import.as_ref().map(|(r, peak)| json!({
        "seconds": r.seconds, "build_seconds_per_head": r.build_seconds() / r.heads.max(1) as f64, "peak_rss_bytes": peak,
        "seconds_per_head": crate::import::phases_json(r), "knn_gpu_heads": r.knn_gpu_heads,
    })));
    if args.json {
        outln!("{v}")?;
        return Ok(());
    }
    let built = if layers == MODEL_LAYERS {
        format!("all {layers} layers built; baselines and quality on {base}, extrapolated")
    } else {
        format!("{layers} of {MODEL_LAYERS} layers built, the rest extrapolated")
    };
    outln!("bench decode: {n} tokens, {Q_HEADS} q heads / {KV_HEADS} kv heads, d={HEAD_DIM}; {built}")?;
    let share = match args.resident_budget {
        None => format!("{:.0}% of the data blocks", args.data_cache * 100.0),
        Some(_) => format!("as much again caches key blocks: {:.0}% of both streams", args.data_cache * 100.0),
    };
    outln!(
        "buffer pool {} MiB: index {} MiB + data cache {} MiB ({share})",
        pool_bytes >> 20,
        index_bytes >> 20,
        cache >> 20
    )?;
    if let Some((r, peak)) = &import {
        outln!(
            "import: {:.1} s, graph and coarse builds {:.2} s per head; peak resident memory {}",
            r.seconds,
            r.build_seconds() / r.heads.max(1) as f64,
            peak.map_or("unknown".to_string(), |b| format!("{} MiB", b >> 20))
        )?;
    }
    out!("{}", crate::inspect::footprint_text(NAME, &footprint))?;
    outln!(
        "held resident: resident_bytes / kv_bytes = {:.3}{}, block maps included",
        warmed.resident_over_kv(),
        if warmed.compact { " (served compact: meta, seeds and PQ codes)" } else { "" }
    )?;
    if let Some((held, _)) = gpu_codes.filter(|c| c.0 > 0) {
        outln!("the codes' scans ran on the GPU ({gpu_status}), which holds {} MiB of them", held >> 20)?;
    }
    outln!("{:<44} {:>12}", "32-layer decode step", "seconds")?;
    outln!("{:<44} {:>12.4}", "ctxfs, cold (first step)", cold)?;
    outln!("{:<44} {:>12.4}", "ctxfs, steady state (median)", steady)?;
    if let Some(from_base) = steady_from_base {
        outln!(
            "{:<44} {:>12.4}",
            format!("  the same extrapolated from {}", crate::units::count(base as u64, "layer")),
            from_base
        )?;
    }
    outln!(
        "{:<44} {:>12.4}",
        format!("  its CPU time ÷ {} (no wait on the disk)", crate::units::count(attention_threads() as u64, "thread")),
        cpu_bound
    )?;
    if let Some(b) = &baselines {
        outln!("{:<44} {:>12.4}", "exact attention over the same store", b.exact_step)?;
        outln!("{:<44} {:>12.4}", "exact attention over the KV in DRAM", b.dram_step)?;
        let q = &b.quality;
        outln!(
            "quality of the steps timed: DIPR recall {:.3}, output error {:.4} (the exact DIPR set's {:.4}), recovery {:.3}, keys scored {:.2}%",
            q.recall,
            q.error,
            q.exact_dipr_error,
            q.recovery,
            q.keys_scored_fraction * 100.0
        )?;
    }
    outln!(
        "I/O per steady step: {:.0} blocks ({:.1} MiB), cold step {} blocks; hit ratio {:.3}; plans {}",
        steady_ios,
        steady_ios * args.block_size as f64 / (1 << 20) as f64,
        ios[0],
        v["hit_ratio"].as_f64().unwrap_or(0.0),
        plans.join(", ")
    )?;
    outln!(
        "steady step split (32 layers, median): search {:.4} s, value reads and sums {:.4} s (waiting for reads {:.4} s), window and merge {:.4} s",
        split[0], split[1], split[2], split[3]
    )?;
    if let Some(p) = pool_steady.as_object() {
        let (reads, first) = (&p["reads"], &p["first_reads"]);
        outln!(
            "pool reads per steady step: {:.0} index blocks ({:.0} never read before), {:.0} data blocks ({:.0} never read before)",
            reads["index"].as_f64().unwrap_or(0.0),
            first["index"].as_f64().unwrap_or(0.0),
            reads["data"].as_f64().unwrap_or(0.0),
            first["data"].as_f64().unwrap_or(0.0),
        )?;
    }
    if let Some(d) = disk_steady.as_object() {
        outln!(
            "disk {} per steady step ({} layers): {:.0} reads ({:.0} more merged into them), {:.2} ms per read, busy {:.0}% of the time",
            d["device"].as_str().unwrap_or("?"),
            layers,
            d["reads"].as_f64().unwrap_or(0.0),
            d["read_merges"].as_f64().unwrap_or(0.0),
            d["read_latency_ms"].as_f64().unwrap_or(0.0),
            d["busy_fraction"].as_f64().unwrap_or(0.0) * 100.0
        )?;
    }
    if let Some(b) = &baselines {
        outln!(
            "store_session of {} new tokens on top of the {n}-token book: {:.2} s, {} blocks written ({} layers)",
            b.stored.tokens,
            b.stored.seconds,
            b.stored.blocks,
            layers
        )?;
    }
    outln!(
        "DB open (maps the {} MiB pool) {db_open_s:.2} s; index made resident once per DB open: {} of {} blocks held, read in {warm_s:.2} s ({:.2} s for 32 layers)",
        pool_bytes >> 20,
        warmed.held,
        warmed.blocks,
        per_layer(warm_s)
    )?;
    match &baselines {
        Some(b) => {
            outln!(
                "first output, context not resident (DB open + index read + session + first step): {first_output:.3} s; raw O_DIRECT load of the {:.2} GB of K+V, attended as it arrives: {:.3} s: {:.2}×",
                per_base_layer(b.raw_kv_bytes as f64) / 1e9,
                b.raw_first_output,
                b.raw_first_output / first_output
            )?;
            outln!(
                "first output, context resident (session + first step): {resident_first_output:.4} s; exact attention over the KV in DRAM: {:.4} s per step: {:.2}×",
                b.dram_step,
                b.dram_step / resident_first_output
            )?;
        }
        None => outln!(
            "first output, context not resident (DB open + index read + session + first step): {first_output:.3} s; resident (session + first step): {resident_first_output:.4} s"
        )?,
    }
    Ok(())
}

/// What the steps are measured against, on the baselines' layers, 32-layer steps
/// extrapolated from them.
struct Baselines {
    /// Exact attention over the same store, one step.
    exact_step: f64,
    /// Exact attention over the KV held in DRAM, one step.
    dram_step: f64,
    quality: Quality,
    stored: ctxfs_attention::WriteReport,
    /// The loader's first output: the K+V read with raw O_DIRECT and attended as it arrives.
    raw_first_output: f64,
    /// The K+V bytes the loader read (the baselines' layers).
    raw_kv_bytes: u64,
    /// The loader's first output against exact attention's (relative, the worst layer).
    loader_error: f64,
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

/// Threads a session attends on: one per core, at most one per kv head.
fn attention_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, KV_HEADS)
}

/// Exact attention of a GQA group's queries `qs` over `n` keys and values: one batched scan
/// of the keys for all of them, then each query's softmax-weighted sum.
fn gqa_attend(keys: &[f16], values: &[f16], qs: &[f32], n: usize) -> Vec<Vec<f32>> {
    let m = qs.len() / HEAD_DIM;
    let mut z = vec![0.0f32; m * n];
    ctxfs_kernels::scores_many(keys, qs, HEAD_DIM, &mut z, n);
    z.chunks_exact_mut(n)
        .map(|zs| {
            zs.iter_mut().for_each(|x| *x *= SCALE);
            Partial::from_scores_on(ctxfs_kernels::active(), zs, values, HEAD_DIM).o
        })
        .collect()
}

/// The loader baseline's file: per measured layer and kv head, the keys then the values in
/// f16, each padded to 4 KiB: the bytes a KV-cache store keeps of a context.
struct RawKv {
    path: PathBuf,
    /// Bytes of one head's keys (or values), padded.
    part: usize,
}

/// What the loader baseline read and answered: each (layer, kv head)'s keys and values, and
/// the first step's output per layer (all q heads).
struct Loaded {
    seconds: f64,
    chunks: Vec<AlignedBuf>,
    outputs: Vec<Vec<f32>>,
}

impl RawKv {
    /// Writes the file from the generated book unless it is there at the right size and the
    /// book was reused.
    fn write(dir: &std::path::Path, book: &std::path::Path, layers: usize, n: usize, fresh: bool) -> Result<RawKv> {
        let part = (n * HEAD_DIM * 2).next_multiple_of(4096);
        let raw = RawKv { path: dir.join("kv.raw"), part };
        let len = (layers * KV_HEADS * 2 * part) as u64;
        if !fresh && std::fs::metadata(&raw.path).is_ok_and(|m| m.len() == len) {
            return Ok(raw);
        }
        let source = SafetensorsKv::open(book, DType::F16)?;
        let mut out = std::io::BufWriter::new(std::fs::File::create(&raw.path)?);
        for l in 0..layers {
            for h in 0..KV_HEADS {
                for rows in [source.keys(l, h)?, source.values(l, h)?] {
                    let mut bytes: Vec<u8> =
                        rows.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes()).collect::<Vec<u8>>();
                    bytes.resize(part, 0);
                    out.write_all(&bytes)?;
                }
            }
        }
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        Ok(raw)
    }

    /// K+V bytes of `layers` layers, without the padding.
    fn kv_bytes(&self, layers: usize, n: usize) -> u64 {
        (layers * KV_HEADS * 2 * n * HEAD_DIM * 2) as u64
    }

    /// Reads every (layer, kv head) in order with raw O_DIRECT io_uring on one thread and
    /// attends each group as soon as its bytes are in, on [`attention_threads`] threads.
    fn load_and_attend(&self, layers: usize, n: usize, q: &(dyn Fn(usize) -> Vec<f32> + Sync)) -> Result<Loaded> {
        let heads = layers * KV_HEADS;
        let group = Q_HEADS / KV_HEADS;
        let started = Instant::now();
        let (tx, rx) = std::sync::mpsc::channel::<(usize, AlignedBuf)>();
        let rx = std::sync::Mutex::new(rx);
        let answers = std::sync::Mutex::new(Vec::new());
        let read = std::thread::scope(|scope| -> Result<()> {
            let reader = scope.spawn(move || -> Result<()> {
                let mut file = RawFile::open(&self.path)?;
                for c in 0..heads {
                    let mut buf = AlignedBuf::zeroed(2 * self.part);
                    file.read_at((c * 2 * self.part) as u64, &mut buf, RAW_OP, RAW_QUEUE_DEPTH)?;
                    if tx.send((c, buf)).is_err() {
                        break;
                    }
                }
                Ok(())
            });
            for _ in 0..attention_threads() {
                scope.spawn(|| loop {
                    let Ok((c, buf)) = rx.lock().unwrap_or_else(|p| p.into_inner()).recv() else { break };
                    let (l, h) = (c / KV_HEADS, c % KV_HEADS);
                    let qs = q(l)[h * group * HEAD_DIM..(h + 1) * group * HEAD_DIM].to_vec();
                    let (keys, values) = Self::split(&buf, self.part, n);
                    let out = gqa_attend(keys, values, &qs, n);
                    answers.lock().unwrap_or_else(|p| p.into_inner()).push((c, out, buf));
                });
            }
            reader.join().map_err(|_| anyhow::anyhow!("the loader thread panicked"))?
        });
        read?;
        let seconds = started.elapsed().as_secs_f64();
        let mut answers = answers.into_inner().unwrap_or_else(|p| p.into_inner());
        ensure!(answers.len() == heads, "the loader answered {} of {heads} heads", answers.len());
        answers.sort_by_key(|a| a.0);
        let mut outputs = vec![Vec::new(); layers];
        let mut chunks = Vec::new();
        for (c, out, buf) in answers {
            outputs[c / KV_HEADS].extend(out.into_iter().flatten());
            chunks.push(buf);
        }
        Ok(Loaded { seconds, chunks, outputs })
    }

    /// A chunk's keys and values.
    fn split(buf: &[u8], part: usize, n: usize) -> (&[f16], &[f16]) {
        let rows = n * HEAD_DIM * 2;
        (bytemuck::cast_slice(&buf[..rows]), bytemuck::cast_slice(&buf[part..part + rows]))
    }
}

impl Loaded {
    /// Exact attention of one step over the loaded KV, the kv heads shared out over the
    /// session's threads.
    fn attend(&self, layers: usize, n: usize, q: &(dyn Fn(usize) -> Vec<f32> + Sync)) -> Vec<Vec<f32>> {
        let group = Q_HEADS / KV_HEADS;
        let part = self.chunks.first().map_or(0, |c| c.len() / 2);
        let qs: Vec<Vec<f32>> = (0..layers).map(q).collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        let outs = std::sync::Mutex::new(vec![Vec::new(); layers * KV_HEADS]);
        std::thread::scope(|scope| {
            for _ in 0..attention_threads() {
                scope.spawn(|| loop {
                    let c = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if c >= layers * KV_HEADS {
                        break;
                    }
                    let (l, h) = (c / KV_HEADS, c % KV_HEADS);
                    let (keys, values) = RawKv::split(&self.chunks[c], part, n);
                    let out = gqa_attend(keys, values, &qs[l][h * group * HEAD_DIM..(h + 1) * group * HEAD_DIM], n);
                    outs.lock().unwrap_or_else(|p| p.into_inner())[c] = out.into_iter().flatten().collect();
                });
            }
        });
        outs.into_inner().unwrap_or_else(|p| p.into_inner())
    }
}

/// The pool's block reads per step over `steps` steps, from `from` to `to`, per class: all
/// of them, and those of blocks it read for the first time (reads no cache would save).
fn pool_reads(from: &ctxfs_buffer::PoolStats, to: &ctxfs_buffer::PoolStats, steps: usize) -> serde_json::Value {
    let per = |a: u64, b: u64| (b - a) as f64 / steps.max(1) as f64;
    json!({
        "reads": {"index": per(from.index.misses, to.index.misses), "data": per(from.data.misses, to.data.misses)},
        "first_reads": {
            "index": per(from.index.first_reads, to.index.first_reads),
            "data": per(from.data.first_reads, to.data.first_reads),
        },
    })
}

/// Quality of the timed steps, replayed on a fresh session with the same plans: each q
/// head's DIPR recall (its retrieved tokens against the exact DIPR set's at β = √d·ln 100,
/// outside the window and without the tail estimate's seeds), output error against exact
/// attention, and the exact DIPR set's own error; and exact attention's output of the first
/// step per layer.
#[derive(Default)]
struct Quality {
    recall: f64,
    error: f64,
    exact_dipr_error: f64,
    recovery: f64,
    keys_scored_fraction: f64,
    heads: usize,
    exact_first_step: Vec<Vec<f32>>,
}

fn quality(db: &Db, layers: usize, steps: usize, step_q: &dyn Fn(usize, usize) -> Vec<f32>) -> Result<Quality> {
    let auto = AttentionOptions { detail: true, ..Default::default() };
    let exact_dipr = crate::bench::exact_dipr_reference(HEAD_DIM, &auto);
    let full = AttentionOptions { plan: Some(Plan::Full), ..Default::default() };
    let replay = db.open_session(NAME, None)?;
    let window: std::collections::BTreeSet<u32> = replay.window_tokens().iter().copied().collect();
    let n = replay.prefix_tokens() as f64;
    let mut q = Quality::default();
    for s in 0..steps {
        for l in 0..layers {
            let qv = step_q(l, s);
            let got = replay.attention_with(l, &qv, &auto)?;
            let truth = replay.attention_with(l, &qv, &full)?;
            let dipr = replay.attention_with(l, &qv, &exact_dipr)?;
            for (h, r) in got.heads.iter().enumerate() {
                let retrieved = |ids: &[u32]| -> std::collections::BTreeSet<u32> {
                    ids.iter().copied().filter(|t| !window.contains(t)).collect()
                };
                let want = retrieved(&dipr.heads[h].selected);
                let mut have = retrieved(&r.selected);
                r.tail.iter().for_each(|t| _ = have.remove(t));
                q.recall +=
                    if want.is_empty() { 1.0 } else { want.intersection(&have).count() as f64 / want.len() as f64 };
                let span = h * HEAD_DIM..(h + 1) * HEAD_DIM;
                q.error += rel_err(&got.output[span.clone()], &truth.output[span.clone()]);
                q.exact_dipr_error += rel_err(&dipr.output[span.clone()], &truth.output[span]);
                q.recovery += ((r.lse - truth.heads[h].lse) as f64).exp();
                q.keys_scored_fraction += r.stats.keys_scored as f64 / n;
                q.heads += 1;
            }
            if s == 0 {
                q.exact_first_step.push(truth.output);
            }
        }
    }
    let heads = q.heads.max(1) as f64;
    for x in [&mut q.recall, &mut q.error, &mut q.exact_dipr_error, &mut q.recovery, &mut q.keys_scored_fraction] {
        *x /= heads;
    }
    Ok(q)
}

/// ‖a − b‖ / ‖b‖.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - *y as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-300)).sqrt()
}

/// Evicts a file (the store, the loader baseline's K+V file) from the page cache, so "cold"
/// means read from the device: O_DIRECT reads bypass the cache, but pages a buffered writer
/// left there would otherwise answer the first reads of a device that shares them.
fn drop_page_cache(path: &std::path::Path) {
    if let Ok(f) = std::fs::File::open(path) {
        use std::os::fd::AsRawFd;
        // SAFETY: fadvise on a valid open descriptor; it only drops clean cached pages.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
}
