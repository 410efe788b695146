//! The buffer pool over real stores on the io_uring device (and the mem device where faults
//! are injected).

use ctxfs_buffer::{
    BlockClass, BlockRequest, Blocks, BufferError, BufferPool, DeviceSource, FrameHint, PoolConfig, Prefetcher,
    ResidentBlocks,
};
use ctxfs_vfs::device::{self, FaultPlan, IoOp, MemDevice};
use ctxfs_vfs::{BlockDevice, DType, DeviceChoice, DeviceInfo, FileStream, ModelShape, SplitMix64, Store};
use half::f16;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

const BS: usize = 4096;
const PER_BLOCK: usize = 15; // f16 vectors of dim 128 per block

/// A real device that counts submissions and operations, to check batching.
struct Counting {
    inner: Arc<dyn BlockDevice>,
    submits: AtomicU64,
    ops: AtomicU64,
}

impl BlockDevice for Counting {
    fn geometry(&self) -> device::Geometry {
        self.inner.geometry()
    }
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }
    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<std::io::Result<()>> {
        self.submits.fetch_add(1, Ordering::Relaxed);
        self.ops.fetch_add(ops.len() as u64, Ordering::Relaxed);
        self.inner.submit(ops)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The value a vector element has: a function of (context, layer, head, stream, token, dim).
fn element(ctx: u32, head: u16, stream: u8, token: usize, dim: usize) -> f16 {
    let x = (ctx as usize * 7919 + head as usize * 104729 + stream as usize * 31 + token * 131 + dim) % 2048;
    f16::from_f32(x as f32 / 64.0 - 16.0)
}

fn block_payload(ctx: u32, head: u16, stream: u8, first: usize, n: usize) -> Vec<u8> {
    (first..first + n)
        .flat_map(|t| (0..128).map(move |d| element(ctx, head, stream, t, d)))
        .flat_map(|x| x.to_le_bytes())
        .collect()
}

/// A store with `contexts` contexts of one layer and two kv heads, `tokens` tokens each:
/// keys in the index streams, values in the data streams.
fn build(dev: Arc<dyn BlockDevice>, contexts: u32, tokens: usize) -> Store {
    let store = ctxfs_vfs::format(dev).unwrap();
    let shape = ModelShape { layers: 1, q_heads: 4, kv_heads: 2, head_dim: 128, dtype: DType::F16 };
    let mut txn = store.begin().unwrap();
    for c in 1..=contexts {
        let name = format!("ctx{c}");
        txn.create_context(&name, shape, &[]).unwrap();
        for head in 0..2u16 {
            for first in (0..tokens).step_by(PER_BLOCK) {
                let n = PER_BLOCK.min(tokens - first);
                txn.append_block(&name, 0, head, FileStream::Index, &block_payload(c, head, 0, first, n)).unwrap();
                txn.append_block(&name, 0, head, FileStream::Data, &block_payload(c, head, 1, first, n)).unwrap();
            }
        }
    }
    txn.commit().unwrap();
    store
}

fn real_store(dir: &tempfile::TempDir, mib: u64, contexts: u32, tokens: usize) -> (Arc<Counting>, Store) {
    let path = dir.path().join("store.img");
    std::fs::File::create(&path).unwrap().set_len(mib << 20).unwrap();
    let inner: Arc<dyn BlockDevice> =
        Arc::from(device::open_path(&path, DeviceChoice::Uring, BS, ctxfs_vfs::Access::Write).unwrap());
    let dev = Arc::new(Counting { inner, submits: AtomicU64::new(0), ops: AtomicU64::new(0) });
    let store = build(dev.clone(), contexts, tokens);
    (dev, store)
}

/// A block's request and what it holds: (context, head, stream, first token).
type Located = (BlockRequest, (u32, u16, u8, usize));

/// One data stream of `blocks` blocks written alone (context 1, layer 0, head 0): past its
/// first 16 blocks, its blocks are adjacent on the device. Its requests, in logical order.
fn lone_data_stream(store: &Store, blocks: usize) -> Vec<Located> {
    let shape = ModelShape { layers: 1, q_heads: 4, kv_heads: 2, head_dim: 128, dtype: DType::F16 };
    let mut txn = store.begin().unwrap();
    txn.create_context("ctx1", shape, &[]).unwrap();
    for first in (0..blocks * PER_BLOCK).step_by(PER_BLOCK) {
        txn.append_block("ctx1", 0, 0, FileStream::Data, &block_payload(1, 0, 1, first, PER_BLOCK)).unwrap();
    }
    txn.commit().unwrap();
    let all = requests(store, 1, 0, FileStream::Data);
    assert!(all[16..].windows(2).all(|w| w[0].0.block + 1 == w[1].0.block), "the blocks are adjacent");
    all
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// Every block request of one stream, with (context, head, stream) to know its contents.
fn requests(store: &Store, ctx: u32, head: u16, which: FileStream) -> Vec<Located> {
    let snap = store.snapshot();
    let c = snap.context(&format!("ctx{ctx}")).unwrap();
    let s = c.stream(0, head, which).unwrap();
    let tag = if which == FileStream::Index { 0 } else { 1 };
    (0..s.blocks())
        .map(|l| (BlockRequest::new(s.locate(l).unwrap()), (ctx, head, tag, l as usize * PER_BLOCK)))
        .collect()
}

/// A stream's blocks made from its map on demand are the requests the stream lists, block
/// for block, narrowed as slices narrow, and read through the pool to the same contents;
/// the map takes a fraction of the bytes the listed requests do.
#[test]
fn blocks_made_from_a_stream_map_are_the_requests_it_lists() {
    let dir = tmp();
    let tokens = 40 * PER_BLOCK + 7;
    let (dev, store) = real_store(&dir, 64, 2, tokens);
    let pool = pool(dev, 8 << 20, 0.5);
    let snap = store.snapshot();
    for (ctx, head, which) in [(1, 0, FileStream::Index), (2, 1, FileStream::Data)] {
        let listed = requests(&store, ctx, head, which);
        let refs = snap.context(&format!("ctx{ctx}")).unwrap().stream(0, head, which).unwrap().refs();
        let blocks = Blocks::of(&refs);
        assert_eq!(blocks.len(), listed.len());
        assert_eq!(blocks.to_vec(), listed.iter().map(|l| l.0).collect::<Vec<_>>());
        assert_eq!(blocks.get(listed.len()), None, "past the end");
        let part = blocks.range(5..17);
        assert_eq!((part.len(), part.first(), part.at(11)), (12, Some(listed[5].0), listed[16].0));
        assert_eq!(part.skip(10).to_vec(), vec![listed[15].0, listed[16].0]);
        // Even written block by block, interleaved with three other streams (an import writes
        // long runs), the map takes under half of what the listed requests do.
        let listed_bytes = listed.len() * std::mem::size_of::<BlockRequest>();
        assert!(refs.memory_bytes() < listed_bytes / 2, "{} bytes against {listed_bytes}", refs.memory_bytes());
        let reqs = part.to_vec();
        for (g, (_, key)) in pool.get_many(&reqs).into_iter().zip(&listed[5..17]) {
            assert_eq!(g.unwrap().as_f16(), expected(*key, tokens).as_slice());
        }
    }
}

fn expected(key: (u32, u16, u8, usize), tokens: usize) -> Vec<f16> {
    let (ctx, head, stream, first) = key;
    let n = PER_BLOCK.min(tokens - first);
    (first..first + n).flat_map(|t| (0..128).map(move |d| element(ctx, head, stream, t, d))).collect()
}

fn pool(dev: Arc<dyn BlockDevice>, budget: u64, data_fraction: f64) -> BufferPool {
    let config =
        PoolConfig { budget_bytes: budget, data_fraction, wait: Duration::from_secs(10), ..Default::default() };
    BufferPool::new(Arc::new(DeviceSource::new(dev)), config).unwrap()
}

#[test]
fn stress_eight_threads_pin_both_kinds_and_hold_some_resident_within_five_percent_of_the_data() {
    let dir = tmp();
    let tokens = 6000;
    let (dev, store) = real_store(&dir, 64, 4, tokens);
    let mut all = Vec::new();
    for ctx in 1..=4 {
        for head in 0..2 {
            all.extend(requests(&store, ctx, head, FileStream::Index));
            all.extend(requests(&store, ctx, head, FileStream::Data));
        }
    }
    let data_bytes = (all.len() * BS) as u64;
    let budget = data_bytes / 20;
    let pool = Arc::new(pool(dev, budget, 0.5));
    let all = Arc::new(all);
    let (checked, holds) = (AtomicU64::new(0), AtomicU64::new(0));
    std::thread::scope(|s| {
        for t in 0..8u64 {
            let (pool, all, checked, holds) = (pool.clone(), all.clone(), &checked, &holds);
            s.spawn(move || {
                let mut rng = SplitMix64::new(t);
                // Even threads also hold a few index blocks resident, a new set every 8 rounds.
                let mut held: Option<(ResidentBlocks, Vec<usize>)> = None;
                for round in 0..400 {
                    if t % 2 == 0 && round % 8 == 0 {
                        drop(held.take());
                        let picks: Vec<usize> = (0..3)
                            .map(|_| loop {
                                let i = rng.below(all.len() as u64) as usize;
                                if all[i].0.class() == BlockClass::Index {
                                    break i;
                                }
                            })
                            .collect();
                        let reqs: Vec<BlockRequest> = picks.iter().map(|&i| all[i].0).collect();
                        held =
                            pool.make_resident(&reqs).unwrap_or_else(|e| panic!("thread {t}: {e}")).map(|r| (r, picks));
                        holds.fetch_add(u64::from(held.is_some()), Ordering::Relaxed);
                    }
                    if let Some((r, picks)) = &held {
                        for (j, &i) in picks.iter().enumerate() {
                            assert_eq!(resident_f16(r, j), expected(all[i].1, tokens), "resident block {i} changed");
                        }
                    }
                    // A few blocks at a time, held together, both kinds mixed.
                    let picks: Vec<usize> =
                        (0..1 + rng.below(4) as usize).map(|_| rng.below(all.len() as u64) as usize).collect();
                    let reqs: Vec<BlockRequest> = picks.iter().map(|&i| all[i].0).collect();
                    let guards = pool.get_many(&reqs);
                    for (g, &i) in guards.iter().zip(&picks) {
                        let g = g.as_ref().unwrap_or_else(|e| panic!("thread {t}: {e}"));
                        assert_eq!(g.as_f16(), &expected(all[i].1, tokens)[..], "wrong bytes for block {}", g.block());
                        checked.fetch_add(g.payload().len() as u64, Ordering::Relaxed);
                    }
                    let st = pool.stats();
                    assert!(st.allocated_bytes <= budget, "allocated {} > budget {budget}", st.allocated_bytes);
                    assert!(st.index.resident_frames <= st.index.capacity_frames);
                    assert!(st.data.resident_frames <= st.data.capacity_frames);
                }
            });
        }
    });
    let st = pool.stats();
    assert_eq!(st.index.resident_pins, 0, "every hold was released");
    assert_eq!(holds.load(Ordering::Relaxed), 4 * 50, "every hold requested fit under the reserve");
    assert!(st.index.evictions > 0 && st.data.evictions > 0, "the budget must force evictions: {st:?}");
    assert!(checked.load(Ordering::Relaxed) > 0);
    println!("stress: {st:?}");
}

#[test]
fn batches_that_each_fit_the_data_area_but_not_together_all_succeed() {
    // Six threads pin batches of 6 of an 8-frame data area: two that each took some frames
    // and waited for the rest would wait on each other until both failed.
    let dir = tmp();
    let tokens = 6000;
    let (dev, store) = real_store(&dir, 64, 2, tokens);
    let data: Vec<Located> = (1..=2).flat_map(|ctx| requests(&store, ctx, 0, FileStream::Data)).collect();
    let config = PoolConfig {
        budget_bytes: (16 * BS) as u64,
        data_fraction: 0.5,
        wait: Duration::from_secs(2),
        ..Default::default()
    };
    let pool = BufferPool::new(Arc::new(DeviceSource::new(dev)), config).unwrap();
    assert_eq!(pool.frames(BlockClass::Data), 8);
    let start = Barrier::new(6);
    std::thread::scope(|s| {
        for t in 0..6u64 {
            let (pool, data, start) = (&pool, &data, &start);
            s.spawn(move || {
                let mut rng = SplitMix64::new(t);
                start.wait();
                for _ in 0..100 {
                    let mut picks: Vec<usize> = Vec::new();
                    while picks.len() < 6 {
                        let i = rng.below(data.len() as u64) as usize;
                        if !picks.contains(&i) {
                            picks.push(i);
                        }
                    }
                    let reqs: Vec<BlockRequest> = picks.iter().map(|&i| data[i].0).collect();
                    for (g, &i) in pool.get_many(&reqs).iter().zip(&picks) {
                        let g = g.as_ref().unwrap_or_else(|e| panic!("thread {t}: {e}"));
                        assert_eq!(g.as_f16(), &expected(data[i].1, tokens)[..], "wrong bytes for block {}", g.block());
                    }
                }
            });
        }
    });
}

#[test]
fn streaming_every_data_block_evicts_no_index_block() {
    let dir = tmp();
    let tokens = 15 * 400;
    let (dev, store) = real_store(&dir, 64, 1, tokens);
    let index: Vec<_> = (0..2).flat_map(|h| requests(&store, 1, h, FileStream::Index)).collect();
    let data: Vec<_> = (0..2).flat_map(|h| requests(&store, 1, h, FileStream::Data)).collect();
    // The index fits; the data area is a tenth of the data.
    let data_frames = data.len() / 10;
    let budget = ((index.len() + data_frames) * BS) as u64;
    let pool = pool(dev, budget, data_frames as f64 / (index.len() + data_frames) as f64);
    for chunk in index.chunks(64) {
        let reqs: Vec<_> = chunk.iter().map(|r| r.0).collect();
        assert!(pool.get_many(&reqs).iter().all(|g| g.is_ok()));
    }
    let before = pool.stats();
    assert_eq!(before.index.resident_frames, index.len() as u64);
    for chunk in data.chunks(32) {
        let reqs: Vec<_> = chunk.iter().map(|r| r.0).collect();
        for (g, r) in pool.get_many(&reqs).iter().zip(chunk) {
            assert_eq!(g.as_ref().unwrap().as_f16(), &expected(r.1, tokens)[..]);
        }
    }
    let after = pool.stats();
    assert_eq!(after.index.evictions, 0, "streaming data pushed index blocks out");
    assert_eq!(after.index.resident_frames, index.len() as u64);
    assert!(after.data.evictions >= (data.len() - data_frames) as u64);
    // Every index block is still a hit.
    let reqs: Vec<_> = index.iter().map(|r| r.0).collect();
    let hits = pool.stats().index.hits;
    for chunk in reqs.chunks(64) {
        pool.get_many(chunk);
    }
    assert_eq!(pool.stats().index.hits - hits, index.len() as u64);
    assert_eq!(pool.stats().index.misses, before.index.misses);
}

#[test]
fn a_batch_of_misses_is_one_submission_with_adjacent_blocks_coalesced() {
    let dir = tmp();
    let (dev, store) = real_store(&dir, 64, 1, 15 * 600);
    let data = requests(&store, 1, 0, FileStream::Data);
    let pool = pool(dev.clone(), (2048 * BS) as u64, 0.5);
    // 300 selected blocks: runs of 3 neighbours, as clustered critical tokens give.
    let picks: Vec<usize> = (0..100).flat_map(|i| [i * 6, i * 6 + 1, i * 6 + 2]).collect();
    let reqs: Vec<BlockRequest> = picks.iter().map(|&i| data[i].0).collect();
    let (s0, o0) = (dev.submits.load(Ordering::Relaxed), dev.ops.load(Ordering::Relaxed));
    let guards = pool.get_many(&reqs);
    assert!(guards.iter().all(|g| g.is_ok()));
    let (submits, ops) = (dev.submits.load(Ordering::Relaxed) - s0, dev.ops.load(Ordering::Relaxed) - o0);
    assert_eq!(submits, 1, "one submission for the whole batch");
    // 100 runs of 3, each one coalesced read.
    assert_eq!(ops, 100, "{ops} operations for 300 blocks in 100 runs");
    assert_eq!(pool.stats().data.misses, 300);
    drop(guards);
    // The same batch again: all hits since then, half of everything since the pool was made.
    let before = pool.stats();
    assert!(pool.get_many(&reqs).iter().all(|g| g.is_ok()));
    assert_eq!(pool.stats().hit_ratio_since(&before), 1.0);
    assert_eq!(pool.stats().data.hit_ratio(), 0.5);
    // Duplicates in a request are read once.
    let dup = vec![data[599].0; 5];
    let s0 = dev.submits.load(Ordering::Relaxed);
    assert!(pool.get_many(&dup).iter().all(|g| g.is_ok()));
    assert_eq!(dev.submits.load(Ordering::Relaxed) - s0, 1);
    assert_eq!(pool.stats().data.misses, 301);
}

#[test]
fn long_runs_are_split_and_runs_past_the_staging_buffer_are_read_block_by_block() {
    use ctxfs_buffer::{RUN_BLOCKS, STAGING_BUFFER_BYTES};
    const STAGING_BLOCKS: usize = STAGING_BUFFER_BYTES / BS;
    let dir = tmp();
    let blocks = STAGING_BLOCKS + 276;
    let (dev, store) = real_store(&dir, 64, 0, 0);
    let written = blocks + 16;
    let all = lone_data_stream(&store, written);
    let data = &all[written - blocks..];
    let pool = pool(dev.clone(), (4 * blocks * BS) as u64, 0.5);
    let o0 = dev.ops.load(Ordering::Relaxed);
    let reqs: Vec<BlockRequest> = data.iter().rev().map(|r| r.0).collect();
    for (g, r) in pool.get_many(&reqs).iter().zip(data.iter().rev()) {
        assert_eq!(g.as_ref().unwrap().as_f16(), &expected(r.1, PER_BLOCK * written)[..]);
    }
    // Runs of RUN_BLOCKS fill the staging buffer; the blocks after it are read one by one.
    let staged = STAGING_BLOCKS / RUN_BLOCKS;
    assert_eq!(dev.ops.load(Ordering::Relaxed) - o0, (staged + blocks - staged * RUN_BLOCKS) as u64);
}

/// Blocks one apart (a vector file's key blocks, each beside its value block) are read as
/// one span, the blocks between them included; blocks two apart are not.
#[test]
fn blocks_one_apart_are_read_in_one_span_and_a_bad_block_between_fails_nothing() {
    use ctxfs_buffer::{RUN_BLOCKS, RUN_GAP};
    assert_eq!(RUN_GAP, 1);
    let dir = tmp();
    let (dev, store) = real_store(&dir, 64, 0, 0);
    let written = 400;
    let all = lone_data_stream(&store, written);
    let data = &all[16..];
    let pool = pool(dev.clone(), (4 * written * BS) as u64, 0.5);
    let check = |picked: &[&Located]| {
        let reqs: Vec<BlockRequest> = picked.iter().map(|r| r.0).collect();
        let o0 = dev.ops.load(Ordering::Relaxed);
        for (g, r) in pool.get_many(&reqs).iter().zip(picked) {
            assert_eq!(g.as_ref().unwrap().as_f16(), &expected(r.1, PER_BLOCK * written)[..]);
        }
        dev.ops.load(Ordering::Relaxed) - o0
    };
    // Every other block: 96 blocks over 191, read in spans of at most RUN_BLOCKS blocks.
    let every_other: Vec<_> = data.iter().step_by(2).take(96).collect();
    let per_span = RUN_BLOCKS.div_ceil(2);
    assert_eq!(check(&every_other), 96usize.div_ceil(per_span) as u64);
    // Every third block, beyond those: one read each.
    let every_third: Vec<_> = data[200..].iter().step_by(3).take(20).collect();
    assert_eq!(check(&every_third), 20);
    assert_eq!(pool.stats().data.misses, 116, "the blocks between were read, not cached");

    // A block between two asked for that cannot be read: the span fails and its blocks are
    // read one by one, so the two load and nothing names the bad block.
    let mem = Arc::new(MemDevice::new(BS, 2048));
    let data = lone_data_stream(&ctxfs_vfs::format(mem.clone()).unwrap(), 40);
    let pool = self::pool(mem.clone(), (64 * BS) as u64, 0.5);
    mem.set_faults(FaultPlan { bad_read_blocks: [data[21].0.block].into(), ..Default::default() });
    let results = pool.get_many(&[data[20].0, data[22].0]);
    assert_eq!(results[0].as_ref().unwrap().as_f16(), &expected(data[20].1, PER_BLOCK * 40)[..]);
    assert_eq!(results[1].as_ref().unwrap().as_f16(), &expected(data[22].1, PER_BLOCK * 40)[..]);
}

/// A block read again after its eviction is a miss but not a first read: first reads count
/// the misses that no cache could have saved, in each class.
#[test]
fn first_reads_count_each_block_once_however_often_it_is_read() {
    let dir = tmp();
    let (dev, store) = real_store(&dir, 32, 1, 15 * 100);
    // 20 data frames; two passes over 60 data blocks, then 10 index blocks twice.
    let data: Vec<BlockRequest> = requests(&store, 1, 0, FileStream::Data).into_iter().map(|r| r.0).take(60).collect();
    let p = pool(dev, (40 * BS) as u64, 0.5);
    for _ in 0..2 {
        for chunk in data.chunks(10) {
            assert!(p.get_many(chunk).iter().all(|g| g.is_ok()));
        }
    }
    let st = p.stats().data;
    assert_eq!((st.misses, st.first_reads), (120, 60), "{st:?}");
    let index: Vec<BlockRequest> =
        requests(&store, 1, 0, FileStream::Index).into_iter().map(|r| r.0).take(10).collect();
    for _ in 0..2 {
        assert!(p.get_many(&index).iter().all(|g| g.is_ok()));
    }
    let st = p.stats();
    assert_eq!((st.index.misses, st.index.first_reads, st.index.hits), (10, 10, 10), "{st:?}");
    assert_eq!(st.data.first_reads, 60, "the index reads left the data class's count alone");
}

#[test]
fn two_threads_missing_the_same_block_share_one_read() {
    let dir = tmp();
    let (dev, store) = real_store(&dir, 32, 1, 15 * 100);
    let data = requests(&store, 1, 1, FileStream::Data);
    let pool = pool(dev, (64 * BS) as u64, 0.5);
    for (round, (req, _)) in data.iter().take(20).enumerate() {
        let req = *req;
        let barrier = Barrier::new(4);
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    barrier.wait();
                    assert_eq!(pool.get(&req).unwrap().block(), req.block);
                });
            }
        });
        let st = pool.stats();
        assert_eq!(st.data.misses, round as u64 + 1, "round {round}: {st:?}");
        assert_eq!(st.data.hits, 3 * (round as u64 + 1));
    }
}

