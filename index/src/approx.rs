//! Mass targets over approximate scores: a scan of compressed codes (product quantisation,
//! [`crate::coarse::pq`]) chooses the candidates of a range, and only the candidates are
//! scored exactly. The full-precision keys then need not stay in memory: the codes take
//! `m` bytes per token where the keys take `2d`.
//!
//! The codes give every key an approximate score `a_t = s_t + e_t`. The error `e` is
//! measured per query on keys whose exact scores the caller knows anyway (the seed table,
//! which stays resident): `σ` is its root mean square there. The cut that meets the target
//! on the approximate scores ([`MassTarget::exact_beta`]) is then lowered by
//! [`MARGIN_SIGMAS`]`·σ`, so that a key whose approximation fell short of its exact score by
//! less than that is still a candidate. The caller scores the candidates exactly and keeps
//! those that reach the target's cut of the scores as they are now known (the candidates'
//! exact scores, every other key's approximate one: [`attended`]), so that the margin widens
//! what is scored, not what is attended. It checks the answer's error as for any other range
//! ([`crate::target::estimate`]); when the estimate misses, a refined target
//! ([`MassTarget::refined`]) widens the candidates.

use crate::coarse::pq::ScoresAbove;
use crate::coarse::reaching;
use crate::flat::{GroupScan, QueryScores};
use crate::target::MassTarget;
use std::borrow::Cow;

/// How many root-mean-square errors of the approximation below the approximate cut the
/// candidates reach. One: a key the codes underrate by more is caught by the answer's error
/// estimate, which widens the target where it misses. On the generator and SmolLM2's code,
/// prose and structured text at 8K tokens (`ctxfs bench search`, `pq target`), 0 met a 1%
/// output error target on 92–98% of queries, 1 on 98–99%, 3 on 99–100% with about 1.2× the
/// tokens of 1.
pub const MARGIN_SIGMAS: f32 = 1.0;

/// The margin for one query: [`MARGIN_SIGMAS`] times the root mean square of `approx − exact`
/// over calibration keys (0 without any).
pub fn margin(exact: &[f32], approx: &[f32]) -> f32 {
    MARGIN_SIGMAS * rms_error(exact, approx)
}

/// [`margin`] on the seeds: `seeds` are the exact scores of every `stride`-th key, `approx`
/// every key's approximate score.
pub fn seed_margin(seeds: &[f32], approx: &[f32], stride: u32) -> f32 {
    let seed_approx: Vec<f32> = approx.iter().step_by(stride as usize).copied().collect();
    margin(seeds, &seed_approx)
}

/// The root mean square of `approx − exact` (0 over none).
fn rms_error(exact: &[f32], approx: &[f32]) -> f32 {
    let n = exact.len().min(approx.len());
    if n == 0 {
        return 0.0;
    }
    let sum: f64 = exact.iter().zip(approx).map(|(&s, &a)| (f64::from(a) - f64::from(s)).powi(2)).sum();
    (sum / n as f64).sqrt() as f32
}

/// The cut that meets `t` on `known`, every key's best known score: its approximate one, or
/// its exact one once scored.
fn cut_of_known(known: &[f32], window_max: f32, t: &MassTarget) -> f32 {
    let best = known.iter().copied().fold(window_max, f32::max);
    best - t.exact_beta(known, best)
}

/// As the cut of [`attended`]'s candidates, over `among`, the approximate scores of the keys
/// a budget already chose (the others to be estimated from a sample rather than left out).
/// The others' mass is not counted: counted with the attended mass it would only raise the
/// cut, so a key that cut keeps is kept.
pub fn cut_among(among: &[f32], window_max: f32, t: &MassTarget, margin: f32) -> f32 {
    cut_of_known(among, window_max, t) - margin.max(0.0)
}

/// A caller's refinement of candidates' approximate scores before their keys are read (the
/// residual codes, [`crate::coarse::pq::PagedPq::refine`]): given the candidates (ascending)
/// and their approximate scores, it adds each one's refinement and returns the margin of
/// the refined scores' error ([`refined_margin`]), or `None`, the scores as they were, where
/// it has none.
pub trait Refine<E>: FnOnce(&[u32], &mut [f32]) -> Result<Option<f32>, E> {}
impl<E, F: FnOnce(&[u32], &mut [f32]) -> Result<Option<f32>, E>> Refine<E> for F {}

