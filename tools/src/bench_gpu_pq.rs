//! `ctxfs bench gpu`'s PQ part: a GQA group's scan of a compact context's codes (what a
//! compact step does for every kv head of every layer) on the GPU against one core, on the
//! same generated head in one run.
//!
//! One head of the generator (`ctxfs_index::synth`), its scan codes built as an import builds
//! them (`PqParams::scan_codes`); the group's 4 q heads' decode queries. The scan is timed over
//! the first 131,072 tokens and over all of them (a prefix scan reads the same codes), on one
//! thread as a session's worker runs it, and on the GPU as a session calls it: the tables built
//! on the host, uploaded, the scan, and every score downloaded (the codes' one-time upload is
//! timed apart). Medians of 5 after one untimed call. The scores are compared bit for bit.
//!
//! Then the same with only each query's best [`BEST`] taken, as a compact step's `pq` plan
//! takes them: on the GPU, the scan, a sample of every 97th score, and the tokens reaching the
//! sample's cut read back (`PagedPq::token_best_many_by`); on the core, the scan and the
//! selection from every score (`take_tokens`), and (`cpu_kept_seconds`) the core's own scan
//! keeping only the tokens reaching a cut from the sample codes (`Pq::token_best_many`, as
//! `ctxfs bench codes` times it). The chosen tokens are compared.

use crate::bench::timed_median;
use anyhow::{anyhow, ensure, Result};
use ctxfs_attention::KeptOnDevice;
use ctxfs_index::coarse::pq::{Pq, PqParams};
use ctxfs_index::coarse::take_tokens;
use ctxfs_index::search::SEED_STRIDE;
use ctxfs_index::synth::{head, SynthParams};
use ctxfs_index::MemKeys;
use ctxfs_kernels::gpu::{Gpu, PqScanner};
use serde_json::{json, Value};
use std::cell::RefCell;
use std::time::Instant;

/// q heads per kv head of the generated group.
const GROUP: usize = 4;
/// The shorter scan: the 128K context of `ctxfs bench decode`.
const SHORT: usize = 131_072;
const TIMED: usize = 5;
/// Tokens each query takes in the timing of the best alone (a compact step takes
/// `Rules::codes_budget`, 768, beyond the window, and the window's; this times a larger choice).
const BEST: usize = 1024;

/// Times the scan of `tokens` tokens' codes of dimension `dim` on `gpu` against one core.
pub fn run(gpu: &Gpu, tokens: usize, dim: usize) -> Result<Value> {
    ensure!(tokens > 0 && dim >= 4, "--pq-tokens must be positive and the head dim at least 4");
    let p = SynthParams { tokens, head_dim: dim, group: GROUP, seed: 11 };
    let h = head(&p, 1, 0, 0, 1);
    let queries: Vec<f32> = h.decode.iter().flat_map(|q| q[..dim].iter().copied()).collect();
    let keys = MemKeys::new(dim, h.keys);
    let t = Instant::now();
    let pq = Pq::build(&keys, &PqParams::scan_codes(dim)).map_err(|e| anyhow!(e))?;
    let build_seconds = t.elapsed().as_secs_f64();
    let m = pq.params().m as usize;
    let t = Instant::now();
    let codes = gpu.codes(pq.code_bytes(), tokens, tokens, m)?;
    gpu.synchronize()?;
    let upload_seconds = t.elapsed().as_secs_f64();

    let scanner = RefCell::new(PqScanner::new(gpu)?);
    let mut scans = Vec::new();
    for lim in [SHORT.min(tokens), tokens] {
        if scans.iter().any(|s: &Value| s["tokens"] == lim) {
            continue;
        }
        let prefix = Some(lim as u32);
        let on_gpu = || {
            pq.token_scores_many_by(&queries, prefix, |luts, lim, out| {
                scanner.borrow_mut().scan(&codes, luts, lim, out)
            })
            .map_err(|e| anyhow!("{e}"))?
            .map_err(|e| anyhow!("{e}"))
        };
        let on_cpu = || pq.token_scores_many(&queries, prefix).map_err(|e| anyhow!("{e}"));
        let (gpu_scan, cpu_scan) = (on_gpu()?, on_cpu()?);
        let identical = (0..GROUP)
            .map(|i| {
                gpu_scan.scores(i).iter().zip(cpu_scan.scores(i)).filter(|(g, c)| g.to_bits() == c.to_bits()).count()
            })
            .sum::<usize>();
        drop((gpu_scan, cpu_scan));
        let (gpu_seconds, cpu_seconds) = (timed_median(TIMED, &on_gpu)?, timed_median(TIMED, &on_cpu)?);

        let k = BEST.min(lim);
        let best_on_gpu = || -> Result<Option<Vec<Vec<u32>>>> {
            let mut scanner = scanner.borrow_mut();
            let mut keep = KeptOnDevice { scanner: &mut scanner, codes: &codes };
            let kept =
                pq.token_best_many_by(&queries, prefix, k, SEED_STRIDE, &mut keep).map_err(|e| anyhow!("{e}"))?;
            let kept = kept.map_err(|e| anyhow!("{e}"))?;
            Ok(kept.map(|kept| kept.queries.into_iter().map(|q| q.best.into_iter().map(|b| b.0).collect()).collect()))
        };
        let best_on_cpu = || -> Result<Option<Vec<Vec<u32>>>> {
            let scan = on_cpu()?;
            Ok(Some((0..GROUP).map(|i| take_tokens(scan.query(i), k)).collect()))
        };
        let kept_on_cpu = || -> Result<Option<Vec<Vec<u32>>>> {
            let kept = pq.token_best_many(&queries, prefix, k, SEED_STRIDE).map_err(|e| anyhow!("{e}"))?;
            Ok(kept.map(|kept| kept.queries.into_iter().map(|q| q.best.into_iter().map(|b| b.0).collect()).collect()))
        };
        let (gpu_best, cpu_best, cpu_kept) = (best_on_gpu()?, best_on_cpu()?, kept_on_cpu()?);
        let same = |a: &Option<Vec<Vec<u32>>>| match (a, &cpu_best) {
            (Some(a), Some(c)) => a.iter().zip(c).filter(|(a, c)| a == c).count(),
            _ => 0,
        };
        let (best_identical, kept_identical) = (same(&gpu_best), same(&cpu_kept));
        let (best_gpu_seconds, best_cpu_seconds) =
            (timed_median(TIMED, &best_on_gpu)?, timed_median(TIMED, &best_on_cpu)?);
        let kept_cpu_seconds = timed_median(TIMED, &kept_on_cpu)?;
        scans.push(json!({
            "tokens": lim,
            "gpu_seconds": gpu_seconds,
            "cpu_seconds": cpu_seconds,
            "gpu_vs_cpu_speedup": cpu_seconds / gpu_seconds,
            "scores": GROUP * lim,
            "scores_identical": identical,
            "best": {
                "per_query": k,
                "gpu_seconds": best_gpu_seconds,
                "cpu_seconds": best_cpu_seconds,
                "gpu_vs_cpu_speedup": best_cpu_seconds / best_gpu_seconds,
                "sampled_cut_held": gpu_best.is_some(),
                "queries_identical": best_identical,
                "cpu_kept_seconds": kept_cpu_seconds,
                "cpu_kept_queries_identical": kept_identical,
            },
        }));
    }
    Ok(json!({
        "tokens": tokens,
        "head_dim": dim,
        "subspaces": m,
        "queries": GROUP,
        "cpu_threads": 1,
        "build_seconds": build_seconds,
        "codes_bytes": codes.device_bytes(),
        "upload_seconds": upload_seconds,
        "scans": scans,
    }))
}
