//! The GPU window attention and merge against the CPU reference (`Partial::attend`,
//! `Partial::merge`) on random data with extreme values, every GQA grouping and tail length,
//! and a window growing across its capacity. Without a usable GPU each test prints
//! `skipped: <reason>` and passes.

use ctxfs_kernels::gpu::{Gpu, GpuPartials, GpuQueries, GpuWindow};
use ctxfs_kernels::Partial;
use half::f16;

fn gpu() -> Option<Gpu> {
    match Gpu::open() {
        Ok(gpu) => Some(gpu),
        Err(e) => {
            eprintln!("skipped: {}", e.reason());
            None
        }
    }
}

mod common;
use common::Rng;

/// The window's tokens on the host, per kv head, for the reference.
struct Host {
    dim: usize,
    keys: Vec<Vec<f16>>,
    values: Vec<Vec<f16>>,
}

impl Host {
    fn new(kv_heads: usize, dim: usize) -> Host {
        Host { dim, keys: vec![Vec::new(); kv_heads], values: vec![Vec::new(); kv_heads] }
    }

    /// Adds `[kv_heads][tokens][dim]` rows, as `GpuWindow::append` does.
    fn append(&mut self, keys: &[f16], values: &[f16]) {
        if keys.is_empty() {
            return;
        }
        let per_head = keys.len() / self.keys.len();
        for (h, (k, v)) in keys.chunks_exact(per_head).zip(values.chunks_exact(per_head)).enumerate() {
            self.keys[h].extend_from_slice(k);
            self.values[h].extend_from_slice(v);
        }
    }

    /// The CPU's partial for each q head (GQA: head h reads kv head h / group).
    fn reference(&self, q: &[f32], scale: f32) -> Vec<Want> {
        let d = self.dim;
        let q_heads = q.len() / d;
        let group = q_heads / self.keys.len();
        (0..q_heads)
            .map(|h| {
                let (q, kv) = (&q[h * d..(h + 1) * d], h / group);
                Want::attend(q, &self.keys[kv], &self.values[kv], scale)
            })
            .collect()
    }
}

/// A reference partial with the scales its error is measured against: per dimension
/// Σ a_j |v_ji| (what the f32 sums of o are exact relative to, cancellation or not), the
/// part of that sum from weights near or below f32's smallest normal, and the largest
/// Σ |scale · q_i k_ji| (what the scores are exact relative to).
#[derive(Clone)]
struct Want {
    p: Partial,
    magnitude: Vec<f64>,
    /// Σ a_j |v_ji| over the tokens whose weight e^(z_j − m) is below e^(1 − 87.3): the CPU's
    /// exp flushes weights under f32's smallest normal (e^−87.3) to 0, the GPU's keeps them
    /// as subnormals, so either side may hold these terms and the other not.
    flushed: Vec<f64>,
    z_magnitude: f64,
}

impl Want {
    fn attend(q: &[f32], keys: &[f16], values: &[f16], scale: f32) -> Want {
        let d = q.len();
        let p = Partial::attend(q, keys, values, scale);
        let z: Vec<f64> = keys
            .chunks_exact(d)
            .map(|k| k.iter().zip(q).map(|(k, q)| k.to_f64() * f64::from(*q)).sum::<f64>() * f64::from(scale))
            .collect();
        let z_magnitude = keys
            .chunks_exact(d)
            .map(|k| k.iter().zip(q).map(|(k, q)| (k.to_f64() * f64::from(*q)).abs()).sum::<f64>() * f64::from(scale))
            .fold(0.0, f64::max);
        let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = z.iter().map(|z| (z - m).exp()).collect();
        let total: f64 = weights.iter().sum();
        let flush_below = (f64::from(f32::MIN_POSITIVE).ln() + 1.0).exp();
        let (mut magnitude, mut flushed) = (vec![0.0; d], vec![0.0; d]);
        for (w, v) in weights.iter().zip(values.chunks_exact(d)) {
            magnitude.iter_mut().zip(v).for_each(|(a, v)| *a += w / total * v.to_f64().abs());
            if *w < flush_below {
                flushed.iter_mut().zip(v).for_each(|(a, v)| *a += w / total * v.to_f64().abs());
            }
        }
        Want { p, magnitude, flushed, z_magnitude }
    }

    /// A host partial given as is: its o is its own magnitude.
    fn given(p: &Partial) -> Want {
        Want {
            magnitude: p.o.iter().map(|x| f64::from(*x).abs()).collect(),
            flushed: vec![0.0; p.o.len()],
            z_magnitude: 0.0,
            p: p.clone(),
        }
    }