#[test]
fn io_errors_and_checksum_failures_reach_every_waiter_and_are_not_cached() {
    let mem = Arc::new(MemDevice::new(BS, 2048));
    let store = build(mem.clone(), 1, 15 * 50);
    let data = requests(&store, 1, 0, FileStream::Data);
    let pool = pool(mem.clone(), (64 * BS) as u64, 0.5);
    let bad = data[3].0;
    mem.set_faults(FaultPlan { bad_read_blocks: [bad.block].into(), ..Default::default() });
    let results = pool.get_many(&[data[2].0, bad, data[4].0]);
    assert!(results[0].is_ok() && results[2].is_ok(), "neighbours of a bad block still load");
    let err = results[1].as_ref().err().unwrap();
    assert_eq!(err.block(), Some(bad.block), "{err}");
    drop(results);
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| assert_eq!(pool.get(&bad).err().and_then(|e| e.block()), Some(bad.block)));
        }
    });
    // The error was not cached: once the device heals, the block reads.
    mem.set_faults(FaultPlan::default());
    assert_eq!(pool.get(&bad).unwrap().as_f16(), &expected((1, 0, 1, 3 * PER_BLOCK), 750)[..]);

    // A checksum failure: the request expects another CRC (as after a lost write).
    let mut wrong = data[10].0;
    wrong.expect.crc ^= 1;
    let e = pool.get(&wrong).err().unwrap();
    assert!(matches!(&e, BufferError::Block(inner) if matches!(**inner, ctxfs_vfs::Error::Damaged { .. })), "{e}");
    assert!(pool.get(&data[10].0).is_ok(), "the bad attempt left nothing behind");
}

