//! The frames' buffers: one allocation for the whole pool, one block-sized slot per frame.
//!
//! Allocating each frame's page-aligned buffer on its own cost about as much again in the C
//! allocator's alignment padding: `bench decode`'s 1.1 GB pool held 2.4 GB. One zeroed
//! allocation the size of the budget takes only the pages frames have touched, because the
//! system maps a large zeroed allocation lazily. A serving pool maps it all at once instead
//! (`populate`): a page fault per block read cost more than the read itself.

use ctxfs_vfs::device::PAGE;
use std::alloc::Layout;
use std::ptr::NonNull;

pub(crate) struct FrameArena {
    /// Start of the allocation (what `dealloc` takes back).
    base: NonNull<u8>,
    layout: Layout,
    /// First slot: `base` rounded up to a page.
    first: NonNull<u8>,
    slots: usize,
    slot_bytes: usize,
}

// SAFETY: the arena only hands out disjoint slots (`slot`), each owned by one `FrameBuf`;
// it never reads or writes their bytes itself.
unsafe impl Send for FrameArena {}
// SAFETY: as for Send; `&FrameArena` only computes slot addresses.
unsafe impl Sync for FrameArena {}

impl FrameArena {
    /// An arena of `slots` frame buffers, or `None` if the system refuses that much memory.
    /// `populate` maps every page now (writing the zero it already reads as), so that no
    /// later read into a frame pays a page fault.
    pub fn new(slots: usize, slot_bytes: usize, populate: bool) -> Option<FrameArena> {
        assert!(slot_bytes > 0 && slot_bytes.is_multiple_of(PAGE), "frame size {slot_bytes}");
        let bytes = slots.checked_mul(slot_bytes)?.checked_add(PAGE)?;
        // Requested at the allocator's natural alignment, so the zeroed allocation is a
        // lazily mapped `calloc`; the page alignment O_DIRECT needs comes from rounding up.
        let layout = Layout::from_size_align(bytes, 16).ok()?;
        // SAFETY: `layout` has a non-zero size (at least one page).
        let base = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) })?;
        let skip = base.as_ptr().align_offset(PAGE);
        assert!(skip < PAGE);
        // SAFETY: `skip < PAGE`, and the allocation has PAGE bytes beyond the slots.
        let first = unsafe { base.add(skip) };
        if populate {
            for offset in (0..slots * slot_bytes).step_by(PAGE) {
                // A volatile write: the memory already reads as zero, so a plain write of
                // zero could be elided. SAFETY: the byte lies inside the allocation, and no
                // slot has been handed out yet, so nothing else refers to it.
                unsafe { first.add(offset).as_ptr().write_volatile(0) };
            }
        }
        Some(FrameArena { base, layout, first, slots, slot_bytes })
    }

    /// The buffer of frame `idx`.
    ///
    /// # Safety
    /// Called at most once per `idx` over the arena's life, and the buffer is not used after
    /// the arena is dropped: the returned `FrameBuf` is then the only handle to its bytes.
    pub unsafe fn slot(&self, idx: usize) -> FrameBuf {
        assert!(idx < self.slots, "frame {idx} of {}", self.slots);
        // SAFETY: `idx < slots`, so the slot lies inside the allocation.
        let ptr = unsafe { self.first.add(idx * self.slot_bytes) };
        FrameBuf { ptr, len: self.slot_bytes }
    }
}

impl Drop for FrameArena {
    fn drop(&mut self) {
        // SAFETY: `base` came from `alloc_zeroed` with this layout and is freed once.
        unsafe { std::alloc::dealloc(self.base.as_ptr(), self.layout) };
    }
}

/// One frame's buffer: a page-aligned slot of the arena, owned like a `Box<[u8]>`.
#[derive(Debug)]
pub(crate) struct FrameBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a `FrameBuf` is the only handle to its bytes (`FrameArena::slot`), so moving it to
// another thread moves sole ownership, as for a `Box<[u8]>`.
unsafe impl Send for FrameBuf {}
// SAFETY: `&FrameBuf` gives shared reads only; writes need `&mut FrameBuf`.
unsafe impl Sync for FrameBuf {}

impl FrameBuf {
    /// No buffer yet: the frame has never been used.
    pub const fn none() -> FrameBuf {
        FrameBuf { ptr: NonNull::dangling(), len: 0 }
    }
}

impl std::ops::Deref for FrameBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `ptr..ptr + len` is this buffer's slot of a live arena (or empty), and no
        // `&mut` to it exists while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for FrameBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for Deref, and `&mut self` makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}