    /// `Partial::merge` of the parts, magnitudes weighted alike.
    fn merge(parts: &[Want]) -> Want {
        let p = Partial::merge(&parts.iter().map(|w| w.p.clone()).collect::<Vec<_>>());
        let (mut magnitude, mut flushed) = (vec![0.0; p.o.len()], vec![0.0; p.o.len()]);
        for part in parts.iter().filter(|w| !w.p.is_empty()) {
            let share = f64::from((part.p.m - p.m).exp() * part.p.l / p.l);
            magnitude.iter_mut().zip(&part.magnitude).for_each(|(a, m)| *a += share * m);
            flushed.iter_mut().zip(&part.flushed).for_each(|(a, m)| *a += share * m);
        }
        let z_magnitude = parts.iter().map(|w| w.z_magnitude).fold(0.0, f64::max);
        Want { p, magnitude, flushed, z_magnitude }
    }
}

/// Products and sums below f32's normal range round to multiples of its smallest subnormal
/// (1.4e-45): a few of those, whatever the magnitude.
const SUBNORMAL_SLACK: f64 = 64.0 * 1.401_298_464_324_817e-45;

/// Relative error at most 1e-3: o per dimension against its magnitude (plus the terms one
/// side may flush), l relative, m against the score magnitude (f32 sums of d products in
/// another order differ by a few ulps of it).
fn check(got: &Partial, want: &Want, what: &str) {
    let w = &want.p;
    assert_eq!(got.o.len(), w.o.len(), "{what}: dimension");
    if w.is_empty() {
        assert!(got.is_empty() && got.m == f32::NEG_INFINITY, "{what}: expected empty, got m {} l {}", got.m, got.l);
        assert!(got.o.iter().all(|&x| x == 0.0), "{what}: an empty partial's o is zero");
        return;
    }
    let m_tolerance = 1e-5 * want.z_magnitude + 1e-6 * f64::from(w.m).abs() + 1e-6;
    assert!(
        (f64::from(got.m) - f64::from(w.m)).abs() <= m_tolerance,
        "{what}: m {} vs {} (tolerance {m_tolerance})",
        got.m,
        w.m
    );
    assert!(
        ((got.l - w.l) / w.l).abs() <= 1e-3,
        "{what}: l {} vs {} (relative error {})",
        got.l,
        w.l,
        (got.l - w.l) / w.l
    );
    for (i, (((g, x), mag), flushed)) in got.o.iter().zip(&w.o).zip(&want.magnitude).zip(&want.flushed).enumerate() {
        let error = (f64::from(*g) - f64::from(*x)).abs();
        assert!(
            error <= 1e-3 * mag + flushed + SUBNORMAL_SLACK,
            "{what}: o[{i}] {g} vs {x} (magnitude {mag}, of it near-subnormal weights' {flushed}, relative error {})",
            error / mag
        );
    }
}

/// A GPU window of `len` tokens loaded with `keys` and `values`, and the host reference
/// holding the same.
fn loaded(
    gpu: &Gpu,
    q_heads: usize,
    (kv_heads, dim, len): (usize, usize, usize),
    keys: &[f16],
    values: &[f16],
) -> (GpuWindow, Host) {
    let mut window = GpuWindow::new(gpu, q_heads, kv_heads, dim, len).unwrap();
    window.load(keys, values).unwrap();
    let mut host = Host::new(kv_heads, dim);
    host.append(keys, values);
    (window, host)
}

fn check_all(got: &[Partial], want: &[Want], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: heads");
    for (h, (g, w)) in got.iter().zip(want).enumerate() {
        check(g, w, &format!("{what}, q head {h}"));
    }
}

/// Random host partials: ordinary, empty, dominating and negligible ones.
fn host_partials(rng: &mut Rng, heads: usize, dim: usize) -> Vec<Partial> {
    (0..heads)
        .map(|h| {
            if h % 5 == 1 {
                return Partial::empty(dim);
            }
            let m = match h % 5 {
                2 => 80.0,  // dominates the window
                3 => -80.0, // negligible beside it
                _ => rng.f32() * 3.0,
            };
            Partial { o: (0..dim).map(|_| rng.f32() * 2.0).collect(), m, l: 1.0 + rng.f32().abs() * 50.0 }
        })
        .collect()
}