#[test]
fn data_area_resists_a_scan_and_index_evicts_the_coldest_context_first() {
    let dir = tmp();
    let (dev, store) = real_store(&dir, 64, 3, 15 * 200);
    // Data: 40 frames. Make 8 blocks hot (hit twice), then scan 400 others once.
    let data = requests(&store, 1, 0, FileStream::Data);
    let p = pool(dev.clone(), (80 * BS) as u64, 0.5);
    let hot: Vec<BlockRequest> = data[..8].iter().map(|r| r.0).collect();
    for _ in 0..2 {
        assert!(p.get_many(&hot).iter().all(|g| g.is_ok()));
    }
    let scan: Vec<BlockRequest> =
        (0..2).flat_map(|h| requests(&store, 2, h, FileStream::Data)).map(|r| r.0).take(400).collect();
    for chunk in scan.chunks(16) {
        assert!(p.get_many(chunk).iter().all(|g| g.is_ok()));
    }
    let misses = p.stats().data.misses;
    assert!(p.get_many(&hot).iter().all(|g| g.is_ok()));
    assert_eq!(p.stats().data.misses, misses, "hot blocks were scanned out");

    // Index: 40 frames; contexts 1 and 2 fill them, context 1 is used last; loading context
    // 3 must evict context 2's blocks, not context 1's.
    let idx = |c| requests(&store, c, 0, FileStream::Index).into_iter().map(|r| r.0).take(20).collect::<Vec<_>>();
    let (a, b, c) = (idx(1), idx(2), idx(3));
    assert!(p.get_many(&b).iter().all(|g| g.is_ok()));
    assert!(p.get_many(&a).iter().all(|g| g.is_ok()));
    assert!(p.get_many(&a).iter().all(|g| g.is_ok())); // context 1 is the warmest
    assert!(p.get_many(&c[..10]).iter().all(|g| g.is_ok()));
    let misses = p.stats().index.misses;
    assert!(p.get_many(&a).iter().all(|g| g.is_ok()));
    assert_eq!(p.stats().index.misses, misses, "the warm context lost blocks");
    assert!(p.get_many(&b).iter().all(|g| g.is_ok()));
    assert!(p.stats().index.misses > misses, "the cold context kept all its blocks");
}

