//! AVX2 (+FMA, F16C) and AVX-512F kernels.
//!
//! Every function here is `unsafe` for one reason only: it must run on a CPU with the target
//! features it is compiled for. The dispatcher (`lib.rs`) calls them only after runtime
//! detection. Within them, raw-pointer loads and stores stay inside the slices they come
//! from: every loop bound is checked against the slice length before the pointer is formed.

use core::arch::x86_64::*;
use half::{bf16, f16};

/// Loads lanes of an element type as f32.
pub(crate) trait Lanes: Copy {
    /// # Safety
    /// AVX2, FMA and F16C must be available; `p` must point at 8 readable elements.
    unsafe fn load8(p: *const Self) -> __m256;
    /// # Safety
    /// AVX-512F must be available; `p` must point at 16 readable elements.
    unsafe fn load16(p: *const Self) -> __m512;
    fn to_f32(self) -> f32;
}

impl Lanes for f16 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

impl Lanes for bf16 {
    // A bf16 is the upper half of an f32: widen and shift.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))))
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i))))
    }
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

impl Lanes for f32 {
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8(p: *const Self) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn load16(p: *const Self) -> __m512 {
        _mm512_loadu_ps(p)
    }
    fn to_f32(self) -> f32 {
        self
    }
}

use crate::expf::{EXP_HI, EXP_LO, LN2_HI, LN2_LO, LOG2E, P};

/// Vectors of columns [`avx2::weighted_sum`] and [`avx512::weighted_sum`] sum at once, each
/// held in a register over every row: 8 and 16 registers of the 16 and 32 there are, 128
/// columns at AVX-512 (a whole head at d = 128).
const SUM_VECTORS: usize = 8;

/// A weighted sum over vectors of `$lanes` columns: whole chunks of `SUM_VECTORS` vectors,
/// then the vectors left, each by `sum_columns::<_, N>`, then the columns left past them
/// ([`sum_tail`]). One driver for both instruction sets; their `sum_columns` differ only in
/// the intrinsics.
macro_rules! sum_by_columns {
    ($acc:expr, $weights:expr, $values:expr, $lanes:expr) => {{
        let (acc, weights, values) = ($acc, $weights, $values);
        let d = acc.len();
        let mut c = 0;
        while c + $lanes * SUM_VECTORS <= d {
            sum_columns::<_, SUM_VECTORS>(acc, weights, values, c);
            c += $lanes * SUM_VECTORS;
        }
        let rest = (d - c) / $lanes;
        match rest {
            1 => sum_columns::<_, 1>(acc, weights, values, c),
            2 => sum_columns::<_, 2>(acc, weights, values, c),
            3 => sum_columns::<_, 3>(acc, weights, values, c),
            4 => sum_columns::<_, 4>(acc, weights, values, c),
            5 => sum_columns::<_, 5>(acc, weights, values, c),
            6 => sum_columns::<_, 6>(acc, weights, values, c),
            7 => sum_columns::<_, 7>(acc, weights, values, c),
            _ => {}
        }
        sum_tail(acc, weights, values, c + $lanes * rest);
    }};
}

/// The columns from `c` of a weighted sum, element by element (fewer than a vector's).
fn sum_tail<E: Lanes>(acc: &mut [f32], weights: &[f32], values: &[E], c: usize) {
    let d = acc.len();
    for (w, v) in weights.iter().zip(values.chunks_exact(d)) {
        for (a, x) in acc[c..].iter_mut().zip(&v[c..]) {
            *a += w * x.to_f32();
        }
    }
}

pub(crate) mod avx2 {
    use super::*;

