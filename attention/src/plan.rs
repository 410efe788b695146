//! The rule-based query optimizer (AlayaDB Figure 8): which search answers one layer's
//! attention. Every rule can be overridden per call, and the choice is reported.

/// How the tokens outside the window are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Plan {
    /// Every token, attended exactly.
    Full,
    /// The exact DIPR set, by scanning every key with the SIMD kernels.
    Flat,
    /// The dynamic inner-product range search (DIPRS): every key within β of the best
    /// score. Found on the PQ scan codes where the context stores them: every key whose
    /// approximate score reaches the range less the codes' error margin is scored exactly
    /// (`ctxfs_index::approx::in_range`). On real attention this finds 0.99 of the range
    /// where the graph's walk finds 0.88–0.93 (`ctxfs bench search --data`: `diprs` against
    /// `graph diprs`), but it scans every code, so the optimizer walks the graph instead. A
    /// context stored without codes is searched on the graph, and the choice reports
    /// [`Plan::GraphDiprs`].
    Diprs,
    /// DIPRS as a walk of the graph index from its seeds (AlayaDB's). It scores fewer keys
    /// than the codes scan on long contexts (10–11× the flat plan at 128K on the generator,
    /// where the codes are 4.4–4.6×), but misses more of the range on real attention.
    GraphDiprs,
    /// Beam search for the `k` best keys.
    Topk,
    /// Quest: the pages whose per-channel key bounds score best, up to a token budget.
    Quest,
    /// InfLLM: the blocks whose representative keys score best, up to a token budget.
    Infllm,
    /// PQCache: the tokens whose product-quantised keys score best, up to a token budget.
    Pq,
}

impl Plan {
    /// Every plan's name, as an error message lists them.
    pub const NAMES: &'static str = "full, flat, diprs, graph-diprs, topk, quest, infllm or pq";

    pub fn name(self) -> &'static str {
        match self {
            Plan::Full => "full",
            Plan::Flat => "flat",
            Plan::Diprs => "diprs",
            Plan::GraphDiprs => "graph-diprs",
            Plan::Topk => "topk",
            Plan::Quest => "quest",
            Plan::Infllm => "infllm",
            Plan::Pq => "pq",
        }
    }

    /// Plans that select by coarse metadata up to a token budget.
    pub fn is_coarse(self) -> bool {
        matches!(self, Plan::Quest | Plan::Infllm | Plan::Pq)
    }
}

impl std::str::FromStr for Plan {
    type Err = String;
    fn from_str(s: &str) -> Result<Plan, String> {
        match s {
            "full" => Ok(Plan::Full),
            "flat" => Ok(Plan::Flat),
            "diprs" => Ok(Plan::Diprs),
            "topk" => Ok(Plan::Topk),
            "quest" => Ok(Plan::Quest),
            "infllm" => Ok(Plan::Infllm),
            "graph-diprs" => Ok(Plan::GraphDiprs),
            "pq" => Ok(Plan::Pq),
            _ => Err(format!("unknown plan {s:?} (expected {})", Plan::NAMES)),
        }
    }
}

/// The optimizer's thresholds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rules {
    /// Reused prefixes of at most this many tokens are attended in full: a search's fixed
    /// costs exceed a scan's there.
    pub short_context: u32,
    /// Tokens the optimizer's DIPR plans retrieve at most beyond the window (the best by
    /// score). A diffuse head's DIPR range can hold most of a long context; without a cap a
    /// decode step reads most of its values. Forced plans use only the caller's budget.
    pub dipr_budget: usize,
    /// The same cap when the plan estimates the tail from the seed sample
    /// (`AttentionOptions::tail`): the tokens left out are then estimated, not lost, so far
    /// fewer need retrieving, and graph DIPRS narrows a diffuse range to about this many instead
    /// of exploring what the cap would drop (docs/architecture.md, "The tail estimate").
    pub dipr_tail_budget: usize,
    /// Candidates the codes' best (a compact context's plan beyond `scan_context`) scores
    /// exactly beyond the window; every other token of their key blocks is attended with them,
    /// since reading a candidate's key and value blocks brings those tokens' too. On SmolLM2's
    /// decode queries over its 32K texts, 768 with the blocks' tokens gives an output error
    /// 46–55% below 1,024 candidates alone (reading 4–5% fewer blocks), and on `ctxfs bench
    /// decode --resident-budget 0.125` DIPR recall 0.961 against 0.943, output error 0.043
    /// against 0.050 and a 15% shorter step; 512 halves the step but not the generator's
    /// error (docs/benchmarks.md, "Whole key blocks").
    pub codes_budget: usize,
    /// Reused prefixes of at most this many tokens are served by the flat scan with the
    /// error target `error_target`: the scan knows every score, so it cuts each query's range
    /// where the target asks, and on real attention it is within a small factor of DIPRS's
    /// speed there (`ctxfs bench search --data`: graph DIPRS 0.9–2.3×, DIPRS on the codes
    /// 1.1–1.7× the flat plan's speed at 8K–32K tokens). Beyond it a scan's cost grows with
    /// the context and graph DIPRS serves.
    pub scan_context: u32,
    /// The output error the optimizer's scan plans target (`AttentionOptions::target_error`).
    /// On SmolLM2-135M's 8K contexts (`python -m ctxfs.bench_model`, docs/benchmarks.md)
    /// 0.02 held perplexity within 0.6% of full attention's on three texts, attending 8.9% of
    /// the prefix beyond the window; 0.03 attended 7.0% but came within 0.02 points of the
    /// 1% bound (−0.98% on prose); 0.01 attends about half again as much as 0.02.
    pub error_target: f32,
}

