//! The DB: a mounted store, its buffer pool, and the prefix trie sessions reuse stored
//! contexts through (AlayaDB Table 2: `DB.open`, `DB.import`, `DB.create_session`,
//! `DB.store`).

use crate::device_codes::DeviceCodes;
use crate::error::{Error, Result};
use crate::footprint::{self, Footprint, IndexParts, Planned};
use crate::layout::{files_of, segments, FileBlocks};
use crate::plan::Rules;
use crate::poison::{lock, read, write};
use crate::session::{Reuse, Session};
use crate::trie::PrefixTrie;
use ctxfs_buffer::{
    BlockClass, BlockRequest, BufferPool, DeviceSource, PoolConfig, PoolStats, Prefetcher, ResidentBlocks,
};
use ctxfs_index::coarse::pq::PqParams;
use ctxfs_index::BuildParams;
use ctxfs_kernels::gpu::Gpu;
use ctxfs_vfs::{DeviceChoice, ModelShape, Snapshot, Store};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

/// The tokens every plan attends exactly: the first `init` and the last `recent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub init: u32,
    pub recent: u32,
}

impl Default for Window {
    fn default() -> Self {
        Window { init: 128, recent: 512 }
    }
}

impl Window {
    /// The window over a prefix of `p` tokens: the first `init`, and the last `recent` that
    /// are not among them, in order.
    pub fn tokens(&self, p: u32) -> Vec<u32> {
        let head = self.init.min(p);
        (0..head).chain(p.saturating_sub(self.recent).max(head)..p).collect()
    }

    /// How many tokens the window over a prefix of `p` tokens holds: [`Window::tokens`]'
    /// length.
    pub fn len(&self, p: u32) -> u32 {
        let head = self.init.min(p);
        head + (p - p.saturating_sub(self.recent).max(head))
    }

    /// Whether token `t` of a prefix of `p` tokens is in the window.
    pub fn contains(&self, p: u32, t: u32) -> bool {
        t < self.init.min(p) || t >= p.saturating_sub(self.recent)
    }
}

#[derive(Debug, Clone)]
pub struct DbConfig {
    /// The buffer pool's byte budget.
    pub pool_bytes: u64,
    /// Share of the pool for data blocks; the rest keeps index blocks resident.
    pub data_fraction: f64,
    /// Map the whole pool's memory when the DB opens (`PoolConfig::populate`): what a
    /// server does, so that first reads pay no page faults.
    pub populate_pool: bool,
    pub window: Window,
    pub rules: Rules,
    pub build: BuildParams,
    /// The model of sessions that reuse nothing (a reused context brings its own shape).
    pub model: Option<ModelShape>,
    /// Attend session windows on the GPU when one is present (`CTXFS_GPU=off` also disables
    /// it).
    pub gpu: bool,
    /// The product quantisation imports store beside Quest's and InfLLM's metadata: the
    /// codes the `pq` plan ranks and compact serving scans ([`PqCodes::Scan`] by default).
    pub pq: PqCodes,
    /// The most a served context may hold resident, per byte of its KV cache (keys and
    /// values of every token, layer and kv head): [`Db::warm`] refuses a context over it with
    /// `Error::OverBudget`, before holding anything. None: no limit.
    pub resident_budget: Option<f64>,
}

/// Which product quantisation an import stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PqCodes {
    /// None: the `pq` plan is refused on the contexts imported, and they cannot be served
    /// compact (`DbConfig::resident_budget`).
    Off,
    /// A subspace of 4 dimensions per byte ([`PqParams::scan_codes`]): `d / 4` bytes per
    /// token, a sixteenth of its keys and values in f16, close enough to the keys for an
    /// error target's candidates (`ctxfs_index::approx`).
    Scan,
    /// These parameters (PQCache's: [`PqParams::M2B6`], [`PqParams::M4B8`]).
    Params(PqParams),
}

impl PqCodes {
    /// The parameters for keys of `dim` elements.
    pub fn params(self, dim: usize) -> Option<PqParams> {
        match self {
            PqCodes::Off => None,
            PqCodes::Scan => Some(PqParams::scan_codes(dim)),
            PqCodes::Params(p) => Some(p),
        }
    }
}

/// Frames each area of the pool holds at the least: a session pins up to 256 value blocks
/// at a time (`session::PIN_BATCH`), a search a hop's and a scan's index blocks.
pub const MIN_AREA_FRAMES: u64 = 256;

