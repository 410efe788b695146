//! PQ codes held in GPU memory, so that a GQA group's scan of a context's codes runs on the
//! device instead of a core ([`ctxfs_kernels::gpu::PqScanner`]: the same scores as the
//! CPU's, bit for bit, so every plan answers the same either way).
//!
//! A compact context's step scans every token's codes for each GQA group: at 1M tokens that
//! scan bounds the step on 2 cores (docs/benchmarks.md). A run's codes are copied up the first
//! time a session scans them and stay until evicted, least recently used first, to keep the
//! codes held within [`DeviceCodes::budget`]. Runs are named by their vector file and the
//! block of their meta block: stored contexts never change and context ids are never reused,
//! so a held copy never goes stale.

use crate::poison::lock;
use ctxfs_buffer::{Blocks, BufferError};
use ctxfs_index::coarse::pq::{KeepCodes, KeptGroup, PagedPq};
use ctxfs_index::flat::GroupScan;
use ctxfs_kernels::gpu::{Gpu, GpuCodes, GpuError, PqScanner, MAX_GPU_SUBSPACES};
use ctxfs_kernels::{PqLut, Reached};
use ctxfs_vfs::format::Owner;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Share of the device memory free when the DB opens that held codes may take.
const BUDGET_SHARE: f64 = 0.5;

/// Scanners at most: one per session worker up to this many scan at once, the others wait.
const SCANNERS: usize = 8;

/// Codes of PQ runs in device memory, and scanners on streams of their own.
pub(crate) struct DeviceCodes {
    /// Uploads the codes.
    gpu: Gpu,
    budget: usize,
    held: Mutex<Held>,
    scanners: Vec<Mutex<PqScanner>>,
    /// A copy failed (the device's memory taken by others, say): runs not yet held stay on
    /// the CPU's scan from then on, rather than each scan trying again.
    copy_failed: AtomicBool,
}

/// A PQ run: its vector file and the block of its meta block.
type RunKey = (Owner, u64);

#[derive(Default)]
struct Held {
    runs: HashMap<RunKey, (Arc<GpuCodes>, u64)>,
    bytes: usize,
    /// Uses so far: a run's stamp is the count at its last use.
    uses: u64,
}

/// What a device scan came to.
pub(crate) enum DeviceScan<T> {
    Done(T),
    /// These codes cannot be held on the device (token-major, too many subspaces, larger than
    /// the budget, or the device's memory is taken): the CPU scans them.
    NotHeld,
    Failed(GpuError),
}

/// A scanner reading back only each query's best of the codes it scans
/// ([`PagedPq::token_best_many_by`]).
pub struct KeptOnDevice<'a> {
    pub scanner: &'a mut PqScanner,
    pub codes: &'a GpuCodes,
}

impl KeepCodes<GpuError> for KeptOnDevice<'_> {
    fn scan_sampled(&mut self, luts: &[PqLut], lim: usize, stride: usize) -> Result<Vec<f32>, GpuError> {
        self.scanner.scan_sampled(self.codes, luts, lim, stride)
    }

    fn reaching(&mut self, _: &[PqLut], _: usize, cuts: &[f32], cap: usize) -> Result<Vec<Reached>, GpuError> {
        // The scan left the scores on the device, by the same tables and tokens.
        self.scanner.reaching(cuts, cap)
    }
}

