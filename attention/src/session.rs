//! A session: a prompt's reused prefix (searched on storage), its window (attended exactly,
//! in memory), and the tokens it added since (late materialization: they stay in memory
//! until `Db::store`).
//!
//! One attention call, for every q head of a layer: the window and the session's own tokens
//! are attended exactly; the optimizer's plan retrieves the prefix tokens outside the window
//! from each stored segment (filtered where only part of a segment is reused), their values
//! are read through the buffer pool in one batch per segment, and the parts are merged with
//! the log-sum-exp rule; a DIPR plan adds a third part, the tail estimate (the seeds it left
//! out, each standing for its stride's tokens). The kv heads of a layer run in parallel.

use crate::db::{Db, Window};
use crate::device_codes::DeviceScan;
use crate::error::{input, Error, Result};
use crate::kv::{first_unattendable, first_unstorable};
use crate::layout::{FileBlocks, Segment};
use crate::plan::{choose, Choice, Plan, Request, Situation};
use crate::poison::lock;
use ctxfs_buffer::{BlockClass, Blocks, Prefetched};
use ctxfs_index::approx::{self, LazyRefine, RangeScan};
use ctxfs_index::coarse::infllm::PagedInfllm;
use ctxfs_index::coarse::pq::{AboveGroup, KeptGroup, KeptScores, PagedPq, ResidualTable};
use ctxfs_index::coarse::quest::PagedQuest;
use ctxfs_index::coarse::{run_of, take_tokens, Coarse, CoarseKind};
use ctxfs_index::flat::{GroupScan, QueryScores};
use ctxfs_index::paged::{for_row_runs, gather_rows, Layout, PagedIndex, Rows, StoredRows};
use ctxfs_index::search::SEED_STRIDE;
use ctxfs_index::search::{diprs_from, topk};
use ctxfs_index::target::{estimate, left_out_lse, TailVariance, REFINEMENTS};
use ctxfs_index::{flat, DiprsParams, Keys, MassTarget, SearchResult, SearchStats, SeedScores};
use ctxfs_kernels::gpu::{Gpu, GpuError, GpuWindow};
use ctxfs_kernels::Partial;
use ctxfs_vfs::DType;
use ctxfs_vfs::{ModelShape, Snapshot};
use half::{bf16, f16};

/// `x` rounded to a stored element type, back in f32.
fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F16 => f16::from_f32(x).to_f32(),
        DType::Bf16 => bf16::from_f32(x).to_f32(),
    }
}

fn to_f16(x: &[f32]) -> Vec<f16> {
    x.iter().map(|&x| f16::from_f32(x)).collect()
}
use std::borrow::Cow;
use std::cell::OnceCell;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Tokens a coarse plan attends beyond the window when the caller gives no budget.
pub const COARSE_BUDGET: usize = 2048;

/// Data blocks one value gather pins at most.
const PIN_BATCH: usize = 256;

/// Workers of an attention call per core (at most one per kv head). A kv head's search waits
/// on its key and value reads when they are not cached, and a second worker keeps the core
/// busy meanwhile. `ctxfs bench decode` at 131,072 tokens on 2 cores, alternating runs: under
/// a resident budget of 1/8 (the candidates' keys read from disk), 1.47–1.50 s per steady
/// 32-layer step with 2 workers per core against 1.64–1.70 s with one, the disk busy 85% of
/// the step against 73%; with the whole index held, 0.15–0.17 s against 0.15–0.20 s. Four per
/// core were no faster than two (1.46–1.63 s).
pub(crate) const WORKERS_PER_CORE: usize = 2;

/// The stored prefix a session reuses.
#[derive(Debug, Clone)]
pub(crate) struct Reuse {
    pub context: u32,
    pub name: String,
    /// Tokens reused.
    pub prefix: u32,
    /// Fewer tokens than the context holds: searches filter to the prefix.
    pub filtered: bool,
    pub segments: Vec<Segment>,
}

/// Knobs of one attention call; the defaults are the optimizer's.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionOptions {
    /// Overrides the optimizer.
    pub plan: Option<Plan>,
    /// DIPR range below the best inner product, in inner-product units. `None`: the range
    /// reaches down to the softmax weight at which the tail estimate takes over within the
    /// error target, `ln(SEED_STRIDE / Rules::error_target) / scale` (8.49 logits: 67.9 at
    /// d = 64, 96.0 at d = 128): a token left out is estimated by a seed that stands for
    /// `SEED_STRIDE` tokens, so one lighter than `error_target / SEED_STRIDE` of the best
    /// moves the estimate by less than the target. The same cut in softmax terms at every
    /// head dimension and scale (docs/benchmarks.md, "The default range").
    pub beta: Option<f32>,
    /// The width of graph DIPRS's optional best-first climb through the graph before its
    /// range phase ([`DiprsParams::l0`]; by default its default, 16; 0: no climb).
    pub l0: usize,
    /// Tokens top-k retrieves beyond the window.
    pub k: usize,
    /// At most this many retrieved tokens (the best by score), beyond the window.
    pub budget: Option<usize>,
    /// Softmax scale (default 1/sqrt(head_dim)).
    pub scale: Option<f32>,
    /// Report every selected token id per head.
    pub detail: bool,
    /// Attend the window, and scan the codes, on the CPU even when the DB has a GPU.
    pub cpu_only: bool,
    /// Start each graph DIPRS search ([`Plan::GraphDiprs`]) from the best tokens the same q
    /// head's last one in this layer returned ([`ctxfs_index::search::diprs_from`]):
    /// critical tokens repeat from one decode step to the next. `false`: every search starts
    /// afresh, so a call's answer does not depend on the calls before it.
    pub warm_start: bool,
    /// Estimate the softmax over the tokens a DIPR plan (DIPRS, flat) neither retrieved nor
    /// holds in the window, from the seed sample its index stores (every 97th token's key
    /// and value, as indexes are written): each such seed stands for its stride's tokens. A
    /// diffuse head holds most of its attention outside any range a search can retrieve;
    /// without this, that mass is lost. `None`: the optimizer's plans estimate it, a forced
    /// plan gives the bare DIPR answer (an error target keeps it on). `Some(true)` on a
    /// forced `pq` makes it the compact plan's selection: the codes' best within the budget,
    /// the seeds scored beside them, and the tail; `full`, `topk`, `quest` and `infllm`
    /// refuse it. Indexes stored before layout 4 have no seed values: no estimate.
    pub tail: Option<bool>,
    /// Ask for an output error at most this (relative to exact attention's output norm)
    /// instead of a fixed β: the range is cut per query where the softmax mass left out meets
    /// it, the answer's error is then estimated from the values read and the tail estimate
    /// (`ctxfs_index::target`), and while the estimate misses, the range is widened by how
    /// far it missed (at most `ctxfs_index::target::REFINEMENTS` times). The optimizer serves
    /// it with the flat scan, which cuts the range exactly; forced DIPRS and pq plans take the
    /// candidates of the codes' error margin (`ctxfs_index::approx`), and graph DIPRS
    /// estimates the cut from its seeds. `beta` and the optimizer's token budgets do not
    /// apply; a caller's `budget` still does. The optimizer's own scan plans carry
    /// `Rules::error_target`.
    pub target_error: Option<f32>,
}

impl AttentionOptions {
    /// Refuses options no plan can honour: a non-positive or non-finite target, scale or
    /// β; an error target on a plan with a fixed budget; a budget on `full`, which attends
    /// every token; the tail estimate asked of a plan that makes none.
    /// [`Session::attention_with`] checks them before anything runs.
    pub fn validate(&self) -> Result<()> {
        if let Some(e) = self.target_error.filter(|e| !(e.is_finite() && *e > 0.0)) {
            return input(format!("the error target must be a positive number, not {e}"));
        }
        if let Some(x) = self.scale.filter(|x| !(x.is_finite() && *x > 0.0)) {
            return input(format!("the softmax scale must be a positive number, not {x}"));
        }
        if let Some(b) = self.beta.filter(|b| !(b.is_finite() && *b >= 0.0)) {
            return input(format!("the DIPR range beta must be a finite number ≥ 0, not {b}"));
        }
        match (self.plan, self.target_error, self.budget) {
            (Some(p @ (Plan::Topk | Plan::Quest | Plan::Infllm)), Some(_), _) => input(format!(
                "an error target needs a plan that widens its search until it meets it (auto, full, flat, diprs, \
                 graph-diprs or pq); {} takes a fixed budget",
                p.name()
            )),
            (Some(Plan::Full), _, Some(b)) => input(format!(
                "plan full attends every token exactly: a budget ({b} tokens) applies to the plans that retrieve \
                 (flat, diprs, graph-diprs, topk, quest, infllm, pq)"
            )),
            (Some(p @ (Plan::Full | Plan::Topk | Plan::Quest | Plan::Infllm)), ..) if self.tail == Some(true) => {
                input(format!(
                    "plan {} estimates no tail: the tail estimate is the DIPR plans' and the codes' (flat, diprs, \
                     graph-diprs, pq)",
                    p.name()
                ))
            }
            _ => Ok(()),
        }
    }
}

impl Default for AttentionOptions {
    fn default() -> Self {
        AttentionOptions {
            plan: None,
            beta: None,
            l0: DiprsParams::default().l0,
            k: 100,
            budget: None,
            scale: None,
            detail: false,
            cpu_only: false,
            warm_start: true,
            tail: None,
            target_error: None,
        }
    }
}

/// What one q head's attention did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HeadReport {
    pub lse: f32,
    /// Token ids whose values entered the output (with `detail`), ascending.
    pub selected: Vec<u32>,
    /// Tokens retrieved beyond the window and the session's own tokens.
    pub retrieved: usize,
    /// Seeds whose values entered the output as the tail estimate
    /// ([`AttentionOptions::tail`]).
    pub tail_seeds: usize,
    /// Their token ids (with `detail`), ascending; they are in `selected` too.
    pub tail: Vec<u32>,
    /// With an error target: the output error the session estimated for its answer without
    /// the tail estimate ([`AttentionOptions::target_error`]); the answer merges the tail
    /// estimate when the plan does, which usually leaves less.
    pub estimated_error: Option<f32>,
    pub stats: SearchStats,
    pub timing: HeadTiming,
}

/// Where one q head's share of an attention call went, on the thread that ran it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct HeadTiming {
    /// Finding the retrieved tokens (DIPRS, top-k, a scan or a coarse index).
    pub search: Duration,
    /// Reading the retrieved tokens' value blocks and summing their values.
    pub values: Duration,
    /// Of `values`, the time spent blocked until the prefetch thread had read the value
    /// blocks it was handed after the search (the I/O the searches did not hide). Blocks
    /// missed on the way are read while summing and count in `values` only.
    pub value_wait: Duration,
    /// The head's whole share: the above, the window's attention and the merge (and, for
    /// the first q head of a group, opening the kv head's files and window). A scan of the
    /// group's codes, keys or pages counts a share in each head's `search` and `total`.
    pub total: Duration,
}

/// One layer's attention output, `q_heads × head_dim`, and how it was found.
#[derive(Debug, Clone)]
pub struct Attention {
    pub output: Vec<f32>,
    pub heads: Vec<HeadReport>,
    pub choice: Choice,
    /// Where the window was attended and the parts merged.
    pub device: Device,
    pub micros: u64,
}

/// Where a session's window is attended and the partial attentions merged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Gpu,
}

impl Attention {
    /// The plan as `ctxfs query` reports it: the optimizer's choice, `@gpu` when the window
    /// was attended on the GPU.
    pub fn plan(&self) -> String {
        match self.device {
            Device::Cpu => self.choice.label(),
            Device::Gpu => format!("{}@gpu", self.choice.label()),
        }
    }
}

/// A session's GPU: the device, and each layer's window uploaded on first use.
struct SessionGpu {
    device: Gpu,
    windows: Mutex<Vec<Option<GpuWindow>>>,
    /// Set when a GPU call failed: the session stays on the CPU from then on.
    failed: std::sync::atomic::AtomicBool,
    reason: Mutex<String>,
}

/// One stored segment of the session's prefix, opened for one (layer, kv head).
struct SegmentReader<'a> {
    seg: Segment,
    index: PagedIndex<'a>,
    file: &'a FileBlocks,
    /// Its seed values' spread, once read: the same for every q head of the group and every
    /// widening of a target ([`SegmentReader::seed_value_spread`]).
    seed_spread: OnceCell<f64>,
}

impl<'a> SegmentReader<'a> {
    fn new(seg: Segment, index: PagedIndex<'a>, file: &'a FileBlocks) -> SegmentReader<'a> {
        SegmentReader { seg, index, file, seed_spread: OnceCell::new() }
    }

    /// Every how many tokens the segment's seeds are: its index's seed table's stride, which
    /// its codes' samples share (one writer wrote both).
    fn seed_stride(&self) -> u32 {
        self.index.layout().search_stride()
    }

    /// The spread of its seed values ([`PagedIndex::seed_value_spread`]; 0 without any),
    /// read once.
    fn seed_value_spread(&self, stats: &mut SearchStats) -> Result<f64> {
        if let Some(&spread) = self.seed_spread.get() {
            return Ok(spread);
        }
        let spread = self.index.seed_value_spread(stats).unwrap_or(Ok(0.0))?;
        Ok(*self.seed_spread.get_or_init(|| spread))
    }
}

