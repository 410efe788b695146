//! Resident blocks: index blocks held in their frames for as long as a [`ResidentBlocks`]
//! lives, and read without a latch.
//!
//! A served context's graph and key blocks are read by every decode step of every session,
//! tens of thousands of times per step. Pinning each through the page table costs a latch, a
//! recency update and a shared hit counter per block: a search spent a fifth of its time
//! there. Residency moves that cost to once per context:
//! * it is taken under a frame's read latch (a pin), which proves the frame holds the block
//!   and is `Ready`, and counted in the frame's `resident` count;
//! * eviction (`BufferPool::evict`) takes a frame only under its write latch and refuses one
//!   whose `resident` count is not zero. The count is raised while a read latch is held, so
//!   an evictor that gets the write latch afterwards sees it; one that got it before could
//!   not have, as the pin excludes it;
//! * a frame's contents change only through its write latch after a successful eviction (a
//!   load fills only a claimed, evicted or free frame), and its buffer is allocated once and
//!   never moved. So while the count is held, the payload bytes stay put and unchanged, and
//!   are read through a plain pointer.
//!
//! Residency is bounded: a request that would leave fewer than `reserve` frames of the index
//! area to everything else is refused (the caller keeps reading through pins).

use crate::pool::BufferPool;
use crate::request::{BlockClass, BlockRequest, BufferError};
use std::sync::Arc;

/// Blocks held resident in the index area, in request order.
pub struct ResidentBlocks {
    pool: Arc<BufferPool>,
    frames: Vec<usize>,
    /// Each block's payload, in its frame's buffer.
    payloads: Vec<(*const u8, usize)>,
    /// Blocks read from the device to take the holds (the others were in the pool).
    read: usize,
}

// SAFETY: the pointers address frame buffers that nothing writes or frees while the blocks
// are resident (module comment); they are only read, through `&self`, from any thread.
unsafe impl Send for ResidentBlocks {}
// SAFETY: as for Send; `payload` hands out shared slices only.
unsafe impl Sync for ResidentBlocks {}

impl ResidentBlocks {
    pub(crate) fn new(pool: Arc<BufferPool>) -> ResidentBlocks {
        ResidentBlocks { pool, frames: Vec::new(), payloads: Vec::new(), read: 0 }
    }

    pub(crate) fn push(&mut self, frame: usize, payload: &[u8], read_here: bool) {
        self.frames.push(frame);
        self.payloads.push((payload.as_ptr(), payload.len()));
        self.read += usize::from(read_here);
    }

    /// Blocks read from the device to take the holds.
    pub fn read(&self) -> usize {
        self.read
    }

    pub fn len(&self) -> usize {
        self.payloads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.payloads.is_empty()
    }

    /// The payload of the `i`-th block requested.
    #[inline]
    pub fn payload(&self, i: usize) -> &[u8] {
        let (ptr, len) = self.payloads[i];
        // SAFETY: `ptr..ptr + len` is the payload of a block in a frame whose resident count
        // this value holds: the frame is never evicted or refilled while it is held, and its
        // buffer is neither moved nor freed before the pool, which `self.pool` keeps alive.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}

impl Drop for ResidentBlocks {
    fn drop(&mut self) {
        self.pool.release_resident(&self.frames);
    }
}

impl std::fmt::Debug for ResidentBlocks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ResidentBlocks({} blocks)", self.payloads.len())
    }
}

/// What a request for residency needs to leave free in the index area for pinned reads:
/// an eighth of it, at least 128 frames (all but one of a smaller area) and at most 1,024.
/// Readers of indexes not held pin a bounded batch at a time (64 key blocks beyond a small
/// cache), so this serves several of them at once.
pub(crate) fn reserve(index_frames: usize) -> usize {
    (index_frames / 8).clamp(index_frames.saturating_sub(1).min(128), 1024)
}

/// Blocks requested for residency must be index blocks.
pub(crate) fn check_class(reqs: &[BlockRequest]) -> Result<(), BufferError> {
    match reqs.iter().find(|r| r.class() != BlockClass::Index) {
        Some(r) => {
            Err(BufferError::Config(format!("block {} is a data block; only index blocks stay resident", r.block)))
        }
        None => Ok(()),
    }
}