/// [`margin`] of refined scores, on the seeds (at most [`REFINED_MARGIN_SEEDS`] of them,
/// evenly spread): `seeds` are the exact scores of every `stride`-th key, `samples` their
/// approximate ones, and `refine` adds the refinement to the scores of the ids it is given.
pub fn refined_margin<E>(
    (seeds, stride): (&[f32], u32),
    samples: &[f32],
    refine: impl FnOnce(&[u32], &mut [f32]) -> Result<(), E>,
) -> Result<f32, E> {
    let n = seeds.len().min(samples.len());
    // Evenly spread, at most `REFINED_MARGIN_SEEDS` of them.
    let step = n.div_ceil(REFINED_MARGIN_SEEDS).max(1);
    let picked: Vec<usize> = (0..n).step_by(step).collect();
    let ids: Vec<u32> = picked.iter().map(|&j| j as u32 * stride).collect();
    let mut refined: Vec<f32> = picked.iter().map(|&j| samples[j]).collect();
    refine(&ids, &mut refined)?;
    let exact: Vec<f32> = picked.iter().map(|&j| seeds[j]).collect();
    Ok(margin(&exact, &refined))
}

/// The most seeds [`refined_margin`] refines: a root mean square over 1,024 keys is within
/// about 2% of the seeds' own (its relative standard error is about 1/√(2n)), while the
/// residual codes of every seed of a long context are read from as many blocks as it has
/// (4,145 at 1M tokens, d = 128).
pub const REFINED_MARGIN_SEEDS: usize = 1024;

/// The tokens a mass target attends from the codes, as (id, exact score), ascending. Its
/// candidates are every key whose approximate score (`approx`, one per key) reaches the cut
/// that meets `t` on the approximate scores, lowered by `margin`; `window_max` is the best
/// exact score of the caller's window (−∞ without one). `refine` refines the scores of those
/// the margin adds below the approximate cut, and only those whose refined score reaches the
/// cut lowered by the refined scores' margin (the codes' error less what the residual codes
/// correct) stay candidates. The candidates are scored exactly by `score` (their scores, in
/// the order of the ids it is given), and those that reach the cut of the scores then known
/// are attended (the candidates' exact scores, the others' approximate ones, refined where
/// they were).
pub fn attended<E>(
    approx: &[f32],
    window_max: f32,
    t: &MassTarget,
    margin: f32,
    refine: impl Refine<E>,
    score: impl FnOnce(&[u32]) -> Result<Vec<f32>, E>,
) -> Result<Vec<(u32, f32)>, E> {
    let cut = cut_of_known(approx, window_max, t);
    let mut ids = reaching(approx, cut - margin.max(0.0));
    let mut known = approx.to_vec();
    // The band the margin adds below the cut: refined, it narrows to the refined margin.
    let band: Vec<u32> = ids.iter().copied().filter(|&i| approx[i as usize] < cut).collect();
    let mut refined: Vec<f32> = band.iter().map(|&i| approx[i as usize]).collect();
    if let Some(refined_margin) = refine(&band, &mut refined)? {
        for (&i, &r) in band.iter().zip(&refined) {
            known[i as usize] = r;
        }
        let floor = cut - refined_margin.max(0.0);
        ids.retain(|&i| known[i as usize] >= floor);
    }
    let scores = score(&ids)?;
    for (&i, &s) in ids.iter().zip(&scores) {
        known[i as usize] = s;
    }
    let cut = cut_of_known(&known, window_max, t);
    let mut pairs: Vec<(u32, f32)> = ids.into_iter().zip(scores).collect();
    pairs.retain(|p| p.1 >= cut);
    Ok(pairs)
}

/// How many root-mean-square errors of the codes over the keys found in a range the next
/// round of [`in_range`] reaches below it. On the generator and SmolLM2's code, prose and
/// structured text at 32K tokens, and the generator at 128K (`ctxfs bench search`,
/// `diprs`, β = 5·√d): 1 found 0.95–0.99 of the DIPR set; 1.5 found 0.98–1.00, scoring
/// at most 4.9% of the keys at 32K; 2 found 0.99–1.00 but scored 5.4–5.6% on the generator
/// and structured text at 32K.
pub const RANGE_MARGIN_SIGMAS: f32 = 1.5;

/// Rounds of [`in_range`] at most: the first from the caller's margin, the others from the
/// errors of the keys found in the range.
pub const RANGE_ROUNDS: usize = 3;

/// A query's approximate scores as [`in_range`] reads them: every key's, or those a scan kept
/// above a floor.
pub trait Approx {
    /// The best approximate score, or one at most the floor where a scan kept none above it.
    fn best(&self) -> f32;
    /// The keys whose approximate score reaches `cut`, as (id, score), ascending by id;
    /// `None` where `cut` is below what was kept.
    fn reaching(&self, cut: f32) -> Option<Vec<(u32, f32)>>;
    /// The approximate scores of the seeds' tokens (every `stride`-th), which margins are
    /// measured on.
    fn samples(&self, stride: u32) -> Cow<'_, [f32]>;
}