/// One q head's attention in two parts: over the window and the session's own tokens, and
/// over the retrieved tokens.
struct Parts {
    own: Partial,
    retrieved: Partial,
}

/// Retrieved (segment, token, q · k).
type Found = Vec<(usize, u32, f32)>;

/// Each q head of a GQA group: its parts and report.
type GroupOutput = Vec<(Parts, HeadReport)>;

/// A GQA group after its searches, its value blocks being prefetched.
struct GroupSearch {
    h: usize,
    files: Vec<Arc<FileBlocks>>,
    /// Each segment's index layout (how its data stream packs value rows).
    layouts: Vec<Layout>,
    window: Arc<HeadWindow>,
    heads: Vec<SearchedHead>,
}

/// One q head after its search.
struct SearchedHead {
    /// q · k of the window's and of the session's own tokens.
    win_z: Vec<f32>,
    fresh_z: Vec<f32>,
    /// Retrieved, by token.
    found: Found,
    tail: Option<Tail>,
    estimated_error: Option<f32>,
    /// Attention over the window and own tokens, and over `found`, when an error target's
    /// estimate already computed them.
    own: Option<Partial>,
    retrieved: Option<Partial>,
    prefetch: Option<Prefetched>,
    stats: SearchStats,
    search: Duration,
    /// Time spent on this head so far.
    elapsed: Duration,
}

/// The window's keys and values of one (layer, kv head), in window order, in the type they
/// are stored in (the same values as f32, at half the bytes).
struct HeadWindow {
    keys: StoredRows,
    values: StoredRows,
}

/// The session's own tokens of one layer, per kv head (and the prefill queries that will
/// train their index when stored).
#[derive(Default)]
pub(crate) struct Fresh {
    pub rows: usize,
    /// Rounded to the context's element type, as `Db::store_session` will store them.
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
    pub queries: Vec<Vec<f32>>,
}

pub struct Session {
    db: Db,
    snap: Arc<Snapshot>,
    reuse: Option<Reuse>,
    shape: ModelShape,
    window: Window,
    window_ids: Vec<u32>,
    /// Loaded on a layer's first attention call, per (layer, kv head).
    windows: Mutex<Vec<Option<Arc<HeadWindow>>>>,
    fresh: Vec<Fresh>,
    /// Per (layer, q head): the best tokens, as (segment, token in it), that the last DIPRS
    /// search returned; the next one starts from them.
    last_found: Mutex<Vec<Vec<(usize, u32)>>>,
    /// Per (layer, kv head): the thread time its group took in the last call, so the next
    /// call hands out the costliest groups first.
    last_cost: Mutex<Vec<Duration>>,
    /// Ids of the tokens after the prefix: the prompt's unreused tokens, then appended ones.
    new_tokens: Vec<u32>,
    /// The pool's data area could hold every value of the reused prefix.
    ample: bool,
    /// The reused context is served compact (`Db::warm`): from its PQ codes.
    compact: bool,
    gpu: Option<SessionGpu>,
}

impl Session {
    pub(crate) fn new(db: Db, snap: Arc<Snapshot>, reuse: Option<Reuse>, new_tokens: Vec<u32>) -> Result<Session> {
        let shape = match &reuse {
            Some(r) => snap.context_by_id(r.context)?.record().shape,
            None => db.config().model.ok_or_else(|| {
                Error::Input("no stored context shares a prefix with these tokens, and no model shape is configured for sessions without one: import a context of this model first".into())
            })?,
        };
        let window = db.config().window;
        let prefix = reuse.as_ref().map_or(0, |r| r.prefix);
        let files = shape.files();
        let fresh = (0..shape.layers)
            .map(|_| Fresh {
                rows: 0,
                keys: vec![Vec::new(); shape.kv_heads as usize],
                values: vec![Vec::new(); shape.kv_heads as usize],
                queries: vec![Vec::new(); shape.kv_heads as usize],
            })
            .collect();
        let config = db.config();
        let values = prefix as u64 * shape.head_dim as u64 * 2 * files as u64;
        let ample = values <= (config.pool_bytes as f64 * config.data_fraction) as u64;
        let compact = match &reuse {
            Some(r) if config.resident_budget.is_some() => db.serves_compact(&snap, &r.name)?,
            _ => false,
        };
        // The GPU window holds f16; a bf16 context's window stays on the CPU.
        let gpu = db.inner.gpu.clone().filter(|_| shape.dtype == DType::F16).map(|device| SessionGpu {
            device,
            windows: Mutex::new((0..shape.layers).map(|_| None).collect()),
            failed: false.into(),
            reason: Mutex::default(),
        });
        Ok(Session {
            gpu,
            ample,
            compact,
            db,
            snap,
            reuse,
            shape,
            window,
            window_ids: window.tokens(prefix),
            windows: Mutex::new(vec![None; files]),
            fresh,
            last_found: Mutex::new(vec![Vec::new(); shape.layers as usize * shape.q_heads as usize]),
            last_cost: Mutex::new(vec![Duration::ZERO; files]),
            new_tokens,
        })
    }

    pub fn shape(&self) -> ModelShape {
        self.shape
    }

    /// Tokens reused from storage.
    pub fn prefix_tokens(&self) -> u32 {
        self.reuse.as_ref().map_or(0, |r| r.prefix)
    }

    /// The stored context reused, and whether only part of it is.
    pub fn reused_context(&self) -> Option<(&str, bool)> {
        self.reuse.as_ref().map(|r| (r.name.as_str(), r.filtered))
    }

    /// The tokens reused that every plan attends exactly.
    pub fn window_tokens(&self) -> &[u32] {
        &self.window_ids
    }

    /// Ids of the tokens after the reused prefix.
    pub fn new_tokens(&self) -> &[u32] {
        &self.new_tokens
    }

    /// Tokens the session added to `layer` through [`Session::update`].
    pub fn updated_rows(&self, layer: usize) -> usize {
        self.fresh.get(layer).map_or(0, |f| f.rows)
    }

    pub(crate) fn reuse(&self) -> Option<&Reuse> {
        self.reuse.as_ref()
    }

    /// The session's own tokens of `layer`, per kv head.
    pub(crate) fn fresh_layer(&self, layer: usize) -> &Fresh {
        &self.fresh[layer]
    }

    /// Ids of tokens generated after the prompt (decode steps), in order.
    pub fn append_tokens(&mut self, ids: &[u32]) {
        self.new_tokens.extend_from_slice(ids);
    }