impl Default for Rules {
    fn default() -> Self {
        Rules {
            short_context: 4096,
            dipr_budget: 4096,
            dipr_tail_budget: 1024,
            codes_budget: 768,
            scan_context: 32768,
            error_target: 0.02,
        }
    }
}

/// A plan and why it was chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Choice {
    pub plan: Plan,
    /// Only part of a stored context is reused: searches filter to the prefix.
    pub filtered: bool,
    /// The caller chose the plan (the optimizer's budgets do not apply).
    pub forced: bool,
    /// The output error the plan targets instead of a fixed β or budget: the caller's, or
    /// the optimizer's for its scan and compact plans (`Rules::error_target`). Flat, DIPRS
    /// and PQ plans only.
    pub error_target: Option<f32>,
    /// The optimizer's token budget (`Rules::dipr_tail_budget`) bounds the tokens its error
    /// target retrieves, the rest left to the tail estimate: layer 0's scan beyond
    /// `Rules::scan_context`, where a diffuse head would otherwise read most of a long
    /// context's values.
    pub budgeted: bool,
    pub reason: &'static str,
}

impl Choice {
    /// The `plan` field of `ctxfs query --json`, e.g. `diprs+prefix`.
    pub fn label(&self) -> String {
        if self.filtered && self.plan != Plan::Full {
            format!("{}+prefix", self.plan.name())
        } else {
            self.plan.name().to_string()
        }
    }
}

/// What a call asks of the optimizer besides the session's state.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Request {
    /// The caller's plan, which overrides the optimizer.
    pub forced: Option<Plan>,
    /// The caller's output error target (`AttentionOptions::target_error`).
    pub error_target: Option<f32>,
}

/// What the optimizer knows of a session besides the call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Situation {
    /// Stored tokens the session reuses.
    pub prefix: u32,
    /// Only part of a stored context is reused.
    pub filtered: bool,
    /// The memory budget holds the prefix's values, so whole pages cost little to attend.
    pub ample: bool,
    /// The context is served compact (`DbConfig::resident_budget`): only its PQ codes and
    /// seed table are resident.
    pub compact: bool,
}

