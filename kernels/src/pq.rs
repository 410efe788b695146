//! Product-quantisation scan: a token's approximate score is `Σ_j table_j[code(t, j)]` over
//! the m subspaces. The tables are quantised to one byte per entry ([`PqLut`]), so that a
//! CPU with AVX-512 VBMI looks up 64 codes of a subspace in one pair of byte permutes
//! (`vpermi2b`) instead of 64 loads, and the sums are exact integers on every path: every
//! instruction set gives the same scores, bit for bit.
//!
//! Codes come **subspace-major**: for a run of `r` tokens, subspace `j`'s codes of all `r`
//! tokens are bytes `j·r .. (j+1)·r` (the layout of stored code blocks; see
//! `ctxfs_index::coarse::pq`).

use crate::{usable, Isa};

/// Entries of a quantised table: a code is one byte, so 256 whatever the centroid count
/// (entries beyond it are 0 and never looked up by valid codes).
pub const PQ_TABLE: usize = 256;

/// A query's lookup tables, one byte per entry: entry `(j, c)` stands for
/// `min_j + step · byte`, `min_j` the smallest entry of table `j` and `step` the widest
/// table's range over 255 (one step for all tables, so that byte sums add up).
#[derive(Debug, Clone, PartialEq)]
pub struct PqLut {
    pub(crate) bytes: Vec<u8>,
    /// `Σ_j min_j`.
    pub(crate) bias: f32,
    pub(crate) step: f32,
}

impl PqLut {
    /// Quantises `tables`: `m` tables of `k` (1..=256) entries, table after table.
    pub fn quantise(tables: &[f32], k: usize) -> PqLut {
        assert!(
            (1..=PQ_TABLE).contains(&k) && tables.len().is_multiple_of(k),
            "{} entries in tables of {k}",
            tables.len()
        );
        // Comparisons written as selects, which compile to vector min and max.
        let range = |t: &[f32]| {
            t.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &x| {
                (if x < lo { x } else { lo }, if x > hi { x } else { hi })
            })
        };
        let ranges: Vec<(f32, f32)> = tables.chunks_exact(k).map(range).collect();
        let widest = ranges.iter().map(|(lo, hi)| hi - lo).fold(0.0f32, f32::max);
        let step = if widest.is_finite() && widest > 0.0 { widest / 255.0 } else { 0.0 };
        let mut bytes = vec![0u8; ranges.len() * PQ_TABLE];
        for ((table, &(lo, _)), out) in tables.chunks_exact(k).zip(&ranges).zip(bytes.chunks_exact_mut(PQ_TABLE)) {
            if step > 0.0 {
                // Entries are at least `lo`: adding a half and truncating rounds them (the
                // cast saturates at 255).
                let per_step = 1.0 / step;
                for (b, &x) in out.iter_mut().zip(table) {
                    *b = ((x - lo) * per_step + 0.5) as u8;
                }
            }
        }
        let bias = ranges.iter().map(|&(lo, _)| lo as f64).sum::<f64>() as f32;
        PqLut { bytes, bias, step }
    }

    /// Subspaces (m).
    pub fn subspaces(&self) -> usize {
        self.bytes.len() / PQ_TABLE
    }

    /// The most a score can differ from the sum of the unquantised entries: half a step
    /// per subspace.
    pub fn max_error(&self) -> f32 {
        self.subspaces() as f32 * self.step * 0.5
    }

    /// A score from its byte sum; the same expression on every path.
    #[inline(always)]
    fn score(&self, sum: u32) -> f32 {
        self.bias + self.step * sum as f32
    }
}

/// Width of the subspaces that [`pq_table`] has a vector path for (`PqParams::scan_codes`'
/// 4 dimensions per byte).
const VECTOR_SUB: usize = 4;

/// One subspace's table entries before quantisation: `out[c]` is centroid row `c` of `rows`
/// (rows of `q.len()` f16) dotted with `q`, the query's part in the subspace. Rows of 4
/// are summed as (r0·q0 + r1·q1) + (r2·q2 + r3·q3) on every path, so every instruction set
/// builds the same tables; other widths are [`crate::dot`]s.
pub fn pq_table(rows: &[half::f16], q: &[f32], out: &mut [f32]) {
    pq_table_on(crate::active(), rows, q, out)
}

