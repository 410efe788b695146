use crate::bench::{drop_scratch, ensure_free, median, ratio, scratch_name, sweep_scratch};
use crate::progress;
use crate::raw_uring::{Dir, RawFile};
use crate::scratch_files::{check_interrupt, defer_interrupts};
use anyhow::{bail, ensure, Result};
use ctxfs_vfs::{max_payload, DType, DeviceChoice, FileStream, ModelShape, SplitMix64, Store};
use serde_json::json;
use std::os::unix::fs::FileTypeExt;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    store: PathBuf,
    /// Scratch data written and read, in MiB.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    mib: u64,
    /// Random 4 KiB reads to time, in batches of the queue depth.
    #[arg(long, default_value_t = 32768, value_parser = clap::value_parser!(u64).range(1..))]
    random_reads: u64,
    /// Rounds of (ctxfs, raw) measurements; medians are reported.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    rounds: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

const QUEUE_DEPTH: usize = 32;
/// The raw loop's sequential operation size; it keeps as many bytes in flight as the store.
const SEQ_OP: usize = 1 << 20;

struct Figures {
    seq_write_mib_s: f64,
    seq_read_mib_s: f64,
    random_read_iops: f64,
}

impl Figures {
    fn median(rounds: &[Figures]) -> Figures {
        let med = |f: fn(&Figures) -> f64| median(rounds.iter().map(f).collect());
        Figures {
            seq_write_mib_s: med(|f| f.seq_write_mib_s),
            seq_read_mib_s: med(|f| f.seq_read_mib_s),
            random_read_iops: med(|f| f.random_read_iops),
        }
    }
}

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    if std::fs::metadata(&args.store).is_ok_and(|m| m.file_type().is_block_device()) {
        bail!(
            "{} is a block device: bench io compares the store with a raw file beside it, and /dev is no disk \
             file system; bench a store file on the device's file system instead",
            args.store.display()
        );
    }
    let store = Store::open_path(&args.store, choice)?;
    // Ctrl-C stops the run at its next step, and the scratch context and raw file go.
    let _deferred = defer_interrupts();
    sweep_scratch(&store)?;
    let bs = store.device().block_size();
    let blocks = (args.mib << 20) / bs as u64;
    ensure!(blocks > 0, "--mib {} holds no block of {bs} bytes", args.mib);
    ensure_free(&store, blocks + 64)?;
    let name = scratch_name("io");
    let raw_path = args.store.with_extension("bench-raw");
    // The raw file is made once and written whole before the rounds: its timed writes meet
    // blocks the file system has allocated, not holes it must fill first.
    // A file already there is refused, and stays: only the file made here is removed, when
    // `raw` drops.
    let mut raw = RawFile::create(&raw_path, blocks * bs as u64)?;
    let result = raw
        .run(Dir::Write, &seq_offsets(blocks * bs as u64), SEQ_OP, write_depth())
        .and_then(|()| raw.sync())
        .and_then(|()| Ok(check_interrupt()?))
        .and_then(|()| rounds(&args, &store, &name, &mut raw, blocks));
    drop(raw);
    let (ours, raw) = result?;
    report(&args, &store, &raw_path, &ours, &raw)
}

/// Raw write depth: the bytes a store transaction keeps in flight, in `SEQ_OP` operations.
fn write_depth() -> usize {
    (ctxfs_vfs::WRITE_IN_FLIGHT_BYTES / SEQ_OP).max(1)
}

/// Raw sequential read depth: the bytes a store range read keeps in flight.
fn read_depth(bs: usize) -> usize {
    (ctxfs_vfs::RangeReader::BATCH_BLOCKS as usize * bs / SEQ_OP).max(1)
}

fn seq_offsets(bytes: u64) -> Vec<u64> {
    (0..bytes / SEQ_OP as u64).map(|i| i * SEQ_OP as u64).collect()
}

