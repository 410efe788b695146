//! A mounted store: recovery on open, immutable snapshots for readers, one writer at a time.

use crate::alloc::{Allocator, Bitmap};
use crate::blockio::{
    max_payload, read_chain, read_chains, read_many, read_many_pooled, read_raw, read_verified, BlockBuf, ChainId,
    ReadPool,
};
use crate::device::{self, BlockDevice, DeviceChoice, DeviceInfo, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE};
use crate::error::{BlockFault, Error, Result};
use crate::format::records::{
    bits_per_chunk, decode_alloc_dir, decode_catalog, CatalogEntry, ContextRecord, ParentLink, StreamRoot,
};
use crate::format::{BlockKind, BlockRef, Expect, Owner, StreamTag, Superblock, SUPERBLOCK_SLOTS};
use crate::lock::{Access, StoreLock};
use crate::stream::{StreamId, StreamMap};
use crate::txn::Txn;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};

/// Which stream of a vector file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FileStream {
    Index,
    Data,
}

impl FileStream {
    pub fn tag(self) -> StreamTag {
        match self {
            FileStream::Index => StreamTag::Index,
            FileStream::Data => StreamTag::Data,
        }
    }
}

/// Generations held by live snapshots, so freed blocks are not reused under a reader; with the
/// store's cross-process lock (lock.rs), also those other processes' readers pin.
#[derive(Default)]
pub(crate) struct Readers {
    held: Mutex<BTreeMap<u64, usize>>,
    /// A writer asks it for other processes' pins; a read-only store pins through it.
    lock: Option<StoreLock>,
}

impl Readers {
    pub fn with_lock(lock: Option<StoreLock>) -> Self {
        Readers { held: Mutex::default(), lock }
    }
    fn lock(&self) -> MutexGuard<'_, BTreeMap<u64, usize>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn pins_elsewhere(&self) -> bool {
        self.lock.as_ref().is_some_and(|l| l.access() == Access::Read)
    }
    pub fn read_only(&self) -> bool {
        self.pins_elsewhere()
    }
    /// The oldest generation a reader in this process or, for a writer, in another holds.
    pub fn oldest(&self) -> Option<u64> {
        let here = self.lock().keys().next().copied();
        here.into_iter().chain(self.oldest_elsewhere()).min()
    }
    /// For a writer, the oldest generation a reader in another process pins.
    fn oldest_elsewhere(&self) -> Option<u64> {
        match &self.lock {
            // A pin that cannot be looked up is taken to be the oldest possible one.
            Some(l) if l.access() == Access::Write => l.oldest_pinned_elsewhere().unwrap_or(Some(0)),
            _ => None,
        }
    }
    pub fn ticket(self: &Arc<Self>, generation: u64) -> ReaderTicket {
        *self.lock().entry(generation).or_default() += 1;
        ReaderTicket { readers: self.clone(), generation, root: 0 }
    }
    /// A ticket that other processes see (a read-only store's snapshots hold these): `root`
    /// is the first block of the generation's allocator directory.
    fn pin(self: &Arc<Self>, generation: u64, root: u64) -> Result<ReaderTicket> {
        let mut held = self.lock();
        let count = held.entry(generation).or_default();
        if *count == 0 {
            if let Some(l) = self.lock.as_ref().filter(|_| self.pins_elsewhere()) {
                if let Err(e) = l.pin(generation, root) {
                    held.remove(&generation);
                    return Err(e);
                }
            }
        }
        *count += 1;
        Ok(ReaderTicket { readers: self.clone(), generation, root })
    }

    /// For a writer that opens: the blocks of states that other processes read, older than
    /// the fallback, which neither superblock describes any more. Their allocator bitmaps are
    /// found through the pinned directory blocks; all are held until every reader of a
    /// generation up to the newest pinned one is gone. A bitmap that cannot be read holds
    /// every free block instead.
    fn hold_older_states(
        &self,
        dev: &dyn BlockDevice,
        sb: &Superblock,
        fallback: Option<Superblock>,
        alloc: &mut Allocator,
    ) {
        let Some(lock) = self.lock.as_ref().filter(|l| l.access() == Access::Write) else { return };
        let known = fallback.map_or(sb.generation, |f| f.generation);
        let (generations, roots) = match lock.pins_elsewhere() {
            Ok(pins) => pins,
            Err(_) => return alloc.freeze(known),
        };
        let Some(&newest) = generations.iter().filter(|&&g| g < known).max() else { return };
        let described = [Some(sb.alloc.block), fallback.map(|f| f.alloc.block)];
        for root in roots.into_iter().filter(|r| !described.contains(&Some(*r))) {
            match bitmap_at(dev, sb, root) {
                Ok(bitmap) => alloc.hold_for_readers(&bitmap, newest + 1),
                Err(_) => return alloc.freeze(known),
            }
        }
    }

    /// Reads the superblock slots and holds a ticket on the newest generation. A read-only
    /// store's pin is checked against a second read: if the writer committed
    /// twice meanwhile, blocks of the pinned generation may already be reused, so it pins
    /// again. Slots with no valid superblock hold nothing to protect and get no ticket.
    pub fn pin_committed(self: &Arc<Self>, dev: &dyn BlockDevice) -> Result<(Vec<SlotStatus>, Option<ReaderTicket>)> {
        self.pin_committed_racing(dev, || {})
    }

    /// [`Readers::pin_committed`], calling `race` between reading the slots and pinning: a
    /// test commits there to lose the race on purpose.
    fn pin_committed_racing(
        self: &Arc<Self>,
        dev: &dyn BlockDevice,
        mut race: impl FnMut(),
    ) -> Result<(Vec<SlotStatus>, Option<ReaderTicket>)> {
        /// A writer commits far slower than a reader re-reads two blocks; reaching this bound
        /// means the slots change under every read.
        const ATTEMPTS: usize = 64;
        for _ in 0..ATTEMPTS {
            let slots = read_slots(dev)?;
            let Ok((sb, _)) = pick(&slots) else { return Ok((slots, None)) };
            if !self.pins_elsewhere() {
                return Ok((slots, Some(self.ticket(sb.generation))));
            }
            race();
            let ticket = self.pin(sb.generation, sb.alloc.block)?;
            let again = read_slots(dev)?;
            let same = |a: &[SlotStatus], b: &[SlotStatus]| {
                a.iter().zip(b).all(|(x, y)| match (&x.result, &y.result) {
                    (Ok(p), Ok(q)) => p.generation == q.generation,
                    (Err(p), Err(q)) => p == q,
                    _ => false,
                })
            };
            if same(&slots, &again) {
                return Ok((slots, Some(ticket)));
            }
        }
        Err(Error::Io(std::io::Error::other(format!(
            "the superblocks changed under {ATTEMPTS} reads in a row; cannot pin a committed state"
        ))))
    }
}