/// Chooses the plan for `layer` of a session in situation `s`, unless the request forces
/// one.
pub fn choose(rules: &Rules, layer: usize, s: Situation, request: Request) -> Choice {
    let (plan, reason) = match request.forced {
        Some(p) => (p, "forced by the caller"),
        None if s.prefix <= rules.short_context => (Plan::Full, "short context"),
        // Only the codes are in memory: the keys of their candidates are read on demand. Up
        // to the scan's reach they meet an error target; beyond it, as DIPRS there, the best
        // within a budget are read and the rest estimated from the seeds.
        None if s.compact && (request.error_target.is_some() || s.prefix <= rules.scan_context) => {
            (Plan::Pq, "compact context: the codes meet an error target")
        }
        None if s.compact => (Plan::Pq, "compact long context: the codes' best within the budget"),
        // The scan knows every score: it cuts the range exactly where a target asks, where
        // DIPRS's estimate misses the keys its range phase did not reach (`ctxfs bench search`,
        // real attention: the scan meets a 1% target on 95–99% of queries, DIPRS on 70–85%).
        None if request.error_target.is_some() => (Plan::Flat, "error target: the scan cuts the range exactly"),
        None if s.prefix <= rules.scan_context => (Plan::Flat, "scannable context: the scan meets an error target"),
        // Layer 0's attention is broad: its scan cuts at the optimizer's target within the
        // budget, where a fixed β would cut each head dimension's range at another softmax
        // weight (docs/benchmarks.md, "Layer 0").
        None if layer == 0 => (Plan::Flat, "layer 0 attends broadly: the scan's target within the budget"),
        // Quest is the best of the coarse types at equal budgets (`ctxfs bench search`: at a
        // 1K budget, DIPR recall 0.888 against InfLLM's 0.841 and PQ m=2 b=6's 0.428).
        None if s.ample => (Plan::Quest, "ample memory budget: coarse pages"),
        // The graph's walk, not the codes' scan: the walk scores a few thousand keys, where the
        // codes rescore the budget's best candidates after scanning every code. In `ctxfs bench
        // decode` the walk's 32-layer step is 0.16 s; choosing the same budget on the codes made
        // it 0.47–0.50 s, for DIPR recall 0.94 against 0.85 and output error 0.111 against 0.130.
        None if s.filtered => (Plan::GraphDiprs, "partial prefix reuse: filtered search"),
        None => (Plan::GraphDiprs, "long context"),
    };
    let unforced = request.forced.is_none();
    let error_target = match (request.error_target, plan) {
        (Some(e), Plan::Flat | Plan::Diprs | Plan::GraphDiprs | Plan::Pq) => Some(e),
        // The optimizer scans within the scan's reach and on layer 0: both cut at its target.
        (None, Plan::Flat) if unforced => Some(rules.error_target),
        (None, Plan::Pq) if unforced && s.compact && s.prefix <= rules.scan_context => Some(rules.error_target),
        _ => None,
    };
    let budgeted = unforced && request.error_target.is_none() && plan == Plan::Flat && s.prefix > rules.scan_context;
    Choice { plan, filtered: s.filtered, forced: !unforced, error_target, budgeted, reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(prefix: u32, filtered: bool, ample: bool) -> Situation {
        Situation { prefix, filtered, ample, compact: false }
    }

    #[test]
    fn follows_the_papers_rules_and_honours_overrides() {
        let r = Rules::default();
        assert_eq!(choose(&r, 5, at(1000, false, false), Request::default()).plan, Plan::Full);
        let layer0 = choose(&r, 0, at(100_000, false, false), Request::default());
        // Layer 0 is scanned at any length, and the scan cuts where the target asks.
        assert_eq!((layer0.plan, layer0.error_target, layer0.budgeted), (Plan::Flat, Some(r.error_target), true));
        // Up to the scan's reach, the optimizer's plan is the scan with its error target.
        let scanned = choose(&r, 3, at(32_768, true, true), Request::default());
        assert_eq!((scanned.label(), scanned.error_target), ("flat+prefix".to_string(), Some(r.error_target)));
        let c = choose(&r, 3, at(100_000, true, false), Request::default());
        assert_eq!((c.plan, c.label()), (Plan::GraphDiprs, "graph-diprs+prefix".to_string()));
        assert_eq!(choose(&r, 3, at(100_000, false, false), Request::default()).label(), "graph-diprs");
        assert_eq!(choose(&r, 3, at(100_000, false, true), Request::default()).label(), "quest");
        assert_eq!(choose(&r, 0, at(100_000, false, true), Request::default()).label(), "flat");
        let forced = |p| Request { forced: Some(p), error_target: None };
        assert_eq!(choose(&r, 0, at(100_000, false, false), forced(Plan::Topk)).plan, Plan::Topk);
        let targeted = Request { forced: None, error_target: Some(0.05) };
        let c = choose(&r, 3, at(100_000, false, true), targeted);
        assert_eq!((c.label(), c.error_target), ("flat".to_string(), Some(0.05)));
        let c = choose(&r, 3, at(1000, false, false), targeted);
        assert_eq!((c.label(), c.error_target), ("full".to_string(), None));
        let forced_target = Request { forced: Some(Plan::Diprs), error_target: Some(0.05) };
        assert_eq!(choose(&r, 3, at(100_000, false, false), forced_target).error_target, Some(0.05));
        assert_eq!(choose(&r, 3, at(100_000, false, false), forced(Plan::Flat)).error_target, None);
        assert_eq!(choose(&r, 3, at(100, true, false), Request::default()).label(), "full");
        // A compact context is served from its codes with the optimizer's target (within the
        // scan's reach; beyond it with a budget), or the caller's; a short one in full.
        let compact = Situation { compact: true, ..at(100_000, false, true) };
        let c = choose(&r, 0, compact, Request::default());
        assert_eq!((c.plan, c.error_target), (Plan::Pq, None));
        let c = choose(&r, 0, Situation { prefix: 32_768, ..compact }, Request::default());
        assert_eq!((c.plan, c.error_target), (Plan::Pq, Some(r.error_target)));
        assert_eq!(choose(&r, 3, compact, targeted).error_target, Some(0.05));
        assert_eq!(choose(&r, 3, Situation { prefix: 100, ..compact }, Request::default()).plan, Plan::Full);
        assert_eq!(choose(&r, 3, compact, forced(Plan::Pq)).error_target, None);
        assert_eq!("topk".parse::<Plan>(), Ok(Plan::Topk));
        assert_eq!("pq".parse::<Plan>(), Ok(Plan::Pq));
        assert_eq!("graph-diprs".parse::<Plan>().map(Plan::name), Ok("graph-diprs"));
        assert!("nope".parse::<Plan>().is_err());
    }
}
