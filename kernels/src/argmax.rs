//! The index of the largest of `init + Σ_i weights_i · row_i` (the sum [`crate::weighted_sum`]
//! makes) in one pass, without writing the sums out: what k-means needs to find a point's
//! nearest centroid (init `−½‖c‖²`, weights the point, rows the centroids transposed).

use crate::{usable, Isa};

/// The first index of the largest `init[c] + Σ_i weights[i] · values[i · k + c]`, `k` =
/// `init.len()` (0 when `k` is 0; a NaN sum is never the largest).
pub fn argmax_weighted_sum(init: &[f32], weights: &[f32], values: &[f32]) -> usize {
    argmax_weighted_sum_on(crate::active(), init, weights, values)
}

pub fn argmax_weighted_sum_on(isa: Isa, init: &[f32], weights: &[f32], values: &[f32]) -> usize {
    let k = init.len();
    assert_eq!(values.len(), weights.len() * k, "{} values for {} weights of {k} sums", values.len(), weights.len());
    match usable(isa) {
        // SAFETY: `usable` never returns an instruction set the CPU lacks; the lengths are
        // checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::argmax_weighted_sum(init, weights, values) },
        _ => scalar(init, weights, values, 0..k).0,
    }
}

/// The best index among `range` and its sum (−∞ when none is a number).
fn scalar(init: &[f32], weights: &[f32], values: &[f32], range: std::ops::Range<usize>) -> (usize, f32) {
    let k = init.len();
    let mut best = (0, f32::NEG_INFINITY);
    for c in range {
        let sum = weights.iter().enumerate().fold(init[c], |acc, (i, &w)| w.mul_add(values[i * k + c], acc));
        if sum > best.1 {
            best = (c, sum);
        }
    }
    best
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// 16 sums at a time, each lane keeping its best sum and where it was; then the best
    /// lane (the lowest index among equal sums), then the sums past the last 16.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `values.len() == weights.len() · init.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn argmax_weighted_sum(init: &[f32], weights: &[f32], values: &[f32]) -> usize {
        let k = init.len();
        let whole = k / 16 * 16;
        let mut best = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut at = _mm512_setzero_si512();
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        for c in (0..whole).step_by(16) {
            // SAFETY: sums `c .. c + 16` lie below `whole ≤ k`, and row `i`'s below
            // `i·k + k ≤ values.len()`.
            let mut sum = unsafe { _mm512_loadu_ps(init.as_ptr().add(c)) };
            for (i, &w) in weights.iter().enumerate() {
                let row = unsafe { _mm512_loadu_ps(values.as_ptr().add(i * k + c)) };
                sum = _mm512_fmadd_ps(_mm512_set1_ps(w), row, sum);
            }
            let better = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(sum, best);
            best = _mm512_mask_blend_ps(better, best, sum);
            at = _mm512_mask_blend_epi32(better, at, _mm512_add_epi32(lanes, _mm512_set1_epi32(c as i32)));
        }
        let top = _mm512_reduce_max_ps(best);
        let mut winner = (0, f32::NEG_INFINITY);
        if top > f32::NEG_INFINITY {
            let tied = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(best, _mm512_set1_ps(top));
            winner = (_mm512_mask_reduce_min_epi32(tied, at) as usize, top);
        }
        let tail = super::scalar(init, weights, values, whole..k);
        if tail.1 > winner.1 {
            winner = tail;
        }
        winner.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_instruction_set_finds_the_first_largest() {
        let mut seed = 11u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((seed >> 40) % 64) as f32 / 8.0 - 4.0
        };
        for (k, dim) in [(256, 4), (37, 3), (16, 1), (5, 8), (1, 2), (0, 3)] {
            let init: Vec<f32> = (0..k).map(|_| next()).collect();
            let weights: Vec<f32> = (0..dim).map(|_| next()).collect();
            let values: Vec<f32> = (0..k * dim).map(|_| next()).collect();
            let sums: Vec<f32> =
                (0..k).map(|c| (0..dim).fold(init[c], |a, i| weights[i].mul_add(values[i * k + c], a))).collect();
            let want = (0..k).fold(0, |b, c| if sums[c] > sums[b] { c } else { b });
            for isa in crate::available() {
                assert_eq!(argmax_weighted_sum_on(isa, &init, &weights, &values), want, "{isa:?} k {k}");
            }
        }
        // Ties go to the lowest index, across lanes and past the last 16.
        let init = vec![1.0; 40];
        for isa in crate::available() {
            assert_eq!(argmax_weighted_sum_on(isa, &init, &[], &[]), 0);
        }
    }
}
