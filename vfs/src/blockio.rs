//! Reading blocks through references (with full verification), staging writes into batches,
//! and chains: blobs stored across linked blocks.

use crate::device::{AlignedBuf, BlockDevice, IoOp};
use crate::error::{BlockFault, Error, Result};
use crate::format::codec::{Dec, Enc};
use crate::format::header::{payload, seal, verify};
use crate::format::records::chain_capacity;
use crate::format::{BlockHeader, BlockKind, BlockRef, Expect, Owner, StreamTag, HEADER_LEN};
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// One block inside a (possibly multi-block) read buffer. Blocks of one coalesced read share
/// the buffer, so splitting a read into blocks copies nothing.
#[derive(Clone)]
pub struct RawBlock {
    buf: Arc<AlignedBuf>,
    at: usize,
    len: usize,
}

impl RawBlock {
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.at..self.at + self.len]
    }
}

/// A block read and verified: its bytes and header.
pub struct BlockBuf {
    raw: RawBlock,
    header: BlockHeader,
}

impl BlockBuf {
    pub fn header(&self) -> &BlockHeader {
        &self.header
    }
    pub fn payload(&self) -> &[u8] {
        payload(self.raw.bytes(), &self.header)
    }
    /// The whole block, header included.
    pub fn raw(&self) -> &[u8] {
        self.raw.bytes()
    }
}

pub(crate) fn damaged(block: u64, expect: &Expect, fault: BlockFault) -> Error {
    Error::mismatch(block, expect, fault)
}

/// Reads one block's raw bytes, unchecked (superblock slots, inspection).
pub fn read_raw(dev: &dyn BlockDevice, block: u64) -> std::io::Result<AlignedBuf> {
    let mut buf = AlignedBuf::zeroed(dev.block_size());
    dev.submit(&mut [IoOp::Read { block, buf: &mut buf }]).pop().expect("one result")?;
    Ok(buf)
}

/// Reads one block and checks it against what its reference says.
pub fn read_verified(dev: &dyn BlockDevice, block: u64, expect: &Expect) -> Result<BlockBuf> {
    read_many(dev, &[(block, *expect)]).pop().expect("one result")
}

/// Reads many blocks in one submission, coalescing runs of consecutive device blocks, and
/// verifies each. One result per request, in request order.
pub fn read_many(dev: &dyn BlockDevice, reqs: &[(u64, Expect)]) -> Vec<Result<BlockBuf>> {
    read_many_pooled(dev, reqs, &mut Vec::new())
}

/// [`read_many`] with buffers from a [`ReadPool`].
pub fn read_many_pooled(dev: &dyn BlockDevice, reqs: &[(u64, Expect)], pool: &mut ReadPool) -> Vec<Result<BlockBuf>> {
    let blocks: Vec<u64> = reqs.iter().map(|r| r.0).collect();
    read_raw_many_pooled(dev, &blocks, pool)
        .into_iter()
        .zip(reqs)
        .map(|(raw, (block, expect))| {
            let raw = raw?;
            let header = verify(raw.bytes(), expect).map_err(|f| damaged(*block, expect, f))?;
            Ok(BlockBuf { raw, header })
        })
        .collect()
}

/// Reads many blocks in one submission, coalescing runs of consecutive device blocks, without
/// checking them. One result per requested block, in request order.
pub fn read_raw_many(dev: &dyn BlockDevice, blocks: &[u64]) -> Vec<Result<RawBlock>> {
    read_raw_many_pooled(dev, blocks, &mut Vec::new())
}

/// Read buffers kept for reuse by a sequential reader: a buffer goes back into service once
/// every block handed out from it has been dropped. Fresh buffers would make each O_DIRECT
/// read fault in and zero new pages.
pub type ReadPool = Vec<Arc<AlignedBuf>>;

