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
use std::ops::Range;

/// Entries of a quantised table: a code is one byte, so 256 whatever the centroid count
/// (entries beyond it are 0 and never looked up by valid codes).
pub const PQ_TABLE: usize = 256;

/// Entries of a table that one 128-byte permute looks up ([`PqLut::narrow`]): codes of
/// 7 bits or fewer (`PqParams::bits`).
pub const NARROW_TABLE: usize = 128;

/// A query's lookup tables, one byte per entry: entry `(j, c)` stands for
/// `min_j + step · byte`, `min_j` the smallest entry of table `j` and `step` the widest
/// table's range over 255 (one step for all tables, so that byte sums add up).
#[derive(Debug, Clone, PartialEq)]
pub struct PqLut {
    pub(crate) bytes: Vec<u8>,
    /// Every table has at most [`NARROW_TABLE`] entries: its upper half is zeros, so a code's
    /// low 7 bits find its entry and a code with the top bit finds 0, as the wide lookup does.
    pub(crate) narrow: bool,
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
        PqLut { bytes, narrow: k <= NARROW_TABLE, bias, step }
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

    /// The cut `cut` as a byte sum: the least sum whose score reaches it in
    /// [`f32::total_cmp`]'s order, which every larger sum's reaches too (the score grows with
    /// the sum: `step ≥ 0`, and adding and multiplying round monotonically); `None` when no
    /// sum of `m` bytes reaches it. A scan then compares integers, and the tokens it keeps
    /// are exactly those whose score reaches the cut.
    pub fn least_sum_reaching(&self, cut: f32) -> Option<u32> {
        let reaches = |sum: u32| self.score(sum).total_cmp(&cut).is_ge();
        let most = 255 * self.subspaces() as u32;
        if !reaches(most) {
            return None;
        }
        // `reaches(hi)` holds throughout.
        let (mut lo, mut hi) = (0, most);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            if reaches(mid) {
                hi = mid;
            } else {
                lo = mid + 1;
            }
        }
        Some(lo)
    }
}

/// A run of `tokens` tokens' codes, subspace-major (`codes`: `m · tokens` bytes), whose first
/// token is `first` of the context.
#[derive(Debug, Clone, Copy)]
pub struct CodeRun<'a> {
    pub codes: &'a [u8],
    pub tokens: usize,
    pub first: u32,
}

/// A cut as [`pq_reaching`] applies it: the least byte sum that reaches it
/// ([`PqLut::least_sum_reaching`]), and how many of the tokens reaching it to keep.
#[derive(Debug, Clone, Copy)]
pub struct SumCut {
    pub least: u32,
    pub cap: usize,
}

/// One query's tokens whose score reaches its cut ([`pq_reaching`]; the GPU scan's
/// `PqScanner::reaching`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reached {
    /// How many reach it.
    pub count: usize,
    /// Of those, the first `cap` found (all of them when `count ≤ cap`), as (token, score):
    /// in token order from this core ([`pq_reaching`]), in no order from a device.
    pub tokens: Vec<(u32, f32)>,
}

impl Reached {
    /// Counts token `token` of the context, keeping it while fewer than `cap` are kept.
    #[inline]
    fn add(&mut self, token: u32, score: f32, cap: usize) {
        self.count += 1;
        if self.tokens.len() < cap {
            self.tokens.push((token, score));
        }
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
            // checked above; the narrow lookup only for a narrow table.
            unsafe {
                if lut.narrow {
                    avx512vbmi::pq_scores::<false>(lut, codes, r, from, out)
                } else {
                    avx512vbmi::pq_scores::<true>(lut, codes, r, from, out)
                }
            }
        }
        _ => 0,
    };
    scalar_scores(lut, codes, r, from + done, &mut out[done..]);
}

/// Of the run's tokens `tokens` (positions within it), those whose byte sum reaches
/// `cuts[i].least` under `luts[i]`, added to `outs[i]` in token order as (context token,
/// score) while it keeps fewer than `cuts[i].cap`; `outs[i].count` counts every one. The
/// scores are [`pq_scores`]' bit for bit, and only these are made: a caller that wants a
/// query's best reads a few thousand scores instead of every token's. Several queries over
/// the same codes (a GQA group's q heads) are scanned together, up to [`REACH_QUERIES`] at
/// a time over a block's tokens: the block's codes come from memory once for all of them,
/// and each query's lookups find them in the L1 cache. A cut of `u32::MAX` is
/// reached by none (a query no sum reaches, [`PqLut::least_sum_reaching`]'s `None`).
pub fn pq_reaching(luts: &[PqLut], run: CodeRun<'_>, tokens: Range<usize>, cuts: &[SumCut], outs: &mut [Reached]) {
    pq_reaching_on(crate::active(), luts, run, tokens, cuts, outs)
}

