//! `ctxfs query`: attention for each (layer, q head, query) of a query file over a stored
//! context, through a session (`Db::open_session`), one JSON object per line.
//!
//! Every plan attends the window (the first `INIT` and last `RECENT` tokens of the reused
//! prefix) exactly, plus the tokens it retrieves; the DIPR plans take the window's best score
//! as their starting maximum. `--mode auto` is the optimizer's choice; its DIPR plans also
//! estimate the softmax over what they left out from the index's seed sample (`--tail`), and
//! the seeds that estimate used are in `selected` (their values entered the output).

use crate::decode_queries::step_of;
use anyhow::{bail, ensure, Context, Result};
use ctxfs_attention::kv::f32s;
use ctxfs_attention::{AttentionOptions, Db, DbConfig, Plan, Window};
use ctxfs_vfs::DeviceChoice;
use safetensors::SafeTensors;
use serde_json::json;
use std::path::PathBuf;

/// `auto` (the optimizer's choice) or a plan forced by name.
#[derive(Debug, Clone, Copy)]
struct Mode(Option<Plan>);

fn parse_mode(s: &str) -> Result<Mode, String> {
    if s == "auto" {
        Ok(Mode(None))
    } else {
        s.parse().map(|p| Mode(Some(p)))
    }
}

#[derive(clap::Args)]
pub struct Args {
    store: PathBuf,
    #[arg(long)]
    context: String,
    /// A safetensors file of `layers.{l}.q`, shape [q_heads, n, head_dim].
    #[arg(long)]
    queries: PathBuf,
    /// Only this layer (default: every layer the query file has).
    #[arg(long)]
    layer: Option<usize>,
    /// auto, full, flat, diprs, topk, quest, infllm or pq.
    #[arg(long, default_value = "auto", value_parser = parse_mode)]
    mode: Mode,
    /// DIPR range below the best inner product, in inner-product units.
    #[arg(long, default_value_t = 50.0)]
    beta: f32,
    /// Tokens top-k retrieves.
    #[arg(long, default_value_t = 100)]
    k: usize,
    /// Only tokens below this reused prefix length take part.
    #[arg(long)]
    prefix: Option<u32>,
    /// Window: INIT,RECENT tokens attended exactly.
    #[arg(long, default_value = "128,512", value_parser = parse_window)]
    window: (u32, u32),
    /// At most this many retrieved tokens (the best by score), beyond the window; the token
    /// budget of the coarse modes (default 2048).
    #[arg(long)]
    budget: Option<usize>,
    /// Softmax scale (default 1/sqrt(head_dim)).
    #[arg(long)]
    scale: Option<f32>,
    /// on|off: estimate the softmax over the tokens a DIPR plan left out from the index's
    /// seed sample (default: on for `--mode auto`, off for a forced mode).
    #[arg(long, value_parser = parse_on_off)]
    tail: Option<bool>,
    /// Buffer pool budget.
    #[arg(long, default_value = "256M", value_parser = crate::units::parse_size)]
    pool: u64,
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
        ..Default::default()
    };
    let db = Db::open(&args.store, choice, config)?;
    let session = db.open_session(&args.context, args.prefix)?;
    let shape = session.shape();
    let d = shape.head_dim as usize;
    let file = std::fs::File::open(&args.queries).with_context(|| format!("cannot open {}", args.queries.display()))?;
    // SAFETY: mapped read-only, not modified while mapped.
    let map = unsafe { memmap2::Mmap::map(&file)? };
    let st = SafeTensors::deserialize(&map)
        .with_context(|| format!("{} is not a safetensors file", args.queries.display()))?;
    let layers: Vec<usize> = match args.layer {
        Some(l) => vec![l],
        None => (0..shape.layers as usize).filter(|l| st.tensor(&format!("layers.{l}.q")).is_ok()).collect(),
    };
    ensure!(!layers.is_empty(), "{} has no layers.{{l}}.q tensor for this context", args.queries.display());
    let opts = AttentionOptions {
        plan: args.mode.0,
        beta: args.beta,
        k: args.k,
        budget: args.budget,
        scale: args.scale,
        tail: args.tail,
        detail: true,
        ..Default::default()
    };
    let out = std::io::stdout();
    let mut out = std::io::BufWriter::new(out.lock());
    for &l in &layers {
        if l >= shape.layers as usize {
            bail!("layer {l} does not exist: the context has {} layers", shape.layers);
        }
        let name = format!("layers.{l}.q");
        let qt = st.tensor(&name).with_context(|| format!("{} has no {name}", args.queries.display()))?;
        let qs = qt.shape().to_vec();
        ensure!(
            qs.len() == 3 && qs[0] == shape.q_heads as usize && qs[2] == d,
            "{name} has shape {qs:?}, expected [{}, n, {d}]",
            shape.q_heads
        );
        let nq = qs[1];
        let queries = f32s(&st, &name, 0..qs.iter().product())?;
        for qi in 0..nq {
            let a = session.attention_with(l, &step_of(&queries, nq, d, qi), &opts)?;
            let plan = a.plan();
            for (h, r) in a.heads.iter().enumerate() {
                let v = json!({
                    "layer": l, "head": h, "query": qi, "selected": r.selected, "output": &a.output[h * d..(h + 1) * d],
                    "lse": r.lse, "keys_scored": r.stats.keys_scored, "blocks_read": r.stats.blocks_read,
                    "micros": a.micros, "plan": plan, "tail_seeds": r.tail_seeds,
                });
                if args.json {
                    serde_json::to_writer(&mut out, &v)?;
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