impl DeviceCodes {
    /// Codes on `gpu`'s device, on streams of their own (the scans never wait behind a
    /// session's window, nor behind each other); `None` when the streams do not open.
    pub fn open(gpu: &Gpu) -> Option<DeviceCodes> {
        let gpu = gpu.with_own_stream().ok()?;
        let budget = (gpu.memory_free().ok()? as f64 * BUDGET_SHARE) as usize;
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get()) * crate::session::WORKERS_PER_CORE;
        let scanners = (0..workers.clamp(1, SCANNERS))
            .map(|_| PqScanner::new(&gpu).map(Mutex::new))
            .collect::<Result<_, _>>()
            .ok()?;
        Some(DeviceCodes { gpu, budget, held: Mutex::default(), scanners, copy_failed: AtomicBool::new(false) })
    }

    /// Bytes of codes the device holds at most.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Bytes of codes the device holds now.
    pub fn held_bytes(&self) -> usize {
        lock(&self.held).bytes
    }

    /// Every token's approximate score below `prefix` for each query of `queries`, as
    /// [`PagedPq::token_scores_many`] gives them, from the device's copy of the codes of the
    /// run `run` (`pq` opened on it); the copy is made on first use.
    pub fn scan(
        &self,
        pq: &PagedPq<'_>,
        run: Blocks<'_>,
        queries: &[f32],
        prefix: Option<u32>,
    ) -> Result<DeviceScan<GroupScan>, BufferError> {
        let Some(codes) = self.codes_of(pq, run)? else { return Ok(DeviceScan::NotHeld) };
        let mut scanner = self.scanner();
        let scanned =
            pq.token_scores_many_by(queries, prefix, |luts, lim, out| scanner.scan(&codes, luts, lim, out))?;
        Ok(match scanned {
            Ok(scan) => DeviceScan::Done(scan),
            Err(e) => DeviceScan::Failed(e),
        })
    }

    /// As [`DeviceCodes::scan`], but only each query's `k` best and every `stride`-th score come
    /// back ([`PagedPq::token_best_many_by`]); `Done(None)` where a sample cannot bound them.
    pub fn scan_kept(
        &self,
        pq: &PagedPq<'_>,
        run: Blocks<'_>,
        queries: &[f32],
        prefix: Option<u32>,
        (k, stride): (usize, u32),
    ) -> Result<DeviceScan<Option<KeptGroup>>, BufferError> {
        let Some(codes) = self.codes_of(pq, run)? else { return Ok(DeviceScan::NotHeld) };
        let mut scanner = self.scanner();
        let mut keep = KeptOnDevice { scanner: &mut scanner, codes: &codes };
        Ok(match pq.token_best_many_by(queries, prefix, k, stride, &mut keep)? {
            Ok(kept) => DeviceScan::Done(kept),
            Err(e) => DeviceScan::Failed(e),
        })
    }

    /// The device's copy of the codes of `run` (`pq` opened on it), made on first use; `None`
    /// where they cannot be held.
    fn codes_of(&self, pq: &PagedPq<'_>, run: Blocks<'_>) -> Result<Option<Arc<GpuCodes>>, BufferError> {
        let Some(meta_block) = run.first() else { return Ok(None) };
        let key = (meta_block.expect.owner, meta_block.block);
        if let Some(codes) = self.held(key) {
            return Ok(Some(codes));
        }
        if self.copy_failed.load(Ordering::Relaxed) {
            return Ok(None);
        }
        Ok(match self.upload(pq)? {
            Ok(Some(codes)) => Some(self.hold(key, codes)),
            Ok(None) => None,
            Err(_) => {
                self.copy_failed.store(true, Ordering::Relaxed);
                None
            }
        })
    }

    /// A scanner no other thread is using, else the first one once it is free.
    fn scanner(&self) -> std::sync::MutexGuard<'_, PqScanner> {
        self.scanners.iter().find_map(|s| s.try_lock().ok()).unwrap_or_else(|| lock(&self.scanners[0]))
    }

    fn held(&self, key: RunKey) -> Option<Arc<GpuCodes>> {
        let mut held = lock(&self.held);
        held.uses += 1;
        let now = held.uses;
        held.runs.get_mut(&key).map(|(codes, stamp)| {
            *stamp = now;
            codes.clone()
        })
    }

    /// The run's codes copied to the device; `None` where they cannot be held.
    fn upload(&self, pq: &PagedPq<'_>) -> Result<Result<Option<GpuCodes>, GpuError>, BufferError> {
        let meta = pq.meta();
        let (tokens, m) = (meta.tokens as usize, meta.params.m as usize);
        if m > MAX_GPU_SUBSPACES || tokens * m > self.budget {
            return Ok(Ok(None));
        }
        let Some(bytes) = pq.code_bytes()? else { return Ok(Ok(None)) };
        Ok(self.gpu.codes(&bytes, tokens, meta.codes_per_block as usize, m).map(Some))
    }

    /// Keeps `codes` under `key`, evicting the least recently used runs until they fit; a
    /// run another thread copied up meanwhile is kept instead.
    fn hold(&self, key: RunKey, codes: GpuCodes) -> Arc<GpuCodes> {
        let mut held = lock(&self.held);
        held.uses += 1;
        let now = held.uses;
        if let Some((codes, stamp)) = held.runs.get_mut(&key) {
            *stamp = now;
            return codes.clone();
        }
        while held.bytes + codes.device_bytes() > self.budget {
            let Some(oldest) = held.runs.iter().min_by_key(|(_, (_, stamp))| *stamp).map(|(k, _)| *k) else { break };
            if let Some((evicted, _)) = held.runs.remove(&oldest) {
                held.bytes -= evicted.device_bytes();
            }
        }
        let codes = Arc::new(codes);
        held.bytes += codes.device_bytes();
        held.runs.insert(key, (codes.clone(), now));
        codes
    }
}
