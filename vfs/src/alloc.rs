//! The block allocator. Its persisted form is a bitmap of the blocks the committed state
//! references. In memory it also tracks blocks that are free in the newest state but may not
//! be reused yet:
//!
//! * a block freed by commit `g` is still referenced by state `g-1`, which the fallback
//!   superblock describes until commit `g+1` overwrites it, and which open snapshots of
//!   generation `g-1` or older may be reading. It is *quarantined* until both have passed.
//!
//! So nothing a committed state or a live reader can reach is ever overwritten.

use std::collections::{BTreeSet, VecDeque};

#[derive(Clone, PartialEq, Eq)]
pub struct Bitmap {
    words: Vec<u64>,
    len: u64,
}

impl Bitmap {
    pub fn new(len: u64) -> Self {
        Bitmap { words: vec![0; len.div_ceil(64) as usize], len }
    }
    /// Every bit set.
    pub fn full(len: u64) -> Self {
        let mut b = Bitmap { words: vec![u64::MAX; len.div_ceil(64) as usize], len };
        if let (Some(last), tail @ 1..) = (b.words.last_mut(), len % 64) {
            *last = (1 << tail) - 1;
        }
        b
    }
    pub fn len(&self) -> u64 {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn get(&self, i: u64) -> bool {
        i < self.len && self.words[(i / 64) as usize] >> (i % 64) & 1 == 1
    }
    pub fn set(&mut self, i: u64, v: bool) {
        assert!(i < self.len, "bit {i} out of range {}", self.len);
        let w = &mut self.words[(i / 64) as usize];
        if v {
            *w |= 1 << (i % 64);
        } else {
            *w &= !(1 << (i % 64));
        }
    }
    pub fn count_ones(&self) -> u64 {
        self.words.iter().map(|w| w.count_ones() as u64).sum()
    }
    /// The first clear bit at or after `from`, wrapping around once.
    pub fn find_clear(&self, from: u64) -> Option<u64> {
        let scan = |lo: u64, hi: u64| -> Option<u64> {
            let mut i = lo;
            while i < hi {
                let w = self.words[(i / 64) as usize];
                if w == u64::MAX && i.is_multiple_of(64) {
                    i += 64;
                    continue;
                }
                if w >> (i % 64) & 1 == 0 {
                    return Some(i);
                }
                i += 1;
            }
            None
        };
        let from = from.min(self.len);
        scan(from, self.len).or_else(|| scan(0, from))
    }
    /// Bits `[start, start+len)` as bytes, least significant bit first.
    pub fn to_bytes(&self, start: u64, len: u64) -> Vec<u8> {
        let mut out = vec![0u8; len.div_ceil(8) as usize];
        for i in 0..len.min(self.len.saturating_sub(start)) {
            if self.get(start + i) {
                out[(i / 8) as usize] |= 1 << (i % 8);
            }
        }
        out
    }
    /// Sets bits `[start, start+len)` from bytes written by [`Bitmap::to_bytes`].
    pub fn load_bytes(&mut self, start: u64, len: u64, bytes: &[u8]) {
        for i in 0..len.min(self.len.saturating_sub(start)) {
            let bit = bytes.get((i / 8) as usize).is_some_and(|b| b >> (i % 8) & 1 == 1);
            self.set(start + i, bit);
        }
    }
    pub fn iter_ones(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.len).filter(|&i| self.get(i))
    }
}

impl std::fmt::Debug for Bitmap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bitmap({} of {} set)", self.count_ones(), self.len)
    }
}

pub struct Allocator {
    /// The committed state: what the newest superblock's bitmap says.
    committed: Bitmap,
    /// The state the open transaction is building.
    next: Bitmap,
    /// `next` plus quarantined blocks: what may not be handed out.
    in_use: Bitmap,
    /// Blocks freed by commit `gen`, not yet reusable.
    quarantine: VecDeque<(u64, Vec<u64>)>,
    /// Blocks freed by the open transaction.
    freed: Vec<u64>,
    /// Bitmap chunks where `next` may differ from `committed`.
    dirty_chunks: BTreeSet<u64>,
    bits_per_chunk: u64,
    cursor: u64,
    /// Set at open when another process reads a state older than the fallback: which blocks
    /// that state references is not known here, so none free at open is handed out until
    /// every reader of a generation below this one is gone.
    frozen: Option<u64>,
    /// The first block the open transaction freed that the state being built does not hold:
    /// the committed state references a block its own bitmap calls free (or one beyond the
    /// store's blocks, or one it references twice). Damage, not a bug of the caller: the
    /// transaction cannot commit ([`Allocator::stray_free`]).
    stray_free: Option<u64>,
}

