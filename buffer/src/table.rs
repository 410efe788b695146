//! The page table: device block → frame, split into shards so that lookups on different
//! blocks never share a lock, and lookups of one block share only a read lock.

use crate::sync::{AtomicU64, Ordering, RwLock};
use crossbeam_utils::CachePadded;
use std::collections::HashMap;

pub(crate) struct Shard {
    map: RwLock<HashMap<u64, usize>>,
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
                    map: RwLock::new(HashMap::new()),
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
