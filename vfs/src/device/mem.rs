//! An in-memory device with a volatile write cache and deterministic, seeded fault
//! injection. It exists for crash and fault tests: real I/O is tested on the real devices.
//!
//! Model: a write lands in a volatile cache and is visible to reads at once; `flush` makes
//! the cache durable. A crash keeps only the durable image (plus whatever the [`CrashMode`]
//! says survives). Operations are counted (one per block written, one per flush) so a test
//! can crash after each of them in turn.

use super::{check_op, BlockDevice, DeviceInfo, Geometry, IoOp};
use crate::rng::SplitMix64;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::Mutex;

/// What survives of unflushed writes when the simulated crash happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CrashMode {
    /// Every write not yet flushed is lost.
    #[default]
    DropUnflushed,
    /// Unflushed writes are lost, except the last one, which lands torn: only its first
    /// `keep` bytes reach the medium.
    TearLast { keep: usize },
    /// Each unflushed write independently survives or not (a reordering cache), seeded.
    KeepRandom,
}

/// Faults to inject. Operation indexes count block writes and flushes from 0.
#[derive(Debug, Clone, Default)]
pub struct FaultPlan {
    pub seed: u64,
    /// Probability that a block read fails.
    pub read_error_rate: f64,
    /// Probability that a block write fails.
    pub write_error_rate: f64,
    /// Blocks whose reads always fail.
    pub bad_read_blocks: BTreeSet<u64>,
    /// Blocks whose writes always fail.
    pub bad_write_blocks: BTreeSet<u64>,
    /// Flushes fail from this operation index on.
    pub fail_flush_from_op: Option<u64>,
    /// Crash once this many operations have completed; later operations fail.
    pub crash_after_ops: Option<u64>,
    pub crash_mode: CrashMode,
    /// The write at this operation index reports success but keeps only its first bytes.
    pub torn_write: Option<(u64, usize)>,
    /// The write at this operation index lands on another block instead.
    pub misdirected_write: Option<(u64, u64)>,
}

struct State {
    durable: Vec<u8>,
    /// Written but not flushed, in write order, by block.
    cache: BTreeMap<u64, Vec<u8>>,
    cache_order: Vec<u64>,
    plan: FaultPlan,
    rng: SplitMix64,
    ops: u64,
    crashed: bool,
}

pub struct MemDevice {
    geo: Geometry,
    state: Mutex<State>,
}

fn crashed_error() -> io::Error {
    io::Error::other("device has crashed (simulated)")
}

impl MemDevice {
    pub fn new(block_size: usize, num_blocks: u64) -> Self {
        Self::from_image(vec![0; block_size * num_blocks as usize], block_size)
    }