pub(crate) struct ReaderTicket {
    readers: Arc<Readers>,
    generation: u64,
    root: u64,
}

impl Drop for ReaderTicket {
    fn drop(&mut self) {
        let mut map = self.readers.lock();
        if let Some(n) = map.get_mut(&self.generation) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.generation);
                if let Some(l) = self.readers.lock.as_ref().filter(|_| self.readers.pins_elsewhere()) {
                    l.unpin(self.generation, self.root);
                }
            }
        }
    }
}

/// A stream root whose extent map is read on first use.
pub(crate) struct LazyStream {
    pub id: StreamId,
    pub root: StreamRoot,
    map: OnceLock<Arc<StreamMap>>,
}

impl LazyStream {
    pub fn new(id: StreamId, root: StreamRoot) -> Self {
        LazyStream { id, root, map: OnceLock::new() }
    }
    pub fn with_map(id: StreamId, root: StreamRoot, mut map: StreamMap) -> Self {
        map.shrink();
        let s = Self::new(id, root);
        let _ = s.map.set(Arc::new(map));
        s
    }
    pub fn map(&self, dev: &dyn BlockDevice, generation: u64) -> Result<Arc<StreamMap>> {
        if let Some(m) = self.map.get() {
            return Ok(m.clone());
        }
        // Errors are not cached: a transient I/O error must not stick.
        let loaded = Arc::new(StreamMap::load(dev, self.id, &self.root, generation)?);
        Ok(self.map.get_or_init(|| loaded).clone())
    }
}

pub(crate) struct ContextMeta {
    pub record: ContextRecord,
    pub record_ref: BlockRef,
    pub record_blocks: Vec<u64>,
    pub tokens: LazyStream,
    /// (index, data) per file, layer-major.
    pub files: Vec<[LazyStream; 2]>,
}

impl ContextMeta {
    pub fn from_record(record: ContextRecord, record_ref: BlockRef, record_blocks: Vec<u64>) -> Self {
        let id = record.id;
        let tokens =
            LazyStream::new(StreamId { owner: Owner::context(id), tag: StreamTag::Tokens }, record.tokens.clone());
        let kv = record.shape.kv_heads as usize;
        let files = record
            .files
            .iter()
            .enumerate()
            .map(|(i, f)| {
                let owner = Owner::file(id, (i / kv) as u16, (i % kv) as u16);
                [
                    LazyStream::new(StreamId { owner, tag: StreamTag::Index }, f.index.clone()),
                    LazyStream::new(StreamId { owner, tag: StreamTag::Data }, f.data.clone()),
                ]
            })
            .collect();
        ContextMeta { record, record_ref, record_blocks, tokens, files }
    }

    pub fn streams(&self) -> impl Iterator<Item = &LazyStream> {
        std::iter::once(&self.tokens).chain(self.files.iter().flatten())
    }

    /// Checks that each stream's byte count fits its blocks, as the writers leave them: a
    /// vector file's at most a full payload a block and none without blocks, the token
    /// stream's of whole tokens in blocks full but the last. Appending reads the last token
    /// block by that count.
    fn check_roots(&self, block_size: usize) -> Result<()> {
        let full = max_payload(block_size) as u64;
        let token_block = full / 4 * 4;
        let kv = self.record.shape.kv_heads as usize;
        for (i, f) in self.record.files.iter().enumerate() {
            for (stream, r) in [("index", &f.index), ("data", &f.data)] {
                if r.bytes > r.blocks.saturating_mul(full) || (r.blocks == 0 && r.bytes > 0) {
                    return Err(self.damaged(format!(
                        "the {stream} stream of layer {} head {} says {} bytes in {} blocks",
                        i / kv,
                        i % kv,
                        r.bytes,
                        r.blocks
                    )));
                }
            }
        }
        let tokens = &self.record.tokens;
        let tail_short = tokens.blocks > 0 && tokens.bytes <= (tokens.blocks - 1) * token_block;
        if !tokens.bytes.is_multiple_of(4) || tail_short || tokens.bytes > tokens.blocks.saturating_mul(token_block) {
            return Err(self.damaged(format!(
                "token stream says {} bytes in {} blocks of {token_block}",
                tokens.bytes, tokens.blocks
            )));
        }
        Ok(())
    }

    /// Damage found in what this context's record says, named by the record's first block.
    pub fn damaged(&self, what: String) -> Error {
        let owner = Owner::context(self.record.id).to_string();
        Error::damaged(self.record_ref.block, "catalog", owner, BlockFault::Malformed(what))
    }
}

