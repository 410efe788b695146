//! ctxfs-kernels: the CPU kernels every scoring and attention loop in ctxfs goes through.
//!
//! * [`dot`]: f16/bf16/f32 × f32 dot products;
//! * [`scores`]: q·K over a block of keys, scaled;
//! * [`max`] and [`exp_sub`]: the scaled exp-sum with a running max;
//! * [`weighted_sum`]: weighted value accumulation, and [`argmax_weighted_sum`], where its
//!   largest sum is;
//! * [`Partial`]: attention over a set of keys as (o, m, l), and the exact log-sum-exp merge;
//! * [`pq_scores`]: product-quantisation codes scored from byte-quantised tables ([`PqLut`]).
//!
//! Each kernel has an AVX-512F path and an AVX2+FMA+F16C path (x86-64, chosen at run time by
//! CPU detection), a NEON path (aarch64, where NEON is baseline) and a scalar reference.
//! `CTXFS_KERNELS=scalar|neon|avx2|avx512` lowers the choice (it never picks a path the CPU
//! lacks). On other architectures the scalar path runs.
//!
//! [`gpu`] runs a session's window attention and the merge on a CUDA device when one is there
//! (libcuda and NVRTC are loaded at run time; without them [`gpu::Gpu::open`] says why and the
//! CPU path serves).
//!
//! A leaf of the workspace: it depends on no other ctxfs crate (`docs/architecture.md`).

mod argmax;
mod element;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod expf;
pub mod gpu;
#[cfg(target_arch = "aarch64")]
mod neon;
mod partial;
mod pq;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use argmax::{argmax_weighted_sum, argmax_weighted_sum_on};
pub use element::{Element, ElementKind};
pub use partial::Partial;
pub use pq::{
    pq_reaching, pq_reaching_on, pq_scores, pq_scores_on, pq_table, pq_table_on, CodeRun, PqLut, Reached, SumCut,
    PQ_TABLE, REACH_QUERIES, SHORT_REACH_TOKENS,
};

use std::sync::OnceLock;

/// An instruction set the kernels can run on, from least to most capable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Scalar,
    /// aarch64's baseline SIMD.
    Neon,
    Avx2,
    Avx512,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Neon => "neon",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// The best instruction set this CPU supports.
pub fn detected() -> Isa {
    static DETECTED: OnceLock<Isa> = OnceLock::new();
    *DETECTED.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f") {
                return Isa::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c") {
                return Isa::Avx2;
            }
        }
        if cfg!(target_arch = "aarch64") {
            return Isa::Neon;
        }
        Isa::Scalar
    })
}

/// The instruction set the kernels use: [`detected`], lowered by `CTXFS_KERNELS`.
pub fn active() -> Isa {
    static ACTIVE: OnceLock<Isa> = OnceLock::new();
    *ACTIVE.get_or_init(|| {
        let asked = std::env::var("CTXFS_KERNELS").map(|v| v.to_ascii_lowercase());
        let wanted = match asked.as_deref() {
            Ok("scalar") => Isa::Scalar,
            Ok("neon") => Isa::Neon,
            Ok("avx2") => Isa::Avx2,
            Ok("avx512") | Ok("") | Err(_) => Isa::Avx512,
            Ok(other) => {
                // Said once, where a typo would otherwise go unnoticed in every figure.
                eprintln!("ctxfs: CTXFS_KERNELS={other:?} is none of scalar, neon, avx2, avx512: the best this CPU runs is used");
                Isa::Avx512
            }
        };
        usable(wanted)
    })
}

/// Every instruction set this CPU can run, for tests and benchmarks that compare them.
pub fn available() -> Vec<Isa> {
    let native: &[Isa] = if cfg!(target_arch = "aarch64") { &[Isa::Neon] } else { &[Isa::Avx2, Isa::Avx512] };
    std::iter::once(Isa::Scalar).chain(native.iter().copied()).filter(|&i| i <= detected()).collect()
}

/// Runs `$body` with `$xs` bound to `$x` as a slice of the concrete element type.
macro_rules! by_element {
    ($E:ty, $x:expr, |$xs:ident| $body:expr) => {
        match <$E as Element>::KIND {
            ElementKind::F16 => {
                let $xs: &[half::f16] = bytemuck::cast_slice($x);
                $body
            }
            ElementKind::Bf16 => {
                let $xs: &[half::bf16] = bytemuck::cast_slice($x);
                $body
            }
            ElementKind::F32 => {
                let $xs: &[f32] = bytemuck::cast_slice($x);
                $body
            }
        }
    };
}

