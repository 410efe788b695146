//! The end-to-end demonstration on an embedded default store. For now it formats a store,
//! writes a synthetic context (keys in the index streams, values in the data streams), reads
//! every vector back and compares, runs fsck, and prints the store.

use crate::mkfs::format_store;
use crate::progress;
use anyhow::{ensure, Result};
use ctxfs_vfs::{fsck, max_payload, DType, DeviceChoice, FileStream, ModelShape, SplitMix64, Store};
use half::f16;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Where the demo store lives.
    #[arg(long, default_value = "./ctxfs-demo")]
    dir: PathBuf,
}

const SHAPE: ModelShape = ModelShape { layers: 4, q_heads: 8, kv_heads: 2, head_dim: 128, dtype: DType::F16 };
const TOKENS: usize = 16384;

/// A deterministic vector for (layer, head, token, k-or-v).
fn vector(layer: u16, head: u16, token: usize, value: bool) -> Vec<f16> {
    let seed = ((layer as u64) << 48) ^ ((head as u64) << 32) ^ ((token as u64) << 1) ^ value as u64;
    let mut r = SplitMix64::new(seed);
    (0..SHAPE.head_dim).map(|_| f16::from_f32((r.next_f64() as f32 - 0.5) * 4.0)).collect()
}

/// Whole vectors per block; vectors never straddle blocks.
fn per_block(bs: usize) -> usize {
    max_payload(bs) / (SHAPE.head_dim as usize * 2)
}

fn block_payload(layer: u16, head: u16, first: usize, n: usize, value: bool) -> Vec<u8> {
    (first..first + n).flat_map(|t| vector(layer, head, t, value)).flat_map(|x| x.to_le_bytes()).collect()
}

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    std::fs::create_dir_all(&args.dir)?;
    let path = args.dir.join("store.ctxfs");
    // The demo owns this store; a previous run's copy is replaced.
    let t = Instant::now();
    let store = format_store(&path, Some(512 << 20), 4096, true, choice)?;
    let mkfs_s = t.elapsed().as_secs_f64();
    let bs = store.device().block_size();
    let vpb = per_block(bs);
    let tokens: Vec<u32> = (0..TOKENS as u32).map(|t| t.wrapping_mul(2_654_435_761) % 128_000).collect();

    let files = SHAPE.files();
    let bar = progress::bar((files * TOKENS * 2 * SHAPE.head_dim as usize * 2) as u64, "write context");
    let t = Instant::now();
    let mut txn = store.begin()?;
    txn.create_context("demo-book", SHAPE, &tokens)?;
    for layer in 0..SHAPE.layers {
        for head in 0..SHAPE.kv_heads {
            for first in (0..TOKENS).step_by(vpb) {
                let n = vpb.min(TOKENS - first);
                txn.append_block(
                    "demo-book",
                    layer,
                    head,
                    FileStream::Index,
                    &block_payload(layer, head, first, n, false),
                )?;
                txn.append_block(
                    "demo-book",
                    layer,
                    head,
                    FileStream::Data,
                    &block_payload(layer, head, first, n, true),
                )?;
                bar.inc((2 * n * SHAPE.head_dim as usize * 2) as u64);
            }
        }
    }
    txn.commit()?;
    bar.finish_and_clear();
    let write_s = t.elapsed().as_secs_f64();
    let kv_bytes = (files * TOKENS * 2 * SHAPE.head_dim as usize * 2) as f64;
    drop(store);

    // Reopen, as another program would, and read every vector back.
    let t = Instant::now();
    let store = Store::open_path(&path, choice)?;
    let snap = store.snapshot();
    let ctx = snap.context("demo-book")?;
    ensure!(ctx.tokens()? == tokens, "token ids differ after reopen");
    let mut checked = 0usize;
    for layer in 0..SHAPE.layers {
        for head in 0..SHAPE.kv_heads {
            for (which, value) in [(FileStream::Index, false), (FileStream::Data, true)] {
                let stream = ctx.stream(layer, head, which)?;
                for (i, block) in stream.read_range(0, stream.blocks()).enumerate() {
                    let first = i * vpb;
                    let n = vpb.min(TOKENS - first);
                    ensure!(
                        block?.payload() == &block_payload(layer, head, first, n, value)[..],
                        "layer {layer} head {head} block {i} differs"
                    );
                    checked += n;
                }
            }
        }
    }
    let read_s = t.elapsed().as_secs_f64();
    drop(snap);

    let t = Instant::now();
    let report = fsck::check(store.device().as_ref())?;
    let fsck_s = t.elapsed().as_secs_f64();
    ensure!(report.is_clean(), "fsck found problems: {:?}", report.problems);

    println!("ctxfs demo — store {}", path.display());
    println!("  {:<34} {:>10}", "step", "result");
    println!("  {:<34} {:>8.2} s", "mkfs (512 MiB)", mkfs_s);
    println!(
        "  {:<34} {:>8.2} s  ({} tokens × {} layers × {} kv heads, {:.0} MiB/s)",
        "write + commit context",
        write_s,
        TOKENS,
        SHAPE.layers,
        SHAPE.kv_heads,
        kv_bytes / (1 << 20) as f64 / write_s
    );
    println!(
        "  {:<34} {:>8.2} s  ({} vectors verified, {:.0} MiB/s)",
        "reopen + read back all K/V",
        read_s,
        checked,
        kv_bytes / (1 << 20) as f64 / read_s
    );
    println!("  {:<34} {:>8.2} s  ({} blocks, clean)", "fsck", fsck_s, report.blocks_checked);
    println!();
    crate::inspect::run(crate::inspect::Args::summary_of(path), choice)
}