/// One committed state of the store. Readers hold it for as long as they read; the blocks it
/// references are not reused until it is dropped.
pub struct Snapshot {
    pub(crate) dev: Arc<dyn BlockDevice>,
    pub(crate) superblock: Superblock,
    pub(crate) contexts: Contexts,
    pub(crate) retired: Retired,
    pub(crate) damaged: Arc<Damaged>,
    pub(crate) catalog_blocks: Vec<u64>,
    pub(crate) _ticket: Option<ReaderTicket>,
}

impl Snapshot {
    pub fn generation(&self) -> u64 {
        self.superblock.generation
    }
    pub fn superblock(&self) -> &Superblock {
        &self.superblock
    }
    pub fn block_size(&self) -> usize {
        self.dev.block_size()
    }
    /// Committed contexts, by name. Retired contexts are not listed: their names are free.
    pub fn contexts(&self) -> impl Iterator<Item = &ContextRecord> {
        self.contexts.values().map(|c| &c.record)
    }
    /// Contexts deleted by name but kept for their descendants, by id.
    pub fn retired_contexts(&self) -> impl Iterator<Item = &ContextRecord> {
        self.retired.values().map(|c| &c.record)
    }
    pub fn context(&self, name: &str) -> Result<Context<'_>> {
        match self.contexts.get(name) {
            Some(meta) => Ok(Context { snap: self, meta }),
            None => Err(self.missing(name)),
        }
    }
    /// The error for a name no live context has: its damaged entry's, if one has it.
    pub(crate) fn missing(&self, name: &str) -> Error {
        self.damaged_named(name).map_or_else(|| Error::NoSuchContext(name.to_string()), DamagedContext::error)
    }
    /// A context by id, retired ones included: how a child finds its parent.
    pub fn context_by_id(&self, id: u32) -> Result<Context<'_>> {
        match self.meta_by_id(id) {
            Some(meta) => Ok(Context { snap: self, meta }),
            None => Err(self.damaged.get(&id).map_or(Error::NoSuchContextId(id), DamagedContext::error)),
        }
    }
    /// Catalog entries whose context record cannot be read: the store is served around them.
    pub fn damaged_contexts(&self) -> impl Iterator<Item = &DamagedContext> {
        self.damaged.values()
    }
    /// The damaged entry named `name`, if one is.
    pub(crate) fn damaged_named(&self, name: &str) -> Option<&DamagedContext> {
        self.damaged.values().find(|d| d.entry.name == name)
    }
    fn meta_by_id(&self, id: u32) -> Option<&ContextMeta> {
        let live = || self.contexts.values().find(|m| m.record.id == id);
        self.retired.get(&id).or_else(live).map(|m| &**m)
    }
    pub(crate) fn catalog_blocks(&self) -> &[u64] {
        &self.catalog_blocks
    }

    /// The parent `link` of `child` names, checked to hold the prefix; `depth` parents have
    /// been followed so far, and more than there are contexts means the links loop.
    fn parent_of(&self, child: &ContextMeta, link: ParentLink, depth: usize) -> Result<&ContextMeta> {
        if depth > self.contexts.len() + self.retired.len() {
            return Err(child.damaged("parent links form a cycle".into()));
        }
        let parent = self.meta_by_id(link.id).ok_or_else(|| match self.damaged.get(&link.id) {
            Some(d) => d.error(),
            None => child.damaged(format!("parent context {} does not exist", link.id)),
        })?;
        if link.prefix_tokens > parent.record.token_count() {
            return Err(child.damaged(format!(
                "prefix of {} tokens exceeds the {} tokens of parent context {}",
                link.prefix_tokens,
                parent.record.token_count(),
                link.id
            )));
        }
        Ok(parent)
    }
}

/// A committed context, read through a snapshot.
pub struct Context<'a> {
    snap: &'a Snapshot,
    meta: &'a ContextMeta,
}

impl<'a> Context<'a> {
    pub fn record(&self) -> &'a ContextRecord {
        &self.meta.record
    }

    pub fn parent(&self) -> Option<ParentLink> {
        self.meta.record.parent
    }

    /// Length of the whole token sequence: the parent's prefix, then the own tokens.
    pub fn token_count(&self) -> u64 {
        self.meta.record.token_count()
    }

    /// Tokens in this context's own token stream.
    pub fn own_token_count(&self) -> u64 {
        self.meta.record.own_token_count()
    }

    /// The whole token sequence: the ancestors' prefix, then the own tokens.
    pub fn tokens(&self) -> Result<Vec<u32>> {
        // From this context up to the root: each one's share is the first `n` of its own tokens.
        let mut shares = Vec::new();
        let (mut meta, mut need) = (self.meta, self.token_count());
        loop {
            let Some(link) = meta.record.parent else {
                shares.push((meta, need));
                break;
            };
            let from_parent = link.prefix_tokens.min(need);
            shares.push((meta, need - from_parent));
            if from_parent == 0 {
                break;
            }
            meta = self.snap.parent_of(meta, link, shares.len())?;
            need = from_parent;
        }
        let mut out = Vec::new();
        for (meta, n) in shares.into_iter().rev() {
            self.read_own(meta, n, &mut out)?;
        }
        Ok(out)
    }

    /// Only this context's own tokens, without the parent's prefix.
    pub fn own_tokens(&self) -> Result<Vec<u32>> {
        let mut out = Vec::new();
        self.read_own(self.meta, self.own_token_count(), &mut out)?;
        Ok(out)
    }

    /// Appends the first `n` tokens of `meta`'s own token stream to `out`.
    fn read_own(&self, meta: &'a ContextMeta, n: u64, out: &mut Vec<u32>) -> Result<()> {
        let s = self.stream_of(&meta.tokens)?;
        let per_block = (max_payload(self.snap.dev.block_size()) / 4) as u64;
        let blocks = n.div_ceil(per_block);
        // Sized by the blocks that exist, not by a count a damaged record could inflate.
        out.reserve(n.min(s.blocks() * per_block) as usize);
        let want = out.len().saturating_add(usize::try_from(n).unwrap_or(usize::MAX));
        for block in s.read_range(0, blocks) {
            let block = block?;
            out.extend(block.payload().chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))));
        }
        if out.len() < want {
            return Err(meta.damaged(format!("token stream holds fewer than the {n} tokens its record claims")));
        }
        out.truncate(want);
        Ok(())
    }

    pub fn stream(&self, layer: u16, head: u16, which: FileStream) -> Result<StreamReader<'a>> {
        let shape = &self.meta.record.shape;
        if layer >= shape.layers || head >= shape.kv_heads {
            return Err(Error::InvalidArgument(format!(
                "context {:?} has {} layers and {} kv heads; no layer {layer} head {head}",
                self.meta.record.name, shape.layers, shape.kv_heads
            )));
        }
        let file = &self.meta.files[layer as usize * shape.kv_heads as usize + head as usize];
        self.stream_of(&file[which as usize])
    }

    fn stream_of(&self, lazy: &'a LazyStream) -> Result<StreamReader<'a>> {
        let map = lazy.map(self.snap.dev.as_ref(), self.snap.generation())?;
        Ok(StreamReader { dev: self.snap.dev.as_ref(), lazy, map, generation: self.snap.generation() })
    }
}