    /// Appends tokens to `layer`: `k` and `v` are `[kv_heads, t, head_dim]`, `q` is
    /// `[q_heads, t, head_dim]` or empty (the queries train the index when the session is
    /// stored). Nothing changes when the input is refused.
    pub fn update(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32]) -> Result<()> {
        let s = self.shape;
        let (kv, qh, d) = (s.kv_heads as usize, s.q_heads as usize, s.head_dim as usize);
        if layer >= s.layers as usize {
            return input(format!("layer {layer} does not exist: the model's layers are 0 to {}", s.layers - 1));
        }
        if k.is_empty() || !k.len().is_multiple_of(kv * d) || v.len() != k.len() {
            return input(format!(
                "update of layer {layer}: k has {} and v {} elements; both must be kv_heads ({kv}) × t × head_dim ({d}), \
                 t at least 1",
                k.len(),
                v.len()
            ));
        }
        let t = k.len() / (kv * d);
        if !q.is_empty() && q.len() != qh * t * d {
            return input(format!("update of layer {layer}: q has {} elements, expected {qh} × {t} × {d}", q.len()));
        }
        for (name, x) in [("q", q), ("k", k), ("v", v)] {
            if let Some((i, why)) = first_unstorable(x, s.dtype) {
                return input(format!("update of layer {layer}: {name}[{i}] {why}"));
            }
        }
        let f = &mut self.fresh[layer];
        let group = qh / kv;
        for h in 0..kv {
            f.keys[h].extend(k[h * t * d..(h + 1) * t * d].iter().map(|&x| round_to(s.dtype, x)));
            f.values[h].extend(v[h * t * d..(h + 1) * t * d].iter().map(|&x| round_to(s.dtype, x)));
            if !q.is_empty() {
                f.queries[h].extend_from_slice(&q[h * group * t * d..(h + 1) * group * t * d]);
            }
        }
        f.rows += t;
        if let Some(g) = &self.gpu {
            let mut windows = lock(&g.windows);
            if let Some(w) = windows[layer].as_mut() {
                if w.append(&to_f16(k), &to_f16(v)).is_err() {
                    // Rebuilt from the host copy on the next attention call.
                    windows[layer] = None;
                }
            }
        }
        Ok(())
    }

    /// The plan an attention call on `layer` runs: the request's forced plan, or the
    /// optimizer's choice.
    pub fn choice(&self, layer: usize, request: Request) -> Choice {
        let situation = Situation {
            prefix: self.prefix_tokens(),
            filtered: self.reuse.as_ref().is_some_and(|r| r.filtered),
            ample: self.ample,
            compact: self.compact,
        };
        choose(&self.db.config().rules, layer, situation, request)
    }

    /// Whether the reused context is served compact: a resident budget its whole index
    /// exceeds, so the optimizer answers from its PQ codes (`Db::warm`).
    pub fn is_compact(&self) -> bool {
        self.compact
    }

    /// Attention of one decode step's queries (`[q_heads, head_dim]`) over the layer, with
    /// the optimizer's plan.
    pub fn attention(&self, layer: usize, q: &[f32]) -> Result<Attention> {
        self.attention_with(layer, q, &AttentionOptions::default())
    }

    pub fn attention_with(&self, layer: usize, q: &[f32], opts: &AttentionOptions) -> Result<Attention> {
        let started = Instant::now();
        let s = self.shape;
        let (kv, qh, d) = (s.kv_heads as usize, s.q_heads as usize, s.head_dim as usize);
        if layer >= s.layers as usize {
            return input(format!("layer {layer} does not exist: the model's layers are 0 to {}", s.layers - 1));
        }
        if q.len() != qh * d {
            return input(format!("attention of layer {layer}: q has {} elements, expected {qh} × {d}", q.len()));
        }
        if let Some((i, why)) = first_unattendable(q) {
            return input(format!("attention of layer {layer}: q[{i}] {why}"));
        }
        opts.validate()?;
        let choice = self.choice(layer, Request { forced: opts.plan, error_target: opts.target_error });
        let choice = self.on_stored_index(layer, choice)?;
        let on_gpu = self.gpu_usable(opts);
        let group = qh / kv;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = (cores * WORKERS_PER_CORE).min(kv).max(1);
        let mut per_head: Vec<Option<Result<GroupOutput>>> = (0..kv).map(|_| None).collect();
        // Workers take kv heads as they come free, the costliest in the last call first: a
        // diffuse head's search costs several times a sharp one's, and one taken last would
        // leave the other workers idle. Every search first, then their values: the value
        // blocks are read under the searches that follow. The calling thread is one of the
        // workers.
        let order: Vec<usize> = {
            let cost = &lock(&self.last_cost)[layer * kv..(layer + 1) * kv];
            let mut order: Vec<usize> = (0..kv).collect();
            order.sort_by_key(|&h| std::cmp::Reverse(cost[h]));
            order
        };
        let next = std::sync::atomic::AtomicUsize::new(0);
        let work = || -> Vec<(usize, Result<GroupOutput>)> {
            let mut searched = Vec::new();
            while let Some(&h) = order.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                searched.push((h, self.search_group(layer, h, &q[h * group * d..(h + 1) * group * d], choice, opts)));
            }
            searched.into_iter().map(|(h, g)| (h, g.and_then(|g| self.sum_group(layer, g, opts, !on_gpu)))).collect()
        };
        std::thread::scope(|scope| {
            // A worker the system will not start (a thread limit reached) leaves its kv heads
            // to the others.
            let helpers: Vec<_> =
                (1..threads).filter_map(|_| std::thread::Builder::new().spawn_scoped(scope, work).ok()).collect();
            let mine = work();
            for done in helpers.into_iter().map(|w| w.join().expect("attention worker panicked")).chain([mine]) {
                for (h, r) in done {
                    per_head[h] = Some(r);
                }
            }
        });
        let (mut parts, mut heads) = (Vec::with_capacity(qh), Vec::with_capacity(qh));
        for r in per_head {
            for (p, report) in r.expect("every kv head ran")? {
                parts.push(p);
                heads.push(report);
            }
        }
        {
            let mut cost = lock(&self.last_cost);
            for (h, group) in heads.chunks(group).enumerate() {
                cost[layer * kv + h] = group.iter().map(|r| r.timing.total).sum();
            }
        }
        let scale = self.scale(opts);
        let merged = if on_gpu {
            match self.gpu_merge(layer, q, scale, &parts) {
                Ok(m) => m,
                // The device failed mid-call: answer on the CPU, and stay there.
                Err(e) => {
                    self.gpu_failed(&e);
                    return self.attention_with(layer, q, &AttentionOptions { cpu_only: true, ..opts.clone() });
                }
            }
        } else {
            parts.into_iter().map(|p| Partial::merge(&[p.own, p.retrieved])).collect()
        };
        let mut output = Vec::with_capacity(qh * d);
        for (m, report) in merged.into_iter().zip(&mut heads) {
            report.lse = m.lse();
            output.extend_from_slice(&m.o);
        }
        // No token attended (an empty window and nothing retrieved) leaves a softmax over
        // nothing; scores beyond f32's range (a large softmax scale) leave no answer either.
        let nothing = |h: usize| heads[h].lse == f32::NEG_INFINITY && heads[h].retrieved == 0;
        if let Some(h) = (0..qh).find(|&h| self.window_ids.is_empty() && nothing(h)) {
            return input(format!(
                "attention of layer {layer}, q head {h}, attended no token: the window holds none of the context \
                 and the plan retrieved none (widen the window, or give a budget above 0)"
            ));
        }
        if let Some(h) =
            (0..qh).find(|&h| !heads[h].lse.is_finite() || output[h * d..(h + 1) * d].iter().any(|x| !x.is_finite()))
        {
            return input(format!(
                "attention of layer {layer}, q head {h}, overflowed f32: its scores (q·k times the scale, {scale}) \
                 are too large"
            ));
        }
        let device = if on_gpu { Device::Gpu } else { Device::Cpu };
        Ok(Attention { output, heads, choice, device, micros: started.elapsed().as_micros() as u64 })
    }

    /// The window (and own tokens) attended on the GPU for all q heads of the layer in one
    /// launch, merged there with the retrieved parts in a second. The layer's window is
    /// uploaded on its first use and grows as `update` appends.
    fn gpu_merge(&self, layer: usize, q: &[f32], scale: f32, parts: &[Parts]) -> Result<Vec<Partial>, GpuError> {
        let gpu = self.gpu.as_ref().expect("on_gpu implies a GPU");
        let mut windows = lock(&gpu.windows);
        if windows[layer].is_none() {
            let s = self.shape;
            let (kv, d) = (s.kv_heads as usize, s.head_dim as usize);
            let host = lock(&self.windows);
            let fresh = &self.fresh[layer];
            let (mut keys, mut values) = (Vec::new(), Vec::new());
            for h in 0..kv {
                let w = host[layer * kv + h].as_ref().expect("the kv head loaded its window");
                w.keys.extend_f32(&mut keys);
                keys.extend_from_slice(&fresh.keys[h]);
                w.values.extend_f32(&mut values);
                values.extend_from_slice(&fresh.values[h]);
            }
            let tokens = self.window_ids.len() + fresh.rows;
            let mut w = GpuWindow::new(&gpu.device, s.q_heads as usize, kv, d, (tokens * 2).max(64))?;
            w.load(&to_f16(&keys), &to_f16(&values))?;
            windows[layer] = Some(w);
        }
        let host: Vec<Partial> = parts.iter().map(|p| p.retrieved.clone()).collect();
        windows[layer].as_mut().expect("loaded above").attention(q, scale, Some(&host))
    }

    /// Whether a call with `opts` may use the GPU: the session has one, it has not failed,
    /// and the call does not ask for the CPU.
    fn gpu_usable(&self, opts: &AttentionOptions) -> bool {
        !opts.cpu_only && self.gpu.as_ref().is_some_and(|g| !g.failed.load(std::sync::atomic::Ordering::Relaxed))
    }

    fn gpu_failed(&self, e: &GpuError) {
        if let Some(g) = &self.gpu {
            g.failed.store(true, std::sync::atomic::Ordering::Relaxed);
            *lock(&g.reason) = e.to_string();
        }
    }

    /// Where this session's window is attended, and why (the GPU's name, or why not).
    pub fn device(&self) -> String {
        match &self.gpu {
            Some(g) if !g.failed.load(std::sync::atomic::Ordering::Relaxed) => format!("gpu ({})", g.device.name()),
            Some(g) => format!("cpu (the GPU failed: {})", lock(&g.reason)),
            None if self.shape.dtype == DType::Bf16 && self.db.inner.gpu.is_some() => {
                "cpu (a bf16 context: the GPU window holds f16)".to_string()
            }
            None => format!("cpu ({})", self.db.gpu_status()),
        }
    }

    /// The window of (layer, kv head), read from its segments on first use. Returns it and
    /// the I/O the load did (none when it was cached).
    fn head_window(&self, layer: usize, h: usize, files: &[Arc<FileBlocks>]) -> Result<(Arc<HeadWindow>, SearchStats)> {
        let slot = layer * self.shape.kv_heads as usize + h;
        if let Some(w) = &lock(&self.windows)[slot] {
            return Ok((w.clone(), SearchStats::default()));
        }
        let mut io = SearchStats::default();
        let rows = self.window_ids.len() * self.shape.head_dim as usize;
        let mut keys = StoredRows::with_capacity(self.shape.dtype, rows);
        let mut values = StoredRows::with_capacity(self.shape.dtype, rows);
        let segments = self.reuse.as_ref().map_or(&[][..], |r| &r.segments);
        for (seg, file) in segments.iter().zip(files) {
            let local: Vec<u32> = self
                .window_ids
                .iter()
                .filter(|&&t| t >= seg.base && t < seg.base + seg.usable)
                .map(|&t| t - seg.base)
                .collect();
            if local.is_empty() {
                continue;
            }
            let index = self.open_index(file, seg, layer, h)?;
            let (k, kio) = index.gather_keys(&local)?;
            let (v, vio) = gather_rows(&self.db.inner.pool, file.data(), index.layout(), &local)?;
            kio.add_to(&mut io);
            vio.add_to(&mut io);
            keys.extend(k.rows());
            values.extend(v.rows());
        }
        let w = Arc::new(HeadWindow { keys, values });
        lock(&self.windows)[slot] = Some(w.clone());
        Ok((w, io))
    }

    fn open_index<'a>(&'a self, file: &'a FileBlocks, seg: &Segment, layer: usize, h: usize) -> Result<PagedIndex<'a>> {
        let corrupt = |e: String| Error::Corrupt(format!("context {} layer {layer} head {h}: {e}", seg.context));
        let mut index = PagedIndex::open(&self.db.inner.pool, file.index(), &file.index_hints)
            .map_err(corrupt)?
            .with_values(file.data());
        if let Some(held) = file.resident.get() {
            index = index.with_resident(held).map_err(corrupt)?;
        }
        if let Some(why) = crate::check::layout_disagrees(index.layout(), u64::from(seg.own), &self.shape) {
            let meta = file.index().first().map_or(0, |b| b.block);
            return Err(corrupt(format!("index meta block {meta}: {why}")));
        }
        Ok(index)
    }

    /// The searches of the q heads of kv head `h`'s group (`qs`: their queries, row after
    /// row); each hands its value blocks to the prefetch thread as soon as it is done.
    fn search_group(
        &self,
        layer: usize,
        h: usize,
        qs: &[f32],
        choice: Choice,
        opts: &AttentionOptions,
    ) -> Result<GroupSearch> {
        let started = Instant::now();
        let d = self.shape.head_dim as usize;
        let scale = self.scale(opts);
        let isa = ctxfs_kernels::active();
        let segments = self.reuse.as_ref().map_or(&[][..], |r| &r.segments);
        let files = segments
            .iter()
            .map(|s| self.db.inner.file(&self.snap, s.context, layer as u16, h as u16))
            .collect::<Result<Vec<_>>>()?;
        let (window, window_io) = self.head_window(layer, h, &files)?;
        let readers = segments
            .iter()
            .zip(&files)
            .map(|(s, f)| Ok(SegmentReader::new(*s, self.open_index(f, s, layer, h)?, f)))
            .collect::<Result<Vec<_>>>()?;
        // Each q head's scores of the window and of the session's own tokens, before the scans:
        // their best bounds a range's.
        let fresh = &self.fresh[layer];
        let own_z: Vec<(Vec<f32>, Vec<f32>)> = qs
            .chunks_exact(d)
            .map(|q| {
                let mut win_z = vec![0.0; self.window_ids.len()];
                window.keys.rows().scores_on(isa, q, &mut win_z);
                let mut fresh_z = vec![0.0; fresh.rows];
                ctxfs_kernels::scores_on(isa, &fresh.keys[h], q, 1.0, &mut fresh_z);
                (win_z, fresh_z)
            })
            .collect();
        // A flat plan scores every key for each q head of the group, and Quest every page's
        // bound: one pass over each segment's keys or pages for all of them (its time is shared
        // out as their search time).
        let opening = started.elapsed();
        let scanning = Instant::now();
        let scans: Vec<GroupCodes> = match choice.plan {
            Plan::Full | Plan::Flat => readers
                .iter()
                .map(|r| Ok(GroupCodes::Scores(flat::scan_many(&r.index, qs, r.seg.usable)?)))
                .collect::<Result<Vec<_>>>()?,
            Plan::Quest => readers
                .iter()
                .map(|r| Ok(GroupCodes::Scores(self.open_quest(r)?.page_scores_many(qs, r.seg.filter())?)))
                .collect::<Result<Vec<_>>>()?,
            // The codes' approximate scores, which the candidates of an error target, of the
            // optimizer's budget or of a range come from. Choosing the best within a budget,
            // only the best are needed; finding a range, only those above its floor.
            Plan::Pq | Plan::Diprs if codes_choose(choice, opts) => {
                let budget = self.retrieval_budget(choice, opts, false);
                let own_max: Vec<f32> = own_z.iter().map(|(w, f)| OwnScores { win_z: w, fresh_z: f }.max()).collect();
                readers
                    .iter()
                    .map(|r| {
                        let want = if codes_best(choice, opts) {
                            CodesWant::Best(self.selection_size(budget, &r.seg))
                        } else if codes_range(choice) {
                            CodesWant::Above { beta: self.beta(opts), own_max: &own_max }
                        } else {
                            CodesWant::Every
                        };
                        self.codes_scan(r, qs, opts, want)
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            _ => Vec::new(),
        };
        let scan_share = scanning.elapsed() / (qs.len() / d).max(1) as u32;
        // Each head's share of the time counts its share of the scan; the first head's also
        // the opening of the files and window.
        let (mut started, mut carried) = (Instant::now(), opening);
        let mut heads = Vec::with_capacity(qs.len() / d);
        for ((i, q), (win_z, fresh_z)) in qs.chunks_exact(d).enumerate().zip(own_z) {
            let mut stats = if i == 0 { window_io } else { SearchStats::default() };
            let own_scores = OwnScores { win_z: &win_z, fresh_z: &fresh_z };
            let searching = Instant::now();
            let scanned: Vec<Scanned<'_>> = scans.iter().map(|s| s.query(i)).collect();
            // Every key's score, and so the mass a cut leaves out: a scan's exactly, the codes'
            // approximately where they scored every key (an error target's scan, not a kept
            // or a range's).
            let every = match choice.plan {
                Plan::Flat => Some(&scanned[..]),
                Plan::Pq | Plan::Diprs if !scanned.is_empty() && scanned.iter().all(Scanned::has_every_score) => {
                    Some(&scanned[..])
                }
                _ => None,
            };
            let slot = layer * self.shape.q_heads as usize + h * (qs.len() / d) + i;
            let warm = choice.plan == Plan::GraphDiprs && opts.warm_start;
            // Taken, not copied: this search replaces them.
            let previous = if warm { std::mem::take(&mut lock(&self.last_found)[slot]) } else { Vec::new() };
            // An error target asks for the mass left out beside the window's and own tokens'.
            let own_part = choice
                .error_target
                .map(|_| own_attention(isa, (&win_z, window.values.rows()), (&fresh_z, &fresh.values[h]), scale, d));
            let target = own_part.as_ref().zip(choice.error_target).map(|(own, share)| MassTarget {
                share,
                scale,
                window_lse: own.lse(),
            });
            let (mut found, mut seeds) =
                self.retrieve(&readers, &scanned, q, own_scores, choice, opts, target, &previous, &mut stats)?;
            // A target the optimizer budgets cuts once, within the budget, and is not refined:
            // widening would mostly meet the budget, and its values are read as a range's are.
            let refined = target.filter(|_| !choice.budgeted);
            // Without a refined target, only the tail's log-sum-exp is needed before the group's
            // q heads are all searched: their values are summed together after.
            let mut tail = if estimates_tail(choice, opts) || target.is_some() {
                self.tail(&readers, &seeds, &found, every, (scale, refined.is_none()), &mut stats)?
            } else {
                None
            };
            let (mut estimated_error, mut retrieved) = (None, None);
            if let (Some(own), Some(mut t), Some(e)) = (&own_part, refined, choice.error_target) {
                // The answer's estimate from the values it sums; a wider search while it
                // misses the target. The last sum is the answer's retrieved part.
                let mut rounds = 0;
                // The tokens the last sum was over: a wider range sums only those it adds.
                let mut summed: Vec<(usize, u32, f32)> = Vec::new();
                while let Some(tl) = &tail {
                    let part = match (retrieved.take(), added(&summed, &found)) {
                        (Some(last), Some(more)) => {
                            Partial::merge(&[last, self.retrieved_part(&readers, &more, scale, &mut stats)?])
                        }
                        _ => self.retrieved_part(&readers, &found, scale, &mut stats)?,
                    };
                    let est =
                        estimate(&Partial::merge(&[own.clone(), part.clone()]), &tl.part, tl.left_out_lse, tl.variance);
                    retrieved = Some(part);
                    estimated_error = Some(est.error as f32);
                    let Some(wider) = t.refined(est, e).filter(|_| rounds < REFINEMENTS) else { break };
                    t = wider;
                    let from: Vec<(usize, u32)> = found.iter().map(|f| (f.0, f.1 - readers[f.0].seg.base)).collect();
                    // The scans' work was counted by the first retrieval.
                    let counted: Vec<Scanned<'_>> = scanned.iter().map(Scanned::counted).collect();
                    let (wider_found, wider_seeds) =
                        self.retrieve(&readers, &counted, q, own_scores, choice, opts, Some(wider), &from, &mut stats)?;
                    if wider_found == found {
                        // Nothing more within the plan's budget: the estimate stands.
                        break;
                    }
                    summed = std::mem::replace(&mut found, wider_found);
                    seeds = wider_seeds;
                    tail = self.tail(&readers, &seeds, &found, every, (scale, false), &mut stats)?;
                    rounds += 1;
                }
            }
            if codes_best(choice, opts) {
                // The codes' best within a budget: of its candidates, now scored exactly,
                // those whose attention is negligible are not read.
                drop_negligible(
                    &mut found,
                    scale,
                    log_add(own_scores.lse(scale), tail.as_ref().map_or(f32::NEG_INFINITY, |t| t.part.lse())),
                );
            }
            if !estimates_tail(choice, opts) {
                tail = None;
            }
            if warm {
                lock(&self.last_found)[slot] = best_found(&found, &readers);
            }
            let search = searching.elapsed() + scan_share;
            let prefetch = if retrieved.is_none() { self.prefetch_values(&found, &readers) } else { None };
            heads.push(SearchedHead {
                win_z,
                fresh_z,
                found,
                tail,
                estimated_error,
                own: own_part,
                retrieved,
                prefetch,
                stats,
                search,
                elapsed: carried + scan_share + started.elapsed(),
            });
            (started, carried) = (Instant::now(), Duration::ZERO);
        }
        // The tails' values, one pass over the seed values for the group; each head's share of
        // the time counts in its search, as a tail summed during the search would.
        let unsummed = |h: &SearchedHead| h.tail.as_ref().is_some_and(|t| !t.weights.is_empty());
        let waiting: Vec<usize> = (0..heads.len()).filter(|&i| unsummed(&heads[i])).collect();
        if let Some(&first) = waiting.first() {
            let mut stats = SearchStats::default();
            let mut tails: Vec<&mut Tail> =
                heads.iter_mut().filter(|h| unsummed(h)).filter_map(|h| h.tail.as_mut()).collect();
            let share = self.sum_tails(&readers, &mut tails, &mut stats)?;
            heads[first].stats += stats;
            for i in waiting {
                heads[i].search += share;
                heads[i].elapsed += share;
            }
        }
        let layouts = readers.iter().map(|r| *r.index.layout()).collect();
        drop(readers);
        Ok(GroupSearch { h, files, layouts, window, heads })
    }

    /// Attention of a searched group's q heads: their retrieved values summed (once their
    /// prefetch is in), and the window's part.
    fn sum_group(
        &self,
        layer: usize,
        g: GroupSearch,
        opts: &AttentionOptions,
        own_on_cpu: bool,
    ) -> Result<GroupOutput> {
        let GroupSearch { h, files, layouts, window, heads } = g;
        let d = self.shape.head_dim as usize;
        let scale = self.scale(opts);
        let isa = ctxfs_kernels::active();
        let fresh = &self.fresh[layer];
        let prefix = self.prefix_tokens();
        let mut out = Vec::with_capacity(heads.len());
        for SearchedHead {
            win_z,
            fresh_z,
            found,
            tail,
            estimated_error,
            own,
            retrieved,
            prefetch,
            mut stats,
            search,
            elapsed,
        } in heads
        {
            let reading = Instant::now();
            stats.blocks_read += prefetch.map_or(0, |p| p.wait()) as u64;
            let value_wait = reading.elapsed();
            let retrieved = match retrieved {
                Some(part) => part,
                None => {
                    let file_refs: Vec<&FileBlocks> = files.iter().map(|f| &**f).collect();
                    self.sum_retrieved(&file_refs, &layouts, &found, scale, &mut stats)?
                }
            };
            let (retrieved, tail_ids, tail_time) = match tail {
                Some(t) => (Partial::merge(&[retrieved, t.part]), t.seeds, t.spent),
                None => (retrieved, Vec::new(), Duration::ZERO),
            };
            let values = reading.elapsed() + tail_time;
            // The window and own tokens: here, or on the GPU (which merges the retrieved part in).
            let own = match own {
                _ if !own_on_cpu => Partial::empty(d),
                Some(part) => part,
                None => own_attention(isa, (&win_z, window.values.rows()), (&fresh_z, &fresh.values[h]), scale, d),
            };
            let selected = if opts.detail {
                let mut ids: Vec<u32> = self.window_ids.clone();
                ids.extend(found.iter().map(|f| f.1));
                ids.extend(&tail_ids);
                ids.extend((0..fresh.rows as u32).map(|i| prefix + i));
                ids.sort_unstable();
                ids
            } else {
                Vec::new()
            };
            let tail_seeds = tail_ids.len();
            let tail = if opts.detail { tail_ids } else { Vec::new() };
            let timing = HeadTiming { search, values, value_wait, total: elapsed + reading.elapsed() };
            let report = HeadReport {
                lse: f32::NAN,
                selected,
                retrieved: found.len(),
                tail_seeds,
                tail,
                estimated_error,
                stats,
                timing,
            };
            out.push((Parts { own, retrieved }, report));
        }
        Ok(out)
    }

    /// Attention over the retrieved tokens `found` (segment, token, q·k), their values summed
    /// straight from the pinned data blocks, one batch per segment, never copied.
    fn sum_retrieved(
        &self,
        files: &[&FileBlocks],
        layouts: &[Layout],
        found: &[(usize, u32, f32)],
        scale: f32,
        stats: &mut SearchStats,
    ) -> Result<Partial> {
        let d = self.shape.head_dim as usize;
        let isa = ctxfs_kernels::active();
        let segments = self.reuse.as_ref().map_or(&[][..], |r| &r.segments);
        let mut ret_z: Vec<f32> = found.iter().map(|f| f.2 * scale).collect();
        Partial::from_scores_summed(isa, &mut ret_z, d, |weights, o| {
            for (si, file) in files.iter().enumerate() {
                let (local, w): (Vec<u32>, Vec<f32>) = found
                    .iter()
                    .zip(weights)
                    .filter(|(f, _)| f.0 == si)
                    .map(|(f, &w)| (f.1 - segments[si].base, w))
                    .unzip();
                let layout = &layouts[si];
                let rows = layout.rows_per_block;
                // Pins at most PIN_BATCH blocks at a time, so a plan that selects most of
                // a long prefix (full attention) streams it through a small data area.
                let mut from = 0;
                while from < local.len() {
                    let (mut to, mut blocks) = (from + 1, 1);
                    while to < local.len() {
                        let next_block = local[to] / rows != local[to - 1] / rows;
                        if next_block && blocks == PIN_BATCH {
                            break;
                        }
                        blocks += usize::from(next_block);
                        to += 1;
                    }
                    let batch = &w[from..to];
                    let io = for_row_runs(&self.db.inner.pool, file.data(), layout, &local[from..to], |i, rows| {
                        rows.accumulate_rows(o, &batch[i..i + rows.len() / layout.dim as usize])
                    })?;
                    io.add_to(stats);
                    from = to;
                }
            }
            Ok::<(), Error>(())
        })
    }

    /// [`Session::sum_retrieved`] over the segments a search reads.
    fn retrieved_part(
        &self,
        readers: &[SegmentReader<'_>],
        found: &[(usize, u32, f32)],
        scale: f32,
        stats: &mut SearchStats,
    ) -> Result<Partial> {
        let files: Vec<&FileBlocks> = readers.iter().map(|r| r.file).collect();
        let layouts: Vec<Layout> = readers.iter().map(|r| *r.index.layout()).collect();
        self.sum_retrieved(&files, &layouts, found, scale, stats)
    }

    /// Starts reading the value blocks of `found` (segment, token, score) that the pool lacks,
    /// and gives the cached ones a second chance against eviction before they are summed.
    /// `None` when there are none to read, or more than a sixteenth of the data area (a plan
    /// selecting most of the prefix streams its values in batches instead). Only the blocks to
    /// read count: a diffuse head's tokens span a thousand blocks or more, most of them cached
    /// (counting them all left those heads to read their misses one batch at a time).
    fn prefetch_values(&self, found: &[(usize, u32, f32)], readers: &[SegmentReader<'_>]) -> Option<Prefetched> {
        let pool = &self.db.inner.pool;
        let mut reqs = Vec::new();
        for (si, r) in readers.iter().enumerate() {
            let (rows, data) = (r.index.layout().rows_per_block, r.file.data());
            let mut blocks: Vec<u32> = found.iter().filter(|f| f.0 == si).map(|f| (f.1 - r.seg.base) / rows).collect();
            blocks.dedup();
            reqs.extend(blocks.iter().filter_map(|&b| data.get(b as usize)).filter(|req| !pool.will_use(req.block)));
        }
        (!reqs.is_empty() && reqs.len() <= pool.frames(BlockClass::Data) / 16)
            .then(|| self.db.inner.prefetcher.submit(reqs))
    }

    /// `choice` as the stored indexes of `layer` can serve it: DIPRS on the graph where a
    /// segment was stored without PQ codes (`PqCodes::Off`, a bf16 context, or a session's
    /// own tokens). An import stores the same indexes for every kv head: kv head 0 answers
    /// for all of them.
    fn on_stored_index(&self, layer: usize, choice: Choice) -> Result<Choice> {
        if choice.plan != Plan::Diprs {
            return Ok(choice);
        }
        for s in self.reuse.as_ref().map_or(&[][..], |r| &r.segments) {
            let file = self.db.inner.file(&self.snap, s.context, layer as u16, 0)?;
            let r = SegmentReader::new(*s, self.open_index(&file, s, layer, 0)?, &file);
            if self.stored_run(&r, CoarseKind::Pq, choice.plan)?.is_none() {
                return Ok(Choice { plan: Plan::GraphDiprs, ..choice });
            }
        }
        Ok(choice)
    }

    /// The run of a segment's coarse index of `kind`, which follows the graph index in the
    /// index stream (each run self-describing).
    fn coarse_run<'r>(&self, r: &SegmentReader<'r>, kind: CoarseKind, plan: Plan) -> Result<Blocks<'r>> {
        match self.stored_run(r, kind, plan)? {
            Some(run) => Ok(run),
            None => {
                // A context reused by a session may be retired since: its id then names it.
                let name = self.snap.context_by_id(r.seg.context).map(|c| format!("{:?}", c.record().name));
                input(format!(
                    "context {} has no {} index (stored without it: a bf16 context has none); choose another \
                     --mode",
                    name.unwrap_or_else(|_| r.seg.context.to_string()),
                    plan.name()
                ))
            }
        }
    }

    /// A segment's coarse run of `kind`, if it was stored with one.
    fn stored_run<'r>(&self, r: &SegmentReader<'r>, kind: CoarseKind, plan: Plan) -> Result<Option<Blocks<'r>>> {
        let (index, seg) = (r.file.index(), &r.seg);
        let pool = &self.db.inner.pool;
        let mut at = r.index.layout().index_blocks() as usize;
        loop {
            if at >= index.len() {
                return Ok(None);
            }
            let meta = pool.get(&index.at(at))?;
            let (k, blocks) = run_of(meta.payload()).map_err(|e| coarse_corrupt(seg, plan, e))?;
            if at + blocks > index.len() {
                let e = format!("a run of {blocks} blocks at block {at} overruns the stream");
                return Err(coarse_corrupt(seg, plan, e));
            }
            if k == kind {
                return Ok(Some(index.range(at..at + blocks)));
            }
            at += blocks;
        }
    }

    /// A segment's Quest index.
    fn open_quest<'a, 'r: 'a>(&'a self, r: &SegmentReader<'r>) -> Result<PagedQuest<'a>> {
        let run = self.coarse_run(r, CoarseKind::Quest, Plan::Quest)?;
        let quest = PagedQuest::open(&self.db.inner.pool, run).map_err(|e| coarse_corrupt(&r.seg, Plan::Quest, e))?;
        check_coarse_shape(r, Plan::Quest, (quest.meta().tokens, quest.meta().dim))?;
        Ok(quest)
    }

    /// The tokens a retrieval takes beyond the window: the caller's budget, else, for a plan the
    /// optimizer chose without a `target` (flat, graph and codes DIPR) or with a target it
    /// budgets ([`Choice::budgeted`]), the rules' (the smaller
    /// where the tail is estimated; the codes' best: its candidates, `Rules::codes_budget`),
    /// else none.
    fn retrieval_budget(&self, choice: Choice, opts: &AttentionOptions, target: bool) -> Option<usize> {
        let auto_dipr = !choice.forced
            && (!target || choice.budgeted)
            && matches!(choice.plan, Plan::Flat | Plan::GraphDiprs | Plan::Pq);
        let rules = &self.db.config().rules;
        let tail = estimates_tail(choice, opts) || target;
        let auto_budget = match choice.plan {
            Plan::Pq => rules.codes_budget,
            _ if tail => rules.dipr_tail_budget,
            _ => rules.dipr_budget,
        };
        opts.budget.or(auto_dipr.then_some(auto_budget))
    }

    /// The tokens a selection from `seg` asks for: `budget` beyond the window
    /// (`COARSE_BUDGET` if none), and as many more as the window holds within `seg`, since
    /// the selection may return them.
    fn selection_size(&self, budget: Option<usize>, seg: &Segment) -> usize {
        let in_window = self.window_ids.iter().filter(|&&t| t >= seg.base && t < seg.base + seg.usable).count();
        budget.unwrap_or(COARSE_BUDGET) + in_window
    }

    /// A segment's PQ codes.
    fn open_pq<'a, 'r: 'a>(&'a self, r: &SegmentReader<'r>) -> Result<PagedPq<'a>> {
        self.pq_of(r, self.coarse_run(r, CoarseKind::Pq, Plan::Pq)?)
    }

    /// The PQ codes of `run`, a segment's PQ run.
    fn pq_of<'a, 'r: 'a>(&'a self, r: &SegmentReader<'r>, run: Blocks<'a>) -> Result<PagedPq<'a>> {
        // A compact context's held PQ run: read from its frames, without pins.
        let held = match (r.file.compact.get(), r.file.compact_pq.get()) {
            (Some(held), Some(&(at, from))) if run.first() == r.file.index().get(at) => Some((held, from)),
            _ => None,
        };
        let pq = PagedPq::open_held(&self.db.inner.pool, run, held).map_err(|e| coarse_corrupt(&r.seg, Plan::Pq, e))?;
        check_coarse_shape(r, Plan::Pq, (pq.meta().tokens, pq.meta().dim))?;
        Ok(pq)
    }

    /// A segment's approximate scores of a group's queries `qs`: scanned on the GPU where the
    /// session attends there and the device holds (or takes) the codes, else on this core.
    /// Both give the same scores; a GPU failure moves the session to the CPU. `want`: every
    /// score; each query's best so many (only those and the seeds' scores are made, or read
    /// back from the device, where a sample bounds them); or, on this core, those above each
    /// query's range floor. Every score where a kept scan cannot serve.
    fn codes_scan(
        &self,
        r: &SegmentReader<'_>,
        qs: &[f32],
        opts: &AttentionOptions,
        want: CodesWant<'_>,
    ) -> Result<GroupCodes> {
        let run = self.coarse_run(r, CoarseKind::Pq, Plan::Pq)?;
        let pq = self.pq_of(r, run)?;
        if let Some(device) = self.db.inner.device_codes.as_ref().filter(|_| self.gpu_usable(opts)) {
            let kept = match want {
                CodesWant::Best(k) => device.scan_kept(&pq, run, qs, r.seg.filter(), (k, r.seed_stride()))?,
                CodesWant::Every | CodesWant::Above { .. } => DeviceScan::Done(None),
            };
            match kept {
                DeviceScan::Done(Some(kept)) => return Ok(GroupCodes::Kept { kept, seeds: self.group_seeds(r, qs)? }),
                DeviceScan::Done(None) => match device.scan(&pq, run, qs, r.seg.filter())? {
                    DeviceScan::Done(scan) => return Ok(GroupCodes::Scores(scan)),
                    DeviceScan::NotHeld => {}
                    DeviceScan::Failed(e) => self.gpu_failed(&e),
                },
                DeviceScan::NotHeld => {}
                DeviceScan::Failed(e) => self.gpu_failed(&e),
            }
        }
        match want {
            CodesWant::Best(k) => {
                if let Some(kept) = pq.token_best_many(qs, r.seg.filter(), k, r.seed_stride())? {
                    return Ok(GroupCodes::Kept { kept, seeds: self.group_seeds(r, qs)? });
                }
            }
            CodesWant::Above { beta, own_max } => {
                // The seeds' exact scores bound each query's best before the scan: its floor
                // lies that far below them ([`approx::range_floor`]).
                let seeds = self.group_seeds(r, qs)?;
                let floor = |i: usize, sample: &[f32]| {
                    let known = approx::known_max(&seeds[i].scores, own_max[i]);
                    Some(approx::range_floor(known, beta, approx::margin(&seeds[i].scores, sample)))
                };
                // Where the run cannot keep them (no sample codes), every score; the seeds
                // scored stand either way.
                let scan = match pq.token_above_many(qs, r.seg.filter(), r.seed_stride(), &floor)? {
                    Some(group) => RangeGroup::Above(group),
                    None => RangeGroup::Every(pq.token_scores_many(qs, r.seg.filter())?),
                };
                return Ok(GroupCodes::Range { scan, seeds });
            }
            CodesWant::Every => {}
        }
        Ok(GroupCodes::Scores(pq.token_scores_many(qs, r.seg.filter())?))
    }

    /// The exact scores of a segment's seeds (every [`SegmentReader::seed_stride`]-th token)
    /// for each query of a GQA group: one scan of the seed table for all of them. The first
    /// query's counts the blocks the scan touched; each counts its seeds as keys scored.
    fn group_seeds(&self, r: &SegmentReader<'_>, qs: &[f32]) -> Result<Vec<SeedsScored>> {
        let (mut all, mut stats) = (Vec::new(), SearchStats::default());
        let len = r.index.score_strided_many(r.seed_stride(), r.seg.usable, qs, &mut all, &mut stats)?;
        let scored = SearchStats { keys_scored: len as u64, ..SearchStats::default() };
        Ok((0..qs.len() / self.shape.head_dim as usize)
            .map(|i| SeedsScored {
                scores: all[i * len..(i + 1) * len].to_vec(),
                stats: if i == 0 { stats } else { scored },
            })
            .collect())
    }

    /// A coarse plan's selection from one segment, with the exact scores of the tokens it
    /// chose (their keys are read from the graph index's key blocks): `budget` tokens beyond
    /// the window (`COARSE_BUDGET` if none). `scanned`: Quest's page bounds of `q`, computed
    /// for its GQA group, and the work that did it (always given for Quest).
    fn coarse(
        &self,
        r: &SegmentReader<'_>,
        plan: Plan,
        q: &[f32],
        scanned: Option<(QueryScores<'_>, SearchStats)>,
        budget: Option<usize>,
        stats: &mut SearchStats,
    ) -> Result<SearchResult> {
        let (index, seg) = (&r.index, &r.seg);
        let budget = self.selection_size(budget, seg);
        let pool = &self.db.inner.pool;
        let corrupt = |e: String| coarse_corrupt(seg, plan, e);
        let selected = match plan {
            Plan::Quest => {
                let (scores, work) = scanned.expect("search_group scores Quest's pages for the whole GQA group");
                self.open_quest(r)?.select_scored(scores.scores, work, budget, seg.filter())
            }
            Plan::Infllm => {
                let run = self.coarse_run(r, CoarseKind::Infllm, plan)?;
                let infllm = PagedInfllm::open(pool, run).map_err(corrupt)?;
                check_coarse_shape(r, plan, (infllm.meta().tokens, infllm.meta().dim))?;
                infllm.select(q, budget, seg.filter())?
            }
            _ => self.open_pq(r)?.select(q, budget, seg.filter())?,
        };
        *stats += selected.stats;
        let mut scores = vec![0.0; selected.ids.len()];
        let mut scoring = SearchStats::default();
        index.score(&selected.ids, q, &mut scores, &mut scoring)?;
        // The exact scores of the chosen tokens are attention work, not selection work.
        stats.blocks_touched += scoring.blocks_touched;
        stats.blocks_read += scoring.blocks_read;
        Ok(SearchResult::from_pairs(selected.ids.into_iter().zip(scores).collect(), SearchStats::default()))
    }

    /// The codes' choice on one segment, from their approximate scores (`approx`, from
    /// `search_group`'s pass over the codes, and its work): with a mass target, its
    /// candidates, the cut lowered by the codes' error on the seed table's exact scores
    /// (`ctxfs_index::approx`); without one, the best `want` of them, less those that even
    /// the codes' error would not lift out of the `negligible` share. They are scored
    /// exactly from their key blocks; the seeds' scores come back for the tail estimate. The
    /// tokens come by id ([`SearchResult::by_id`]), as attention takes them.
    fn codes_select(
        &self,
        r: &SegmentReader<'_>,
        q: &[f32],
        scan: Scanned<'_>,
        best: f32,
        codes: CodesChoice<'_>,
        stats: &mut SearchStats,
    ) -> Result<SearchResult> {
        let (index, seg, scored, approx) = (&r.index, &r.seg, scan.scores, scan.scores.scores);
        let stride = r.seed_stride();
        let seeds = match scan.seeds {
            Some(scored) => {
                *stats += scored.stats;
                scored.scores.clone()
            }
            None => {
                let mut seeds = Vec::new();
                index.score_strided(stride, seg.usable, q, &mut seeds, stats)?;
                seeds
            }
        };
        // The codes' scores of the seeds' tokens (every `stride`-th), which a target's and
        // a budget's margins are measured on (a range measures its own): a kept scan kept them.
        let samples = || -> Cow<'_, [f32]> {
            match scan.kept {
                Some(kept) => Cow::Borrowed(&kept.samples),
                None => approx.iter().step_by(stride as usize).copied().collect(),
            }
        };
        // The codes read beyond the scan: every score again (a range), or the residual codes
        // (a range's tables and refinements apart, as separate closures make them).
        let mut codes_work = SearchStats::default();
        let (mut tables_work, mut refine_work) = (SearchStats::default(), SearchStats::default());
        let mut score = |ids: &[u32]| -> Result<Vec<f32>> {
            let mut scores = vec![0.0; ids.len()];
            index.score(ids, q, &mut scores, stats)?;
            Ok(scores)
        };
        // Only the best within a budget are ever scanned keeping the best alone (`codes_best`),
        // and only a range keeping those above its floor: a target has every score.
        debug_assert!(matches!(codes, CodesChoice::Best { .. }) || scan.kept.is_none());
        debug_assert!(matches!(codes, CodesChoice::Range { .. }) || scan.range.is_none());
        let pairs = match codes {
            CodesChoice::Target(t) => {
                let samples = samples();
                let refiner = self.refiner(r, q, (&seeds, &samples), &mut codes_work)?;
                let refine = |ids: &[u32], scores: &mut [f32]| Refiner::apply(&refiner, ids, scores, &mut codes_work);
                approx::attended(approx, best, t, approx::margin(&seeds, &samples), refine, &mut score)?
            }
            CodesChoice::Range { beta } => {
                let given = match scan.range {
                    Some(range) => range,
                    None => RangeScan::Every(scored),
                };
                let every = || -> Result<GroupScan> {
                    let run = self.coarse_run(r, CoarseKind::Pq, Plan::Pq)?;
                    let every = self.pq_of(r, run)?.token_scores_many(q, seg.filter())?;
                    codes_work = every.stats;
                    Ok(every)
                };
                // The residual codes' refinement of the candidates, where their keys are read
                // from disk: a compact context's.
                let make = |samples: &[f32]| -> Result<Option<(Refiner<'_>, f32)>> {
                    if !self.compact {
                        return Ok(None);
                    }
                    let refiner = self.refiner(r, q, (&seeds, samples), &mut tables_work)?;
                    Ok(refiner.map(|f| {
                        let margin = f.margin;
                        (f, margin)
                    }))
                };
                let refine = |f: &Refiner<'_>, ids: &[u32], scores: &mut [f32]| {
                    Ok(f.pq.refine(&f.table, ids, scores, &mut refine_work)?)
                };
                let mut refiner = LazyRefine::new(make, refine);
                approx::range_on_codes(given, (&seeds, stride), best, beta, &mut refiner, &mut score, every)?
            }
            CodesChoice::Best { want, budget, negligible } => {
                // (token, approximate score), ascending by token.
                let chosen: Cow<'_, [(u32, f32)]> = match scan.kept {
                    Some(kept) => Cow::Borrowed(&kept.best),
                    None => take_tokens(scored, want).into_iter().map(|t| (t, approx[t as usize])).collect(),
                };
                // The window's tokens are attended from the session: their keys are not read
                // (`want` leaves room for them, and the caller drops them from what is found).
                let (prefix, window) = (self.prefix_tokens(), self.window);
                let outside = |&(t, _): &(u32, f32)| !window.contains(prefix, seg.base + t);
                let samples = samples();
                let candidates: Vec<(u32, f32)> = chosen.iter().copied().filter(outside).collect();
                let ids: Vec<u32> = candidates.iter().map(|c| c.0).collect();
                let mut refined: Vec<f32> = candidates.iter().map(|c| c.1).collect();
                let refiner = self.refiner(r, q, (&seeds, &samples), &mut codes_work)?;
                let ids: Vec<u32> = match Refiner::apply(&refiner, &ids, &mut refined, &mut codes_work)? {
                    Some(margin) => {
                        // Ranked by the residual codes: those that reach the budget's least,
                        // lowered by their error, and the negligible share's cut.
                        let cut = approx::cut_among(&refined, best, &negligible, margin);
                        let floor = cut.max(nth_best(&refined, budget) - margin);
                        candidates.iter().zip(&refined).filter(|p| *p.1 >= floor).map(|p| p.0 .0).collect()
                    }
                    None => {
                        let among: Vec<f32> = chosen.iter().map(|c| c.1).collect();
                        let cut = approx::cut_among(&among, best, &negligible, approx::margin(&seeds, &samples));
                        candidates.iter().filter(|c| c.1 >= cut).map(|c| c.0).collect()
                    }
                };
                let in_window = |t: u32| window.contains(prefix, seg.base + t);
                let ids = whole_blocks(&ids, index.layout().rows_per_block, seg.usable, in_window);
                let scores = score(&ids)?;
                ids.into_iter().zip(scores).collect()
            }
        };
        // The codes' approximate scores are not inner products with keys: keys scored counts
        // the exact ones (the seeds' and the candidates').
        let mut found = SearchResult::by_id(pairs, SearchStats { keys_scored: 0, ..scan.stats });
        codes_work += tables_work;
        codes_work += refine_work;
        found.stats += SearchStats { keys_scored: 0, ..codes_work };
        found.seeds = SeedScores { stride, scores: seeds };
        Ok(found)
    }

    /// The residual codes' refinement of `q`'s approximate scores on a segment: its tables,
    /// and the margin of the refined scores' error, measured on the seeds (their exact scores
    /// `seeds`, the codes' `samples`) as the codes' own is. `None` where the segment's codes
    /// have no residual codes.
    fn refiner<'a, 'r: 'a>(
        &'a self,
        r: &SegmentReader<'r>,
        q: &[f32],
        (seeds, samples): (&[f32], &[f32]),
        stats: &mut SearchStats,
    ) -> Result<Option<Refiner<'a>>> {
        let pq = self.open_pq(r)?;
        let Some(table) = pq.residual_table(q, stats)? else { return Ok(None) };
        let margin =
            approx::refined_margin((seeds, r.seed_stride()), samples, |ids, s| pq.refine(&table, ids, s, stats))?;
        Ok(Some(Refiner { pq, table, margin }))
    }

    /// The softmax scale of a call: the caller's, else 1/√d.
    fn scale(&self, opts: &AttentionOptions) -> f32 {
        opts.scale.unwrap_or(1.0 / (self.shape.head_dim as f32).sqrt())
    }

    /// The DIPR range of a call: the caller's β, or the default ([`AttentionOptions::beta`]).
    fn beta(&self, opts: &AttentionOptions) -> f32 {
        let tail_takes_over = (SEED_STRIDE as f32 / self.db.config().rules.error_target).ln();
        opts.beta.unwrap_or_else(|| tail_takes_over / self.scale(opts))
    }

    /// The prefix tokens outside the window that `plan` selects: (segment, token, q·k), by
    /// token, and, when the plan estimates the tail, each segment's seed scores.
    /// `scanned`: for a flat plan, each segment's scores of `q` and the scan's work. With a
    /// mass `target`, a DIPR plan cuts each segment's range where it meets it, not at β.
    #[allow(clippy::too_many_arguments)]
    fn retrieve(
        &self,
        readers: &[SegmentReader<'_>],
        scanned: &[Scanned<'_>],
        q: &[f32],
        own: OwnScores<'_>,
        choice: Choice,
        opts: &AttentionOptions,
        target: Option<MassTarget>,
        previous: &[(usize, u32)],
        stats: &mut SearchStats,
    ) -> Result<(Found, Vec<SeedScores>)> {
        let plan = choice.plan;
        let tail = estimates_tail(choice, opts) || target.is_some();
        let budget = self.retrieval_budget(choice, opts, target.is_some());
        // With a target, the widest range any segment cut (each against its own best).
        let range = self.beta(opts);
        let mut beta = if target.is_some() { 0.0 } else { range };
        let mut seeds = Vec::with_capacity(if tail { readers.len() } else { 0 });
        let prefix = self.prefix_tokens();
        let win = self.window;
        let in_window = self.window_ids.len() as u32;
        let mut best = own.max();
        let mut found: Vec<(usize, u32, f32)> = Vec::new();
        for (si, r) in readers.iter().enumerate() {
            let (seg, index) = (&r.seg, &r.index);
            let r: SearchResult = match plan {
                Plan::Full => {
                    flat::dipr_of(scanned[si].scores.scores, f32::INFINITY, f32::NEG_INFINITY, scanned[si].stats)
                }
                Plan::Flat => {
                    flat::dipr_or_target(scanned[si].scores.scores, range, best, target.as_ref(), scanned[si].stats)
                }
                Plan::GraphDiprs => diprs_from(
                    index,
                    q,
                    &DiprsParams {
                        beta: range,
                        l0: opts.l0,
                        window_max: best,
                        prefix: seg.filter(),
                        expand_limit: budget.map(|b| b * 2 + in_window as usize),
                        range_target: budget.filter(|_| tail),
                        target,
                        seed_stride: Some(readers[si].seed_stride()),
                        ..Default::default()
                    },
                    &previous.iter().filter(|p| p.0 == si).map(|p| p.1).collect::<Vec<_>>(),
                )?,
                Plan::Topk => {
                    // Window tokens may rank among the best; ask for enough to fill k without them.
                    let want = opts.k + in_window as usize;
                    topk(index, q, want, want.max(64), seg.filter())?
                }
                Plan::Quest | Plan::Infllm => {
                    self.coarse(r, plan, q, scanned.get(si).map(|s| s.all()), budget, stats)?
                }
                Plan::Pq if !codes_choose(choice, opts) => {
                    self.coarse(r, plan, q, scanned.get(si).map(|s| s.all()), budget, stats)?
                }
                Plan::Pq | Plan::Diprs => {
                    let codes = match &target {
                        Some(t) => CodesChoice::Target(t),
                        None if plan == Plan::Diprs => CodesChoice::Range { beta: range },
                        None => CodesChoice::Best {
                            want: self.selection_size(budget, seg),
                            budget: budget.unwrap_or(COARSE_BUDGET),
                            negligible: MassTarget {
                                share: NEGLIGIBLE_SHARE,
                                scale: self.scale(opts),
                                window_lse: own.lse(self.scale(opts)),
                            },
                        },
                    };
                    self.codes_select(r, q, scanned[si], best, codes, stats)?
                }
            };
            *stats += r.stats;
            // Best first, or by token (the codes' choices): the best is the greatest either way.
            best = r.scores.iter().copied().fold(best, f32::max);
            beta = match (target, r.chosen_beta) {
                (Some(_), Some(cut)) => beta.max(cut),
                // The codes cut a target's range on their own scores: no β bounds it.
                (Some(_), None) => f32::INFINITY,
                (None, chosen) => beta.min(chosen.unwrap_or(beta)),
            };
            if tail {
                seeds.push(match plan {
                    Plan::Flat => {
                        let stride = readers[si].seed_stride();
                        SeedScores {
                            stride,
                            scores: scanned[si].scores.scores.iter().step_by(stride as usize).copied().collect(),
                        }
                    }
                    _ => r.seeds,
                });
            }
            found.extend(
                r.ids
                    .iter()
                    .zip(&r.scores)
                    .map(|(&local, &s)| (si, seg.base + local, s))
                    .filter(|&(_, t, _)| !win.contains(prefix, t)),
            );
        }
        if matches!(plan, Plan::Flat | Plan::Diprs | Plan::GraphDiprs) {
            // Each segment pruned against the best it knew of; the range is the global best's
            // (narrowed where a search narrowed it).
            found.retain(|f| f.2 >= best - beta);
        }
        let cap = match plan {
            Plan::Topk => Some(budget.map_or(opts.k, |b| b.min(opts.k))),
            Plan::Pq if target.is_some() => budget,
            // The codes' best chose its candidates within the budget (`codes_select`); the
            // other tokens of their blocks came with them.
            Plan::Pq if codes_best(choice, opts) => None,
            Plan::Quest | Plan::Infllm | Plan::Pq => Some(budget.unwrap_or(COARSE_BUDGET)),
            _ => budget,
        };
        if let Some(cap) = cap {
            // Which tokens are kept is all that matters (they are put in token order next).
            keep_best(&mut found, cap);
        }
        if plan == Plan::GraphDiprs && !choice.forced {
            // The optimizer's walk: its tokens' value blocks are read anyway, and the keys are
            // held, so the other tokens of those blocks cost a score each and no read.
            self.add_block_mates(readers, q, &mut found, stats)?;
        }
        found.sort_unstable_by_key(|f| (f.1, f.0));
        Ok((found, seeds))
    }

    /// Adds to `found` (segment, token, q·k) the other tokens of the blocks its tokens lie in
    /// ([`whole_blocks`]), scored exactly from their keys. On the optimizer's graph DIPRS
    /// beyond 32,768 tokens (`ctxfs bench decode`: 483 block reads a 2-layer step either
    /// way, layer 0 cut at β = 50) DIPR recall 0.905 against 0.854 and output error 0.107 against 0.130; on
    /// SmolLM2's 32K decode queries 11–21% less output error (docs/benchmarks.md, "Whole key
    /// blocks").
    fn add_block_mates(
        &self,
        readers: &[SegmentReader<'_>],
        q: &[f32],
        found: &mut Vec<(usize, u32, f32)>,
        stats: &mut SearchStats,
    ) -> Result<()> {
        let (prefix, win) = (self.prefix_tokens(), self.window);
        let mut mates = Vec::new();
        for (si, r) in readers.iter().enumerate() {
            let seg = &r.seg;
            let mut ids: Vec<u32> = found.iter().filter(|f| f.0 == si).map(|f| f.1 - seg.base).collect();
            ids.sort_unstable();
            let in_window = |t: u32| win.contains(prefix, seg.base + t);
            let more: Vec<u32> = whole_blocks(&ids, r.index.layout().rows_per_block, seg.usable, in_window)
                .into_iter()
                .filter(|t| ids.binary_search(t).is_err())
                .collect();
            let mut scores = vec![0.0; more.len()];
            r.index.score(&more, q, &mut scores, stats)?;
            mates.extend(more.into_iter().zip(scores).map(|(t, s)| (si, seg.base + t, s)));
        }
        found.extend(mates);
        Ok(())
    }

    /// The tail estimate of one q head: attention over the seeds of `seeds` (each segment's,
    /// from its search) that are neither in `found` (by token, then segment) nor in the
    /// window, each weighted by its stride, their values read from the seed values. `None`
    /// when a segment's index has no seed values (stored before layout 4): an estimate of
    /// only some segments would be biased. With `defer`, its values are left for
    /// [`Session::sum_tails`] to sum with the rest of the group's; its log-sum-exp is final
    /// either way.
    ///
    /// With `every` key's score (a scan's, exact, or the codes', per segment) and not
    /// deferred, it also holds the mass left out measured on them ([`Tail::left_out_lse`],
    /// for [`estimate`]: the seeds left out alone miss it where none or few of them were).
    #[allow(clippy::too_many_arguments)]
    fn tail(
        &self,
        readers: &[SegmentReader<'_>],
        seeds: &[SeedScores],
        found: &[(usize, u32, f32)],
        every: Option<&[Scanned<'_>]>,
        (scale, defer): (f32, bool),
        stats: &mut SearchStats,
    ) -> Result<Option<Tail>> {
        let started = Instant::now();
        let (prefix, win) = (self.prefix_tokens(), self.window);
        let (mut z, mut ids, mut spans) = (Vec::new(), Vec::new(), Vec::with_capacity(readers.len()));
        let mut every_lse = None;
        for (si, (r, s)) in readers.iter().zip(seeds).enumerate() {
            let l = r.index.layout();
            if !l.seed_values || s.stride != l.seed_stride {
                return Ok(None);
            }
            let from = z.len();
            // exp(z + ln s) = s · exp(z): a seed stands for its stride's tokens.
            let log_stride = (s.stride as f32).ln();
            // `found` ascends by (token, segment), and so do this segment's seeds: one merge.
            let mut at = found.partition_point(|f| (f.1, f.0) < (r.seg.base, si));
            for j in 0..l.seed_rows() {
                let (local, sc) = (j * s.stride, s.scores.get(j as usize).copied().unwrap_or(f32::NEG_INFINITY));
                let t = r.seg.base + local;
                at += found[at..].iter().take_while(|f| (f.1, f.0) < (t, si)).count();
                let retrieved = found.get(at).is_some_and(|f| (f.1, f.0) == (t, si));
                let left_out = local < r.seg.usable && sc > f32::NEG_INFINITY && !win.contains(prefix, t) && !retrieved;
                if left_out {
                    z.push(sc * scale + log_stride);
                    ids.push(t);
                } else {
                    z.push(f32::NEG_INFINITY);
                }
            }
            if let Some(all) = every.filter(|_| !defer).map(|e| e[si].scores.scores) {
                let scores = &all[..all.len().min(r.seg.usable as usize)];
                let mut retrieved = vec![false; scores.len()];
                for f in found.iter().filter(|f| f.0 == si) {
                    if let Some(k) = f.1.checked_sub(r.seg.base).and_then(|local| retrieved.get_mut(local as usize)) {
                        *k = true;
                    }
                }
                let left_out =
                    left_out_lse(scores, scale, |u| !retrieved[u] && !win.contains(prefix, r.seg.base + u as u32));
                every_lse = Some(log_add(every_lse.unwrap_or(f32::NEG_INFINITY), left_out));
            }
            spans.push(from..z.len());
        }
        let part = Partial::unsummed(ctxfs_kernels::active(), &mut z, self.shape.head_dim as usize);
        // The variance of the estimate where an answer's error is estimated from it (not
        // deferred): the spread of each segment's seed values over the seeds' effective
        // number, `z` now holding their weights.
        let mut variance = TailVariance::default();
        if !defer && !part.is_empty() {
            for (r, span) in readers.iter().zip(&spans) {
                variance.add(&z[span.clone()], || r.seed_value_spread(stats))?;
            }
        }
        // An empty part has no values to sum (and `z` holds no weights).
        let weights = if part.is_empty() { Vec::new() } else { z };
        let variance = variance.value();
        let mut tail = Tail { part, seeds: ids, spent: started.elapsed(), weights, left_out_lse: every_lse, variance };
        if !defer && !tail.weights.is_empty() {
            self.sum_tails(readers, &mut [&mut tail], stats)?;
        }
        Ok(Some(tail))
    }

    /// Sums the values of `tails` ([`Session::tail`]'s, their values not yet summed: their
    /// `weights` not empty) in one pass over each segment's seed values for all of them: a
    /// GQA group's q heads read the seed values once. Returns each one's share of the time,
    /// which its `spent` counts too.
    fn sum_tails(
        &self,
        readers: &[SegmentReader<'_>],
        tails: &mut [&mut Tail],
        stats: &mut SearchStats,
    ) -> Result<Duration> {
        let started = Instant::now();
        let mut from = 0;
        for r in readers {
            let span = from..from + r.index.layout().seed_rows() as usize;
            let (weights, mut accs): (Vec<&[f32]>, Vec<&mut [f32]>) =
                tails.iter_mut().map(|t| (&t.weights[span.clone()], &mut t.part.o[..])).unzip();
            r.index.sum_seed_values(&weights, &mut accs, stats).expect("Session::tail checked: it has seed values")?;
            from = span.end;
        }
        let share = started.elapsed() / tails.len().max(1) as u32;
        for t in tails.iter_mut() {
            t.part.normalise();
            t.weights = Vec::new();
            t.spent += share;
        }
        Ok(share)
    }
}

/// Attention over the window and the session's own tokens: their scores (q · k, unscaled)
/// and values.
fn own_attention(
    isa: ctxfs_kernels::Isa,
    (win_z, win_values): (&[f32], Rows<'_>),
    (fresh_z, fresh_values): (&[f32], &[f32]),
    scale: f32,
    d: usize,
) -> Partial {
    let scaled = |z: &[f32]| z.iter().map(|z| z * scale).collect::<Vec<f32>>();
    let window = match win_values {
        Rows::F16(v) => Partial::from_scores_on(isa, &mut scaled(win_z), v, d),
        Rows::Bf16(v) => Partial::from_scores_on(isa, &mut scaled(win_z), v, d),
    };
    Partial::merge(&[window, Partial::from_scores_on(isa, &mut scaled(fresh_z), fresh_values, d)])
}

/// What a segment's scan of the codes makes for a GQA group ([`Session::codes_scan`]).
#[derive(Clone, Copy)]
enum CodesWant<'a> {
    Every,
    /// Each query's best so many.
    Best(usize),
    /// Each query's scores above its floor for a range `beta` below the best, the best known
    /// beside the seeds being `own_max` (per query: the window's and the session's own).
    Above {
        beta: f32,
        own_max: &'a [f32],
    },
}

/// A query's seeds' exact scores, scored before the scan, and the work.
struct SeedsScored {
    scores: Vec<f32>,
    stats: SearchStats,
}

/// A segment's scan for a GQA group: every score, only each query's best within a budget,
/// or only its scores above a range's floor and its seeds' ([`Session::codes_scan`]).
enum GroupCodes {
    Scores(GroupScan),
    Kept { kept: KeptGroup, seeds: Vec<SeedsScored> },
    Range { scan: RangeGroup, seeds: Vec<SeedsScored> },
}

/// A range's scan of a segment for a GQA group: each query's scores above its floor, or
/// every score where the run cannot keep only those.
enum RangeGroup {
    Above(AboveGroup),
    Every(GroupScan),
}

impl GroupCodes {
    /// The group's `i`-th query's part.
    fn query(&self, i: usize) -> Scanned<'_> {
        let none = Scanned {
            scores: QueryScores::plain(&[]),
            kept: None,
            range: None,
            seeds: None,
            stats: SearchStats::default(),
        };
        match self {
            GroupCodes::Scores(scan) => Scanned { scores: scan.query(i), stats: scan.stats, ..none },
            GroupCodes::Kept { kept, seeds } => {
                Scanned { kept: Some(&kept.queries[i]), seeds: Some(&seeds[i]), stats: kept.stats, ..none }
            }
            GroupCodes::Range { scan, seeds } => {
                let (scan, stats) = match scan {
                    RangeGroup::Above(group) => (RangeScan::Above(group.queries[i].as_ref()), group.stats),
                    RangeGroup::Every(every) => (RangeScan::Every(every.query(i)), every.stats),
                };
                Scanned { range: Some(scan), seeds: Some(&seeds[i]), stats, ..none }
            }
        }
    }
}

/// One query's part of a segment's scan: its scores (none when only some were kept), or its
/// kept best, or a range's scan (the scores above its floor, none where more reached it than
/// there was room for, or every score); the exact scores of its seeds where the group's
/// were scored with the scan; and the scan's work.
#[derive(Clone, Copy)]
struct Scanned<'a> {
    scores: QueryScores<'a>,
    kept: Option<&'a KeptScores>,
    range: Option<RangeScan<'a>>,
    seeds: Option<&'a SeedsScored>,
    stats: SearchStats,
}

impl<'a> Scanned<'a> {
    /// Every score and the work: what plans other than the codes' best take.
    fn all(&self) -> (QueryScores<'a>, SearchStats) {
        (self.scores, self.stats)
    }

    /// Whether it holds every key's score: not only the best kept, nor a range's.
    fn has_every_score(&self) -> bool {
        self.kept.is_none() && self.range.is_none()
    }

    /// The same scan without its work: for a wider retrieval from scores already counted.
    fn counted(&self) -> Scanned<'a> {
        Scanned { stats: SearchStats::default(), ..*self }
    }
}

/// What the codes choose from one segment ([`Session::codes_select`]).
enum CodesChoice<'t> {
    /// The candidates of a mass target.
    Target(&'t MassTarget),
    /// The best `want` (`budget` beyond the window, and room for the window's tokens), less
    /// those the `negligible` target leaves out; with residual codes, those of them that may
    /// be among the best `budget` beyond the window.
    Best { want: usize, budget: usize, negligible: MassTarget },
    /// Every key within `beta` of the best score.
    Range { beta: f32 },
}

/// One query's refinement of the codes' scores on a segment by its residual codes
/// ([`Session::refiner`]).
struct Refiner<'a> {
    pq: PagedPq<'a>,
    table: ResidualTable,
    /// The margin of the refined scores' error.
    margin: f32,
}

impl Refiner<'_> {
    /// Adds to `scores` (approximate, of the ascending `ids`) their refinement and gives the
    /// margin of the refined scores' error ([`approx::Refine`]); `None`, the scores as they
    /// were, without a refiner.
    fn apply(refiner: &Option<Self>, ids: &[u32], scores: &mut [f32], stats: &mut SearchStats) -> Result<Option<f32>> {
        let Some(r) = refiner else { return Ok(None) };
        r.pq.refine(&r.table, ids, scores, stats)?;
        Ok(Some(r.margin))
    }
}

