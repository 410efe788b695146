//! What the pool costs in resident memory, measured on the process (a binary of its own, so
//! no other test's allocations land in the figures).

use ctxfs_buffer::{BlockRequest, BufferPool, DeviceSource, PoolConfig, PoolStats};
use ctxfs_vfs::{device, DType, DeviceChoice, FileStream, ModelShape};
use std::sync::Arc;

const BS: usize = 4096;

fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[test]
fn frame_buffers_take_the_memory_of_the_blocks_they_hold() {
    const BLOCKS: usize = 8192;
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("store.img");
    std::fs::File::create(&path).unwrap().set_len(64 << 20).unwrap();
    let dev: Arc<dyn ctxfs_vfs::BlockDevice> =
        Arc::from(device::open_path(&path, DeviceChoice::Uring, BS, ctxfs_vfs::Access::Write).unwrap());
    let store = ctxfs_vfs::format(dev.clone()).unwrap();
    let shape = ModelShape { layers: 1, q_heads: 1, kv_heads: 1, head_dim: 128, dtype: DType::F16 };
    let mut txn = store.begin().unwrap();
    txn.create_context("c", shape, &[]).unwrap();
    for b in 0..BLOCKS {
        txn.append_block("c", 0, 0, FileStream::Data, &[b as u8; 3840]).unwrap();
    }
    txn.commit().unwrap();
    let snap = store.snapshot();
    let stream = snap.context("c").unwrap().stream(0, 0, FileStream::Data).unwrap();
    let reqs: Vec<BlockRequest> = (0..BLOCKS as u64).map(|l| BlockRequest::new(stream.locate(l).unwrap())).collect();

    // A 1 GiB pool costs its frame descriptors and table, not its budget.
    let budget = 1u64 << 30;
    let before = resident_bytes();
    let config = PoolConfig { budget_bytes: budget, data_fraction: 0.5, ..Default::default() };
    let pool = BufferPool::new(Arc::new(DeviceSource::new(dev.clone())), config).unwrap();
    let idle = resident_bytes() - before;
    let overhead = PoolStats::overhead((budget / BS as u64) as usize);
    assert!(idle <= overhead + (8 << 20), "an idle pool holds {idle} bytes; its overhead is {overhead}");

    // Holding 32 MiB of blocks takes about 32 MiB, not twice that (one allocation per frame
    // did: the C allocator padded each page-aligned buffer with as much again).
    let before = resident_bytes();
    for (i, chunk) in reqs.chunks(512).enumerate() {
        for (g, l) in pool.get_many(chunk).iter().zip(i * 512..) {
            assert_eq!(g.as_ref().unwrap().payload()[0], l as u8);
        }
    }
    let held = (BLOCKS * BS) as u64;
    let grown = resident_bytes() - before;
    assert!(grown <= held + held / 4 + (8 << 20), "holding {held} bytes of blocks grew the process by {grown}");
    assert_eq!(pool.stats().data.resident_frames, BLOCKS as u64);
    drop(pool);

    // A populated pool (a server's) maps its whole budget when made, and reads add nothing.
    let budget = 2 * held;
    let before = resident_bytes();
    let config = PoolConfig { budget_bytes: budget, data_fraction: 0.6, populate: true, ..Default::default() };
    let pool = BufferPool::new(Arc::new(DeviceSource::new(dev)), config).unwrap();
    let made = resident_bytes() - before;
    assert!(made >= budget, "a populated pool of {budget} bytes mapped {made}");
    let before = resident_bytes();
    for (i, chunk) in reqs.chunks(512).enumerate() {
        for (g, l) in pool.get_many(chunk).iter().zip(i * 512..) {
            assert_eq!(g.as_ref().unwrap().payload()[0], l as u8);
        }
    }
    let grown = resident_bytes().saturating_sub(before);
    assert!(grown <= 8 << 20, "reads into a populated pool grew the process by {grown}");
}