pub fn pq_table_on(isa: Isa, rows: &[half::f16], q: &[f32], out: &mut [f32]) {
    assert!(
        rows.len() == out.len() * q.len(),
        "{} centroid elements for {} rows of {}",
        rows.len(),
        out.len(),
        q.len()
    );
    let &[q0, q1, q2, q3] = q else {
        for (o, row) in out.iter_mut().zip(rows.chunks_exact(q.len().max(1))) {
            *o = crate::dot_on(isa, row, q);
        }
        return;
    };
    let done = match usable(isa) {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => {
            // SAFETY: `usable` returned AVX-512, so the CPU has AVX-512F; `q` has 4 elements
            // and the lengths are checked above.
            unsafe { avx512table::four_wide(rows, q, out) }
        }
        _ => 0,
    };
    for (o, r) in out[done..].iter_mut().zip(rows[done * VECTOR_SUB..].chunks_exact(VECTOR_SUB)) {
        *o = (r[0].to_f32() * q0 + r[1].to_f32() * q1) + (r[2].to_f32() * q2 + r[3].to_f32() * q3);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512table {
    use std::arch::x86_64::*;

    /// Rows of 4 dimensions, four rows per vector, summed as the scalar path sums them;
    /// returns how many rows it scored (the rest, fewer than four, are left to that path).
    ///
    /// # Safety
    /// The CPU has AVX-512F; `q.len() == 4` and `rows.len() == 4 · out.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn four_wide(rows: &[half::f16], q: &[f32], out: &mut [f32]) -> usize {
        let qv = _mm512_broadcast_f32x4(_mm_loadu_ps(q.as_ptr()));
        let whole = out.len() / 4 * 4;
        for at in (0..whole).step_by(4) {
            // SAFETY: rows `at .. at + 4` are 16 halves within `rows` (`at + 4 ≤ out.len()`).
            let halves = unsafe { _mm256_loadu_si256(rows.as_ptr().add(4 * at).cast()) };
            let p = _mm512_mul_ps(_mm512_cvtph_ps(halves), qv);
            // Neighbours, then pairs: lane 4·i ends with row i's sum, in the scalar order.
            let pairs = _mm512_add_ps(p, _mm512_permute_ps::<0b10_11_00_01>(p));
            let sums = _mm512_add_ps(pairs, _mm512_permute_ps::<0b01_00_11_10>(pairs));
            // Compressed in a register: a compressing store is microcoded on some CPUs.
            let four = _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, sums));
            // SAFETY: four floats at `at .. at + 4 ≤ out.len()`.
            unsafe { _mm_storeu_ps(out.as_mut_ptr().add(at), four) };
        }
        whole
    }
}

/// The scores of tokens `from .. from + out.len()` of a run of `r` tokens' codes,
/// subspace-major (`codes`: `m · r` bytes, `m` = `lut.subspaces()`). A caller scoring
/// several queries over a long run takes a slice of its tokens at a time for all of them,
/// so that the slice's codes stay in cache between the queries.
pub fn pq_scores(lut: &PqLut, codes: &[u8], r: usize, from: usize, out: &mut [f32]) {
    pq_scores_on(crate::active(), lut, codes, r, from, out)
}

pub fn pq_scores_on(isa: Isa, lut: &PqLut, codes: &[u8], r: usize, from: usize, out: &mut [f32]) {
    let m = lut.subspaces();
    assert!(
        codes.len() == m * r && from + out.len() <= r,
        "{} code bytes for {m} subspaces of {r} tokens, tokens {from}.. scored",
        codes.len()
    );
    let done = match usable(isa) {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 if vbmi() && m <= MAX_U16_SUBSPACES => {
            // SAFETY: `vbmi` checked the CPU has AVX-512 F, BW and VBMI; the lengths are
            // checked above.
            unsafe { avx512vbmi::pq_scores(lut, codes, r, from, out) }
        }
        _ => 0,
    };
    scalar_scores(lut, codes, r, from + done, &mut out[done..]);
}

/// Subspaces whose byte sums fit a u16 lane (255 each).
#[cfg(target_arch = "x86_64")]
const MAX_U16_SUBSPACES: usize = u16::MAX as usize / 255;

#[cfg(target_arch = "x86_64")]
fn vbmi() -> bool {
    static VBMI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VBMI.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vbmi")
    })
}

