//! A frame: one block-sized buffer and the protocol that guards it.
//!
//! The contents sit behind a per-frame `RwLock`:
//! * a **pin** is a read guard: any number of readers, and the frame cannot change under them;
//! * a **load** holds the write guard from the moment the frame is claimed until its I/O has
//!   completed, so a second reader of the same block blocks on the lock and shares the I/O;
//! * an **eviction** only ever `try_write`s: a pinned or loading frame is never taken, nor
//!   one whose loader has reserved a pin it has yet to take (`reserved`).
//!
//! A reader that found a frame through the page table re-checks, under its read guard, that
//! the frame still holds the block it wanted: the frame may have been evicted and reused
//! between the lookup and the lock.

use crate::arena::FrameBuf;
use crate::request::BufferError;
use crate::sync::{AtomicBool, AtomicU64, Ordering, RwLock};
use ctxfs_vfs::format::BlockHeader;

#[derive(Debug)]
pub(crate) enum FrameState {
    Empty,
    Loading,
    /// Loaded for a request that expected this header and checksum (`Expect::crc`). A later
    /// request for the same block that expects other contents finds the frame stale: the
    /// block was freed and written again since.
    Ready(BlockHeader, u32),
    /// The load failed: waiters that were already blocked on the frame get the error.
    Failed(BufferError),
}

#[derive(Debug)]
pub(crate) struct FrameData {
    pub block: u64,
    pub state: FrameState,
    /// The frame's slot of the pool's arena, taken on first use.
    pub buf: FrameBuf,
}

/// No context: the frame holds nothing an eviction policy should look at.
pub(crate) const NO_CONTEXT: u64 = u64::MAX;

pub(crate) struct Frame {
    pub data: RwLock<FrameData>,
    /// Set by hits; the eviction policies' second-chance bit.
    pub referenced: AtomicBool,
    /// Read by a prefetch and not used since: its first pin is the use the read was for,
    /// neither a hit nor a second reference (a block read ahead and used once must not look
    /// reused to the eviction policy).
    pub prefetched: AtomicBool,
    /// Pool clock at the last hit (coarse recency, for coldest-context eviction).
    pub last_use: AtomicU64,
    /// Context of the block held, or [`NO_CONTEXT`]; read by eviction without locking.
    pub context: AtomicU64,
    /// Pins reserved by a loader for the callers it read the block for. Taken under the write
    /// lock before it is released, so no eviction can slip in between the end of a load and
    /// the loader's own pin (which would cost the block a second read).
    pub reserved: AtomicU64,
    /// Holds of [`ResidentBlocks`](crate::ResidentBlocks) on the frame: raised under a read
    /// latch, so an evictor holding the write latch sees every one (see resident.rs).
    pub resident: AtomicU64,
}

impl Frame {
    pub fn new() -> Self {
        Frame {
            data: RwLock::new(FrameData { block: u64::MAX, state: FrameState::Empty, buf: FrameBuf::none() }),
            referenced: AtomicBool::new(false),
            prefetched: AtomicBool::new(false),
            last_use: AtomicU64::new(0),
            context: AtomicU64::new(NO_CONTEXT),
            reserved: AtomicU64::new(0),
            resident: AtomicU64::new(0),
        }
    }

    pub fn touch(&self, now: u64) {
        if !self.referenced.load(Ordering::Relaxed) {
            self.referenced.store(true, Ordering::Relaxed);
        }
        if self.last_use.load(Ordering::Relaxed) != now {
            self.last_use.store(now, Ordering::Relaxed);
        }
    }
}