/// The window's attention and its merge with `host` as two launches (`attend`, then `merge`).
fn two_launches(gpu: &Gpu, window: &mut GpuWindow, q: &[f32], scale: f32, host: &[Partial]) -> Vec<Partial> {
    let (heads, dim) = (window.q_heads(), window.head_dim());
    let mut queries = GpuQueries::new(gpu, heads, dim).unwrap();
    let (mut parts, mut out) = (GpuPartials::new(gpu, heads, dim).unwrap(), GpuPartials::new(gpu, heads, dim).unwrap());
    queries.upload(q).unwrap();
    parts.upload(host).unwrap();
    window.attend(&queries, scale).unwrap();
    window.merge(Some(&parts), &mut out).unwrap();
    out.download().unwrap()
}

/// (q heads, kv heads): GQA groups of 1, 4 and 12 (two blocks of q heads per kv head).
const GROUPINGS: [(usize, usize); 3] = [(4, 4), (8, 2), (24, 2)];
/// Windows of one token, within, at and across tile edges (32), and long ones.
const LENGTHS: [usize; 8] = [1, 5, 31, 32, 33, 100, 640, 1000];

#[test]
fn opening_never_panics() {
    match Gpu::open() {
        Ok(gpu) => {
            assert!(!gpu.name().is_empty());
            eprintln!(
                "{} (sm_{}{}), kernels from {}",
                gpu.name(),
                gpu.compute_capability().0,
                gpu.compute_capability().1,
                gpu.nvrtc()
            );
        }
        Err(e) => {
            assert!(!e.reason().is_empty());
            eprintln!("skipped: {}", e.reason());
        }
    }
}

#[test]
fn window_attention_matches_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(1);
    for dim in [64, 128] {
        for (q_heads, kv_heads) in GROUPINGS {
            for len in LENGTHS {
                let what = format!("d={dim} q={q_heads} kv={kv_heads} len={len}");
                let keys = rng.halves(kv_heads * len * dim, |r| r.f32() * 2.0);
                let values = rng.halves(kv_heads * len * dim, |r| r.f32() * 4.0);
                let q: Vec<f32> = (0..q_heads * dim).map(|_| rng.f32()).collect();
                let scale = if len == 100 { 0.5 } else { 1.0 / (dim as f32).sqrt() };
                let (mut window, host) = loaded(&gpu, q_heads, (kv_heads, dim, len), &keys, &values);
                check_all(&window.attention(&q, scale, None).unwrap(), &host.reference(&q, scale), &what);
            }
        }
    }
}

#[test]
fn merge_matches_partial_merge() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(2);
    for dim in [64, 128] {
        for (q_heads, kv_heads) in GROUPINGS {
            // An empty window too: the result is the host's partial (or empty). Up to 64 tiles
            // of 32 tokens a cluster merges the splits on Hopper; 2,100 tokens are merged by the
            // last split to finish.
            for len in [0, 1, 33, 640, 2100] {
                let what = format!("d={dim} q={q_heads} kv={kv_heads} len={len}");
                let keys = rng.halves(kv_heads * len * dim, |r| r.f32() * 2.0);
                let values = rng.halves(kv_heads * len * dim, |r| r.f32() * 4.0);
                let q: Vec<f32> = (0..q_heads * dim).map(|_| rng.f32()).collect();
                let scale = 1.0 / (dim as f32).sqrt();
                let mut window = GpuWindow::new(&gpu, q_heads, kv_heads, dim, 16).unwrap();
                window.load(&keys, &values).unwrap();
                let mut host = Host::new(kv_heads, dim);
                host.append(&keys, &values);
                let reference = host.reference(&q, scale);
                let parts = host_partials(&mut rng, q_heads, dim);
                let want: Vec<Want> =
                    reference.iter().zip(&parts).map(|(w, p)| Want::merge(&[w.clone(), Want::given(p)])).collect();
                let fused = window.attention(&q, scale, Some(&parts)).unwrap();
                check_all(&fused, &want, &what);
                // The fused launch merges as the merge kernel does, in the same order.
                assert_eq!(fused, two_launches(&gpu, &mut window, &q, scale, &parts), "{what}: fused vs two launches");
                // Every host partial empty: the window's own partial.
                let empty = vec![Partial::empty(dim); q_heads];
                check_all(
                    &window.attention(&q, scale, Some(&empty)).unwrap(),
                    &reference,
                    &format!("{what}, empty host"),
                );
            }
        }
    }
}

