//! Every SIMD path against the scalar reference (and f64 ground truth), on random data with
//! extreme values: large magnitudes, denormals, −∞ masks, every tail length.

use ctxfs_kernels::*;
use half::{bf16, f16};

mod common;
use common::Rng;

const LENGTHS: [usize; 14] = [0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 128, 1000];

fn check_close(got: f32, want: f64, scale: f64, what: &str) {
    let tol = 1e-5 * scale.max(1e-30) + 1e-30;
    assert!(((got as f64) - want).abs() <= tol, "{what}: got {got}, want {want} (tolerance {tol})");
}

fn dot_cases<E: Element>(make: impl Fn(f32) -> E, huge: f32, tiny: f32) {
    let mut rng = Rng(7);
    for isa in available() {
        for &n in &LENGTHS {
            for _ in 0..4 {
                let x: Vec<E> = (0..n).map(|_| make(rng.wild(huge, tiny))).collect();
                let q: Vec<f32> = (0..n).map(|_| rng.f32()).collect();
                let exact: f64 = x.iter().zip(&q).map(|(a, b)| a.to_f32() as f64 * *b as f64).sum();
                let magnitude: f64 = x.iter().zip(&q).map(|(a, b)| (a.to_f32() as f64 * *b as f64).abs()).sum();
                check_close(dot_on(isa, &x, &q), exact, magnitude, &format!("{} dot n={n}", isa.name()));
                check_close(dot_on(Isa::Scalar, &x, &q), exact, magnitude, "scalar dot");
            }
        }
    }
}

#[test]
fn dot_products_match_the_reference_for_every_type() {
    // f16: max 65504, smallest subnormal 6e-8.
    dot_cases(f16::from_f32, 60000.0, 1e-7);
    // bf16: f32 range, subnormals near 1e-39.
    dot_cases(bf16::from_f32, 1e30, 1e-39);
    dot_cases(|x| x, 1e30, 1e-40);
}

#[test]
fn subnormal_halves_convert_exactly() {
    let tiny = [f16::from_bits(1), f16::from_bits(0x03ff), f16::from_bits(0x8001)];
    let q = [1.0f32, 1.0, 1.0];
    for isa in available() {
        let got = dot_on(isa, &tiny, &q);
        assert_eq!(got, tiny.iter().map(|x| x.to_f32()).sum::<f32>(), "{}", isa.name());
        assert!(got > 0.0);
    }
}

#[test]
fn scores_over_a_block_of_keys_match() {
    let mut rng = Rng(11);
    for isa in available() {
        for d in [1, 8, 13, 64, 128, 130] {
            let n = 37;
            let keys: Vec<f16> = (0..n * d).map(|_| f16::from_f32(rng.wild(1000.0, 1e-6))).collect();
            let q: Vec<f32> = (0..d).map(|_| rng.f32()).collect();
            let scale = 1.0 / (d as f32).sqrt();
            let mut got = vec![0.0; n];
            let mut want = vec![0.0; n];
            scores_on(isa, &keys, &q, scale, &mut got);
            scores_on(Isa::Scalar, &keys, &q, scale, &mut want);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let mag: f64 =
                    keys[i * d..(i + 1) * d].iter().zip(&q).map(|(k, q)| (k.to_f32() * q * scale).abs() as f64).sum();
                check_close(*g, *w as f64, mag, &format!("{} scores d={d} row {i}", isa.name()));
            }
        }
    }
}

/// The multi-query scan equals one `dot` per (key, query), to the bit, on every path and
/// element type; slots between the rows of a stride stay untouched.
fn scores_many_cases<E: Element>(make: impl Fn(f32) -> E, huge: f32, tiny: f32) {
    let mut rng = Rng(13);
    for isa in available() {
        for (d, n, m) in
            [(1, 1, 1), (7, 5, 2), (16, 15, 4), (33, 9, 3), (48, 15, 5), (128, 15, 4), (128, 37, 8), (130, 4, 1)]
        {
            let keys: Vec<E> = (0..n * d).map(|_| make(rng.wild(huge, tiny))).collect();
            let queries: Vec<f32> = (0..m * d).map(|_| rng.f32()).collect();
            let stride = n + 3;
            let mut got = vec![f32::NAN; m * stride];
            scores_many_on(isa, &keys, &queries, d, &mut got, stride);
            for t in 0..m {
                for i in 0..n {
                    let want = dot_on(isa, &keys[i * d..(i + 1) * d], &queries[t * d..(t + 1) * d]);
                    let g = got[t * stride + i];
                    assert!(
                        g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                        "{} d={d} q{t} k{i}: {g} vs {want}",
                        isa.name()
                    );
                }
                assert!(
                    got[t * stride + n..(t + 1) * stride].iter().all(|x| x.is_nan()),
                    "{} wrote past row {t}",
                    isa.name()
                );
            }
        }
    }
}

