//! NEON kernels (aarch64), the counterparts of the AVX2 ones in `x86.rs`.
//!
//! NEON is part of the aarch64 baseline, so these need no runtime detection. Every function
//! is `unsafe` only because of its raw-pointer loads and stores, which stay inside the slices
//! they come from: every loop bound is checked against the slice length before a pointer is
//! formed.

use core::arch::aarch64::*;
use half::{bf16, f16};

/// Loads 4 lanes of an element type as f32.
pub(crate) trait Lanes: Copy {
    /// # Safety
    /// `p` must point at 4 readable elements.
    unsafe fn load4(p: *const Self) -> float32x4_t;
    fn to_f32(self) -> f32;
}

impl Lanes for f16 {
    // IEEE half to single by bits (the f16 NEON intrinsics are not stable in Rust): the
    // exponent and mantissa shifted into place are the single-precision number 2^-112 times
    // too small, subnormals included, so one multiply rescales them; infinities and NaNs
    // (exponent all ones) get the single-precision all-ones exponent instead.
    unsafe fn load4(p: *const Self) -> float32x4_t {
        let h = vmovl_u16(vld1_u16(p as *const u16));
        let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
        let magnitude = vandq_u32(h, vdupq_n_u32(0x7fff));
        let shifted = vshlq_n_u32::<13>(magnitude);
        let scaled =
            vreinterpretq_u32_f32(vmulq_f32(vreinterpretq_f32_u32(shifted), vdupq_n_f32(f32::from_bits(0x7780_0000))));
        let special = vcgeq_u32(magnitude, vdupq_n_u32(0x7c00));
        let bits = vbslq_u32(special, vorrq_u32(shifted, vdupq_n_u32(0x7f80_0000)), scaled);
        vreinterpretq_f32_u32(vorrq_u32(bits, sign))
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Lanes for bf16 {
    // A bf16 is the upper half of an f32: widen by a shift.
    unsafe fn load4(p: *const Self) -> float32x4_t {
        vreinterpretq_f32_u32(vshll_n_u16::<16>(vld1_u16(p as *const u16)))
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl Lanes for f32 {
    unsafe fn load4(p: *const Self) -> float32x4_t {
        vld1q_f32(p)
    }
    fn to_f32(self) -> f32 {
        self
    }
}

use crate::expf::{EXP_HI, EXP_LO, LN2_HI, LN2_LO, LOG2E, P};

/// # Safety
/// `x.len() == q.len()`.
pub unsafe fn dot<E: Lanes>(x: &[E], q: &[f32]) -> f32 {
    debug_assert_eq!(x.len(), q.len());
    let n = x.len().min(q.len());
    let (xp, qp) = (x.as_ptr(), q.as_ptr());
    let mut acc = [vdupq_n_f32(0.0); 4];
    let mut i = 0;
    while i + 16 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = vfmaq_f32(*a, E::load4(xp.add(i + 4 * k)), vld1q_f32(qp.add(i + 4 * k)));
        }
        i += 16;
    }
    while i + 4 <= n {
        acc[0] = vfmaq_f32(acc[0], E::load4(xp.add(i)), vld1q_f32(qp.add(i)));
        i += 4;
    }
    let mut s = vaddvq_f32(vaddq_f32(vaddq_f32(acc[0], acc[1]), vaddq_f32(acc[2], acc[3])));
    for j in i..n {
        s += x[j].to_f32() * q[j];
    }
    s
}

/// # Safety
/// `keys.len() == out.len() * q.len()`.
pub unsafe fn scores<E: Lanes>(keys: &[E], q: &[f32], scale: f32, out: &mut [f32]) {
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(q.len())) {
        *o = dot(k, q) * scale;
    }
}

/// [`dot`] of every key with `Q` queries (rows of `d` from `qp`) at once, the sums grouped
/// as `dot` groups them (each score equals `dot(key, query)` to the bit).
///
/// # Safety
/// `qp` points at `Q · d` readable floats, `keys.len()` is a multiple of `d`, and
/// `out[t · stride + i]` is in bounds for every query `t` and key `i`.
unsafe fn scores_of<E: Lanes, const Q: usize>(keys: &[E], qp: *const f32, d: usize, out: &mut [f32], stride: usize) {
    for (i, k) in keys.chunks_exact(d).enumerate() {
        let kp = k.as_ptr();
        let mut acc = [[vdupq_n_f32(0.0); 4]; Q];
        let mut c = 0;
        while c + 16 <= d {
            let kv = [0, 4, 8, 12].map(|o| E::load4(kp.add(c + o)));
            for (t, a) in acc.iter_mut().enumerate() {
                for (j, (a, kv)) in a.iter_mut().zip(&kv).enumerate() {
                    *a = vfmaq_f32(*a, *kv, vld1q_f32(qp.add(t * d + c + 4 * j)));
                }
            }
            c += 16;
        }
        while c + 4 <= d {
            let kv = E::load4(kp.add(c));
            for (t, a) in acc.iter_mut().enumerate() {
                a[0] = vfmaq_f32(a[0], kv, vld1q_f32(qp.add(t * d + c)));
            }
            c += 4;
        }
        for (t, a) in acc.iter().enumerate() {
            let mut s = vaddvq_f32(vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3])));
            for (j, x) in k.iter().enumerate().skip(c) {
                s += x.to_f32() * *qp.add(t * d + j);
            }
            out[t * stride + i] = s;
        }
    }
}

