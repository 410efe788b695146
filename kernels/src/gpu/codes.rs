//! The PQ scan on the GPU: a context's codes copied to device memory once
//! ([`Gpu::codes`]), then each GQA group's scan of them in one launch
//! ([`PqScanner::scan`]), its scores read back through page-locked memory.
//!
//! The scores are those of [`crate::pq_scores`], bit for bit: the tables are the same bytes
//! ([`PqLut`]), their sums exact integers, and each score `bias + step · sum` rounded as the
//! CPU rounds it (`pq_scan` in `kernels.cu`). A caller may switch between the two freely.

use super::{Gpu, GpuError, MAX_GRID_Y};
use crate::{PqLut, Reached, PQ_TABLE};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PinnedHostSlice, PushKernelArg, ValidAsZeroBits};
use std::sync::Arc;

/// Threads per `pq_scan` block (`PQ_THREADS` in `kernels.cu`)...
const THREADS: u32 = 256;
/// ...and the tokens each block scores (`PQ_TOKENS`).
const TOKENS_PER_BLOCK: usize = 1024;
/// Shared memory a block may use without opting in: a query's tables must fit it.
const SHARED_BYTES: usize = 48 << 10;
/// The most subspaces the device scan takes: their tables fill the 48 KiB of shared memory a
/// block has without opting in.
pub const MAX_GPU_SUBSPACES: usize = SHARED_BYTES / PQ_TABLE;

/// One run of tokens' PQ codes in device memory, laid out as stored: blocks of `per_block`
/// tokens (the last may hold fewer), each subspace-major.
pub struct GpuCodes {
    bytes: CudaSlice<u8>,
    tokens: usize,
    per_block: usize,
    m: usize,
    gpu: Gpu,
}

impl GpuCodes {
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Device memory the codes take.
    pub fn device_bytes(&self) -> usize {
        self.tokens * self.m
    }
}

impl Drop for GpuCodes {
    fn drop(&mut self) {
        self.gpu.freed();
    }
}

impl Gpu {
    /// Copies the codes of `tokens` tokens, `m` subspaces, to the device: `bytes` is their
    /// code blocks in order, each of `per_block` tokens (the last `tokens - b·per_block`)
    /// subspace-major, as a stored PQ run holds them.
    pub fn codes(&self, bytes: &[u8], tokens: usize, per_block: usize, m: usize) -> Result<GpuCodes, GpuError> {
        if m == 0 || m > MAX_GPU_SUBSPACES || per_block == 0 || bytes.len() != tokens * m || tokens > i32::MAX as usize
        {
            return Err(GpuError::Invalid(format!(
                "PQ codes: {} bytes for {tokens} tokens of {m} subspaces in blocks of {per_block} \
                 (1..={MAX_GPU_SUBSPACES} subspaces, fewer than 2^31 tokens)",
                bytes.len()
            )));
        }
        let mut dev = self.alloc::<u8>(bytes.len().max(1))?;
        if !bytes.is_empty() {
            self.stream.memcpy_htod(bytes, &mut dev)?;
        }
        // Scanners read the codes from streams of their own: the copy must be complete.
        self.synchronize()?;
        Ok(GpuCodes { bytes: dev, tokens, per_block, m, gpu: self.clone() })
    }

    /// Device memory free now, in bytes.
    pub fn memory_free(&self) -> Result<usize, GpuError> {
        Ok(self.device.ctx.mem_get_info()?.0)
    }
}

/// Scans codes on a stream of its own, with buffers kept from one scan to the next (they
/// grow to the largest scan): the tables, the scores on the device, and page-locked host
/// memory the scores come back through (a copy into pageable memory runs at a fraction of
/// the bus's speed). One scanner per thread that scans at a time.
///
/// A caller that wants only each query's best reads back a sample of the scores
/// ([`PqScanner::scan_sampled`]), and from it a cut, then the tokens reaching the cut
/// ([`PqScanner::reaching`]), instead of every score: at 1M tokens a group's scores are 16 MB.
pub struct PqScanner {
    gpu: Gpu,
    luts: Option<CudaSlice<u32>>,
    bias_step: Option<CudaSlice<f32>>,
    scores: Option<CudaSlice<f32>>,
    host: Option<PinnedHostSlice<f32>>,
    samples: Option<CudaSlice<f32>>,
    cuts: Option<CudaSlice<f32>>,
    reached: Option<CudaSlice<u32>>,
    reached_ids: Option<CudaSlice<u32>>,
    reached_scores: Option<CudaSlice<f32>>,
    /// The queries and tokens of the scores the last scan left on the device.
    last: Option<(usize, usize)>,
}