#[test]
fn scores_of_many_queries_equal_their_dot_products() {
    scores_many_cases(f16::from_f32, 60000.0, 1e-7);
    scores_many_cases(bf16::from_f32, 1e30, 1e-39);
    scores_many_cases(|x| x, 1e30, 1e-40);
}

#[test]
fn dimension_major_scores_of_many_queries_match() {
    let mut rng = Rng(12);
    for isa in available() {
        for (d, nk, m) in [
            (1, 1, 1),
            (8, 16, 4),
            (13, 37, 5),
            (64, 33, 9),
            (128, 512, 4),
            (128, 17, 3),
            (128, 64, 8),
            (64, 48, 13),
            (7, 81, 12),
        ] {
            let keys: Vec<f32> = (0..nk * d).map(|_| rng.wild(1000.0, 1e-6)).collect();
            let mut kt = vec![0.0; nk * d];
            for k in 0..nk {
                for j in 0..d {
                    kt[j * nk + k] = keys[k * d + j];
                }
            }
            let queries: Vec<f32> = (0..m * d).map(|_| rng.f32()).collect();
            let mut got = vec![f32::NAN; m * nk];
            scores_dim_major_on(isa, &kt, nk, &queries, &mut got);
            for q in 0..m {
                for k in 0..nk {
                    let row = |i: usize| keys[k * d + i] as f64 * queries[q * d + i] as f64;
                    let want: f64 = (0..d).map(row).sum();
                    let mag: f64 = (0..d).map(|i| row(i).abs()).sum();
                    check_close(got[q * nk + k], want, mag, &format!("{} d={d} nk={nk} q{q} k{k}", isa.name()));
                }
            }
        }
    }
}

#[test]
fn max_and_exp_sums_handle_masks_and_extremes() {
    let mut rng = Rng(5);
    for isa in available() {
        for &n in &LENGTHS {
            let z: Vec<f32> = (0..n)
                .map(|_| match rng.next() % 8 {
                    0 => f32::NEG_INFINITY,
                    1 => -1e30,
                    2 => rng.f32() * 200.0,
                    _ => rng.f32() * 20.0,
                })
                .collect();
            let m = max_on(isa, &z);
            assert_eq!(m, z.iter().copied().fold(f32::NEG_INFINITY, f32::max), "{} max n={n}", isa.name());
            let mut e = z.clone();
            let sum = exp_sub_on(isa, &mut e, m);
            let mut want_sum = 0.0f64;
            for (i, (&zi, &ei)) in z.iter().zip(&e).enumerate() {
                let want = if zi == f32::NEG_INFINITY { 0.0 } else { ((zi - m) as f64).exp() };
                want_sum += want;
                if zi == f32::NEG_INFINITY {
                    assert_eq!(ei, 0.0, "a masked score must weigh exactly 0");
                } else if want > 1e-30 {
                    assert!(
                        ((ei as f64) - want).abs() <= 2e-6 * want,
                        "{} exp n={n} i={i}: {ei} vs {want}",
                        isa.name()
                    );
                } else {
                    assert!((0.0..=1e-30).contains(&(ei as f64)), "{} exp underflow: {ei}", isa.name());
                }
                assert!(ei.is_finite() && ei <= 1.0 + 1e-6);
            }
            check_close(sum, want_sum, want_sum, &format!("{} exp sum n={n}", isa.name()));
        }
        // All masked: nothing to weigh, and no NaN.
        let mut all = vec![f32::NEG_INFINITY; 40];
        assert_eq!(max_on(isa, &all), f32::NEG_INFINITY);
        assert_eq!(exp_sub_on(isa, &mut all, 0.0), 0.0);
        assert!(all.iter().all(|&x| x == 0.0));
    }
}

