//! `ctxfs query`: attention for each (layer, q head, query) of a query file over a stored
//! context, through a session (`Db::open_session`), one JSON object per line.
//!
//! Every plan attends the window (the first `INIT` and last `RECENT` tokens of the reused
//! prefix) exactly, plus the tokens it retrieves; the DIPR plans take the window's best score
//! as their starting maximum. `--mode auto` is the optimizer's choice; its DIPR plans also
//! estimate the softmax over what they left out from the index's seed sample (`--tail`), and
//! the seeds that estimate used are in `selected` (their values entered the output).

use anyhow::{anyhow, bail, ensure, Context, Result};
use ctxfs_attention::queries::QueryFile;
use ctxfs_attention::{AttentionOptions, Db, DbConfig, Plan, Window};
use ctxfs_vfs::DeviceChoice;
use serde_json::json;
use std::path::PathBuf;

/// `auto` (the optimizer's choice) or a plan forced by name.
#[derive(Debug, Clone, Copy)]
struct Mode(Option<Plan>);

fn parse_mode(s: &str) -> Result<Mode, String> {
    if s == "auto" {
        Ok(Mode(None))
    } else {
        s.parse()
            .map(|p| Mode(Some(p)))
            .map_err(|_: String| format!("unknown mode {s:?} (expected auto, {})", Plan::NAMES))
    }
}

#[derive(clap::Args)]
pub struct Args {
    store: PathBuf,
    /// The stored context to answer from.
    #[arg(long)]
    context: String,
    /// A safetensors file of `layers.{l}.q` (with `--decode`, `layers.{l}.decode_q`), shape
    /// [q_heads, n, head_dim].
    #[arg(long)]
    queries: PathBuf,
    /// Only this layer (default: every layer the query file has).
    #[arg(long)]
    layer: Option<usize>,
    /// auto, full, flat, diprs (the DIPR range, found on the PQ codes), graph-diprs (the
    /// same range by a walk of the graph), topk, quest, infllm or pq.
    #[arg(long, default_value = "auto", value_parser = parse_mode)]
    mode: Mode,
    /// DIPR range below the best inner product, in inner-product units (default: ln(97 /
    /// 0.02) / scale, 8.49 logits: 67.9 at head dim 64, 96.0 at 128)
    #[arg(long, value_parser = crate::values::non_negative::<f32>)]
    beta: Option<f32>,
    /// Tokens top-k retrieves.
    #[arg(long, default_value_t = 100)]
    k: usize,
    /// Only tokens below this reused prefix length take part.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    prefix: Option<u32>,
    /// Window: INIT,RECENT tokens attended exactly.
    #[arg(long, default_value = "128,512", value_parser = parse_window)]
    window: (u32, u32),
    /// At most this many retrieved tokens (the best by score), beyond the window; the token
    /// budget of the coarse modes (default 2048). A compact context's codes' best takes this
    /// many candidates, each with the other tokens of its key block.
    #[arg(long)]
    budget: Option<usize>,
    /// Softmax scale (default 1/sqrt(head_dim)).
    #[arg(long, value_parser = crate::values::positive::<f32>)]
    scale: Option<f32>,
    /// on|off: estimate the softmax over the tokens a DIPR plan left out from the index's
    /// seed sample (default: on for `--mode auto` and for a forced mode with --target-error,
    /// off for a forced mode without it). `--mode pq --tail on` is the compact plan's
    /// selection; full, topk, quest and infllm refuse it.
    #[arg(long, value_parser = parse_on_off)]
    tail: Option<bool>,
    /// Ask for an output error at most E (relative to exact attention's) instead of a fixed
    /// --beta: the range is cut per query where the mass it leaves out meets E, the answer's
    /// error is estimated (`estimated_error` in --json) and the range widened while the
    /// estimate misses (at most 6 times). `--mode auto` serves it with the flat scan.
    #[arg(long, value_name = "E", value_parser = crate::values::positive::<f32>)]
    target_error: Option<f32>,
    /// Buffer pool budget.
    #[arg(long, default_value = "256M", value_parser = crate::values::positive_size)]
    pool: u64,
    /// The most the context may hold resident per byte of its KV cache (0.125: an eighth).
    /// When its whole index exceeds it, it is served compact: its PQ codes and seed table
    /// are held, and `--mode auto` answers from the codes (plan `pq`): with an output error
    /// target up to --scan-context tokens, beyond it the codes' best 768 with the tail
    /// estimate. A context that does not fit even so is refused.
    #[arg(long, value_name = "F", value_parser = crate::values::positive::<f64>)]
    resident_budget: Option<f64>,
    /// The longest context `--mode auto` serves with an error target (the flat scan, or a
    /// compact context's codes); beyond it, graph DIPRS or the codes' best within their budget
    /// (`Rules::scan_context`; 0 serves every context as a long one).
    #[arg(long, value_name = "TOKENS", default_value_t = ctxfs_attention::Rules::default().scan_context)]
    scan_context: u32,
    /// Read each layer's `layers.{l}.decode_q` instead of `layers.{l}.q`: the decode steps'
    /// queries of a capture file (`python -m ctxfs.capture`), answered in order.
    #[arg(long)]
    decode: bool,
    /// Print one JSON object per answer (a layer, q head and query), a line each, instead of text.
    #[arg(long)]
    json: bool,
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("{s:?}: expected on or off")),
    }
}

