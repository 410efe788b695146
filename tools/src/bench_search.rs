//! `ctxfs bench search`: every search method side by side on generated attention, against
//! exact attention over all tokens. Every method attends the same window (128 + 512 tokens).
//!
//! The timed unit is a GQA group's decode step: the 4 q heads of one kv head, as a session
//! serves them. The flat baseline is the session's flat plan: one `flat::scan_many` pass over
//! the keys for the whole group, then each q head's DIPR set from its scores. Every method's
//! time includes scoring the window (its maximum sets the DIPR range). Speed-ups are ratios
//! of sums over every group step of every head, as a decode step pays the sum; each head's
//! sums are reported too. Heads come from several generator seeds (`--seeds`); the search's
//! defaults were tuned on seed 1 only.
//!
//! Besides the DIPRS and flat searches, the coarse indexes (Quest pages, InfLLM blocks, PQ
//! codes at PQCache's two settings) and graph top-k select at equal token budgets (1K, 2K,
//! 4K). DIPRS has no budget: its range sets how many tokens it returns (fewer than 1K outside
//! the window on generated data at β = 5·√d), so graph top-k is the graph index's row at
//! each budget. A coarse method's budget counts every token it selects, including any that
//! the window already holds (those are attended once); top-k's counts tokens outside it.
//!
//! The `diprs` row finds the DIPR range as `ctxfs query --mode diprs` does: from the
//! approximate scores of PQ scan codes, the candidates scored exactly
//! ([`ctxfs_index::approx::in_range`]); its keys scored count the seeds and the candidates.
//! The `graph diprs` rows find it by a walk of the graph index (`--mode graph-diprs`).
//!
//! Bytes per query, at 4 KiB blocks: `meta` is the index metadata a selection touched (a
//! coarse method's page bounds, representatives or codes and centroids; for graph and flat
//! rows, the key rows scored and the adjacency records expanded); `data` is 4 KiB per
//! distinct value block of the retrieved tokens outside the window, and for coarse methods
//! per key block too, since only their exact scores (from the keys) weigh the values.
//!
//! Beside the rows, a probe times scattered key rows against the flat scan's rows (see
//! [`PROBE_ROWS`]): how far a graph search can be faster than the scan depends on it.

use crate::bench::{median, ratio};
use anyhow::{ensure, Result};
use ctxfs_attention::WARM_START_TOKENS;
use ctxfs_attention::{KvSource, SafetensorsKv};
use ctxfs_index::approx::{self, RangeScan};
use ctxfs_index::coarse::infllm::{Infllm, InfllmParams};
use ctxfs_index::coarse::pq::{Pq, PqParams};
use ctxfs_index::coarse::quest::{Quest, QuestParams};
use ctxfs_index::flat::GroupScan;
use ctxfs_index::search::SEED_STRIDE;
use ctxfs_index::search::{diprs, diprs_from, topk};
use ctxfs_index::synth::{head, HeadData, Rng, SynthParams};
use ctxfs_index::target::{estimate, left_out_lse, TailVariance, ValueSpread, REFINEMENTS};
use ctxfs_index::{build, flat, BuildParams, Coarse, DiprsParams, MemGraph, MemKeys};
use ctxfs_index::{Estimate, Keys, MassTarget, Pair, SearchResult, SearchStats};
use ctxfs_kernels::Partial;
use ctxfs_vfs::DType;
use half::f16;
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Instant;

