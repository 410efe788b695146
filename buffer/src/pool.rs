//! The buffer pool: frames split into an index area and a data area, a lock-free page table,
//! batched loads through a [`BlockSource`].

use crate::arena::FrameArena;
use crate::frame::{Frame, FrameData, FrameState, NO_CONTEXT};
use crate::guard::PageGuard;
use crate::hint::FrameHint;
use crate::policy::{coldest_context, TwoQueue};
use crate::request::{BlockClass, BlockRequest, BufferError};
use crate::resident::{check_class, reserve, ResidentBlocks};
use crate::source::{io_error, BlockSource};
use crate::stats::{ClassStats, PoolStats};
use crate::sync::{lock, yield_now, AtomicU64, Mutex, Ordering, RwLockWriteGuard};
use crate::table::Table;
use ctxfs_vfs::format::{BlockHeader, Expect};
use ctxfs_vfs::{FileStream, Snapshot};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Clone)]
pub struct PoolConfig {
    /// Bytes of frames, index and data areas together.
    pub budget_bytes: u64,
    /// Share of the budget that is the data area; the rest holds index blocks.
    pub data_fraction: f64,
    /// How long a request waits for a frame when every frame it could use is pinned.
    pub wait: Duration,
    /// Shards of the page table's hit counters.
    pub shards: usize,
    /// Map every frame's memory when the pool is made, so that no read pays a page fault
    /// later (a serving pool: it then holds its whole budget from the start). Otherwise a
    /// frame's memory is mapped when the frame is first used.
    pub populate: bool,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            budget_bytes: 256 << 20,
            data_fraction: 0.2,
            wait: Duration::from_secs(5),
            shards: 64,
            populate: false,
        }
    }
}

/// Extra frames freed from the coldest context with each index eviction, so the ranking of
/// the whole area that finds it (a pass over every frame) is paid once per batch rather than
/// once per frame: at least 8, and 1/64 of the area, so a 1 GiB area (262,144 frames) frees
/// 4,096 per ranking instead of 8. Serving compact, every candidate's key block is an index
/// miss: a smaller batch spent a sixth of a decode step ranking (`ctxfs bench decode
/// --resident-budget 0.125`, profiled).
fn index_eviction_batch(frames: usize) -> usize {
    (frames / 64).max(8)
}

struct Area {
    class: BlockClass,
    frames: Range<usize>,
    free: Mutex<Vec<usize>>,
    /// The data area's policy (the index area ranks frames by context recency instead).
    two_queue: Mutex<TwoQueue>,
    misses: AtomicU64,
    /// Of the misses, blocks read for the first time since the pool was made.
    first_reads: AtomicU64,
    bytes_read: AtomicU64,
    evictions: AtomicU64,
    /// Holds of [`ResidentBlocks`] on the area's frames, all together.
    resident_pins: AtomicU64,
}

pub struct BufferPool {
    source: Arc<dyn BlockSource>,
    block_size: usize,
    frames: Box<[Frame]>,
    /// The frames' buffers (after `frames`, which point into it).
    arena: FrameArena,
    areas: [Area; 2],
    table: Table,
    /// Advances on every load; hits record it as their frame's recency.
    clock: AtomicU64,
    /// Frame buffers allocated so far, in bytes (never more than the budget).
    allocated: AtomicU64,
    config: PoolConfig,
    /// Taken by a batch read that found no frame to read into, until it ends: the one batch
    /// that may hold pins while it waits for frames (`load_many`).
    stalled: Mutex<()>,
}

type Claim<'a> = (usize, RwLockWriteGuard<'a, FrameData>);

/// What one `load` did.
struct LoadOutcome {
    /// The blocks whose reads failed.
    failed: Vec<(u64, BufferError)>,
    /// Whether anything was read, or found being read by another caller.
    progressed: bool,
    /// Blocks read and published.
    read: Vec<u64>,
}