#[test]
fn window_grows_across_its_capacity() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(3);
    let (q_heads, kv_heads, dim) = (8, 2, 128);
    let mut window = GpuWindow::new(&gpu, q_heads, kv_heads, dim, 4).unwrap();
    let mut host = Host::new(kv_heads, dim);
    let first = 3;
    let keys = rng.halves(kv_heads * first * dim, |r| r.f32() * 2.0);
    let values = rng.halves(kv_heads * first * dim, |r| r.f32() * 4.0);
    window.load(&keys, &values).unwrap();
    host.append(&keys, &values);
    for (step, tokens) in [1, 1, 2, 7, 30, 64, 1, 200, 1].into_iter().enumerate() {
        let (capacity, len) = (window.capacity(), window.len());
        let keys = rng.halves(kv_heads * tokens * dim, |r| r.f32() * 2.0);
        let values = rng.halves(kv_heads * tokens * dim, |r| r.f32() * 4.0);
        window.append(&keys, &values).unwrap();
        host.append(&keys, &values);
        assert_eq!(window.len(), len + tokens);
        if len + tokens > capacity {
            assert_eq!(window.capacity(), (len + tokens).max(2 * capacity), "step {step}: growth");
        } else {
            assert_eq!(window.capacity(), capacity, "step {step}: no growth needed");
        }
        let q: Vec<f32> = (0..q_heads * dim).map(|_| rng.f32()).collect();
        let scale = 1.0 / (dim as f32).sqrt();
        let what = format!("step {step}: {} tokens, capacity {}", window.len(), window.capacity());
        check_all(&window.attention(&q, scale, None).unwrap(), &host.reference(&q, scale), &what);
    }
    // Loading replaces the window.
    let keys = rng.halves(kv_heads * 2 * dim, |r| r.f32());
    let values = rng.halves(kv_heads * 2 * dim, |r| r.f32());
    window.load(&keys, &values).unwrap();
    let mut host = Host::new(kv_heads, dim);
    host.append(&keys, &values);
    let q: Vec<f32> = (0..q_heads * dim).map(|_| rng.f32()).collect();
    check_all(&window.attention(&q, 0.1, None).unwrap(), &host.reference(&q, 0.1), "reloaded");
}

#[test]
fn extreme_values_match_the_cpu() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(4);
    for dim in [64, 128] {
        for (q_heads, kv_heads) in [(4, 1), (8, 2)] {
            for len in [1, 37, 640] {
                let what = format!("d={dim} q={q_heads} kv={kv_heads} len={len}");
                // Keys with large entries (scores spread over hundreds), values from f16's
                // largest to its subnormals, queries with outlier channels.
                let mut keys = rng.halves(kv_heads * len * dim, |r| r.wild(500.0, 1e-7));
                let values = rng.halves(kv_heads * len * dim, |r| r.wild(60000.0, 1e-7));
                let q: Vec<f32> =
                    (0..q_heads * dim).map(|i| if i % 17 == 0 { rng.f32() * 8.0 } else { rng.f32() }).collect();
                // A sink: the first token of kv head 0 points along q head 0, and dominates.
                for i in 0..dim {
                    keys[i] = f16::from_f32(q[i].signum() * 8.0);
                }
                let scale = 1.0 / (dim as f32).sqrt();
                let (mut window, host) = loaded(&gpu, q_heads, (kv_heads, dim, len), &keys, &values);
                check_all(&window.attention(&q, scale, None).unwrap(), &host.reference(&q, scale), &what);
            }
        }
    }
}

#[test]
fn attend_runs_while_the_host_computes_its_part() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(5);
    let (q_heads, kv_heads, dim, len) = (32, 8, 128, 640);
    let keys = rng.halves(kv_heads * len * dim, |r| r.f32() * 2.0);
    let values = rng.halves(kv_heads * len * dim, |r| r.f32() * 4.0);
    let (mut window, host) = loaded(&gpu, q_heads, (kv_heads, dim, len), &keys, &values);
    let q: Vec<f32> = (0..q_heads * dim).map(|_| rng.f32()).collect();
    let scale = 1.0 / (dim as f32).sqrt();

    let mut queries = GpuQueries::new(&gpu, q_heads, dim).unwrap();
    queries.upload(&q).unwrap();
    window.attend(&queries, scale).unwrap();
    // Meanwhile the host attends its retrieved set (here: other random tokens).
    let retrieved = 300;
    let group = q_heads / kv_heads;
    let other_keys: Vec<Vec<f16>> = (0..kv_heads).map(|_| rng.halves(retrieved * dim, |r| r.f32() * 2.0)).collect();
    let other_values: Vec<Vec<f16>> = (0..kv_heads).map(|_| rng.halves(retrieved * dim, |r| r.f32() * 4.0)).collect();
    let theirs: Vec<Want> = (0..q_heads)
        .map(|h| Want::attend(&q[h * dim..(h + 1) * dim], &other_keys[h / group], &other_values[h / group], scale))
        .collect();
    let mut parts = GpuPartials::new(&gpu, q_heads, dim).unwrap();
    parts.upload(&theirs.iter().map(|w| w.p.clone()).collect::<Vec<_>>()).unwrap();
    let mut out = GpuPartials::new(&gpu, q_heads, dim).unwrap();
    window.merge(Some(&parts), &mut out).unwrap();
    let merged = out.download().unwrap();
    let ours = host.reference(&q, scale);
    let want: Vec<Want> = ours.iter().zip(&theirs).map(|(a, b)| Want::merge(&[a.clone(), b.clone()])).collect();
    check_all(&merged, &want, "window ⊕ retrieved");
    // The same splits merge again, alone: the window's partial.
    window.merge(None, &mut out).unwrap();
    check_all(&out.download().unwrap(), &ours, "window alone");
    // The merge of everything is exact attention over the union.
    for (h, m) in merged.iter().enumerate() {
        let kv = h / group;
        let all_keys = [&host.keys[kv][..], &other_keys[kv][..]].concat();
        let all_values = [&host.values[kv][..], &other_values[kv][..]].concat();
        check(m, &Want::attend(&q[h * dim..(h + 1) * dim], &all_keys, &all_values, scale), &format!("union, head {h}"));
    }
}

