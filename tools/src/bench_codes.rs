//! `ctxfs bench codes`: a GQA group's choice of each query's best tokens from a compact
//! context's PQ codes, on one core, as a compact step's `pq` plan makes it for every kv head
//! of every layer: from every score (the scan writes each token's score, then `take_tokens`
//! cuts a sample of them and ranks those reaching the cut) against only the tokens reaching
//! a cut taken from the run's sample codes (`PagedPq::token_best_many`: the scan makes no
//! other score).
//!
//! One head of the generator (`ctxfs_index::synth`), its scan codes built as an import builds
//! them (`PqParams::scan_codes`), stored as one PQ run in a store file in `--dir` on the
//! chosen device and read through a buffer pool holding all of it, as a compact context holds
//! its codes; the group's 4 q heads' decode queries. Both are timed over the first 131,072
//! tokens and over all of them (a prefix reads the same codes): medians of 5 after one
//! untimed call. The chosen tokens are compared query by query.

use crate::bench::timed_median;
use anyhow::{anyhow, ensure, Context, Result};
use ctxfs_buffer::{BlockRequest, BufferPool, DeviceSource, PoolConfig};
use ctxfs_index::coarse::pq::{PagedPq, Pq, PqParams};
use ctxfs_index::coarse::take_tokens;
use ctxfs_index::search::SEED_STRIDE;
use ctxfs_index::synth::{head, SynthParams};
use ctxfs_index::MemKeys;
use ctxfs_vfs::{max_payload, DType, DeviceChoice, FileStream, ModelShape};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Where the bench's store file is made (and removed after the run).
    #[arg(long, default_value = "./ctxfs-bench-codes")]
    dir: PathBuf,
    /// Tokens of the generated head; the choice is also timed over its first 131,072.
    #[arg(long, default_value_t = 1_048_576)]
    tokens: usize,
    /// Head dimension of the generated keys.
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Tokens each query takes (a compact step takes `Rules::codes_budget`, 768, beyond the
    /// window, and the window's; the default times a larger choice).
    #[arg(long, default_value_t = 1024)]
    best: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// q heads per kv head of the generated group.
const GROUP: usize = 4;
/// The shorter choice: the 128K context of `ctxfs bench decode`.
const SHORT: usize = 131_072;
const TIMED: usize = 5;
const BLOCK: usize = 4096;

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    let (n, d) = (args.tokens, args.head_dim);
    ensure!(n > 0 && d >= 4 && d.is_multiple_of(4), "--tokens must be positive and --head-dim a multiple of 4");
    ensure!(args.best > 0, "--best must be positive");
    let p = SynthParams { tokens: n, head_dim: d, group: GROUP, seed: 11 };
    let h = head(&p, 1, 0, 0, 1);
    let queries: Vec<f32> = h.decode.iter().flat_map(|q| q[..d].iter().copied()).collect();
    let t = Instant::now();
    let pq = Pq::build(&MemKeys::new(d, h.keys), &PqParams::scan_codes(d)).map_err(|e| anyhow!(e))?;
    let build_seconds = t.elapsed().as_secs_f64();
    let run = pq.payloads(max_payload(BLOCK)).map_err(|e| anyhow!(e))?;

    std::fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    let path = args.dir.join("codes.ctxfs");
    let result = time_choices(&path, choice, &run, (&queries, d), args.best);
    // The store is scratch: removed whether or not the run succeeded.
    let _ = std::fs::remove_file(&path);
    let scans = result?;

    let v = json!({
        "tokens": n,
        "head_dim": d,
        "subspaces": pq.params().m,
        "queries": GROUP,
        "best": args.best,
        "cpu_threads": 1,
        "build_seconds": build_seconds,
        "run_blocks": run.len(),
        "scans": scans,
    });
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    outln!("each of {GROUP} queries' best {} of d = {d} codes on one core ({} subspaces)", args.best, pq.params().m)?;
    outln!("{:>10}  {:>14}  {:>14}  {:>7}  same tokens", "tokens", "every score", "kept", "ratio")?;
    for s in v["scans"].as_array().into_iter().flatten() {
        // Where the sample's cut did not hold, the kept scan gave up at once: its time is no
        // choice's, and the ratio none.
        let (kept, ratio) = match s["sampled_cut_held"].as_bool() == Some(true) {
            true => (
                format!("{:>11.3} ms", s["kept_seconds"].as_f64().unwrap_or(0.0) * 1e3),
                format!("{:>6.2}×", s["speedup"].as_f64().unwrap_or(0.0)),
            ),
            false => (format!("{:>14}", "cut failed"), format!("{:>7}", "n/a")),
        };
        outln!(
            "{:>10}  {:>11.3} ms  {kept}  {ratio}  {}/{GROUP}",
            s["tokens"],
            s["every_score_seconds"].as_f64().unwrap_or(0.0) * 1e3,
            s["queries_identical"],
        )?;
    }
    Ok(())
}