impl BufferPool {
    pub fn new(source: Arc<dyn BlockSource>, config: PoolConfig) -> Result<BufferPool, BufferError> {
        let bs = source.block_size() as u64;
        let total = (config.budget_bytes / bs) as usize;
        if !(0.0..1.0).contains(&config.data_fraction) {
            return Err(BufferError::Config(format!("data fraction {} must be in [0, 1)", config.data_fraction)));
        }
        let data = ((total as f64 * config.data_fraction).round() as usize).max(1);
        if total < data + 1 {
            return Err(BufferError::Config(format!(
                "a budget of {} bytes holds {total} frames of {bs} bytes; at least 2 are needed",
                config.budget_bytes
            )));
        }
        let index = total - data;
        let arena = FrameArena::new(total, bs as usize, config.populate).ok_or_else(|| {
            BufferError::Config(format!("the system refused {} bytes for the pool's frames", config.budget_bytes))
        })?;
        if total >= u32::MAX as usize {
            return Err(BufferError::Config(format!(
                "a budget of {} bytes holds {total} frames; the page table numbers at most {} frames",
                config.budget_bytes,
                u32::MAX - 1
            )));
        }
        let area = |class, frames: Range<usize>| Area {
            class,
            free: Mutex::new(frames.clone().rev().collect()),
            two_queue: Mutex::new(TwoQueue::new(frames.len())),
            frames,
            misses: AtomicU64::new(0),
            first_reads: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            resident_pins: AtomicU64::new(0),
        };
        Ok(BufferPool {
            block_size: bs as usize,
            frames: (0..total).map(|_| Frame::new()).collect(),
            arena,
            areas: [area(BlockClass::Index, 0..index), area(BlockClass::Data, index..total)],
            table: Table::new(source.blocks(), config.shards),
            clock: AtomicU64::new(1),
            allocated: AtomicU64::new(0),
            source,
            config,
            stalled: Mutex::new(()),
        })
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn config(&self) -> &PoolConfig {
        &self.config
    }

    /// Frames of an area: how many of its blocks can be pinned at once.
    pub fn frames(&self, class: BlockClass) -> usize {
        self.areas[class as usize].frames.len()
    }

    /// Announces that `block` is about to be pinned. Returns whether it is in a frame, or
    /// being read into one (a request for it then reads nothing); a block in a frame is marked
    /// referenced, so the eviction policy passes it over once before that use.
    pub fn will_use(&self, block: u64) -> bool {
        match self.table.get(block) {
            Some(idx) => {
                // The frame may hold another block by now: that one gets the second chance.
                self.frames[idx].referenced.store(true, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Frames of an area that are not held by [`ResidentBlocks`]: what pinned reads share.
    pub fn pinnable(&self, class: BlockClass) -> usize {
        let area = &self.areas[class as usize];
        area.frames.len().saturating_sub(area.resident_pins.load(Ordering::Relaxed) as usize)
    }

    /// Holds index blocks in their frames until the returned value is dropped, readable
    /// without latches (see [`ResidentBlocks`]); misses are read first, in batches. `None`
    /// when holding them would leave the index area too few frames for pinned reads
    /// (a reserve of its frames is kept for them); the caller then reads them through pins.
    pub fn make_resident(self: &Arc<Self>, reqs: &[BlockRequest]) -> Result<Option<ResidentBlocks>, BufferError> {
        check_class(reqs)?;
        let area = &self.areas[BlockClass::Index as usize];
        let reserve = reserve(area.frames.len());
        let limit = area.frames.len().saturating_sub(reserve) as u64;
        let wanted = reqs.len() as u64;
        // Reserve first, so concurrent requests cannot both pass the check.
        if area.resident_pins.fetch_add(wanted, Ordering::AcqRel) + wanted > limit {
            area.resident_pins.fetch_sub(wanted, Ordering::AcqRel);
            return Ok(None);
        }
        let mut held = ResidentBlocks::new(self.clone());
        // Misses are read in batches the reserve can take.
        let batch = reserve.clamp(1, 256);
        let mut outcome = Ok(());
        for chunk in reqs.chunks(batch) {
            for g in self.get_many(chunk) {
                match g {
                    Ok(g) => {
                        // Raised under the pin's read latch: see resident.rs.
                        self.frames[g.frame()].resident.fetch_add(1, Ordering::AcqRel);
                        held.push(g.frame(), g.payload(), g.read_here());
                    }
                    Err(e) => outcome = outcome.and(Err(e)),
                }
            }
            if outcome.is_err() {
                break;
            }
        }
        // Holds not taken (a failed batch) give their reservation back; the taken ones go
        // back when `held` drops.
        area.resident_pins.fetch_sub(wanted - held.len() as u64, Ordering::AcqRel);
        outcome.map(|()| Some(held))
    }

    /// Ends the holds of a [`ResidentBlocks`] on `frames`.
    pub(crate) fn release_resident(&self, frames: &[usize]) {
        for &f in frames {
            self.frames[f].resident.fetch_sub(1, Ordering::AcqRel);
        }
        self.areas[BlockClass::Index as usize].resident_pins.fetch_sub(frames.len() as u64, Ordering::AcqRel);
    }

    /// One block, pinned until the guard is dropped.
    pub fn get(&self, req: &BlockRequest) -> Result<PageGuard<'_>, BufferError> {
        // A hit needs neither the batch bookkeeping nor an allocation: searches take one per hop.
        if let Some(Ok(g)) = self.lookup(req, false) {
            return Ok(g);
        }
        self.get_many(std::slice::from_ref(req)).pop().expect("one result")
    }

    /// A hit at the frame `hint` remembers, without the page table; `None` when the hint is
    /// empty or stale (then [`get`](Self::get) or [`get_many`](Self::get_many) it, and
    /// [`FrameHint::remember`] where it was found). The frame is re-checked under its latch,
    /// exactly as after a page-table lookup, so a stale hint is only a wasted latch.
    pub fn get_at_hint(&self, req: &BlockRequest, hint: &FrameHint) -> Option<PageGuard<'_>> {
        let idx = hint.frame().filter(|&i| i < self.frames.len())?;
        self.lookup_at(idx, req, false)?.ok()
    }

    /// A set of blocks, pinned until their guards are dropped. Misses are read in one
    /// submission; requests for the same block, here or in other threads, share one read.
    pub fn get_many(&self, reqs: &[BlockRequest]) -> Vec<Result<PageGuard<'_>, BufferError>> {
        // Leading hits (all of them, for resident index blocks) need no batch bookkeeping:
        // searches call this once per hop. The rest goes through the batch path.
        let mut out = Vec::with_capacity(reqs.len());
        for r in reqs {
            match self.lookup(r, false) {
                Some(Ok(g)) => out.push(Some(Ok(g))),
                _ => break,
            }
        }
        if out.len() == reqs.len() {
            return out.into_iter().map(|r| r.expect("every request a hit")).collect();
        }
        out.resize_with(reqs.len(), || None);
        self.load_many(reqs, out)
    }

    /// Answers the requests `out` has not: `out[i]` is `reqs[i]`'s pin once it is taken.
    fn load_many<'p>(
        &'p self,
        reqs: &[BlockRequest],
        mut out: Vec<Option<Result<PageGuard<'p>, BufferError>>>,
    ) -> Vec<Result<PageGuard<'p>, BufferError>> {
        for class in [BlockClass::Index, BlockClass::Data] {
            let mut distinct: Vec<u64> = reqs.iter().filter(|r| r.class() == class).map(|r| r.block).collect();
            distinct.sort_unstable();
            distinct.dedup();
            let frames = self.areas[class as usize].frames.len();
            if distinct.len() > frames {
                let err = BufferError::TooLarge { class, needed: distinct.len(), frames };
                for (i, r) in reqs.iter().enumerate() {
                    if r.class() == class && out[i].is_none() {
                        out[i] = Some(Err(err.clone()));
                    }
                }
            }
        }
        let rounds = self.wait_rounds();
        let mut idle = 0;
        // Held from this call's first round without progress to its end (see `stalled`).
        let mut turn = None;
        // Blocks this call read: pinning them afterwards is neither a hit nor a reference.
        let mut loaded_here: BTreeSet<u64> = BTreeSet::new();
        loop {
            let mut missing: BTreeMap<u64, BlockRequest> = BTreeMap::new();
            for (i, r) in reqs.iter().enumerate() {
                if out[i].is_none() {
                    match self.lookup(r, loaded_here.remove(&r.block)) {
                        Some(res) => out[i] = Some(res),
                        None => {
                            missing.insert(r.block, *r);
                        }
                    }
                }
            }
            if missing.is_empty() {
                break;
            }
            let wanted: Vec<BlockRequest> = missing.into_values().collect();
            let LoadOutcome { failed, progressed, .. } = self.load(&wanted, Some(&mut loaded_here));
            for (block, err) in failed {
                for (i, r) in reqs.iter().enumerate() {
                    if r.block == block && out[i].is_none() {
                        out[i] = Some(Err(err.clone()));
                    }
                }
            }
            if progressed {
                idle = 0;
            } else if turn.is_none() {
                // Frames are short. Two calls that each hold some of their pins while they
                // wait for the rest could wait on each other until both time out, though
                // either alone fits: so a call gives its pins back before it waits, and
                // stalled calls wait one at a time, only the one whose turn it is holding pins.
                for slot in &mut out {
                    if slot.as_ref().is_some_and(|r| r.is_ok()) {
                        *slot = None;
                    }
                }
                turn = Some(lock(&self.stalled));
            } else {
                idle += 1;
                if idle > rounds {
                    for (i, r) in reqs.iter().enumerate() {
                        if out[i].is_none() {
                            let class = r.class();
                            let frames = self.areas[class as usize].frames.len();
                            out[i] = Some(Err(BufferError::Exhausted {
                                class,
                                frames,
                                waited_ms: self.config.wait.as_millis() as u64,
                            }));
                        }
                    }
                    break;
                }
                self.pause();
            }
        }
        debug_assert!(loaded_here.is_empty(), "every block this call read was pinned");
        out.into_iter().map(|r| r.expect("every request answered")).collect()
    }

