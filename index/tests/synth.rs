//! The generator's statistics, measured: what DESIGN.md says real attention looks like.

use ctxfs_index::synth::{head, stats, SynthParams};

#[test]
fn generated_heads_look_like_real_attention() {
    // At the length the sharpness range is calibrated for (AlayaDB Fig. 5, ~128K tokens).
    let p = SynthParams { tokens: 131072, head_dim: 128, group: 2, seed: 7 };
    let (mut needed, mut sinks) = (Vec::new(), 0);
    for kv in 0..8 {
        let h = head(&p, 1, kv, 8, 16);
        assert_eq!(h.keys.len(), 131072 * 128);
        assert_eq!(h.prefill.len(), 2);
        assert_eq!(h.decode[1].len(), 16 * 128);
        let s = stats(&h, 128);
        println!("kv head {kv}: sharpness {:.2}, {s:?}", h.sharpness);
        assert!(s.mahalanobis_ratio > 10.0, "queries must lie out of the key distribution: {s:?}");
        sinks += usize::from(s.sink_lift > 5.0);
        needed.push(s.tokens_for_90);
    }
    // The sharpest heads put nearly all their mass on their targets, sinks included.
    assert!(sinks >= 6, "in most heads a sink token must draw far more than an average token");
    let (lo, hi) = (*needed.iter().min().unwrap(), *needed.iter().max().unwrap());
    assert!(hi >= 100 * lo.max(1), "sparsity must vary by orders of magnitude across heads: {needed:?}");
    // Fig. 5's span: no head much sharper than ~50 tokens or much more diffuse than ~43,000.
    assert!(lo >= 20 && hi <= 70_000, "outside the measured span: {needed:?}");
}

#[test]
fn generation_is_deterministic_per_seed() {
    let p = SynthParams { tokens: 700, head_dim: 16, group: 1, seed: 3 };
    let (a, b) = (head(&p, 0, 0, 4, 4), head(&p, 0, 0, 4, 4));
    assert_eq!(a.keys, b.keys);
    assert_eq!(a.decode, b.decode);
    let c = head(&SynthParams { seed: 4, ..p }, 0, 0, 4, 4);
    assert_ne!(a.keys, c.keys);
}
