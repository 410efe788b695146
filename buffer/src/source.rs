//! Where frames are filled from. The pool asks for a whole batch at once; the device source
//! sends it to the device as one submission, coalescing runs of blocks at most [`RUN_GAP`]
//! apart.

use crate::request::{BlockRequest, BufferError};
use crate::sync::{lock, Mutex};
use ctxfs_vfs::device::{AlignedBuf, IoOp};
use ctxfs_vfs::format::header::verify;
use ctxfs_vfs::format::BlockHeader;
use ctxfs_vfs::{BlockDevice, Error};
use std::ops::Range;
use std::sync::Arc;

pub trait BlockSource: Send + Sync {
    fn block_size(&self) -> usize;
    /// Blocks on the device: requests name blocks below this.
    fn blocks(&self) -> u64;
    /// Fills `bufs[i]` (one block each) with the block `reqs[i]` names, verified against the
    /// request. One result per request. Requests name distinct blocks.
    fn load(&self, reqs: &[BlockRequest], bufs: &mut [&mut [u8]]) -> Vec<Result<BlockHeader, BufferError>>;
}

/// Staging buffers for coalesced reads: a fixed number of fixed size, so the memory they take
/// is bounded. A batch takes one and packs all its runs into it; runs that do not fit, and
/// every run of a batch that finds none free, are read block by block, straight into frames.
pub const STAGING_BUFFERS: usize = 4;
/// Bytes of one staging buffer (1,024 blocks of 4 KiB).
pub const STAGING_BUFFER_BYTES: usize = 4 << 20;
/// Longest coalesced read, in blocks.
pub const RUN_BLOCKS: usize = 64;
/// Blocks nobody asked for that a coalesced read may span between two that were: reading
/// one more block costs a disk bound by its count of random reads about nothing, and a
/// vector file's key blocks lie every other block, beside their values (`Txn::append_block_pair`).
pub const RUN_GAP: u64 = 1;

pub struct DeviceSource {
    dev: Arc<dyn BlockDevice>,
    /// Idle staging buffers, and how many exist: they are made when first needed.
    staging: Mutex<(Vec<AlignedBuf>, usize)>,
}

impl DeviceSource {
    pub fn new(dev: Arc<dyn BlockDevice>) -> Self {
        DeviceSource { dev, staging: Mutex::new((Vec::new(), 0)) }
    }

    /// Bytes the staging buffers may take.
    pub fn staging_bytes(&self) -> usize {
        STAGING_BUFFERS * STAGING_BUFFER_BYTES
    }

    /// An idle staging buffer, or a new one while fewer than [`STAGING_BUFFERS`] exist.
    fn take_staging(&self) -> Option<AlignedBuf> {
        let mut staging = lock(&self.staging);
        let (idle, made) = &mut *staging;
        if let Some(stage) = idle.pop() {
            return Some(stage);
        }
        if *made == STAGING_BUFFERS {
            return None;
        }
        *made += 1;
        drop(staging);
        Some(AlignedBuf::zeroed(STAGING_BUFFER_BYTES))
    }
}

/// The error of reading `block`, for every request of it (an `io::Error` cannot be cloned).
pub(crate) fn io_error(block: u64, e: &std::io::Error) -> BufferError {
    BufferError::Block(Arc::new(Error::BlockIo { block, source: std::io::Error::new(e.kind(), e.to_string()) }))
}

/// A coalesced read: the requests at `positions` of the block order, which name device
/// blocks from `first` to `last` (with at most [`RUN_GAP`] unasked blocks between two),
/// staged from block `at` of the batch's staging buffer.
struct Run {
    positions: Range<usize>,
    first: u64,
    last: u64,
    at: usize,
}

impl Run {
    /// Device blocks the read spans.
    fn span(&self) -> usize {
        (self.last - self.first + 1) as usize
    }
}

/// Splits the sorted blocks into runs whose neighbours are at most [`RUN_GAP`] blocks
/// apart, each spanning at most [`RUN_BLOCKS`] device blocks, as ranges of positions.
fn runs_of(sorted: &[u64]) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for (pos, &block) in sorted.iter().enumerate() {
        match runs.last_mut() {
            Some(r) if block - sorted[r.end - 1] <= RUN_GAP + 1 && block - sorted[r.start] < RUN_BLOCKS as u64 => {
                r.end = pos + 1
            }
            _ => runs.push(pos..pos + 1),
        }
    }
    runs
}

impl BlockSource for DeviceSource {
    fn block_size(&self) -> usize {
        self.dev.block_size()
    }

    fn blocks(&self) -> u64 {
        self.dev.num_blocks()
    }