/// Tokens `from .. from + out.len()` of the run, 64 at a time with their sums side by side
/// (independent loads, not one long chain of adds per token).
fn scalar_scores(lut: &PqLut, codes: &[u8], r: usize, from: usize, out: &mut [f32]) {
    let mut sums = [0u32; 64];
    for (c, chunk) in out.chunks_mut(64).enumerate() {
        let at = from + c * 64;
        let sums = &mut sums[..chunk.len()];
        sums.fill(0);
        for (table, sub) in lut.bytes.chunks_exact(PQ_TABLE).zip(codes.chunks_exact(r.max(1))) {
            for (s, &code) in sums.iter_mut().zip(&sub[at..at + chunk.len()]) {
                *s += table[code as usize] as u32;
            }
        }
        for (o, &s) in chunk.iter_mut().zip(sums.iter()) {
            *o = lut.score(s);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512vbmi {
    use super::{PqLut, PQ_TABLE};
    use std::arch::x86_64::*;

    /// Chunks of 64 tokens summed side by side, so that a subspace's table is loaded once
    /// for all of them.
    const CHUNKS: usize = 4;

    /// Tokens `from .. from + out.len()`, 64 at a time (the last chunk's bytes and scores
    /// masked); returns how many tokens it scored. Runs of [`CHUNKS`] chunks while they
    /// fill, then one chunk at a time: a short run (a block's 127 tokens at `m` = 32) does
    /// not look up chunks that are wholly masked.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VBMI; `codes.len() == m · r`, `from + out.len() ≤ r`
    /// and `m ≤ MAX_U16_SUBSPACES` (`m` = `lut.subspaces()`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(super) unsafe fn pq_scores(lut: &PqLut, codes: &[u8], r: usize, from: usize, out: &mut [f32]) -> usize {
        let whole = out.len() / (64 * CHUNKS) * (64 * CHUNKS);
        for at in (0..whole).step_by(64 * CHUNKS) {
            // SAFETY: as this function's; tokens `at .. at + 256 ≤ out.len()`.
            unsafe { chunks::<CHUNKS>(lut, codes, r, from, at, out) };
        }
        for at in (whole..out.len()).step_by(64) {
            // SAFETY: as this function's; `at < out.len()`.
            unsafe { chunks::<1>(lut, codes, r, from, at, out) };
        }
        out.len()
    }

    /// `N` chunks of 64 tokens from `at` (of `out`; beyond its end, masked), summed side by
    /// side. A chunk's looked-up bytes are summed as 16-bit words without widening: the even
    /// bytes masked, the odd ones shifted down, and the two sums interleaved back into token
    /// order once per chunk.
    ///
    /// # Safety
    /// As [`pq_scores`]', and `at < out.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn chunks<const N: usize>(lut: &PqLut, codes: &[u8], r: usize, from: usize, at: usize, out: &mut [f32]) {
        let (bias, step) = (_mm512_set1_ps(lut.bias), _mm512_set1_ps(lut.step));
        let low_bytes = _mm512_set1_epi16(0x00FF);
        // Word `i` of the even sums is token 2i, of the odd sums token 2i + 1 (index 32 + i
        // of the pair): tokens 0..32, then 32..64.
        let order = |from: i16| {
            let words: [i16; 32] = std::array::from_fn(|k| from + (k as i16 / 2) + if k % 2 == 1 { 32 } else { 0 });
            // SAFETY: 32 words are 64 readable bytes.
            unsafe { _mm512_loadu_si512(words.as_ptr().cast()) }
        };
        let (first_half, second_half) = (order(0), order(16));
        let masks: [__mmask64; N] = std::array::from_fn(|c| match (out.len() - at).saturating_sub(64 * c) {
            w if w >= 64 => !0,
            w => (1u64 << w) - 1,
        });
        let mut even = [_mm512_setzero_si512(); N];
        let mut odd = [_mm512_setzero_si512(); N];
        for (j, table) in lut.bytes.chunks_exact(PQ_TABLE).enumerate() {
            let t = table.as_ptr();
            // SAFETY: each table is 256 bytes, read as four 64-byte vectors.
            let (t0, t1, t2, t3) = unsafe {
                (
                    _mm512_loadu_si512(t.cast()),
                    _mm512_loadu_si512(t.add(64).cast()),
                    _mm512_loadu_si512(t.add(128).cast()),
                    _mm512_loadu_si512(t.add(192).cast()),
                )
            };
            for c in 0..N {
                // SAFETY: the mask reads bytes `j·r + from + at + 64c ..` below
                // `j·r + from + out.len() ≤ m·r` of `codes` (an empty mask reads none).
                let idx =
                    unsafe { _mm512_maskz_loadu_epi8(masks[c], codes.as_ptr().add(j * r + from + at + 64 * c).cast()) };
                // Entries 0..128 and 128..256 by the code's low 7 bits; its top bit picks.
                let low = _mm512_permutex2var_epi8(t0, idx, t1);
                let high = _mm512_permutex2var_epi8(t2, idx, t3);
                let v = _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), low, high);
                even[c] = _mm512_add_epi16(even[c], _mm512_and_si512(v, low_bytes));
                odd[c] = _mm512_add_epi16(odd[c], _mm512_srli_epi16::<8>(v));
            }
        }
        for c in 0..N {
            let tokens = [
                _mm512_permutex2var_epi16(even[c], first_half, odd[c]),
                _mm512_permutex2var_epi16(even[c], second_half, odd[c]),
            ];
            for (i, sums) in tokens.into_iter().enumerate() {
                for (half, part) in
                    [_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64::<1>(sums)].into_iter().enumerate()
                {
                    let wide = _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(part));
                    let scores = _mm512_add_ps(bias, _mm512_mul_ps(step, wide));
                    let first = 32 * i + 16 * half;
                    let lanes = (masks[c] >> first) as u16;
                    // SAFETY: the mask writes tokens `at + 64c + first ..` below `out.len()`
                    // (an empty mask writes none).
                    unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr().add(at + 64 * c + first), lanes, scores) };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> u64 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        *seed >> 33
    }

    #[test]
    fn every_instruction_set_sums_the_same_bytes() {
        let mut seed = 5;
        for (m, k, r) in [(32, 256, 200), (16, 64, 64), (3, 7, 131), (1, 256, 1), (300, 256, 70), (257, 256, 700)] {
            let tables: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed) as f32 / 1e8 - 20.0).collect();
            let codes: Vec<u8> = (0..m * r).map(|_| (lcg(&mut seed) % k as u64) as u8).collect();
            let lut = PqLut::quantise(&tables, k);
            let exact: Vec<f32> =
                (0..r).map(|t| (0..m).map(|j| tables[j * k + codes[j * r + t] as usize]).sum()).collect();
            let reference = {
                let mut out = vec![0.0; r];
                pq_scores_on(Isa::Scalar, &lut, &codes, r, 0, &mut out);
                out
            };
            for (e, s) in exact.iter().zip(&reference) {
                assert!((e - s).abs() <= lut.max_error() * 1.001 + 1e-3, "m {m} k {k}: {s} vs {e}");
            }
            for isa in crate::available() {
                let mut out = vec![0.0; r - r / 3];
                pq_scores_on(isa, &lut, &codes, r, 0, &mut out);
                assert_eq!(out, reference[..out.len()], "{isa:?} m {m} k {k} r {r}");
                // A slice of the run's tokens from the middle.
                let from = r / 5;
                let mut out = vec![0.0; r / 2];
                pq_scores_on(isa, &lut, &codes, r, from, &mut out);
                assert_eq!(out, reference[from..from + out.len()], "{isa:?} m {m} k {k} r {r} from {from}");
            }
        }
    }

    #[test]
    fn every_instruction_set_builds_the_same_tables() {
        let mut seed = 9;
        for (sub, rows) in [(4, 256), (4, 7), (2, 64), (8, 33), (16, 5), (3, 10)] {
            let centroids: Vec<half::f16> =
                (0..sub * rows).map(|_| half::f16::from_f32(lcg(&mut seed) as f32 / 1e9 - 1.0)).collect();
            let q: Vec<f32> = (0..sub).map(|_| lcg(&mut seed) as f32 / 1e9 - 1.0).collect();
            let mut reference = vec![0.0; rows];
            pq_table_on(Isa::Scalar, &centroids, &q, &mut reference);
            for isa in crate::available() {
                let mut out = vec![0.0; rows];
                pq_table_on(isa, &centroids, &q, &mut out);
                for (c, (&o, &r)) in out.iter().zip(&reference).enumerate() {
                    let exact: f64 = (0..sub).map(|i| centroids[c * sub + i].to_f64() * q[i] as f64).sum();
                    assert!((o as f64 - exact).abs() < 1e-5, "{isa:?} sub {sub} row {c}: {o} vs {exact}");
                    // Rows of 4 sum the same way on every path.
                    assert!(sub != VECTOR_SUB || o == r, "{isa:?} row {c}: {o} vs {r}");
                }
            }
        }
    }

    #[test]
    fn flat_tables_score_their_constant() {
        let lut = PqLut::quantise(&[1.5; 8], 4);
        let mut out = [0.0; 3];
        pq_scores(&lut, &[0, 1, 2, 3, 3, 0], 3, 0, &mut out);
        assert_eq!(out, [3.0; 3]);
        assert_eq!(lut.max_error(), 0.0);
    }
}