/// One stream's blocks as [`StreamReader::locate`] gives them, with no borrow of the
/// snapshot: its map (a CRC per block and the runs of device blocks), its identity and the
/// generation it was reached from.
#[derive(Debug, Clone)]
pub struct StreamRefs {
    map: Arc<StreamMap>,
    id: StreamId,
    generation: u64,
}

impl StreamRefs {
    /// Blocks in the stream.
    pub fn len(&self) -> u64 {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Where logical block `logical` is, and what reading it must find.
    pub fn locate(&self, logical: u64) -> Option<(u64, Expect)> {
        let r = self.map.locate(logical)?;
        Some((r.block, self.id.expect(logical, r.crc, self.generation)))
    }

    /// Bytes the map takes in memory ([`StreamMap::memory_bytes`]).
    pub fn memory_bytes(&self) -> usize {
        self.map.memory_bytes()
    }
}

/// Reads one stream's blocks; every block is verified against the CRC its extent recorded.
pub struct StreamReader<'a> {
    dev: &'a dyn BlockDevice,
    lazy: &'a LazyStream,
    map: Arc<StreamMap>,
    generation: u64,
}

impl StreamReader<'_> {
    pub fn id(&self) -> StreamId {
        self.lazy.id
    }
    pub fn blocks(&self) -> u64 {
        self.map.len()
    }
    pub fn bytes(&self) -> u64 {
        self.lazy.root.bytes
    }
    pub fn map(&self) -> &StreamMap {
        &self.map
    }
    /// Where logical block `logical` is, and what reading it must find.
    pub fn locate(&self, logical: u64) -> Option<(u64, Expect)> {
        self.refs().locate(logical)
    }

    /// Every block's place and expectations, made on demand from the stream's map, which
    /// the snapshot keeps: a reader that holds them for as long as it serves the stream
    /// holds no copy per block.
    pub fn refs(&self) -> StreamRefs {
        StreamRefs { map: self.map.clone(), id: self.lazy.id, generation: self.generation }
    }

    fn request(&self, logical: u64) -> Result<(u64, Expect)> {
        self.locate(logical).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "{} stream of {} has {} blocks; no block {logical}",
                self.lazy.id.tag.name(),
                self.lazy.id.owner,
                self.blocks()
            ))
        })
    }

    pub fn read(&self, logical: u64) -> Result<BlockBuf> {
        let (block, expect) = self.request(logical)?;
        read_verified(self.dev, block, &expect)
    }

    /// Reads a set of blocks in one batch; one result per requested block.
    pub fn read_many(&self, logicals: &[u64]) -> Vec<Result<BlockBuf>> {
        let mut reqs = Vec::with_capacity(logicals.len());
        let mut errors = BTreeMap::new();
        for (i, &l) in logicals.iter().enumerate() {
            match self.request(l) {
                Ok(r) => reqs.push(r),
                Err(e) => {
                    errors.insert(i, e);
                }
            }
        }
        let mut read = read_many(self.dev, &reqs).into_iter();
        (0..logicals.len())
            .map(|i| errors.remove(&i).map_or_else(|| read.next().expect("one per request"), Err))
            .collect()
    }

    /// Reads `count` blocks from `first` in batches, yielding them in order.
    pub fn read_range(&self, first: u64, count: u64) -> RangeReader<'_> {
        RangeReader {
            stream: self,
            next: first,
            end: (first + count).min(self.blocks()),
            pool: Vec::new(),
            batch: Vec::new().into_iter(),
        }
    }
}

/// Sequential reads of a stream in large batches, reusing its read buffers.
pub struct RangeReader<'a> {
    stream: &'a StreamReader<'a>,
    next: u64,
    end: u64,
    pool: ReadPool,
    batch: std::vec::IntoIter<Result<BlockBuf>>,
}

impl RangeReader<'_> {
    /// Blocks a range read keeps in flight: 8 MiB of 4 KiB blocks, read as 1 MiB operations,
    /// enough to stream. `ctxfs bench io` gives its raw baseline as many bytes in flight.
    pub const BATCH_BLOCKS: u64 = 2048;
}