#[test]
fn a_captured_graph_replays_the_launches() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(6);
    let (q_heads, kv_heads, dim, len) = (32, 8, 128, 640);
    let keys = rng.halves(kv_heads * len * dim, |r| r.f32() * 2.0);
    let values = rng.halves(kv_heads * len * dim, |r| r.f32() * 4.0);
    let (mut window, host) = loaded(&gpu, q_heads, (kv_heads, dim, len), &keys, &values);
    let scale = 1.0 / (dim as f32).sqrt();
    let mut queries = GpuQueries::new(&gpu, q_heads, dim).unwrap();
    let mut out = GpuPartials::new(&gpu, q_heads, dim).unwrap();
    // Attend once outside the capture: it sizes the split buffers (no allocation is captured).
    window.attend(&queries, scale).unwrap();
    let graph = gpu
        .capture(|| {
            window.attend(&queries, scale)?;
            window.merge(None, &mut out)
        })
        .unwrap();
    // The fused launch too: each replay's last blocks find their counters back at 0.
    let mut fused_out = GpuPartials::new(&gpu, q_heads, dim).unwrap();
    let fused = gpu.capture(|| window.attend_merged(&queries, scale, None, &mut fused_out)).unwrap();
    for round in 0..3 {
        let q: Vec<f32> = (0..q_heads * dim).map(|_| rng.f32()).collect();
        queries.upload(&q).unwrap();
        let elapsed = gpu.time(|| graph.launch()).unwrap();
        assert!(elapsed.as_secs_f64() > 0.0);
        let want = host.reference(&q, scale);
        check_all(&out.download().unwrap(), &want, &format!("replay {round}"));
        fused.launch().unwrap();
        check_all(&fused_out.download().unwrap(), &want, &format!("fused replay {round}"));
    }
    // A window that grows moves its buffers: the graph refuses to replay.
    let more = rng.halves(kv_heads * len * dim, |r| r.f32());
    window.append(&more, &more).unwrap();
    assert!(graph.launch().is_err(), "replay after the window moved");
    // Capturing a first attend (it would allocate its scratch) fails, and leaves the stream usable.
    let mut fresh = GpuWindow::new(&gpu, q_heads, kv_heads, dim, len).unwrap();
    fresh.load(&keys, &values).unwrap();
    assert!(gpu.capture(|| fresh.attend(&queries, scale)).is_err(), "allocation while capturing");
    let q: Vec<f32> = (0..q_heads * dim).map(|_| rng.f32()).collect();
    check_all(&fresh.attention(&q, scale, None).unwrap(), &host.reference(&q, scale), "after a failed capture");
}