/// A q head's exact scores (q·k) of the window and of the session's own tokens.
#[derive(Debug, Clone, Copy)]
struct OwnScores<'z> {
    win_z: &'z [f32],
    fresh_z: &'z [f32],
}

impl OwnScores<'_> {
    /// The best of them.
    fn max(&self) -> f32 {
        self.win_z.iter().chain(self.fresh_z).copied().fold(f32::NEG_INFINITY, f32::max)
    }

    /// `ln Σ exp(scale · q·k)` over them (only the codes' best within a budget asks).
    fn lse(&self, scale: f32) -> f32 {
        log_add(lse_of(self.win_z, scale), lse_of(self.fresh_z, scale))
    }
}

/// log Σ exp(scale · z), −∞ for none.
fn lse_of(z: &[f32], scale: f32) -> f32 {
    let mut scaled: Vec<f32> = z.iter().map(|&x| x * scale).collect();
    let m = ctxfs_kernels::max(&scaled);
    if m == f32::NEG_INFINITY {
        return m;
    }
    m + ctxfs_kernels::exp_sub(&mut scaled, m).ln()
}

/// The `n`-th best of `scores` (1-based): +∞ for none, −∞ where there are fewer.
fn nth_best(scores: &[f32], n: usize) -> f32 {
    if n == 0 {
        return f32::INFINITY;
    }
    if n > scores.len() {
        return f32::NEG_INFINITY;
    }
    let mut order = scores.to_vec();
    *order.select_nth_unstable_by(n - 1, |a, b| b.total_cmp(a)).1
}

