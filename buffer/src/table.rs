//! The page table: device block → frame, one atomic slot per device block, in leaves of
//! [`LEAF`] slots that are allocated when a block of their range is first mapped.
//!
//! A lookup is one load: no lock, no hash, nothing written. Lookups are most of a decode
//! step's buffer work (every value block pinned, and the prefetch thread's check of every
//! block it is handed), and the table of sharded `RwLock<HashMap>` this replaces spent them
//! on read-lock increments that the workers and the prefetch thread bounced between cores,
//! and on probes of maps holding all ~280,000 blocks of a served context: 7% of a decode
//! step's CPU in `bench decode`'s loop over a layer.
//!
//! Each leaf also keeps a bit per block, set when the block is first read
//! ([`Table::first_read`]): the pool counts the reads no cache could have saved.
//!
//! Mapping and unmapping are compare-and-swaps on the slot, so, as under the shard locks
//! before, two loads of one block cannot both map it, and an unmapping of a frame that no
//! longer holds the block leaves its new mapping alone. A leaf lives as long as the table:
//! slots are never freed under a reader.

use crate::sync::{AtomicU32, AtomicU64, Ordering};
use crossbeam_utils::CachePadded;
use std::sync::OnceLock;

/// Slots per leaf: 4,096 blocks (16 MiB of device at 4 KiB) in 16 KiB. The models of
/// tests/loom.rs use few blocks, and loom tracks every atomic, so their leaves are small.
#[cfg(not(loom))]
pub(crate) const LEAF: u64 = 4096;
#[cfg(loom)]
pub(crate) const LEAF: u64 = 8;

/// An empty slot.
const UNMAPPED: u32 = u32::MAX;

/// A leaf's slots, and a bit per block: whether it was ever read.
struct Leaf {
    slots: Box<[AtomicU32]>,
    read: Box<[AtomicU64]>,
}

pub(crate) struct Table {
    /// Leaf `i` holds the slots of blocks `i · LEAF ..`.
    leaves: Box<[OnceLock<Leaf>]>,
    blocks: u64,
    /// Hits per block class, in shards so that hits on different blocks rarely share a line.
    hits: Box<[CachePadded<[AtomicU64; 2]>]>,
}