#[test]
fn a_block_announced_for_use_outlives_one_eviction_round() {
    let dir = tmp();
    let (dev, store) = real_store(&dir, 64, 1, 15 * 200);
    // Data: 40 frames, filled by blocks read once each (all on probation, oldest first).
    let data: Vec<BlockRequest> = requests(&store, 1, 0, FileStream::Data).into_iter().map(|r| r.0).collect();
    let p = pool(dev.clone(), (80 * BS) as u64, 0.5);
    assert_eq!(p.frames(BlockClass::Data), 40);
    assert!(p.get_many(&data[..40]).iter().all(|g| g.is_ok()));
    assert!(p.will_use(data[0].block), "a block in a frame");
    assert!(!p.will_use(data[40].block), "a block never read");
    // Twenty more blocks evict twenty of the oldest: the announced one is passed over.
    for chunk in data[40..60].chunks(4) {
        assert!(p.get_many(chunk).iter().all(|g| g.is_ok()));
    }
    let misses = p.stats().data.misses;
    assert!(p.get(&data[0]).is_ok());
    assert_eq!(p.stats().data.misses, misses, "the announced block was evicted");
    assert!(p.get(&data[1]).is_ok());
    assert_eq!(p.stats().data.misses, misses + 1, "the next oldest block stayed: nothing was evicted");
}