#[derive(clap::Args)]
pub struct Args {
    /// Tokens per head.
    #[arg(long, default_value_t = 131072)]
    tokens: usize,
    /// Head dimension of the generated heads.
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// kv heads generated per seed (each with its own sparsity).
    #[arg(long, default_value_t = 2, value_parser = crate::values::at_least::<1>)]
    heads: usize,
    /// Decode steps per kv head (each a query for every one of its 4 q heads).
    #[arg(long, default_value_t = 8, value_parser = crate::values::at_least::<1>)]
    queries: usize,
    /// Generator seeds, comma-separated. The search's defaults were tuned on seed 1; the
    /// others are data they never saw.
    #[arg(long, value_delimiter = ',', default_value = "1,2,3")]
    seeds: Vec<u64>,
    /// A real attention dataset (`python -m ctxfs.capture`: keys, values, prefill and decode
    /// queries of a model's layers), measured beside the generator; repeatable. Each of its
    /// (layer, kv head) is a head; `--queries` caps the decode steps used.
    #[arg(long = "data", value_name = "PATH")]
    data: Vec<std::path::PathBuf>,
    /// Measure only the `--data` sets, not the generator.
    #[arg(long, requires = "data")]
    no_generator: bool,
    /// The output error the target rows ask for (against exact attention): the flat scan
    /// and DIPRS choose β per query to meet it, and each is compared with the oracle, the
    /// fewest best-scoring tokens that meet it.
    #[arg(long, default_value_t = 0.01, value_parser = crate::values::positive::<f32>)]
    target_error: f32,
    /// The reference DIPR range, in units of √d: the range the DIPRS rows find and their
    /// recall is measured on (√d·ln 100, AlayaDB's, is 4.61).
    #[arg(long, default_value_t = 5.0, value_parser = crate::values::positive::<f32>)]
    beta: f32,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// Where a dataset's heads come from.
enum Source {
    /// `ctxfs_index::synth` heads: `--heads` kv heads per seed.
    Generator { seeds: Vec<u64>, heads: usize, tokens: usize, head_dim: usize },
    /// A captured file, with its metadata's description.
    /// `layers`: the model layer of each of the file's layers (its metadata's `layers`).
    File { kv: Box<SafetensorsKv>, path: std::path::PathBuf, about: String, layers: Vec<String> },
}

/// One head of a dataset: its data and how to name it.
struct BenchHead {
    label: serde_json::Value,
    sharpness: Option<f32>,
    data: HeadData,
}

impl Source {
    fn open(path: &std::path::Path) -> Result<Source> {
        let kv = Box::new(SafetensorsKv::open(path, DType::F16)?);
        // Sorted, so that the description reads the same every run.
        let meta: std::collections::BTreeMap<&str, &str> =
            kv.metadata().into_iter().flatten().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let about = meta.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(", ");
        let named: Vec<String> =
            meta.get("layers").map(|l| l.split(',').map(str::to_string).collect()).unwrap_or_default();
        let count = kv.shape().layers as usize;
        let layers = if named.len() == count { named } else { (0..count).map(|l| l.to_string()).collect() };
        Ok(Source::File { kv, path: path.to_path_buf(), about, layers })
    }
    fn name(&self) -> String {
        match self {
            Source::Generator { .. } => "generator".into(),
            Source::File { path, .. } => path.file_stem().map_or("data".into(), |s| s.to_string_lossy().into_owned()),
        }
    }
    fn tokens(&self) -> usize {
        match self {
            Source::Generator { tokens, .. } => *tokens,
            Source::File { kv, .. } => kv.token_count(),
        }
    }
    fn head_dim(&self) -> usize {
        match self {
            Source::Generator { head_dim, .. } => *head_dim,
            Source::File { kv, .. } => kv.shape().head_dim as usize,
        }
    }
    fn group(&self) -> usize {
        match self {
            Source::Generator { .. } => GROUP,
            Source::File { kv, .. } => (kv.shape().q_heads / kv.shape().kv_heads) as usize,
        }
    }
    fn heads(&self) -> usize {
        match self {
            Source::Generator { seeds, heads, .. } => seeds.len() * heads,
            Source::File { kv, .. } => kv.shape().layers as usize * kv.shape().kv_heads as usize,
        }
    }
    /// Head `i`, with at most `queries` decode steps.
    fn head(&self, i: usize, queries: usize) -> Result<BenchHead> {
        match self {
            Source::Generator { seeds, heads, tokens, head_dim } => {
                let (seed, kv) = (seeds[i / heads], i % heads);
                let p = SynthParams { tokens: *tokens, head_dim: *head_dim, group: GROUP, seed };
                let data = head(&p, 1, kv, (tokens / 4 / GROUP).clamp(64, 4096), queries);
                let label = json!({"seed": seed, "tuning_seed": seed == TUNING_SEED, "kv_head": kv});
                Ok(BenchHead { label, sharpness: Some(data.sharpness), data })
            }
            Source::File { kv, path, layers, .. } => {
                let heads = kv.shape().kv_heads as usize;
                let (layer, h) = (i / heads, i % heads);
                let d = kv.shape().head_dim as usize;
                let decode = kv.decode_queries(layer, h)?.ok_or_else(|| {
                    anyhow::anyhow!(
                        "{}: no layers.{layer}.decode_q tensor (write the file with python -m ctxfs.capture)",
                        path.display()
                    )
                })?;
                let steps = decode[0].len() / d;
                ensure!(steps > 0, "{}: layers.{layer}.decode_q holds no steps", path.display());
                let take = queries.min(steps);
                let decode = decode.into_iter().map(|q| q[..take * d].to_vec()).collect();
                let f16s = |x: Vec<f32>| x.into_iter().map(f16::from_f32).collect::<Vec<f16>>();
                let data = HeadData {
                    keys: f16s(kv.keys(layer, h)?),
                    values: f16s(kv.values(layer, h)?),
                    prefill: vec![kv.train_queries(layer, h)?],
                    decode,
                    sharpness: f32::NAN,
                };
                let label = json!({"layer": layers[layer], "kv_head": h});
                Ok(BenchHead { label, sharpness: None, data })
            }
        }
    }
}

const WINDOW: (usize, usize) = (128, 512);
const GROUP: usize = 4;
/// Token budgets of the coarse rows and of graph top-k beside them.
const BUDGETS: [usize; 3] = [1024, 2048, 4096];
/// The block size bytes are counted in.
const BLOCK: usize = 4096;
/// The coarse indexes, in the order they are built for each head.
const COARSE: [&str; 4] = ["quest", "infllm", "pq m2b6", "pq m4b8"];
/// The build time's name of the `pq target` row's codes.
const SCAN_CODES: &str = "pq scan codes";
/// Prefix shares of the filtered rows, in percent: each is also served by a graph built on
/// the prefix alone and by a flat scan of the prefix, the two ways to answer without a filter.
const PREFIX_SHARES: [usize; 2] = [20, 50];
/// The seed the search's defaults were tuned on.
const TUNING_SEED: u64 = 1;

/// How a row selects its tokens.
#[derive(Clone, Copy)]
enum Method {
    /// Exact DIPR by the session's flat plan, over the first `prefix` tokens if given; with
    /// an output error target, β is chosen per query to meet it.
    Flat { beta: f32, prefix: Option<u32>, target: Option<f32> },
    /// Graph top-k, keeping the best `k` outside the window.
    Topk(usize),
    /// DIPRS; `warm`: also from the best tokens of the same q head's last decode step, as
    /// sessions search ([`ctxfs_index::search::diprs_from`]); with an output error target,
    /// β is chosen per query to meet it ([`ctxfs_index::target`]).
    Diprs { beta: f32, prefix: Option<u32>, warm: bool, target: Option<f32> },
    /// DIPRS without a filter on the graph of the first tokens only (of [`PREFIX_SHARES`]).
    PrefixGraph { beta: f32, share: usize },
    /// A coarse index (of [`COARSE`]) at a token budget.
    Coarse { index: usize, budget: usize },
    /// The scan's output error target on PQ codes ([`PqParams::scan_codes`]): candidates
    /// from the approximate scores ([`ctxfs_index::approx`]), those the margin adds refined
    /// by the residual codes where the codes have them and `refine` asks, scored exactly.
    CodesTarget { target: f32, refine: bool },
    /// The DIPR range at `beta` on PQ codes ([`PqParams::scan_codes`]): candidates from the
    /// approximate scores, down to the codes' margin below the range
    /// ([`ctxfs_index::approx::in_range`]), scored exactly; over the first `prefix` tokens
    /// if given (the scan skips the codes beyond it, as a session reusing part of a context
    /// filters).
    CodesRange { beta: f32, prefix: Option<u32> },
}

impl Method {
    /// The tokens the method answers over: all `n`, or a prefix.
    fn tokens(self, n: usize) -> usize {
        match self {
            Method::Flat { prefix: Some(p), .. }
            | Method::Diprs { prefix: Some(p), .. }
            | Method::CodesRange { prefix: Some(p), .. } => p as usize,
            Method::PrefixGraph { share, .. } => prefix_len(n, PREFIX_SHARES[share]),
            _ => n,
        }
    }
    fn target(self) -> Option<f32> {
        match self {
            Method::Flat { target, .. } | Method::Diprs { target, .. } => target,
            Method::CodesTarget { target, .. } => Some(target),
            _ => None,
        }
    }
    /// Whether the method chooses from metadata and then reads its candidates' keys to
    /// score them exactly (a coarse index, or codes).
    fn scores_candidates(self) -> bool {
        matches!(self, Method::Coarse { .. } | Method::CodesTarget { .. } | Method::CodesRange { .. })
    }
    fn beta(self, reference: f32) -> f32 {
        match self {
            Method::Flat { beta, .. }
            | Method::Diprs { beta, .. }
            | Method::PrefixGraph { beta, .. }
            | Method::CodesRange { beta, .. } => beta,
            _ => reference,
        }
    }
}

fn prefix_len(n: usize, percent: usize) -> usize {
    n * percent / 100
}

#[derive(Default, Clone)]
struct Row {
    name: String,
    budget: Option<usize>,
    recall: Vec<f64>,
    recovery: Vec<f64>,
    error: Vec<f64>,
    exact_dipr_error: Vec<f64>,
    scored: Vec<f64>,
    /// Per group step.
    micros: Vec<f64>,
    /// Summed per head, in the order heads were generated.
    head_micros: Vec<f64>,
    /// Per group step, of a row that scans codes: the seeds' scores and the scan.
    scan_micros: Vec<f64>,
    selected: Vec<f64>,
    meta_bytes: Vec<f64>,
    data_bytes: Vec<f64>,
    meta_per_token: Vec<f64>,
    /// The output error the row targets.
    target: Option<f32>,
    /// Per query, with a target: 1 when the output error met it.
    target_met: Vec<f64>,
    /// Per query: tokens retrieved beyond the window, and the oracle's.
    vs_oracle: Vec<(f64, f64)>,
    /// Per query: the output error estimated without the tail estimate.
    estimate: Vec<f64>,
}

/// The rows, in order: the graph and flat searches, then per budget graph top-k and the
/// coarse indexes.
fn methods(n: usize, sqrt_d: f32, target_error: f32, names: &RowNames) -> Vec<(String, Method)> {
    let beta = names.units * sqrt_d;
    let plain = |beta: f32, prefix: Option<u32>| Method::Diprs { beta, prefix, warm: false, target: None };
    let target = Some(target_error);
    let mut m: Vec<(String, Method)> = vec![
        (FLAT_ROW.into(), Method::Flat { beta, prefix: None, target: None }),
        ("topk k=100".into(), Method::Topk(100)),
        ("topk k=2000".into(), Method::Topk(2000)),
        ("graph diprs beta=2·√d".into(), plain(2.0 * sqrt_d, None)),
        ("graph diprs beta=3·√d".into(), plain(3.0 * sqrt_d, None)),
        (names.graph.clone(), plain(beta, None)),
        (names.all_cold.clone(), plain(beta, None)),
        (names.warm.clone(), Method::Diprs { beta, prefix: None, warm: true, target: None }),
        (FLAT_TARGET_ROW.into(), Method::Flat { beta, prefix: None, target }),
        (GRAPH_TARGET_ROW.into(), Method::Diprs { beta, prefix: None, warm: false, target }),
        (CODES_TARGET_ROW.into(), Method::CodesTarget { target: target_error, refine: true }),
        (CODES_ALONE_TARGET_ROW.into(), Method::CodesTarget { target: target_error, refine: false }),
        (names.diprs.clone(), Method::CodesRange { beta, prefix: None }),
    ];
    for (share, percent) in PREFIX_SHARES.into_iter().enumerate() {
        let p = Some(prefix_len(n, percent) as u32);
        m.push((filtered_row(percent), plain(beta, p)));
        m.push((codes_filtered_row(percent), Method::CodesRange { beta, prefix: p }));
        m.push((prefix_graph_row(percent), Method::PrefixGraph { beta, share }));
        m.push((flat_prefix_row(percent), Method::Flat { beta, prefix: p, target: None }));
    }
    for budget in BUDGETS {
        let k = budget / 1024;
        m.push((format!("topk k={k}K"), Method::Topk(budget)));
        for (index, name) in COARSE.iter().enumerate() {
            m.push((format!("{name} {k}K"), Method::Coarse { index, budget }));
        }
    }
    m
}

/// The baseline row: the session's flat plan over all tokens.
const FLAT_ROW: &str = "flat";
/// The names of the rows that find the reference range β = `units`·√d (`--beta`).
struct RowNames {
    units: f32,
    /// The DIPR range as `ctxfs query --mode diprs` finds it: on the PQ scan codes.
    diprs: String,
    /// The same range by a walk of the graph (`--mode graph-diprs`).
    graph: String,
    /// The graph's walk started from the last decode step's best tokens.
    warm: String,
    /// The graph's walk timed with its code cold as well as the head's data (see
    /// [`WARM_UP_TOKENS`]): the bound for a search that runs after unrelated work.
    all_cold: String,
}

impl RowNames {
    fn at(units: f32) -> RowNames {
        let beta = format!("beta={units}·√d");
        RowNames {
            units,
            diprs: format!("diprs {beta}"),
            graph: format!("graph diprs {beta}"),
            warm: format!("graph diprs {beta} warm"),
            all_cold: format!("graph diprs {beta} all-cold"),
        }
    }