/// Queries [`pq_reaching`] scans at once over a block's tokens (at most
/// [`SHORT_REACH_TOKENS`]).
pub const REACH_QUERIES: usize = 4;

/// Tokens up to which [`pq_reaching`] takes [`REACH_QUERIES`] queries at a time: two chunks
/// of 64 (a 4 KiB code block holds 126 at `m` = 32). Over a longer range it takes one at a
/// time, four chunks at once, each query's tables loaded once for 256 tokens: over a long
/// range from memory (an in-memory run's slice of 1,024 tokens), four queries' tables, 32 KB,
/// and the codes do not fit the L1 cache together, and that scan was the slower.
pub const SHORT_REACH_TOKENS: usize = 128;

pub fn pq_reaching_on(
    isa: Isa,
    luts: &[PqLut],
    run: CodeRun<'_>,
    tokens: Range<usize>,
    cuts: &[SumCut],
    outs: &mut [Reached],
) {
    let m = luts.first().map_or(0, PqLut::subspaces);
    assert!(
        luts.iter().all(|l| l.subspaces() == m) && cuts.len() == luts.len() && outs.len() == luts.len(),
        "{} tables of {m} subspaces, {} cuts, {} outputs",
        luts.len(),
        cuts.len(),
        outs.len()
    );
    assert!(
        run.codes.len() == m * run.tokens && tokens.start <= tokens.end && tokens.end <= run.tokens,
        "{} code bytes for {m} subspaces of {} tokens, tokens {tokens:?} scanned",
        run.codes.len(),
        run.tokens
    );
    let at_once = if tokens.len() <= SHORT_REACH_TOKENS { REACH_QUERIES } else { 1 };
    for ((luts, cuts), outs) in luts.chunks(at_once).zip(cuts.chunks(at_once)).zip(outs.chunks_mut(at_once)) {
        let done = match usable(isa) {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if vbmi() && m <= MAX_U16_SUBSPACES => {
                use avx512vbmi::pq_reaching_of as scan;
                let tokens = tokens.clone();
                // SAFETY: `vbmi` checked the CPU has AVX-512 F, BW and VBMI; the lengths are
                // checked above, a chunk holds 1 to REACH_QUERIES queries, and the narrow
                // lookup serves only chunks whose every table is narrow.
                unsafe {
                    if luts.iter().all(|l| l.narrow) {
                        scan::<false>(luts, run, tokens, cuts, outs)
                    } else {
                        scan::<true>(luts, run, tokens, cuts, outs)
                    }
                }
            }
            _ => 0,
        };
        for ((lut, &cut), out) in luts.iter().zip(cuts).zip(outs.iter_mut()) {
            scalar_reaching(lut, run, tokens.start + done..tokens.end, cut, out);
        }
    }
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

/// Tokens `from .. from + out.len()` of the run, 64 at a time ([`scalar_sums`]).
fn scalar_scores(lut: &PqLut, codes: &[u8], r: usize, from: usize, out: &mut [f32]) {
    let mut sums = [0u32; 64];
    for (c, chunk) in out.chunks_mut(64).enumerate() {
        let sums = &mut sums[..chunk.len()];
        scalar_sums(lut, codes, r, from + c * 64, sums);
        for (o, &s) in chunk.iter_mut().zip(sums.iter()) {
            *o = lut.score(s);
        }
    }
}

/// [`pq_reaching`]'s tokens `tokens` of the run, 64 at a time ([`scalar_sums`]).
fn scalar_reaching(lut: &PqLut, run: CodeRun<'_>, tokens: Range<usize>, cut: SumCut, out: &mut Reached) {
    let mut sums = [0u32; 64];
    for at in tokens.clone().step_by(64) {
        let sums = &mut sums[..(tokens.end - at).min(64)];
        scalar_sums(lut, run.codes, run.tokens, at, sums);
        for (t, &s) in (at..).zip(sums.iter()) {
            if s >= cut.least {
                out.add(run.first + t as u32, lut.score(s), cut.cap);
            }
        }
    }
}

/// The byte sums of tokens `at .. at + sums.len()` of the run, side by side (independent
/// loads, not one long chain of adds per token).
fn scalar_sums(lut: &PqLut, codes: &[u8], r: usize, at: usize, sums: &mut [u32]) {
    sums.fill(0);
    let end = at + sums.len();
    for (table, sub) in lut.bytes.chunks_exact(PQ_TABLE).zip(codes.chunks_exact(r.max(1))) {
        for (s, &code) in sums.iter_mut().zip(&sub[at..end]) {
            *s += table[code as usize] as u32;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512vbmi {
    use super::{CodeRun, PqLut, Reached, SumCut, PQ_TABLE};
    use std::arch::x86_64::*;
    use std::ops::Range;

    /// Chunks of 64 tokens summed side by side, so that a subspace's table is loaded once
    /// for all of them.
    const CHUNKS: usize = 4;

    /// Tokens `from .. from + out.len()`, 64 at a time (the last chunk's bytes and scores
    /// masked); returns how many tokens it scored. Runs of [`CHUNKS`] chunks while they
    /// fill, then the 1 to 4 chunks left side by side: a short run (a block's 126 tokens at
    /// `m` = 32) loads each subspace's table once for its two chunks, and does not look up
    /// chunks that are wholly masked.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VBMI; `codes.len() == m · r`, `from + out.len() ≤ r`
    /// and `m ≤ MAX_U16_SUBSPACES` (`m` = `lut.subspaces()`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(super) unsafe fn pq_scores<const WIDE: bool>(
        lut: &PqLut,
        codes: &[u8],
        r: usize,
        from: usize,
        out: &mut [f32],
    ) -> usize {
        let whole = out.len() / (64 * CHUNKS) * (64 * CHUNKS);
        for at in (0..whole).step_by(64 * CHUNKS) {
            // SAFETY: as this function's; tokens `at .. at + 256 ≤ out.len()`.
            unsafe { chunks::<CHUNKS, WIDE>(lut, codes, r, from, at, out) };
        }
        // SAFETY: as this function's; `whole < out.len()` when a chunk is left.
        unsafe {
            match (out.len() - whole).div_ceil(64) {
                0 => {}
                1 => chunks::<1, WIDE>(lut, codes, r, from, whole, out),
                2 => chunks::<2, WIDE>(lut, codes, r, from, whole, out),
                3 => chunks::<3, WIDE>(lut, codes, r, from, whole, out),
                _ => chunks::<CHUNKS, WIDE>(lut, codes, r, from, whole, out),
            }
        }
        out.len()
    }

    /// [`pq_reaching`] of 1 to [`super::REACH_QUERIES`] queries, as many as `luts` holds.
    ///
    /// # Safety
    /// As [`pq_reaching`]', with `Q` the number of tables.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(super) unsafe fn pq_reaching_of<const WIDE: bool>(
        luts: &[PqLut],
        run: CodeRun<'_>,
        tokens: Range<usize>,
        cuts: &[SumCut],
        outs: &mut [Reached],
    ) -> usize {
        // SAFETY: as this function's, `Q` being the number of tables.
        unsafe {
            match luts.len() {
                1 => pq_reaching::<1, WIDE>(luts, run, tokens, cuts, outs),
                2 => pq_reaching::<2, WIDE>(luts, run, tokens, cuts, outs),
                3 => pq_reaching::<3, WIDE>(luts, run, tokens, cuts, outs),
                _ => pq_reaching::<{ super::REACH_QUERIES }, WIDE>(luts, run, tokens, cuts, outs),
            }
        }
    }

    /// [`super::pq_reaching`] of `Q` queries (1 to [`super::REACH_QUERIES`]) over the run's
    /// tokens `tokens`: two chunks at a time for more than two queries (the sums of four
    /// queries' two chunks fill half the vector registers), four for fewer; returns how many
    /// tokens it scanned (all of them).
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VBMI; every table has `m` subspaces, `m ≤
    /// MAX_U16_SUBSPACES`; `run.codes.len() == m · run.tokens`, `tokens.end ≤ run.tokens`;
    /// `luts`, `cuts` and `outs` have `Q` elements.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    pub(super) unsafe fn pq_reaching<const Q: usize, const WIDE: bool>(
        luts: &[PqLut],
        run: CodeRun<'_>,
        tokens: Range<usize>,
        cuts: &[SumCut],
        outs: &mut [Reached],
    ) -> usize {
        let luts: &[PqLut; Q] = luts.try_into().expect("Q tables");
        let (len, from) = (tokens.len(), tokens.start);
        let step = if Q > 2 { 2 } else { CHUNKS };
        let whole = len / (64 * step) * (64 * step);
        for at in (0..whole).step_by(64 * step) {
            // SAFETY: as this function's; tokens `at .. at + 64 · step ≤ len`.
            unsafe {
                if Q > 2 {
                    reaching::<Q, 2, WIDE>(luts, run, from, at, len, cuts, outs)
                } else {
                    reaching::<Q, CHUNKS, WIDE>(luts, run, from, at, len, cuts, outs)
                }
            }
        }
        // SAFETY: as this function's; `whole < len` when a chunk is left, fewer than `step`.
        unsafe {
            match (len - whole).div_ceil(64) {
                0 => {}
                1 => reaching::<Q, 1, WIDE>(luts, run, from, whole, len, cuts, outs),
                2 => reaching::<Q, 2, WIDE>(luts, run, from, whole, len, cuts, outs),
                3 => reaching::<Q, 3, WIDE>(luts, run, from, whole, len, cuts, outs),
                _ => reaching::<Q, CHUNKS, WIDE>(luts, run, from, whole, len, cuts, outs),
            }
        }
        len
    }

    /// The masks of `N` chunks of 64 tokens from `at` of `len`: bit `t` of chunk `c` is
    /// token `at + 64c + t`, set below `len`.
    fn chunk_masks<const N: usize>(at: usize, len: usize) -> [__mmask64; N] {
        std::array::from_fn(|c| match (len - at).saturating_sub(64 * c) {
            w if w >= 64 => !0,
            w => (1u64 << w) - 1,
        })
    }

    /// `N` chunks of 64 tokens from `at` (of `out`; beyond its end, masked), scored. The
    /// sums ([`sums`]) are interleaved back into token order once per chunk.
    ///
    /// # Safety
    /// As [`pq_scores`]', and `at < out.len()`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn chunks<const N: usize, const WIDE: bool>(
        lut: &PqLut,
        codes: &[u8],
        r: usize,
        from: usize,
        at: usize,
        out: &mut [f32],
    ) {
        let (bias, step) = (_mm512_set1_ps(lut.bias), _mm512_set1_ps(lut.step));
        let masks = chunk_masks::<N>(at, out.len());
        // SAFETY: as this function's: the masks cover tokens `from + at ..` below
        // `from + out.len() ≤ r`.
        let [(even, odd)] = unsafe { sums::<1, N, WIDE>(&[lut], codes, r, from + at, &masks) };
        for c in 0..N {
            for (i, sums) in in_token_order(even[c], odd[c]).into_iter().enumerate() {
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

    /// A chunk's sums in token order, tokens 0..32 then 32..64, from its even tokens' sums and
    /// its odd tokens' ([`sums`]).
    #[target_feature(enable = "avx512f,avx512bw")]
    #[inline]
    fn in_token_order(even: __m512i, odd: __m512i) -> [__m512i; 2] {
        // Word `i` of the even sums is token 2i, of the odd sums token 2i + 1 (index 32 + i
        // of the pair).
        let order = |from: i16| {
            let words: [i16; 32] = std::array::from_fn(|k| from + (k as i16 / 2) + if k % 2 == 1 { 32 } else { 0 });
            // SAFETY: 32 words are 64 readable bytes.
            unsafe { _mm512_loadu_si512(words.as_ptr().cast()) }
        };
        [_mm512_permutex2var_epi16(even, order(0), odd), _mm512_permutex2var_epi16(even, order(16), odd)]
    }

    /// `N` chunks of 64 tokens from `at` of the `len` tokens from `from` of the run, and of
    /// those, per query, the tokens whose sum reaches its cut, added in token order. A chunk
    /// none of whose tokens reaches a query's cut (nearly all, for a query's best) costs one
    /// compare per half.
    ///
    /// # Safety
    /// As [`pq_reaching`]', with `from + len ≤ run.tokens` and `at < len`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    unsafe fn reaching<const Q: usize, const N: usize, const WIDE: bool>(
        luts: &[PqLut; Q],
        run: CodeRun<'_>,
        from: usize,
        at: usize,
        len: usize,
        cuts: &[SumCut],
        outs: &mut [Reached],
    ) {
        let masks = chunk_masks::<N>(at, len);
        // SAFETY: as this function's: the masks cover tokens `from + at ..` below
        // `from + len ≤ run.tokens`.
        let sums = unsafe { sums::<Q, N, WIDE>(&luts.each_ref(), run.codes, run.tokens, from + at, &masks) };
        for (((lut, cut), out), (even, odd)) in luts.iter().zip(cuts).zip(outs.iter_mut()).zip(sums) {
            // Sums are at most 255 · m ≤ u16::MAX: a cut above every u16 is reached by none.
            let Ok(least) = u16::try_from(cut.least) else { continue };
            let least = _mm512_set1_epi16(least as i16);
            for c in 0..N {
                // Word `i` of the even sums is token 2i of the chunk, of the odd ones 2i + 1;
                // a masked token's sum is that of code 0 and must not count.
                let valid = (len - at).saturating_sub(64 * c).min(64);
                let below = |n: usize| if n >= 32 { !0u32 } else { (1u32 << n) - 1 };
                let even_hits = _mm512_cmpge_epu16_mask(even[c], least) & below(valid.div_ceil(2));
                let odd_hits = _mm512_cmpge_epu16_mask(odd[c], least) & below(valid / 2);
                if even_hits | odd_hits == 0 {
                    continue;
                }
                let [low, high] = in_token_order(even[c], odd[c]);
                let mut words = [0u16; 64];
                // SAFETY: 64 u16 are two 64-byte vectors' worth of writable bytes.
                unsafe {
                    _mm512_storeu_si512(words.as_mut_ptr().cast(), low);
                    _mm512_storeu_si512(words.as_mut_ptr().add(32).cast(), high);
                }
                let hits = u64::from(_mm512_cmpge_epu16_mask(low, least))
                    | u64::from(_mm512_cmpge_epu16_mask(high, least)) << 32;
                let mut hits = hits & if valid == 64 { !0 } else { (1u64 << valid) - 1 };
                let first = run.first + (from + at + 64 * c) as u32;
                while hits != 0 {
                    let i = hits.trailing_zeros();
                    hits &= hits - 1;
                    out.add(first + i, lut.score(u32::from(words[i as usize])), cut.cap);
                }
            }
        }
    }

    /// Per query, the byte sums of `N` chunks of 64 tokens from token `at` of a run of `r`,
    /// the bytes of tokens outside `masks` read as code 0: per chunk, the even tokens' sums
    /// and the odd tokens' as 16-bit words. Query after query for each subspace: the codes
    /// come from memory for the first, from the L1 cache for the rest (loading them once and
    /// keeping them in registers for every query was the slower: the compiler spills them).
    /// The looked-up bytes are added as words (a word is even + 256 · odd, summed
    /// modulo 2^16) and the odd bytes apart; the even sums are the difference, exact since
    /// they are below 2^16: two adds and a shift per looked-up vector, not three and a mask.
    ///
    /// `WIDE`: the tables' upper halves are looked up too (two permutes and a blend); else
    /// every table is narrow ([`PqLut::narrow`]: its upper half zeros) and one permute looks
    /// up the lower half, zeroing the codes with the top bit, as the upper half would.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VBMI; every table has `m` subspaces, `m ≤
    /// MAX_U16_SUBSPACES`; `codes.len() == m · r`; chunk `c`'s mask covers only tokens below
    /// `r` from `at + 64c`; without `WIDE`, every table is narrow.
    #[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
    #[inline]
    unsafe fn sums<const Q: usize, const N: usize, const WIDE: bool>(
        luts: &[&PqLut; Q],
        codes: &[u8],
        r: usize,
        at: usize,
        masks: &[__mmask64; N],
    ) -> [([__m512i; N], [__m512i; N]); Q] {
        let mut words = [[_mm512_setzero_si512(); N]; Q];
        let mut odd = [[_mm512_setzero_si512(); N]; Q];
        let m = luts[0].subspaces();
        for j in 0..m {
            for q in 0..Q {
                let t = luts[q].bytes[j * PQ_TABLE..(j + 1) * PQ_TABLE].as_ptr();
                // SAFETY: each table is 256 bytes, read as four 64-byte vectors (the upper two
                // only when wide).
                let (t0, t1) = unsafe { (_mm512_loadu_si512(t.cast()), _mm512_loadu_si512(t.add(64).cast())) };
                let (t2, t3) = if WIDE {
                    // SAFETY: as above.
                    unsafe { (_mm512_loadu_si512(t.add(128).cast()), _mm512_loadu_si512(t.add(192).cast())) }
                } else {
                    (_mm512_setzero_si512(), _mm512_setzero_si512())
                };
                for c in 0..N {
                    // SAFETY: the mask reads bytes `j·r + at + 64c ..` of subspace `j`, below
                    // `(j + 1)·r ≤ m·r` of `codes` (an empty mask reads none). Loaded again
                    // for each query, from the L1 cache after the first.
                    let idx =
                        unsafe { _mm512_maskz_loadu_epi8(masks[c], codes.as_ptr().add(j * r + at + 64 * c).cast()) };
                    // Entries 0..128 and 128..256 by the code's low 7 bits; its top bit picks.
                    let top = _mm512_movepi8_mask(idx);
                    let v = if WIDE {
                        let low = _mm512_permutex2var_epi8(t0, idx, t1);
                        let high = _mm512_permutex2var_epi8(t2, idx, t3);
                        _mm512_mask_blend_epi8(top, low, high)
                    } else {
                        _mm512_maskz_permutex2var_epi8(!top, t0, idx, t1)
                    };
                    words[q][c] = _mm512_add_epi16(words[q][c], v);
                    odd[q][c] = _mm512_add_epi16(odd[q][c], _mm512_srli_epi16::<8>(v));
                }
            }
        }
        std::array::from_fn(|q| {
            (std::array::from_fn(|c| _mm512_sub_epi16(words[q][c], _mm512_slli_epi16::<8>(odd[q][c]))), odd[q])
        })
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
        for (m, k, r) in
            [(32, 256, 200), (32, 128, 200), (16, 64, 64), (3, 7, 131), (1, 256, 1), (300, 256, 70), (257, 256, 700)]
        {
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

    /// A code beyond its table's entries (which a checksummed code block does not hold, but a
    /// bug might) finds the zero padding on every path, narrow tables' one-permute lookup too.
    #[test]
    fn codes_beyond_a_table_find_its_padding() {
        let mut seed = 3;
        for (m, k, r) in [(32, 100, 200), (8, 128, 130), (32, 200, 200)] {
            let tables: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed) as f32 / 1e8 - 20.0).collect();
            let lut = PqLut::quantise(&tables, k);
            assert_eq!(lut.narrow, k <= NARROW_TABLE);
            let codes: Vec<u8> = (0..m * r).map(|_| lcg(&mut seed) as u8).collect();
            let sums: Vec<u32> = (0..r)
                .map(|t| {
                    let entry = |j: usize| lut.bytes[j * PQ_TABLE + codes[j * r + t] as usize] as u32;
                    (0..m).map(entry).sum()
                })
                .collect();
            assert!(codes.iter().any(|&c| c as usize >= k));
            for isa in crate::available() {
                let mut out = vec![0.0; r];
                pq_scores_on(isa, &lut, &codes, r, 0, &mut out);
                let want: Vec<f32> = sums.iter().map(|&s| lut.score(s)).collect();
                assert_eq!(out, want, "{isa:?} m {m} k {k}");
                let run = CodeRun { codes: &codes, tokens: r, first: 0 };
                let mut reached = [Reached::default()];
                let cut = [SumCut { least: 0, cap: usize::MAX }];
                pq_reaching_on(isa, std::slice::from_ref(&lut), run, 0..r, &cut, &mut reached);
                let every: Vec<(u32, f32)> = want.iter().enumerate().map(|(t, &s)| (t as u32, s)).collect();
                assert_eq!(reached[0].tokens, every, "{isa:?} m {m} k {k} reaching");
            }
        }
    }

    #[test]
    fn tokens_reaching_a_cut_are_those_whose_scores_reach_it() {
        let mut seed = 11;
        for (m, k, r) in
            [(32, 256, 300), (32, 128, 300), (16, 64, 64), (3, 7, 131), (1, 256, 1), (257, 256, 200), (300, 256, 70)]
        {
            // Up to six queries over the same codes (more than one scan takes at once), each
            // with its own tables and cut.
            let luts: Vec<PqLut> = (0..6)
                .map(|_| {
                    let tables: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed) as f32 / 1e8 - 20.0).collect();
                    PqLut::quantise(&tables, k)
                })
                .collect();
            let codes: Vec<u8> = (0..m * r).map(|_| (lcg(&mut seed) % k as u64) as u8).collect();
            let run = CodeRun { codes: &codes, tokens: r, first: 1_000 };
            let scores: Vec<Vec<f32>> = luts
                .iter()
                .map(|lut| {
                    let mut scores = vec![0.0; r];
                    pq_scores_on(Isa::Scalar, lut, &codes, r, 0, &mut scores);
                    scores
                })
                .collect();
            // Cuts at a token's score (ties reach it), between scores, above and below all.
            let cuts_of = |scores: &[f32]| {
                let mut sorted = scores.to_vec();
                sorted.sort_by(|a, b| b.total_cmp(a));
                [sorted[r / 7], sorted[r / 2], sorted[0], sorted[r - 1], sorted[0] + 1.0, f32::NEG_INFINITY]
            };
            for (pick, queries) in [(0, 1), (1, 2), (2, 3), (3, 4), (4, 6), (5, 5)] {
                // Query `i` takes cut `(pick + i) % 6` of its own scores.
                let cuts: Vec<f32> = (0..queries).map(|i| cuts_of(&scores[i])[(pick + i) % 6]).collect();
                let want: Vec<Vec<(u32, f32)>> = (0..queries)
                    .map(|i| {
                        (r / 5..r)
                            .filter(|&t| scores[i][t].total_cmp(&cuts[i]).is_ge())
                            .map(|t| (run.first + t as u32, scores[i][t]))
                            .collect()
                    })
                    .collect();
                for (i, &cut) in cuts.iter().enumerate() {
                    if luts[i].least_sum_reaching(cut).is_none() {
                        assert!(want[i].is_empty(), "m {m}: no sum reaches {cut}, yet {} scores do", want[i].len());
                    }
                }
                for isa in crate::available() {
                    for halve in [false, true] {
                        let sum_cuts: Vec<SumCut> = (0..queries)
                            .map(|i| SumCut {
                                least: luts[i].least_sum_reaching(cuts[i]).unwrap_or(u32::MAX),
                                cap: if halve { want[i].len() / 2 } else { usize::MAX },
                            })
                            .collect();
                        let mut outs = vec![Reached::default(); queries];
                        pq_reaching_on(isa, &luts[..queries], run, r / 5..r, &sum_cuts, &mut outs);
                        for (i, out) in outs.iter().enumerate() {
                            let why = format!("{isa:?} m {m} k {k} r {r} query {i} of {queries}, cut {}", cuts[i]);
                            assert_eq!(out.count, want[i].len(), "{why}");
                            // In token order: the first `cap` of them when they are more.
                            let bits = |v: &[(u32, f32)]| v.iter().map(|&(t, s)| (t, s.to_bits())).collect::<Vec<_>>();
                            let cap = sum_cuts[i].cap.min(want[i].len());
                            assert_eq!(bits(&out.tokens), bits(&want[i][..cap]), "{why}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_least_sum_reaching_a_cut_is_exact() {
        let lut = PqLut::quantise(&[0.0, 0.3, 1.7, -2.0, 0.9, 4.0], 3);
        for cut in [-2.0f32, -1.99, 0.0, 0.5, 3.0, 5.7, 5.71, f32::NEG_INFINITY] {
            match lut.least_sum_reaching(cut) {
                Some(least) => {
                    assert!(lut.score(least) >= cut, "cut {cut}: sum {least}");
                    assert!(least == 0 || lut.score(least - 1) < cut, "cut {cut}: sum {least} is not the least");
                }
                None => assert!(lut.score(510) < cut, "cut {cut}: the greatest sum reaches it"),
            }
        }
        assert_eq!(lut.least_sum_reaching(f32::INFINITY), None);
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
