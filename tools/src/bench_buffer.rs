//! `ctxfs bench buffer`: cold random 4 KiB block reads through the buffer manager against a
//! raw O_DIRECT io_uring loop reading the same blocks of the same file, and hot hits per
//! second per thread.

use crate::bench::{drop_scratch, ensure_free, median, ratio, scratch_name, sweep_scratch};
use crate::progress;
use crate::raw_uring::{Dir, RawFile};
use crate::scratch_files::{check_interrupt, defer_interrupts};
use anyhow::{ensure, Result};
use ctxfs_buffer::{BlockRequest, BufferPool, DeviceSource, PoolConfig, PoolStats};
use ctxfs_vfs::{max_payload, DType, DeviceChoice, FileStream, ModelShape, SplitMix64, Store};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    store: PathBuf,
    /// Scratch data blocks written and read at random, in MiB.
    #[arg(long, default_value_t = 256)]
    mib: u64,
    /// Random reads per round, in batches of 32.
    #[arg(long, default_value_t = 32768)]
    reads: u64,
    /// Threads for the hot-hit measurement (at most 256).
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u16).range(1..=256))]
    threads: u16,
    /// Rounds of (buffer, raw) measurements; medians are reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    rounds: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

const QUEUE_DEPTH: usize = 32;
/// Index blocks the hot measurement keeps resident.
const HOT_BLOCKS: u64 = 1024;
/// Hits each hot thread times.
const HOT_HITS: u64 = 500_000;

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    ensure!(args.mib > 0 && args.reads > 0, "--mib and --reads must be positive");
    let store = Store::open_path(&args.store, choice)?;
    // Ctrl-C stops the run at its next step, and the scratch context goes.
    let _deferred = defer_interrupts();
    sweep_scratch(&store)?;
    let dev = store.device().clone();
    let bs = dev.block_size();
    let blocks = (args.mib << 20) / bs as u64;
    ensure_free(&store, blocks + HOT_BLOCKS + 64)?;
    let name = scratch_name("buffer");
    let result = measure(&store, &args, &name, blocks);
    drop_scratch(&store, &name)?;
    let (cold_pool, cold_raw, hot1, hot_n, stats) = result?;
    let ratio_cold = ratio(cold_pool, cold_raw);
    if args.json {
        let v = json!({
            "ratios": {"random_read_vs_raw": ratio_cold},
            "cold": {"pool_iops": cold_pool, "raw_iops": cold_raw, "queue_depth": QUEUE_DEPTH, "reads": args.reads, "rounds": args.rounds},
            "hot": {"threads": args.threads, "hits_per_sec_per_thread": hot_n, "single_thread_hits_per_sec": hot1},
            "stats": ctxfs_attention::describe::pool_json(&stats),
            "device": store.device_info().kind, "mib": args.mib,
        });
        outln!("{v}")?;
        return Ok(());
    }
    outln!(
        "bench buffer: {} MiB of data blocks, {}-byte blocks, device {}, median of {} interleaved rounds",
        args.mib,
        bs,
        store.device_info().kind,
        args.rounds
    )?;
    outln!("{:<44} {:>12} {:>12} {:>8}", "", "buffer", "raw", "ratio")?;
    outln!(
        "{:<44} {:>12.0} {:>12.0} {:>8.2}",
        format!("cold 4 KiB random reads, QD{QUEUE_DEPTH} (IOPS)"),
        cold_pool,
        cold_raw,
        ratio_cold
    )?;
    outln!("{:<44} {:>12.0}", "hot hits/s, 1 thread", hot1)?;
    outln!(
        "{:<44} {:>12.0}",
        format!("hot hits/s per thread, {}", crate::units::count(args.threads, "thread")),
        hot_n
    )?;
    out!("{}", stats_text(&stats))?;
    Ok(())
}

type Measured = (f64, f64, f64, f64, PoolStats);