/// Every token of the key blocks that hold `ids` (ascending), ascending: the blocks a
/// candidate's exact score reads, `rows_per_block` tokens each, and a token's value lies in
/// the data block of the same number (docs/format.md, "Key blocks", "Value blocks"). Reading
/// a candidate's key and value brings its block's other tokens with them, so attending them
/// too costs no read, and their mass no longer falls to the tail estimate. Tokens from
/// `usable` on and those `in_window` (attended from the session) are left out.
fn whole_blocks(ids: &[u32], rows_per_block: u32, usable: u32, in_window: impl Fn(u32) -> bool) -> Vec<u32> {
    let w = rows_per_block.max(1);
    let mut out = Vec::with_capacity(ids.len() * 2);
    let mut last_block = None;
    for &t in ids {
        let b = t / w;
        if last_block == Some(b) {
            continue;
        }
        last_block = Some(b);
        out.extend((b * w..((b + 1) * w).min(usable)).filter(|&u| !in_window(u)));
    }
    out
}

/// The share of a q head's attention that the codes' best within a budget may leave out.
/// Candidates that even the codes' error would not lift out of it are not scored
/// ([`approx::cut_among`]); of those scored, the least attended that together hold it are
/// not read ([`drop_negligible`]). Leaving out a share δ moves the output by at most
/// 2δ·max‖v‖ (the rest is renormalised): at 10⁻³ an order of magnitude below the error the
/// codes' choice leaves (`ctxfs bench decode`: 0.026–0.049).
const NEGLIGIBLE_SHARE: f32 = 1e-3;