    /// `Q` queries (rows of `d` at `queries`) against 8 keys at column `c` of the
    /// dimension-major block `kt` (`nk` keys a row), into `out` rows of `nk`.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; `c + 8 ≤ nk`, `queries` holds `Q · d` elements from
    /// `q0 · d`, `kt` holds `d · nk` and `out` `(q0 + Q) · nk`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const Q: usize>(
        kt: &[f32],
        nk: usize,
        c: usize,
        queries: &[f32],
        q0: usize,
        d: usize,
        out: &mut [f32],
    ) {
        let mut acc = [_mm256_setzero_ps(); Q];
        let (kp, qp) = (kt.as_ptr(), queries.as_ptr().add(q0 * d));
        for j in 0..d {
            let kv = _mm256_loadu_ps(kp.add(j * nk + c));
            for (t, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_set1_ps(*qp.add(t * d + j)), kv, *a);
            }
        }
        for (t, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add((q0 + t) * nk + c), *a);
        }
    }

    /// # Safety
    /// AVX2 and FMA must be available; the lengths are as `crate::scores_dim_major` checks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scores_dim_major(kt: &[f32], nk: usize, queries: &[f32], d: usize, out: &mut [f32]) {
        let m = queries.len() / d;
        let full = nk / 8 * 8;
        let mut q0 = 0;
        while q0 < m {
            let take = (m - q0).min(4);
            for c in (0..full).step_by(8) {
                match take {
                    4 => tile::<4>(kt, nk, c, queries, q0, d, out),
                    _ => (q0..q0 + take).for_each(|q| tile::<1>(kt, nk, c, queries, q, d, out)),
                }
            }
            q0 += take;
        }
        crate::scalar::scores_dim_major_cols(kt, nk, queries, d, out, full);
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available. `x.len() == q.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot<E: Lanes>(x: &[E], q: &[f32]) -> f32 {
        debug_assert_eq!(x.len(), q.len());
        let n = x.len().min(q.len());
        let (xp, qp) = (x.as_ptr(), q.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(E::load8(xp.add(i + 8 * k)), _mm256_loadu_ps(qp.add(i + 8 * k)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(E::load8(xp.add(i)), _mm256_loadu_ps(qp.add(i)), acc[0]);
            i += 8;
        }
        let mut s = hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
        for j in i..n {
            s += x[j].to_f32() * q[j];
        }
        s
    }

    /// # Safety
    /// As [`dot`]; `keys.len() == out.len() * q.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scores<E: Lanes>(keys: &[E], q: &[f32], scale: f32, out: &mut [f32]) {
        for (o, k) in out.iter_mut().zip(keys.chunks_exact(q.len())) {
            *o = dot(k, q) * scale;
        }
    }

    /// As the AVX-512 `scores_of`, with [`dot`]'s grouping of the sums.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; the rest as the AVX-512 `scores_of`.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores_of<E: Lanes, const Q: usize>(
        keys: &[E],
        qp: *const f32,
        d: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        for (i, k) in keys.chunks_exact(d).enumerate() {
            let kp = k.as_ptr();
            let mut acc = [[_mm256_setzero_ps(); 4]; Q];
            let mut c = 0;
            while c + 32 <= d {
                let kv = [0, 8, 16, 24].map(|o| E::load8(kp.add(c + o)));
                for (t, a) in acc.iter_mut().enumerate() {
                    for (j, (a, kv)) in a.iter_mut().zip(&kv).enumerate() {
                        *a = _mm256_fmadd_ps(*kv, _mm256_loadu_ps(qp.add(t * d + c + 8 * j)), *a);
                    }
                }
                c += 32;
            }
            while c + 8 <= d {
                let kv = E::load8(kp.add(c));
                for (t, a) in acc.iter_mut().enumerate() {
                    a[0] = _mm256_fmadd_ps(kv, _mm256_loadu_ps(qp.add(t * d + c)), a[0]);
                }
                c += 8;
            }
            for (t, a) in acc.iter().enumerate() {
                let mut s = hsum(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
                for (j, x) in k.iter().enumerate().skip(c) {
                    s += x.to_f32() * *qp.add(t * d + j);
                }
                out[t * stride + i] = s;
            }
        }
    }

    /// `out[t · stride + i] = queries_t · key_i`, two queries per pass over the keys (four
    /// would need more than AVX2's sixteen registers).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; the lengths are as `crate::scores_many` checks.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scores_many<E: Lanes>(keys: &[E], queries: &[f32], d: usize, out: &mut [f32], stride: usize) {
        for (g, qs) in queries.chunks(2 * d).enumerate() {
            let (qp, o) = (qs.as_ptr(), &mut out[g * 2 * stride..]);
            match qs.len() / d {
                2 => scores_of::<E, 2>(keys, qp, d, o, stride),
                _ => scores_of::<E, 1>(keys, qp, d, o, stride),
            }
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn max(z: &[f32]) -> f32 {
        let mut m = _mm256_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i + 8 <= z.len() {
            m = _mm256_max_ps(m, _mm256_loadu_ps(z.as_ptr().add(i)));
            i += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        lanes.iter().chain(&z[i..]).copied().fold(f32::NEG_INFINITY, f32::max)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn exp(x: __m256) -> __m256 {
        let masked = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_LO)), _mm256_set1_ps(EXP_HI));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(
            x,
            _mm256_set1_ps(LOG2E),
        ));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x));
        let mut y = _mm256_set1_ps(P[0]);
        for c in &P[1..] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(*c));
        }
        y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        )));
        _mm256_andnot_ps(masked, _mm256_mul_ps(y, pow2))
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn exp_sub(z: &mut [f32], m: f32) -> f32 {
        let mv = _mm256_set1_ps(m);
        let mut sum = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= z.len() {
            let p = z.as_mut_ptr().add(i);
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(p), mv));
            _mm256_storeu_ps(p, e);
            sum = _mm256_add_ps(sum, e);
            i += 8;
        }
        hsum(sum) + crate::scalar::exp_sub(&mut z[i..], m)
    }

    /// # Safety
    /// AVX2, FMA and F16C must be available. `values.len() == weights.len() * acc.len()`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn weighted_sum<E: Lanes>(acc: &mut [f32], weights: &[f32], values: &[E]) {
        sum_by_columns!(acc, weights, values, 8);
    }

    /// [`weighted_sum`] of the `N` vectors of columns from `c`, their sums held in registers
    /// over every row (one kept in memory would wait on its own store each row).
    ///
    /// # Safety
    /// As [`weighted_sum`]; `c + 8·N ≤ acc.len()`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn sum_columns<E: Lanes, const N: usize>(acc: &mut [f32], weights: &[f32], values: &[E], c: usize) {
        let d = acc.len();
        let ap = acc.as_mut_ptr().add(c);
        let mut a = [_mm256_setzero_ps(); N];
        for (j, x) in a.iter_mut().enumerate() {
            *x = _mm256_loadu_ps(ap.add(8 * j));
        }
        for (w, v) in weights.iter().zip(values.chunks_exact(d)) {
            let (wv, vp) = (_mm256_set1_ps(*w), v.as_ptr().add(c));
            for (j, x) in a.iter_mut().enumerate() {
                *x = _mm256_fmadd_ps(E::load8(vp.add(8 * j)), wv, *x);
            }
        }
        for (j, x) in a.iter().enumerate() {
            _mm256_storeu_ps(ap.add(8 * j), *x);
        }
    }
}