impl Iterator for RangeReader<'_> {
    type Item = Result<BlockBuf>;
    fn next(&mut self) -> Option<Result<BlockBuf>> {
        if let Some(b) = self.batch.next() {
            return Some(b);
        }
        if self.next >= self.end {
            return None;
        }
        let last = (self.next + Self::BATCH_BLOCKS).min(self.end);
        let reqs: Vec<(u64, Expect)> =
            (self.next..last).map(|l| self.stream.locate(l).expect("within the stream")).collect();
        self.next = last;
        self.batch = read_many_pooled(self.stream.dev, &reqs, &mut self.pool).into_iter();
        self.batch.next()
    }
}

/// What the writer owns: the allocator and where the committed allocator blocks are.
pub(crate) struct WriterState {
    pub alloc: Allocator,
    pub chunk_refs: Vec<BlockRef>,
    pub alloc_dir_blocks: Vec<u64>,
    pub poisoned: Option<String>,
}

/// Block counts of a store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Space {
    pub total: u64,
    /// Allocatable now.
    pub free: u64,
    /// Referenced by the committed state.
    pub used: u64,
    /// Freed by the last commit, still referenced by the fallback state (or by an open
    /// snapshot): allocatable after the next commit.
    pub reclaimable: u64,
}

impl Space {
    fn of(alloc: &Allocator) -> Space {
        Space {
            total: alloc.total(),
            free: alloc.available(),
            used: alloc.committed().count_ones(),
            reclaimable: alloc.quarantined(),
        }
    }
}

/// What `open` found in each superblock slot.
#[derive(Debug, Clone)]
pub struct SlotStatus {
    pub slot: u64,
    pub result: std::result::Result<Superblock, String>,
    /// A superblock valid but for describing more blocks than the device has (the second):
    /// a store file cut short.
    pub beyond_device: Option<(Superblock, u64)>,
}

pub struct Store {
    pub(crate) dev: Arc<dyn BlockDevice>,
    pub(crate) current: RwLock<Arc<Snapshot>>,
    pub(crate) writer: Mutex<WriterState>,
    /// The thread whose transaction holds `writer`: a second `begin` there would wait on
    /// itself (a progress callback that writes, say), so it is refused instead.
    pub(crate) writer_thread: Mutex<Option<std::thread::ThreadId>>,
    /// The allocator's counts as of the last commit or transaction start: read without
    /// `writer`, which a transaction holds until it ends.
    pub(crate) space: RwLock<Space>,
    pub(crate) readers: Arc<Readers>,
    pub(crate) slots: Vec<SlotStatus>,
}

/// How `open` gets the allocator's committed bitmap.
pub(crate) enum AllocSource {
    /// From the allocator blocks the superblock references.
    Persisted,
    /// Given by fsck's reachability walk (repair), or-ed with what is persisted if readable.
    Rebuilt(Bitmap),
}

pub(crate) fn read_slots(dev: &dyn BlockDevice) -> Result<Vec<SlotStatus>> {
    let mut out = Vec::new();
    for slot in 0..SUPERBLOCK_SLOTS {
        let mut beyond_device = None;
        let result = match read_raw(dev, slot) {
            Err(source) => Err(Error::BlockIo { block: slot, source }.to_string()),
            Ok(buf) => match Superblock::decode(&buf, slot) {
                // Everything sized from a superblock (bitmaps, scans) trusts this bound.
                Ok(sb) if sb.total_blocks > dev.num_blocks() => {
                    beyond_device = Some((sb, dev.num_blocks()));
                    Err(format!(
                        "superblock describes {} blocks but the device has {}",
                        sb.total_blocks,
                        dev.num_blocks()
                    ))
                }
                Ok(sb) => Ok(sb),
                Err(e @ Error::UnsupportedVersion { .. }) => return Err(e),
                Err(e) => Err(e.to_string()),
            },
        };
        out.push(SlotStatus { slot, result, beyond_device });
    }
    Ok(out)
}

/// The newest valid superblock, and the other slot's if it is valid and older.
pub(crate) fn pick(slots: &[SlotStatus]) -> Result<(Superblock, Option<Superblock>)> {
    let mut valid: Vec<Superblock> = slots.iter().filter_map(|s| s.result.as_ref().ok().copied()).collect();
    valid.sort_by_key(|sb| std::cmp::Reverse(sb.generation));
    // Every slot the device still holds intact but longer than the device (a slot cut off
    // with the rest counts for one): a store file cut short, not another file.
    let newest_cut = slots.iter().filter_map(|s| s.beyond_device).max_by_key(|(sb, _)| sb.generation);
    let cut_or_gone =
        |s: &SlotStatus| s.beyond_device.is_some() || newest_cut.is_some_and(|(_, blocks)| s.slot >= blocks);
    if let (true, Some((sb, device_blocks))) = (slots.iter().all(cut_or_gone), newest_cut) {
        let bytes = sb.total_blocks * sb.block_size as u64;
        return Err(Error::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "store truncated: its superblocks describe {} blocks of {} bytes ({bytes} bytes), but the device \
                 has {device_blocks} blocks; extend the file back to {bytes} bytes (truncate -s {bytes}), then run \
                 ctxfs fsck: the blocks cut off are lost",
                sb.total_blocks, sb.block_size
            ),
        )));
    }
    match valid.as_slice() {
        [] => Err(Error::NotAStore(format!(
            "no valid superblock ({})",
            slots
                .iter()
                .map(|s| format!("slot {}: {}", s.slot, s.result.as_ref().err().map_or("ok", |e| e)))
                .collect::<Vec<_>>()
                .join("; ")
        ))),
        [only] => Ok((*only, None)),
        [a, b, ..] => Ok((*a, (b.generation < a.generation && b.store_id == a.store_id).then_some(*b))),
    }
}

pub(crate) const CATALOG_CHAIN: ChainId = ChainId { kind: BlockKind::Catalog, owner: Owner::SYSTEM };
pub(crate) const ALLOC_CHAIN: ChainId = ChainId { kind: BlockKind::Alloc, owner: Owner::SYSTEM };