fn rounds(args: &Args, store: &Store, name: &str, raw: &mut RawFile, blocks: u64) -> Result<(Figures, Figures)> {
    let bs = store.device().block_size();
    let bar = progress::bar((args.rounds * 4 + 2) * blocks * bs as u64, "bench io");
    // As the raw file is, the store's scratch blocks are written before the rounds: a round's
    // freed blocks are reused by the round after next (quarantine), so two untimed fills
    // make every timed write meet blocks the file system has allocated, as a store in use
    // reuses its blocks.
    for _ in 0..2 {
        let filled = write_scratch(store, name, blocks, &bar);
        drop_scratch(store, name)?;
        filled?;
    }
    // Rounds alternate ours and raw, so drift in the shared device hits both alike.
    let mut ours_rounds = Vec::new();
    let mut raw_rounds = Vec::new();
    for _ in 0..args.rounds {
        let ours = measure_store(store, name, blocks, args.random_reads, &bar);
        // Whatever happened, the scratch context goes.
        drop_scratch(store, name)?;
        ours_rounds.push(ours?);
        raw_rounds.push(measure_raw(raw, blocks * bs as u64, bs, args.random_reads, &bar)?);
    }
    bar.finish_and_clear();
    Ok((Figures::median(&ours_rounds), Figures::median(&raw_rounds)))
}

fn report(args: &Args, store: &Store, raw_path: &std::path::Path, ours: &Figures, raw: &Figures) -> Result<()> {
    let bs = store.device().block_size();
    let ratios = json!({
        "seq_write_vs_raw": ratio(ours.seq_write_mib_s, raw.seq_write_mib_s),
        "seq_read_vs_raw": ratio(ours.seq_read_mib_s, raw.seq_read_mib_s),
        "random_read_vs_raw": ratio(ours.random_read_iops, raw.random_read_iops),
    });
    let info = store.device_info();
    if args.json {
        let fig = |f: &Figures| json!({"seq_write_mib_s": f.seq_write_mib_s, "seq_read_mib_s": f.seq_read_mib_s, "random_read_iops": f.random_read_iops});
        let v = json!({
            "ratios": ratios, "ctxfs": fig(ours), "raw": fig(raw), "mib": args.mib, "block_size": bs,
            "random_reads": args.random_reads, "rounds": args.rounds, "queue_depth": QUEUE_DEPTH, "device": info.kind,
            "in_flight_bytes": {"sequential_write": write_depth() * SEQ_OP, "sequential_read": read_depth(bs) * SEQ_OP},
        });
        outln!("{v}")?;
        return Ok(());
    }
    outln!(
        "bench io: {} MiB, {}-byte blocks, device {}, median of {} interleaved rounds; raw = O_DIRECT io_uring loop over {}",
        args.mib,
        bs,
        info.kind,
        args.rounds,
        raw_path.display()
    )?;
    outln!("{:<28} {:>12} {:>12} {:>8}", "", "ctxfs", "raw", "ratio")?;
    let row = |what: &str, a: f64, b: f64, unit: &str| {
        outln!("{:<28} {:>9.0} {unit} {:>9.0} {unit} {:>8.2}", what, a, b, ratio(a, b))
    };
    row("sequential write (MiB/s)", ours.seq_write_mib_s, raw.seq_write_mib_s, "  ")?;
    row("sequential read (MiB/s)", ours.seq_read_mib_s, raw.seq_read_mib_s, "  ")?;
    row(&format!("4 KiB random read, QD{QUEUE_DEPTH} (IOPS)"), ours.random_read_iops, raw.random_read_iops, "  ")?;
    Ok(())
}

fn mib_s(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / (1 << 20) as f64 / secs
}

/// Progress and the Ctrl-C check once per raw operation's worth of blocks: per block, the
/// bar's clock would be timed with the store. The rest is reported when dropped.
struct Ticker<'a> {
    bar: &'a indicatif::ProgressBar,
    block_size: u64,
    unreported: u64,
}

impl<'a> Ticker<'a> {
    fn new(bar: &'a indicatif::ProgressBar, block_size: usize) -> Self {
        Ticker { bar, block_size: block_size as u64, unreported: 0 }
    }