pub(crate) mod avx512 {
    use super::*;

    /// As the AVX2 `tile`, `16 · W` keys wide: `Q` queries × `W` vectors of keys held in
    /// `Q · W` accumulators, so each broadcast query element feeds `W` FMAs and each key
    /// load `Q`. Every score is the same chain of FMAs over `j` whatever the tile's shape.
    ///
    /// # Safety
    /// AVX-512F must be available; `c + 16 · W ≤ nk` and the lengths as in the AVX2 `tile`.
    #[target_feature(enable = "avx512f")]
    unsafe fn tile<const Q: usize, const W: usize>(
        kt: &[f32],
        nk: usize,
        c: usize,
        queries: &[f32],
        q0: usize,
        d: usize,
        out: &mut [f32],
    ) {
        let mut acc = [[_mm512_setzero_ps(); W]; Q];
        let (kp, qp) = (kt.as_ptr(), queries.as_ptr().add(q0 * d));
        for j in 0..d {
            let mut kv = [_mm512_setzero_ps(); W];
            for (w, v) in kv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(kp.add(j * nk + c + 16 * w));
            }
            for (t, row) in acc.iter_mut().enumerate() {
                let qb = _mm512_set1_ps(*qp.add(t * d + j));
                for (a, v) in row.iter_mut().zip(&kv) {
                    *a = _mm512_fmadd_ps(qb, *v, *a);
                }
            }
        }
        for (t, row) in acc.iter().enumerate() {
            for (w, a) in row.iter().enumerate() {
                _mm512_storeu_ps(out.as_mut_ptr().add((q0 + t) * nk + c + 16 * w), *a);
            }
        }
    }

    /// Tiles of `Q` queries: 32 keys wide, then 16, the last keys left to the scalar path.
    ///
    /// # Safety
    /// As [`tile`], for queries `q0..q0 + Q`.
    #[target_feature(enable = "avx512f")]
    unsafe fn tile_row<const Q: usize>(kt: &[f32], nk: usize, queries: &[f32], q0: usize, d: usize, out: &mut [f32]) {
        let mut c = 0;
        while c + 32 <= nk {
            tile::<Q, 2>(kt, nk, c, queries, q0, d, out);
            c += 32;
        }
        if c + 16 <= nk {
            tile::<Q, 1>(kt, nk, c, queries, q0, d, out);
        }
    }

    /// # Safety
    /// AVX-512F must be available; the lengths are as `crate::scores_dim_major` checks.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores_dim_major(kt: &[f32], nk: usize, queries: &[f32], d: usize, out: &mut [f32]) {
        let m = queries.len() / d;
        let mut q0 = 0;
        // 8 queries × 32 keys: 16 accumulators, 10 loads per 16 FMAs.
        while q0 + 8 <= m {
            tile_row::<8>(kt, nk, queries, q0, d, out);
            q0 += 8;
        }
        if q0 + 4 <= m {
            tile_row::<4>(kt, nk, queries, q0, d, out);
            q0 += 4;
        }
        for q in q0..m {
            tile_row::<1>(kt, nk, queries, q, d, out);
        }
        crate::scalar::scores_dim_major_cols(kt, nk, queries, d, out, nk / 16 * 16);
    }

    /// # Safety
    /// AVX-512F must be available. `x.len() == q.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn dot<E: Lanes>(x: &[E], q: &[f32]) -> f32 {
        debug_assert_eq!(x.len(), q.len());
        let n = x.len().min(q.len());
        let (xp, qp) = (x.as_ptr(), q.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 2];
        let mut i = 0;
        while i + 32 <= n {
            acc[0] = _mm512_fmadd_ps(E::load16(xp.add(i)), _mm512_loadu_ps(qp.add(i)), acc[0]);
            acc[1] = _mm512_fmadd_ps(E::load16(xp.add(i + 16)), _mm512_loadu_ps(qp.add(i + 16)), acc[1]);
            i += 32;
        }
        while i + 16 <= n {
            acc[0] = _mm512_fmadd_ps(E::load16(xp.add(i)), _mm512_loadu_ps(qp.add(i)), acc[0]);
            i += 16;
        }
        let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1]));
        for j in i..n {
            s += x[j].to_f32() * q[j];
        }
        s
    }

    /// # Safety
    /// As [`dot`]; `keys.len() == out.len() * q.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn scores<E: Lanes>(keys: &[E], q: &[f32], scale: f32, out: &mut [f32]) {
        for (o, k) in out.iter_mut().zip(keys.chunks_exact(q.len())) {
            *o = dot(k, q) * scale;
        }
    }

    /// [`dot`] of every key with `Q` queries (rows of `d` from `qp`) at once: each key is
    /// loaded and widened once for all of them. The sums are grouped exactly as `dot` groups
    /// them, so each score equals `dot(key, query)` to the bit.
    ///
    /// # Safety
    /// AVX-512F must be available; `qp` points at `Q · d` readable floats, `keys.len()` is a
    /// multiple of `d`, and `out[t · stride + i]` is in bounds for every query `t` and key `i`.
    #[target_feature(enable = "avx512f")]
    unsafe fn scores_of<E: Lanes, const Q: usize>(
        keys: &[E],
        qp: *const f32,
        d: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        for (i, k) in keys.chunks_exact(d).enumerate() {
            let kp = k.as_ptr();
            let mut acc = [[_mm512_setzero_ps(); 2]; Q];
            let mut c = 0;
            while c + 32 <= d {
                let (lo, hi) = (E::load16(kp.add(c)), E::load16(kp.add(c + 16)));
                for (t, a) in acc.iter_mut().enumerate() {
                    a[0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(qp.add(t * d + c)), a[0]);
                    a[1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(qp.add(t * d + c + 16)), a[1]);
                }
                c += 32;
            }
            while c + 16 <= d {
                let lo = E::load16(kp.add(c));
                for (t, a) in acc.iter_mut().enumerate() {
                    a[0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(qp.add(t * d + c)), a[0]);
                }
                c += 16;
            }
            for (t, a) in acc.iter().enumerate() {
                let mut s = _mm512_reduce_add_ps(_mm512_add_ps(a[0], a[1]));
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
    /// AVX-512F must be available; the lengths are as `crate::scores_many` checks.
    #[target_feature(enable = "avx512f")]
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
    /// AVX-512F must be available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn max(z: &[f32]) -> f32 {
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i + 16 <= z.len() {
            m = _mm512_max_ps(m, _mm512_loadu_ps(z.as_ptr().add(i)));
            i += 16;
        }
        z[i..].iter().copied().fold(_mm512_reduce_max_ps(m), f32::max)
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn exp(x: __m512) -> __m512 {
        let masked = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_LO));
        let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_LO)), _mm512_set1_ps(EXP_HI));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(
            x,
            _mm512_set1_ps(LOG2E),
        ));
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x));
        let mut y = _mm512_set1_ps(P[0]);
        for c in &P[1..] {
            y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(*c));
        }
        y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0)));
        let pow2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        )));
        _mm512_maskz_mov_ps(!masked, _mm512_mul_ps(y, pow2))
    }

    /// # Safety
    /// AVX-512F must be available.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn exp_sub(z: &mut [f32], m: f32) -> f32 {
        let mv = _mm512_set1_ps(m);
        let mut sum = _mm512_setzero_ps();
        let mut i = 0;
        while i + 16 <= z.len() {
            let p = z.as_mut_ptr().add(i);
            let e = exp(_mm512_sub_ps(_mm512_loadu_ps(p), mv));
            _mm512_storeu_ps(p, e);
            sum = _mm512_add_ps(sum, e);
            i += 16;
        }
        _mm512_reduce_add_ps(sum) + crate::scalar::exp_sub(&mut z[i..], m)
    }

    /// # Safety
    /// AVX-512F must be available. `values.len() == weights.len() * acc.len()`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn weighted_sum<E: Lanes>(acc: &mut [f32], weights: &[f32], values: &[E]) {
        sum_by_columns!(acc, weights, values, 16);
    }

    /// [`weighted_sum`] of the `N` vectors of columns from `c`, their sums held in registers
    /// over every row (one kept in memory would wait on its own store each row).
    ///
    /// # Safety
    /// As [`weighted_sum`]; `c + 16·N ≤ acc.len()`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn sum_columns<E: Lanes, const N: usize>(acc: &mut [f32], weights: &[f32], values: &[E], c: usize) {
        let d = acc.len();
        let ap = acc.as_mut_ptr().add(c);
        let mut a = [_mm512_setzero_ps(); N];
        for (j, x) in a.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(ap.add(16 * j));
        }
        for (w, v) in weights.iter().zip(values.chunks_exact(d)) {
            let (wv, vp) = (_mm512_set1_ps(*w), v.as_ptr().add(c));
            for (j, x) in a.iter_mut().enumerate() {
                *x = _mm512_fmadd_ps(E::load16(vp.add(16 * j)), wv, *x);
            }
        }
        for (j, x) in a.iter().enumerate() {
            _mm512_storeu_ps(ap.add(16 * j), *x);
        }
    }
}