fn new_leaf() -> Leaf {
    Leaf {
        slots: (0..LEAF).map(|_| AtomicU32::new(UNMAPPED)).collect(),
        read: (0..LEAF.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
    }
}

impl Table {
    /// A table for a device of `blocks` blocks, with `shards` shards of hit counters.
    pub fn new(blocks: u64, shards: usize) -> Self {
        let leaves: Box<[OnceLock<Leaf>]> = (0..blocks.div_ceil(LEAF)).map(|_| OnceLock::new()).collect();
        // Under loom every leaf exists from the start: a race to make one would block in
        // std's OnceLock, which loom cannot see; the models explore the slots' protocol.
        if cfg!(loom) {
            for leaf in leaves.iter() {
                let _ = leaf.set(new_leaf());
            }
        }
        let hits = (0..shards.max(1)).map(|_| CachePadded::new([AtomicU64::new(0), AtomicU64::new(0)])).collect();
        Table { leaves, blocks, hits }
    }

    /// Whether `block` is on the device, so it can be mapped.
    pub fn holds(&self, block: u64) -> bool {
        block < self.blocks
    }

    fn slot(&self, block: u64) -> Option<&AtomicU32> {
        let leaf = self.leaves.get((block / LEAF) as usize)?.get()?;
        Some(&leaf.slots[(block % LEAF) as usize])
    }

    pub fn get(&self, block: u64) -> Option<usize> {
        match self.slot(block)?.load(Ordering::Acquire) {
            UNMAPPED => None,
            frame => Some(frame as usize),
        }
    }

    /// Maps `block` (which the device [`holds`](Self::holds)) to `frame` unless it is
    /// already mapped; returns whether it mapped it.
    pub fn insert_if_absent(&self, block: u64, frame: usize) -> bool {
        assert!(self.holds(block), "block {block} of a device of {} blocks", self.blocks);
        // BufferPool::new refuses a pool of u32::MAX frames or more.
        let frame = u32::try_from(frame).ok().filter(|&f| f != UNMAPPED).expect("frame numbers fit a slot");
        let leaf = self.leaves[(block / LEAF) as usize].get_or_init(new_leaf);
        leaf.slots[(block % LEAF) as usize]
            .compare_exchange(UNMAPPED, frame, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Marks `block` (mapped, so its leaf exists) as read; returns whether this is its first
    /// read since the table was made.
    pub fn first_read(&self, block: u64) -> bool {
        let Some(leaf) = self.leaves.get((block / LEAF) as usize).and_then(|l| l.get()) else { return false };
        let (word, bit) = (((block % LEAF) / 64) as usize, 1u64 << (block % 64));
        leaf.read[word].fetch_or(bit, Ordering::Relaxed) & bit == 0
    }

    /// Unmaps `block` if it still maps to `frame`.
    pub fn remove(&self, block: u64, frame: usize) {
        let Some(slot) = self.slot(block) else { return };
        let Ok(frame) = u32::try_from(frame) else { return };
        let _ = slot.compare_exchange(frame, UNMAPPED, Ordering::AcqRel, Ordering::Relaxed);
    }

    /// Counts a hit on `block`, of class `class`.
    pub fn hit(&self, block: u64, class: usize) {
        // Fibonacci hashing spreads consecutive blocks over shards.
        let h = block.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        self.hits[(h % self.hits.len() as u64) as usize][class].fetch_add(1, Ordering::Relaxed);
    }

    pub fn hits(&self, class: usize) -> u64 {
        self.hits.iter().map(|s| s[class].load(Ordering::Relaxed)).sum()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn maps_each_block_once_and_unmaps_only_its_own_frame() {
        let t = Table::new(3 * LEAF + 5, 4);
        assert_eq!(t.get(0), None);
        assert!(t.insert_if_absent(LEAF + 1, 7));
        assert!(!t.insert_if_absent(LEAF + 1, 8), "a mapped block is not mapped again");
        assert_eq!(t.get(LEAF + 1), Some(7));
        assert_eq!(t.get(LEAF), None, "a neighbour in the same leaf stays unmapped");
        t.remove(LEAF + 1, 8);
        assert_eq!(t.get(LEAF + 1), Some(7), "unmapping another frame leaves the mapping");
        t.remove(LEAF + 1, 7);
        assert_eq!(t.get(LEAF + 1), None);
        assert!(t.insert_if_absent(3 * LEAF + 4, 0), "the last block of the device");
        assert_eq!(t.get(3 * LEAF + 4), Some(0));
        assert!(!t.holds(3 * LEAF + 5));
        assert_eq!(t.get(3 * LEAF + 5), None);
        assert_eq!(t.get(u64::MAX), None);
        t.remove(u64::MAX, 0);
    }

    #[test]
    fn a_block_is_read_first_once_however_often_it_is_mapped() {
        let t = Table::new(2 * LEAF, 1);
        assert!(!t.first_read(LEAF + 3), "a block of a leaf never mapped was never read");
        for round in 0..3 {
            assert!(t.insert_if_absent(LEAF + 3, 1));
            assert_eq!(t.first_read(LEAF + 3), round == 0, "round {round}");
            t.remove(LEAF + 3, 1);
        }
        assert!(t.insert_if_absent(LEAF + 64, 2));
        assert!(t.first_read(LEAF + 64), "another word of the same leaf");
        assert!(!t.first_read(2 * LEAF), "beyond the device");
    }

    #[test]
    #[should_panic(expected = "of a device of")]
    fn refuses_a_block_beyond_the_device() {
        Table::new(10, 1).insert_if_absent(10, 0);
    }

    /// Many threads race to map, look up and unmap the same few blocks, spread over leaves
    /// that do not exist yet: a block is never mapped twice at once, a lookup only ever
    /// sees a frame some thread mapped it to, and one read of each block is its first.
    #[test]
    fn racing_threads_map_each_block_at_most_once() {
        const THREADS: usize = 8;
        const BLOCKS: u64 = 16;
        let t = Table::new(BLOCKS * LEAF, 8);
        let owners: Vec<AtomicUsize> = (0..BLOCKS).map(|_| AtomicUsize::new(0)).collect();
        let firsts: Vec<AtomicUsize> = (0..BLOCKS).map(|_| AtomicUsize::new(0)).collect();
        let (mapped, unmapped) = (AtomicUsize::new(0), AtomicUsize::new(0));
        std::thread::scope(|s| {
            for id in 1..=THREADS {
                let (t, owners, firsts, mapped, unmapped) = (&t, &owners, &firsts, &mapped, &unmapped);
                s.spawn(move || {
                    let mut x = id as u64;
                    for _ in 0..20_000 {
                        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                        let b = (x >> 33) % BLOCKS;
                        let block = b * LEAF + b; // one block per leaf
                        let frame = id * 100 + b as usize;
                        if let Some(f) = t.get(block) {
                            assert_eq!(f % 100, b as usize, "block {block} maps to frame {f}");
                        }
                        if t.insert_if_absent(block, frame) {
                            let before = owners[b as usize].swap(id, Ordering::SeqCst);
                            assert_eq!(before, 0, "block {block} mapped by {id} while {before} held it");
                            mapped.fetch_add(1, Ordering::Relaxed);
                            assert_eq!(t.get(block), Some(frame));
                            if t.first_read(block) {
                                firsts[b as usize].fetch_add(1, Ordering::Relaxed);
                            }
                            owners[b as usize].store(0, Ordering::SeqCst);
                            t.remove(block, frame);
                            unmapped.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                });
            }
        });
        assert!(mapped.load(Ordering::Relaxed) > 0);
        assert_eq!(mapped.load(Ordering::Relaxed), unmapped.load(Ordering::Relaxed));
        assert!((0..BLOCKS).all(|b| t.get(b * LEAF + b).is_none()), "every block unmapped at the end");
        assert!(firsts.iter().all(|f| f.load(Ordering::Relaxed) == 1), "each block read first once: {firsts:?}");
    }
}