/// [`read_raw_many`], taking its buffers from `pool` where it can and leaving them there.
pub fn read_raw_many_pooled(dev: &dyn BlockDevice, blocks: &[u64], pool: &mut ReadPool) -> Vec<Result<RawBlock>> {
    /// Longest coalesced read: 1 MiB of 4 KiB blocks.
    const MAX_RUN: usize = 256;
    let bs = dev.block_size();
    let mut sorted = blocks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    // Group sorted, distinct blocks into runs.
    let mut runs: Vec<(u64, usize)> = Vec::new();
    for b in sorted {
        match runs.last_mut() {
            Some((start, n)) if *start + *n as u64 == b && *n < MAX_RUN => *n += 1,
            _ => runs.push((b, 1)),
        }
    }
    let mut spare: Vec<AlignedBuf> = pool.drain(..).filter_map(|b| Arc::try_unwrap(b).ok()).collect();
    let mut bufs: Vec<AlignedBuf> = runs
        .iter()
        .map(|&(_, n)| match spare.iter().position(|b| b.len() == n * bs) {
            Some(i) => spare.swap_remove(i),
            None => AlignedBuf::zeroed(n * bs),
        })
        .collect();
    let mut io: Vec<std::io::Result<()>> = {
        let mut ops: Vec<IoOp<'_>> =
            runs.iter().zip(bufs.iter_mut()).map(|(&(block, _), buf)| IoOp::Read { block, buf }).collect();
        dev.submit(&mut ops)
    };
    // A failed coalesced read is retried block by block, so one bad block fails alone.
    let failed: Vec<usize> = (0..runs.len()).filter(|&r| io[r].is_err() && runs[r].1 > 1).collect();
    let mut split: BTreeMap<u64, std::io::Result<RawBlock>> = BTreeMap::new();
    for r in failed {
        let (start, n) = runs[r];
        let mut single: Vec<AlignedBuf> = (0..n).map(|_| AlignedBuf::zeroed(bs)).collect();
        let res = {
            let mut ops: Vec<IoOp<'_>> =
                single.iter_mut().enumerate().map(|(i, buf)| IoOp::Read { block: start + i as u64, buf }).collect();
            dev.submit(&mut ops)
        };
        for (i, (res, buf)) in res.into_iter().zip(single).enumerate() {
            split.insert(start + i as u64, res.map(|()| RawBlock { buf: Arc::new(buf), at: 0, len: bs }));
        }
        io[r] = Ok(());
    }
    let bufs: Vec<Arc<AlignedBuf>> = bufs.into_iter().map(Arc::new).collect();
    pool.extend(bufs.iter().cloned());
    blocks
        .iter()
        .map(|&block| {
            if let Some(res) = split.get(&block) {
                return match res {
                    Ok(buf) => Ok(buf.clone()),
                    Err(e) => Err(Error::BlockIo { block, source: std::io::Error::new(e.kind(), e.to_string()) }),
                };
            }
            let r = runs.partition_point(|&(start, n)| start + n as u64 <= block);
            let (start, _) = runs[r];
            if let Err(e) = &io[r] {
                return Err(Error::BlockIo { block, source: std::io::Error::new(e.kind(), e.to_string()) });
            }
            Ok(RawBlock { buf: bufs[r].clone(), at: (block - start) as usize * bs, len: bs })
        })
        .collect()
}

/// Writes waiting to go to the device, gathered so that consecutive blocks go out as one
/// operation and a batch goes out as one submission. A full batch is written by a thread of
/// its own while the next ones are sealed: a transaction keeps the device busy while it
/// checksums, with up to [`WriteQueue::IN_FLIGHT_BYTES`] in flight, as a sliding window of
/// batches. A batch in flight holds blocks of the open transaction only (blocks freed in it
/// are not handed out again before it commits), so nothing else reads or writes them meanwhile.
pub struct WriteQueue {
    dev: Arc<dyn BlockDevice>,
    capacity: usize,
    buf: AlignedBuf,
    addrs: Vec<u64>,
    /// Batches being written, oldest first.
    in_flight: VecDeque<InFlight>,
    /// Buffers of batches written, for the next ones to fill.
    spare: Vec<AlignedBuf>,
}

/// A batch back from its writing thread: the buffer to reuse and how the write went.
struct WrittenBatch {
    buf: AlignedBuf,
    written: Result<()>,
}

/// A batch sent to the device: on a thread of its own, or already written by the sender
/// when the system would not start a thread (a process or thread limit reached).
enum InFlight {
    Writing(JoinHandle<WrittenBatch>),
    Written(WrittenBatch),
}

impl WriteQueue {
    /// 1 MiB per batch (one submission).
    pub const BATCH_BYTES: usize = 1 << 20;
    /// 4 MiB in flight at most; `ctxfs bench io` gives its raw baseline as many bytes in flight.
    pub const IN_FLIGHT_BYTES: usize = 4 << 20;

    pub fn new(dev: Arc<dyn BlockDevice>) -> Self {
        let capacity = (Self::BATCH_BYTES / dev.block_size()).max(1);
        WriteQueue {
            dev,
            capacity,
            buf: AlignedBuf::zeroed(0),
            addrs: Vec::new(),
            in_flight: VecDeque::new(),
            spare: Vec::new(),
        }
    }

    pub fn block_size(&self) -> usize {
        self.dev.block_size()
    }