/// Stores the PQ run `run` in a new store at `path`, holds it in a pool, and times both
/// choices over the first 131,072 tokens and over all of them.
fn time_choices(
    path: &std::path::Path,
    choice: DeviceChoice,
    run: &[Vec<u8>],
    (queries, d): (&[f32], usize),
    best: usize,
) -> Result<Vec<serde_json::Value>> {
    let bytes = (run.len() as u64 + 1024) * BLOCK as u64;
    std::fs::File::create(path)
        .and_then(|f| f.set_len(bytes))
        .with_context(|| format!("creating {}", path.display()))?;
    let dev = ctxfs_vfs::device::open_path(path, choice, BLOCK, ctxfs_vfs::Access::Write)?;
    let store = ctxfs_vfs::format(Arc::from(dev))?;
    let shape = ModelShape { layers: 1, q_heads: GROUP as u16, kv_heads: 1, head_dim: d as u16, dtype: DType::F16 };
    let mut txn = store.begin()?;
    txn.create_context("codes", shape, &[])?;
    for block in run {
        txn.append_block("codes", 0, 0, FileStream::Index, block)?;
    }
    txn.commit()?;
    let snap = store.snapshot();
    let stream = snap.context("codes")?.stream(0, 0, FileStream::Index)?;
    let reqs: Vec<BlockRequest> = (0..stream.blocks())
        .map(|l| stream.locate(l).map(BlockRequest::new))
        .collect::<Option<_>>()
        .ok_or_else(|| anyhow!("the PQ run's stream has a block it cannot locate"))?;
    drop(snap);
    // Room for the whole run in the index area, as a compact context holds its codes.
    let config = PoolConfig { budget_bytes: 2 * bytes, data_fraction: 0.1, ..Default::default() };
    let pool = Arc::new(BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), config)?);
    // Held resident and read from its frames, as a compact context's codes are.
    let held = pool.make_resident(&reqs)?.ok_or_else(|| anyhow!("the pool has no room to hold the PQ run"))?;
    let pq = PagedPq::open_held(&pool, &reqs, Some((&held, 0))).map_err(|e| anyhow!(e))?;
    let tokens = pq.meta().tokens as usize;
    let mut scans = Vec::new();
    for lim in [SHORT.min(tokens), tokens] {
        if scans.iter().any(|s: &serde_json::Value| s["tokens"] == lim) {
            continue;
        }
        let (prefix, k) = (Some(lim as u32), best.min(lim));
        let every = || -> Result<Option<Vec<Vec<u32>>>> {
            let scan = pq.token_scores_many(queries, prefix)?;
            Ok(Some((0..GROUP).map(|i| take_tokens(scan.query(i), k)).collect()))
        };
        let kept = || -> Result<Option<Vec<Vec<u32>>>> {
            let kept = pq.token_best_many(queries, prefix, k, SEED_STRIDE)?;
            Ok(kept.map(|g| g.queries.into_iter().map(|q| q.best.into_iter().map(|b| b.0).collect()).collect()))
        };
        let (all, few) = (every()?, kept()?);
        let identical = match (&all, &few) {
            (Some(a), Some(f)) => a.iter().zip(f).filter(|(a, f)| a == f).count(),
            _ => 0,
        };
        let (every_seconds, kept_seconds) = (timed_median(TIMED, &every)?, timed_median(TIMED, &kept)?);
        scans.push(json!({
            "tokens": lim,
            "every_score_seconds": every_seconds,
            "kept_seconds": kept_seconds,
            "speedup": few.is_some().then(|| every_seconds / kept_seconds),
            "sampled_cut_held": few.is_some(),
            "queries_identical": identical,
        }));
    }
    Ok(scans)
}