    /// The names a dataset's report was made with.
    fn of(report: &serde_json::Value) -> RowNames {
        RowNames::at(report["reference_beta_sqrt_d"].as_f64().unwrap_or(5.0) as f32)
    }
}

/// The rows that choose β per query to meet `--target-error`.
const FLAT_TARGET_ROW: &str = "flat target";
const GRAPH_TARGET_ROW: &str = "graph diprs target";
const CODES_TARGET_ROW: &str = "pq target";
/// The same without the residual codes' refinement.
const CODES_ALONE_TARGET_ROW: &str = "pq target, codes alone";
/// The target rows, in the order the target table lists them.
const TARGET_ROWS: [&str; 4] = [FLAT_TARGET_ROW, GRAPH_TARGET_ROW, CODES_TARGET_ROW, CODES_ALONE_TARGET_ROW];

fn codes_filtered_row(percent: usize) -> String {
    format!("diprs filtered {percent}%")
}
fn filtered_row(percent: usize) -> String {
    format!("graph diprs filtered {percent}%")
}
fn prefix_graph_row(percent: usize) -> String {
    format!("graph diprs {percent}% prefix graph")
}
fn flat_prefix_row(percent: usize) -> String {
    format!("flat {percent}% prefix")
}

/// Tokens of the warm-up head. After the caches are flushed, each row's method first runs
/// once on this small head, as a decode step runs it on every head and layer in turn: the
/// timed search then finds its code, and the allocator's, in the caches (as it would after
/// another head's search) and this head's keys and graph evicted. Flushed code alone costs
/// graph DIPRS about 1% at 131,072 tokens (the median group step of this bench's all-cold row
/// against β = 5√d's: 306 µs against 303 over 12 heads, docs/benchmarks.md).
const WARM_UP_TOKENS: usize = 4096;

/// Key rows of the scattered-read probe: uniformly random rows of the head, scored from cold
/// caches through the same path DIPRS scores its neighbours by. What one costs, against a
/// row of the flat scan, bounds how many scattered rows a search can read and still be a
/// given factor faster than the scan.
const PROBE_ROWS: usize = 1024;

/// Bytes written before each timed search: twice this VM's 32 MiB L3.
const CACHE_FLUSH_BYTES: usize = 64 << 20;

/// Every method is timed with the head's data out of the CPU caches. In a decode step a
/// head's search follows the other heads' and layers' searches, which have evicted its keys;
/// without this, a method timed right after another on the same query (β = 2√d, 3√d, then
/// 5√d) finds that query's keys cached and measured up to 2× faster than the same search
/// timed after others. Those searches run the same code, so the code is warmed again after
/// the flush (see [`WARM_UP_TOKENS`]).
fn evict_caches(buf: &mut [u64]) {
    for (i, x) in buf.iter_mut().enumerate().step_by(8) {
        *x = x.wrapping_add(i as u64);
    }
    std::hint::black_box(buf);
}

/// One head's indexes, as the methods search them.
struct HeadIndexes {
    keys: MemKeys,
    /// The values, row after row: the target rows estimate their error from the window's,
    /// the retrieved tokens' and the seeds'.
    values: Vec<f16>,
    /// The seed values' spread ([`seed_value_spread`]), which the target rows' estimates read.
    seed_spread: f64,
    graph: MemGraph,
    /// In the order of [`COARSE`].
    coarse: Vec<Box<dyn Coarse>>,
    /// The codes the `pq target` row scans ([`PqParams::scan_codes`]).
    codes: Pq,
    /// The keys and graph of each prefix of [`PREFIX_SHARES`], built on its own.
    prefix_graphs: Vec<(MemKeys, MemGraph)>,
}

impl HeadIndexes {
    /// The graph (trained on `prefill`), the coarse indexes and the prefix graphs of `keys`,
    /// and how long each build took (the graph's by phase).
    fn build(keys: MemKeys, values: Vec<f16>, prefill: &[f32]) -> Result<(HeadIndexes, serde_json::Value)> {
        let started = Instant::now();
        let (graph, report) = build(&keys, prefill, &BuildParams::default());
        let graph_seconds = started.elapsed().as_secs_f64();
        let mut coarse: Vec<Box<dyn Coarse>> = Vec::new();
        let mut seconds = serde_json::Map::new();
        for name in COARSE {
            let started = Instant::now();
            coarse.push(match name {
                "quest" => Box::new(Quest::build(&keys, &QuestParams::default()).map_err(anyhow::Error::msg)?),
                "infllm" => {
                    Box::new(Infllm::build(&keys, prefill, &InfllmParams::default()).map_err(anyhow::Error::msg)?)
                }
                "pq m2b6" => Box::new(Pq::build(&keys, &PqParams::M2B6).map_err(anyhow::Error::msg)?),
                _ => Box::new(Pq::build(&keys, &PqParams::M4B8).map_err(anyhow::Error::msg)?),
            });
            seconds.insert(name.into(), json!(started.elapsed().as_secs_f64()));
        }
        let d = keys.dim();
        let started = Instant::now();
        let codes = Pq::build(&keys, &PqParams::scan_codes(d)).map_err(anyhow::Error::msg)?;
        seconds.insert(SCAN_CODES.into(), json!(started.elapsed().as_secs_f64()));
        let n = keys.len() as usize;
        let prefix_graphs = PREFIX_SHARES
            .map(|percent| {
                let p = prefix_len(n, percent);
                let keys = MemKeys::new(d, keys.data()[..p * d].to_vec());
                let graph = build(&keys, prefill, &BuildParams::default()).0;
                (keys, graph)
            })
            .into();
        let timing = json!({
            "seconds": graph_seconds, "knn_seconds": report.knn.as_secs_f64(),
            "projection_seconds": report.projection.as_secs_f64(),
            "enhancement_seconds": report.enhancement.as_secs_f64(), "training_queries": report.queries,
            "coarse_seconds": seconds,
        });
        let seed_spread = seed_value_spread(&values, d, n.div_ceil(SEED_STRIDE as usize));
        Ok((HeadIndexes { keys, values, seed_spread, graph, coarse, codes, prefix_graphs }, timing))
    }
}

/// The window of a context of `n` tokens: its token ids, and its key rows side by side, as a
/// session keeps them resident.
struct Window {
    ids: Vec<u32>,
    keys: Vec<f16>,
}

impl Window {
    fn of(keys: &MemKeys, n: usize) -> Window {
        let d = keys.dim();
        let ids = ctxfs_attention::Window { init: WINDOW.0 as u32, recent: WINDOW.1 as u32 }.tokens(n as u32);
        let keys =
            ids.iter().flat_map(|&t| keys.data()[t as usize * d..(t as usize + 1) * d].iter().copied()).collect();
        Window { ids, keys }
    }
}

/// What a method selected for one q head.
struct Selection {
    /// Best first for the searches, ascending for coarse indexes.
    ids: Vec<u32>,
    keys_scored: u64,
    /// Index metadata bytes touched.
    meta_bytes: u64,
    /// Bytes per token the index holds.
    per_token: f64,
    /// With an error target: the tail estimate merged into the answer (as sessions merge
    /// it), and the output error estimated without it.
    target: Option<(Partial, Estimate)>,
    /// On the first query's selection of a row that scans codes for the whole group: µs the
    /// seeds' scores and the scan took, before any candidate was scored exactly.
    scan_micros: Option<f64>,
}

/// Runs `method` for a GQA group's queries `qs` on `ix`: the window's scores (their maximum
/// sets each DIPR range), then the selection. `windows` holds the window of every length a
/// method answers over; `previous` each q head's start for the warm row, replaced by this
/// search's best tokens.
fn run_group(
    method: Method,
    ix: &HeadIndexes,
    qs: &[f32],
    windows: &WindowSet,
    previous: &mut [Vec<u32>],
) -> Result<Vec<Selection>> {
    let d = ix.keys.dim();
    let n = ix.keys.len() as usize;
    let window = windows.get(method.tokens(n));
    let scale = 1.0 / (d as f32).sqrt();
    // Each q head's window scores, maximum and (in softmax units) log-sum-exp.
    let win_z: Vec<Vec<f32>> = qs
        .chunks_exact(d)
        .map(|q| {
            let mut z = vec![0.0f32; window.ids.len()];
            ctxfs_kernels::scores(&window.keys, q, 1.0, &mut z);
            z
        })
        .collect();
    let win_max: Vec<f32> = win_z.iter().map(|z| z.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
    // The log-sum-exp alone: the window's values are attended with the answer, not here.
    let win_lse: Vec<f32> = win_z
        .iter()
        .map(|z| {
            let mut zs: Vec<f32> = z.iter().map(|x| x * scale).collect();
            Partial::unsummed(ctxfs_kernels::active(), &mut zs, d).lse()
        })
        .collect();
    let mass_target =
        |target: Option<f32>, i: usize| target.map(|share| MassTarget { share, scale, window_lse: win_lse[i] });
    // A target row's answer is checked against its error estimate and, when that misses the
    // target, searched again for the refined mass target (as sessions do).
    // A scan's rows give every key's score (`exact`), and so the mass left out exactly.
    let estimated = |f: &SearchResult, seeds: &[f32], exact: Option<&[f32]>, i: usize| {
        estimate_of(f, (seeds, exact), window, &win_z[i], (&ix.values, ix.seed_spread), d, scale)
    };
    let graph_meta =
        |s: &SearchStats, graph: &MemGraph| s.keys_scored * 2 * d as u64 + s.hops * 4 * graph.degree as u64;
    let graph_per_token = |graph: &MemGraph| (2 * d + 4 * graph.degree) as f64;
    let searched = |f: SearchResult, graph: &MemGraph| Selection {
        keys_scored: f.stats.keys_scored,
        meta_bytes: graph_meta(&f.stats, graph),
        per_token: graph_per_token(graph),
        target: None,
        ids: f.ids,
        scan_micros: None,
    };
    let mut out = Vec::with_capacity(qs.len() / d);
    match method {
        Method::Flat { beta, prefix, target } => {
            let targets: Vec<Option<MassTarget>> = (0..win_max.len()).map(|i| mass_target(target, i)).collect();
            let scan = flat::scan_many(&ix.keys, qs, prefix.unwrap_or(u32::MAX))?;
            for (i, mut f) in flat_group(&scan, beta, &win_max, &targets).into_iter().enumerate() {
                if let (Some(e), Some(mut t)) = (target, targets[i]) {
                    let seeds = seeds_of(scan.scores(i));
                    for _ in 0..REFINEMENTS {
                        let Some(wider) = t.refined(estimated(&f, &seeds, Some(scan.scores(i)), i).1, e) else {
                            break;
                        };
                        t = wider;
                        f = flat::dipr_or_target(scan.scores(i), beta, win_max[i], Some(&t), scan.stats);
                    }
                }
                let scored = f.stats.keys_scored;
                let estimate = target.map(|_| estimated(&f, &seeds_of(scan.scores(i)), Some(scan.scores(i)), i));
                out.push(Selection {
                    ids: f.ids,
                    keys_scored: scored,
                    meta_bytes: scored * 2 * d as u64,
                    per_token: (2 * d) as f64,
                    target: estimate,
                    scan_micros: None,
                });
            }
        }
        Method::Topk(k) => {
            let idx = Pair { keys: &ix.keys, graph: &ix.graph };
            for q in qs.chunks_exact(d) {
                out.push(searched(
                    topk(&idx, q, k + window.ids.len(), k.max(128) + window.ids.len(), None)?,
                    &ix.graph,
                ));
            }
        }
        Method::Diprs { beta, prefix, warm, target } => {
            let idx = Pair { keys: &ix.keys, graph: &ix.graph };
            for (i, q) in qs.chunks_exact(d).enumerate() {
                let params = DiprsParams {
                    beta,
                    window_max: win_max[i],
                    prefix,
                    target: mass_target(target, i),
                    ..Default::default()
                };
                let mut f = if warm { diprs_from(&idx, q, &params, &previous[i])? } else { diprs(&idx, q, &params)? };
                if let (Some(e), Some(mut t)) = (target, params.target) {
                    for _ in 0..REFINEMENTS {
                        let Some(wider) = t.refined(estimated(&f, &f.seeds.scores, None, i).1, e) else { break };
                        t = wider;
                        let stats = f.stats;
                        f = diprs_from(&idx, q, &DiprsParams { target: Some(t), ..params }, &f.ids)?;
                        f.stats += stats;
                    }
                }
                if warm {
                    // A search's tokens come best first.
                    previous[i] = f.ids.iter().copied().take(WARM_START_TOKENS).collect();
                }
                let estimate = target.map(|_| estimated(&f, &f.seeds.scores, None, i));
                out.push(Selection { target: estimate, ..searched(f, &ix.graph) });
            }
        }
        Method::PrefixGraph { beta, share } => {
            let (keys, graph) = &ix.prefix_graphs[share];
            let idx = Pair { keys, graph };
            for (i, q) in qs.chunks_exact(d).enumerate() {
                let params = DiprsParams { beta, window_max: win_max[i], ..Default::default() };
                out.push(searched(diprs(&idx, q, &params)?, graph));
            }
        }
        Method::CodesTarget { target, refine: refining } => {
            let per_token = ix.codes.metadata_bytes_per_token();
            let scan = ix.codes.token_scores_many(qs, None)?;
            for (i, q) in qs.chunks_exact(d).enumerate() {
                let approx = scan.scores(i);
                let mut stats = SearchStats::default();
                let seeds = seed_scores(&ix.keys, q, ix.keys.len(), &mut stats)?;
                let samples: Vec<f32> = approx.iter().step_by(SEED_STRIDE as usize).copied().collect();
                let margin = approx::margin(&seeds, &samples);
                // The residual codes' refinement of the candidates, as compact sessions make it.
                let codes = &ix.codes;
                let table = if refining { codes.residual_table(q).map_err(|e| anyhow::anyhow!("{e}"))? } else { None };
                let refiner = match table {
                    Some(table) => {
                        let refined = |ids: &[u32], s: &mut [f32]| codes.refine(&table, ids, s);
                        let margin = approx::refined_margin((&seeds, SEED_STRIDE), &samples, refined)
                            .map_err(|e| anyhow::anyhow!("{e}"))?;
                        Some((table, margin))
                    }
                    None => None,
                };
                let refine = |ids: &[u32], scores: &mut [f32]| -> Result<Option<f32>> {
                    let Some((table, margin)) = &refiner else { return Ok(None) };
                    codes.refine(table, ids, scores).map_err(|e| anyhow::anyhow!("{e}"))?;
                    Ok(Some(*margin))
                };
                let (ids, target) = {
                    {
                        // Exact scores of the candidates so far (NaN: not scored): a widened
                        // target scores only its new candidates.
                        let mut exact = vec![f32::NAN; n];
                        let mut select = |t: &MassTarget| -> Result<SearchResult> {
                            let pairs =
                                approx::attended(approx, win_max[i], t, margin, refine, |ids| -> Result<Vec<f32>> {
                                    let new: Vec<u32> =
                                        ids.iter().copied().filter(|&t| exact[t as usize].is_nan()).collect();
                                    let mut scores = vec![0.0f32; new.len()];
                                    ix.keys
                                        .score(&new, q, &mut scores, &mut stats)
                                        .map_err(|e| anyhow::anyhow!("{e}"))?;
                                    for (&t, &s) in new.iter().zip(&scores) {
                                        exact[t as usize] = s;
                                    }
                                    Ok(ids.iter().map(|&t| exact[t as usize]).collect())
                                })?;
                            Ok(SearchResult::from_pairs(pairs, SearchStats::default()))
                        };
                        let mut t = mass_target(Some(target), i).expect("a target");
                        let mut f = select(&t)?;
                        for _ in 0..REFINEMENTS {
                            let Some(wider) = t.refined(estimated(&f, &seeds, Some(approx), i).1, target) else {
                                break;
                            };
                            t = wider;
                            f = select(&t)?;
                        }
                        let estimate = estimated(&f, &seeds, Some(approx), i);
                        (f.ids, Some(estimate))
                    }
                };
                out.push(Selection {
                    ids,
                    keys_scored: stats.keys_scored,
                    meta_bytes: (n as f64 * per_token) as u64 + stats.keys_scored * 2 * d as u64,
                    per_token,
                    target,
                    scan_micros: None,
                });
            }
        }
        Method::CodesRange { beta, prefix } => {
            // As a session finds a range on this core: the seeds first, which bound each
            // query's best, then a scan keeping the scores above each query's floor.
            let per_token = ix.codes.metadata_bytes_per_token();
            // The tokens it answers over, whose codes it reads.
            let len = prefix.map_or(n, |p| p as usize);
            let mut stats = vec![SearchStats::default(); win_max.len()];
            let scanning = Instant::now();
            let seeds = qs
                .chunks_exact(d)
                .zip(&mut stats)
                .map(|(q, stats)| seed_scores(&ix.keys, q, len as u32, stats))
                .collect::<Result<Vec<_>>>()?;
            let floor = |i: usize, sample: &[f32]| {
                let known = approx::known_max(&seeds[i], win_max[i]);
                Some(approx::range_floor(known, beta, approx::margin(&seeds[i], sample)))
            };
            let above = ix.codes.token_above_many(qs, prefix, SEED_STRIDE, &floor)?;
            let every = match above {
                Some(_) => None,
                None => Some(ix.codes.token_scores_many(qs, prefix)?),
            };
            let scan_micros = scanning.elapsed().as_secs_f64() * 1e6;
            for (i, q) in qs.chunks_exact(d).enumerate() {
                let stats = &mut stats[i];
                let score = |ids: &[u32]| -> Result<Vec<f32>> {
                    let mut scores = vec![0.0f32; ids.len()];
                    ix.keys.score(ids, q, &mut scores, stats).map_err(|e| anyhow::anyhow!("{e}"))?;
                    Ok(scores)
                };
                let given = match (&above, &every) {
                    (Some(above), _) => RangeScan::Above(above.queries[i].as_ref()),
                    (None, Some(every)) => RangeScan::Every(every.query(i)),
                    (None, None) => unreachable!("every score where nothing was kept"),
                };
                let rescan = || Ok(ix.codes.token_scores_many(q, prefix)?);
                // The keys are in memory: refining candidates by the residual codes would cost
                // about what scoring them does (`approx::RangeRefine`).
                let unrefined = &mut approx::Unrefined;
                let pairs = approx::range_on_codes(
                    given,
                    (&seeds[i], SEED_STRIDE),
                    win_max[i],
                    beta,
                    unrefined,
                    score,
                    rescan,
                )?;
                out.push(Selection {
                    ids: SearchResult::from_pairs(pairs, SearchStats::default()).ids,
                    keys_scored: stats.keys_scored,
                    meta_bytes: (len as f64 * per_token) as u64 + stats.keys_scored * 2 * d as u64,
                    per_token,
                    target: None,
                    scan_micros: (i == 0).then_some(scan_micros),
                });
            }
        }
        Method::Coarse { index, budget } => {
            let c = &ix.coarse[index];
            for q in qs.chunks_exact(d) {
                let f = c.select(q, budget, None)?;
                out.push(Selection {
                    ids: f.ids,
                    keys_scored: f.stats.keys_scored,
                    meta_bytes: f.metadata_bytes,
                    per_token: c.metadata_bytes_per_token(),
                    target: None,
                    scan_micros: None,
                });
            }
        }
    }
    Ok(out)
}

/// The seeds' exact scores of `q` below token `limit`: every [`SEED_STRIDE`]-th key, from the
/// seed table in one sequential scan, as sessions score them (the resident sample the codes'
/// margin is measured on).
fn seed_scores(keys: &MemKeys, q: &[f32], limit: u32, stats: &mut SearchStats) -> Result<Vec<f32>> {
    let mut seeds = Vec::new();
    keys.score_strided(SEED_STRIDE, limit, q, &mut seeds, stats).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(seeds)
}

/// The baseline: the session's flat plan for a GQA group's queries `qs` (one pass over the
/// keys below `prefix` for all of them, `flat::scan_many`), then each q head's exact DIPR set
/// from its scores and its window maximum (β chosen to meet its mass target, if it has one).
fn flat_group(scan: &GroupScan, beta: f32, win_max: &[f32], targets: &[Option<MassTarget>]) -> Vec<SearchResult> {
    win_max
        .iter()
        .enumerate()
        .map(|(i, &best)| flat::dipr_or_target(scan.scores(i), beta, best, targets[i].as_ref(), scan.stats))
        .collect()
}

/// The spread of the seed values (every [`SEED_STRIDE`]-th token's, `seeds` of them): the
/// mean of `‖v − v̄‖²`, as [`ctxfs_index::paged::PagedIndex::seed_value_spread`] makes it.
fn seed_value_spread(values: &[f16], d: usize, seeds: usize) -> f64 {
    let mut spread = ValueSpread::new(d);
    let mut row = Vec::with_capacity(d);
    for t in (0..seeds).map(|j| j * SEED_STRIDE as usize) {
        row.clear();
        row.extend(values[t * d..(t + 1) * d].iter().map(|v| v.to_f32()));
        spread.add(&row);
    }
    spread.spread()
}

/// A target row's error estimate ([`ctxfs_index::target::estimate`]): attention over the
/// window (scores `win_z`) and the retrieved tokens against the tail estimate, the seeds
/// (every [`SEED_STRIDE`]-th token; `seeds` their scores) neither holds, and with every
/// key's score (`exact`: a scan's, or the codes') the mass the two leave out; `seed_spread`
/// is the head's seed values' spread ([`TailVariance`]).
fn estimate_of(
    f: &SearchResult,
    (seeds, exact): (&[f32], Option<&[f32]>),
    window: &Window,
    win_z: &[f32],
    (values, seed_spread): (&[f16], f64),
    d: usize,
    scale: f32,
) -> (Partial, Estimate) {
    let mut kept = vec![false; values.len() / d];
    for &t in &window.ids {
        kept[t as usize] = true;
    }
    let (mut ids, mut z) = (window.ids.clone(), win_z.to_vec());
    for (&t, &s) in f.ids.iter().zip(&f.scores) {
        if !std::mem::replace(&mut kept[t as usize], true) {
            ids.push(t);
            z.push(s);
        }
    }
    let (seed_ids, seed_z): (Vec<u32>, Vec<f32>) =
        seeds.iter().enumerate().map(|(j, &s)| (j as u32 * SEED_STRIDE, s)).filter(|&(t, _)| !kept[t as usize]).unzip();
    let tail = {
        let rows: Vec<f16> =
            seed_ids.iter().flat_map(|&t| values[t as usize * d..(t as usize + 1) * d].iter().copied()).collect();
        let log_stride = (SEED_STRIDE as f32).ln();
        let mut zs: Vec<f32> = seed_z.iter().map(|s| s * scale + log_stride).collect();
        Partial::from_scores_on(ctxfs_kernels::active(), &mut zs, &rows, d)
    };
    let left_out = exact.map(|scores| left_out_lse(scores, scale, |t| !kept[t]));
    // The variance of the tail's output, as sessions make it: the seed values' spread over
    // the left-out seeds' effective number.
    let weights: Vec<f32> = {
        let top = seed_z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        seed_z.iter().map(|&s| (scale * (s - top)).exp()).collect()
    };
    let e = estimate(&attend(&ids, &z, values, d, scale), &tail, left_out, TailVariance::of(&weights, seed_spread));
    (tail, e)
}

/// The seeds' scores (every [`SEED_STRIDE`]-th) among every key's.
fn seeds_of(scores: &[f32]) -> Vec<f32> {
    scores.iter().step_by(SEED_STRIDE as usize).copied().collect()
}

/// The windows of every length the rows answer over, made before the timers start.
struct WindowSet(Vec<(usize, Window)>);

impl WindowSet {
    fn of(ix: &HeadIndexes) -> WindowSet {
        let n = ix.keys.len() as usize;
        let lengths = std::iter::once(n).chain(PREFIX_SHARES.map(|p| prefix_len(n, p)));
        WindowSet(lengths.map(|len| (len, Window::of(&ix.keys, len))).collect())
    }
    fn get(&self, len: usize) -> &Window {
        &self.0.iter().find(|(l, _)| *l == len).expect("a window for every length the rows use").1
    }
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn p99(v: &[f64]) -> f64 {
    quantile(v.to_vec(), 0.99)
}

/// The `q` quantile (nearest rank) of `v`, 0 when empty.
fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(((v.len() as f64 * q).ceil() as usize).saturating_sub(1)).copied().unwrap_or(0.0)
}

/// Attention over `ids` (scores `z` in inner-product units), as a partial.
fn attend(ids: &[u32], z: &[f32], values: &[f16], d: usize, scale: f32) -> Partial {
    let rows: Vec<f16> =
        ids.iter().flat_map(|&t| values[t as usize * d..(t as usize + 1) * d].iter().copied()).collect();
    let mut zs: Vec<f32> = z.iter().map(|x| x * scale).collect();
    Partial::from_scores_on(ctxfs_kernels::active(), &mut zs, &rows, d)
}

/// Tokens retrieved beyond the window over the oracle's, summed over the queries
/// (`retrieved, oracle` per query): the tokens a target costs against the fewest that meet it.
fn vs_oracle_total(pairs: &[(f64, f64)]) -> f64 {
    let (retrieved, oracle) = pairs.iter().fold((0.0, 0.0), |(r, o), p| (r + p.0, o + p.1));
    retrieved / oracle.max(1.0)
}

/// Per query, tokens retrieved over the oracle's. A query that the window alone serves
/// within the target has an oracle of 0, counted as 1: its ratio is the count retrieved.
fn per_query_vs_oracle(pairs: &[(f64, f64)]) -> Vec<f64> {
    pairs.iter().map(|&(r, o)| r / o.max(1.0)).collect()
}

/// The oracle of an output error target: the fewest of the best-scoring tokens outside the
/// window (scores `all`, in inner-product units) that, attended with the window, give an
/// output within `target` of `exact` (relative, as [`err`] measures); all of them when none
/// fewer do.
fn oracle_tokens(
    all: &[f32],
    values: &[f16],
    d: usize,
    scale: f32,
    window: &Window,
    exact: &[f32],
    target: f32,
) -> usize {
    let in_window: BTreeSet<u32> = window.ids.iter().copied().collect();
    let mut order: Vec<u32> = (0..all.len() as u32).filter(|t| !in_window.contains(t)).collect();
    order.sort_unstable_by(|&a, &b| all[b as usize].total_cmp(&all[a as usize]).then(a.cmp(&b)));
    let best = all.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let norm = exact.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>().sqrt().max(1e-30);
    let (mut z, mut acc) = (0.0f64, vec![0.0f64; d]);
    let add = |t: u32, z: &mut f64, acc: &mut [f64]| {
        let w = (f64::from(scale) * f64::from(all[t as usize] - best)).exp();
        *z += w;
        for (a, v) in acc.iter_mut().zip(&values[t as usize * d..(t as usize + 1) * d]) {
            *a += w * f64::from(v.to_f32());
        }
    };
    for &t in &window.ids {
        add(t, &mut z, &mut acc);
    }
    let meets = |acc: &[f64], z: f64| {
        let e2: f64 = acc.iter().zip(exact).map(|(a, &x)| (a / z - f64::from(x)).powi(2)).sum();
        e2.sqrt() / norm <= f64::from(target)
    };
    for (n, &t) in order.iter().enumerate() {
        if z > 0.0 && meets(&acc, z) {
            return n;
        }
        add(t, &mut z, &mut acc);
    }
    order.len()
}

fn err(o: &[f32], exact: &[f32]) -> f64 {
    let num: f64 = o.iter().zip(exact).map(|(a, b)| (*a as f64 - *b as f64).powi(2)).sum::<f64>().sqrt();
    num / exact.iter().map(|b| (*b as f64).powi(2)).sum::<f64>().sqrt().max(1e-30)
}

/// A q head's exact answers over one prefix length: attention, and the exact DIPR set's.
struct Reference {
    exact: Partial,
    dipr: BTreeSet<u32>,
    exact_dipr: Partial,
}

/// Quality of one q head's selection against exact attention over the first `p_len` tokens.
#[allow(clippy::too_many_arguments)]
fn reference(all: &[f32], values: &[f16], d: usize, scale: f32, p_len: usize, window: &Window, beta: f32) -> Reference {
    let pz = &all[..p_len];
    let p_ids: Vec<u32> = (0..p_len as u32).collect();
    let exact = attend(&p_ids, pz, values, d, scale);
    let win_max = window.ids.iter().map(|&t| all[t as usize]).fold(f32::NEG_INFINITY, f32::max);
    let best = pz.iter().copied().fold(win_max, f32::max);
    let dipr: BTreeSet<u32> = p_ids.iter().copied().filter(|&t| pz[t as usize] >= best - beta).collect();
    let dipr_sel: Vec<u32> =
        window.ids.iter().copied().chain(dipr.iter().copied().filter(|t| !window.ids.contains(t))).collect();
    let dz: Vec<f32> = dipr_sel.iter().map(|&t| all[t as usize]).collect();
    Reference { exact, dipr, exact_dipr: attend(&dipr_sel, &dz, values, d, scale) }
}

pub fn run(a: Args) -> Result<()> {
    let mut sources = Vec::new();
    if !a.no_generator {
        let least = 5 * (WINDOW.0 + WINDOW.1) + 1;
        ensure!(
            a.tokens >= least,
            "--tokens must be at least {least}: more than five 640-token windows (the 20% prefix holds one)"
        );
        ensure!(!a.seeds.is_empty(), "--seeds must name at least one seed");
        ensure!(a.head_dim >= 2, "--head-dim must be at least 2: the generator pairs dimensions");
        sources.push(Source::Generator {
            seeds: a.seeds.clone(),
            heads: a.heads,
            tokens: a.tokens,
            head_dim: a.head_dim,
        });
    }
    for path in &a.data {
        let src = Source::open(path)?;
        ensure!(
            src.tokens() > 5 * (WINDOW.0 + WINDOW.1),
            "{}: {} tokens; a dataset must exceed five 640-token windows (the 20% prefix holds one)",
            path.display(),
            src.tokens()
        );
        sources.push(src);
    }
    let total: usize = sources.iter().map(|s| s.heads() * s.tokens()).sum();
    let bar = crate::progress::bar(total as u64, "bench search");
    let mut reports = Vec::new();
    for src in &sources {
        reports.push(run_dataset(&a, src, &bar)?);
    }
    bar.finish_and_clear();
    if a.json {
        outln!("{}", json!({"window": [WINDOW.0, WINDOW.1], "datasets": reports}))?;
        return Ok(());
    }
    for r in &reports {
        print_dataset(r)?;
    }
    print_side_by_side(&reports)?;
    Ok(())
}

/// Every method on every head of one dataset; its report as JSON.
fn run_dataset(a: &Args, src: &Source, bar: &indicatif::ProgressBar) -> Result<serde_json::Value> {
    let (n, d, group) = (src.tokens(), src.head_dim(), src.group());
    let scale = 1.0 / (d as f32).sqrt();
    let sqrt_d = (d as f32).sqrt();
    let names = RowNames::at(a.beta);
    let reference_beta = a.beta * sqrt_d;
    let all_methods = methods(n, sqrt_d, a.target_error, &names);
    let mut rows: Vec<Row> = all_methods
        .iter()
        .map(|(name, m)| Row {
            name: name.clone(),
            budget: match *m {
                Method::Topk(k) => Some(k),
                Method::Coarse { budget, .. } => Some(budget),
                _ => None,
            },
            target: m.target(),
            ..Default::default()
        })
        .collect();
    let mut builds = Vec::new();
    let mut heads_json = Vec::new();
    let mut flush = vec![0u64; CACHE_FLUSH_BYTES / 8];
    let warm_up = {
        let p = SynthParams { tokens: WARM_UP_TOKENS, head_dim: d, group, seed: TUNING_SEED.wrapping_add(1000) };
        let h = head(&p, 1, 0, WARM_UP_TOKENS / 4 / group, 1);
        let ix = HeadIndexes::build(MemKeys::new(d, h.keys), h.values, &h.prefill.concat())?.0;
        let qs: Vec<f32> = h.decode.iter().flat_map(|q| q[..d].iter().copied()).collect();
        let windows = WindowSet::of(&ix);
        (ix, qs, windows)
    };
    let warm_up_methods = methods(WARM_UP_TOKENS, sqrt_d, a.target_error, &names);
    // Nanoseconds per row of each probe.
    let mut probe_row_ns = Vec::new();
    {
        for head_no in 0..src.heads() {
            let BenchHead { label, sharpness, data: h } = src.head(head_no, a.queries)?;
            let steps = h.decode[0].len() / d;
            let (ix, timing) = HeadIndexes::build(MemKeys::new(d, h.keys), h.values, &h.prefill.concat())?;
            let mut build = label.clone();
            build["sharpness"] = json!(sharpness);
            build.as_object_mut().expect("an object").extend(timing.as_object().expect("an object").clone());
            builds.push(build);
            let windows = WindowSet::of(&ix);
            let rows_per_block = ctxfs_vfs::max_payload(BLOCK) / (2 * d);
            let mut last_step = vec![Vec::new(); group];
            let mut rng = Rng::new(head_no as u64);
            let probe: Vec<u32> = (0..PROBE_ROWS).map(|_| rng.below(n) as u32).collect();
            let mut probe_scores = vec![0.0f32; PROBE_ROWS];
            for r in rows.iter_mut() {
                r.head_micros.push(0.0);
            }
            // The tokens of the head's DIPR ranges at the reference β outside the window (those
            // a search must find), summed over its steps' q heads.
            let mut range_tokens = 0usize;
            let full_window: BTreeSet<u32> = windows.get(n).ids.iter().copied().collect();
            for step in 0..steps {
                let qs: Vec<f32> = h.decode.iter().flat_map(|q| q[step * d..(step + 1) * d].iter().copied()).collect();
                // Every key's score for each q head, for the references.
                let all: Vec<Vec<f32>> = qs
                    .chunks_exact(d)
                    .map(|q| {
                        let mut z = vec![0.0f32; n];
                        ctxfs_kernels::scores(ix.keys.data(), q, 1.0, &mut z);
                        z
                    })
                    .collect();
                let lengths = std::iter::once(n).chain(PREFIX_SHARES.map(|p| prefix_len(n, p)));
                let references: Vec<(usize, Vec<Reference>)> = lengths
                    .map(|len| {
                        let w = windows.get(len);
                        (len, all.iter().map(|z| reference(z, &ix.values, d, scale, len, w, reference_beta)).collect())
                    })
                    .collect();
                range_tokens += references[0].1.iter().map(|r| r.dipr.difference(&full_window).count()).sum::<usize>();
                // Each q head's oracle for the target rows, made when first asked for.
                let mut oracles: Vec<Option<usize>> = vec![None; group];
                evict_caches(&mut flush);
                let t = Instant::now();
                ix.keys.score(&probe, &qs[..d], &mut probe_scores, &mut SearchStats::default())?;
                probe_row_ns.push(t.elapsed().as_secs_f64() * 1e9 / PROBE_ROWS as f64);
                for (mi, (name, method)) in all_methods.iter().enumerate() {
                    evict_caches(&mut flush);
                    if *name != names.all_cold {
                        let (wix, wqs, wwin) = (&warm_up.0, &warm_up.1, &warm_up.2);
                        let mut scratch = vec![Vec::new(); GROUP];
                        std::hint::black_box(run_group(warm_up_methods[mi].1, wix, wqs, wwin, &mut scratch)?);
                    }
                    let t = Instant::now();
                    let sels = run_group(*method, &ix, &qs, &windows, &mut last_step)?;
                    let micros = t.elapsed().as_secs_f64() * 1e6;
                    let p_len = method.tokens(n);
                    let beta = method.beta(reference_beta);
                    let window = windows.get(p_len);
                    let win_set: BTreeSet<u32> = window.ids.iter().copied().collect();
                    let refs = &references.iter().find(|(l, _)| *l == p_len).expect("a reference per length").1;
                    let r = &mut rows[mi];
                    r.micros.push(micros);
                    r.head_micros[head_no] += micros;
                    for (qi, sel) in sels.into_iter().enumerate() {
                        let Selection { ids, keys_scored, meta_bytes, per_token, target, scan_micros } = sel;
                        r.scan_micros.extend(scan_micros);
                        let mut retrieved: Vec<u32> = ids.iter().copied().filter(|t| !win_set.contains(t)).collect();
                        if let Method::Topk(k) = *method {
                            retrieved.truncate(k);
                        }
                        let mut blocks: Vec<usize> = retrieved.iter().map(|&t| t as usize / rows_per_block).collect();
                        blocks.sort_unstable();
                        blocks.dedup();
                        // Coarse and code rows read key blocks for exact scores as well.
                        let per_block = if method.scores_candidates() { 2 } else { 1 };
                        let selected: Vec<u32> = window.ids.iter().copied().chain(retrieved.iter().copied()).collect();
                        let z: Vec<f32> = selected.iter().map(|&t| all[qi][t as usize]).collect();
                        let mut part = attend(&selected, &z, &ix.values, d, scale);
                        if let Some((tail, _)) = &target {
                            part = Partial::merge(&[part, tail.clone()]);
                        }
                        // The reference's DIPR set is at β = 5√d; the other β rows are
                        // measured against their own β's set.
                        let rf = &refs[qi];
                        let dipr_own;
                        let dipr = if beta == reference_beta {
                            &rf.dipr
                        } else {
                            dipr_own = reference(&all[qi], &ix.values, d, scale, p_len, window, beta).dipr;
                            &dipr_own
                        };
                        let got: BTreeSet<u32> = selected.iter().copied().collect();
                        r.recall
                            .push(dipr.iter().filter(|t| got.contains(t)).count() as f64 / dipr.len().max(1) as f64);
                        r.recovery.push((part.lse() as f64 - rf.exact.lse() as f64).exp());
                        let error = err(&part.o, &rf.exact.o);
                        r.error.push(error);
                        if let Some(e) = method.target() {
                            let oracle = *oracles[qi].get_or_insert_with(|| {
                                oracle_tokens(&all[qi], &ix.values, d, scale, window, &rf.exact.o, e)
                            });
                            r.target_met.push(f64::from(u8::from(error <= f64::from(e))));
                            r.vs_oracle.push((retrieved.len() as f64, oracle as f64));
                            r.estimate.push(target.as_ref().map_or(f64::NAN, |t| t.1.error));
                        }
                        r.exact_dipr_error.push(err(&rf.exact_dipr.o, &rf.exact.o));
                        r.scored.push(keys_scored as f64 / p_len as f64);
                        r.selected.push(selected.len() as f64);
                        r.meta_bytes.push(meta_bytes as f64);
                        r.data_bytes.push((blocks.len() * per_block * BLOCK) as f64);
                        r.meta_per_token.push(per_token);
                    }
                }
            }
            let sum_of = |name: &str| rows.iter().find(|r| r.name == name).map_or(0.0, |r| r.head_micros[head_no]);
            let mut one = label;
            one["sharpness"] = json!(sharpness);
            one["flat_us"] = json!(sum_of(FLAT_ROW));
            one["dipr_range_share"] = json!(range_tokens as f64 / (steps * group * n).max(1) as f64);
            for (key, row) in [("diprs", &names.diprs), ("graph_diprs", &names.graph)] {
                one[format!("{key}_us")] = json!(sum_of(row));
                one[format!("{key}_vs_flat_speedup")] = json!(ratio(sum_of(FLAT_ROW), sum_of(row)));
            }
            heads_json.push(one);
            bar.inc(n as u64);
        }
    }
    let about = match src {
        Source::Generator { seeds, heads, .. } => {
            format!("ctxfs_index::synth, seeds {seeds:?} (defaults tuned on {TUNING_SEED}) × {heads} kv heads")
        }
        Source::File { about, path, .. } => format!("{} ({about})", path.display()),
    };
    Ok(report(src.name(), about, n, d, group, &names, &rows, builds, heads_json, median(probe_row_ns)))
}

#[allow(clippy::too_many_arguments)]
fn report(
    name: String,
    about: String,
    n: usize,
    d: usize,
    group: usize,
    names: &RowNames,
    rows: &[Row],
    builds: Vec<serde_json::Value>,
    heads: Vec<serde_json::Value>,
    scattered_row_ns: f64,
) -> serde_json::Value {
    let total = |name: &str| rows.iter().find(|r| r.name == name).map_or(0.0, |r| r.micros.iter().sum::<f64>());
    let flat_total = total(FLAT_ROW);
    let out_rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            json!({
                "method": r.name, "dipr_recall": mean(&r.recall), "recovery": mean(&r.recovery), "output_error": mean(&r.error),
                "exact_dipr_output_error": mean(&r.exact_dipr_error), "keys_scored_fraction": mean(&r.scored),
                "latency_median_us": median(r.micros.clone()), "latency_p99_us": p99(&r.micros),
                "scan_median_us": (!r.scan_micros.is_empty()).then(|| median(r.scan_micros.clone())),
                "total_us": r.micros.iter().sum::<f64>(),
                "speedup_vs_flat": ratio(flat_total, r.micros.iter().sum::<f64>()),
                "budget_tokens": r.budget, "selected_tokens": mean(&r.selected),
                "meta_bytes_per_query": mean(&r.meta_bytes), "data_bytes_per_query": mean(&r.data_bytes),
                "bytes_per_query": mean(&r.meta_bytes) + mean(&r.data_bytes),
                "metadata_bytes_per_token": mean(&r.meta_per_token),
                "target_error": r.target.map(|t| t.to_string().parse::<f64>().unwrap_or(f64::from(t))),
                "target_met": r.target.map(|_| mean(&r.target_met)),
                "tokens_vs_oracle": r.target.map(|_| vs_oracle_total(&r.vs_oracle)),
                "tokens_vs_oracle_median": r.target.map(|_| median(per_query_vs_oracle(&r.vs_oracle))),
                "tokens_vs_oracle_mean": r.target.map(|_| mean(&per_query_vs_oracle(&r.vs_oracle))),
                "estimated_error": r.target.map(|_| mean(&r.estimate)),
                "error_over_estimate_p95": r.target.map(|_| quantile(
                    r.error.iter().zip(&r.estimate).map(|(e, m)| e / m.max(1e-9)).collect(), 0.95
                )),
                "error_over_estimate_median": r.target.map(|_| median(
                    r.error.iter().zip(&r.estimate).map(|(e, m)| e / m.max(1e-9)).collect()
                )),
            })
        })
        .collect();
    // A flat row's cost: the flat plan's time per key row per q head.
    let steps = rows[0].micros.len().max(1) as f64;
    let flat_row_ns = flat_total * 1e3 / steps / (n * group) as f64;
    let mut ratios = serde_json::Map::new();
    ratios.insert("diprs_vs_flat_speedup".into(), json!(ratio(flat_total, total(&names.diprs))));
    // What DIPRS on the codes would reach if its candidates cost nothing: the flat plan's time
    // over the seeds' and the scan's alone.
    let scans = rows.iter().find(|r| r.name == names.diprs).map_or(0.0, |r| r.scan_micros.iter().sum::<f64>());
    ratios.insert("diprs_scan_bound_speedup".into(), json!(ratio(flat_total, scans)));
    // What any search that scores each key of a q head's range at the flat plan's cost per
    // key would reach, were that all it did: each head's flat time times its range's share.
    let range_cost: f64 = heads
        .iter()
        .map(|h| h["flat_us"].as_f64().unwrap_or(0.0) * h["dipr_range_share"].as_f64().unwrap_or(0.0))
        .sum();
    ratios.insert("dipr_range_bound_speedup".into(), json!(ratio(flat_total, range_cost)));
    ratios.insert("graph_diprs_vs_flat_speedup".into(), json!(ratio(flat_total, total(&names.graph))));
    ratios.insert("graph_diprs_warm_vs_flat_speedup".into(), json!(ratio(flat_total, total(&names.warm))));
    ratios.insert("graph_diprs_all_cold_vs_flat_speedup".into(), json!(ratio(flat_total, total(&names.all_cold))));
    for percent in PREFIX_SHARES {
        let filtered = total(&filtered_row(percent));
        ratios.insert(
            format!("filtered{percent}_vs_prefix_graph_latency"),
            json!(ratio(filtered, total(&prefix_graph_row(percent)))),
        );
        ratios.insert(
            format!("filtered{percent}_vs_flat_prefix_speedup"),
            json!(ratio(total(&flat_prefix_row(percent)), filtered)),
        );
        ratios.insert(
            format!("codes_filtered{percent}_vs_flat_prefix_speedup"),
            json!(ratio(total(&flat_prefix_row(percent)), total(&codes_filtered_row(percent)))),
        );
    }
    ratios.insert("scattered_vs_flat_row_cost".into(), json!(ratio(scattered_row_ns, flat_row_ns)));
    let ratios = serde_json::Value::Object(ratios);
    let row_costs = json!({"flat_row_ns": flat_row_ns, "scattered_row_ns": scattered_row_ns, "probe_rows": PROBE_ROWS});
    json!({"dataset": name, "about": about, "tokens": n, "head_dim": d, "group": group,
           "heads": heads.len(), "steps_per_head": steps as usize / heads.len().max(1),
           "reference_beta_sqrt_d": names.units.to_string().parse::<f64>().unwrap_or(f64::from(names.units)), "ratios": ratios, "row_costs": row_costs, "rows": out_rows, "per_head": heads, "build": builds})
}