impl Allocator {
    pub fn new(committed: Bitmap, bits_per_chunk: u64) -> Self {
        Allocator {
            next: committed.clone(),
            in_use: committed.clone(),
            committed,
            quarantine: VecDeque::new(),
            freed: Vec::new(),
            dirty_chunks: BTreeSet::new(),
            bits_per_chunk,
            cursor: 0,
            frozen: None,
            stray_free: None,
        }
    }

    /// Holds every block free now until no reader of a generation below `generation` is left.
    pub fn freeze(&mut self, generation: u64) {
        self.frozen = Some(generation);
        self.in_use = Bitmap::full(self.total());
    }

    /// The error for an allocation of `needed` more blocks that found none.
    pub fn full(&self, needed: u64) -> crate::Error {
        match self.frozen {
            Some(generation) => crate::Error::HeldForReader { generation },
            None => crate::Error::StoreFull { needed, free: self.available(), held: self.quarantined() },
        }
    }

    /// `in_use` from `base` and the quarantined blocks (everything, while frozen).
    fn rebuild_in_use(&mut self, base: Bitmap) {
        if self.frozen.is_some() {
            self.in_use = Bitmap::full(self.total());
            return;
        }
        self.in_use = base;
        for (_, blocks) in &self.quarantine {
            for &b in blocks {
                self.in_use.set(b, true);
            }
        }
    }

    pub fn total(&self) -> u64 {
        self.committed.len()
    }
    pub fn committed(&self) -> &Bitmap {
        &self.committed
    }
    pub fn next(&self) -> &Bitmap {
        &self.next
    }
    /// Blocks freed by commits but not yet reusable.
    pub fn quarantined(&self) -> u64 {
        self.quarantine.iter().map(|(_, b)| b.iter().filter(|&&b| !self.next.get(b)).count() as u64).sum()
    }

    /// Blocks that could be allocated now.
    pub fn available(&self) -> u64 {
        self.in_use.len() - self.in_use.count_ones()
    }
    pub fn is_allocated(&self, block: u64) -> bool {
        self.next.get(block)
    }

    /// Quarantines blocks that an older state references but the committed one does not.
    pub fn quarantine_from(&mut self, older: &Bitmap, generation: u64) {
        let blocks: Vec<u64> = older.iter_ones().filter(|&b| b < self.total() && !self.committed.get(b)).collect();
        for &b in &blocks {
            self.in_use.set(b, true);
        }
        if !blocks.is_empty() {
            self.quarantine.push_back((generation, blocks));
        }
    }

    /// Holds the blocks of a state another process reads (`reader`) that the committed state
    /// does not reference, until no reader of a generation below `until` is left.
    pub fn hold_for_readers(&mut self, reader: &Bitmap, until: u64) {
        let blocks: Vec<u64> = reader.iter_ones().filter(|&b| b < self.total() && !self.in_use.get(b)).collect();
        for &b in &blocks {
            self.in_use.set(b, true);
        }
        if !blocks.is_empty() {
            // Release walks the queue from the front while it may: keep it ordered.
            let at = self.quarantine.partition_point(|(g, _)| *g <= until);
            self.quarantine.insert(at, (until, blocks));
        }
    }

    fn mark(&mut self, block: u64, used: bool) {
        self.next.set(block, used);
        self.dirty_chunks.insert(block / self.bits_per_chunk);
    }

    /// One free block, preferring `hint`.
    pub fn alloc(&mut self, hint: u64) -> Option<u64> {
        let block =
            if hint < self.total() && !self.in_use.get(hint) { hint } else { self.in_use.find_clear(self.cursor)? };
        self.in_use.set(block, true);
        self.mark(block, true);
        self.cursor = block + 1;
        Some(block)
    }

    /// Up to `want` consecutive free blocks starting at or after a free block near `hint`
    /// (at least one). Returns the first block and the count.
    pub fn alloc_run(&mut self, hint: u64, want: u64) -> Option<(u64, u64)> {
        let first = self.alloc(hint)?;
        let mut n = 1;
        while n < want && first + n < self.total() && !self.in_use.get(first + n) {
            self.in_use.set(first + n, true);
            self.mark(first + n, true);
            n += 1;
        }
        self.cursor = first + n;
        Some((first, n))
    }