#[test]
fn requests_that_cannot_fit_fail_clearly() {
    let dir = tmp();
    let (dev, store) = real_store(&dir, 32, 1, 15 * 100);
    let data: Vec<BlockRequest> = requests(&store, 1, 0, FileStream::Data).into_iter().map(|r| r.0).collect();
    let config = PoolConfig {
        budget_bytes: (8 * BS) as u64,
        data_fraction: 0.5,
        wait: Duration::from_millis(50),
        ..Default::default()
    };
    let p = BufferPool::new(Arc::new(DeviceSource::new(dev)), config).unwrap();
    let too_many = p.get_many(&data[..5]);
    assert!(too_many
        .iter()
        .all(|g| matches!(g, Err(BufferError::TooLarge { class: BlockClass::Data, needed: 5, frames: 4 }))));
    // Every data frame pinned by this thread: the next miss waits, then fails.
    let pinned = p.get_many(&data[..4]);
    assert!(pinned.iter().all(|g| g.is_ok()));
    let err = p.get(&data[4]).err().unwrap();
    assert!(matches!(err, BufferError::Exhausted { class: BlockClass::Data, frames: 4, .. }), "{err}");
    drop(pinned);
    assert!(p.get(&data[4]).is_ok(), "frames free again once unpinned");
    // A block past the end of the device (a corrupt reference) fails with its number, at once.
    let beyond = BlockRequest { block: (32 << 20) / BS as u64, ..data[0] };
    for res in [p.get(&beyond).err(), p.get_many(&[data[0], beyond]).pop().unwrap().err()] {
        let err = res.expect("a block beyond the device is an error");
        assert_eq!(err.block(), Some(beyond.block), "{err}");
        assert!(err.to_string().contains("beyond the end of the device"), "{err}");
    }
    assert!(p.get(&data[0]).is_ok());
    assert!(BufferPool::new(
        Arc::new(DeviceSource::new(Arc::new(MemDevice::new(BS, 64)))),
        PoolConfig { budget_bytes: 4096, ..Default::default() }
    )
    .is_err());
}