impl DbConfig {
    /// Refuses settings no DB can run with on a store of `block_size` bytes a block (before
    /// a caller formats a store for it).
    pub fn check(&self, block_size: usize) -> Result<()> {
        if let Some(b) = self.resident_budget.filter(|b| !(b.is_finite() && *b > 0.0)) {
            return crate::error::input(format!("the resident budget must be a positive number, got {b}"));
        }
        if !(self.data_fraction > 0.0 && self.data_fraction < 1.0) {
            return crate::error::input(format!(
                "the pool's data fraction must be in (0, 1), got {}",
                self.data_fraction
            ));
        }
        // The least of the two areas, as the pool splits its frames.
        let frames = self.pool_bytes / block_size.max(1) as u64;
        let data = (frames as f64 * self.data_fraction).round() as u64;
        let least = data.min(frames.saturating_sub(data));
        if least < MIN_AREA_FRAMES {
            let needed = self.least_pool_bytes(block_size);
            return crate::error::input(format!(
                "a pool of {} bytes is too small: each of its areas needs {MIN_AREA_FRAMES} blocks of {block_size} \
                 bytes; give at least {needed} bytes ({} MiB)",
                self.pool_bytes,
                needed.div_ceil(1 << 20)
            ));
        }
        Ok(())
    }
}

impl DbConfig {
    /// The smallest pool [`DbConfig::check`] passes on a store of `block_size` bytes a block.
    pub fn least_pool_bytes(&self, block_size: usize) -> u64 {
        let fraction = self.data_fraction.min(1.0 - self.data_fraction);
        (MIN_AREA_FRAMES as f64 / fraction).ceil() as u64 * block_size as u64
    }

    /// A DB that imports into or checks a store of `block_size` bytes a block rather than
    /// serving it: a pool of 16 MiB, or the least that block size takes.
    pub fn streaming(block_size: usize) -> DbConfig {
        let config = DbConfig::default();
        DbConfig { pool_bytes: (16 << 20).max(config.least_pool_bytes(block_size)), ..config }
    }
}

impl Default for DbConfig {
    fn default() -> Self {
        DbConfig {
            pool_bytes: 256 << 20,
            data_fraction: PoolConfig::default().data_fraction,
            populate_pool: false,
            window: Window::default(),
            rules: Rules::default(),
            build: BuildParams::default(),
            model: None,
            pq: PqCodes::Scan,
            gpu: true,
            resident_budget: None,
        }
    }
}

pub(crate) struct Inner {
    pub store: Store,
    pub pool: Arc<BufferPool>,
    /// Reads searches' value blocks while the next searches run.
    pub prefetcher: Prefetcher,
    pub config: DbConfig,
    /// Derived from the committed contexts' token ids; see [`crate::trie`].
    pub trie: RwLock<PrefixTrie>,
    /// Block locations of vector files, by (context id, layer, kv head). Context ids are
    /// never reused and stored contexts never change, so entries stay valid until deleted.
    files: Mutex<HashMap<(u32, u16, u16), Arc<FileBlocks>>>,
    pub gpu: Option<Gpu>,
    /// Compact contexts' PQ codes held on the GPU, scanned there.
    pub device_codes: Option<DeviceCodes>,
    /// Which GPU, or why none is used.
    gpu_status: String,
}

impl Inner {
    pub fn file(&self, snap: &Snapshot, context: u32, layer: u16, head: u16) -> Result<Arc<FileBlocks>> {
        let key = (context, layer, head);
        if let Some(f) = lock(&self.files).get(&key) {
            return Ok(f.clone());
        }
        let f = Arc::new(FileBlocks::locate(snap, context, layer, head)?);
        lock(&self.files).insert(key, f.clone());
        Ok(f)
    }

    /// Rebuilds the prefix trie from the committed contexts. A context whose token ids
    /// cannot be read (a damaged block) is left out: no session reuses it as a prefix, and
    /// opening it by name reports the damage; the others are served.
    pub fn refresh_trie(&self) {
        let snap = self.store.snapshot();
        let mut trie = PrefixTrie::default();
        for rec in snap.contexts() {
            if let Ok(tokens) = snap.context_by_id(rec.id).and_then(|c| c.tokens()) {
                trie.insert(rec.id, &tokens);
            }
        }
        *write(&self.trie) = trie;
    }

    /// Adds a newly committed context to the prefix trie.
    pub fn remember(&self, name: &str) -> Result<()> {
        let snap = self.store.snapshot();
        let ctx = snap.context(name)?;
        let tokens = ctx.tokens()?;
        write(&self.trie).insert(ctx.record().id, &tokens);
        Ok(())
    }

    /// Every vector file of `name` and of the prefix it stands on, each with its name for
    /// errors.
    pub fn files_of(&self, snap: &Snapshot, name: &str) -> Result<Vec<(Arc<FileBlocks>, String)>> {
        files_of(snap, name)?
            .into_iter()
            .map(|f| Ok((self.file(snap, f.context, f.layer, f.head)?, f.name())))
            .collect()
    }