    /// Seals a block into the queue and returns its CRC. A full batch goes to the device
    /// first; its failure, or the failure of a batch written before it, is returned.
    pub fn push(&mut self, block: u64, header: &BlockHeader, data: &[u8]) -> Result<u32> {
        if self.addrs.len() == self.capacity {
            self.send()?;
        }
        let bs = self.block_size();
        let at = self.addrs.len() * bs;
        if at == self.buf.len() {
            // Grow by doubling, so small transactions stay small.
            let blocks = (2 * self.addrs.len()).clamp(16, self.capacity);
            let mut bigger = AlignedBuf::zeroed(blocks * bs);
            bigger[..at].copy_from_slice(&self.buf);
            self.buf = bigger;
        }
        self.addrs.push(block);
        Ok(seal(&mut self.buf[at..at + bs], header, data))
    }

    /// Starts writing the queued batch on a thread of its own, once the window has room.
    fn send(&mut self) -> Result<()> {
        let window = (Self::IN_FLIGHT_BYTES / Self::BATCH_BYTES).max(1);
        while self.in_flight.len() >= window {
            self.settle_oldest()?;
        }
        // A transaction that filled one batch is likely to fill the next: its buffer is
        // made whole at once rather than grown.
        let whole = self.capacity * self.block_size();
        let next = self.spare.pop().unwrap_or_else(|| AlignedBuf::zeroed(whole));
        let buf = std::mem::replace(&mut self.buf, next);
        let addrs = std::mem::take(&mut self.addrs);
        // The thread takes the batch from here; a thread that does not start leaves it.
        let batch = Arc::new(Mutex::new(Some((buf, addrs))));
        let (dev, theirs) = (self.dev.clone(), batch.clone());
        let writer = std::thread::Builder::new().name("ctxfs-write".into()).spawn(move || {
            let (buf, addrs) = take_batch(&theirs);
            let written = write_batch(dev.as_ref(), &buf, &addrs);
            WrittenBatch { buf, written }
        });
        self.in_flight.push_back(match writer {
            Ok(thread) => InFlight::Writing(thread),
            Err(_) => {
                let (buf, addrs) = take_batch(&batch);
                let written = write_batch(self.dev.as_ref(), &buf, &addrs);
                InFlight::Written(WrittenBatch { buf, written })
            }
        });
        Ok(())
    }

    /// Waits for the oldest batch in flight and returns how its write went.
    fn settle_oldest(&mut self) -> Result<()> {
        let Some(writer) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let WrittenBatch { buf, written } = match writer {
            InFlight::Writing(thread) => thread
                .join()
                .map_err(|_| Error::Io(std::io::Error::other("the thread writing a batch of blocks panicked")))?,
            InFlight::Written(batch) => batch,
        };
        self.spare.push(buf);
        written
    }

    /// Waits for every batch in flight; returns the first failure, in the order they were sent.
    pub fn settle(&mut self) -> Result<()> {
        let mut first = Ok(());
        while !self.in_flight.is_empty() {
            let written = self.settle_oldest();
            if first.is_ok() {
                first = written;
            }
        }
        first
    }

    /// Writes every queued block and waits until the device has them all (not durably:
    /// that is [`BlockDevice::flush`]); on failure names the first block that failed.
    pub fn finish(&mut self) -> Result<()> {
        self.settle()?;
        let written = write_batch(self.dev.as_ref(), &self.buf, &self.addrs);
        self.addrs.clear();
        written
    }
}

impl Drop for WriteQueue {
    /// Batches still in flight are waited for: their blocks may be handed out again as soon
    /// as the transaction that wrote them is gone.
    fn drop(&mut self) {
        let _ = self.settle();
    }
}

/// The batch a [`WriteQueue`] sent, taken by whoever writes it.
fn take_batch(batch: &Mutex<Option<(AlignedBuf, Vec<u64>)>>) -> (AlignedBuf, Vec<u64>) {
    batch.lock().unwrap_or_else(|p| p.into_inner()).take().expect("a batch is written once")
}

/// Writes `addrs.len()` sealed blocks from `buf` (block `i` to device block `addrs[i]`), runs
/// of consecutive blocks as one operation each; on failure names the first block that failed.
fn write_batch(dev: &dyn BlockDevice, buf: &[u8], addrs: &[u64]) -> Result<()> {
    let bs = dev.block_size();
    let mut spans: Vec<(u64, usize, usize)> = Vec::new(); // (device block, first slot, count)
    for (slot, &b) in addrs.iter().enumerate() {
        match spans.last_mut() {
            Some((start, _, n)) if *start + *n as u64 == b => *n += 1,
            _ => spans.push((b, slot, 1)),
        }
    }
    let results = {
        let mut ops: Vec<IoOp<'_>> = spans
            .iter()
            .map(|&(block, slot, n)| IoOp::Write { block, buf: &buf[slot * bs..(slot + n) * bs] })
            .collect();
        dev.submit(&mut ops)
    };
    for (res, &(block, _, _)) in results.into_iter().zip(&spans) {
        res.map_err(|source| Error::BlockIo { block, source })?;
    }
    Ok(())
}