#[test]
fn opening_a_context_loads_its_whole_index_and_nothing_else() {
    let dir = tmp();
    let (dev, store) = real_store(&dir, 32, 2, 15 * 100);
    let p = pool(dev, (1024 * BS) as u64, 0.2);
    let n = p.open_context(&store.snapshot(), "ctx2").unwrap();
    assert_eq!(n, 200, "two heads of 100 index blocks");
    let st = p.stats();
    assert_eq!((st.index.misses, st.index.resident_frames, st.data.misses), (200, 200, 0));
    // Every index block of ctx2 is now a hit; ctx1 was not touched.
    for r in requests(&store, 2, 1, FileStream::Index) {
        p.get(&r.0).unwrap();
    }
    assert_eq!(p.stats().index.misses, 200);
    assert!(matches!(p.open_context(&store.snapshot(), "nope"), Err(BufferError::Block(_))));
}

#[test]
fn a_frame_hint_finds_its_block_and_a_stale_one_finds_nothing() {
    let dir = tmp();
    let (dev, store) = real_store(&dir, 16, 1, 15 * 40);
    let data = requests(&store, 1, 0, FileStream::Data);
    // Two data frames: a third block evicts one of the first two.
    let p = pool(dev.clone(), (8 * BS) as u64, 0.25);
    let hints: Vec<FrameHint> = data.iter().map(|_| FrameHint::default()).collect();
    assert!(p.get_at_hint(&data[0].0, &hints[0]).is_none(), "an empty hint is no hit");
    for (i, (req, _)) in data[..2].iter().enumerate() {
        hints[i].remember(&p.get(req).unwrap());
    }
    let misses = p.stats().data.misses;
    for (i, (req, key)) in data[..2].iter().enumerate() {
        let g = p.get_at_hint(req, &hints[i]).expect("resident where the hint says");
        assert_eq!(g.as_f16(), &expected(*key, 15 * 40)[..]);
    }
    assert_eq!(p.stats().data.misses, misses, "hinted hits read nothing");
    drop(p.get(&data[2].0).unwrap());
    let evicted = (0..2).filter(|&i| p.get_at_hint(&data[i].0, &hints[i]).is_none()).count();
    assert_eq!(evicted, 1, "the block evicted for the third is not found at its old frame");
    // The evicted block's old frame now holds the third block: its hint is stale, not wrong.
    let stale = (0..2).find(|&i| p.get_at_hint(&data[i].0, &hints[i]).is_none()).unwrap();
    assert!(p.get_at_hint(&data[2].0, &hints[stale]).is_some(), "the frame was reused for block 3");
}