impl PqScanner {
    /// A scanner on a new stream of `gpu`'s device.
    pub fn new(gpu: &Gpu) -> Result<PqScanner, GpuError> {
        Ok(PqScanner {
            gpu: gpu.with_own_stream()?,
            luts: None,
            bias_step: None,
            scores: None,
            host: None,
            samples: None,
            cuts: None,
            reached: None,
            reached_ids: None,
            reached_scores: None,
            last: None,
        })
    }

    /// Each query's score of tokens `0..lim` of `codes`, by its tables in `luts`: query `i`'s
    /// scores are `out[i·lim .. (i + 1)·lim]`, the same as [`crate::pq_scores`] writes.
    pub fn scan(&mut self, codes: &GpuCodes, luts: &[PqLut], lim: usize, out: &mut [f32]) -> Result<(), GpuError> {
        if out.len() != luts.len() * lim {
            return Err(GpuError::Invalid(format!(
                "PQ scan: {} scores for {} queries of {lim}",
                out.len(),
                luts.len()
            )));
        }
        self.launch_scan(codes, luts, lim)?;
        self.read_scores(out)
    }

    /// Scans as [`PqScanner::scan`] does, leaving the scores on the device, and returns every
    /// `stride`-th score of each query (tokens `0, stride, 2·stride, …` below `lim`: ⌈lim /
    /// stride⌉ per query, query after query). [`PqScanner::reaching`] and
    /// [`PqScanner::read_scores`] then read the scores this scan left.
    pub fn scan_sampled(
        &mut self,
        codes: &GpuCodes,
        luts: &[PqLut],
        lim: usize,
        stride: usize,
    ) -> Result<Vec<f32>, GpuError> {
        if stride == 0 || stride > i32::MAX as usize {
            return Err(GpuError::Invalid(format!("PQ scan: a sample of every {stride}th score")));
        }
        self.launch_scan(codes, luts, lim)?;
        let (queries, count) = (luts.len(), lim.div_ceil(stride));
        if queries * count == 0 {
            return Ok(Vec::new());
        }
        let gpu = &self.gpu;
        let scores = self.scores.as_ref().expect("launch_scan sized it");
        let samples = grown(gpu, &mut self.samples, queries * count)?;
        let (lim_arg, stride_arg, count_arg) = (lim as i32, stride as i32, count as i32);
        let mut launch = gpu.stream.launch_builder(&gpu.device.pq_sample);
        launch.arg(scores).arg(&lim_arg).arg(&stride_arg).arg(&count_arg).arg(&mut *samples);
        let cfg = LaunchConfig {
            grid_dim: (count.div_ceil(THREADS as usize) as u32, queries as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the arguments match `pq_sample(const float* scores, int lim, int stride, int
        // count, float* samples)` in order and type. Block (x, q), q < queries, reads scores q ×
        // lim + j × stride for j < count = ⌈lim / stride⌉, so below (q + 1) × lim ≤ the scores
        // `launch_scan` wrote on this stream, and writes samples q × count + j, below queries ×
        // count ≤ the buffer's length.
        unsafe { launch.launch(cfg) }?;
        let out = gpu.stream.clone_dtoh(&samples.slice(..queries * count))?;
        gpu.synchronize()?;
        Ok(out)
    }

    /// Of the scores the last scan left on the device, each query's tokens whose score
    /// reaches `cuts[q]` (in [`f32::total_cmp`]'s order): how many, and the first `cap` found.
    pub fn reaching(&mut self, cuts: &[f32], cap: usize) -> Result<Vec<Reached>, GpuError> {
        let Some((queries, lim)) = self.last else {
            return Err(GpuError::Invalid("PQ reaching: no scan's scores are on the device".into()));
        };
        if cuts.len() != queries || cap > i32::MAX as usize {
            return Err(GpuError::Invalid(format!(
                "PQ reaching: {} cuts for {queries} queries, room for {cap}",
                cuts.len()
            )));
        }
        if queries == 0 {
            return Ok(Vec::new());
        }
        let gpu = &self.gpu;
        let dev_cuts = grown(gpu, &mut self.cuts, queries)?;
        gpu.stream.memcpy_htod(cuts, dev_cuts)?;
        let reached = grown(gpu, &mut self.reached, queries)?;
        gpu.stream.memset_zeros(reached)?;
        let room = (queries * cap).max(1);
        let ids = grown(gpu, &mut self.reached_ids, room)?;
        let kept = grown(gpu, &mut self.reached_scores, room)?;
        if let Some(scores) = self.scores.as_ref().filter(|_| lim > 0) {
            let (lim_arg, cap_arg) = (lim as i32, cap as i32);
            let mut launch = gpu.stream.launch_builder(&gpu.device.pq_reaching);
            launch
                .arg(scores)
                .arg(&lim_arg)
                .arg(&*dev_cuts)
                .arg(&cap_arg)
                .arg(&mut *reached)
                .arg(&mut *ids)
                .arg(&mut *kept);
            let cfg = LaunchConfig {
                grid_dim: (lim.div_ceil(TOKENS_PER_BLOCK) as u32, queries as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match `pq_reaching(const float* scores, int lim, const
            // float* cuts, int cap, unsigned* reached, unsigned* ids, float* kept)` in order
            // and type. Block (x, q), q < queries, reads scores q × lim + t for its tokens t <
            // lim (written by the last scan on this stream) and cut q (copied above), adds to
            // reached[q] (zeroed above; queries elements), and writes ids and kept at q × cap +
            // a for a < cap only, below queries × cap ≤ both buffers' lengths.
            unsafe { launch.launch(cfg) }?;
        }
        let counts = gpu.stream.clone_dtoh(&reached.slice(..queries))?;
        let ids = gpu.stream.clone_dtoh(&ids.slice(..queries * cap))?;
        let kept = gpu.stream.clone_dtoh(&kept.slice(..queries * cap))?;
        gpu.synchronize()?;
        Ok(counts
            .iter()
            .enumerate()
            .map(|(q, &count)| {
                let found = (count as usize).min(cap);
                let (ids, kept) = (&ids[q * cap..q * cap + found], &kept[q * cap..q * cap + found]);
                Reached { count: count as usize, tokens: ids.iter().copied().zip(kept.iter().copied()).collect() }
            })
            .collect())
    }

    /// Reads every score the last scan left on the device into `out` (query after query).
    pub fn read_scores(&mut self, out: &mut [f32]) -> Result<(), GpuError> {
        let Some((queries, lim)) = self.last else {
            return Err(GpuError::Invalid("PQ scores: no scan's scores are on the device".into()));
        };
        if out.len() != queries * lim {
            return Err(GpuError::Invalid(format!("PQ scores: {} for {queries} queries of {lim}", out.len())));
        }
        if out.is_empty() {
            return Ok(());
        }
        let gpu = &self.gpu;
        let dev_scores = self.scores.as_ref().expect("a scan sized it");
        let host = match &mut self.host {
            Some(h) if h.len() >= out.len() => h,
            slot => {
                *slot = None;
                // Not write-combined (cudarc's default): the host reads it.
                // SAFETY: the memory is unset, and only read below after the copy into it
                // (of `out.len()` elements) has completed.
                let fresh = unsafe { gpu.device.ctx.alloc_pinned_with_flags::<f32>(out.len(), 0) }?;
                slot.insert(fresh)
            }
        };
        gpu.stream.memcpy_dtoh(&dev_scores.slice(..out.len()), host)?;
        gpu.synchronize()?;
        out.copy_from_slice(&host.as_slice()?[..out.len()]);
        Ok(())
    }

    /// Uploads the tables and launches the scan of tokens `0..lim`; the scores stay on the
    /// device, queries × lim of them.
    fn launch_scan(&mut self, codes: &GpuCodes, luts: &[PqLut], lim: usize) -> Result<(), GpuError> {
        self.last = None;
        if !Arc::ptr_eq(&self.gpu.device, &codes.gpu.device) {
            return Err(GpuError::Invalid("the codes are on another device".into()));
        }
        if lim > codes.tokens
            // One query per block along the grid's y dimension.
            || luts.len() > MAX_GRID_Y
            || luts.iter().any(|l| l.subspaces() != codes.m)
        {
            return Err(GpuError::Invalid(format!(
                "PQ scan: {} tables (at most {MAX_GRID_Y}), {lim} of {} tokens of {} subspaces",
                luts.len(),
                codes.tokens,
                codes.m,
            )));
        }
        let len = luts.len() * lim;
        if len == 0 {
            self.last = Some((luts.len(), lim));
            return Ok(());
        }
        let words: Vec<u32> = luts
            .iter()
            .flat_map(|l| l.bytes.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])))
            .collect();
        let bias_step: Vec<f32> = luts.iter().map(|l| l.bias).chain(luts.iter().map(|l| l.step)).collect();
        let gpu = &self.gpu;
        let dev_luts = grown(gpu, &mut self.luts, words.len())?;
        gpu.stream.memcpy_htod(&words, dev_luts)?;
        let dev_bias_step = grown(gpu, &mut self.bias_step, bias_step.len())?;
        gpu.stream.memcpy_htod(&bias_step, dev_bias_step)?;
        let (bias, step) = (dev_bias_step.slice(..luts.len()), dev_bias_step.slice(luts.len()..2 * luts.len()));
        let dev_scores = grown(gpu, &mut self.scores, len)?;

        let (tokens, per_block, m, lim_arg) = (codes.tokens as i32, codes.per_block as i32, codes.m as i32, lim as i32);
        let mut launch = gpu.stream.launch_builder(&gpu.device.pq_scan);
        launch
            .arg(&codes.bytes)
            .arg(&tokens)
            .arg(&per_block)
            .arg(&m)
            .arg(&*dev_luts)
            .arg(&bias)
            .arg(&step)
            .arg(&lim_arg)
            .arg(&mut *dev_scores);
        let cfg = LaunchConfig {
            grid_dim: (lim.div_ceil(TOKENS_PER_BLOCK) as u32, luts.len() as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: (codes.m * PQ_TABLE) as u32,
        };
        // SAFETY: the arguments match `pq_scan(const unsigned char* codes, int tokens, int
        // per_block, int m, const unsigned int* luts, const float* bias, const float* step, int
        // lim, float* scores)` in order and type. `codes.bytes` holds tokens × m bytes in blocks
        // of per_block tokens (checked by `Gpu::codes`, whose copy completed before it
        // returned), and a thread of token t < lim ≤ tokens reads only its block's bytes; block
        // (x, q) reads query q < luts.len()'s m × 256 table bytes (m × 64 words, copied to
        // `dev_luts` above on this stream) into m × 256 ≤ 48 KiB of shared memory, and `bias`
        // and `step` element q, and writes scores q × lim + t for its tokens t < lim
        // (1024x ≤ t < 1024(x + 1)), all below queries × lim ≤ the buffer's length.
        unsafe { launch.launch(cfg) }?;
        self.last = Some((luts.len(), lim));
        Ok(())
    }
}

/// `slot`'s device buffer, replaced by a larger one where it holds fewer than `len` elements.
fn grown<'a, T: DeviceRepr + ValidAsZeroBits>(
    gpu: &Gpu,
    slot: &'a mut Option<CudaSlice<T>>,
    len: usize,
) -> Result<&'a mut CudaSlice<T>, GpuError> {
    if slot.as_ref().is_none_or(|b| b.len() < len) {
        *slot = None;
        *slot = Some(gpu.alloc(len)?);
    }
    Ok(slot.as_mut().expect("set above"))
}