pub(crate) fn record_chain(id: u32) -> ChainId {
    ChainId { kind: BlockKind::Catalog, owner: Owner::context(id) }
}

pub(crate) fn chunk_expect(chunk: u64, crc: u32, generation: u64) -> Expect {
    Expect {
        kind: BlockKind::Alloc,
        stream: StreamTag::Meta,
        owner: Owner::SYSTEM,
        logical: chunk,
        crc,
        max_generation: generation,
    }
}

/// Reads the allocator bitmap a superblock references. Returns it with the chunk references
/// and the directory chain's blocks.
pub(crate) fn load_bitmap(dev: &dyn BlockDevice, sb: &Superblock) -> Result<(Bitmap, Vec<BlockRef>, Vec<u64>)> {
    let (blob, dir_blocks) = read_chain(dev, sb.alloc, ALLOC_CHAIN, sb.generation)?;
    let bad = |what: String| Error::damaged(sb.alloc.block, "alloc", "system", BlockFault::Malformed(what));
    let (total, chunks) = decode_alloc_dir(&blob).map_err(|f| Error::damaged(sb.alloc.block, "alloc", "system", f))?;
    let bpc = bits_per_chunk(dev.block_size());
    if total != sb.total_blocks || chunks.len() as u64 != total.div_ceil(bpc) {
        return Err(bad(format!("directory describes {total} blocks in {} chunks", chunks.len())));
    }
    let mut bitmap = Bitmap::new(total);
    let reqs: Vec<(u64, Expect)> =
        chunks.iter().enumerate().map(|(i, r)| (r.block, chunk_expect(i as u64, r.crc, sb.generation))).collect();
    for (i, res) in read_many(dev, &reqs).into_iter().enumerate() {
        let b = res?;
        let start = i as u64 * bpc;
        let bits = bpc.min(total - start);
        if b.payload().len() as u64 != bits.div_ceil(8) {
            let what = format!("bitmap chunk {i} holds {} bytes for {bits} blocks", b.payload().len());
            return Err(Error::damaged(reqs[i].0, "alloc", "system", BlockFault::Malformed(what)));
        }
        bitmap.load_bytes(start, bits, b.payload());
    }
    Ok((bitmap, chunks, dir_blocks))
}

/// The allocator bitmap whose directory starts at `root`, a block a reader pins: the block's
/// own header gives the CRC and generation to check the chain against.
fn bitmap_at(dev: &dyn BlockDevice, sb: &Superblock, root: u64) -> Result<Bitmap> {
    let raw = read_raw(dev, root).map_err(|source| Error::BlockIo { block: root, source })?;
    let (header, crc) = crate::format::header::unseal(&raw).map_err(|f| Error::damaged(root, "alloc", "system", f))?;
    let state = Superblock { alloc: BlockRef { block: root, crc }, generation: header.generation, ..*sb };
    Ok(load_bitmap(dev, &state)?.0)
}

/// Committed contexts by name.
pub(crate) type Contexts = BTreeMap<String, Arc<ContextMeta>>;
/// Retired contexts by id: they have no name that lookups may find.
pub(crate) type Retired = BTreeMap<u32, Arc<ContextMeta>>;
/// Catalog entries whose context record cannot be read, by id.
pub(crate) type Damaged = BTreeMap<u32, DamagedContext>;

/// A catalog entry whose context record (or what it says) cannot be read. The rest of the
/// store is served around it: commits carry the entry forward as it is, its name stays taken,
/// and its blocks stay allocated, until fsck drops it (`--repair --drop-damaged`).
#[derive(Debug, Clone)]
pub struct DamagedContext {
    pub entry: CatalogEntry,
    /// The block the damage was found in, where one was.
    pub block: Option<u64>,
    pub why: String,
}

impl DamagedContext {
    pub fn error(&self) -> Error {
        Error::DamagedContext {
            name: self.entry.name.clone(),
            id: self.entry.id,
            block: self.block,
            why: self.why.clone(),
        }
    }
}

/// What [`load_catalog`] read.
pub(crate) struct Catalog {
    pub contexts: Contexts,
    pub retired: Retired,
    pub damaged: Damaged,
    /// The catalog chain's blocks.
    pub blocks: Vec<u64>,
}

/// Reads the catalog and every context record a superblock references; `skip` lists ids to
/// leave out. A record that cannot be read (or disagrees with its entry) makes its context
/// damaged, not the catalog: the store is served around it.
pub(crate) fn load_catalog(dev: &dyn BlockDevice, sb: &Superblock, skip: &BTreeSet<u32>) -> Result<Catalog> {
    let (blob, blocks) = read_chain(dev, sb.catalog, CATALOG_CHAIN, sb.generation)?;
    let bad = |block, what: String| Error::damaged(block, "catalog", "system", BlockFault::Malformed(what));
    let entries = decode_catalog(&blob).map_err(|f| Error::damaged(sb.catalog.block, "catalog", "system", f))?;
    let mut catalog = Catalog { contexts: BTreeMap::new(), retired: BTreeMap::new(), damaged: BTreeMap::new(), blocks };
    let mut ids = BTreeSet::new();
    let entries: Vec<CatalogEntry> = entries.into_iter().filter(|e| !skip.contains(&e.id)).collect();
    let heads: Vec<(BlockRef, ChainId)> = entries.iter().map(|e| (e.record, record_chain(e.id))).collect();
    let records = read_chains(dev, &heads, sb.generation);
    for (entry, record) in entries.into_iter().zip(records) {
        if entry.id == 0 || entry.id >= sb.next_context_id || !ids.insert(entry.id) {
            return Err(bad(
                sb.catalog.block,
                format!("context {:?} has id {}: repeated or outside 1..{}", entry.name, entry.id, sb.next_context_id),
            ));
        }
        let meta = match record.and_then(|(blob, blocks)| record_meta(dev, &entry, &blob, blocks)) {
            Ok(meta) => meta,
            Err(e) => {
                let (block, why) = (e.block(), e.to_string());
                catalog.damaged.insert(entry.id, DamagedContext { entry, block, why });
                continue;
            }
        };
        if meta.record.retired {
            catalog.retired.insert(entry.id, meta);
        } else if catalog.contexts.insert(entry.name.clone(), meta).is_some() {
            return Err(bad(sb.catalog.block, format!("context name {:?} listed twice", entry.name)));
        }
    }
    Ok(catalog)
}