/// Where a chain's blocks are and what their headers say.
#[derive(Debug, Clone, Copy)]
pub struct ChainId {
    pub kind: BlockKind,
    pub owner: Owner,
}

/// Number of blocks a blob of `len` bytes takes as a chain.
pub fn chain_blocks(block_size: usize, len: usize) -> usize {
    len.div_ceil(chain_capacity(block_size)).max(1)
}

/// Writes `blob` into the given blocks, back to front so each carries its successor's CRC.
/// Returns the reference to the first block.
pub fn write_chain(
    queue: &mut WriteQueue,
    id: ChainId,
    generation: u64,
    blob: &[u8],
    blocks: &[u64],
) -> Result<BlockRef> {
    let cap = chain_capacity(queue.block_size());
    assert_eq!(blocks.len(), chain_blocks(queue.block_size(), blob.len()));
    let mut next = BlockRef::default();
    for (pos, &block) in blocks.iter().enumerate().rev() {
        let piece = &blob[(pos * cap).min(blob.len())..((pos + 1) * cap).min(blob.len())];
        let mut e = Enc(Vec::with_capacity(piece.len() + 16));
        next.encode(&mut e);
        e.bytes(piece);
        let header = BlockHeader {
            kind: id.kind,
            stream: StreamTag::Meta,
            owner: id.owner,
            payload_len: e.0.len() as u32,
            logical: pos as u64,
            generation,
        };
        next = BlockRef { block, crc: queue.push(block, &header, &e.0)? };
    }
    Ok(next)
}

/// A chain's contents: its blob, and the blocks it occupies.
pub type Chain = (Vec<u8>, Vec<u64>);

/// Reads a chain from its first reference.
pub fn read_chain(dev: &dyn BlockDevice, first: BlockRef, id: ChainId, generation: u64) -> Result<Chain> {
    read_chains(dev, &[(first, id)], generation).pop().expect("one chain")
}

/// Chains [`read_chains`] walks side by side: their buffers are held at once.
const CHAINS_AT_ONCE: usize = 1024;

/// Reads many chains, each from its first reference: the next block of every chain still
/// being walked is read in one submission, so a store's many one-block context records cost
/// one submission, not one each. One result per chain, in order.
pub fn read_chains(dev: &dyn BlockDevice, heads: &[(BlockRef, ChainId)], generation: u64) -> Vec<Result<Chain>> {
    let total = dev.num_blocks();
    let mut out = Vec::with_capacity(heads.len());
    for some in heads.chunks(CHAINS_AT_ONCE) {
        let mut walks: Vec<(BlockRef, Vec<u8>, Vec<u64>)> =
            some.iter().map(|h| (h.0, Vec::new(), Vec::new())).collect();
        let mut done: Vec<Option<Result<Chain>>> = some.iter().map(|_| None).collect();
        loop {
            let mut reqs = Vec::new();
            let mut walking = Vec::new();
            for (i, (at, _, blocks)) in walks.iter().enumerate() {
                if done[i].is_some() {
                    continue;
                }
                let id = some[i].1;
                let expect = Expect {
                    kind: id.kind,
                    stream: StreamTag::Meta,
                    owner: id.owner,
                    logical: blocks.len() as u64,
                    crc: at.crc,
                    max_generation: generation,
                };
                if at.block < 2 || at.block >= total || blocks.len() as u64 >= total {
                    let fault = BlockFault::Malformed("chain link out of range".into());
                    done[i] = Some(Err(damaged(at.block, &expect, fault)));
                } else {
                    reqs.push((at.block, expect));
                    walking.push(i);
                }
            }
            if walking.is_empty() {
                break;
            }
            for ((i, read), (block, expect)) in walking.into_iter().zip(read_many(dev, &reqs)).zip(&reqs) {
                let (at, blob, blocks) = &mut walks[i];
                let next = read.and_then(|b| {
                    let mut d = Dec::new(b.payload(), "chain block");
                    let next = BlockRef::decode(&mut d).map_err(|f| damaged(*block, expect, f))?;
                    blob.extend_from_slice(&b.payload()[crate::format::REF_LEN..]);
                    Ok(next)
                });
                match next {
                    Err(e) => done[i] = Some(Err(e)),
                    Ok(next) => {
                        blocks.push(*block);
                        match next.block {
                            0 => done[i] = Some(Ok((std::mem::take(blob), std::mem::take(blocks)))),
                            _ => *at = next,
                        }
                    }
                }
            }
        }
        out.extend(done.into_iter().map(|d| d.expect("every chain walked to its end or an error")));
    }
    out
}

/// Largest payload one block carries.
pub fn max_payload(block_size: usize) -> usize {
    block_size - HEADER_LEN
}