fn measure(store: &Store, args: &Args, name: &str, blocks: u64) -> Result<Measured> {
    let bs = store.device().block_size();
    let bar = progress::bar((blocks + HOT_BLOCKS) * bs as u64, "write scratch");
    let payload = vec![0x5au8; max_payload(bs)];
    let shape = ModelShape { layers: 1, q_heads: 1, kv_heads: 1, head_dim: 128, dtype: DType::F16 };
    let mut txn = store.begin()?;
    txn.create_context(name, shape, &[])?;
    for _ in 0..blocks {
        check_interrupt()?;
        txn.append_block(name, 0, 0, FileStream::Data, &payload)?;
        bar.inc(bs as u64);
    }
    for _ in 0..HOT_BLOCKS {
        txn.append_block(name, 0, 0, FileStream::Index, &payload)?;
        bar.inc(bs as u64);
    }
    txn.commit()?;
    bar.finish_and_clear();
    let snap = store.snapshot();
    let ctx = snap.context(name)?;
    let data = ctx.stream(0, 0, FileStream::Data)?;
    let index = ctx.stream(0, 0, FileStream::Index)?;
    let data_reqs: Vec<BlockRequest> =
        (0..blocks).map(|l| BlockRequest::new(data.locate(l).expect("in range"))).collect();
    let hot_reqs: Vec<BlockRequest> =
        (0..HOT_BLOCKS).map(|l| BlockRequest::new(index.locate(l).expect("in range"))).collect();

    // Cold: a data area of 1/64 of the data, so about 98% of random reads miss. The index
    // area holds the hot set twice over.
    let data_frames = (blocks / 64).clamp(32, 1024);
    let index_frames = 2 * HOT_BLOCKS;
    let config = PoolConfig {
        budget_bytes: (index_frames + data_frames) * bs as u64,
        data_fraction: data_frames as f64 / (index_frames + data_frames) as f64,
        ..Default::default()
    };
    let pool = Arc::new(BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), config)?);
    let mut raw = RawFile::open(&args.store)?;
    let (mut pool_rounds, mut raw_rounds) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let mut rng = SplitMix64::new(round);
        let picks: Vec<usize> = (0..args.reads).map(|_| rng.below(blocks) as usize).collect();
        let t = Instant::now();
        for batch in picks.chunks(QUEUE_DEPTH) {
            check_interrupt()?;
            let reqs: Vec<BlockRequest> = batch.iter().map(|&i| data_reqs[i]).collect();
            for g in pool.get_many(&reqs) {
                g?;
            }
        }
        pool_rounds.push(args.reads as f64 / t.elapsed().as_secs_f64());
        let offsets: Vec<u64> = picks.iter().map(|&i| data_reqs[i].block * bs as u64).collect();
        let t = Instant::now();
        raw.run(Dir::Read, &offsets, bs, QUEUE_DEPTH)?;
        raw_rounds.push(args.reads as f64 / t.elapsed().as_secs_f64());
    }

    // Hot: every index block resident, then threads pin random ones.
    check_interrupt()?;
    for chunk in hot_reqs.chunks(64) {
        for g in pool.get_many(chunk) {
            g?;
        }
    }
    let hot = |threads: usize| -> f64 {
        let rates: Vec<f64> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads)
                .map(|t| {
                    let (pool, hot_reqs) = (&pool, &hot_reqs);
                    s.spawn(move || {
                        let mut rng = SplitMix64::new(t as u64 + 100);
                        let start = Instant::now();
                        let mut sum = 0u64;
                        for _ in 0..HOT_HITS {
                            let g = pool.get(&hot_reqs[rng.below(HOT_BLOCKS) as usize]).expect("resident block");
                            sum += g.payload()[0] as u64;
                        }
                        std::hint::black_box(sum);
                        HOT_HITS as f64 / start.elapsed().as_secs_f64()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("hot thread")).collect()
        });
        rates.iter().sum::<f64>() / rates.len() as f64
    };
    let hot1 = hot(1);
    let hot_n = hot(args.threads.into());
    Ok((median(pool_rounds), median(raw_rounds), hot1, hot_n, pool.stats()))
}

/// The pool's statistics as a table.
pub fn stats_text(s: &PoolStats) -> String {
    let mut o = format!(
        "buffer pool: budget {} (data area {:.0}%), {} allocated, overhead {}\n",
        crate::units::human_bytes(s.budget_bytes),
        s.data_fraction * 100.0,
        crate::units::human_bytes(s.allocated_bytes),
        crate::units::human_bytes(s.overhead_bytes)
    );
    o += &format!(
        "  {:<6} {:>10} {:>10} {:>7} {:>12} {:>10} {:>16} {:>10}\n",
        "class", "hits", "misses", "hit %", "read", "evictions", "resident/frames", "held"
    );
    for (name, c) in [("index", &s.index), ("data", &s.data)] {
        o += &format!(
            "  {:<6} {:>10} {:>10} {:>6.1}% {:>12} {:>10} {:>16} {:>10}\n",
            name,
            c.hits,
            c.misses,
            c.hit_ratio() * 100.0,
            crate::units::human_bytes(c.bytes_read),
            c.evictions,
            format!("{}/{}", c.resident_frames, c.capacity_frames),
            c.resident_pins
        );
    }
    o
}