    /// A device whose medium holds `image` (for example what a crash left).
    pub fn from_image(image: Vec<u8>, block_size: usize) -> Self {
        assert!(image.len().is_multiple_of(block_size));
        let num_blocks = (image.len() / block_size) as u64;
        MemDevice {
            geo: Geometry { block_size, num_blocks },
            state: Mutex::new(State {
                durable: image,
                cache: BTreeMap::new(),
                cache_order: Vec::new(),
                plan: FaultPlan::default(),
                rng: SplitMix64::new(0),
                ops: 0,
                crashed: false,
            }),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the fault plan and restarts the operation count.
    pub fn set_faults(&self, plan: FaultPlan) {
        let mut s = self.state();
        s.rng = SplitMix64::new(plan.seed);
        s.plan = plan;
        s.ops = 0;
    }

    /// Operations (block writes and flushes) since the plan was set.
    pub fn ops(&self) -> u64 {
        self.state().ops
    }

    pub fn has_crashed(&self) -> bool {
        self.state().crashed
    }

    /// Crashes now, as the plan's crash mode says.
    pub fn crash(&self) {
        let mut s = self.state();
        crash(&mut s, self.geo.block_size);
    }

    /// What the medium holds: the durable image, without the volatile cache.
    pub fn durable_image(&self) -> Vec<u8> {
        self.state().durable.clone()
    }

    /// The image as reads see it now (durable plus cache).
    pub fn current_image(&self) -> Vec<u8> {
        let s = self.state();
        let mut image = s.durable.clone();
        for (&block, data) in &s.cache {
            let at = block as usize * self.geo.block_size;
            image[at..at + self.geo.block_size].copy_from_slice(data);
        }
        image
    }

    fn write_block(&self, s: &mut State, block: u64, data: &[u8]) -> io::Result<()> {
        if s.crashed {
            return Err(crashed_error());
        }
        let op = s.ops;
        if s.plan.crash_after_ops == Some(op) {
            crash(s, self.geo.block_size);
            return Err(crashed_error());
        }
        s.ops += 1;
        let roll = s.rng.next_f64();
        if s.plan.bad_write_blocks.contains(&block) || roll < s.plan.write_error_rate {
            return Err(io::Error::other(format!("injected write error on block {block}")));
        }
        let target = match s.plan.misdirected_write {
            Some((at, to)) if at == op => to,
            _ => block,
        };
        let mut contents = self.cached_block(s, target);
        let keep = match s.plan.torn_write {
            Some((at, keep)) if at == op => keep.min(self.geo.block_size),
            _ => self.geo.block_size,
        };
        contents[..keep].copy_from_slice(&data[..keep]);
        s.cache.insert(target, contents);
        s.cache_order.push(target);
        Ok(())
    }

    fn cached_block(&self, s: &State, block: u64) -> Vec<u8> {
        match s.cache.get(&block) {
            Some(data) => data.clone(),
            None => {
                let at = block as usize * self.geo.block_size;
                s.durable[at..at + self.geo.block_size].to_vec()
            }
        }
    }

    fn run(&self, s: &mut State, op: &mut IoOp<'_>) -> io::Result<()> {
        check_op(op, self.geo)?;
        let bs = self.geo.block_size;
        let first = op.block();
        match op {
            IoOp::Read { buf, .. } => {
                if s.crashed {
                    return Err(crashed_error());
                }
                for (i, chunk) in buf.chunks_mut(bs).enumerate() {
                    let block = first + i as u64;
                    let roll = s.rng.next_f64();
                    if s.plan.bad_read_blocks.contains(&block) || roll < s.plan.read_error_rate {
                        return Err(io::Error::other(format!("injected read error on block {block}")));
                    }
                    chunk.copy_from_slice(&self.cached_block(s, block));
                }
                Ok(())
            }
            IoOp::Write { buf, .. } => {
                for (i, chunk) in buf.chunks(bs).enumerate() {
                    self.write_block(s, first + i as u64, chunk)?;
                }
                Ok(())
            }
        }
    }
}

fn crash(s: &mut State, block_size: usize) {
    if s.crashed {
        return;
    }
    s.crashed = true;
    let cache = std::mem::take(&mut s.cache);
    let order = std::mem::take(&mut s.cache_order);
    let persist = |durable: &mut Vec<u8>, block: u64, data: &[u8]| {
        let at = block as usize * block_size;
        durable[at..at + data.len()].copy_from_slice(data);
    };
    match s.plan.crash_mode {
        CrashMode::DropUnflushed => {}
        CrashMode::TearLast { keep } => {
            if let Some(&last) = order.last() {
                let keep = keep.min(block_size);
                persist(&mut s.durable, last, &cache[&last][..keep]);
            }
        }
        CrashMode::KeepRandom => {
            for (&block, data) in &cache {
                if s.rng.next_u64() & 1 == 1 {
                    persist(&mut s.durable, block, data);
                }
            }
        }
    }
}

impl BlockDevice for MemDevice {
    fn geometry(&self) -> Geometry {
        self.geo
    }
    fn info(&self) -> DeviceInfo {
        DeviceInfo { kind: "mem", path: "(memory)".into(), note: None, queue_depth: 1 }
    }
    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<io::Result<()>> {
        let mut s = self.state();
        ops.iter_mut().map(|op| self.run(&mut s, op)).collect()
    }
    fn flush(&self) -> io::Result<()> {
        let mut s = self.state();
        if s.crashed {
            return Err(crashed_error());
        }
        let op = s.ops;
        if s.plan.crash_after_ops == Some(op) {
            crash(&mut s, self.geo.block_size);
            return Err(crashed_error());
        }
        s.ops += 1;
        if s.plan.fail_flush_from_op.is_some_and(|from| op >= from) {
            return Err(io::Error::other("injected flush error"));
        }
        let cache = std::mem::take(&mut s.cache);
        s.cache_order.clear();
        for (block, data) in cache {
            let at = block as usize * self.geo.block_size;
            s.durable[at..at + self.geo.block_size].copy_from_slice(&data);
        }
        Ok(())
    }
}