    pub fn forget_files(&self, context: u32) {
        lock(&self.files).retain(|k, _| k.0 != context);
    }
}

/// What a compact context holds ([`Db::warm`]): each vector file's blocks, and its parts.
struct CompactPlan {
    holds: Vec<Vec<BlockRequest>>,
    parts: Vec<IndexParts>,
    residual_streamed: bool,
}

/// What [`Db::warm`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmReport {
    /// Index blocks of the context and of the prefix it stands on.
    pub blocks: u64,
    /// Of those, the blocks read from the device (the others were in the pool).
    pub read: u64,
    /// Of those, the blocks held resident: all of them unless the index area ran out of
    /// room, in which case the rest are searched through pins.
    pub held: u64,
    /// The bytes of pool frames the held blocks take, and of the vector files' block maps
    /// and frame hints beside them (`Footprint::maps`).
    pub resident_bytes: u64,
    /// The context's KV cache: keys and values of every token, layer and kv head.
    pub kv_bytes: u64,
    /// Served compact: its whole index exceeds `DbConfig::resident_budget`, so only the meta
    /// blocks, seed tables and PQ codes were held.
    pub compact: bool,
    /// Served compact without holding the PQ codes' residual codes, which did not fit the
    /// budget beside them: sessions read them through the pool as they refine candidates.
    pub residual_streamed: bool,
}

impl WarmReport {
    /// Resident bytes per KV byte.
    pub fn resident_over_kv(&self) -> f64 {
        crate::footprint::ratio(self.resident_bytes, self.kv_bytes)
    }
}

/// A mounted context store. Cloning shares it; sessions keep it alive.
#[derive(Clone)]
pub struct Db {
    pub(crate) inner: Arc<Inner>,
}

impl Db {
    /// Opens a store as its one writer: imports, deletes and stored sessions commit. A second
    /// writer, in this process or another, is refused (`Error::Locked` in the vfs error).
    pub fn open(path: &Path, choice: DeviceChoice, config: DbConfig) -> Result<Db> {
        Db::with_store(Store::open_path(path, choice)?, config)
    }

    /// Opens a store to serve sessions beside a writer in another process, on the state
    /// committed at open; storing a session or importing fails with `Error::ReadOnly`.
    pub fn open_read_only(path: &Path, choice: DeviceChoice, config: DbConfig) -> Result<Db> {
        Db::with_store(Store::open_path_read_only(path, choice)?, config)
    }

    pub fn with_store(store: Store, config: DbConfig) -> Result<Db> {
        config.check(store.device().block_size())?;
        let pool = Arc::new(BufferPool::new(
            Arc::new(DeviceSource::new(store.device().clone())),
            PoolConfig {
                budget_bytes: config.pool_bytes,
                data_fraction: config.data_fraction,
                populate: config.populate_pool,
                ..Default::default()
            },
        )?);
        let (gpu, gpu_status) = match config.gpu {
            false => (None, "the GPU is disabled by the DB's configuration".to_string()),
            true => match Gpu::open() {
                Ok(g) => {
                    let name = g.name().to_string();
                    (Some(g), name)
                }
                Err(e) => (None, e.reason().to_string()),
            },
        };
        let device_codes = gpu.as_ref().and_then(DeviceCodes::open);
        let prefetcher = Prefetcher::start(pool.clone());
        let inner = Inner {
            store,
            pool,
            prefetcher,
            config,
            trie: RwLock::default(),
            files: Mutex::default(),
            gpu,
            device_codes,
            gpu_status,
        };
        inner.refresh_trie();
        Ok(Db { inner: Arc::new(inner) })
    }

    pub fn store(&self) -> &Store {
        &self.inner.store
    }

    pub fn config(&self) -> &DbConfig {
        &self.inner.config
    }

    /// The GPU's name when sessions use one, otherwise why they do not.
    pub fn gpu_status(&self) -> &str {
        &self.inner.gpu_status
    }

    /// Bytes of compact contexts' PQ codes the GPU holds now, and the most it may hold (half
    /// its memory free when the DB opened); `None` without a GPU.
    pub fn gpu_codes_bytes(&self) -> Option<(u64, u64)> {
        self.inner.device_codes.as_ref().map(|c| (c.held_bytes() as u64, c.budget() as u64))
    }

    pub fn pool_stats(&self) -> PoolStats {
        self.inner.pool.stats()
    }

    pub fn pool(&self) -> &BufferPool {
        &self.inner.pool
    }