impl Approx for QueryScores<'_> {
    fn best(&self) -> f32 {
        QueryScores::best(self)
    }

    fn reaching(&self, cut: f32) -> Option<Vec<(u32, f32)>> {
        Some(QueryScores::reaching(self, cut).into_iter().map(|t| (t, self.scores[t as usize])).collect())
    }

    fn samples(&self, stride: u32) -> Cow<'_, [f32]> {
        Cow::Owned(self.scores.iter().step_by(stride as usize).copied().collect())
    }
}

impl Approx for ScoresAbove {
    fn best(&self) -> f32 {
        self.tokens.iter().map(|p| p.1).fold(self.floor, f32::max)
    }

    fn reaching(&self, cut: f32) -> Option<Vec<(u32, f32)>> {
        (cut >= self.floor).then(|| self.tokens.iter().copied().filter(|p| p.1 >= cut).collect())
    }

    /// The scan kept the samples of the stride it was asked for, the seeds'.
    fn samples(&self, _stride: u32) -> Cow<'_, [f32]> {
        Cow::Borrowed(&self.samples)
    }
}

/// The residual codes' refinement a DIPR range may ask for ([`in_range`]): candidates'
/// approximate scores taken most of the way to their exact ones, so that fewer keys are
/// read to be scored exactly. It pays where a key's read is a block read (a compact
/// context's keys), not where the keys are in memory: a lookup of a candidate's residual
/// codes then costs about what its key's exact score does.
pub trait RangeRefine<E> {
    /// Makes the query's tables and gives the margin of the refined scores' error, measured
    /// on the seeds ([`refined_margin`]; `samples`: the codes' scores of the seeds' tokens);
    /// `None` where there are no residual codes.
    fn start(&mut self, samples: &[f32]) -> Result<Option<f32>, E>;
    /// Adds to `scores` (approximate, of the ascending `ids`) their refinement; asked only
    /// after [`RangeRefine::start`] gave a margin.
    fn refine(&mut self, ids: &[u32], scores: &mut [f32]) -> Result<(), E>;
}

/// The codes alone: a range that never refines.
pub struct Unrefined;

impl<E> RangeRefine<E> for Unrefined {
    fn start(&mut self, _samples: &[f32]) -> Result<Option<f32>, E> {
        Ok(None)
    }
    fn refine(&mut self, _ids: &[u32], _scores: &mut [f32]) -> Result<(), E> {
        Ok(())
    }
}

/// [`RangeRefine`] made when a range first starts it: `make` gives, from the codes' scores
/// of the seeds' tokens, the query's tables and the refined scores' margin (`None` without
/// residual codes; [`refined_margin`] measures it), and `refine` adds, with the tables, the
/// refinement of the ascending ids' scores. It is made once, however often a range starts.
pub struct LazyRefine<T, M, R> {
    /// Until the first start.
    make: Option<M>,
    /// The tables and the margin, once made with residual codes.
    made: Option<(T, f32)>,
    refine: R,
}

impl<T, M, R> LazyRefine<T, M, R> {
    pub fn new(make: M, refine: R) -> Self {
        LazyRefine { make: Some(make), made: None, refine }
    }
}

impl<E, T, M, R> RangeRefine<E> for LazyRefine<T, M, R>
where
    M: FnOnce(&[f32]) -> Result<Option<(T, f32)>, E>,
    R: FnMut(&T, &[u32], &mut [f32]) -> Result<(), E>,
{
    fn start(&mut self, samples: &[f32]) -> Result<Option<f32>, E> {
        if let Some(make) = self.make.take() {
            self.made = make(samples)?;
        }
        Ok(self.made.as_ref().map(|m| m.1))
    }

    fn refine(&mut self, ids: &[u32], scores: &mut [f32]) -> Result<(), E> {
        match &self.made {
            Some((t, _)) => (self.refine)(t, ids, scores),
            None => Ok(()),
        }
    }
}

/// How many of the caller's margins below a DIPR range's least first cut a scan keeps for
/// [`in_range`] ([`range_floor`]): room for [`RANGE_MARGIN_SIGMAS`] times an error of the
/// range's keys up to twice the seeds'. A range that needs more is found again from every
/// score. On the generator at 128K tokens (`ctxfs bench search`, `diprs`, β = 5·√d), 1.5
/// and 2 left 6–9 of 64 queries to be found again and 3 none; on a generated 128K store's
/// decode queries (`ctxfs query --mode diprs --beta 56.6`), 2 left 148 of 512, 3 left 93 and
/// 4 left 114 (a lower floor is reached by more than the scan keeps).
pub const FLOOR_MARGINS: f32 = 3.0;