    /// Opens a context for serving: reads every index block of every vector file into the
    /// index area (in batches, unpinned). Returns how many index blocks the context has.
    pub fn open_context(&self, snap: &Snapshot, name: &str) -> Result<usize, BufferError> {
        let wrap = |e: ctxfs_vfs::Error| BufferError::Block(Arc::new(e));
        let ctx = snap.context(name).map_err(wrap)?;
        let shape = ctx.record().shape;
        let mut reqs = Vec::new();
        for layer in 0..shape.layers {
            for head in 0..shape.kv_heads {
                let s = ctx.stream(layer, head, FileStream::Index).map_err(wrap)?;
                reqs.extend((0..s.blocks()).map(|l| BlockRequest::new(s.locate(l).expect("within the stream"))));
            }
        }
        let batch = self.areas[BlockClass::Index as usize].frames.len().clamp(1, 256);
        for chunk in reqs.chunks(batch) {
            for g in self.get_many(chunk) {
                g?;
            }
        }
        Ok(reqs.len())
    }

    /// Reads blocks into the pool without pinning them, in one submission (a prefetch: see
    /// [`Prefetcher`](crate::Prefetcher)). Blocks already here or being read are skipped, and
    /// so are those no frame is free for. Errors are dropped: a later `get` reads again and
    /// reports them. Returns the blocks read.
    pub fn prefetch(&self, reqs: &[BlockRequest]) -> Vec<u64> {
        let mut wanted = reqs.to_vec();
        wanted.sort_by_key(|r| r.block);
        wanted.dedup_by_key(|r| r.block);
        self.load(&wanted, None).read
    }