#[test]
fn windows_made_used_and_dropped_on_fresh_threads_work() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(7);
    let (q_heads, kv_heads, dim, len) = (8, 2, 64, 100);
    let keys = rng.halves(kv_heads * len * dim, |r| r.f32() * 2.0);
    let values = rng.halves(kv_heads * len * dim, |r| r.f32() * 4.0);
    let q: Vec<f32> = (0..q_heads * dim).map(|_| rng.f32()).collect();
    let scale = 1.0 / (dim as f32).sqrt();
    for round in 0..3 {
        let (mut window, host) = loaded(&gpu, q_heads, (kv_heads, dim, len), &keys, &values);
        check_all(&window.attention(&q, scale, None).unwrap(), &host.reference(&q, scale), "before");
        // Freed by a thread that never used CUDA: no error is left for the next call.
        std::thread::spawn(move || drop(window)).join().unwrap();
        let (mut next, _) = loaded(&gpu, q_heads, (kv_heads, dim, len), &keys, &values);
        check_all(&next.attention(&q, scale, None).unwrap(), &host.reference(&q, scale), &format!("after {round}"));
        // Made and used by a thread that never used CUDA (a session's worker, say).
        std::thread::scope(|s| {
            s.spawn(|| {
                let (mut fresh, _) = loaded(&gpu, q_heads, (kv_heads, dim, len), &keys, &values);
                let got = fresh.attention(&q, scale, None).unwrap();
                check_all(&got, &host.reference(&q, scale), &format!("on a fresh thread, {round}"));
            });
        });
    }
}

#[test]
fn misuse_is_an_error_not_a_crash() {
    let Some(gpu) = gpu() else { return };
    assert!(GpuWindow::new(&gpu, 8, 2, 72, 16).is_err(), "head dim without a kernel");
    assert!(GpuWindow::new(&gpu, 6, 4, 128, 16).is_err(), "q heads not a multiple of kv heads");
    let mut window = GpuWindow::new(&gpu, 8, 2, 64, 16).unwrap();
    let row = vec![f16::ZERO; 2 * 64];
    assert!(window.load(&row[..100], &row[..100]).is_err(), "partial rows");
    assert!(window.append(&row, &row[..64]).is_err(), "keys and values differ");
    let mut out = GpuPartials::new(&gpu, 8, 64).unwrap();
    assert!(window.merge(None, &mut out).is_err(), "merge before attend");
    let queries = GpuQueries::new(&gpu, 8, 64).unwrap();
    window.append(&row, &row).unwrap();
    window.attend(&queries, 1.0).unwrap();
    window.append(&row, &row).unwrap();
    assert!(window.merge(None, &mut out).is_err(), "merge after the window changed");
    assert!(window.attention(&[0.0; 10], 1.0, None).is_err(), "queries of the wrong size");
    assert!(window.attention(&[0.0; 8 * 64], 1.0, Some(&[Partial::empty(64)])).is_err(), "too few host partials");
    let mut wrong = GpuPartials::new(&gpu, 8, 128).unwrap();
    window.attend(&queries, 1.0).unwrap();
    assert!(window.merge(None, &mut wrong).is_err(), "output of another shape");
    let other = Gpu::open().unwrap();
    let mut foreign = GpuPartials::new(&other, 8, 64).unwrap();
    assert!(window.merge(None, &mut foreign).is_err(), "another Gpu's buffer");
    // After all that, the window still works.
    let got = window.attention(&[0.5; 8 * 64], 1.0, None).unwrap();
    assert!(got.iter().all(|p| p.l == 2.0 && p.o.iter().all(|&x| x == 0.0)), "two zero tokens: l = 2, o = 0");
}

/// The kNN's reference: each score a chain of fused multiply-adds over the dimensions in
/// order from +0 (the GPU's arithmetic), the best `k` by `total_cmp`, the lower id first among
/// equal scores.
fn knn_reference(keys: &[f16], dim: usize, q: &[f32], k: usize) -> Vec<u32> {
    let mut ranked: Vec<(f32, u32)> = keys
        .chunks_exact(dim)
        .enumerate()
        .map(|(id, key)| (q.iter().zip(key).fold(0.0f32, |acc, (x, y)| x.mul_add(y.to_f32(), acc)), id as u32))
        .collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    ranked.into_iter().take(k).map(|(_, id)| id).collect()
}

/// The GPU kNN returns exactly the reference's ids in its order: sizes off the kernels' tiles,
/// k above the key count, every head dim, and keys repeated many times over, so that the k-th
/// score is tied across many ids and only the lowest of them may be taken.
#[test]
fn knn_matches_the_reference_with_ties_and_extreme_values() {
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(0x6b6e_6e00);
    for (n, dim, m, k) in [
        (1, 64, 1, 10),
        (50, 64, 3, 100),
        (777, 80, 65, 100),
        (4099, 128, 130, 100),
        (2000, 96, 9, 2000),
        (513, 256, 64, 7),
    ] {
        let mut keys = rng.halves(n * dim, |r| r.wild(3000.0, 1e-6));
        // Every 5th key repeats key 3: many ids share its score for every query.
        for id in (8..n).step_by(5) {
            keys.copy_within(3 * dim..4 * dim, id * dim);
        }
        let queries: Vec<f32> = (0..m * dim).map(|_| rng.wild(50.0, 1e-4)).collect();
        let got = gpu.knn(&keys, dim, &queries, k).unwrap();
        assert_eq!(got.len(), m);
        for (qi, (q, ids)) in queries.chunks_exact(dim).zip(&got).enumerate() {
            assert_eq!(ids, &knn_reference(&keys, dim, q, k), "n {n}, dim {dim}, query {qi}");
        }
    }
    assert!(gpu.knn(&[f16::ZERO; 10], 3, &[0.0; 3], 1).is_err(), "keys that are not rows of dim");
    assert_eq!(gpu.knn(&[], 4, &[0.0; 8], 5).unwrap(), vec![Vec::<u32>::new(); 2]);
}

