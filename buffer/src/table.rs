//! The page table: device block → frame, split into shards so that lookups on different
//! blocks never share a lock, and lookups of one block share only a read lock.

use crate::sync::{AtomicU64, Ordering, RwLock};
use crossbeam_utils::CachePadded;
use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// Hashes a block number with one multiply and shift. The keys are device block numbers,
/// not attacker-chosen strings, so std's SipHash buys nothing here; it cost a search about
/// as much as the rest of a page-table hit.
#[derive(Default)]
pub(crate) struct BlockHasher(u64);

impl Hasher for BlockHasher {
    fn finish(&self) -> u64 {
        // A different multiplier from the shard choice, so a shard's keys spread over its map.
        let h = (self.0 ^ self.0 >> 29).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        h ^ h >> 32
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

type BlockMap = HashMap<u64, usize, BuildHasherDefault<BlockHasher>>;

pub(crate) struct Shard {
    map: RwLock<BlockMap>,
    /// Hits per block class, counted here because the hit path already touches this shard.
    pub hits: [AtomicU64; 2],
}

pub(crate) struct Table {
    shards: Box<[CachePadded<Shard>]>,
}

impl Table {
    pub fn new(shards: usize) -> Self {
        let shards = (0..shards.max(1))
            .map(|_| {
                CachePadded::new(Shard {
                    map: RwLock::new(BlockMap::default()),
                    hits: [AtomicU64::new(0), AtomicU64::new(0)],
                })
            })
            .collect();
        Table { shards }
    }

    pub fn shard(&self, block: u64) -> &Shard {
        // Fibonacci hashing spreads consecutive blocks over shards.
        let h = block.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        &self.shards[(h % self.shards.len() as u64) as usize]
    }

    pub fn get(&self, block: u64) -> Option<usize> {
        self.shard(block).map.read().unwrap_or_else(|p| p.into_inner()).get(&block).copied()
    }

    /// Maps `block` to `frame` unless it is already mapped; returns whether it inserted.
    pub fn insert_if_absent(&self, block: u64, frame: usize) -> bool {
        let mut map = self.shard(block).map.write().unwrap_or_else(|p| p.into_inner());
        if map.contains_key(&block) {
            return false;
        }
        map.insert(block, frame);
        true
    }

    /// Unmaps `block` if it still maps to `frame`.
    pub fn remove(&self, block: u64, frame: usize) {
        let mut map = self.shard(block).map.write().unwrap_or_else(|p| p.into_inner());
        if map.get(&block) == Some(&frame) {
            map.remove(&block);
        }
    }

    pub fn hits(&self, class: usize) -> u64 {
        self.shards.iter().map(|s| s.hits[class].load(Ordering::Relaxed)).sum()
    }
}
