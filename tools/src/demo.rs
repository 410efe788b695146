//! `ctxfs demo`: the end-to-end run on an embedded default store (the README's main job).
//!
//! 1. mkfs a store file in DIR;
//! 2. generate a book-scale synthetic context;
//! 3. import it (index build included);
//! 4. reopen the store with a buffer pool that holds the index blocks and a tenth of the
//!    data blocks, and open a session on a prompt that shares three quarters of the book and
//!    adds new tokens (partial reuse: filtered search);
//! 5. run decode steps through `Session::attention` for every layer, appending each step's
//!    token; then replay the same steps in a second session for exact attention and the
//!    exact DIPR set, so the timed pass has the buffer pool to itself;
//! 6. print import throughput, build time, attention latency per token, DIPR recall,
//!    recovery ratio and output error against exact attention, blocks read and the buffer
//!    hit ratio;
//! 7. fsck.

use crate::bench::Serving;
use crate::decode_queries::DecodeQueries;
use crate::{gen, progress};
use anyhow::{ensure, Result};
use ctxfs_attention::{AttentionOptions, Db, DbConfig, KvSource, Plan, SafetensorsKv};
use ctxfs_vfs::mkfs::format_path;
use ctxfs_vfs::{fsck, DType, DeviceChoice};
use serde_json::json;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Where the demo's files live (the generated book, and the store unless `--store`).
    #[arg(long, default_value = "./ctxfs-demo")]
    dir: PathBuf,
    /// The store to format and use instead of DIR/store.ctxfs: a file, a block device, or an
    /// SPDK bdev (`spdk:CONFIG.json#BDEV`, with the `spdk` feature). One that holds a store or
    /// any data is replaced only with --force, as `ctxfs mkfs` does.
    #[arg(long)]
    store: Option<PathBuf>,
    /// Replace what --store holds.
    #[arg(long, requires = "store")]
    force: bool,
    /// Tokens of the generated book.
    #[arg(long, default_value_t = 65536)]
    tokens: usize,
    /// Layers of the generated book.
    #[arg(long, default_value_t = 2)]
    layers: usize,
    /// Decode steps run.
    #[arg(long, default_value_t = 16)]
    steps: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

const Q_HEADS: usize = 8;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 128;
/// New tokens the demo prompt adds after the shared prefix.
const PROMPT_TAIL: usize = 32;