/// One dataset's report as text: every row, each head, each build, the ratios.
fn print_dataset(v: &serde_json::Value) -> Result<(), crate::OutputLost> {
    let (n, d) = (&v["tokens"], &v["head_dim"]);
    outln!(
        "bench search on {}: {}; {n} tokens per head, d={d}, {} heads × {} steps of a {}-q-head group, window 128+512; β in q·k/√d units; times per group step",
        v["dataset"].as_str().unwrap_or(""),
        v["about"].as_str().unwrap_or(""),
        v["heads"],
        v["steps_per_head"],
        v["group"]
    )?;
    outln!(
        "{:<32} {:>7} {:>9} {:>9} {:>10} {:>9} {:>7} {:>8} {:>8} {:>7} {:>10} {:>10} {:>8}",
        "method",
        "recall",
        "recovery",
        "out err",
        "DIPR err",
        "scored",
        "sel",
        "meta KiB",
        "data KiB",
        "B/tok",
        "median µs",
        "p99 µs",
        "vs flat"
    )?;
    let empty = Vec::new();
    for r in v["rows"].as_array().unwrap_or(&empty) {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        outln!(
            "{:<32} {:>7.3} {:>9.3} {:>9.4} {:>10.4} {:>8.2}% {:>7.0} {:>8.1} {:>8.1} {:>7.1} {:>10.0} {:>10.0} {:>7.1}×",
            r["method"].as_str().unwrap_or(""),
            f("dipr_recall"),
            f("recovery"),
            f("output_error"),
            f("exact_dipr_output_error"),
            f("keys_scored_fraction") * 100.0,
            f("selected_tokens"),
            f("meta_bytes_per_query") / 1024.0,
            f("data_bytes_per_query") / 1024.0,
            f("metadata_bytes_per_token"),
            f("latency_median_us"),
            f("latency_p99_us"),
            f("speedup_vs_flat")
        )?;
    }
    for r in v["rows"].as_array().unwrap_or(&empty).iter().filter(|r| !r["target_error"].is_null()) {
        let f = |k: &str| r[k].as_f64().unwrap_or(0.0);
        outln!(
            "{}: output error ≤ {} on {:.1}% of queries (mean {:.4}); {:.2}× the oracle's tokens (per query: median {:.2}×, mean {:.2}×); estimated error without the tail estimate {:.4}, error ÷ estimate median {:.2}",
            r["method"].as_str().unwrap_or(""),
            f("target_error"),
            f("target_met") * 100.0,
            f("output_error"),
            f("tokens_vs_oracle"),
            f("tokens_vs_oracle_median"),
            f("tokens_vs_oracle_mean"),
            f("estimated_error"),
            f("error_over_estimate_median")
        )?;
    }
    for h in v["per_head"].as_array().unwrap_or(&empty) {
        outln!(
            "{}: flat {:.0} µs, DIPRS {:.0} µs over its steps: {:.1}×; graph DIPRS {:.0} µs: {:.1}×; the DIPR range outside the window {:.2}% of the tokens",
            head_label(h),
            h["flat_us"].as_f64().unwrap_or(0.0),
            h["diprs_us"].as_f64().unwrap_or(0.0),
            h["diprs_vs_flat_speedup"].as_f64().unwrap_or(0.0),
            h["graph_diprs_us"].as_f64().unwrap_or(0.0),
            h["graph_diprs_vs_flat_speedup"].as_f64().unwrap_or(0.0),
            100.0 * h["dipr_range_share"].as_f64().unwrap_or(0.0)
        )?;
    }
    for b in v["build"].as_array().unwrap_or(&empty) {
        outln!(
            "build {}: {:.1} s (kNN {:.1} s, projection {:.2} s, enhancement {:.2} s), {} training queries",
            head_label(b),
            b["seconds"].as_f64().unwrap_or(0.0),
            b["knn_seconds"].as_f64().unwrap_or(0.0),
            b["projection_seconds"].as_f64().unwrap_or(0.0),
            b["enhancement_seconds"].as_f64().unwrap_or(0.0),
            b["training_queries"]
        )?;
        let c = &b["coarse_seconds"];
        outln!(
            "  coarse builds: {}",
            COARSE
                .iter()
                .chain([&SCAN_CODES])
                .map(|name| format!("{name} {:.2} s", c[name].as_f64().unwrap_or(0.0)))
                .collect::<Vec<_>>()
                .join(", ")
        )?;
    }
    let r = |k: &str| v["ratios"][k].as_f64().unwrap_or(0.0);
    let (flat_row_ns, scattered_row_ns) = (
        v["row_costs"]["flat_row_ns"].as_f64().unwrap_or(0.0),
        v["row_costs"]["scattered_row_ns"].as_f64().unwrap_or(0.0),
    );
    outln!(
        "DIPRS (β={}·√d) vs the GQA-batched flat plan, sums over every group step: {:.1}× faster; graph DIPRS {:.1}× (from the last step's best tokens: {:.1}×; with its code cold too: {:.1}×)",
        RowNames::of(v).units,
        r("diprs_vs_flat_speedup"),
        r("graph_diprs_vs_flat_speedup"),
        r("graph_diprs_warm_vs_flat_speedup"),
        r("graph_diprs_all_cold_vs_flat_speedup")
    )?;
    let diprs = RowNames::of(v).diprs;
    if let Some(row) = v["rows"].as_array().and_then(|rows| rows.iter().find(|r| r["method"] == diprs.as_str())) {
        let (step, scan) = (row["latency_median_us"].as_f64().unwrap_or(0.0), row["scan_median_us"].as_f64());
        if let Some(scan) = scan {
            outln!(
                "DIPRS's median group step {step:.0} µs: the seeds and the scan of the codes {scan:.0} µs (median), the rest the exact scores of the candidates; the flat plan's sum is {:.1}× the seeds' and the scan's, the most DIPRS on the codes could reach",
                r("diprs_scan_bound_speedup")
            )?;
        }
    }
    outln!(
        "the flat plan's sum is {:.1}× its cost of the DIPR ranges' keys alone (each head's flat time × its range's share of the tokens): the most any search that scores every key of the range could reach",
        r("dipr_range_bound_speedup")
    )?;
    for percent in PREFIX_SHARES {
        outln!(
            "filtered at {percent}% reuse: {:.2}× the latency of a graph built on the prefix alone, {:.1}× faster than a flat scan of the prefix; DIPRS on the codes {:.1}×",
            r(&format!("filtered{percent}_vs_prefix_graph_latency")),
            r(&format!("filtered{percent}_vs_flat_prefix_speedup")),
            r(&format!("codes_filtered{percent}_vs_flat_prefix_speedup"))
        )?;
    }
    outln!(
        "a key row from cold caches: {flat_row_ns:.1} ns per q head in the flat plan, {scattered_row_ns:.0} ns read alone ({PROBE_ROWS} uniformly random rows): {:.1}× a flat row",
        r("scattered_vs_flat_row_cost")
    )?;
    outln!()
}

