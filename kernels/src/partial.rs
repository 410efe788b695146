//! Partial attention and the exact merge of partials (DESIGN.md, "Partial attention and
//! merge"): each part of the keys yields (o, m, l) with m = max z, l = Σ exp(z − m) and o the
//! softmax-weighted mean of its values; parts merge as m = max m_i, l = Σ e^{m_i − m} l_i,
//! o = Σ e^{m_i − m} l_i o_i / l.

use crate::{exp_sub_on, max_on, scores_on, weighted_sum_on, Element, Isa};

#[derive(Debug, Clone, PartialEq)]
pub struct Partial {
    pub o: Vec<f32>,
    pub m: f32,
    pub l: f32,
}

impl Partial {
    /// Attention over no keys: it contributes nothing to a merge.
    pub fn empty(dim: usize) -> Partial {
        Partial { o: vec![0.0; dim], m: f32::NEG_INFINITY, l: 0.0 }
    }

    pub fn is_empty(&self) -> bool {
        self.l == 0.0
    }

    /// log Σ exp(z): the part's log-sum-exp, −∞ when empty.
    pub fn lse(&self) -> f32 {
        if self.is_empty() {
            f32::NEG_INFINITY
        } else {
            self.m + self.l.ln()
        }
    }

    /// Attention of `q` over keys and values stored row after row (each of `q.len()`
    /// elements), with scores `scale · q·k`.
    pub fn attend<E: Element>(q: &[f32], keys: &[E], values: &[E], scale: f32) -> Partial {
        Self::attend_on(crate::active(), q, keys, values, scale)
    }

    pub fn attend_on<E: Element>(isa: Isa, q: &[f32], keys: &[E], values: &[E], scale: f32) -> Partial {
        let d = q.len();
        assert!(
            d > 0 && keys.len().is_multiple_of(d) && keys.len() == values.len(),
            "{} keys and {} values of dimension {d}",
            keys.len(),
            values.len()
        );
        let mut z = vec![0.0; keys.len() / d];
        scores_on(isa, keys, q, scale, &mut z);
        Self::from_scores_on(isa, &mut z, values, d)
    }

    /// Attention given the scores already computed (−∞ masks a key). `z` is overwritten
    /// with the unnormalised weights.
    pub fn from_scores_on<E: Element>(isa: Isa, z: &mut [f32], values: &[E], dim: usize) -> Partial {
        Self::from_scores_summed(isa, z, dim, |weights, o| {
            weighted_sum_on(isa, o, weights, values);
            Ok::<(), std::convert::Infallible>(())
        })
        .unwrap_or_else(|never| match never {})
    }

    /// Attention given the scores, with the values summed by the caller: `sum(weights, o)`
    /// adds `Σ weights_i · value_i` into `o`. Values read straight from pinned pages are then
    /// never copied. `z` is overwritten with the unnormalised weights.
    pub fn from_scores_summed<Err>(
        isa: Isa,
        z: &mut [f32],
        dim: usize,
        sum: impl FnOnce(&[f32], &mut [f32]) -> Result<(), Err>,
    ) -> Result<Partial, Err> {
        let mut part = Self::unsummed(isa, z, dim);
        if !part.is_empty() {
            sum(z, &mut part.o)?;
            part.normalise();
        }
        Ok(part)
    }

    /// Attention given the scores, its values not yet summed: its maximum and weight total
    /// are final (and so its [`Partial::lse`]), `o` is zero, and `z` is overwritten with the
    /// unnormalised weights. The caller adds `Σ z_i · value_i` into `o`, then calls
    /// [`Partial::normalise`]; several queries' values can so be summed in one pass over
    /// them.
    pub fn unsummed(isa: Isa, z: &mut [f32], dim: usize) -> Partial {
        let m = max_on(isa, z);
        if m == f32::NEG_INFINITY {
            return Partial::empty(dim);
        }
        let l = exp_sub_on(isa, z, m);
        Partial { o: vec![0.0; dim], m, l }
    }

    /// Divides the values summed into an [`Partial::unsummed`] part by its weights' total.
    pub fn normalise(&mut self) {
        if !self.is_empty() {
            let inv = 1.0 / self.l;
            self.o.iter_mut().for_each(|x| *x *= inv);
        }
    }

    /// The exact combination of attention over disjoint parts of the keys.
    pub fn merge(parts: &[Partial]) -> Partial {
        let dim = parts.first().map_or(0, |p| p.o.len());
        let m = parts.iter().filter(|p| !p.is_empty()).map(|p| p.m).fold(f32::NEG_INFINITY, f32::max);
        if m == f32::NEG_INFINITY {
            return Partial::empty(dim);
        }
        let mut o = vec![0.0; dim];
        let mut l = 0.0;
        for p in parts.iter().filter(|p| !p.is_empty()) {
            assert_eq!(p.o.len(), dim, "merging partials of different dimensions");
            let w = (p.m - m).exp() * p.l;
            l += w;
            o.iter_mut().zip(&p.o).for_each(|(a, x)| *a += w * x);
        }
        o.iter_mut().for_each(|x| *x /= l);
        Partial { o, m, l }
    }
}
