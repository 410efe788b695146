//! Frame hints: where a block was found last time, so a reader that keeps one per block of
//! a file it reads often (a searched index) can skip the page table.

use crate::guard::PageGuard;
use std::sync::atomic::{AtomicU32, Ordering};

/// The frame a block was last found in, or none. A plain std atomic even under loom: a hint
/// is never trusted, only tried (the pool re-checks the frame under its latch), so no
/// interleaving of hint updates can change what a reader sees.
#[derive(Debug)]
pub struct FrameHint(AtomicU32);

const NONE: u32 = u32::MAX;

impl Default for FrameHint {
    fn default() -> Self {
        FrameHint(AtomicU32::new(NONE))
    }
}

impl FrameHint {
    pub(crate) fn frame(&self) -> Option<usize> {
        match self.0.load(Ordering::Relaxed) {
            NONE => None,
            f => Some(f as usize),
        }
    }

    /// Remembers the frame `guard`'s block is in.
    pub fn remember(&self, guard: &PageGuard<'_>) {
        let f = u32::try_from(guard.frame()).unwrap_or(NONE);
        if self.0.load(Ordering::Relaxed) != f {
            self.0.store(f, Ordering::Relaxed);
        }
    }
}
