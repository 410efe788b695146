//! What the pool reports, per block class.

use crate::frame::Frame;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClassStats {
    /// Requests served from the pool without a read of their own (including requests that
    /// waited on another thread's read of the same block).
    pub hits: u64,
    /// Blocks read from the device.
    pub misses: u64,
    /// Of `misses`, the blocks read for the first time since the pool was made: misses that
    /// no cache size or eviction policy would have saved.
    pub first_reads: u64,
    pub bytes_read: u64,
    pub evictions: u64,
    /// Holds of [`ResidentBlocks`](crate::ResidentBlocks) on the area's frames (index area
    /// only): blocks that stay in memory whatever the pressure.
    pub resident_pins: u64,
    /// Frames holding a block.
    pub resident_frames: u64,
    pub capacity_frames: u64,
}

impl ClassStats {
    pub fn hit_ratio(&self) -> f64 {
        let total = self.hits + self.misses;
        if total == 0 {
            0.0
        } else {
            self.hits as f64 / total as f64
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PoolStats {
    pub block_size: usize,
    pub budget_bytes: u64,
    pub data_fraction: f64,
    /// Frame buffers allocated so far; never more than `budget_bytes`.
    pub allocated_bytes: u64,
    /// Memory beyond the budget: frame descriptors and page-table entries. A constant for a
    /// given budget.
    pub overhead_bytes: u64,
    pub index: ClassStats,
    pub data: ClassStats,
}

/// Page-table bytes per resident block (key, value and hash-map slack).
pub const TABLE_BYTES_PER_FRAME: usize = 32;

impl PoolStats {
    /// Memory beyond the budget for a pool of `frames` frames: each frame's descriptor and its
    /// page-table entry. The device source adds at most `source::STAGING_BUFFERS ×
    /// source::STAGING_BUFFER_BYTES` of staging, also fixed.
    pub fn overhead(frames: usize) -> u64 {
        (frames * (std::mem::size_of::<Frame>() + TABLE_BYTES_PER_FRAME)) as u64
    }

    /// The hit ratio of both classes' requests since `before`, an earlier snapshot of the
    /// same pool.
    pub fn hit_ratio_since(&self, before: &PoolStats) -> f64 {
        let hits = (self.index.hits + self.data.hits) - (before.index.hits + before.data.hits);
        let misses = (self.index.misses + self.data.misses) - (before.index.misses + before.data.misses);
        ClassStats { hits, misses, ..Default::default() }.hit_ratio()
    }
}