#[derive(Default)]
struct Quality {
    recall: f64,
    recovery: f64,
    error: f64,
    exact_dipr_error: f64,
    heads: usize,
}

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    let (n, layers, steps) = (args.tokens, args.layers, args.steps);
    ensure!(n >= 4096 && layers > 0 && steps > 0, "--tokens must be at least 4096; --layers and --steps positive");
    ensure!(n * 3 / 4 + PROMPT_TAIL + steps <= n, "--steps too large for the book");
    std::fs::create_dir_all(&args.dir)?;
    let path = args.store.clone().unwrap_or_else(|| args.dir.join("store.ctxfs"));
    // A bdev or block device is used whole; a file is sized for the book.
    let whole = ctxfs_vfs::device::SpdkPath::parse(&path).is_some()
        || std::fs::metadata(&path).is_ok_and(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()));
    let book = args.dir.join("book.safetensors");
    // Keys twice (index and data streams are separate), values, graph: ~3× the f16 KV.
    let kv_bytes = (n * layers * KV_HEADS * HEAD_DIM * 2 * 2) as u64;
    let size = (kv_bytes * 3 + (64 << 20)).max(256 << 20);
    let t = Instant::now();
    // The demo owns DIR/store.ctxfs: a previous run's copy is replaced. Another path is the
    // user's.
    format_path(&path, (!whole).then_some(size), 4096, args.store.is_none() || args.force, choice)?;
    let mkfs_s = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let gen_args = gen::Args {
        out: book.clone(),
        tokens: n,
        layers,
        q_heads: Q_HEADS,
        kv_heads: KV_HEADS,
        head_dim: HEAD_DIM,
        queries: None,
        decode_queries: steps,
        seed: 7,
        force: true,
        json: false,
    };
    gen::generate(&gen_args)?;
    let gen_s = t.elapsed().as_secs_f64();

    let db = Db::open(&path, choice, DbConfig::streaming(ctxfs_vfs::probe_block_size(&path)?))?;
    let source = SafetensorsKv::open(&book, DType::F16)?;
    source.check_values(|_| {})?;
    let bar = progress::bar(kv_bytes, "import");
    let import = db.import("demo-book", &source, |b| {
        bar.inc(b);
        Ok(())
    })?;
    bar.finish_and_clear();
    drop(db);

    // Serve as a separate process would: the pool holds every index block, and a tenth of
    // the data blocks as a cache.
    let serving = Serving::size(&path, choice, 0.1)?;
    let (pool_bytes, index_bytes) = (serving.config.pool_bytes, serving.index_bytes);
    let db = Db::open(&path, choice, serving.config)?;
    // A server reads a context's index once and holds it resident; sessions then search
    // memory and read only value blocks.
    let t = Instant::now();
    let warm = db.warm("demo-book")?;
    let warm_s = t.elapsed().as_secs_f64();

    // The prompt: three quarters of the book, then new tokens whose KV the "engine" computed
    // (here: the book's next rows, under new token ids).
    let p = n * 3 / 4;
    let ids = source.token_ids()?;
    let prompt: Vec<u32> = ids[..p].iter().copied().chain((0..PROMPT_TAIL as u32).map(|i| 1_000_000 + i)).collect();
    let rows = |layer: usize, first: usize, count: usize| -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for h in 0..KV_HEADS {
            k.extend_from_slice(&source.keys(layer, h)?[first * HEAD_DIM..(first + count) * HEAD_DIM]);
            v.extend_from_slice(&source.values(layer, h)?[first * HEAD_DIM..(first + count) * HEAD_DIM]);
        }
        Ok((k, v))
    };
    let prompt_rows: Vec<_> = (0..layers).map(|l| rows(l, p, PROMPT_TAIL)).collect::<Result<_>>()?;
    let step_rows: Vec<Vec<_>> = (0..steps)
        .map(|s| (0..layers).map(|l| rows(l, p + PROMPT_TAIL + s, 1)).collect::<Result<_>>())
        .collect::<Result<_>>()?;
    let open = |db: &Db| -> Result<ctxfs_attention::Session> {
        let (mut session, remaining) = db.create_session(&prompt)?;
        ensure!(remaining == PROMPT_TAIL, "the session reused {} tokens, expected {p}", prompt.len() - remaining);
        for (l, (k, v)) in prompt_rows.iter().enumerate() {
            session.update(l, &[], k, v)?;
        }
        Ok(session)
    };
    let queries = DecodeQueries::read(&book.with_extension("queries.safetensors"), layers, Q_HEADS, HEAD_DIM)?;
    let step_q = |l: usize, step: usize| queries.step(l, step);

    // The timed pass. Its hit ratio counts its own requests, not the warm's reads.
    let before = db.pool_stats();
    let auto = AttentionOptions { detail: true, ..Default::default() };
    let t = Instant::now();
    let mut session = open(&db)?;
    let open_s = t.elapsed().as_secs_f64();
    let mut ttft = 0.0;
    let (mut step_secs, mut blocks, mut answers) = (Vec::new(), Vec::new(), Vec::new());
    let mut plans = BTreeSet::new();
    for (step, step_kv) in step_rows.iter().enumerate() {
        let (mut secs, mut read) = (0.0, 0);
        for (l, (k, v)) in step_kv.iter().enumerate() {
            let q = step_q(l, step);
            let t = Instant::now();
            let got = session.attention_with(l, &q, &auto)?;
            secs += t.elapsed().as_secs_f64();
            if step == 0 && l == 0 {
                ttft = open_s + secs;
            }
            plans.insert(got.plan());
            read += got.heads.iter().map(|h| h.stats.blocks_read).sum::<u64>();
            answers.push(got);
            // The step's token joins the session (late materialization).
            session.update(l, &[], k, v)?;
        }
        session.append_tokens(&[2_000_000 + step as u32]);
        step_secs.push(secs);
        blocks.push(read);
    }
    let pool = db.pool_stats();
    drop(session);

    // The quality pass: the same steps, exactly.
    let window: BTreeSet<u32> = open(&db)?.window_tokens().iter().copied().collect();
    let exact_dipr = crate::bench::exact_dipr_reference(HEAD_DIM, &auto);
    let full = AttentionOptions { plan: Some(Plan::Full), ..Default::default() };
    let mut quality = Quality::default();
    let mut scored = 0u64;
    let mut replay = open(&db)?;
    let mut answer = answers.iter();
    for (step, step_kv) in step_rows.iter().enumerate() {
        for (l, (k, v)) in step_kv.iter().enumerate() {
            let q = step_q(l, step);
            let got = answer.next().expect("one answer per step and layer");
            let truth = replay.attention_with(l, &q, &full)?;
            let dipr = replay.attention_with(l, &q, &exact_dipr)?;
            for (h, r) in got.heads.iter().enumerate() {
                scored += r.stats.keys_scored;
                let retrieved = |s: &[u32]| -> BTreeSet<u32> {
                    s.iter().copied().filter(|&t| (t as usize) < p && !window.contains(&t)).collect()
                };
                let want = retrieved(&dipr.heads[h].selected);
                // Retrieval's recall: the seeds of the tail estimate entered the output, but
                // as a sample, not retrieved.
                let mut have = retrieved(&r.selected);
                r.tail.iter().for_each(|t| _ = have.remove(t));
                quality.recall +=
                    if want.is_empty() { 1.0 } else { want.intersection(&have).count() as f64 / want.len() as f64 };
                quality.recovery += ((r.lse - truth.heads[h].lse) as f64).exp();
                let span = h * HEAD_DIM..(h + 1) * HEAD_DIM;
                quality.error += rel_err(&got.output[span.clone()], &truth.output[span.clone()]);
                quality.exact_dipr_error += rel_err(&dipr.output[span.clone()], &truth.output[span]);
                quality.heads += 1;
            }
            replay.update(l, &[], k, v)?;
        }
        replay.append_tokens(&[2_000_000 + step as u32]);
    }
    drop(replay);
    let hq = quality.heads as f64;
    let hit_ratio = pool.hit_ratio_since(&before);
    let median = crate::bench::median(step_secs.clone());
    let t = Instant::now();
    let check = fsck::check(db.store().device().as_ref())?;
    let fsck_s = t.elapsed().as_secs_f64();
    ensure!(check.is_clean(), "fsck found problems: {:?}", check.problems);

    let heads = import.heads as f64;
    let mib = kv_bytes as f64 / (1 << 20) as f64;
    let plans: Vec<String> = plans.into_iter().collect();
    let median_blocks = {
        let mut b = blocks.clone();
        b.sort_unstable();
        b[b.len() / 2]
    };
    let v = json!({
        "store": path, "tokens": n, "layers": layers, "q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "mkfs_seconds": mkfs_s, "generate_seconds": gen_s,
        "import_seconds": import.seconds, "import_mib_per_second": mib / import.seconds,
        "build_seconds_per_head": import.build_seconds() / heads,
        "reused_tokens": p, "prompt_new_tokens": PROMPT_TAIL, "session_open_seconds": open_s,
        "index_warm_seconds": warm_s, "index_warm_blocks": warm.blocks, "index_held_blocks": warm.held,
        "time_to_first_output_seconds": ttft,
        "steps": steps, "cold_step_seconds": step_secs[0], "median_step_seconds": median,
        "latency_per_token_per_layer_ms": median * 1e3 / layers as f64,
        "plans": plans,
        "dipr_recall": quality.recall / hq, "recovery_ratio": quality.recovery / hq,
        "output_error": quality.error / hq, "exact_dipr_output_error": quality.exact_dipr_error / hq,
        "keys_scored_fraction": scored as f64 / hq / p as f64,
        "blocks_read_cold_step": blocks[0], "blocks_read_median_step": median_blocks,
        "buffer_hit_ratio": hit_ratio, "pool_bytes": pool_bytes, "fsck_seconds": fsck_s, "fsck_blocks": check.blocks_checked,
    });
    if args.json {
        outln!("{v}")?;
        return Ok(());
    }
    outln!("ctxfs demo — store {}", path.display())?;
    let row = |k: &str, val: String| outln!("  {k:<40} {val}");
    row("mkfs", format!("{:.2} s ({} MiB)", mkfs_s, size >> 20))?;
    row(
        "generate book",
        format!(
            "{:.1} s ({n} tokens × {} × {KV_HEADS} kv heads, {Q_HEADS} q heads, d={HEAD_DIM})",
            gen_s,
            crate::units::count(layers as u64, "layer")
        ),
    )?;
    row(
        "import (check, index, write, commit)",
        format!("{:.1} s, {:.1} MiB/s of KV", import.seconds, mib / import.seconds),
    )?;
    row(
        "index build per head",
        format!(
            "{:.2} s (kNN {:.2}, projection {:.2}, enhancement {:.2})",
            import.build_seconds() / heads,
            import.knn.as_secs_f64() / heads,
            import.projection.as_secs_f64() / heads,
            import.enhancement.as_secs_f64() / heads
        ),
    )?;
    row(
        "session",
        format!("reuses {p} of {} prompt tokens (partial prefix), {:.1} ms to open", prompt.len(), open_s * 1e3),
    )?;
    row(
        "buffer pool",
        format!(
            "{} MiB: every index block ({} MiB) and a tenth of the data blocks",
            pool_bytes >> 20,
            index_bytes >> 20
        ),
    )?;
    row(
        "index held resident",
        format!("{} of {} blocks, read in {:.2} s, once per DB open", warm.held, warm.blocks, warm_s),
    )?;
    row("time to first attention output", format!("{:.1} ms", ttft * 1e3))?;
    row("plans", plans.join(", "))?;
    row(
        "attention per token (all layers)",
        format!("cold {:.2} ms, median {:.2} ms over {steps} steps", step_secs[0] * 1e3, median * 1e3),
    )?;
    row("DIPR recall", format!("{:.3}", v["dipr_recall"].as_f64().unwrap_or(0.0)))?;
    row("recovery ratio", format!("{:.3}", v["recovery_ratio"].as_f64().unwrap_or(0.0)))?;
    row(
        "output error vs exact attention",
        format!(
            "{:.4} (exact DIPR set: {:.4})",
            v["output_error"].as_f64().unwrap_or(0.0),
            v["exact_dipr_output_error"].as_f64().unwrap_or(0.0)
        ),
    )?;
    row("keys scored", format!("{:.1}% of the prefix", v["keys_scored_fraction"].as_f64().unwrap_or(0.0) * 100.0))?;
    row("blocks read per step", format!("cold {}, median {}", blocks[0], v["blocks_read_median_step"]))?;
    row("buffer hit ratio (decode steps)", format!("{:.3}", hit_ratio))?;
    row("fsck", format!("{:.2} s, {} blocks, clean", fsck_s, check.blocks_checked))?;
    outln!()?;
    drop(db);
    crate::inspect::run(crate::inspect::Args::summary_of(path), choice)
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}