    /// A session on `tokens`, reusing the longest prefix any stored context shares with them
    /// (all of it, or part: then searches filter to the shared prefix). Returns the session
    /// and how many of `tokens` it did not reuse: the caller prefills those and passes their
    /// KV to [`Session::update`].
    pub fn create_session(&self, tokens: &[u32]) -> Result<(Session, usize)> {
        let snap = self.inner.store.snapshot();
        let found = read(&self.inner.trie).longest_prefix(tokens);
        let reuse = match found {
            Some(m) => {
                let ctx = snap.context_by_id(m.context)?;
                let total = ctx.token_count() as u32;
                let prefix = m.tokens as u32;
                Some(Reuse {
                    context: m.context,
                    name: ctx.record().name.clone(),
                    prefix,
                    filtered: prefix < total,
                    segments: segments(&snap, m.context, prefix)?,
                })
            }
            None => None,
        };
        let reused = reuse.as_ref().map_or(0, |r| r.prefix as usize);
        let session = Session::new(self.clone(), snap, reuse, tokens[reused..].to_vec())?;
        Ok((session, tokens.len() - reused))
    }

    /// A session on the first `prefix` tokens (all by default) of a named context.
    pub fn open_session(&self, name: &str, prefix: Option<u32>) -> Result<Session> {
        let snap = self.inner.store.snapshot();
        let ctx = snap.context(name)?;
        let total = ctx.token_count() as u32;
        let prefix = prefix.unwrap_or(total);
        if prefix == 0 || prefix > total {
            return Err(Error::Input(format!("prefix {prefix}: context {name:?} has {total} tokens (1..={total})")));
        }
        let id = ctx.record().id;
        let reuse = Reuse {
            context: id,
            name: name.to_string(),
            prefix,
            filtered: prefix < total,
            segments: segments(&snap, id, prefix)?,
        };
        Session::new(self.clone(), snap, Some(reuse), Vec::new())
    }

    /// Reads every index block (graph and keys) of a context and of the prefix it stands on
    /// into the pool's index area and holds them resident there, while the area has room
    /// (the rest stay in the area while nothing pushes them out): what a server does once
    /// per context, so that sessions search memory without pinning and read only value
    /// blocks.
    ///
    /// Under `DbConfig::resident_budget`, a context whose whole index exceeds the budget is
    /// served compact: only each vector file's meta block, seed table and PQ codes are held
    /// (`WarmReport::compact`), and its sessions scan the codes (`Session::is_compact`). The
    /// codes' residual codes are held where they fit beside them, else read through the pool
    /// (`WarmReport::residual_streamed`). One that does not fit even so, or has no PQ codes,
    /// is refused with `Error::OverBudget` before any block is held, as is every session
    /// over it.
    pub fn warm(&self, name: &str) -> Result<WarmReport> {
        let snap = self.inner.store.snapshot();
        let planned = Planned::of(&snap, name)?;
        let compact = planned.compact(self.inner.config.resident_budget);
        let files = self.inner.files_of(&snap, name)?;
        let pool = &self.inner.pool;
        let mut report = WarmReport { kv_bytes: planned.kv_bytes, compact, ..WarmReport::default() };
        if compact {
            let plan = self.compact_plan(name, &planned, &files)?;
            report.residual_streamed = plan.residual_streamed;
            for (((file, _), blocks), p) in files.iter().zip(&plan.holds).zip(&plan.parts) {
                if let Some((pq, held_at)) = p.compact_pq() {
                    let _ = file.compact_pq.set((pq.start, held_at));
                }
                hold(pool, blocks, &file.compact, &mut report)?;
            }
        } else {
            for (file, _) in &files {
                hold(pool, &file.index().to_vec(), &file.resident, &mut report)?;
            }
        }
        report.resident_bytes = report.held * snap.block_size() as u64 + planned.beside;
        Ok(report)
    }