/// The score down to which a scan keeps a query's approximate scores for [`in_range`], before
/// it knows the best of them: [`FLOOR_MARGINS`] margins below the least first cut, that of the
/// best score known exactly (`known_max`).
pub fn range_floor(known_max: f32, beta: f32, margin: f32) -> f32 {
    known_max - beta - FLOOR_MARGINS * margin.max(0.0)
}

/// A DIPR range from the codes: every key within `beta` of the best score, found by scoring
/// exactly only the keys whose approximate score (`scored`: every key's, or those a scan kept
/// above [`range_floor`]) reaches `best − beta − margin`, as (id, exact score), ascending.
/// `best` is the best score known exactly (`known_max`: the caller's window and seeds; then
/// the candidates'), or the best approximate one lowered by the margin where that is higher.
/// `score` gives the exact scores of the ids it is given, in their order. `None` where a
/// round's cut falls below what `scored` kept: the caller then finds it from every score.
///
/// The caller's margin comes from keys sampled evenly (the seeds), but the keys of a range
/// are the few that score highest, and the codes may render them worse than the bulk they
/// were trained on. So once the candidates are scored, [`RANGE_MARGIN_SIGMAS`]
/// root-mean-square errors of the codes over those in the range become the margin where
/// that is wider, and the keys the wider margin adds are scored too, for [`RANGE_ROUNDS`]
/// rounds at most.
///
/// Where `refiner` has residual codes, the keys the codes' cut reaches are refined first,
/// and only those whose refined score reaches the cut lowered by the refined scores' margin
/// are scored; that margin widens as the codes' does, from the refined scores' errors over
/// the range.
pub fn in_range<E>(
    scored: &impl Approx,
    known_max: f32,
    beta: f32,
    margin: f32,
    seed_stride: u32,
    refiner: &mut impl RangeRefine<E>,
    mut score: impl FnMut(&[u32]) -> Result<Vec<f32>, E>,
) -> Result<Option<Vec<(u32, f32)>>, E> {
    let mut margin = margin.max(0.0);
    // The refined scores' margin, once refining.
    let mut refined_margin: Option<f32> = None;
    let best_approx = scored.best();
    // Scored: (id, exact score, approximate score, refined score).
    let mut found: Vec<(u32, f32, f32, f32)> = Vec::new();
    // Reached by the codes' cut, not scored: (id, approximate score, refined score).
    let mut held: Vec<(u32, f32, f32)> = Vec::new();
    let mut best = known_max;
    // Keys at or above it have been reached.
    let mut reached_down_to = f32::INFINITY;
    for round in 0..RANGE_ROUNDS {
        let top = best.max(best_approx - margin);
        let cut = top - beta - margin;
        let reaches_more = cut < reached_down_to;
        if reaches_more {
            let Some(mut reached) = scored.reaching(cut) else {
                return Ok(None);
            };
            reached.retain(|&(_, a)| a < reached_down_to);
            reached_down_to = cut;
            if round == 0 {
                refined_margin = refiner.start(&scored.samples(seed_stride))?.map(|m| m.max(0.0));
            }
            let ids: Vec<u32> = reached.iter().map(|r| r.0).collect();
            let mut refined: Vec<f32> = reached.iter().map(|r| r.1).collect();
            if refined_margin.is_some() {
                refiner.refine(&ids, &mut refined)?;
            }
            held.extend(reached.iter().zip(refined).map(|(&(t, a), r)| (t, a, r)));
        }
        let refined_cut = top - beta - refined_margin.unwrap_or(margin);
        let (mut now, later): (Vec<_>, Vec<_>) = held.into_iter().partition(|h| h.2 >= refined_cut);
        held = later;
        if now.is_empty() && !reaches_more {
            break;
        }
        now.sort_unstable_by_key(|h| h.0);
        let ids: Vec<u32> = now.iter().map(|h| h.0).collect();
        let scores = if ids.is_empty() { Vec::new() } else { score(&ids)? };
        best = scores.iter().copied().fold(best, f32::max);
        found.extend(now.into_iter().zip(scores).map(|((t, a, r), s)| (t, s, a, r)));
        // The errors of the approximate and the refined scores over the range.
        let ranged: Vec<&(u32, f32, f32, f32)> = found.iter().filter(|f| f.1 >= best - beta).collect();
        let exact: Vec<f32> = ranged.iter().map(|f| f.1).collect();
        let wanted = |of: fn(&(u32, f32, f32, f32)) -> f32| {
            let approximate: Vec<f32> = ranged.iter().map(|f| of(f)).collect();
            RANGE_MARGIN_SIGMAS * rms_error(&exact, &approximate)
        };
        let mut wider = false;
        let codes = wanted(|f| f.2);
        if codes > margin {
            margin = codes;
            wider = true;
        }
        if let Some(m) = refined_margin.as_mut() {
            let refined = wanted(|f| f.3);
            if refined > *m {
                *m = refined;
                wider = true;
            }
        }
        if !wider {
            break;
        }
    }
    let mut pairs: Vec<(u32, f32)> = found.into_iter().filter(|f| f.1 >= best - beta).map(|f| (f.0, f.1)).collect();
    pairs.sort_unstable_by_key(|p| p.0);
    Ok(Some(pairs))
}