fn parse_window(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s.split_once(',').ok_or_else(|| format!("window {s:?}: expected INIT,RECENT"))?;
    Ok((
        a.trim().parse().map_err(|e| format!("window {s:?}: {e}"))?,
        b.trim().parse().map_err(|e| format!("window {s:?}: {e}"))?,
    ))
}

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    let config = DbConfig {
        pool_bytes: args.pool,
        window: Window { init: args.window.0, recent: args.window.1 },
        resident_budget: args.resident_budget,
        rules: ctxfs_attention::Rules { scan_context: args.scan_context, ..Default::default() },
        ..Default::default()
    };
    let db = Db::open_read_only(&args.store, choice, config)?;
    if args.resident_budget.is_some() {
        // Holds what the budget allows, or refuses the context.
        db.warm(&args.context)?;
    }
    let session = db.open_session(&args.context, args.prefix)?;
    let shape = session.shape();
    let d = shape.head_dim as usize;
    let file = ctxfs_attention::kv::open_regular_file(&args.queries)
        .with_context(|| format!("cannot open {}", args.queries.display()))?;
    // SAFETY: mapped read-only, not modified while mapped.
    let map =
        unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot read {}", args.queries.display()))?;
    let at = |e: ctxfs_attention::Error| anyhow!("{}: {e}", args.queries.display());
    let file = QueryFile::parse(&map).map_err(at)?;
    let file = if args.decode { file.decode_steps() } else { file };
    let layers: Vec<usize> = match args.layer {
        Some(l) => vec![l],
        None => {
            if let Some(l) = file.last_layer().filter(|&l| l >= shape.layers as usize) {
                bail!(
                    "{} holds layers.{l}.{}, but the context has {}",
                    args.queries.display(),
                    file.tensor(),
                    crate::units::count(shape.layers, "layer")
                );
            }
            (0..shape.layers as usize).filter(|&l| file.has_layer(l)).collect()
        }
    };
    ensure!(
        !layers.is_empty(),
        "{} has no layers.{{l}}.{} tensor for this context",
        args.queries.display(),
        file.tensor()
    );
    let opts = AttentionOptions {
        plan: args.mode.0,
        beta: args.beta,
        k: args.k,
        budget: args.budget,
        scale: args.scale,
        tail: args.tail,
        target_error: args.target_error,
        detail: true,
        ..Default::default()
    };
    // Every layer's queries are checked (shape, finite values) before the first answer is
    // written: a bad query file fails with nothing on standard output.
    for &l in &layers {
        if l >= shape.layers as usize {
            bail!("layer {l} does not exist: the context has {}", crate::units::count(shape.layers, "layer"));
        }
        file.layer(l, shape.q_heads as usize, d).map_err(at)?;
    }
    let out = std::io::stdout();
    let mut out = std::io::BufWriter::new(out.lock());
    for &l in &layers {
        let queries = file.layer(l, shape.q_heads as usize, d).map_err(at)?;
        for qi in 0..queries.steps {
            let a = session.attention_with(l, &queries.step(qi), &opts)?;
            let plan = a.plan();
            for (h, r) in a.heads.iter().enumerate() {
                let v = json!({
                    "layer": l, "head": h, "query": qi, "selected": r.selected, "output": &a.output[h * d..(h + 1) * d],
                    "lse": r.lse, "keys_scored": r.stats.keys_scored, "blocks_read": r.stats.blocks_read,
                    "micros": a.micros, "plan": plan, "tail_seeds": r.tail_seeds,
                    "estimated_error": r.estimated_error,
                });
                if args.json {
                    // As an io::Error, a closed pipe is recognised as the reader stopping.
                    serde_json::to_writer(&mut out, &v).map_err(std::io::Error::from)?;
                    std::io::Write::write_all(&mut out, b"\n")?;
                } else {
                    std::io::Write::write_fmt(
                        &mut out,
                        format_args!(
                            "layer {l} head {h} query {qi}: {} selected ({} retrieved, {} tail seeds), lse {:.3}, {} keys scored, {} blocks read, {} µs, plan {plan}\n",
                            r.selected.len(),
                            r.retrieved,
                            r.tail_seeds,
                            r.lse,
                            r.stats.keys_scored,
                            r.stats.blocks_read,
                            a.micros
                        ),
                    )?;
                }
            }
        }
    }
    std::io::Write::flush(&mut out)?;
    Ok(())
}
