//! Score buffers reused from one group scan to the next, per thread.
//!
//! A group scan writes every score of its buffer (`flat::scan_many`, the PQ scan): 2 MiB
//! for 4 q heads at 128K tokens, 16 MiB at 1M. Zeroing a fresh buffer each time cost about
//! a tenth of a PQ scan. A [`GroupScan`](crate::flat::GroupScan) gives its buffer back to
//! its thread when dropped, and the next scan on that thread takes it without zeroing.

use std::cell::RefCell;

/// Largest buffer a thread keeps (32 MiB of f32): beyond it the memory goes back.
const KEEP_MAX: usize = 8 << 20;

thread_local! {
    static SPARE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// A buffer of `len` scores whose contents are unspecified (left from an earlier scan, or
/// zero): the caller writes every element before reading it.
pub(crate) fn scores(len: usize) -> Vec<f32> {
    let mut v = SPARE.with(|s| std::mem::take(&mut *s.borrow_mut()));
    if v.len() >= len {
        v.truncate(len);
    } else {
        v.resize(len, 0.0);
    }
    v
}

/// Keeps `v` for this thread's next [`scores`], in place of a smaller one.
pub(crate) fn give_back(v: Vec<f32>) {
    if v.capacity() > KEEP_MAX {
        return;
    }
    SPARE.with(|s| {
        let mut spare = s.borrow_mut();
        if v.capacity() > spare.capacity() {
            *spare = v;
        }
    });
}
