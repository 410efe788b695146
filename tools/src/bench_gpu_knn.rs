//! `ctxfs bench gpu`'s kNN part: the index build's first phase (each training query's exact
//! top 100 keys) on the GPU against the CPU's, on the same generated head in one run.
//!
//! The keys and prefill queries are one head of the generator (`ctxfs_index::synth`), as an
//! import of a generated context builds it: by default 131,072 keys of d = 128 and 512
//! prefill queries from each of a GQA group's 4 q heads. The GPU is timed as the import
//! calls it, the keys' upload included (the median of 3 after one untimed call, which loads
//! the kernels); the CPU once, on every core. The lists are compared: each GPU score is one
//! fused multiply-add chain, as the CPU's tiles are, but the CPU's tail columns sum without
//! fusing, so near-ties there may resolve differently.

use crate::bench::median;
use anyhow::{ensure, Result};
use ctxfs_index::synth::{head, SynthParams};
use ctxfs_index::{knn, Keys, MemKeys};
use serde_json::{json, Value};
use std::time::Instant;

/// Keys each query's list holds: the build's `BuildParams::nq`.
const K: usize = 100;
/// q heads per kv head of the generated group.
const GROUP: usize = 4;

/// Times the kNN of `queries` training queries against `keys` keys of dimension `dim`.
pub fn run(keys: usize, queries: usize, dim: usize) -> Result<Value> {
    ensure!(keys > 0 && queries >= GROUP && dim > 0, "--knn-keys and --knn-queries must be positive");
    let p = SynthParams { tokens: keys, head_dim: dim, group: GROUP, seed: 7 };
    let h = head(&p, 1, 0, queries / GROUP, 0);
    let rows = h.prefill.concat();
    let keys = MemKeys::new(dim, h.keys);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());

    let (gpu_lists, on_gpu) = knn(&keys, &rows, K, threads, true);
    ensure!(on_gpu, "the kNN did not run on the GPU");
    let gpu_seconds = median(
        (0..3)
            .map(|_| {
                let t = Instant::now();
                let (_, on_gpu) = knn(&keys, &rows, K, threads, true);
                ensure!(on_gpu, "the kNN fell back to the CPU");
                Ok(t.elapsed().as_secs_f64())
            })
            .collect::<Result<Vec<f64>>>()?,
    );
    let t = Instant::now();
    let (cpu_lists, _) = knn(&keys, &rows, K, threads, false);
    let cpu_seconds = t.elapsed().as_secs_f64();

    let k = K.min(keys.len() as usize).max(1);
    let overlap = gpu_lists
        .iter()
        .zip(&cpu_lists)
        .map(|(g, c)| g.iter().filter(|id| c.contains(id)).count() as f64 / k as f64)
        .sum::<f64>()
        / gpu_lists.len().max(1) as f64;
    let same_order = gpu_lists.iter().zip(&cpu_lists).filter(|(g, c)| g == c).count();
    Ok(json!({
        "keys": keys.len(),
        "queries": rows.len() / dim,
        "head_dim": dim,
        "k": K,
        "gpu_seconds": gpu_seconds,
        "cpu_seconds": cpu_seconds,
        "cpu_threads": threads,
        "gpu_vs_cpu_speedup": cpu_seconds / gpu_seconds,
        "overlap_with_cpu": overlap,
        "lists_identical": same_order,
    }))
}
