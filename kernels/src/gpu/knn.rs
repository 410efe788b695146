//! The exact kNN by inner product on the GPU: the first phase of the index build
//! (`ctxfs_index::build`), each sampled training query's best keys.
//!
//! Two launches per batch of queries (`kernels.cu`): `knn_scores` writes the batch's scores
//! against every key (a tile of 64 queries × 64 keys per block), and `knn_select` takes each
//! row's best `k` by a radix select. The host orders each query's `k` (a few hundred pairs).
//! A batch's scores fill at most [`SCORE_BYTES`] of device memory, so that a 1M-token head
//! needs no more than a 128K one beyond its keys.

use super::{Gpu, GpuError, MAX_GRID_Y};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use half::f16;

/// Device memory for one batch's scores, at most (a single query's row may exceed it).
const SCORE_BYTES: usize = 256 << 20;
/// Queries and keys per `knn_scores` block (`KNN_TILE` in `kernels.cu`).
const TILE: usize = 64;
/// Threads per block of both kernels (`KNN_THREADS`).
const THREADS: u32 = 256;

impl Gpu {
    /// For each query (rows of `dim` in `queries`), the ids of the `k` keys (rows of `dim` in
    /// `keys`) with the largest inner products, best first; among equal scores the lower id
    /// first (`f32::total_cmp`). Fewer than `k` keys: all of them.
    ///
    /// Each score is one chain of fused multiply-adds over the dimensions in order, starting
    /// at +0: the same bits as `q[j].mul_add(key[j], acc)` for j = 0, 1, … on the CPU.
    pub fn knn(&self, keys: &[f16], dim: usize, queries: &[f32], k: usize) -> Result<Vec<Vec<u32>>, GpuError> {
        let batch = (SCORE_BYTES / 4 / (keys.len() / dim.max(1)).max(1)).max(1);
        self.knn_in_batches(keys, dim, queries, k, batch)
    }

    /// [`Gpu::knn`], scoring at most `batch` queries per launch.
    fn knn_in_batches(
        &self,
        keys: &[f16],
        dim: usize,
        queries: &[f32],
        k: usize,
        batch: usize,
    ) -> Result<Vec<Vec<u32>>, GpuError> {
        if dim == 0 || !keys.len().is_multiple_of(dim) || !queries.len().is_multiple_of(dim) {
            return Err(GpuError::Invalid(format!(
                "kNN: {} key and {} query elements are not rows of dim {dim}",
                keys.len(),
                queries.len()
            )));
        }
        let (n, m) = (keys.len() / dim, queries.len() / dim);
        if n > i32::MAX as usize || dim > i32::MAX as usize {
            return Err(GpuError::Invalid(format!("kNN: {n} keys of dim {dim} exceed the kernels' 32-bit indices")));
        }
        let k = k.min(n);
        if k == 0 || m == 0 {
            return Ok(vec![Vec::new(); m]);
        }
        // Whole tiles of queries per batch where the budget allows, and no more tiles than a
        // grid's y dimension holds.
        let batch = if batch >= TILE { batch / TILE * TILE } else { batch.max(1) }.min(m).min(MAX_GRID_Y * TILE);

        let bits: &[u16] = bytemuck::cast_slice(keys);
        let mut dev_keys = self.alloc::<u16>(bits.len())?;
        self.stream.memcpy_htod(bits, &mut dev_keys)?;
        let mut dev_queries = self.alloc::<f32>(queries.len())?;
        self.stream.memcpy_htod(queries, &mut dev_queries)?;
        let mut scores = self.alloc::<f32>(batch * n)?;
        let mut ids = self.alloc::<u32>(m * k)?;
        let mut best = self.alloc::<f32>(m * k)?;

        let (n_arg, dim_arg, k_arg) = (n as i32, dim as i32, k as i32);
        for q0 in (0..m).step_by(batch) {
            let rows = batch.min(m - q0);
            let rows_arg = rows as i32;
            let batch_queries = dev_queries.slice(q0 * dim..(q0 + rows) * dim);
            let mut launch = self.stream.launch_builder(&self.device.knn_scores);
            launch.arg(&dev_keys).arg(&n_arg).arg(&dim_arg).arg(&batch_queries).arg(&rows_arg).arg(&mut scores);
            let cfg = LaunchConfig {
                grid_dim: (n.div_ceil(TILE) as u32, rows.div_ceil(TILE) as u32, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match `knn_scores(const unsigned short* keys, int n, int dim,
            // const float* queries, int m, float* scores)` in order and type. `dev_keys` holds
            // n × dim f16 bits, `batch_queries` rows × dim floats and `scores` batch × n ≥
            // rows × n floats; block (x, y) reads key rows [64x, 64x + 64) ∩ [0, n) and query
            // rows [64y, 64y + 64) ∩ [0, rows) and writes only their scores.
            unsafe { launch.launch(cfg) }?;

            let mut batch_ids = ids.slice_mut(q0 * k..(q0 + rows) * k);
            let mut batch_best = best.slice_mut(q0 * k..(q0 + rows) * k);
            let mut launch = self.stream.launch_builder(&self.device.knn_select);
            launch.arg(&scores).arg(&n_arg).arg(&k_arg).arg(&mut batch_ids).arg(&mut batch_best);
            let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the arguments match `knn_select(const float* scores, int n, int k,
            // unsigned* ids, float* best)` in order and type. Block r < rows reads row r of
            // `scores` (n floats, written above in stream order) and writes k ≤ n elements of
            // row r of `batch_ids` and `batch_best`, which hold rows × k each.
            unsafe { launch.launch(cfg) }?;
        }
        let ids = self.stream.clone_dtoh(&ids)?;
        let best = self.stream.clone_dtoh(&best)?;
        self.synchronize()?;
        // The temporaries are freed on return: graphs captured before must not replay.
        self.freed();

        Ok(ids
            .chunks_exact(k)
            .zip(best.chunks_exact(k))
            .map(|(ids, best)| {
                let mut ranked: Vec<(f32, u32)> = best.iter().copied().zip(ids.iter().copied()).collect();
                ranked.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                ranked.into_iter().map(|(_, id)| id).collect()
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Batches of one query and of one tile, against the whole set in one batch: the batch
    /// boundary changes nothing. Without a GPU it prints why and passes.
    #[test]
    fn batches_agree_with_one_launch() {
        let gpu = match Gpu::open() {
            Ok(gpu) => gpu,
            Err(e) => return eprintln!("skipped: {}", e.reason()),
        };
        let (n, dim, m) = (700, 64, 150);
        let mut x = 1u32;
        let mut next = || {
            x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (x >> 8) as f32 / (1 << 24) as f32 - 0.5
        };
        let keys: Vec<f16> = (0..n * dim).map(|_| f16::from_f32(next())).collect();
        let queries: Vec<f32> = (0..m * dim).map(|_| next()).collect();
        let whole = gpu.knn_in_batches(&keys, dim, &queries, 40, m).unwrap();
        for batch in [1, TILE, 100] {
            assert_eq!(gpu.knn_in_batches(&keys, dim, &queries, 40, batch).unwrap(), whole, "batch {batch}");
        }
    }
}
