//! Where frames are filled from. The pool asks for a whole batch at once; the device source
//! sends it to the device as one submission, coalescing runs of adjacent blocks.

use crate::request::{BlockRequest, BufferError};
use crate::sync::{lock, Mutex};
use ctxfs_vfs::device::{AlignedBuf, IoOp};
use ctxfs_vfs::format::header::verify;
use ctxfs_vfs::format::BlockHeader;
use ctxfs_vfs::{BlockDevice, Error};
use std::sync::Arc;

pub trait BlockSource: Send + Sync {
    fn block_size(&self) -> usize;
    /// Fills `bufs[i]` (one block each) with the block `reqs[i]` names, verified against the
    /// request. One result per request. Requests name distinct blocks.
    fn load(&self, reqs: &[BlockRequest], bufs: &mut [&mut [u8]]) -> Vec<Result<BlockHeader, BufferError>>;
}

/// Staging buffers for coalesced reads: a fixed number of fixed size, so the memory they take
/// is a constant. When all are in use, blocks are read one by one, straight into frames.
pub const STAGING_BUFFERS: usize = 4;
/// Longest coalesced read, in blocks.
pub const STAGING_BLOCKS: usize = 64;

pub struct DeviceSource {
    dev: Arc<dyn BlockDevice>,
    staging: Mutex<Vec<AlignedBuf>>,
}

impl DeviceSource {
    pub fn new(dev: Arc<dyn BlockDevice>) -> Self {
        let bytes = STAGING_BLOCKS * dev.block_size();
        let staging = (0..STAGING_BUFFERS).map(|_| AlignedBuf::zeroed(bytes)).collect();
        DeviceSource { dev, staging: Mutex::new(staging) }
    }

    /// Bytes the staging buffers take.
    pub fn staging_bytes(&self) -> usize {
        STAGING_BUFFERS * STAGING_BLOCKS * self.dev.block_size()
    }
}

fn io_error(block: u64, e: &std::io::Error) -> BufferError {
    BufferError::Block(Arc::new(Error::BlockIo { block, source: std::io::Error::new(e.kind(), e.to_string()) }))
}

impl BlockSource for DeviceSource {
    fn block_size(&self) -> usize {
        self.dev.block_size()
    }

    fn load(&self, reqs: &[BlockRequest], bufs: &mut [&mut [u8]]) -> Vec<Result<BlockHeader, BufferError>> {
        let bs = self.dev.block_size();
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by_key(|&i| reqs[i].block);
        // Runs of adjacent device blocks, as positions in `order`.
        let mut runs: Vec<std::ops::Range<usize>> = Vec::new();
        for (pos, &i) in order.iter().enumerate() {
            match runs.last_mut() {
                Some(r) if reqs[order[r.end - 1]].block + 1 == reqs[i].block && r.len() < STAGING_BLOCKS => r.end += 1,
                _ => runs.push(pos..pos + 1),
            }
        }
        let mut staging: Vec<AlignedBuf> = {
            let mut pool = lock(&self.staging);
            let want = runs.iter().filter(|r| r.len() > 1).count().min(pool.len());
            let at = pool.len() - want;
            pool.split_off(at)
        };
        // Runs that got a staging buffer are read coalesced; the rest block by block.
        let coalesced: Vec<std::ops::Range<usize>> =
            runs.iter().filter(|r| r.len() > 1).take(staging.len()).cloned().collect();
        let mut direct: Vec<Option<&mut [u8]>> = bufs.iter_mut().map(|b| Some(&mut **b)).collect();
        for r in &coalesced {
            for pos in r.clone() {
                direct[order[pos]] = None;
            }
        }
        let mut io = {
            let mut ops: Vec<IoOp<'_>> = Vec::new();
            let mut slots: Vec<Slot> = Vec::new();
            for (r, stage) in coalesced.iter().zip(staging.iter_mut()) {
                ops.push(IoOp::Read { block: reqs[order[r.start]].block, buf: &mut stage[..r.len() * bs] });
                slots.push(Slot::Run(r.clone()));
            }
            for (i, buf) in direct.iter_mut().enumerate() {
                if let Some(buf) = buf.take() {
                    ops.push(IoOp::Read { block: reqs[i].block, buf });
                    slots.push(Slot::Single(i));
                }
            }
            let results = self.dev.submit(&mut ops);
            slots.into_iter().zip(results).collect::<Vec<_>>()
        };
        let mut out: Vec<Option<Result<BlockHeader, BufferError>>> = (0..reqs.len()).map(|_| None).collect();
        let mut retry: Vec<usize> = Vec::new();
        for (slot, res) in io.drain(..) {
            match (slot, res) {
                (Slot::Single(i), Ok(())) => out[i] = Some(check(&reqs[i], bufs[i])),
                (Slot::Single(i), Err(e)) => out[i] = Some(Err(io_error(reqs[i].block, &e))),
                (Slot::Run(r), Ok(())) => {
                    let stage = &staging[coalesced.iter().position(|c| *c == r).expect("run has a stage")];
                    for (k, pos) in r.enumerate() {
                        let i = order[pos];
                        bufs[i].copy_from_slice(&stage[k * bs..(k + 1) * bs]);
                        out[i] = Some(check(&reqs[i], bufs[i]));
                    }
                }
                // A failed coalesced read is retried block by block, so the error names the block.
                (Slot::Run(r), Err(_)) => retry.extend(r.map(|pos| order[pos])),
            }
        }
        lock(&self.staging).append(&mut staging);
        if !retry.is_empty() {
            let results = {
                let mut ops: Vec<IoOp<'_>> = Vec::new();
                for (i, buf) in bufs.iter_mut().enumerate() {
                    if retry.contains(&i) {
                        ops.push(IoOp::Read { block: reqs[i].block, buf });
                    }
                }
                self.dev.submit(&mut ops)
            };
            let mut sorted = retry.clone();
            sorted.sort_unstable();
            for (i, res) in sorted.into_iter().zip(results) {
                out[i] = Some(match res {
                    Ok(()) => check(&reqs[i], bufs[i]),
                    Err(e) => Err(io_error(reqs[i].block, &e)),
                });
            }
        }
        out.into_iter().map(|r| r.expect("every request has a result")).collect()
    }
}

enum Slot {
    Single(usize),
    Run(std::ops::Range<usize>),
}

fn check(req: &BlockRequest, buf: &[u8]) -> Result<BlockHeader, BufferError> {
    verify(buf, &req.expect).map_err(|f| BufferError::Block(Arc::new(Error::mismatch(req.block, &req.expect, f))))
}