/// The f16 elements of a resident block's payload.
fn resident_f16(r: &ResidentBlocks, i: usize) -> Vec<f16> {
    r.payload(i).chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]])).collect()
}

#[test]
fn resident_blocks_survive_any_pressure_until_dropped_and_are_bounded() {
    let dir = tmp();
    let tokens = 15 * 300;
    let (dev, store) = real_store(&dir, 32, 2, tokens);
    // 312 index frames (reserve: 128, the floor) and 78 data frames.
    let p = Arc::new(pool(dev, (390 * BS) as u64, 0.2));
    assert_eq!(p.frames(BlockClass::Index), 312);
    let held_reqs = requests(&store, 1, 0, FileStream::Index);
    let resident = p.make_resident(&held_reqs.iter().map(|r| r.0).take(50).collect::<Vec<_>>()).unwrap().unwrap();
    assert_eq!((resident.len(), p.stats().index.resident_pins, p.pinnable(BlockClass::Index)), (50, 50, 262));
    // 135 more would leave 127 frames, one short of the reserve.
    let more: Vec<BlockRequest> = held_reqs.iter().map(|r| r.0).skip(50).take(135).collect();
    assert!(p.make_resident(&more).unwrap().is_none(), "residency past the reserve is refused");
    assert_eq!(p.stats().index.resident_pins, 50, "a refusal holds nothing");
    // Context 2's 600 index blocks stream through the 262 frames left: none evicts a
    // resident one.
    let stream = || {
        for head in 0..2 {
            for (req, _) in requests(&store, 2, head, FileStream::Index) {
                drop(p.get(&req).unwrap());
            }
        }
    };
    stream();
    assert!(p.stats().index.evictions >= 338);
    for (i, (_, key)) in held_reqs.iter().take(50).enumerate() {
        assert_eq!(resident_f16(&resident, i), expected(*key, tokens), "resident block {i} changed under pressure");
    }
    let misses = p.stats().index.misses;
    for (req, _) in held_reqs.iter().take(50) {
        drop(p.get(req).unwrap());
    }
    assert_eq!(p.stats().index.misses, misses, "resident blocks are hits through the page table too");
    // Dropped, they are evictable again.
    drop(resident);
    assert_eq!((p.stats().index.resident_pins, p.pinnable(BlockClass::Index)), (0, 312));
    stream();
    let reread = held_reqs.iter().take(50).filter(|(req, _)| p.get(req).unwrap().read_here()).count();
    assert!(reread > 0, "released blocks were evicted by the next stream");
    // Data blocks never become resident.
    let data = requests(&store, 1, 0, FileStream::Data);
    assert!(matches!(p.make_resident(&[data[0].0]), Err(BufferError::Config(_))));
}