/// Leaves out of `found` (segment, token, q·k) its least attended tokens while together they
/// hold at most [`NEGLIGIBLE_SHARE`] of the attention over `found` and the rest (whose
/// log-sum-exp is `rest_lse`: the window, own tokens and tail). Their values are then never
/// read. `found` keeps its order.
///
/// Only tokens of at most the share each can be left out; which of those are the least
/// attended that fit is found without sorting them ([`least_that_fit`]): a q head of the
/// codes' best has thousands.
fn drop_negligible(found: &mut Vec<(usize, u32, f32)>, scale: f32, rest_lse: f32) {
    let scores: Vec<f32> = found.iter().map(|f| f.2).collect();
    let total = log_add(lse_of(&scores, scale), rest_lse);
    if !total.is_finite() {
        return;
    }
    let small: Vec<Share> = found
        .iter()
        .enumerate()
        .map(|(i, f)| Share { score: f.2, token: f.1, at: i, share: (f.2 * scale - total).exp() })
        .filter(|c| c.share <= NEGLIGIBLE_SHARE)
        .collect();
    let mut dropped = vec![false; found.len()];
    least_that_fit(&small, NEGLIGIBLE_SHARE as f64, |c| dropped[c.at] = true);
    let mut at = 0;
    found.retain(|_| {
        at += 1;
        !dropped[at - 1]
    });
}

