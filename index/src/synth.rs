//! A synthetic KV generator that looks like real attention (DESIGN.md "Measuring quality"),
//! one (layer, kv head) at a time so a book-scale context streams.
//!
//! What it reproduces, and how:
//! * **passages and locality**: tokens come in passages of 64–512 tokens; a passage's keys
//!   share a topic vector, so neighbouring tokens are alike and critical tokens cluster;
//! * **attention sinks**: the first [`SINKS`] tokens carry a sink direction that every query
//!   leans towards;
//! * **outlier channels**: a few key channels carry a large offset, as in real models;
//! * **out-of-distribution queries**: a query is a head bias in directions where keys barely
//!   vary, plus a pull towards a few target passages, plus noise, so queries sit far from the
//!   key distribution (the Mahalanobis ratio [`stats`] reports);
//! * **sparsity varying by head**: each head draws how far its target passages score above
//!   the background ([`SHARPNESS`]): at 128K tokens sharp heads need tens of tokens for 90%
//!   of the attention mass, diffuse heads tens of thousands, as AlayaDB measured;
//! * **decode queries** target passages that drift slowly from step to step, so critical
//!   tokens repeat between consecutive steps.

use ctxfs_vfs::SplitMix64;
use half::f16;

/// Tokens at the start that act as attention sinks.
pub const SINKS: usize = 4;

#[derive(Debug, Clone)]
pub struct SynthParams {
    pub tokens: usize,
    pub head_dim: usize,
    /// q heads sharing each kv head (GQA group size).
    pub group: usize,
    pub seed: u64,
}

/// Keys, values and queries of one (layer, kv head).
pub struct HeadData {
    /// `tokens × head_dim`.
    pub keys: Vec<f16>,
    pub values: Vec<f16>,
    /// Per q head of the group, `n × head_dim` prefill queries.
    pub prefill: Vec<Vec<f32>>,
    /// Per q head of the group, `n × head_dim` decode queries at consecutive steps.
    pub decode: Vec<Vec<f32>>,
    /// How far target passages score above the background (q·k/√d units).
    pub sharpness: f32,
}

/// Uniform and normal draws on vfs's SplitMix64.
pub struct Rng(SplitMix64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(SplitMix64::new(seed ^ 0x5DEE_CE66_D1CE_4E5B))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    pub fn normal(&mut self) -> f32 {
        (-2.0 * self.uniform().ln()).sqrt() * (std::f32::consts::TAU * self.uniform()).cos()
    }
    fn gaussian(&mut self, d: usize, sigma: f32) -> Vec<f32> {
        (0..d).map(|_| self.normal() * sigma).collect()
    }
}

/// Passage boundaries: starts of passages of 64..=512 tokens after the sinks.
fn passages(tokens: usize, rng: &mut Rng) -> Vec<usize> {
    let mut starts = vec![0];
    let mut at = SINKS.min(tokens);
    while at < tokens {
        starts.push(at);
        at += 64 + rng.below(449);
    }
    starts
}

/// Adds to `q` the multiple of `dir` that raises the score `q·k/√d` of a key equal to `dir`
/// by `lift`.
fn lean(q: &mut [f32], dir: &[f32], lift: f32) {
    let norm2: f32 = dir.iter().map(|x| x * x).sum::<f32>().max(1e-6);
    let c = lift * (q.len() as f32).sqrt() / norm2;
    q.iter_mut().zip(dir).for_each(|(a, x)| *a += c * x);
}

/// A query: the head's bias, a lean towards the sinks, a lean of `lift` towards each target
/// passage's topic, and noise.
fn query(bias: &[f32], sink_key: &[f32], targets: &[&Vec<f32>], lift: f32, rng: &mut Rng) -> Vec<f32> {
    let mut q: Vec<f32> = bias.iter().map(|b| b + 0.6 * rng.normal()).collect();
    lean(&mut q, sink_key, SINK_LIFT + 0.4 * lift);
    for t in targets {
        lean(&mut q, t, lift);
    }
    q
}

/// How far above the background the sink tokens score (in units of q·k/√d), plus 0.4 of the
/// head's target lift: sinks stay strong in sharp heads too.
const SINK_LIFT: f32 = 5.0;