/// One catalog entry's context record, read from its chain's `blob` in `blocks`, checked
/// against the entry.
fn record_meta(dev: &dyn BlockDevice, entry: &CatalogEntry, blob: &[u8], blocks: Vec<u64>) -> Result<Arc<ContextMeta>> {
    let record = ContextRecord::decode(blob)
        .map_err(|f| Error::damaged(entry.record.block, "catalog", Owner::context(entry.id).to_string(), f))?;
    if record.id != entry.id || record.name != entry.name {
        return Err(Error::damaged(
            entry.record.block,
            "catalog",
            Owner::context(entry.id).to_string(),
            BlockFault::Malformed(format!(
                "record {} {:?} listed as {} {:?}",
                record.id, record.name, entry.id, entry.name
            )),
        ));
    }
    let meta = Arc::new(ContextMeta::from_record(record, entry.record, blocks));
    meta.check_roots(dev.block_size())?;
    Ok(meta)
}

impl Store {
    /// Opens a store: recovers from the newest valid superblock and reads the catalog and the
    /// allocator. Damaged metadata is an error naming the block. No other process is kept
    /// out: paths are opened with [`Store::open_path`], which locks.
    pub fn open(dev: Arc<dyn BlockDevice>) -> Result<Store> {
        Self::open_with(dev, AllocSource::Persisted, &BTreeSet::new(), Readers::default())
    }

    /// Opens a store file or block device for writing, finding its block size from the
    /// superblocks. Holds the store's writer lock: a second writer, in this process or
    /// another, is refused with [`Error::Locked`] before anything is written. The lock goes
    /// when the store and every snapshot taken from it are dropped: a snapshot's blocks are
    /// guarded by this store's bookkeeping, which a later writer would not see.
    pub fn open_path(path: &Path, choice: DeviceChoice) -> Result<Store> {
        Self::open_path_as(path, choice, Access::Write)
    }

    /// Opens a store for reading beside a writer in another process: it reads the state
    /// committed when it opened, and the writer reuses none of its blocks until it closes.
    /// Transactions on it fail with [`Error::ReadOnly`].
    pub fn open_path_read_only(path: &Path, choice: DeviceChoice) -> Result<Store> {
        Self::open_path_as(path, choice, Access::Read)
    }

    pub fn open_path_as(path: &Path, choice: DeviceChoice, access: Access) -> Result<Store> {
        // The probe names what is wrong with a path that holds no store; nothing is written
        // before the lock is held.
        let block_size = probe_block_size(path)?;
        let lock = StoreLock::acquire(path, access)?;
        Self::open_locked(Arc::from(device::open_path(path, choice, block_size, access)?), lock)
    }

    /// Opens a store on a device under a lock taken on its path (mkfs formats under one).
    pub fn open_locked(dev: Arc<dyn BlockDevice>, lock: StoreLock) -> Result<Store> {
        Self::open_with(dev, AllocSource::Persisted, &BTreeSet::new(), Readers::with_lock(Some(lock)))
    }

    /// `skip` lists ids of contexts left out of the catalog (fsck dropping damaged ones).
    pub(crate) fn open_with(
        dev: Arc<dyn BlockDevice>,
        source: AllocSource,
        skip: &BTreeSet<u32>,
        readers: Readers,
    ) -> Result<Store> {
        let readers = Arc::new(readers);
        let (slots, ticket) = readers.pin_committed(dev.as_ref())?;
        let (sb, fallback) = pick(&slots)?;
        if sb.block_size as usize != dev.block_size() {
            return Err(Error::InvalidArgument(format!(
                "store block size is {} but the device was opened with {}",
                sb.block_size,
                dev.block_size()
            )));
        }
        let catalog = load_catalog(dev.as_ref(), &sb, skip)?;
        let (committed, chunk_refs, alloc_dir_blocks) = match source {
            AllocSource::Persisted => load_bitmap(dev.as_ref(), &sb)?,
            AllocSource::Rebuilt(mut reachable) => {
                let (persisted, chunks, dir) = load_bitmap(dev.as_ref(), &sb)
                    .unwrap_or_else(|_| (Bitmap::new(sb.total_blocks), Vec::new(), Vec::new()));
                for b in persisted.iter_ones() {
                    reachable.set(b, true);
                }
                (reachable, chunks, dir)
            }
        };
        let mut alloc = Allocator::new(committed, bits_per_chunk(dev.block_size()));
        if let Some(older) = fallback {
            // The fallback state stays intact until the next commit overwrites its slot.
            if let Ok((old_bitmap, _, _)) = load_bitmap(dev.as_ref(), &older) {
                alloc.quarantine_from(&old_bitmap, sb.generation);
            }
        }
        readers.hold_older_states(dev.as_ref(), &sb, fallback, &mut alloc);
        let snapshot = Snapshot {
            dev: dev.clone(),
            superblock: sb,
            contexts: catalog.contexts,
            retired: catalog.retired,
            damaged: Arc::new(catalog.damaged),
            catalog_blocks: catalog.blocks,
            _ticket: ticket,
        };
        let writer = WriterState { alloc, chunk_refs, alloc_dir_blocks, poisoned: None };
        Ok(Store::assemble(dev, snapshot, writer, readers, slots))
    }