/// A candidate of [`drop_negligible`]: its q·k, token, position in `found` and share of the
/// attention.
#[derive(Clone, Copy)]
struct Share {
    score: f32,
    token: u32,
    at: usize,
    share: f32,
}

/// Least attended first: the lower score, then the higher token ([`best_first`] reversed).
fn least_first(a: &Share, b: &Share) -> std::cmp::Ordering {
    a.score.total_cmp(&b.score).then(b.token.cmp(&a.token))
}

/// Buckets of equal width in q·k that [`least_that_fit`] sums shares in.
const SHARE_BUCKETS: usize = 64;

/// Calls `leave_out` with each of the least attended of `c` ([`least_first`]) that together
/// hold at most `room`. The shares are summed per bucket of q·k in one pass: every bucket
/// below the one where they pass `room` fits whole, and only that bucket's tokens are
/// ordered, by selection, halving them each round.
fn least_that_fit(c: &[Share], room: f64, mut leave_out: impl FnMut(&Share)) {
    let (min, max) =
        c.iter().fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), x| (lo.min(x.score), hi.max(x.score)));
    // Scores times `per` from `min` number the buckets, in the order of the scores.
    let per = SHARE_BUCKETS as f32 / (max - min);
    let mut crossing: Vec<Share> = Vec::new();
    let room = if per.is_finite() && per > 0.0 {
        let bucket = |x: &Share| (((x.score - min) * per) as usize).min(SHARE_BUCKETS - 1);
        let mut sums = [0f64; SHARE_BUCKETS];
        for x in c {
            sums[bucket(x)] += x.share as f64;
        }
        let (mut b, mut room) = (0, room);
        while b < SHARE_BUCKETS && sums[b] <= room {
            room -= sums[b];
            b += 1;
        }
        for x in c {
            match bucket(x).cmp(&b) {
                std::cmp::Ordering::Less => leave_out(x),
                std::cmp::Ordering::Equal => crossing.push(*x),
                std::cmp::Ordering::Greater => {}
            }
        }
        room
    } else {
        crossing.extend_from_slice(c);
        room
    };
    let n = least_that_fit_in(&mut crossing, room);
    crossing[..n].iter().for_each(leave_out);
}

