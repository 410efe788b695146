//! What every fuzz target shares: an allocator that enforces the allocation bound.
//!
//! Without a sanitizer (`-s none`, stable Rust) libFuzzer cannot see allocations, so its
//! `-malloc_limit_mb` does nothing; each target installs [`Bounded`] as its global allocator
//! instead, and an allocation above [`MAX_ALLOC_BYTES`] aborts the run, which libFuzzer reports
//! as a crash and saves the input of. The bound is the one fuzz/README.md documents and
//! tools/ci/fuzz-smoke.sh passes as `-malloc_limit_mb`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;

/// The most one allocation may take: 64 MiB.
pub const MAX_ALLOC_BYTES: usize = 64 << 20;

/// The system allocator, aborting on an allocation above [`MAX_ALLOC_BYTES`].
pub struct Bounded;

fn check(layout: &Layout) {
    if layout.size() > MAX_ALLOC_BYTES {
        // No allocation here: stderr is unbuffered and the message is static.
        let _ = std::io::stderr().write_all(b"==ctxfs-fuzz== allocation above the 64 MiB bound\n");
        std::process::abort();
    }
}

// SAFETY: forwards every call to `System` unchanged, after a check that allocates nothing.
unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(&layout);
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(&layout);
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check(&Layout::from_size_align(new_size, layout.align()).unwrap_or(layout));
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