    fn wait_rounds(&self) -> u32 {
        if cfg!(loom) {
            2
        } else {
            (self.config.wait.as_micros() / 200).max(1) as u32
        }
    }

    fn pause(&self) {
        if cfg!(loom) {
            yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// A hit, a shared load's result, or `None` when the block is not (or no longer) here.
    /// `own_load`: this call read the block itself, so pinning it is not a hit, and the pin
    /// replaces the one the load reserved.
    fn lookup(&self, req: &BlockRequest, own_load: bool) -> Option<Result<PageGuard<'_>, BufferError>> {
        self.lookup_at(self.table.get(req.block)?, req, own_load)
    }

    /// [`lookup`](Self::lookup) at frame `idx`, which may hold another block by now.
    fn lookup_at(&self, idx: usize, req: &BlockRequest, own_load: bool) -> Option<Result<PageGuard<'_>, BufferError>> {
        let frame = &self.frames[idx];
        let data = frame.data.read().unwrap_or_else(|p| p.into_inner());
        if data.block != req.block {
            return None; // evicted and reused between the lookup and the lock
        }
        match &data.state {
            FrameState::Ready(header, crc) if !holds(header, *crc, &req.expect) => {
                drop(data);
                self.drop_stale(idx, req)
            }
            FrameState::Ready(header, _) => {
                let header = *header;
                if own_load {
                    frame.reserved.fetch_sub(1, Ordering::Release);
                } else if frame.prefetched.load(Ordering::Relaxed) && frame.prefetched.swap(false, Ordering::Relaxed) {
                    // The use a prefetch read the block for (see Frame::prefetched).
                } else {
                    frame.touch(self.clock.load(Ordering::Relaxed));
                    self.table.hit(req.block, req.class() as usize);
                }
                Some(Ok(PageGuard::new(data, header, own_load, idx)))
            }
            FrameState::Failed(e) => Some(Err(e.clone())),
            FrameState::Empty | FrameState::Loading => None,
        }
    }