/// `isa` if this CPU has it, else the best it has (NEON and the x86 sets exclude each other).
fn usable(isa: Isa) -> Isa {
    let best = detected();
    match isa {
        Isa::Neon if best != Isa::Neon => Isa::Scalar,
        wanted if wanted <= best => wanted,
        _ => best,
    }
}

/// Σ x_i q_i.
pub fn dot<E: Element>(x: &[E], q: &[f32]) -> f32 {
    dot_on(active(), x, q)
}

pub fn dot_on<E: Element>(isa: Isa, x: &[E], q: &[f32]) -> f32 {
    assert_eq!(x.len(), q.len(), "dot product of {} and {} elements", x.len(), q.len());
    match usable(isa) {
        // SAFETY (both arms): `usable` never returns an instruction set the CPU lacks.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => by_element!(E, x, |xs| unsafe { x86::avx512::dot(xs, q) }),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => by_element!(E, x, |xs| unsafe { x86::avx2::dot(xs, q) }),
        // SAFETY: NEON is aarch64's baseline; the lengths are checked above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => by_element!(E, x, |xs| unsafe { neon::dot(xs, q) }),
        _ => scalar::dot(x, q),
    }
}

/// Asks the CPU to start loading `row` into its caches, without waiting for it. A search
/// that scores scattered rows issues this a few rows ahead of the one it scores: the cache
/// misses, which dominate such a search, then overlap instead of following one another.
/// Only a hint: on targets without a prefetch instruction in stable Rust (aarch64) it does
/// nothing.
#[inline]
pub fn prefetch<T>(row: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for line in row.chunks((64 / std::mem::size_of::<T>().max(1)).max(1)) {
        // SAFETY: SSE is part of the x86-64 baseline, and a prefetch never faults (the
        // address, inside `row`, is only a hint).
        unsafe { core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// `out[i] = scale · (q · key_i)` for the keys stored row after row in `keys`.
pub fn scores<E: Element>(keys: &[E], q: &[f32], scale: f32, out: &mut [f32]) {
    scores_on(active(), keys, q, scale, out)
}

pub fn scores_on<E: Element>(isa: Isa, keys: &[E], q: &[f32], scale: f32, out: &mut [f32]) {
    assert_eq!(
        keys.len(),
        out.len() * q.len(),
        "{} key elements for {} scores of dimension {}",
        keys.len(),
        out.len(),
        q.len()
    );
    if q.is_empty() {
        out.fill(0.0);
        return;
    }
    match usable(isa) {
        // SAFETY (both arms): `usable` never returns an instruction set the CPU lacks.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => by_element!(E, keys, |ks| unsafe { x86::avx512::scores(ks, q, scale, out) }),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => by_element!(E, keys, |ks| unsafe { x86::avx2::scores(ks, q, scale, out) }),
        // SAFETY: NEON is aarch64's baseline; the lengths are checked above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => by_element!(E, keys, |ks| unsafe { neon::scores(ks, q, scale, out) }),
        _ => scalar::scores(keys, q, scale, out),
    }
}

/// `out[t · stride + i] = queries_t · key_i` for the keys stored row after row in `keys` and
/// `m` queries (rows of `q_dim`): a flat scan of one GQA group's q heads. Each key is widened
/// once for up to four queries, and each score equals [`dot`]`(key_i, queries_t)` to the bit.
pub fn scores_many<E: Element>(keys: &[E], queries: &[f32], q_dim: usize, out: &mut [f32], stride: usize) {
    scores_many_on(active(), keys, queries, q_dim, out, stride)
}

pub fn scores_many_on<E: Element>(isa: Isa, keys: &[E], queries: &[f32], q_dim: usize, out: &mut [f32], stride: usize) {
    assert!(q_dim > 0 && queries.len().is_multiple_of(q_dim), "{} query elements of dimension {q_dim}", queries.len());
    assert!(keys.len().is_multiple_of(q_dim), "{} key elements of dimension {q_dim}", keys.len());
    let (m, n) = (queries.len() / q_dim, keys.len() / q_dim);
    assert!(n <= stride || m == 0, "{n} scores per query in rows of {stride}");
    assert!(
        m == 0 || out.len() >= (m - 1) * stride + n,
        "{} scores for {m} queries × {n} keys, stride {stride}",
        out.len()
    );
    match usable(isa) {
        // SAFETY (all arms): `usable` never returns an instruction set the CPU lacks (NEON is
        // aarch64's baseline), and the lengths are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => by_element!(E, keys, |ks| unsafe { x86::avx512::scores_many(ks, queries, q_dim, out, stride) }),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => by_element!(E, keys, |ks| unsafe { x86::avx2::scores_many(ks, queries, q_dim, out, stride) }),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => by_element!(E, keys, |ks| unsafe { neon::scores_many(ks, queries, q_dim, out, stride) }),
        _ => scalar::scores_many(keys, queries, q_dim, out, stride),
    }
}

/// `out[i · nk + k] = queries_i · key_k` for `m` queries (rows of `d`) against `nk` keys
/// stored dimension-major: `kt[j · nk + k]` is channel `j` of key `k`. A batch of queries
/// against one transposed block of keys needs no horizontal sum per score and reads each key
/// once per four queries: the kNN of the index build.
pub fn scores_dim_major(kt: &[f32], nk: usize, queries: &[f32], out: &mut [f32]) {
    scores_dim_major_on(active(), kt, nk, queries, out)
}

pub fn scores_dim_major_on(isa: Isa, kt: &[f32], nk: usize, queries: &[f32], out: &mut [f32]) {
    assert!(nk > 0 && kt.len().is_multiple_of(nk), "{} key elements for {nk} keys", kt.len());
    let d = kt.len() / nk;
    assert!(d > 0 && queries.len().is_multiple_of(d), "{} query elements of dimension {d}", queries.len());
    assert_eq!(out.len(), queries.len() / d * nk, "{} scores for {} queries × {nk} keys", out.len(), queries.len() / d);
    match usable(isa) {
        // SAFETY (all arms): `usable` never returns an instruction set the CPU lacks (NEON is
        // aarch64's baseline), and the lengths are checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512::scores_dim_major(kt, nk, queries, d, out) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2::scores_dim_major(kt, nk, queries, d, out) },
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::scores_dim_major(kt, nk, queries, d, out) },
        _ => scalar::scores_dim_major(kt, nk, queries, d, out),
    }
}

/// The largest value, or −∞ for none.
pub fn max(z: &[f32]) -> f32 {
    max_on(active(), z)
}

pub fn max_on(isa: Isa, z: &[f32]) -> f32 {
    match usable(isa) {
        // SAFETY (both arms): `usable` never returns an instruction set the CPU lacks.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512::max(z) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2::max(z) },
        // SAFETY: NEON is aarch64's baseline.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::max(z) },
        _ => scalar::max(z),
    }
}

/// Replaces each `z_i` by `exp(z_i − m)` and returns their sum. A −∞ (a masked score)
/// becomes exactly 0. With `m` the maximum, every term is at most 1.
pub fn exp_sub(z: &mut [f32], m: f32) -> f32 {
    exp_sub_on(active(), z, m)
}

pub fn exp_sub_on(isa: Isa, z: &mut [f32], m: f32) -> f32 {
    match usable(isa) {
        // SAFETY (both arms): `usable` never returns an instruction set the CPU lacks.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512::exp_sub(z, m) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2::exp_sub(z, m) },
        // SAFETY: NEON is aarch64's baseline.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => unsafe { neon::exp_sub(z, m) },
        _ => scalar::exp_sub(z, m),
    }
}

/// `acc += Σ_i weights_i · value_i` for the values stored row after row in `values`.
pub fn weighted_sum<E: Element>(acc: &mut [f32], weights: &[f32], values: &[E]) {
    weighted_sum_on(active(), acc, weights, values)
}

pub fn weighted_sum_on<E: Element>(isa: Isa, acc: &mut [f32], weights: &[f32], values: &[E]) {
    assert_eq!(
        values.len(),
        weights.len() * acc.len(),
        "{} value elements for {} weights of dimension {}",
        values.len(),
        weights.len(),
        acc.len()
    );
    if acc.is_empty() {
        return;
    }
    match usable(isa) {
        // SAFETY (both arms): `usable` never returns an instruction set the CPU lacks.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => by_element!(E, values, |vs| unsafe { x86::avx512::weighted_sum(acc, weights, vs) }),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => by_element!(E, values, |vs| unsafe { x86::avx2::weighted_sum(acc, weights, vs) }),
        // SAFETY: NEON is aarch64's baseline; the lengths are checked above.
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => by_element!(E, values, |vs| unsafe { neon::weighted_sum(acc, weights, vs) }),
        _ => scalar::weighted_sum(acc, weights, values),
    }
}