#[test]
fn a_prefetch_reads_once_in_one_submission_and_its_first_use_is_no_hit() {
    let dir = tmp();
    let tokens = 15 * 40;
    let (dev, store) = real_store(&dir, 16, 1, tokens);
    let p = Arc::new(pool(dev.clone(), (128 * BS) as u64, 0.5));
    let prefetcher = Prefetcher::start(p.clone());
    let data = requests(&store, 1, 0, FileStream::Data);
    drop(p.get(&data[0].0).unwrap());
    let submits = dev.submits.load(Ordering::Relaxed);
    let wanted: Vec<BlockRequest> = data[..10].iter().chain(&data[5..10]).map(|r| r.0).collect();
    assert_eq!(prefetcher.submit(wanted.clone()).wait(), 9, "block 0 was here; repeats are read once");
    assert_eq!(dev.submits.load(Ordering::Relaxed) - submits, 1, "one submission");
    assert_eq!(prefetcher.submit(wanted).wait(), 0, "all here now");
    let (hits, misses) = (p.stats().data.hits, p.stats().data.misses);
    assert_eq!(misses, 10);
    for (req, key) in &data[1..10] {
        let g = p.get(req).unwrap();
        assert!(!g.read_here());
        assert_eq!(g.as_f16(), &expected(*key, tokens)[..]);
    }
    assert_eq!(p.stats().data.hits, hits, "the use a block was read ahead for is not a hit");
    for (req, _) in &data[1..10] {
        drop(p.get(req).unwrap());
    }
    assert_eq!((p.stats().data.hits, p.stats().data.misses), (hits + 9, 10), "later uses are");
    // Requests queued from many threads at once are all answered, each block read once.
    let all: Vec<BlockRequest> = data.iter().map(|r| r.0).collect();
    let read: usize = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                s.spawn({
                    let (prefetcher, all) = (&prefetcher, &all);
                    move || prefetcher.submit(all[t * 5..].to_vec()).wait()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(read, data.len() - 10);
    assert_eq!(p.stats().data.misses as usize, data.len());
}

#[test]
fn index_eviction_frees_a_batch_of_the_coldest_context_per_ranking() {
    let dir = tmp();
    let (dev, store) = real_store(&dir, 256, 2, 15 * 2000);
    // 2,560 index frames: one ranking frees the victim and 40 more (1/64 of the area).
    let p = pool(dev, (3200 * BS) as u64, 0.2);
    assert_eq!(p.frames(BlockClass::Index), 2560);
    let one: Vec<BlockRequest> =
        (0..2).flat_map(|h| requests(&store, 1, h, FileStream::Index)).map(|r| r.0).take(2560).collect();
    for chunk in one.chunks(256) {
        assert!(p.get_many(chunk).iter().all(|g| g.is_ok()));
    }
    assert_eq!(p.stats().index.evictions, 0);
    let two = requests(&store, 2, 0, FileStream::Index);
    drop(p.get(&two[0].0).unwrap());
    assert_eq!(p.stats().index.evictions, 41, "the victim and a batch of 40 of the same context");
    // The next 40 misses take the freed frames: no eviction, no ranking.
    for (req, _) in &two[1..41] {
        drop(p.get(req).unwrap());
    }
    assert_eq!(p.stats().index.evictions, 41);
    drop(p.get(&two[41].0).unwrap());
    assert_eq!(p.stats().index.evictions, 82);
}

#[test]
fn a_budget_the_system_cannot_map_is_a_config_error() {
    let config = PoolConfig { budget_bytes: 1 << 50, ..Default::default() };
    let err = BufferPool::new(Arc::new(DeviceSource::new(Arc::new(MemDevice::new(BS, 64)))), config).err().unwrap();
    assert!(matches!(&err, BufferError::Config(m) if m.contains("refused")), "{err}");
}

/// A block freed by a commit and written again for another context: a pool that cached its
/// old contents reads the new ones for a request that expects them, and never hands the old
/// ones out under the new reference.
#[test]
fn a_block_written_again_is_read_anew_not_served_from_its_old_frame() {
    let dir = tmp();
    let (dev, store) = real_store(&dir, 16, 1, 30);
    let pool = pool(dev.clone(), 1 << 20, 0.5);
    let old = requests(&store, 1, 0, FileStream::Data);
    for (req, key) in &old {
        let g = pool.get(req).unwrap();
        assert_eq!(bytemuck::cast_slice::<u8, f16>(g.payload()), &expected(*key, 30)[..]);
    }
    // Free ctx1 and write ctx2 until its blocks land where ctx1's were.
    let shape = ModelShape { layers: 1, q_heads: 4, kv_heads: 2, head_dim: 128, dtype: DType::F16 };
    let old_blocks: Vec<u64> = old.iter().map(|(r, _)| r.block).collect();
    let mut txn = store.begin().unwrap();
    txn.delete_context("ctx1").unwrap();
    txn.commit().unwrap();
    for round in 0..4 {
        let name = format!("new{round}");
        let mut txn = store.begin().unwrap();
        txn.create_context(&name, shape, &[]).unwrap();
        for first in (0..30).step_by(PER_BLOCK) {
            txn.append_block(&name, 0, 0, FileStream::Data, &block_payload(9, 0, 1, first, PER_BLOCK)).unwrap();
        }
        txn.commit().unwrap();
    }
    let snap = store.snapshot();
    let reused: Vec<BlockRequest> = snap
        .contexts()
        .flat_map(|c| {
            let s = snap.context(&c.name).unwrap().stream(0, 0, FileStream::Data).unwrap();
            (0..s.blocks()).map(move |l| BlockRequest::new(s.locate(l).unwrap())).collect::<Vec<_>>()
        })
        .filter(|r| old_blocks.contains(&r.block))
        .collect();
    assert!(!reused.is_empty(), "the new contexts reuse ctx1's freed blocks");
    for req in &reused {
        let g = pool.get(req).unwrap();
        let first = req.expect.logical as usize * PER_BLOCK;
        let fresh = bytemuck::cast_slice::<u8, f16>(g.payload()) == &expected((9, 0, 1, first), first + PER_BLOCK)[..];
        assert!(fresh, "block {}: the pool served its contents from before it was written again", req.block);
    }
    // The old reference now fails verification on the device: no stale hit answers it.
    let (stale, _) = old.iter().find(|(r, _)| reused.iter().any(|n| n.block == r.block)).unwrap();
    assert!(pool.get(stale).is_err(), "the block no longer holds what the old reference expects");
}