/// [`least_that_fit`] by selection alone.
fn least_that_fit_in(c: &mut [Share], mut room: f64) -> usize {
    let (mut lo, mut hi) = (0, c.len());
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        c[lo..hi].select_nth_unstable_by(mid - lo, least_first);
        let share: f64 = c[lo..=mid].iter().map(|x| x.share as f64).sum();
        if share <= room {
            room -= share;
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

/// The tokens of `wider` (segment, token, score; by token, then segment) that `narrower`
/// lacks, when `wider` holds every token of `narrower`; `None` otherwise.
fn added(narrower: &[(usize, u32, f32)], wider: &[(usize, u32, f32)]) -> Option<Vec<(usize, u32, f32)>> {
    let mut more = Vec::with_capacity(wider.len().saturating_sub(narrower.len()));
    let mut old = narrower.iter().peekable();
    for &f in wider {
        match old.peek() {
            Some(o) if (o.1, o.0) == (f.1, f.0) => {
                old.next();
            }
            Some(o) if (o.1, o.0) < (f.1, f.0) => return None,
            _ => more.push(f),
        }
    }
    old.peek().is_none().then_some(more)
}

/// log(exp a + exp b).
fn log_add(a: f32, b: f32) -> f32 {
    let m = a.max(b);
    if m == f32::NEG_INFINITY {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

/// The tail estimate of one q head ([`AttentionOptions::tail`]).
struct Tail {
    /// Attention over the seeds left out; its `o` is zero while `weights` waits to be summed.
    part: Partial,
    /// The seeds it attended, as token ids.
    seeds: Vec<u32>,
    /// Time spent estimating it (value work, reported with the values).
    spent: Duration,
    /// The unnormalised weights of every segment's seed rows, segment after segment, whose
    /// values are not yet summed into `part` ([`Session::sum_tails`]); empty once summed.
    weights: Vec<f32>,
    /// With every key's score (a scan's exact ones, or the codes'), not deferred: the log of
    /// the mass left out, measured on them.
    left_out_lse: Option<f32>,
    /// Not deferred: the variance of `part`'s output as an estimate of the values left out
    /// ([`estimate`]; 0 when deferred).
    variance: f64,
}

/// Whether `choice` estimates the tail under `opts`: DIPR plans only, by default when the
/// optimizer chose them or the caller gave an error target.
fn estimates_tail(choice: Choice, opts: &AttentionOptions) -> bool {
    (matches!(choice.plan, Plan::GraphDiprs | Plan::Flat) || codes_choose(choice, opts))
        && opts.tail.unwrap_or(!choice.forced || choice.error_target.is_some())
}

/// The pq plan chooses by the codes' approximate scores with the seeds scored beside them
/// (as a DIPR plan does, with a tail estimate) for an error target, for the optimizer's
/// compact plans and where the caller asks for the tail; forced without either it is
/// PQCache's selection of a budget. DIPRS always chooses so once
/// [`Session::on_stored_index`] has kept it (its segments have codes).
fn codes_choose(choice: Choice, opts: &AttentionOptions) -> bool {
    match choice.plan {
        Plan::Pq => choice.error_target.is_some() || !choice.forced || opts.tail == Some(true),
        Plan::Diprs => true,
        _ => false,
    }
}

/// Whether the codes find a DIPR range (DIPRS without an error target): only the scores
/// near the best are needed.
fn codes_range(choice: Choice) -> bool {
    choice.plan == Plan::Diprs && choice.error_target.is_none()
}

/// Whether the codes choose the best within a budget (the optimizer's `pq` plan without an
/// error target, or a forced one asked for the tail): only each query's best of the codes'
/// scores are needed.
fn codes_best(choice: Choice, opts: &AttentionOptions) -> bool {
    choice.plan == Plan::Pq && choice.error_target.is_none() && codes_choose(choice, opts)
}

/// A coarse index that contradicts itself, named by context and plan.
fn coarse_corrupt(seg: &Segment, plan: Plan, e: String) -> Error {
    Error::Corrupt(format!("context {} {}: {e}", seg.context, plan.name()))
}

/// A coarse run must describe the index it was built beside: a run of other tokens or of
/// another dimension would score the group's queries split at the wrong places.
fn check_coarse_shape(r: &SegmentReader<'_>, plan: Plan, (tokens, dim): (u32, u32)) -> Result<()> {
    let l = r.index.layout();
    if (tokens, dim) != (l.tokens, l.dim) {
        let e = format!("its run holds {tokens} tokens of dimension {dim}, the index {} of {}", l.tokens, l.dim);
        return Err(coarse_corrupt(&r.seg, plan, e));
    }
    Ok(())
}

/// Retrieved (segment, token, score) triples best first: higher score, then the lower token.
fn best_first(a: &(usize, u32, f32), b: &(usize, u32, f32)) -> std::cmp::Ordering {
    b.2.total_cmp(&a.2).then(a.1.cmp(&b.1))
}

/// Leaves the `n` best of `found` (by [`best_first`]), in no order: a selection, not a sort.
fn keep_best(found: &mut Vec<(usize, u32, f32)>, n: usize) {
    if n == 0 {
        found.clear();
    } else if found.len() > n {
        found.select_nth_unstable_by(n - 1, best_first);
        found.truncate(n);
    }
}

/// How many of a search's best tokens the next search of the same q head starts from.
pub const WARM_START_TOKENS: usize = 64;

/// The [`WARM_START_TOKENS`] best of `found` (segment, token, score), as (segment, token in
/// the segment).
fn best_found(found: &[(usize, u32, f32)], readers: &[SegmentReader<'_>]) -> Vec<(usize, u32)> {
    let mut best = found.to_vec();
    keep_best(&mut best, WARM_START_TOKENS);
    best.into_iter().map(|(si, t, _)| (si, t - readers[si].seg.base)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_blocks_takes_every_token_of_each_candidates_block_once() {
        // Blocks of 4 tokens: candidates 1 and 2 share block 0, 9 is in block 2, 13 in the last
        // (partial: 14 tokens usable). Tokens 8 and 10 are in the window.
        let window = |t: u32| t == 8 || t == 10;
        assert_eq!(whole_blocks(&[1, 2, 9, 13], 4, 14, window), vec![0, 1, 2, 3, 9, 11, 12, 13]);
        assert_eq!(whole_blocks(&[], 4, 14, window), Vec::<u32>::new());
        // One row per block: the candidates themselves.
        assert_eq!(whole_blocks(&[3, 7], 1, 14, |_| false), vec![3, 7]);
    }

    #[test]
    fn negligible_tokens_are_dropped_least_attended_first_within_the_share() {
        // Scores (scale 1) 0, −1, …, −29 in token order 0..30, and a rest of weight 1 (lse 0).
        let mut found: Vec<(usize, u32, f32)> = (0..30).map(|t| (0, t, -(t as f32))).collect();
        let weights: Vec<f32> = (0..30).map(|t| (-(t as f32)).exp()).collect();
        let total = 1.0 + weights.iter().sum::<f32>();
        drop_negligible(&mut found, 1.0, 0.0);
        let kept = found.len();
        // The kept ones are the best, in their order; what was left out holds at most the
        // share, and leaving out one more would exceed it.
        assert!(found.iter().enumerate().all(|(i, f)| f.1 == i as u32), "{found:?}");
        let left_out: f32 = weights[kept..].iter().sum::<f32>() / total;
        assert!(left_out <= NEGLIGIBLE_SHARE, "{left_out}");
        assert!(left_out + weights[kept - 1] / total > NEGLIGIBLE_SHARE);
        assert!(kept < 30 && kept > 1, "kept {kept}");
        // A rest that outweighs everything leaves out all that fits in its share; nothing
        // when the scores are unknown.
        let mut all: Vec<(usize, u32, f32)> = (0..30).map(|t| (0, t, -(t as f32))).collect();
        drop_negligible(&mut all, 1.0, 20.0);
        assert!(all.is_empty(), "{all:?}");
        let mut none = vec![(0, 0, f32::NAN)];
        drop_negligible(&mut none, 1.0, f32::NEG_INFINITY);
        assert_eq!(none.len(), 1);
    }

    #[test]
    fn negligible_tokens_are_those_a_sort_would_leave_out() {
        // Thousands of tokens of tied and spread scores, against the least attended taken one
        // by one in sorted order until the next would exceed the share.
        let mut rng = ctxfs_vfs::SplitMix64::new(7);
        let mut rounded = 0;
        for case in 0..40 {
            let n = 1 + rng.below(5000) as usize;
            let found: Vec<(usize, u32, f32)> =
                (0..n as u32).map(|t| (0, t * 3, rng.below(400) as f32 / 40.0 - (case % 7) as f32)).collect();
            let rest = (case % 5) as f32 * 2.0 - 4.0;
            let mut got = found.clone();
            drop_negligible(&mut got, 0.7, rest);
            let scores: Vec<f32> = found.iter().map(|f| f.2).collect();
            let total = log_add(lse_of(&scores, 0.7), rest);
            let mut order = found.clone();
            order.sort_unstable_by(|a, b| best_first(b, a));
            let (mut share, mut left_out) = (0.0f64, 0);
            for f in &order {
                let p = ((f.2 * 0.7 - total) as f64).exp();
                if share + p > NEGLIGIBLE_SHARE as f64 {
                    break;
                }
                share += p;
                left_out += 1;
            }
            let mut kept = order[left_out..].to_vec();
            kept.sort_unstable_by_key(|f| f.1);
            // Sums in another order (per bucket of q·k, then by selection) may round the last
            // one across the share: one token apart, rarely.
            let apart = kept.len().abs_diff(got.len());
            assert!(apart <= 1, "case {case}: kept {} against {}", got.len(), kept.len());
            if apart == 0 {
                assert_eq!(got, kept, "case {case}");
            } else {
                rounded += 1;
            }
        }
        assert!(rounded <= 2, "{rounded} of 40 cases a token apart");
    }

    #[test]
    fn a_wider_range_adds_only_the_tokens_the_narrower_lacks() {
        let narrower = [(0, 3, 1.0), (1, 3, 2.0), (0, 9, 0.5)];
        let wider = [(0, 1, 0.1), (0, 3, 1.0), (1, 3, 2.0), (0, 4, 0.2), (0, 9, 0.5), (1, 12, 0.3)];
        assert_eq!(added(&narrower, &wider), Some(vec![(0, 1, 0.1), (0, 4, 0.2), (1, 12, 0.3)]));
        assert_eq!(added(&[], &wider), Some(wider.to_vec()));
        assert_eq!(added(&narrower, &narrower), Some(Vec::new()));
        // A token the wider range lost (a budget's cut, or another segment's) makes it no wider.
        assert_eq!(added(&narrower, &wider[..4]), None);
        assert_eq!(added(&narrower, &[(0, 3, 1.0), (0, 9, 0.5)]), None);
    }

    #[test]
    fn log_sums_of_nothing_are_minus_infinity() {
        assert_eq!(lse_of(&[], 1.0), f32::NEG_INFINITY);
        assert_eq!(log_add(f32::NEG_INFINITY, f32::NEG_INFINITY), f32::NEG_INFINITY);
        assert!((log_add(0.0, 0.0) - 2f32.ln()).abs() < 1e-6);
        assert!((lse_of(&[1.0, 1.0], 2.0) - (2.0 + 2f32.ln())).abs() < 1e-6);
    }
}