    /// Unmaps frame `idx`, which holds `req`'s block as it was before the block was freed and
    /// written again, so that the block is read anew. `None`: the caller loads it (or finds
    /// it loaded) on its next round; a stale frame pinned by someone else is left for the
    /// pin to go. A stale frame held resident cannot go: an error naming the block.
    fn drop_stale(&self, idx: usize, req: &BlockRequest) -> Option<Result<PageGuard<'_>, BufferError>> {
        let frame = &self.frames[idx];
        let mut data = frame.data.try_write().ok()?;
        let stale = matches!(&data.state, FrameState::Ready(h, crc) if !holds(h, *crc, &req.expect));
        if data.block != req.block || !stale || frame.reserved.load(Ordering::Acquire) > 0 {
            return None;
        }
        if frame.resident.load(Ordering::Acquire) > 0 {
            let e = std::io::Error::other("the pool holds an older version of it resident");
            return Some(Err(io_error(req.block, &e)));
        }
        self.table.remove(data.block, idx);
        frame.context.store(NO_CONTEXT, Ordering::Relaxed);
        data.state = FrameState::Empty;
        drop(data);
        lock(&self.areas[req.class() as usize].free).push(idx);
        None
    }

    /// Claims frames for blocks nobody holds, reads them in one batch, and publishes them.
    /// Blocks read for a caller (`loaded` is given) keep a reserved pin for it and are
    /// recorded there.
    fn load(&self, wanted: &[BlockRequest], mut loaded: Option<&mut BTreeSet<u64>>) -> LoadOutcome {
        let wanted_blocks: BTreeSet<u64> = wanted.iter().map(|r| r.block).collect();
        let mut claimed: Vec<(BlockRequest, Claim<'_>)> = Vec::new();
        let mut progressed = false;
        let mut failed = Vec::new();
        for req in wanted {
            if !self.table.holds(req.block) {
                // The device would refuse the read; the table has no slot for it either.
                let e = std::io::Error::new(std::io::ErrorKind::InvalidInput, "beyond the end of the device");
                failed.push((req.block, io_error(req.block, &e)));
                progressed = true;
                continue;
            }
            if self.table.get(req.block).is_some() {
                progressed = true; // someone else has it, or is loading it
                continue;
            }
            let area = &self.areas[req.class() as usize];
            let Some((idx, mut data)) = self.claim(area, &wanted_blocks) else {
                // No frame now. Frames this call holds are loaded first, then released,
                // before anybody waits: never wait while holding a load.
                break;
            };
            if !self.table.insert_if_absent(req.block, idx) {
                data.state = FrameState::Empty;
                drop(data);
                lock(&area.free).push(idx);
                progressed = true;
                continue;
            }
            if data.buf.is_empty() {
                // SAFETY: frame `idx` takes its slot once: here, under its write latch, while
                // its buffer is still empty, and a buffer is never emptied again. Frames drop
                // before the arena (field order), and guards borrow the pool.
                data.buf = unsafe { self.arena.slot(idx) };
                self.allocated.fetch_add(self.block_size as u64, Ordering::Relaxed);
            }
            data.block = req.block;
            data.state = FrameState::Loading;
            claimed.push((*req, (idx, data)));
        }
        if claimed.is_empty() {
            return LoadOutcome { failed, progressed, read: Vec::new() };
        }
        let mut read = Vec::with_capacity(claimed.len());
        let reqs: Vec<BlockRequest> = claimed.iter().map(|(r, _)| *r).collect();
        let results = {
            let mut bufs: Vec<&mut [u8]> = claimed.iter_mut().map(|(_, (_, d))| &mut d.buf[..]).collect();
            self.source.load(&reqs, &mut bufs)
        };
        let now = self.clock.fetch_add(1, Ordering::Relaxed) + 1;
        for ((req, (idx, mut data)), res) in claimed.into_iter().zip(results) {
            let area = &self.areas[req.class() as usize];
            let frame = &self.frames[idx];
            match res {
                Ok(header) => {
                    read.push(req.block);
                    data.state = FrameState::Ready(header, req.expect.crc);
                    frame.referenced.store(false, Ordering::Relaxed);
                    frame.prefetched.store(loaded.is_none(), Ordering::Relaxed);
                    frame.last_use.store(now, Ordering::Relaxed);
                    frame.context.store(req.context() as u64, Ordering::Relaxed);
                    area.misses.fetch_add(1, Ordering::Relaxed);
                    if self.table.first_read(req.block) {
                        area.first_reads.fetch_add(1, Ordering::Relaxed);
                    }
                    area.bytes_read.fetch_add(self.block_size as u64, Ordering::Relaxed);
                    if area.class == BlockClass::Data {
                        lock(&area.two_queue).loaded(idx);
                    }
                    if let Some(loaded) = loaded.as_deref_mut() {
                        frame.reserved.fetch_add(1, Ordering::Relaxed);
                        loaded.insert(req.block);
                    }
                }
                Err(e) => {
                    // Waiters already blocked on this frame see the error; the table forgets
                    // the block, so the next request reads it again.
                    data.state = FrameState::Failed(e.clone());
                    self.table.remove(req.block, idx);
                    drop(data);
                    lock(&area.free).push(idx);
                    failed.push((req.block, e));
                }
            }
        }
        LoadOutcome { read, failed, progressed: true }
    }

    /// A frame of `area` write-locked for a new block: a free one, or an evicted one.
    /// `keep`: blocks being loaded by this call; evicting one of them would only read it again.
    fn claim(&self, area: &Area, keep: &BTreeSet<u64>) -> Option<Claim<'_>> {
        if let Some(idx) = lock(&area.free).pop() {
            // A free frame may still be read briefly by a waiter learning of a failed load.
            let data = self.frames[idx].data.write().unwrap_or_else(|p| p.into_inner());
            return Some((idx, data));
        }
        match area.class {
            BlockClass::Data => {
                let mut queue = lock(&area.two_queue);
                let mut passed = Vec::new();
                let mut found = None;
                while let Some(f) = queue.candidate(&self.frames) {
                    match self.evict(area, f, keep) {
                        Some(data) => {
                            found = Some((f, data));
                            break;
                        }
                        None => passed.push(f),
                    }
                }
                for f in passed {
                    queue.keep(f);
                }
                found
            }
            BlockClass::Index => {
                // The coldest context's least recently used frames; a few more of the same
                // context are freed along with the victim, never frames of another context.
                let mut victim: Option<(usize, u64, RwLockWriteGuard<'_, FrameData>)> = None;
                let mut spare = 0;
                let batch = index_eviction_batch(area.frames.len());
                // The coldest few batches' worth first; the whole area only when every one of
                // them is pinned.
                for first in [4 * (batch + 1), usize::MAX] {
                    for f in coldest_context(&self.frames, area.frames.clone(), first) {
                        let ctx = self.frames[f].context.load(Ordering::Relaxed);
                        if victim.as_ref().is_some_and(|(_, c, _)| *c != ctx) {
                            break;
                        }
                        if let Some(data) = self.evict(area, f, keep) {
                            if victim.is_none() {
                                victim = Some((f, ctx, data));
                            } else {
                                drop(data);
                                lock(&area.free).push(f);
                                spare += 1;
                                if spare == batch {
                                    break;
                                }
                            }
                        }
                    }
                    if victim.is_some() {
                        break;
                    }
                }
                victim.map(|(f, _, data)| (f, data))
            }
        }
    }

    /// Takes a frame that nobody pins or loads, unmapping its block.
    fn evict(&self, area: &Area, f: usize, keep: &BTreeSet<u64>) -> Option<RwLockWriteGuard<'_, FrameData>> {
        let frame = &self.frames[f];
        let mut data = frame.data.try_write().ok()?;
        // A reservation is made under this lock, so holding it we see every one.
        if !matches!(data.state, FrameState::Ready(..))
            || frame.reserved.load(Ordering::Acquire) > 0
            || frame.resident.load(Ordering::Acquire) > 0
            || keep.contains(&data.block)
        {
            return None;
        }
        self.table.remove(data.block, f);
        frame.context.store(NO_CONTEXT, Ordering::Relaxed);
        data.state = FrameState::Empty;
        area.evictions.fetch_add(1, Ordering::Relaxed);
        Some(data)
    }

    pub fn stats(&self) -> PoolStats {
        let class = |a: &Area| ClassStats {
            hits: self.table.hits(a.class as usize),
            misses: a.misses.load(Ordering::Relaxed),
            first_reads: a.first_reads.load(Ordering::Relaxed),
            bytes_read: a.bytes_read.load(Ordering::Relaxed),
            evictions: a.evictions.load(Ordering::Relaxed),
            resident_pins: a.resident_pins.load(Ordering::Relaxed),
            resident_frames: a
                .frames
                .clone()
                .filter(|&f| self.frames[f].context.load(Ordering::Relaxed) != NO_CONTEXT)
                .count() as u64,
            capacity_frames: a.frames.len() as u64,
        };
        PoolStats {
            block_size: self.block_size,
            budget_bytes: self.config.budget_bytes,
            data_fraction: self.config.data_fraction,
            allocated_bytes: self.allocated.load(Ordering::Relaxed),
            overhead_bytes: PoolStats::overhead(self.frames.len()),
            index: class(&self.areas[0]),
            data: class(&self.areas[1]),
        }
    }
}

/// Whether a frame loaded with `header` for a request expecting checksum `crc` holds what
/// `expect` asks for: the same block contents, whatever snapshot the request comes from.
fn holds(header: &BlockHeader, crc: u32, expect: &Expect) -> bool {
    crc == expect.crc
        && header.owner == expect.owner
        && header.logical == expect.logical
        && header.kind == expect.kind
        && header.stream == expect.stream
}
