//! Streams: the numbered blocks of one (owner, stream tag), mapped to device blocks by extent
//! blocks. [`StreamMap`] is the in-memory map; [`StreamDraft`] is a stream being written.

use crate::alloc::Allocator;
use crate::blockio::{max_payload, read_many, WriteQueue};
use crate::device::BlockDevice;
use crate::error::{BlockFault, Error, Result};
use crate::format::records::{ExtentBlock, Run, StreamRoot};
use crate::format::{BlockHeader, BlockKind, BlockRef, Expect, Owner, StreamTag};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId {
    pub owner: Owner,
    pub tag: StreamTag,
}

impl StreamId {
    /// The block kind of the stream's content blocks.
    pub fn kind(&self) -> BlockKind {
        match self.tag {
            StreamTag::Tokens | StreamTag::Meta => BlockKind::Catalog,
            StreamTag::Index => BlockKind::Index,
            StreamTag::Data => BlockKind::Data,
        }
    }

    /// What block `logical` of this stream must be, given its recorded CRC.
    pub fn expect(&self, logical: u64, crc: u32, generation: u64) -> Expect {
        Expect { kind: self.kind(), stream: self.tag, owner: self.owner, logical, crc, max_generation: generation }
    }

    pub fn extent_expect(&self, position: u64, crc: u32, generation: u64) -> Expect {
        Expect {
            kind: BlockKind::Extent,
            stream: self.tag,
            owner: self.owner,
            logical: position,
            crc,
            max_generation: generation,
        }
    }
}

/// Logical blocks `logical ..` at device blocks `start, start + step, …` (`len` of them). A
/// step of 2 keeps a stream written side by side with another (a vector file's key and value
/// blocks, [`crate::Txn::append_block_pair`]) one run in memory; on disk each of its blocks is
/// a run of its own (docs/format.md §10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct MapRun {
    logical: u64,
    start: u64,
    len: u64,
    step: u64,
}

impl MapRun {
    fn block(&self, i: u64) -> u64 {
        self.start + i * self.step
    }
}

/// Largest device-block step one in-memory run takes: 1 (consecutive) or 2 (side by side).
const MAX_RUN_STEP: u64 = 2;

/// Logical block → (device block, CRC) for one stream.
#[derive(Debug, Clone, Default)]
pub struct StreamMap {
    runs: Vec<MapRun>,
    crcs: Vec<u32>,
    /// First logical block each persisted extent block describes.
    extent_first: Vec<u64>,
}

impl StreamMap {
    pub fn len(&self) -> u64 {
        self.crcs.len() as u64
    }

    pub fn is_empty(&self) -> bool {
        self.crcs.is_empty()
    }

    /// Drops the room the map kept to grow: a snapshot keeps it, and readers serve from it,
    /// for as long as the stream is read.
    pub(crate) fn shrink(&mut self) {
        self.runs.shrink_to_fit();
        self.crcs.shrink_to_fit();
        self.extent_first.shrink_to_fit();
    }