/// `out[t · stride + i] = queries_t · key_i`, four queries per pass over the keys.
///
/// # Safety
/// The lengths are as `crate::scores_many` checks.
pub unsafe fn scores_many<E: Lanes>(keys: &[E], queries: &[f32], d: usize, out: &mut [f32], stride: usize) {
    for (g, qs) in queries.chunks(4 * d).enumerate() {
        let (qp, o) = (qs.as_ptr(), &mut out[g * 4 * stride..]);
        match qs.len() / d {
            4 => scores_of::<E, 4>(keys, qp, d, o, stride),
            3 => scores_of::<E, 3>(keys, qp, d, o, stride),
            2 => scores_of::<E, 2>(keys, qp, d, o, stride),
            _ => scores_of::<E, 1>(keys, qp, d, o, stride),
        }
    }
}

/// # Safety
/// None beyond the module's: loads stay within `z`.
pub unsafe fn max(z: &[f32]) -> f32 {
    let mut m = vdupq_n_f32(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 4 <= z.len() {
        m = vmaxq_f32(m, vld1q_f32(z.as_ptr().add(i)));
        i += 4;
    }
    z[i..].iter().copied().fold(vmaxvq_f32(m), f32::max)
}

/// Cephes' expf, as in `x86.rs`; arguments below `EXP_LO` (−∞, a mask) give exactly 0.
unsafe fn exp(x: float32x4_t) -> float32x4_t {
    let masked = vcltq_f32(x, vdupq_n_f32(EXP_LO));
    let x = vminq_f32(vmaxq_f32(x, vdupq_n_f32(EXP_LO)), vdupq_n_f32(EXP_HI));
    let n = vrndnq_f32(vmulq_f32(x, vdupq_n_f32(LOG2E)));
    let r = vfmsq_f32(vfmsq_f32(x, n, vdupq_n_f32(LN2_HI)), n, vdupq_n_f32(LN2_LO));
    let mut y = vdupq_n_f32(P[0]);
    for c in &P[1..] {
        y = vfmaq_f32(vdupq_n_f32(*c), y, r);
    }
    y = vfmaq_f32(vaddq_f32(r, vdupq_n_f32(1.0)), y, vmulq_f32(r, r));
    let pow2 = vreinterpretq_f32_s32(vshlq_n_s32::<23>(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127))));
    vbslq_f32(masked, vdupq_n_f32(0.0), vmulq_f32(y, pow2))
}

/// # Safety
/// None beyond the module's: loads and stores stay within `z`.
pub unsafe fn exp_sub(z: &mut [f32], m: f32) -> f32 {
    let mv = vdupq_n_f32(m);
    let mut sum = vdupq_n_f32(0.0);
    let mut i = 0;
    while i + 4 <= z.len() {
        let p = z.as_mut_ptr().add(i);
        let e = exp(vsubq_f32(vld1q_f32(p), mv));
        vst1q_f32(p, e);
        sum = vaddq_f32(sum, e);
        i += 4;
    }
    vaddvq_f32(sum) + crate::scalar::exp_sub(&mut z[i..], m)
}

/// # Safety
/// `values.len() == weights.len() * acc.len()`.
pub unsafe fn weighted_sum<E: Lanes>(acc: &mut [f32], weights: &[f32], values: &[E]) {
    let d = acc.len();
    for (w, v) in weights.iter().zip(values.chunks_exact(d)) {
        let wv = vdupq_n_f32(*w);
        let mut i = 0;
        while i + 4 <= d {
            let a = acc.as_mut_ptr().add(i);
            vst1q_f32(a, vfmaq_f32(vld1q_f32(a), E::load4(v.as_ptr().add(i)), wv));
            i += 4;
        }
        for j in i..d {
            acc[j] += w * v[j].to_f32();
        }
    }
}

/// `Q` queries against 4 keys at column `c` of the dimension-major block `kt`.
///
/// # Safety
/// `c + 4 ≤ nk`, and the lengths as `crate::scores_dim_major` checks.
unsafe fn tile<const Q: usize>(kt: &[f32], nk: usize, c: usize, queries: &[f32], q0: usize, d: usize, out: &mut [f32]) {
    let mut acc = [vdupq_n_f32(0.0); Q];
    let (kp, qp) = (kt.as_ptr(), queries.as_ptr().add(q0 * d));
    for j in 0..d {
        let kv = vld1q_f32(kp.add(j * nk + c));
        for (t, a) in acc.iter_mut().enumerate() {
            *a = vfmaq_n_f32(*a, kv, *qp.add(t * d + j));
        }
    }
    for (t, a) in acc.iter().enumerate() {
        vst1q_f32(out.as_mut_ptr().add((q0 + t) * nk + c), *a);
    }
}

/// # Safety
/// The lengths are as `crate::scores_dim_major` checks.
pub unsafe fn scores_dim_major(kt: &[f32], nk: usize, queries: &[f32], d: usize, out: &mut [f32]) {
    let m = queries.len() / d;
    let full = nk / 4 * 4;
    let mut q0 = 0;
    while q0 < m {
        let take = (m - q0).min(4);
        for c in (0..full).step_by(4) {
            match take {
                4 => tile::<4>(kt, nk, c, queries, q0, d, out),
                _ => (q0..q0 + take).for_each(|q| tile::<1>(kt, nk, c, queries, q, d, out)),
            }
        }
        q0 += take;
    }
    crate::scalar::scores_dim_major_cols(kt, nk, queries, d, out, full);
}
