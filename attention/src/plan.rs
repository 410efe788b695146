//! The rule-based query optimizer (AlayaDB Figure 8): which search answers one layer's
//! attention. Every rule can be overridden per call, and the choice is reported.

/// How the tokens outside the window are found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Plan {
    /// Every token, attended exactly.
    Full,
    /// The exact DIPR set, by scanning every key with the SIMD kernels.
    Flat,
    /// The dynamic inner-product range search on the graph index.
    Diprs,
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
    pub fn name(self) -> &'static str {
        match self {
            Plan::Full => "full",
            Plan::Flat => "flat",
            Plan::Diprs => "diprs",
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
            "pq" => Ok(Plan::Pq),
            _ => Err(format!("unknown plan {s:?} (expected full, flat, diprs, topk, quest, infllm or pq)")),
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
    /// fewer need retrieving, and DIPRS narrows a diffuse range to about this many instead
    /// of exploring what the cap would drop (docs/architecture.md, "The tail estimate").
    pub dipr_tail_budget: usize,
}

impl Default for Rules {
    fn default() -> Self {
        Rules { short_context: 4096, dipr_budget: 4096, dipr_tail_budget: 1024 }
    }
}

/// A plan and why it was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Choice {
    pub plan: Plan,
    /// Only part of a stored context is reused: searches filter to the prefix.
    pub filtered: bool,
    /// The caller chose the plan (the optimizer's budgets do not apply).
    pub forced: bool,
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

/// Chooses the plan for `layer` of a session reusing `prefix` stored tokens (`filtered`:
/// part of a stored context; `ample`: the memory budget holds the prefix's values, so whole
/// pages cost little to attend), unless `forced`.
pub fn choose(rules: &Rules, layer: usize, prefix: u32, filtered: bool, ample: bool, forced: Option<Plan>) -> Choice {
    let (plan, reason) = match forced {
        Some(p) => (p, "forced by the caller"),
        None if prefix <= rules.short_context => (Plan::Full, "short context"),
        None if layer == 0 => (Plan::Flat, "layer 0 attends broadly"),
        // Quest is the best of the coarse types at equal budgets (`ctxfs bench search`: at a
        // 1K budget, DIPR recall 0.888 against InfLLM's 0.841 and PQ m=2 b=6's 0.428).
        None if ample => (Plan::Quest, "ample memory budget: coarse pages"),
        None if filtered => (Plan::Diprs, "partial prefix reuse: filtered search"),
        None => (Plan::Diprs, "long context"),
    };
    Choice { plan, filtered, forced: forced.is_some(), reason }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follows_the_papers_rules_and_honours_overrides() {
        let r = Rules::default();
        assert_eq!(choose(&r, 5, 1000, false, false, None).plan, Plan::Full);
        assert_eq!(choose(&r, 0, 100_000, false, false, None).plan, Plan::Flat);
        let c = choose(&r, 3, 100_000, true, false, None);
        assert_eq!((c.plan, c.label()), (Plan::Diprs, "diprs+prefix".to_string()));
        assert_eq!(choose(&r, 3, 100_000, false, false, None).label(), "diprs");
        assert_eq!(choose(&r, 3, 100_000, false, true, None).label(), "quest");
        assert_eq!(choose(&r, 0, 100_000, false, true, None).label(), "flat");
        assert_eq!(choose(&r, 0, 100_000, false, false, Some(Plan::Topk)).plan, Plan::Topk);
        assert_eq!(choose(&r, 3, 100, true, false, None).label(), "full");
        assert_eq!("topk".parse::<Plan>(), Ok(Plan::Topk));
        assert_eq!("pq".parse::<Plan>(), Ok(Plan::Pq));
        assert!("nope".parse::<Plan>().is_err());
    }
}