/// A head's name in text output: its seed or layer, and kv head.
fn head_label(h: &serde_json::Value) -> String {
    let sharp = h["sharpness"].as_f64().map(|s| format!(", sharpness {s:.1}")).unwrap_or_default();
    match h.get("seed") {
        Some(seed) => format!(
            "seed {seed} kv head {}{sharp}{}",
            h["kv_head"],
            if h["tuning_seed"] == true { ", tuning seed" } else { "" }
        ),
        None => format!("layer {} kv head {}", h["layer"].as_str().unwrap_or(""), h["kv_head"]),
    }
}

/// The row of a dataset's report named `method`.
fn row_of<'a>(report: &'a serde_json::Value, method: &str) -> Option<&'a serde_json::Value> {
    report["rows"].as_array().and_then(|rows| rows.iter().find(|r| r["method"] == method))
}

/// The headline figures of every dataset side by side: the DIPR range at the reference β, on
/// the codes (DIPRS) and by the graph's walk, then the rows that choose β to meet the error
/// target.
fn print_side_by_side(reports: &[serde_json::Value]) -> Result<(), crate::OutputLost> {
    outln!(
        "{:<28} {:<22} {:>7} {:>9} {:>9} {:>9} {:>9} {:>8} {:>9}",
        "dataset",
        "row",
        "tokens",
        "recall",
        "scored",
        "out err",
        "DIPR err",
        "÷ DIPR",
        "vs flat"
    )?;
    for v in reports {
        let names = RowNames::of(v);
        for name in [&names.diprs, &names.graph] {
            let Some(row) = row_of(v, name) else { continue };
            let f = |k: &str| row[k].as_f64().unwrap_or(0.0);
            outln!(
                "{:<28} {:<22} {:>7} {:>9.3} {:>8.2}% {:>9.4} {:>9.4} {:>7.2}× {:>8.1}×",
                v["dataset"].as_str().unwrap_or(""),
                name,
                v["tokens"],
                f("dipr_recall"),
                f("keys_scored_fraction") * 100.0,
                f("output_error"),
                f("exact_dipr_output_error"),
                ratio(f("output_error"), f("exact_dipr_output_error")),
                f("speedup_vs_flat")
            )?;
        }
    }
    outln!()?;
    outln!(
        "{:<28} {:<22} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "dataset",
        "row",
        "target",
        "met",
        "÷ oracle",
        "selected",
        "scored",
        "estimate",
        "err÷est"
    )?;
    for v in reports {
        for name in TARGET_ROWS {
            let Some(row) = row_of(v, name) else { continue };
            let f = |k: &str| row[k].as_f64().unwrap_or(0.0);
            outln!(
                "{:<28} {:<22} {:>7} {:>8.1}% {:>8.2}× {:>9.0} {:>8.2}% {:>9.4} {:>9.2}",
                v["dataset"].as_str().unwrap_or(""),
                name,
                f("target_error"),
                f("target_met") * 100.0,
                f("tokens_vs_oracle"),
                f("selected_tokens"),
                f("keys_scored_fraction") * 100.0,
                f("estimated_error"),
                f("error_over_estimate_median")
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    /// Keys that count the scans made over them.
    struct Counted<'a> {
        keys: &'a MemKeys,
        /// (scans for several queries at once, scans for one query, scattered scorings).
        calls: Cell<(usize, usize, usize)>,
    }

    impl Keys for Counted<'_> {
        fn dim(&self) -> usize {
            self.keys.dim()
        }
        fn len(&self) -> u32 {
            self.keys.len()
        }
        fn score(&self, ids: &[u32], q: &[f32], out: &mut [f32], stats: &mut SearchStats) -> ctxfs_index::SourceResult {
            let (m, r, s) = self.calls.get();
            self.calls.set((m, r, s + 1));
            self.keys.score(ids, q, out, stats)
        }
        fn score_range(
            &self,
            first: u32,
            q: &[f32],
            out: &mut [f32],
            stats: &mut SearchStats,
        ) -> ctxfs_index::SourceResult {
            let (m, r, s) = self.calls.get();
            self.calls.set((m, r + 1, s));
            self.keys.score_range(first, q, out, stats)
        }
        fn score_range_many(
            &self,
            first: u32,
            queries: &[f32],
            out: &mut [f32],
            stride: usize,
            len: usize,
            stats: &mut SearchStats,
        ) -> ctxfs_index::SourceResult {
            let (m, r, s) = self.calls.get();
            self.calls.set((m + 1, r, s));
            self.keys.score_range_many(first, queries, out, stride, len, stats)
        }
    }

    /// The flat baseline is the strongest flat scan the project has: one batched pass over
    /// the keys for the whole GQA group, as the session's flat plan makes, with the exact
    /// per-query DIPR sets as its answers.
    #[test]
    fn the_flat_baseline_scans_once_per_group_and_answers_exactly() {
        let d = 64;
        let p = SynthParams { tokens: 3000, head_dim: d, group: GROUP, seed: 9 };
        let h = head(&p, 1, 0, 64, 1);
        let keys = MemKeys::new(d, h.keys);
        let qs: Vec<f32> = h.decode.iter().flat_map(|q| q[..d].iter().copied()).collect();
        let counted = Counted { keys: &keys, calls: Cell::new((0, 0, 0)) };
        let beta = 5.0 * (d as f32).sqrt();
        let win_max = [f32::NEG_INFINITY; GROUP];
        let scan = flat::scan_many(&counted, &qs, 2000).unwrap();
        let got = flat_group(&scan, beta, &win_max, &[None; 4]);
        assert_eq!(counted.calls.get(), (1, 0, 0), "one batched scan for {GROUP} q heads, nothing else");
        for (i, q) in qs.chunks_exact(d).enumerate() {
            let alone = flat::dipr(&keys, q, beta, f32::NEG_INFINITY, Some(2000)).unwrap();
            assert_eq!(got[i].ids, alone.ids, "q head {i}");
        }
    }
}