/// Codes laid out as a stored PQ run: blocks of `per_block` tokens, each subspace-major.
fn blocked_codes(token_major: &[u8], m: usize, per_block: usize) -> Vec<u8> {
    let tokens = token_major.len() / m;
    let mut out = Vec::with_capacity(token_major.len());
    for first in (0..tokens).step_by(per_block) {
        let r = per_block.min(tokens - first);
        for j in 0..m {
            out.extend((first..first + r).map(|t| token_major[t * m + j]));
        }
    }
    out
}

/// The device scan of codes gives the CPU scan's scores bit for bit: tables of extreme ranges,
/// partial last blocks, one-token blocks, scans of a prefix, and every subspace count the
/// device takes; misuse is refused.
#[test]
fn pq_scan_matches_the_cpu_bit_for_bit() {
    use ctxfs_kernels::gpu::{PqScanner, MAX_GPU_SUBSPACES};
    use ctxfs_kernels::{pq_scores, PqLut};
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(0x7071_0000);
    // One scanner for all the cases: its buffers grow where a scan needs more.
    let mut scanner = PqScanner::new(&gpu).unwrap();
    for (tokens, m, per_block, queries, lim) in [
        (1, 1, 1, 1, 1),
        (1000, 32, 127, 4, 1000),
        (1000, 32, 127, 4, 333),
        (4097, 16, 255, 3, 4097),
        (300, 64, 1, 2, 299),
        (700, MAX_GPU_SUBSPACES, 63, 1, 700),
    ] {
        let token_major: Vec<u8> = (0..tokens * m).map(|_| (rng.next() % 256) as u8).collect();
        let bytes = blocked_codes(&token_major, m, per_block);
        let luts: Vec<PqLut> = (0..queries)
            .map(|_| {
                let tables: Vec<f32> = (0..m * 256).map(|_| rng.wild(1e4, 1e-3)).collect();
                PqLut::quantise(&tables, 256)
            })
            .collect();
        let mut want = vec![0.0f32; queries * lim];
        for (lut, out) in luts.iter().zip(want.chunks_exact_mut(lim.max(1))) {
            // The CPU scans one stored block at a time, as the index does.
            for first in (0..lim).step_by(per_block) {
                let r = per_block.min(tokens - first);
                let block = &bytes[first * m..(first + r) * m];
                let upto = (first + r).min(lim);
                pq_scores(lut, block, r, 0, &mut out[first..upto]);
            }
        }
        let codes = gpu.codes(&bytes, tokens, per_block, m).unwrap();
        assert_eq!(codes.device_bytes(), tokens * m);
        let mut got = vec![f32::NAN; queries * lim];
        scanner.scan(&codes, &luts, lim, &mut got).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&want), "{tokens} tokens, m {m}, blocks of {per_block}, lim {lim}");
    }
    let codes = gpu.codes(&[7; 40], 10, 3, 4).unwrap();
    let lut = PqLut::quantise(&[1.0; 4 * 256], 256);
    assert!(scanner.scan(&codes, std::slice::from_ref(&lut), 11, &mut [0.0; 11]).is_err(), "beyond the tokens");
    assert!(scanner.scan(&codes, std::slice::from_ref(&lut), 10, &mut [0.0; 9]).is_err(), "a short output");
    let other = PqLut::quantise(&[1.0; 2 * 256], 256);
    assert!(scanner.scan(&codes, &[other], 10, &mut [0.0; 10]).is_err(), "tables of other subspaces");
    assert!(gpu.codes(&[0; 39], 10, 3, 4).is_err(), "bytes that are not the tokens' codes");
    assert!(gpu.codes(&[0; 10 * 193], 10, 3, MAX_GPU_SUBSPACES + 1).is_err(), "tables beyond shared memory");
    // Codes uploaded through another Gpu (stream) of the device scan the same.
    let mut want = vec![0.0; 10];
    pq_scores(&lut, &[7; 40], 10, 0, &mut want);
    let mut got = vec![0.0; 10];
    PqScanner::new(&Gpu::open().unwrap()).unwrap().scan(&codes, &[lut], 10, &mut got).unwrap();
    assert_eq!(got, want);
}