#[test]
fn weighted_value_sums_match() {
    let mut rng = Rng(9);
    for isa in available() {
        // Whole chunks of registers, chunks and the vectors left, and columns left past them.
        for d in [1, 7, 16, 31, 64, 128, 200, 256] {
            let n = 50;
            let values: Vec<bf16> = (0..n * d).map(|_| bf16::from_f32(rng.wild(1e20, 1e-39))).collect();
            let weights: Vec<f32> = (0..n).map(|_| rng.f32().abs()).collect();
            let mut got = vec![0.5; d];
            let mut want = vec![0.5; d];
            weighted_sum_on(isa, &mut got, &weights, &values);
            weighted_sum_on(Isa::Scalar, &mut want, &weights, &values);
            for j in 0..d {
                let mag: f64 =
                    0.5 + (0..n).map(|i| (weights[i] * values[i * d + j].to_f32()).abs() as f64).sum::<f64>();
                check_close(got[j], want[j] as f64, mag, &format!("{} weighted d={d} j={j}", isa.name()));
            }
            // f16 values, widened by another instruction than bf16's.
            let halves: Vec<f16> = (0..n * d).map(|_| f16::from_f32(rng.f32() * 8.0 - 4.0)).collect();
            let (mut got, mut want) = (vec![0.25; d], vec![0.25; d]);
            weighted_sum_on(isa, &mut got, &weights, &halves);
            weighted_sum_on(Isa::Scalar, &mut want, &weights, &halves);
            for j in 0..d {
                let mag = 0.25 + (0..n).map(|i| (weights[i] * halves[i * d + j].to_f32()).abs() as f64).sum::<f64>();
                check_close(got[j], want[j] as f64, mag, &format!("{} weighted f16 d={d} j={j}", isa.name()));
            }
        }
    }
}

/// Exact attention in f64, the ground truth.
fn exact(q: &[f32], keys: &[f16], values: &[f16], scale: f32) -> Vec<f64> {
    let d = q.len();
    let z: Vec<f64> = keys
        .chunks(d)
        .map(|k| k.iter().zip(q).map(|(a, b)| a.to_f32() as f64 * *b as f64).sum::<f64>() * scale as f64)
        .collect();
    let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = w.iter().sum();
    (0..d)
        .map(|j| w.iter().enumerate().map(|(i, wi)| wi * values[i * d + j].to_f32() as f64).sum::<f64>() / l)
        .collect()
}

#[test]
fn partial_attention_merges_exactly() {
    let mut rng = Rng(3);
    let d = 128;
    let n = 700;
    let keys: Vec<f16> = (0..n * d).map(|_| f16::from_f32(rng.f32() * 3.0)).collect();
    let values: Vec<f16> = (0..n * d).map(|_| f16::from_f32(rng.f32())).collect();
    let q: Vec<f32> = (0..d).map(|_| rng.f32() * 2.0).collect();
    let scale = 1.0 / (d as f32).sqrt();
    let want = exact(&q, &keys, &values, scale);
    let norm: f64 = want.iter().map(|x| x * x).sum::<f64>().sqrt();
    for isa in available() {
        let whole = Partial::attend_on(isa, &q, &keys, &values, scale);
        // Three uneven parts, and an empty one, merge to the same answer.
        let cuts = [0, 13, 13, 400, n];
        let parts: Vec<Partial> = cuts
            .windows(2)
            .map(|c| Partial::attend_on(isa, &q, &keys[c[0] * d..c[1] * d], &values[c[0] * d..c[1] * d], scale))
            .collect();
        assert!(parts[1].is_empty());
        let merged = Partial::merge(&parts);
        for o in [&whole.o, &merged.o] {
            let err: f64 = o.iter().zip(&want).map(|(a, b)| (*a as f64 - b).powi(2)).sum::<f64>().sqrt() / norm;
            assert!(err < 1e-5, "{}: relative error {err}", isa.name());
        }
        assert!((whole.lse() - merged.lse()).abs() < 1e-4, "{} lse {} vs {}", isa.name(), whole.lse(), merged.lse());
    }
    assert!(Partial::merge(&[Partial::empty(4), Partial::empty(4)]).is_empty());
}

#[test]
fn masked_scores_take_no_weight() {
    let d = 8;
    let values: Vec<f32> = (0..3 * d).map(|i| (i / d) as f32).collect();
    for isa in available() {
        let mut z = vec![f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY];
        let p = Partial::from_scores_on(isa, &mut z, &values, d);
        assert_eq!(p.o, vec![1.0; d], "{}", isa.name());
        assert_eq!((p.m, p.l), (0.0, 1.0));
    }
}

#[test]
fn this_machine_uses_its_best_instruction_set() {
    println!("detected {:?}, active {:?}, available {:?}", detected(), active(), available());
    assert!(available().contains(&Isa::Scalar));
    assert!(active() <= detected());
    if cfg!(target_arch = "aarch64") {
        assert_eq!(detected(), Isa::Neon, "NEON is aarch64's baseline");
        assert_eq!(available(), [Isa::Scalar, Isa::Neon]);
    } else {
        assert!(!available().contains(&Isa::Neon), "NEON is not an x86 instruction set");
    }
}