    /// Bytes the map takes in memory: a CRC per block, its runs and its extent blocks' firsts.
    pub fn memory_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.crcs.capacity() * std::mem::size_of::<u32>()
            + self.runs.capacity() * std::mem::size_of::<MapRun>()
            + self.extent_first.capacity() * std::mem::size_of::<u64>()
    }

    pub fn locate(&self, logical: u64) -> Option<BlockRef> {
        let i = self.runs.partition_point(|r| r.logical + r.len <= logical);
        let run = self.runs.get(i).filter(|r| r.logical <= logical)?;
        Some(BlockRef { block: run.block(logical - run.logical), crc: self.crcs[logical as usize] })
    }

    /// Device blocks holding the stream's content, in logical order.
    pub fn device_blocks(&self) -> impl Iterator<Item = u64> + '_ {
        self.runs.iter().flat_map(|r| (0..r.len).map(|i| r.block(i)))
    }

    /// The device block after the stream's last one (block 2 for an empty stream): where
    /// its next block would best go.
    pub fn next_block(&self) -> u64 {
        self.runs.last().map_or(2, |r| r.block(r.len - 1) + 1)
    }

    /// Runs of evenly spaced device blocks as (first logical, first device block, length,
    /// step between device blocks: 1 for consecutive ones).
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64, u64, u64)> + '_ {
        self.runs.iter().map(|r| (r.logical, r.start, r.len, r.step))
    }

    fn push(&mut self, block: u64, crc: u32) {
        let logical = self.len();
        match self.runs.last_mut() {
            Some(r) if r.len > 1 && r.block(r.len) == block => r.len += 1,
            // A run of one block takes its step from the block that follows it.
            Some(r) if r.len == 1 && block > r.start && block - r.start <= MAX_RUN_STEP => {
                r.step = block - r.start;
                r.len = 2;
            }
            _ => self.runs.push(MapRun { logical, start: block, len: 1, step: 1 }),
        }
        self.crcs.push(crc);
    }

    fn pop(&mut self) -> Option<u64> {
        self.crcs.pop()?;
        let r = self.runs.last_mut().expect("runs cover crcs");
        r.len -= 1;
        let block = r.block(r.len);
        if r.len == 1 {
            r.step = 1; // as a run of one block is made: the next push sets its step
        } else if r.len == 0 {
            self.runs.pop();
        }
        Some(block)
    }

    /// Reads and checks a stream's extent blocks. Every problem names its block.
    pub fn load(dev: &dyn BlockDevice, id: StreamId, root: &StreamRoot, generation: u64) -> Result<StreamMap> {
        let reqs: Vec<(u64, Expect)> = root
            .extents
            .iter()
            .enumerate()
            .map(|(i, r)| (r.block, id.extent_expect(i as u64, r.crc, generation)))
            .collect();
        let mut map = StreamMap::default();
        for (res, (block, expect)) in read_many(dev, &reqs).into_iter().zip(&reqs) {
            let b = res?;
            let bad =
                |what: String| Error::damaged(*block, "extent", expect.owner.to_string(), BlockFault::Malformed(what));
            let eb = ExtentBlock::decode(b.payload(), dev.num_blocks())
                .map_err(|f| Error::damaged(*block, "extent", expect.owner.to_string(), f))?;
            if eb.first_logical != map.len() {
                return Err(bad(format!("starts at logical {}, expected {}", eb.first_logical, map.len())));
            }
            map.extent_first.push(eb.first_logical);
            let mut crcs = eb.crcs.iter();
            for run in &eb.runs {
                for block in run.start..run.start + run.len as u64 {
                    map.push(block, *crcs.next().expect("decode checked run lengths"));
                }
            }
        }
        if map.len() != root.blocks {
            return Err(Error::damaged(
                root.extents.last().map_or(0, |r| r.block),
                "extent",
                id.owner.to_string(),
                BlockFault::Malformed(format!("extents map {} blocks, the record says {}", map.len(), root.blocks)),
            ));
        }
        map.shrink();
        Ok(map)
    }

    /// Packs logical blocks `from..` greedily into extent blocks.
    fn pack(&self, from: u64, block_size: usize) -> Vec<ExtentBlock> {
        let cap = max_payload(block_size);
        let mut out: Vec<ExtentBlock> = Vec::new();
        let mut cur = ExtentBlock { first_logical: from, ..Default::default() };
        for logical in from..self.len() {
            let at = self.locate(logical).expect("logical within map");
            let extends = cur.runs.last().is_some_and(|r| r.start + r.len as u64 == at.block && r.len < u32::MAX);
            let runs = cur.runs.len() + usize::from(!extends);
            if ExtentBlock::encoded_len(runs, cur.crcs.len() + 1) > cap {
                let first_logical = logical;
                out.push(std::mem::replace(&mut cur, ExtentBlock { first_logical, ..Default::default() }));
                cur.runs.push(Run { start: at.block, len: 1 });
            } else if extends {
                cur.runs.last_mut().expect("extends implies a run").len += 1;
            } else {
                cur.runs.push(Run { start: at.block, len: 1 });
            }
            cur.crcs.push(at.crc);
        }
        if !cur.crcs.is_empty() {
            out.push(cur);
        }
        out
    }
}