    fn block(&mut self) -> Result<()> {
        self.unreported += 1;
        if self.unreported * self.block_size >= SEQ_OP as u64 {
            check_interrupt()?;
            self.bar.inc(self.unreported * self.block_size);
            self.unreported = 0;
        }
        Ok(())
    }
}

impl Drop for Ticker<'_> {
    fn drop(&mut self) {
        self.bar.inc(self.unreported * self.block_size);
    }
}

/// Writes the scratch context: `blocks` data blocks in one transaction.
fn write_scratch(store: &Store, name: &str, blocks: u64, bar: &indicatif::ProgressBar) -> Result<()> {
    let bs = store.device().block_size();
    let payload: Vec<u8> = (0..max_payload(bs)).map(|i| i as u8).collect();
    let shape = ModelShape { layers: 1, q_heads: 1, kv_heads: 1, head_dim: 128, dtype: DType::F16 };
    let mut txn = store.begin()?;
    txn.create_context(name, shape, &[])?;
    let mut ticks = Ticker::new(bar, bs);
    for _ in 0..blocks {
        txn.append_block(name, 0, 0, FileStream::Data, &payload)?;
        ticks.block()?;
    }
    drop(ticks);
    txn.commit()?;
    Ok(())
}

fn measure_store(store: &Store, name: &str, blocks: u64, reads: u64, bar: &indicatif::ProgressBar) -> Result<Figures> {
    let bs = store.device().block_size();
    let t = Instant::now();
    write_scratch(store, name, blocks, bar)?;
    let seq_write = mib_s(blocks * bs as u64, t.elapsed().as_secs_f64());

    let snap = store.snapshot();
    let ctx = snap.context(name)?;
    let stream = ctx.stream(0, 0, FileStream::Data)?;
    let t = Instant::now();
    let mut ticks = Ticker::new(bar, bs);
    for block in stream.read_range(0, blocks) {
        anyhow::ensure!(block?.payload().len() == max_payload(bs), "short block");
        ticks.block()?;
    }
    drop(ticks);
    let seq_read = mib_s(blocks * bs as u64, t.elapsed().as_secs_f64());

    let mut rng = SplitMix64::new(42);
    let t = Instant::now();
    let mut done = 0;
    while done < reads {
        check_interrupt()?;
        let batch: Vec<u64> = (0..QUEUE_DEPTH.min((reads - done) as usize)).map(|_| rng.below(blocks)).collect();
        for r in stream.read_many(&batch) {
            r?;
        }
        done += batch.len() as u64;
        bar.inc(blocks * bs as u64 / reads * batch.len() as u64);
    }
    let random = reads as f64 / t.elapsed().as_secs_f64();
    Ok(Figures { seq_write_mib_s: seq_write, seq_read_mib_s: seq_read, random_read_iops: random })
}

fn measure_raw(raw: &mut RawFile, bytes: u64, bs: usize, reads: u64, bar: &indicatif::ProgressBar) -> Result<Figures> {
    let seq_ops = seq_offsets(bytes);
    let t = Instant::now();
    raw.run(Dir::Write, &seq_ops, SEQ_OP, write_depth())?;
    raw.sync()?;
    let seq_write = mib_s(bytes, t.elapsed().as_secs_f64());
    bar.inc(bytes);
    check_interrupt()?;
    let t = Instant::now();
    raw.run(Dir::Read, &seq_ops, SEQ_OP, read_depth(bs))?;
    let seq_read = mib_s(bytes, t.elapsed().as_secs_f64());
    bar.inc(bytes);
    check_interrupt()?;
    let mut rng = SplitMix64::new(42);
    let blocks = bytes / bs as u64;
    let random_ops: Vec<u64> = (0..reads).map(|_| rng.below(blocks) * bs as u64).collect();
    let t = Instant::now();
    raw.run(Dir::Read, &random_ops, bs, QUEUE_DEPTH)?;
    let random = reads as f64 / t.elapsed().as_secs_f64();
    Ok(Figures { seq_write_mib_s: seq_write, seq_read_mib_s: seq_read, random_read_iops: random })
}
