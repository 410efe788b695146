//! loom models of the pin / unpin / evict / load-in-progress protocol.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p ctxfs-buffer --test loom --release --target-dir target/loom`
//!
//! The block source here is in memory (loom explores thread interleavings and cannot do real
//! I/O); it seals real blocks, so the pool verifies them exactly as it does device blocks.
#![cfg(loom)]

use ctxfs_buffer::{BlockRequest, BlockSource, BufferError, BufferPool, PoolConfig};
use ctxfs_vfs::format::header::seal;
use ctxfs_vfs::format::{BlockHeader, BlockKind, Expect, Owner, StreamTag};
use loom::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

const BS: usize = 4096;
/// Blocks on the in-memory device.
const BLOCKS: u64 = 104;

/// Blocks from 100 on are index blocks; the others data blocks.
fn header(block: u64) -> BlockHeader {
    let index = block >= 100;
    BlockHeader {
        kind: if index { BlockKind::Index } else { BlockKind::Data },
        stream: if index { StreamTag::Index } else { StreamTag::Data },
        owner: Owner::file(1, 0, 0),
        payload_len: 8,
        logical: block,
        generation: 1,
    }
}

fn sealed(block: u64) -> (Vec<u8>, u32) {
    let mut buf = vec![0u8; BS];
    let crc = seal(&mut buf, &header(block), &block.to_le_bytes());
    (buf, crc)
}

fn request(block: u64) -> BlockRequest {
    let h = header(block);
    let crc = sealed(block).1;
    BlockRequest {
        block,
        expect: Expect { kind: h.kind, stream: h.stream, owner: h.owner, logical: h.logical, crc, max_generation: 1 },
    }
}

/// Serves sealed blocks; blocks in `failing` fail with an I/O error. Counts loads per block.
struct Source {
    failing: Vec<u64>,
    loads: AtomicUsize,
}

impl BlockSource for Source {
    fn block_size(&self) -> usize {
        BS
    }
    fn blocks(&self) -> u64 {
        BLOCKS
    }
    fn load(&self, reqs: &[BlockRequest], bufs: &mut [&mut [u8]]) -> Vec<Result<BlockHeader, BufferError>> {
        reqs.iter()
            .zip(bufs.iter_mut())
            .map(|(r, buf)| {
                self.loads.fetch_add(1, Ordering::SeqCst);
                if self.failing.contains(&r.block) {
                    let e = ctxfs_vfs::Error::BlockIo { block: r.block, source: std::io::Error::other("injected") };
                    return Err(BufferError::Block(std::sync::Arc::new(e)));
                }
                buf.copy_from_slice(&sealed(r.block).0);
                Ok(header(r.block))
            })
            .collect()
    }
}

/// One index frame and one data frame.
fn pool(failing: Vec<u64>) -> (std::sync::Arc<Source>, Arc<BufferPool>) {
    let source = std::sync::Arc::new(Source { failing, loads: AtomicUsize::new(0) });
    let config = PoolConfig { budget_bytes: 2 * BS as u64, data_fraction: 0.5, shards: 2, ..Default::default() };
    let pool = BufferPool::new(source.clone(), config).unwrap();
    (source, Arc::new(pool))
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

#[test]
fn two_readers_of_the_same_missing_block_share_one_io() {
    model(|| {
        let (source, pool) = pool(vec![]);
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                loom::thread::spawn(move || {
                    let g = pool.get(&request(5)).expect("the block loads");
                    assert_eq!(g.payload(), &5u64.to_le_bytes());
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(source.loads.load(Ordering::SeqCst), 1, "two readers, one I/O");
        let st = pool.stats();
        assert_eq!((st.data.misses, st.data.hits), (1, 1));
    });
}

#[test]
fn a_frame_being_evicted_cannot_be_pinned() {
    model(|| {
        let (_, pool) = pool(vec![]);
        drop(pool.get(&request(1)).unwrap()); // block 1 resident in the only data frame
        let reader = {
            let pool = pool.clone();
            loom::thread::spawn(move || {
                if let Ok(g) = pool.get(&request(1)) {
                    // While pinned, the frame keeps block 1, whatever the other thread does.
                    let first = g.payload().to_vec();
                    loom::thread::yield_now();
                    assert_eq!(g.block(), 1);
                    assert_eq!(g.payload(), &first[..]);
                    assert_eq!(first, 1u64.to_le_bytes());
                }
            })
        };
        let evictor = {
            let pool = pool.clone();
            loom::thread::spawn(move || match pool.get(&request(2)) {
                Ok(g) => assert_eq!(g.payload(), &2u64.to_le_bytes()),
                Err(e) => assert!(matches!(e, BufferError::Exhausted { .. }), "{e}"),
            })
        };
        reader.join().unwrap();
        evictor.join().unwrap();
    });
}

#[test]
fn an_io_error_wakes_every_waiter_with_the_error() {
    model(|| {
        let (source, pool) = pool(vec![7]);
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let pool = pool.clone();
                loom::thread::spawn(move || match pool.get(&request(7)) {
                    Err(BufferError::Block(e)) => assert_eq!(e.block(), Some(7)),
                    Err(e) => panic!("expected the I/O error, got {e}"),
                    Ok(_) => panic!("a failed read was served as data"),
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let loads = source.loads.load(Ordering::SeqCst);
        assert!((1..=2).contains(&loads), "{loads} loads");
        // Nothing was cached: the frame is free again.
        assert_eq!(pool.stats().data.resident_frames, 0);
    });
}

#[test]
fn a_resident_block_is_never_evicted_or_refilled() {
    model(|| {
        let (_, pool) = pool(vec![]);
        // make_resident needs a std Arc; the pool's own protocol is what loom explores.
        let pool = std::sync::Arc::new(Arc::try_unwrap(pool).ok().expect("only handle"));
        let holder = {
            let pool = pool.clone();
            loom::thread::spawn(move || match pool.make_resident(&[request(101)]) {
                Ok(Some(held)) => {
                    let first = held.payload(0).to_vec();
                    loom::thread::yield_now();
                    assert_eq!(first, 101u64.to_le_bytes());
                    assert_eq!(held.payload(0), &first[..]);
                    Some(held)
                }
                Ok(None) => panic!("one frame, no reserve: residency fits"),
                // The other thread held the only index frame pinned for the whole wait.
                Err(e) => {
                    assert!(matches!(e, BufferError::Exhausted { .. }), "{e}");
                    None
                }
            })
        };
        let evictor = {
            let pool = pool.clone();
            loom::thread::spawn(move || match pool.get(&request(102)) {
                Ok(g) => assert_eq!(g.payload(), &102u64.to_le_bytes()),
                Err(e) => assert!(matches!(e, BufferError::Exhausted { .. }), "{e}"),
            })
        };
        let held = holder.join().unwrap();
        evictor.join().unwrap();
        if let Some(held) = held {
            // The frame still holds block 101, and nothing could take it.
            assert_eq!(held.payload(0), &101u64.to_le_bytes());
            assert_eq!(pool.get(&request(101)).unwrap().payload(), &101u64.to_le_bytes());
            assert!(matches!(pool.get(&request(103)), Err(BufferError::Exhausted { .. })));
            drop(held);
            assert_eq!(pool.stats().index.resident_pins, 0);
            assert_eq!(pool.get(&request(103)).unwrap().payload(), &103u64.to_le_bytes(), "released, it is evictable");
        }
    });
}