    /// Releases a block allocated by the open transaction and never referenced (an unused
    /// reservation): it can be reused at once.
    pub fn unreserve(&mut self, block: u64) {
        debug_assert!(!self.committed.get(block), "unreserving committed block {block}");
        self.mark(block, false);
        self.in_use.set(block, false);
    }

    /// Frees a block in the state being built. It stays unusable until quarantine ends. A
    /// block the state does not hold is left alone and remembered ([`Allocator::stray_free`]).
    pub fn free(&mut self, block: u64) {
        if !self.next.get(block) {
            self.stray_free.get_or_insert(block);
            return;
        }
        self.mark(block, false);
        self.freed.push(block);
    }

    /// The first block the open transaction freed without holding it: the committed state
    /// and its bitmap disagree about that block, and a commit would persist the disagreement.
    pub fn stray_free(&self) -> Option<u64> {
        self.stray_free
    }

    pub fn dirty_chunks(&self) -> &BTreeSet<u64> {
        &self.dirty_chunks
    }

    /// The open transaction committed as `generation`; `oldest_reader` is the oldest
    /// generation a live snapshot holds.
    pub fn commit(&mut self, generation: u64, oldest_reader: Option<u64>) {
        self.committed = self.next.clone();
        self.dirty_chunks.clear();
        let freed = std::mem::take(&mut self.freed);
        if !freed.is_empty() {
            self.quarantine.push_back((generation, freed));
        }
        self.release(generation, oldest_reader);
    }

    /// Ends quarantine for blocks freed at `g` once commit `g+1` is durable and no reader
    /// holds generation `g-1` or older.
    pub fn release(&mut self, committed_generation: u64, oldest_reader: Option<u64>) {
        if self.frozen.is_some_and(|g| oldest_reader.is_none_or(|r| r >= g)) {
            self.frozen = None;
            self.rebuild_in_use(self.next.clone());
        }
        while let Some((g, _)) = self.quarantine.front() {
            let fallback_gone = *g < committed_generation;
            let readers_gone = oldest_reader.is_none_or(|r| r >= *g);
            if !(fallback_gone && readers_gone) {
                break;
            }
            let (_, blocks) = self.quarantine.pop_front().expect("front exists");
            for b in blocks {
                if !self.next.get(b) {
                    self.in_use.set(b, false);
                }
            }
        }
    }

    /// Drops the open transaction's changes.
    pub fn abort(&mut self) {
        self.next = self.committed.clone();
        self.rebuild_in_use(self.committed.clone());
        // Freed blocks of the aborted transaction are still referenced by the committed
        // state, so they are simply allocated again.
        self.freed.clear();
        self.dirty_chunks.clear();
        self.stray_free = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn freed_blocks_wait_for_the_next_commit_and_old_readers() {
        let mut committed = Bitmap::new(16);
        for b in 0..4 {
            committed.set(b, true);
        }
        let mut a = Allocator::new(committed, 64);
        a.free(3);
        a.commit(5, Some(4));
        // Freed at 5: gen 4 is the fallback and a reader holds it.
        assert!(a.alloc(3) != Some(3));
        a.commit(6, Some(4));
        assert!(a.alloc(3) != Some(3), "a reader of generation 4 can still see block 3");
        a.commit(7, None);
        assert_eq!(a.alloc(3), Some(3));
    }

    #[test]
    fn abort_restores_the_committed_state() {
        let mut committed = Bitmap::new(8);
        committed.set(0, true);
        let mut a = Allocator::new(committed.clone(), 64);
        a.alloc(1).unwrap();
        a.free(0);
        a.abort();
        assert_eq!(a.next(), &committed);
        assert_eq!(a.available(), 7);
    }

    #[test]
    fn a_block_freed_without_being_held_is_remembered_not_freed() {
        let mut committed = Bitmap::new(8);
        committed.set(0, true);
        let mut a = Allocator::new(committed.clone(), 64);
        a.free(0);
        a.free(0);
        a.free(5);
        a.free(100);
        assert_eq!(a.stray_free(), Some(0), "the first block freed twice");
        assert_eq!(a.next().count_ones(), 0);
        a.abort();
        assert_eq!(a.stray_free(), None);
        assert_eq!(a.next(), &committed);
    }

    #[test]
    fn bitmap_round_trips_through_bytes() {
        let mut b = Bitmap::new(100);
        for i in [0, 7, 8, 63, 64, 99] {
            b.set(i, true);
        }
        let bytes = b.to_bytes(0, 100);
        let mut c = Bitmap::new(100);
        c.load_bytes(0, 100, &bytes);
        assert_eq!(b, c);
        assert_eq!(c.find_clear(99), Some(1));
    }
}
