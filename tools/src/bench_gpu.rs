//! `ctxfs bench gpu`: the GPU window attention and merge of one decode step, per layer,
//! against the device's memory bandwidth and against torch SDPA on the same shapes.
//!
//! Each of `--layers` layers has its own window (so that, at the defaults, the windows
//! together exceed the H200's 60 MB L2 and are read from HBM), queries and host partials. One
//! pass attends and merges every layer in one fused launch per layer (what
//! `GpuWindow::attention` does); it is timed with CUDA events, replayed from a CUDA graph
//! (device time: what the kernels cost) and launched call by call (what a host loop adds),
//! `--iters` passes per round, the median of `--rounds` interleaved rounds. Beside it, the same
//! pass as two launches per layer (attend, then merge: the overlapped path) and the attention
//! launch alone, both graph-replayed. The SDPA baseline (tools/bench_gpu_sdpa.py) is timed the
//! same two ways.

use crate::bench::median;
use anyhow::{anyhow, bail, ensure, Context, Result};
use ctxfs_kernels::gpu::{Gpu, GpuError, GpuPartials, GpuQueries, GpuWindow};
use ctxfs_kernels::Partial;
use half::f16;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;

#[derive(clap::Args)]
pub struct Args {
    /// Layers, each with its own window (the pass over them is what is timed).
    #[arg(long, default_value_t = 32)]
    layers: usize,
    /// Passes over the layers per timing.
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// Interleaved rounds; the medians are reported.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Window tokens per layer.
    #[arg(long, default_value_t = 640)]
    window: usize,
    /// Query heads per layer.
    #[arg(long, default_value_t = 32)]
    q_heads: usize,
    /// Key-value heads per layer.
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Head dimension.
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// The Python with PyTorch that runs the SDPA baseline.
    #[arg(long, default_value = "python3")]
    python: String,
    /// The SDPA baseline script (default: tools/bench_gpu_sdpa.py under the current
    /// directory, beside the executable, or in the source tree).
    #[arg(long)]
    sdpa_script: Option<PathBuf>,
    /// Skip the SDPA baseline.
    #[arg(long)]
    no_sdpa: bool,
    /// Keys of the kNN part (the index build's kNN, GPU against CPU, `--head-dim` wide).
    #[arg(long, default_value_t = 131072)]
    knn_keys: usize,
    /// Training queries of the kNN part (512 per q head of a group of 4 by default).
    #[arg(long, default_value_t = 2048)]
    knn_queries: usize,
    /// Skip the kNN part.
    #[arg(long)]
    no_knn: bool,
    /// Tokens of the PQ part (a GQA group's scan of a compact context's codes, GPU against
    /// one core, `--head-dim` wide; also timed over the first 131,072).
    #[arg(long, default_value_t = 1 << 20)]
    pq_tokens: usize,
    /// Skip the PQ part.
    #[arg(long)]
    no_pq: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// One layer's buffers.
struct Layer {
    window: GpuWindow,
    q: GpuQueries,
    host: GpuPartials,
    out: GpuPartials,
}

/// A small deterministic generator: the data only has to be ordinary.
struct Rng(u64);
impl Rng {
    fn uniform(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn halves(&mut self, n: usize, scale: f32) -> Vec<f16> {
        (0..n).map(|_| f16::from_f32(self.uniform() * scale)).collect()
    }
}

/// Vendor peak memory bandwidth (bytes/s) of common data-centre GPUs, for drivers that do not
/// report the memory clock and to show beside what the driver's figures give.
fn datasheet_bandwidth(name: &str) -> Option<f64> {
    [("H200", 4.8e12), ("H100", 3.35e12), ("A100", 2.039e12)]
        .iter()
        .find(|(model, _)| name.contains(model))
        .map(|&(_, bytes_per_second)| bytes_per_second)
}

/// How a pass launches each layer's work.
#[derive(Clone, Copy)]
enum Launches {
    /// Attention and merge in one launch.
    Fused,
    /// The attention, then the merge.
    Two,
    /// The attention alone.
    AttendOnly,
}

/// One pass: every layer's window attention and its merge with the host partials.
fn pass(layers: &mut [Layer], scale: f32, launches: Launches) -> Result<(), GpuError> {
    for layer in layers {
        match launches {
            Launches::Fused => layer.window.attend_merged(&layer.q, scale, Some(&layer.host), &mut layer.out)?,
            Launches::Two => {
                layer.window.attend(&layer.q, scale)?;
                layer.window.merge(Some(&layer.host), &mut layer.out)?;
            }
            Launches::AttendOnly => layer.window.attend(&layer.q, scale)?,
        }
    }
    Ok(())
}

pub fn run(a: Args) -> Result<()> {
    ensure!(
        a.layers > 0 && a.iters > 0 && a.rounds > 0 && a.window > 0,
        "--layers, --iters, --rounds and --window must be positive"
    );
    ensure!(
        a.kv_heads > 0 && a.q_heads.is_multiple_of(a.kv_heads),
        "--q-heads must be a positive multiple of --kv-heads"
    );
    let gpu = Gpu::open().map_err(|e| anyhow!("bench gpu needs a CUDA GPU: {}", e.reason()))?;
    let (qh, kvh, d, w) = (a.q_heads, a.kv_heads, a.head_dim, a.window);
    let scale = 1.0 / (d as f32).sqrt();

    let mut rng = Rng(1);
    let mut layers = Vec::with_capacity(a.layers);
    // Layer 0's host data, for the check against the CPU.
    let mut reference = None;
    for l in 0..a.layers {
        let keys = rng.halves(kvh * w * d, 2.0);
        let values = rng.halves(kvh * w * d, 4.0);
        let q: Vec<f32> = (0..qh * d).map(|_| rng.uniform()).collect();
        let host: Vec<Partial> = (0..qh)
            .map(|_| Partial {
                o: (0..d).map(|_| rng.uniform() * 2.0).collect(),
                m: rng.uniform() * 3.0,
                l: 1.0 + rng.uniform().abs() * 50.0,
            })
            .collect();
        let mut layer = Layer {
            window: GpuWindow::new(&gpu, qh, kvh, d, w)?,
            q: GpuQueries::new(&gpu, qh, d)?,
            host: GpuPartials::new(&gpu, qh, d)?,
            out: GpuPartials::new(&gpu, qh, d)?,
        };
        layer.window.load(&keys, &values)?;
        layer.q.upload(&q)?;
        layer.host.upload(&host)?;
        layers.push(layer);
        if l == 0 {
            reference = Some((keys, values, q, host));
        }
    }

    // One pass sizes the scratch buffers (before the capture) and gives layer 0's result, fused
    // and in two launches.
    pass(&mut layers, scale, Launches::Two)?;
    let two = layers[0].out.download()?;
    pass(&mut layers, scale, Launches::Fused)?;
    let got = layers[0].out.download()?;
    ensure!(
        got.iter().zip(&two).all(|(a, b)| a.m == b.m && a.l == b.l && a.o == b.o),
        "the fused launch's result differs from the two launches'"
    );
    let (keys, values, q, host) = reference.expect("at least one layer");
    let group = qh / kvh;
    let mut max_error = 0.0f64;
    for (h, got) in got.iter().enumerate() {
        let kv = h / group;
        let rows = |x: &[f16]| x[kv * w * d..(kv + 1) * w * d].to_vec();
        let window = Partial::attend(&q[h * d..(h + 1) * d], &rows(&keys), &rows(&values), scale);
        let want = Partial::merge(&[window, host[h].clone()]);
        let norm = want.o.iter().fold(0.0f32, |a, x| a.max(x.abs())).max(f32::MIN_POSITIVE);
        let o_error = got.o.iter().zip(&want.o).fold(0.0f32, |a, (g, x)| a.max((g - x).abs())) / norm;
        let lse_error = (got.lse() - want.lse()).abs() / want.lse().abs().max(1.0);
        max_error = max_error.max(f64::from(o_error.max(lse_error)));
    }
    ensure!(max_error <= 1e-3, "the GPU result differs from the CPU reference: relative error {max_error:e}");

    let mut graphs = Vec::new();
    for launches in [Launches::Fused, Launches::Two, Launches::AttendOnly] {
        let graph = gpu.capture(|| pass(&mut layers, scale, launches))?;
        graph.launch()?;
        graphs.push(graph);
    }
    gpu.synchronize()?;
    let per_layer = (a.iters * a.layers) as f64;
    let mut graphed = vec![Vec::new(); graphs.len()];
    let mut eager = Vec::new();
    for _ in 0..a.rounds {
        for (graph, times) in graphs.iter().zip(&mut graphed) {
            let t = gpu.time(|| (0..a.iters).try_for_each(|_| graph.launch()))?;
            times.push(t.as_secs_f64() / per_layer);
        }
        let t = gpu.time(|| (0..a.iters).try_for_each(|_| pass(&mut layers, scale, Launches::Fused)))?;
        eager.push(t.as_secs_f64() / per_layer);
    }
    let mut graphed = graphed.into_iter().map(median);
    let (layer_seconds, two_launches_seconds, attend_seconds) =
        (graphed.next().unwrap_or(0.0), graphed.next().unwrap_or(0.0), graphed.next().unwrap_or(0.0));
    let layer_seconds_eager = median(eager);

    // What one layer must move: the window's keys and values, the queries, the host partials
    // read and the merged partials written (the kernels' own scratch not counted).
    let kv_bytes = 2 * w * kvh * d * 2;
    let bytes = kv_bytes + qh * d * 4 + 2 * qh * (d + 2) * 4;
    let achieved = bytes as f64 / layer_seconds;
    let nominal = datasheet_bandwidth(gpu.name());
    let (peak, peak_source) = match (gpu.memory_bandwidth(), nominal) {
        (Some(b), _) => (Some(b), "driver: 2 × memory clock × bus width"),
        (None, Some(b)) => (Some(b), "datasheet"),
        (None, None) => (None, "unknown"),
    };

    let sdpa = if a.no_sdpa { Err("skipped (--no-sdpa)".to_string()) } else { run_sdpa(&a) };
    let sdpa_seconds = sdpa.as_ref().ok().and_then(|v| v["sdpa_layer_seconds"].as_f64());
    let sdpa_seconds_eager = sdpa.as_ref().ok().and_then(|v| v["sdpa_layer_seconds_eager"].as_f64());
    let speedup = sdpa_seconds.map(|s| s / layer_seconds);

    let knn = if a.no_knn {
        Err("skipped (--no-knn)".to_string())
    } else {
        crate::bench_gpu_knn::run(a.knn_keys, a.knn_queries, d).map_err(|e| format!("{e:#}"))
    };

    let pq = if a.no_pq {
        Err("skipped (--no-pq)".to_string())
    } else {
        crate::bench_gpu_pq::run(&gpu, a.pq_tokens, d).map_err(|e| format!("{e:#}"))
    };

    let gbps = |b: f64| b / 1e9;
    if a.json {
        let (major, minor) = gpu.compute_capability();
        outln!(
            "{}",
            json!({
                "device": gpu.name(),
                "compute_capability": format!("{major}.{minor}"),
                "multiprocessors": gpu.multiprocessors(),
                "hbm_peak_gbps": peak.map(gbps),
                "hbm_peak_source": peak_source,
                "hbm_nominal_gbps": nominal.map(gbps),
                "window": w,
                "q_heads": qh,
                "kv_heads": kvh,
                "head_dim": d,
                "layers": a.layers,
                "iters": a.iters,
                "rounds": a.rounds,
                "bytes_per_layer": bytes,
                "layer_seconds": layer_seconds,
                "layer_seconds_eager": layer_seconds_eager,
                "layer_seconds_two_launches": two_launches_seconds,
                "attend_only_seconds": attend_seconds,
                "achieved_gbps": gbps(achieved),
                "fraction_of_hbm": peak.map(|p| achieved / p),
                "fraction_of_nominal": nominal.map(|p| achieved / p),
                "max_rel_error": max_error,
                "sdpa_layer_seconds": sdpa_seconds,
                "sdpa_layer_seconds_eager": sdpa_seconds_eager,
                "speedup_vs_sdpa": speedup,
                "speedup_vs_sdpa_eager": sdpa_seconds_eager.map(|s| s / layer_seconds_eager),
                "sdpa": sdpa.as_ref().map_or_else(|e| json!({ "error": e }), Value::clone),
                "knn": knn.as_ref().map_or_else(|e| json!({ "error": e }), Value::clone),
                "pq": pq.as_ref().map_or_else(|e| json!({ "error": e }), Value::clone),
                "nvrtc": gpu.nvrtc(),
            })
        )?;
        return Ok(());
    }
    let (major, minor) = gpu.compute_capability();
    outln!(
        "GPU: {} (sm_{major}{minor}, {} multiprocessors), memory bandwidth {} ({peak_source}){}",
        gpu.name(),
        gpu.multiprocessors(),
        peak.map_or("unknown".into(), |p| format!("{:.0} GB/s", gbps(p))),
        nominal.map_or(String::new(), |n| format!(", datasheet {:.0} GB/s", gbps(n)))
    )?;
    outln!(
        "window {w} tokens, {qh} q heads / {kvh} kv heads, head dim {d}: {:.2} MB per layer ({:.2} MB keys and values), {} layers",
        bytes as f64 / 1e6,
        kv_bytes as f64 / 1e6,
        a.layers
    )?;
    outln!(
        "window attention + merge per layer, one fused launch: {:.2} µs (graph replay), {:.2} µs (launch by launch); max relative error {max_error:.1e}",
        layer_seconds * 1e6,
        layer_seconds_eager * 1e6
    )?;
    outln!(
        "  as two launches (attend, then merge): {:.2} µs; the attention launch alone: {:.2} µs",
        two_launches_seconds * 1e6,
        attend_seconds * 1e6
    )?;
    outln!(
        "achieved {:.0} GB/s{}",
        gbps(achieved),
        peak.map_or(String::new(), |p| format!(" = {:.1}% of the memory bandwidth", 100.0 * achieved / p))
    )?;
    match (&sdpa, sdpa_seconds, speedup) {
        (Ok(v), Some(s), Some(x)) => outln!(
            "torch SDPA ({}, torch {}): {:.2} µs per layer (graph replay), {} (launch by launch): ctxfs {x:.2}× as fast",
            v["gqa"].as_str().unwrap_or("?"),
            v["torch"].as_str().unwrap_or("?"),
            s * 1e6,
            sdpa_seconds_eager.map_or("?".into(), |e| format!("{:.2} µs", e * 1e6)),
        )?,
        (Err(e), _, _) => outln!("torch SDPA: {e}")?,
        _ => outln!("torch SDPA: the script's output had no timing")?,
    }
    match &knn {
        Ok(v) => outln!(
            "index build kNN, {} queries × {} keys, top {}: GPU {:.1} ms, CPU {:.1} ms on {} threads ({:.1}× as fast); {:.4} of the CPU's lists found",
            v["queries"],
            v["keys"],
            v["k"],
            v["gpu_seconds"].as_f64().unwrap_or(0.0) * 1e3,
            v["cpu_seconds"].as_f64().unwrap_or(0.0) * 1e3,
            v["cpu_threads"],
            v["gpu_vs_cpu_speedup"].as_f64().unwrap_or(0.0),
            v["overlap_with_cpu"].as_f64().unwrap_or(0.0),
        )?,
        Err(e) => outln!("index build kNN: {e}")?,
    }
    match &pq {
        Ok(v) => {
            for scan in v["scans"].as_array().into_iter().flatten() {
                outln!(
                    "PQ scan of a GQA group ({} q heads), {} tokens' codes: GPU {:.3} ms, CPU {:.3} ms on one core ({:.1}× as fast); {} of {} scores identical",
                    v["queries"],
                    scan["tokens"],
                    scan["gpu_seconds"].as_f64().unwrap_or(0.0) * 1e3,
                    scan["cpu_seconds"].as_f64().unwrap_or(0.0) * 1e3,
                    scan["gpu_vs_cpu_speedup"].as_f64().unwrap_or(0.0),
                    scan["scores_identical"],
                    scan["scores"],
                )?;
                let best = &scan["best"];
                outln!(
                    "  the best {} of each query alone: GPU {:.3} ms, CPU {:.3} ms ({:.1}× as fast); {} of {} queries chose the same tokens",
                    best["per_query"],
                    best["gpu_seconds"].as_f64().unwrap_or(0.0) * 1e3,
                    best["cpu_seconds"].as_f64().unwrap_or(0.0) * 1e3,
                    best["gpu_vs_cpu_speedup"].as_f64().unwrap_or(0.0),
                    best["queries_identical"],
                    v["queries"],
                )?;
            }
        }
        Err(e) => outln!("PQ scan: {e}")?,
    }
    Ok(())
}

/// Runs the SDPA baseline script on the same shapes; its JSON, or why there is none.
fn run_sdpa(a: &Args) -> Result<Value, String> {
    let script = sdpa_script(a).ok_or("tools/bench_gpu_sdpa.py not found (give --sdpa-script)")?;
    let output = Command::new(&a.python)
        .arg(&script)
        .arg("--json")
        .args(["--layers", &a.layers.to_string(), "--iters", &a.iters.to_string()])
        .args(["--rounds", &a.rounds.to_string(), "--window", &a.window.to_string()])
        .args(["--q-heads", &a.q_heads.to_string(), "--kv-heads", &a.kv_heads.to_string()])
        .args(["--head-dim", &a.head_dim.to_string()])
        .output()
        .map_err(|e| format!("cannot run {}: {e}", a.python))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("no message");
        return Err(format!("{} {} failed ({}): {last}", a.python, script.display(), output.status));
    }
    parse_sdpa(&output.stdout).map_err(|e| format!("{e:#}"))
}

fn parse_sdpa(stdout: &[u8]) -> Result<Value> {
    let text = std::str::from_utf8(stdout).context("the SDPA script's output is not UTF-8")?;
    let line =
        text.lines().rev().find(|l| l.trim_start().starts_with('{')).context("the SDPA script printed no JSON")?;
    let value: Value = serde_json::from_str(line).context("the SDPA script's JSON")?;
    if value["sdpa_layer_seconds"].as_f64().is_none() {
        bail!("the SDPA script's JSON has no sdpa_layer_seconds");
    }
    Ok(value)
}

fn sdpa_script(a: &Args) -> Option<PathBuf> {
    if let Some(script) = &a.sdpa_script {
        return Some(script.clone());
    }
    const NAME: &str = "bench_gpu_sdpa.py";
    let beside_exe = std::env::current_exe().ok().and_then(|exe| Some(exe.parent()?.join(NAME)));
    [Some(PathBuf::from("tools").join(NAME)), beside_exe, Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(NAME))]
        .into_iter()
        .flatten()
        .find(|p| p.is_file())
}