/// How far a head's target passages score above the background (q·k/√d units), drawn
/// log-uniform in this range. Calibrated on AlayaDB Fig. 5 (Llama-3-8B at ~128K tokens: from
/// ~50 to ~43,000 tokens hold 90% of a head's attention): at 131,072 tokens, 4.5 needs ~43,000
/// tokens and 20 needs ~40. At 16K tokens the same heads need ~10 to ~1,400.
pub const SHARPNESS: (f32, f32) = (4.5, 20.0);

/// Generates one (layer, kv head): `prefill` and `decode` queries per q head.
pub fn head(p: &SynthParams, layer: usize, kv_head: usize, prefill: usize, decode: usize) -> HeadData {
    let d = p.head_dim;
    let mut rng = Rng::new(p.seed.wrapping_mul(1_000_003) ^ ((layer as u64) << 32) ^ kv_head as u64);
    // Keys vary mostly in the first half of the channels; the query bias lives in the second.
    let key_sigma: Vec<f32> = (0..d).map(|i| if i < d / 2 { 1.0 } else { 0.15 }).collect();
    let mut outlier = vec![0.0f32; d];
    for _ in 0..3 {
        outlier[rng.below(d / 2)] = 6.0 * if rng.uniform() < 0.5 { 1.0 } else { -1.0 };
    }
    let sink: Vec<f32> = (0..d).map(|i| if i < d / 2 { rng.normal() * 2.5 } else { 0.0 }).collect();
    let starts = passages(p.tokens, &mut rng);
    let topics: Vec<Vec<f32>> =
        starts.iter().map(|_| (0..d).map(|i| rng.normal() * 1.2 * key_sigma[i]).collect()).collect();
    let value_topics: Vec<Vec<f32>> = starts.iter().map(|_| rng.gaussian(d, 1.0)).collect();
    let (lo, hi) = SHARPNESS;
    let lift = lo * (rng.uniform() * (hi / lo).ln()).exp();
    let sink_key: Vec<f32> = sink.iter().map(|x| x * 1.6).collect();

    let mut keys = Vec::with_capacity(p.tokens * d);
    let mut values = Vec::with_capacity(p.tokens * d);
    let mut passage = 0;
    for t in 0..p.tokens {
        while passage + 1 < starts.len() && starts[passage + 1] <= t {
            passage += 1;
        }
        let is_sink = t < SINKS;
        for i in 0..d {
            let base = if is_sink { sink[i] * 1.6 } else { topics[passage][i] };
            keys.push(f16::from_f32(base + outlier[i] + 0.7 * key_sigma[i] * rng.normal()));
            values.push(f16::from_f32(value_topics[passage][i] * 0.8 + 0.6 * rng.normal()));
        }
    }

    let mut prefill_q = Vec::with_capacity(p.group);
    let mut decode_q = Vec::with_capacity(p.group);
    for _ in 0..p.group {
        let bias: Vec<f32> = (0..d).map(|i| if i < d / 2 { 0.0 } else { rng.normal() * 3.0 }).collect();
        let pick = |rng: &mut Rng| {
            if starts.len() > 1 {
                1 + rng.below(starts.len() - 1)
            } else {
                0
            }
        };
        let mut pre = Vec::with_capacity(prefill * d);
        for _ in 0..prefill {
            let targets: Vec<&Vec<f32>> = (0..1 + rng.below(3)).map(|_| &topics[pick(&mut rng)]).collect();
            pre.extend(query(&bias, &sink_key, &targets, lift, &mut rng));
        }
        // Decode steps: a working set of 2–3 passages, one of which changes now and then.
        let mut working: Vec<usize> = (0..2 + rng.below(2)).map(|_| pick(&mut rng)).collect();
        let mut dec = Vec::with_capacity(decode * d);
        for _ in 0..decode {
            if rng.uniform() < 0.15 {
                let slot = rng.below(working.len());
                working[slot] = pick(&mut rng);
            }
            let targets: Vec<&Vec<f32>> = working.iter().map(|&w| &topics[w]).collect();
            dec.extend(query(&bias, &sink_key, &targets, lift, &mut rng));
        }
        prefill_q.push(pre);
        decode_q.push(dec);
    }
    HeadData { keys, values, prefill: prefill_q, decode: decode_q, sharpness: lift }
}