/// A scan that keeps its scores on the device: the sample is every `stride`-th of the scores
/// `scan` gives, and the tokens reaching a cut are exactly those whose score reaches it (in
/// total order), their count exact even when only `cap` fit; misuse is refused.
#[test]
fn pq_samples_and_reaching_tokens_are_those_of_the_scores() {
    use ctxfs_kernels::gpu::PqScanner;
    use ctxfs_kernels::PqLut;
    let Some(gpu) = gpu() else { return };
    let mut rng = Rng(0x7071_0001);
    let mut scanner = PqScanner::new(&gpu).unwrap();
    assert!(scanner.reaching(&[0.0], 4).is_err(), "no scan's scores on the device");
    for (tokens, m, per_block, queries, lim, stride) in [
        (5000, 32, 127, 4, 5000, 96),
        (5000, 32, 127, 4, 1234, 96),
        (3000, 16, 255, 3, 3000, 1),
        (40, 8, 7, 2, 40, 100),
    ] {
        let token_major: Vec<u8> = (0..tokens * m).map(|_| (rng.next() % 256) as u8).collect();
        let bytes = blocked_codes(&token_major, m, per_block);
        // Few table values, so that many scores tie (at the cut too).
        let luts: Vec<PqLut> = (0..queries)
            .map(|_| PqLut::quantise(&(0..m * 256).map(|_| (rng.next() % 4) as f32).collect::<Vec<_>>(), 256))
            .collect();
        let codes = gpu.codes(&bytes, tokens, per_block, m).unwrap();
        let mut all = vec![0.0f32; queries * lim];
        scanner.scan(&codes, &luts, lim, &mut all).unwrap();
        let samples = scanner.scan_sampled(&codes, &luts, lim, stride).unwrap();
        let want: Vec<f32> = all.chunks_exact(lim).flat_map(|q| q.iter().step_by(stride).copied()).collect();
        assert_eq!(samples, want, "{tokens} tokens, lim {lim}, every {stride}th");
        // The kept scores are those of the scan: read back whole, they are the same.
        let mut again = vec![0.0f32; queries * lim];
        scanner.read_scores(&mut again).unwrap();
        assert_eq!(again, all);
        for cap in [usize::MAX >> 40, 10] {
            let cuts: Vec<f32> = all.chunks_exact(lim).map(|q| q[lim / 3]).collect();
            let reached = scanner.reaching(&cuts, cap.min(lim)).unwrap();
            assert_eq!(reached.len(), queries);
            for ((r, q), cut) in reached.iter().zip(all.chunks_exact(lim)).zip(&cuts) {
                let mut expect: Vec<(u32, f32)> =
                    (0..lim as u32).map(|t| (t, q[t as usize])).filter(|p| p.1.total_cmp(cut).is_ge()).collect();
                assert_eq!(r.count, expect.len(), "lim {lim}, cap {cap}");
                assert_eq!(r.tokens.len(), expect.len().min(cap.min(lim)));
                let mut got = r.tokens.clone();
                got.sort_by_key(|p| p.0);
                if got.len() == expect.len() {
                    assert_eq!(got, expect);
                } else {
                    expect.retain(|p| got.binary_search_by_key(&p.0, |g| g.0).is_ok());
                    assert_eq!(got, expect, "the tokens that fit are reaching ones, with their scores");
                }
            }
        }
    }
    let codes = gpu.codes(&[7; 40], 10, 3, 4).unwrap();
    let lut = PqLut::quantise(&[1.0; 4 * 256], 256);
    assert!(scanner.scan_sampled(&codes, std::slice::from_ref(&lut), 10, 0).is_err(), "a stride of 0");
    scanner.scan_sampled(&codes, std::slice::from_ref(&lut), 10, 3).unwrap();
    assert!(scanner.reaching(&[0.0, 0.0], 4).is_err(), "cuts for more queries than scanned");
    assert!(scanner.read_scores(&mut [0.0; 9]).is_err(), "a short output");
    // Nothing below the prefix: no samples, nothing reaches.
    assert!(scanner.scan_sampled(&codes, std::slice::from_ref(&lut), 0, 3).unwrap().is_empty());
    assert_eq!(scanner.reaching(&[f32::NEG_INFINITY], 4).unwrap()[0].count, 0);
}