    /// The blocks a compact context (`planned.compact(budget)`) holds under the budget: with
    /// its residual codes where they fit beside the codes, else without them. One that does
    /// not fit even so, or has no PQ codes, is refused with `Error::OverBudget`. Reads each
    /// vector file's index meta block.
    fn compact_plan(&self, name: &str, planned: &Planned, files: &[(Arc<FileBlocks>, String)]) -> Result<CompactPlan> {
        let budget = self.inner.config.resident_budget.unwrap_or(f64::INFINITY);
        let (kv_bytes, beside) = (planned.kv_bytes, planned.beside);
        let over = |resident_bytes| Error::OverBudget { context: name.to_string(), resident_bytes, kv_bytes, budget };
        let pool = &self.inner.pool;
        let bs = self.inner.store.device().block_size() as u64;
        let parts = files.iter().map(|(file, what)| IndexParts::read(pool, file, what)).collect::<Result<Vec<_>>>()?;
        let holds = |residual: bool| -> Result<Vec<Vec<BlockRequest>>> {
            files
                .iter()
                .zip(&parts)
                .map(|((file, _), p)| p.compact(file, residual).ok_or_else(|| over(planned.whole + beside)))
                .collect()
        };
        // The held frames, and what is held beside them.
        let bytes = |h: &[Vec<BlockRequest>]| h.iter().map(|b| b.len() as u64 * bs).sum::<u64>() + beside;
        let fits = |h: &[Vec<BlockRequest>]| bytes(h) as f64 <= budget * kv_bytes as f64;
        let with_residual = holds(true)?;
        if fits(&with_residual) {
            return Ok(CompactPlan { holds: with_residual, parts, residual_streamed: false });
        }
        let lean = holds(false)?;
        if !fits(&lean) {
            return Err(over(bytes(&lean)));
        }
        let residual_streamed = parts.iter().any(|p| p.residual > 0);
        Ok(CompactPlan { holds: lean, parts, residual_streamed })
    }

    /// Whether a session over `name` is served compact under the budget. One that could not
    /// be held within it is refused, as [`Db::warm`] refuses it, whether or not it is ever
    /// warmed.
    pub(crate) fn serves_compact(&self, snap: &Snapshot, name: &str) -> Result<bool> {
        let planned = Planned::of(snap, name)?;
        let compact = planned.compact(self.inner.config.resident_budget);
        if compact {
            self.compact_plan(name, &planned, &self.inner.files_of(snap, name)?)?;
        }
        Ok(compact)
    }

    /// What serving `name` holds resident, part by part, against its KV bytes (reads each
    /// vector file's index meta block).
    pub fn footprint(&self, name: &str) -> Result<Footprint> {
        footprint::measure(&self.inner.pool, &self.inner.store.snapshot(), name, &self.inner.config.window)
    }

    /// Deletes a context by name. Contexts stored on top of it keep its blocks alive.
    pub fn delete(&self, name: &str) -> Result<()> {
        let id = self.inner.store.snapshot().context(name)?.record().id;
        let mut txn = self.inner.store.begin()?;
        txn.delete_context(name)?;
        txn.commit()?;
        write(&self.inner.trie).remove(id);
        let snap = self.inner.store.snapshot();
        if snap.context_by_id(id).is_err() {
            self.inner.forget_files(id);
        }
        Ok(())
    }
}

/// Holds `blocks` resident in `slot` (once: a concurrent warm may have won, and its holds
/// serve), or, when the index area has no room to hold them, reads them into the frames left
/// in batches small enough to leave room for other readers.
fn hold(
    pool: &Arc<BufferPool>,
    blocks: &[BlockRequest],
    slot: &OnceLock<ResidentBlocks>,
    r: &mut WarmReport,
) -> Result<()> {
    if slot.get().is_none() {
        match pool.make_resident(blocks)? {
            Some(held) => {
                r.read += held.read() as u64;
                let _ = slot.set(held);
            }
            None => {
                let batch = (pool.pinnable(BlockClass::Index) / 4).clamp(1, 256);
                for chunk in blocks.chunks(batch) {
                    for g in pool.get_many(chunk) {
                        r.read += u64::from(g?.read_here());
                    }
                }
            }
        }
    }
    r.blocks += blocks.len() as u64;
    if slot.get().is_some() {
        r.held += blocks.len() as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::Window;

    #[test]
    fn the_window_never_repeats_a_token_or_leaves_the_prefix() {
        let w = Window::default();
        assert_eq!(w.tokens(1000).len(), 640);
        assert_eq!(w.tokens(600), (0..600).collect::<Vec<_>>());
        assert_eq!(w.tokens(100), (0..100).collect::<Vec<_>>());
        assert_eq!(w.tokens(0), Vec::<u32>::new());
        let small = Window { init: 4, recent: 8 };
        assert_eq!(small.tokens(5000), [0, 1, 2, 3, 4992, 4993, 4994, 4995, 4996, 4997, 4998, 4999]);
        for p in [0, 3, 100, 600, 640, 641, 5000] {
            assert_eq!(w.len(p) as usize, w.tokens(p).len(), "p {p}");
            assert_eq!(small.len(p) as usize, small.tokens(p).len(), "p {p}");
        }
        for p in [0, 3, 100, 5000] {
            for t in 0..p {
                assert_eq!(small.contains(p, t), small.tokens(p).contains(&t), "p {p} t {t}");
            }
        }
    }
}