/// What a scan of the codes gave one query for a range ([`range_on_codes`]): every score, or
/// those a scan kept above the query's [`range_floor`] (`None` where it kept none for it).
#[derive(Clone, Copy)]
pub enum RangeScan<'a> {
    Every(QueryScores<'a>),
    Above(Option<&'a ScoresAbove>),
}

/// The best score known exactly before a range is searched: the seeds' (`seeds`) and the
/// caller's window's (`window_max`).
pub fn known_max(seeds: &[f32], window_max: f32) -> f32 {
    seeds.iter().copied().fold(window_max, f32::max)
}

/// A query's DIPR range on the codes, as (id, exact score), ascending: [`in_range`] from what
/// the scan gave (`scan`), its margin measured on the seeds' exact scores (`seeds`, every
/// `stride`-th key's), the best known beside them `window_max`, its
/// candidates refined by `refiner` where that pays. Where the scan kept too little for the
/// range, `every` scans this query's every score (a group of one query) and the range is
/// found from those; it is the range every score gives.
pub fn range_on_codes<E>(
    scan: RangeScan<'_>,
    (seeds, stride): (&[f32], u32),
    window_max: f32,
    beta: f32,
    refiner: &mut impl RangeRefine<E>,
    mut score: impl FnMut(&[u32]) -> Result<Vec<f32>, E>,
    every: impl FnOnce() -> Result<GroupScan, E>,
) -> Result<Vec<(u32, f32)>, E> {
    let known = known_max(seeds, window_max);
    let found = match scan {
        RangeScan::Every(scores) => {
            let margin = seed_margin(seeds, scores.scores, stride);
            in_range(&scores, known, beta, margin, stride, refiner, &mut score)?
        }
        RangeScan::Above(Some(kept)) => {
            in_range(kept, known, beta, margin(seeds, &kept.samples), stride, refiner, &mut score)?
        }
        RangeScan::Above(None) => None,
    };
    if let Some(pairs) = found {
        return Ok(pairs);
    }
    let scan = every()?;
    let margin = seed_margin(seeds, scan.scores(0), stride);
    Ok(in_range(&scan.query(0), known, beta, margin, stride, refiner, &mut score)?
        .expect("every score reaches any cut"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::search::SEED_STRIDE;
    use std::cell::RefCell;

    #[test]
    fn the_margin_is_the_root_mean_square_error() {
        assert_eq!(margin(&[1.0, 2.0, 3.0, 4.0], &[2.0, 1.0, 4.0, 3.0]), MARGIN_SIGMAS);
        assert_eq!(margin(&[], &[]), 0.0);
    }

    /// The ids [`attended`] asks `score` for, without residual codes: its candidates.
    fn candidates(approx: &[f32], window_max: f32, t: &MassTarget, margin: f32) -> Vec<u32> {
        let asked = RefCell::new(Vec::new());
        let none = |_: &[u32], _: &mut [f32]| -> Result<Option<f32>, ()> { Ok(None) };
        attended(approx, window_max, t, margin, none, |ids| -> Result<Vec<f32>, ()> {
            asked.borrow_mut().extend_from_slice(ids);
            Ok(ids.iter().map(|&i| approx[i as usize]).collect())
        })
        .unwrap();
        asked.into_inner()
    }

    #[test]
    fn candidates_reach_below_the_approximate_cut_by_the_margin() {
        let t = MassTarget { share: 0.1, scale: 1.0, window_lse: f32::NEG_INFINITY };
        let approx: Vec<f32> = (0..10).map(|i| -(i as f32)).collect();
        // Without a margin: the exact cut of these scores (weights e^0 .. e^-9).
        let exact_cut = t.exact_beta(&approx, 0.0);
        let bare = candidates(&approx, f32::NEG_INFINITY, &t, 0.0);
        assert_eq!(bare, (0..=exact_cut as u32).collect::<Vec<_>>());
        // A margin of 2 takes the next two keys as well.
        let wider = candidates(&approx, f32::NEG_INFINITY, &t, 2.0);
        assert_eq!(wider.len(), bare.len() + 2);
        // A window that holds nearly all the mass leaves every key out.
        let heavy_window = MassTarget { window_lse: 100.0, ..t };
        assert!(candidates(&approx, 100.0, &heavy_window, 0.0).is_empty());
    }

    #[test]
    fn a_cut_among_chosen_keys_is_never_above_one_that_counts_the_others() {
        let t = MassTarget { share: 0.01, scale: 1.0, window_lse: f32::NEG_INFINITY };
        let approx: Vec<f32> = (0..50).map(|i| -(i as f32) / 4.0).collect();
        let among = cut_among(&approx[..20], f32::NEG_INFINITY, &t, 0.5);
        // The others' mass attended beside the window (as an estimate from a sample is):
        // a larger total, a higher cut.
        let others = approx[20..].iter().map(|a| a.exp()).sum::<f32>().ln();
        let counted = MassTarget { window_lse: others, ..t };
        let higher = cut_among(&approx[..20], f32::NEG_INFINITY, &counted, 0.5);
        assert!(among <= higher && among < 0.0, "{among} > {higher}");
        // All of the keys: the cut of the candidates.
        let all = cut_among(&approx, f32::NEG_INFINITY, &t, 0.5);
        assert_eq!(reaching(&approx, all), candidates(&approx, f32::NEG_INFINITY, &t, 0.5));
    }

    #[test]
    fn a_range_scores_its_candidates_and_keeps_those_within_beta_of_the_best() {
        // Exact scores 0, -1, .., -9; the codes overrate key 5 by 3 and underrate key 2 by 1.
        let exact: Vec<f32> = (0..10).map(|i| -(i as f32)).collect();
        let mut approx = exact.clone();
        approx[5] += 3.0;
        approx[2] -= 1.0;
        let run = |known: f32, beta: f32, margin: f32| {
            let mut asked = Vec::new();
            let pairs = in_range(
                &QueryScores::plain(&approx),
                known,
                beta,
                margin,
                SEED_STRIDE,
                &mut Unrefined,
                |ids| -> Result<Vec<f32>, ()> {
                    asked = ids.to_vec();
                    Ok(ids.iter().map(|&t| exact[t as usize]).collect())
                },
            )
            .unwrap()
            .expect("every score reaches any cut");
            (asked, pairs)
        };
        // Range 2 below the best (0): keys 0..=2. Without a margin the underrated key 2 is
        // missed; a margin of 1 lowers the best known (0 at least, by the codes) and the cut
        // below it by 1 each, and scores it; key 5 is scored but left out.
        let (asked, pairs) = run(f32::NEG_INFINITY, 2.0, 0.0);
        assert_eq!((asked, pairs), (vec![0, 1, 5], vec![(0, 0.0), (1, -1.0)]));
        let (asked, pairs) = run(f32::NEG_INFINITY, 2.0, 1.0);
        assert_eq!(asked, vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(pairs, vec![(0, 0.0), (1, -1.0), (2, -2.0)]);
        // A known best above every key (a window's): its range holds none of them.
        let (asked, pairs) = run(10.0, 2.0, 1.0);
        assert!(asked.is_empty() && pairs.is_empty());
    }

    #[test]
    fn a_range_from_the_scores_kept_above_its_floor_is_the_range_from_every_score() {
        use crate::synth::Rng;
        let mut rng = Rng::new(5);
        let exact: Vec<f32> = (0..4_000).map(|_| rng.normal() * 3.0).collect();
        let approx: Vec<f32> = exact.iter().map(|&s| s + rng.normal() * 0.5).collect();
        let lowest_asked = std::cell::Cell::new(f32::INFINITY);
        let score = |ids: &[u32]| -> Result<Vec<f32>, ()> {
            let lowest = ids.iter().map(|&t| approx[t as usize]).fold(lowest_asked.get(), f32::min);
            lowest_asked.set(lowest);
            Ok(ids.iter().map(|&t| exact[t as usize]).collect())
        };
        let (known, beta, margin) = (6.0, 4.0, 0.5);
        let every = in_range(&QueryScores::plain(&approx), known, beta, margin, SEED_STRIDE, &mut Unrefined, score)
            .unwrap()
            .unwrap();
        let lowest = lowest_asked.get();
        assert!(every.len() > 10, "{} keys in the range", every.len());
        let floor = range_floor(known, beta, margin);
        let kept = |floor: f32| ScoresAbove {
            samples: Vec::new(),
            floor,
            tokens: (0..approx.len() as u32).map(|t| (t, approx[t as usize])).filter(|p| p.1 >= floor).collect(),
        };
        assert_eq!(
            in_range(&kept(floor), known, beta, margin, SEED_STRIDE, &mut Unrefined, score).unwrap(),
            Some(every)
        );
        // Kept above the least approximate score a round asked for, a round reaches below what
        // was kept.
        assert!(floor <= lowest, "{floor} > {lowest}");
        assert_eq!(
            in_range(&kept(lowest + 1e-3), known, beta, margin, SEED_STRIDE, &mut Unrefined, score).unwrap(),
            None
        );
        // None above the floor (the best known is far above every key): an empty range.
        let none = ScoresAbove { samples: Vec::new(), floor: 100.0, tokens: Vec::new() };
        assert_eq!(in_range(&none, 110.0, beta, margin, SEED_STRIDE, &mut Unrefined, score).unwrap(), Some(Vec::new()));
    }

    #[test]
    fn a_range_on_the_codes_is_every_scores_however_much_the_scan_kept() {
        use crate::stats::SearchStats;
        let mut rng = crate::synth::Rng::new(7);
        let n = 9_600;
        let exact: Vec<f32> = (0..n).map(|_| rng.normal() * 3.0).collect();
        let approx: Vec<f32> = exact.iter().map(|&s| s + rng.normal() * 0.5).collect();
        let seeds: Vec<f32> = exact.iter().step_by(SEED_STRIDE as usize).copied().collect();
        let samples: Vec<f32> = approx.iter().step_by(SEED_STRIDE as usize).copied().collect();
        let (window_max, beta) = (6.0, 4.0);
        // The ids each call scored, and how many times every score was scanned again.
        let (asked, rescans) = (RefCell::new(Vec::new()), RefCell::new(0));
        let run = |scan: RangeScan<'_>| {
            asked.borrow_mut().clear();
            let score = |ids: &[u32]| -> Result<Vec<f32>, ()> {
                asked.borrow_mut().push(ids.to_vec());
                Ok(ids.iter().map(|&t| exact[t as usize]).collect())
            };
            let every = || {
                *rescans.borrow_mut() += 1;
                Ok(GroupScan::new(approx.clone(), n, SearchStats::default()))
            };
            let pairs =
                range_on_codes(scan, (&seeds, SEED_STRIDE), window_max, beta, &mut Unrefined, score, every).unwrap();
            (pairs, asked.borrow().clone())
        };
        let (range, scored) = run(RangeScan::Every(QueryScores::plain(&approx)));
        assert!(range.len() > 10, "{} keys in the range", range.len());
        let kept = |floor: f32| ScoresAbove {
            samples: samples.clone(),
            floor,
            tokens: (0..n as u32).map(|t| (t, approx[t as usize])).filter(|p| p.1 >= floor).collect(),
        };
        let floor = range_floor(known_max(&seeds, window_max), beta, margin(&seeds, &samples));
        assert_eq!(run(RangeScan::Above(Some(&kept(floor)))), (range.clone(), scored.clone()));
        assert_eq!(*rescans.borrow(), 0);
        // None kept for the query, or kept above every key: every score is scanned again, and
        // the same keys scored from it (with its margin, not a margin of nothing).
        assert_eq!(run(RangeScan::Above(None)), (range.clone(), scored.clone()));
        let (high, again) = run(RangeScan::Above(Some(&kept(100.0))));
        assert_eq!((high, &again[again.len() - scored.len()..]), (range, &scored[..]));
        assert_eq!(*rescans.borrow(), 2);
    }

    #[test]
    fn a_refined_range_scores_fewer_keys_and_finds_the_same_range() {
        let mut rng = crate::synth::Rng::new(11);
        let n = 9_600;
        let exact: Vec<f32> = (0..n).map(|_| rng.normal() * 3.0).collect();
        // The codes err by 1 (root mean square), the codes with their residual codes by 0.2.
        let approx: Vec<f32> = exact.iter().map(|&s| s + rng.normal()).collect();
        let fine: Vec<f32> = exact.iter().map(|&s| s + rng.normal() * 0.2).collect();
        let seeds: Vec<f32> = exact.iter().step_by(SEED_STRIDE as usize).copied().collect();
        let (known, beta) = (known_max(&seeds, f32::NEG_INFINITY), 5.0);
        let margin = seed_margin(&seeds, &approx, SEED_STRIDE);
        // The range and the ids scored exactly, refined by a refiner whose margin is measured
        // on `seeds` (`None`: the codes alone).
        let run = |seeds: Option<&[f32]>| {
            let scored = RefCell::new(Vec::new());
            let score = |ids: &[u32]| -> Result<Vec<f32>, ()> {
                scored.borrow_mut().extend_from_slice(ids);
                Ok(ids.iter().map(|&t| exact[t as usize]).collect())
            };
            let scan = QueryScores::plain(&approx);
            let pairs = match seeds {
                None => in_range(&scan, known, beta, margin, SEED_STRIDE, &mut Unrefined, score),
                Some(seeds) => {
                    let refine = |ids: &[u32], s: &mut [f32]| -> Result<(), ()> {
                        for (s, &t) in s.iter_mut().zip(ids) {
                            *s += fine[t as usize] - approx[t as usize];
                        }
                        Ok(())
                    };
                    let make = |samples: &[f32]| Ok(Some(((), refined_margin((seeds, SEED_STRIDE), samples, refine)?)));
                    let mut refiner = LazyRefine::new(make, |_: &(), ids: &[u32], s: &mut [f32]| refine(ids, s));
                    in_range(&scan, known, beta, margin, SEED_STRIDE, &mut refiner, score)
                }
            };
            (pairs.unwrap().unwrap(), scored.into_inner())
        };
        let (range, scored) = run(None);
        let best = exact.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let truth = exact.iter().filter(|&&s| s >= best - beta).count();
        assert!(range.len() > 20 && range.len() * 100 >= truth * 95, "{} of {truth}", range.len());
        // Refined: as much of the range, from fewer keys scored exactly.
        let (refined, fewer) = run(Some(&seeds));
        assert!(refined.len() >= range.len() && refined.iter().all(|p| p.1 >= best - beta), "{refined:?}");
        assert!(fewer.len() * 10 < scored.len() * 7, "{} keys scored against {}", fewer.len(), scored.len());
    }

    #[test]
    fn refined_scores_narrow_the_band_the_margin_adds() {
        let t = MassTarget { share: 0.1, scale: 1.0, window_lse: f32::NEG_INFINITY };
        // The cut on these scores is −2 (`exact_scores_move_the_cut`); a margin of 3 adds
        // keys 3..=5 below it.
        let approx: Vec<f32> = (0..10).map(|i| -(i as f32)).collect();
        let run = |refined: Option<(Vec<f32>, f32)>| {
            let (given, asked) = (RefCell::new(Vec::new()), RefCell::new(Vec::new()));
            let refine = |ids: &[u32], scores: &mut [f32]| -> Result<Option<f32>, ()> {
                given.borrow_mut().extend_from_slice(ids);
                Ok(refined.map(|(r, margin)| {
                    scores.copy_from_slice(&r);
                    margin
                }))
            };
            let pairs = attended(&approx, f32::NEG_INFINITY, &t, 3.0, refine, |ids| -> Result<Vec<f32>, ()> {
                asked.borrow_mut().extend_from_slice(ids);
                Ok(ids.iter().map(|&i| approx[i as usize]).collect())
            })
            .unwrap();
            (given.into_inner(), asked.into_inner(), pairs)
        };
        // Without residual codes every candidate is scored.
        let (given, asked, bare) = run(None);
        assert_eq!((given, asked), (vec![3, 4, 5], vec![0, 1, 2, 3, 4, 5]));
        // Refined to −3, −4 and −6 with a margin of 1.5: only key 3 reaches −3.5.
        let (given, asked, pairs) = run(Some((vec![-3.0, -4.0, -6.0], 1.5)));
        assert_eq!((given, asked), (vec![3, 4, 5], vec![0, 1, 2, 3]));
        // What is attended is cut on the exact scores either way.
        assert_eq!(pairs, bare);
    }

    #[test]
    fn exact_scores_move_the_cut() {
        let t = MassTarget { share: 0.1, scale: 1.0, window_lse: f32::NEG_INFINITY };
        let approx: Vec<f32> = (0..10).map(|i| -(i as f32)).collect();
        // The cut once `scored` (id, exact score) are known, the others at their approximate scores.
        let exact_cut = |scored: &[(u32, f32)]| {
            let mut known = approx.clone();
            for &(id, s) in scored {
                known[id as usize] = s;
            }
            cut_of_known(&known, f32::NEG_INFINITY, &t)
        };
        let on_approx = exact_cut(&[]);
        assert_eq!(on_approx, -t.exact_beta(&approx, 0.0));
        // The codes overrated keys 1 and 2: scored exactly, they fall far below the others,
        // and the best key alone holds all but the share (the candidates 1..=2 are dropped).
        let higher = exact_cut(&[(1, -20.0), (2, -20.0)]);
        assert_eq!((on_approx, higher), (-2.0, 0.0));
        // The exact cut of a fully known set is the scan's.
        let exact: Vec<(u32, f32)> = (0..10).map(|i| (i, approx[i as usize])).collect();
        assert_eq!(exact_cut(&exact), on_approx);
    }
}