    fn load(&self, reqs: &[BlockRequest], bufs: &mut [&mut [u8]]) -> Vec<Result<BlockHeader, BufferError>> {
        let bs = self.dev.block_size();
        let stage_blocks = STAGING_BUFFER_BYTES / bs;
        let mut order: Vec<usize> = (0..reqs.len()).collect();
        order.sort_by_key(|&i| reqs[i].block);
        let sorted: Vec<u64> = order.iter().map(|&i| reqs[i].block).collect();
        debug_assert!(sorted.windows(2).all(|w| w[0] < w[1]), "requests name distinct blocks");
        let runs: Vec<Range<usize>> = runs_of(&sorted).into_iter().filter(|r| r.len() > 1).collect();
        let mut stage = if runs.is_empty() { None } else { self.take_staging() };
        // Runs of more than one block are staged while the buffer has room.
        let mut coalesced: Vec<Run> = Vec::new();
        if stage.is_some() {
            let mut at = 0;
            for positions in runs {
                let (first, last) = (sorted[positions.start], sorted[positions.end - 1]);
                if at + (last - first + 1) as usize <= stage_blocks {
                    let run = Run { first, last, positions, at };
                    at += run.span();
                    coalesced.push(run);
                }
            }
        }
        let mut direct: Vec<Option<&mut [u8]>> = bufs.iter_mut().map(|b| Some(&mut **b)).collect();
        for run in &coalesced {
            for pos in run.positions.clone() {
                direct[order[pos]] = None;
            }
        }
        let (runs, singles) = {
            let mut ops: Vec<IoOp<'_>> = Vec::new();
            if let Some(stage) = stage.as_mut() {
                // The runs were packed back to back from block 0 of the stage.
                let mut rest: &mut [u8] = &mut stage[..];
                for run in &coalesced {
                    let (buf, tail) = std::mem::take(&mut rest).split_at_mut(run.span() * bs);
                    ops.push(IoOp::Read { block: run.first, buf });
                    rest = tail;
                }
            }
            let mut singles = Vec::new();
            for (i, buf) in direct.iter_mut().enumerate() {
                if let Some(buf) = buf.take() {
                    ops.push(IoOp::Read { block: reqs[i].block, buf });
                    singles.push(i);
                }
            }
            let mut runs = self.dev.submit(&mut ops);
            let single = runs.split_off(coalesced.len());
            (runs, singles.into_iter().zip(single))
        };
        let mut out: Vec<Option<Result<BlockHeader, BufferError>>> = (0..reqs.len()).map(|_| None).collect();
        let mut retry: Vec<usize> = Vec::new();
        for (i, res) in singles {
            out[i] = Some(outcome(&reqs[i], bufs[i], res));
        }
        for (run, res) in coalesced.iter().zip(runs) {
            match (res, stage.as_ref()) {
                (Ok(()), Some(stage)) => {
                    for pos in run.positions.clone() {
                        let i = order[pos];
                        let k = run.at + (sorted[pos] - run.first) as usize;
                        bufs[i].copy_from_slice(&stage[k * bs..(k + 1) * bs]);
                        out[i] = Some(check(&reqs[i], bufs[i]));
                    }
                }
                // A failed coalesced read is retried block by block, so the error names the
                // block.
                _ => retry.extend(run.positions.clone().map(|pos| order[pos])),
            }
        }
        if let Some(stage) = stage {
            lock(&self.staging).0.push(stage);
        }
        if !retry.is_empty() {
            retry.sort_unstable();
            let results = {
                let mut ops: Vec<IoOp<'_>> = Vec::new();
                for (i, buf) in bufs.iter_mut().enumerate() {
                    if retry.binary_search(&i).is_ok() {
                        ops.push(IoOp::Read { block: reqs[i].block, buf });
                    }
                }
                self.dev.submit(&mut ops)
            };
            for (&i, res) in retry.iter().zip(results) {
                out[i] = Some(outcome(&reqs[i], bufs[i], res));
            }
        }
        out.into_iter().map(|r| r.expect("every request has a result")).collect()
    }
}

/// A block read straight into its frame: verified if the read succeeded.
fn outcome(req: &BlockRequest, buf: &[u8], read: std::io::Result<()>) -> Result<BlockHeader, BufferError> {
    match read {
        Ok(()) => check(req, buf),
        Err(e) => Err(io_error(req.block, &e)),
    }
}

fn check(req: &BlockRequest, buf: &[u8]) -> Result<BlockHeader, BufferError> {
    verify(buf, &req.expect).map_err(|f| BufferError::Block(Arc::new(Error::mismatch(req.block, &req.expect, f))))
}