/// Refuses a payload larger than a block holds, before any block is taken for it.
pub(crate) fn check_payload(dev: &dyn BlockDevice, data: &[u8]) -> Result<()> {
    if data.len() > max_payload(dev.block_size()) {
        return Err(Error::InvalidArgument(format!(
            "block payload of {} bytes exceeds the {} bytes a block holds",
            data.len(),
            max_payload(dev.block_size())
        )));
    }
    Ok(())
}

/// Blocks a stream reserves at a time, doubling from the first to the last, so that small
/// streams stay small and large ones get long contiguous runs.
const FIRST_RESERVATION: u64 = 4;
const MAX_RESERVATION: u64 = 256;

/// A stream open for writing in a transaction.
pub(crate) struct StreamDraft {
    pub id: StreamId,
    pub map: StreamMap,
    pub bytes: u64,
    pub extent_refs: Vec<BlockRef>,
    /// The first logical block changed since the stream was last committed.
    dirty_from: Option<u64>,
    reserved: std::ops::Range<u64>,
    next_reservation: u64,
}

impl StreamDraft {
    pub fn new(id: StreamId) -> Self {
        Self::from_committed(id, StreamMap::default(), &StreamRoot::default())
    }

    pub fn from_committed(id: StreamId, map: StreamMap, root: &StreamRoot) -> Self {
        StreamDraft {
            id,
            map,
            bytes: root.bytes,
            extent_refs: root.extents.clone(),
            dirty_from: None,
            reserved: 0..0,
            next_reservation: FIRST_RESERVATION,
        }
    }

    pub fn root(&self) -> StreamRoot {
        StreamRoot { blocks: self.map.len(), bytes: self.bytes, extents: self.extent_refs.clone() }
    }

    fn mark_dirty(&mut self, logical: u64) {
        self.dirty_from = Some(self.dirty_from.map_or(logical, |d| d.min(logical)));
    }

    /// Takes the next reserved block, reserving more when none is left.
    fn take_block(&mut self, alloc: &mut Allocator) -> Result<u64> {
        if self.reserved.is_empty() {
            let hint = self.map.next_block();
            let (first, n) = alloc.alloc_run(hint, self.next_reservation).ok_or_else(|| alloc.full(1))?;
            self.reserved = first..first + n;
            self.next_reservation = (self.next_reservation * 2).min(MAX_RESERVATION);
        }
        let block = self.reserved.start;
        self.reserved.start += 1;
        Ok(block)
    }

    /// Gives back reserved blocks that were never written.
    pub fn unreserve(&mut self, alloc: &mut Allocator) {
        for b in self.reserved.clone() {
            alloc.unreserve(b);
        }
        self.reserved = 0..0;
    }

    /// Queues `data` as the next logical block and returns its index.
    pub fn push(
        &mut self,
        alloc: &mut Allocator,
        queue: &mut WriteQueue,
        dev: &dyn BlockDevice,
        generation: u64,
        data: &[u8],
    ) -> Result<u64> {
        check_payload(dev, data)?;
        let block = self.take_block(alloc)?;
        self.push_to(block, queue, dev, generation, data)
    }

    /// Queues `data`, which [`check_payload`] passed, as the next logical block, at device
    /// `block` (allocated by the caller), and returns its index.
    pub fn push_to(
        &mut self,
        block: u64,
        queue: &mut WriteQueue,
        dev: &dyn BlockDevice,
        generation: u64,
        data: &[u8],
    ) -> Result<u64> {
        debug_assert!(check_payload(dev, data).is_ok(), "payloads are checked before their blocks are taken");
        let logical = self.map.len();
        let header = BlockHeader {
            kind: self.id.kind(),
            stream: self.id.tag,
            owner: self.id.owner,
            payload_len: data.len() as u32,
            logical,
            generation,
        };
        let crc = queue.push(block, &header, data)?;
        self.map.push(block, crc);
        self.bytes += data.len() as u64;
        self.mark_dirty(logical);
        Ok(logical)
    }