/// What the generator achieved, measured rather than assumed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HeadStats {
    /// Mean Mahalanobis distance of queries to the key distribution, over that of keys.
    pub mahalanobis_ratio: f64,
    /// Median over decode queries of the tokens needed to hold 90% of the attention mass.
    pub tokens_for_90: usize,
    /// Share of the attention mass on the sink tokens, averaged over decode queries.
    pub sink_mass: f64,
    /// A sink token's weight over an average token's (sink mass per sink × tokens).
    pub sink_lift: f64,
}

/// Measures a head: Mahalanobis ratio from a sample of keys, and attention concentration
/// for (up to) the first 16 decode queries of the first q head.
pub fn stats(h: &HeadData, head_dim: usize) -> HeadStats {
    let d = head_dim;
    let n = h.keys.len() / d;
    let sample: Vec<usize> = (0..n).step_by((n / 4096).max(1)).collect();
    let rows: Vec<Vec<f64>> =
        sample.iter().map(|&t| h.keys[t * d..(t + 1) * d].iter().map(|x| x.to_f64()).collect()).collect();
    let mean: Vec<f64> = (0..d).map(|i| rows.iter().map(|r| r[i]).sum::<f64>() / rows.len() as f64).collect();
    let mut cov = vec![0.0f64; d * d];
    for r in &rows {
        for i in 0..d {
            for j in 0..=i {
                cov[i * d + j] += (r[i] - mean[i]) * (r[j] - mean[j]);
            }
        }
    }
    for i in 0..d {
        for j in 0..=i {
            let v = cov[i * d + j] / rows.len() as f64 + if i == j { 1e-3 } else { 0.0 };
            cov[i * d + j] = v;
            cov[j * d + i] = v;
        }
    }
    let chol = cholesky(&cov, d);
    let mdist = |x: &[f64]| -> f64 {
        // Solve L y = x - mean; distance = |y|.
        let mut y = vec![0.0; d];
        for i in 0..d {
            let s: f64 = (0..i).map(|k| chol[i * d + k] * y[k]).sum();
            y[i] = (x[i] - mean[i] - s) / chol[i * d + i];
        }
        y.iter().map(|v| v * v).sum::<f64>().sqrt()
    };
    let key_dist = rows.iter().map(|r| mdist(r)).sum::<f64>() / rows.len() as f64;
    let queries: Vec<&[f32]> = h.decode[0].chunks(d).take(16).collect();
    let query_dist = queries.iter().map(|q| mdist(&q.iter().map(|&x| x as f64).collect::<Vec<_>>())).sum::<f64>()
        / queries.len().max(1) as f64;

    let scale = 1.0 / (d as f32).sqrt();
    let mut needed = Vec::new();
    let mut sink_mass = 0.0;
    let mut z = vec![0.0f32; n];
    for q in &queries {
        ctxfs_kernels::scores(&h.keys, q, scale, &mut z);
        let m = ctxfs_kernels::max(&z);
        let l = ctxfs_kernels::exp_sub(&mut z, m);
        sink_mass += z[..SINKS.min(n)].iter().sum::<f32>() as f64 / l as f64;
        let mut w = z.clone();
        w.sort_by(|a, b| b.total_cmp(a));
        let mut acc = 0.0;
        let count = w.iter().take_while(|&&x| {
            let before = acc;
            acc += x;
            before < 0.9 * l
        });
        needed.push(count.count());
    }
    needed.sort_unstable();
    HeadStats {
        mahalanobis_ratio: query_dist / key_dist,
        tokens_for_90: needed.get(needed.len() / 2).copied().unwrap_or(0),
        sink_mass: sink_mass / queries.len().max(1) as f64,
        sink_lift: sink_mass / queries.len().max(1) as f64 / SINKS.min(n) as f64 * n as f64,
    }
}

/// Lower-triangular Cholesky factor of a symmetric positive definite `d × d` matrix.
fn cholesky(a: &[f64], d: usize) -> Vec<f64> {
    let mut l = vec![0.0; d * d];
    for i in 0..d {
        for j in 0..=i {
            let s: f64 = (0..j).map(|k| l[i * d + k] * l[j * d + k]).sum();
            if i == j {
                l[i * d + i] = (a[i * d + i] - s).max(1e-12).sqrt();
            } else {
                l[i * d + j] = (a[i * d + j] - s) / l[j * d + j];
            }
        }
    }
    l
}