    /// A store serving `snapshot`, its writer's state beside it; what it publishes besides
    /// (the space counts) is derived from them.
    pub(crate) fn assemble(
        dev: Arc<dyn BlockDevice>,
        snapshot: Snapshot,
        writer: WriterState,
        readers: Arc<Readers>,
        slots: Vec<SlotStatus>,
    ) -> Store {
        Store {
            dev,
            current: RwLock::new(Arc::new(snapshot)),
            space: RwLock::new(Space::of(&writer.alloc)),
            writer: Mutex::new(writer),
            writer_thread: Mutex::new(None),
            readers,
            slots,
        }
    }

    /// The newest committed state. Hold it to read consistently while others commit.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Starts the (single) write transaction; waits while another is open.
    pub fn begin(&self) -> Result<Txn<'_>> {
        Txn::begin(self)
    }

    pub fn device(&self) -> &Arc<dyn BlockDevice> {
        &self.dev
    }

    pub fn device_info(&self) -> DeviceInfo {
        self.dev.info()
    }

    /// What the superblock slots held when the store was opened.
    pub fn slots(&self) -> &[SlotStatus] {
        &self.slots
    }

    /// Where the store's blocks are, as of the last commit (or the start of the transaction
    /// open now): it never waits for an open transaction to end.
    pub fn space(&self) -> Space {
        *self.space.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Commits once, changing nothing, when blocks the last commit freed are held because the
    /// fallback state (the one before the newest) still references them: after it they can
    /// be handed out, unless an open reader of an older state holds them. A write that needs
    /// that space takes it so. Returns the blocks free after.
    pub fn reclaim(&self) -> Result<u64> {
        if self.space().reclaimable > 0 {
            self.begin()?.commit()?;
        }
        Ok(self.space().free)
    }

    pub(crate) fn publish_space(&self, alloc: &Allocator) {
        *self.space.write().unwrap_or_else(|p| p.into_inner()) = Space::of(alloc);
    }

    pub(crate) fn lock_writer(&self) -> MutexGuard<'_, WriterState> {
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn lock_writer_thread(&self) -> MutexGuard<'_, Option<std::thread::ThreadId>> {
        self.writer_thread.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn publish(&self, snapshot: Snapshot) {
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(snapshot);
    }
}

/// Finds a store's block size: slot 0 names it; if slot 0 is damaged, slot 1 is looked for at
/// each possible block size.
pub fn probe_block_size(path: &Path) -> Result<usize> {
    let prefix = device::read_prefix(path, 2 * MAX_BLOCK_SIZE)?;
    let mut errors = Vec::new();
    if let Some(bs) = Superblock::peek_block_size(&prefix).map(|b| b as usize) {
        if device::check_block_size(bs).is_ok() {
            match Superblock::decode(&prefix[..bs], 0) {
                Ok(_) => return Ok(bs),
                Err(e @ Error::UnsupportedVersion { .. }) => return Err(e),
                Err(e) => errors.push(format!("slot 0: {e}")),
            }
        }
    }
    let mut bs = MIN_BLOCK_SIZE;
    while bs <= MAX_BLOCK_SIZE {
        match Superblock::decode(&prefix[bs..2 * bs], 1) {
            Ok(_) => return Ok(bs),
            Err(e @ Error::UnsupportedVersion { .. }) => return Err(e),
            Err(e) if bs == MIN_BLOCK_SIZE => errors.push(format!("slot 1: {e}")),
            Err(_) => {}
        }
        bs *= 2;
    }
    // Without a block magic in either slot the path never held a store: what each slot's
    // decode found wrong would only say that at length.
    if !Superblock::magic_in(&prefix) {
        return Err(Error::NotAStore(format!("{}: no ctxfs superblock magic in either slot", path.display())));
    }
    Err(Error::NotAStore(format!("{}: no valid superblock ({})", path.display(), errors.join("; "))))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader that read the slots, then lost the race to two commits before its pin was
    /// visible, must not keep the generation it read: its blocks may be reused already.
    #[test]
    fn a_pin_that_lost_the_race_to_two_commits_pins_again() {
        let dir = tempfile::tempdir_in(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")).unwrap();
        let path = dir.path().join("s.img");
        std::fs::File::create(&path).unwrap().set_len(1 << 20).unwrap();
        let dev = || -> Arc<dyn BlockDevice> {
            Arc::from(device::open_path(&path, DeviceChoice::Uring, 4096, Access::Write).unwrap())
        };
        drop(crate::format(dev()).unwrap());
        let writer = Store::open_path(&path, DeviceChoice::Uring).unwrap();
        let first = writer.snapshot().generation();
        let readers = Arc::new(Readers::with_lock(Some(StoreLock::acquire(&path, Access::Read).unwrap())));
        let mut raced = 0;
        let (slots, ticket) = readers
            .pin_committed_racing(dev().as_ref(), || {
                if raced == 0 {
                    writer.begin().unwrap().commit().unwrap();
                    writer.begin().unwrap().commit().unwrap();
                }
                raced += 1;
            })
            .unwrap();
        let (pinned, _) = pick(&slots).unwrap();
        assert_eq!(raced, 2, "the first pin was dropped and taken again");
        assert_eq!(pinned.generation, first + 2);
        assert_eq!(ticket.as_ref().map(|t| t.generation), Some(first + 2));
        assert_eq!(readers.lock().keys().copied().collect::<Vec<_>>(), [first + 2], "the stale pin is gone");
    }
}