    /// Removes the last block (to rewrite it); `payload_len` is its payload size.
    pub fn pop(&mut self, alloc: &mut Allocator, payload_len: u64) {
        let block = self.map.pop().expect("pop of an empty stream");
        self.bytes -= payload_len;
        alloc.free(block);
        let logical = self.map.len();
        self.mark_dirty(logical);
    }

    /// Writes the extent blocks that changed since the last commit.
    pub fn write_extents(
        &mut self,
        alloc: &mut Allocator,
        queue: &mut WriteQueue,
        dev: &dyn BlockDevice,
        generation: u64,
    ) -> Result<()> {
        let Some(from) = self.dirty_from.take() else {
            return Ok(());
        };
        // The extent block holding `from` and every later one are rewritten.
        let keep = self.map.extent_first.partition_point(|&f| f <= from).saturating_sub(1).min(self.extent_refs.len());
        let start = self.map.extent_first.get(keep).copied().unwrap_or(0);
        for r in self.extent_refs.drain(keep..) {
            alloc.free(r.block);
        }
        self.map.extent_first.truncate(keep);
        let hint = self.map.next_block();
        for (i, eb) in self.map.pack(start, dev.block_size()).into_iter().enumerate() {
            let block = alloc.alloc(hint).ok_or_else(|| alloc.full(1))?;
            let payload = eb.encode();
            let header = BlockHeader {
                kind: BlockKind::Extent,
                stream: self.id.tag,
                owner: self.id.owner,
                payload_len: payload.len() as u32,
                logical: (keep + i) as u64,
                generation,
            };
            let crc = queue.push(block, &header, &payload)?;
            self.extent_refs.push(BlockRef { block, crc });
            self.map.extent_first.push(eb.first_logical);
        }
        Ok(())
    }

    /// Frees every block of the stream: content and extent blocks.
    pub fn free_all(map: &StreamMap, root: &StreamRoot, alloc: &mut Allocator) {
        for b in map.device_blocks() {
            alloc.free(b);
        }
        for r in &root.extents {
            alloc.free(r.block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_take_steps_of_one_and_two_and_unwind_exactly() {
        let blocks = [10u64, 12, 14, 15, 16, 17, 20, 21, 30, 32, 33];
        let mut map = StreamMap::default();
        let mut runs_after = Vec::new();
        for (i, &b) in blocks.iter().enumerate() {
            map.push(b, 1000 + i as u32);
            runs_after.push(map.runs.clone());
        }
        let runs: Vec<(u64, u64, u64, u64)> = map.runs().collect();
        // 10,12,14 step 2; 15..=17 step 1; 20,21 step 1; 30,32 step 2; 33 alone.
        assert_eq!(runs, [(0, 10, 3, 2), (3, 15, 3, 1), (6, 20, 2, 1), (8, 30, 2, 2), (10, 33, 1, 1)]);
        assert_eq!(map.device_blocks().collect::<Vec<_>>(), blocks);
        assert_eq!(map.next_block(), 34);
        assert_eq!(StreamMap::default().next_block(), 2);
        for (l, &b) in blocks.iter().enumerate() {
            assert_eq!(map.locate(l as u64), Some(BlockRef { block: b, crc: 1000 + l as u32 }));
        }
        assert_eq!(map.locate(blocks.len() as u64), None);
        // On disk every block of a step-2 run is a run of its own.
        let packed = map.pack(0, 4096);
        assert_eq!(packed.len(), 1);
        let disk: Vec<(u64, u32)> = packed[0].runs.iter().map(|r| (r.start, r.len)).collect();
        assert_eq!(disk, [(10, 1), (12, 1), (14, 4), (20, 2), (30, 1), (32, 2)]);
        // Popping returns the blocks in reverse and leaves the runs as they were.
        for i in (0..blocks.len()).rev() {
            if i > 0 {
                assert_eq!(map.runs, runs_after[i]);
            }
            assert_eq!(map.pop(), Some(blocks[i]));
        }
        assert!(map.runs.is_empty() && map.is_empty());
    }
}
