//! The reference kernels: plain loops, the fallback on every machine, and what the SIMD
//! kernels are tested against.

use crate::element::Element;

pub fn dot<E: Element>(x: &[E], q: &[f32]) -> f32 {
    x.iter().zip(q).map(|(a, b)| a.to_f32() * b).sum()
}

pub fn scores<E: Element>(keys: &[E], q: &[f32], scale: f32, out: &mut [f32]) {
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(q.len())) {
        *o = dot(k, q) * scale;
    }
}

pub fn scores_many<E: Element>(keys: &[E], queries: &[f32], d: usize, out: &mut [f32], stride: usize) {
    for (t, q) in queries.chunks_exact(d).enumerate() {
        for (i, k) in keys.chunks_exact(d).enumerate() {
            out[t * stride + i] = dot(k, q);
        }
    }
}

pub fn max(z: &[f32]) -> f32 {
    z.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

pub fn exp_sub(z: &mut [f32], m: f32) -> f32 {
    let mut sum = 0.0;
    for x in z {
        *x = if *x == f32::NEG_INFINITY { 0.0 } else { (*x - m).exp() };
        sum += *x;
    }
    sum
}

pub fn weighted_sum<E: Element>(acc: &mut [f32], weights: &[f32], values: &[E]) {
    for (w, v) in weights.iter().zip(values.chunks_exact(acc.len())) {
        for (a, x) in acc.iter_mut().zip(v) {
            *a += w * x.to_f32();
        }
    }
}

pub fn scores_dim_major(kt: &[f32], nk: usize, queries: &[f32], d: usize, out: &mut [f32]) {
    scores_dim_major_cols(kt, nk, queries, d, out, 0);
}

/// The scores of keys (columns) `from..nk` only: the tail the SIMD paths leave.
pub fn scores_dim_major_cols(kt: &[f32], nk: usize, queries: &[f32], d: usize, out: &mut [f32], from: usize) {
    for (q, o) in queries.chunks_exact(d).zip(out.chunks_exact_mut(nk)) {
        for (k, slot) in o.iter_mut().enumerate().skip(from) {
            *slot = q.iter().enumerate().map(|(j, x)| x * kt[j * nk + k]).sum();
        }
    }
}
