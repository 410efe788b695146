//! `ctxfs query`: attention for each (layer, q head, query) of a query file over a stored
//! context, through the buffer pool and the index, one JSON object per line.
//!
//! Every plan attends the window (the first `INIT` and last `RECENT` tokens of the reused
//! prefix) exactly, plus the tokens it retrieves; the DIPR plans take the window's best score
//! as their starting maximum.

use crate::tensors::f32s;
use anyhow::{bail, ensure, Context, Result};
use ctxfs_buffer::{BlockRequest, BufferPool, DeviceSource, PoolConfig};
use ctxfs_index::paged::{gather_rows, PagedIndex};
use ctxfs_index::search::{diprs, topk};
use ctxfs_index::{flat, DiprsParams, Keys, SearchStats};
use ctxfs_kernels::Partial;
use ctxfs_vfs::{DeviceChoice, FileStream, Store};
use safetensors::SafeTensors;
use serde_json::json;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    Auto,
    Full,
    Flat,
    Diprs,
    Topk,
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
    #[arg(long, value_enum, default_value = "auto")]
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
    /// At most this many retrieved tokens (the best by score), beyond the window.
    #[arg(long)]
    budget: Option<usize>,
    /// Softmax scale (default 1/sqrt(head_dim)).
    #[arg(long)]
    scale: Option<f32>,
    /// Buffer pool budget.
    #[arg(long, default_value = "256M", value_parser = crate::units::parse_size)]
    pool: u64,
    #[arg(long)]
    json: bool,
}

fn parse_window(s: &str) -> Result<(u32, u32), String> {
    let (a, b) = s.split_once(',').ok_or_else(|| format!("window {s:?}: expected INIT,RECENT"))?;
    Ok((
        a.trim().parse().map_err(|e| format!("window {s:?}: {e}"))?,
        b.trim().parse().map_err(|e| format!("window {s:?}: {e}"))?,
    ))
}

/// The tokens of the window over a prefix of `p` tokens: the first `init`, and the last
/// `recent` that are not among them.
pub fn window(p: u32, (init, recent): (u32, u32)) -> Vec<u32> {
    let head = init.min(p);
    (0..head).chain(p.saturating_sub(recent).max(head)..p).collect()
}

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    let store = Store::open_path(&args.store, choice)?;
    let snap = store.snapshot();
    let ctx = snap.context(&args.context)?;
    let shape = ctx.record().shape;
    let n = ctx.token_count() as u32;
    let d = shape.head_dim as usize;
    let group = (shape.q_heads / shape.kv_heads) as usize;
    let p = args.prefix.unwrap_or(n);
    ensure!(p <= n, "--prefix {p} exceeds the context's {n} tokens");
    let scale = args.scale.unwrap_or(1.0 / (d as f32).sqrt());
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
    let pool = BufferPool::new(
        Arc::new(DeviceSource::new(store.device().clone())),
        PoolConfig { budget_bytes: args.pool, ..Default::default() },
    )?;
    let win = window(p, args.window);
    let win_set: BTreeSet<u32> = win.iter().copied().collect();
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
        let plan = match args.mode {
            Mode::Auto if p as usize <= win.len() => "full",
            Mode::Auto if l == 0 => "flat",
            Mode::Auto | Mode::Diprs => "diprs",
            Mode::Full => "full",
            Mode::Flat => "flat",
            Mode::Topk => "topk",
        };
        let plan_name = if plan != "full" && p < n { format!("{plan}+prefix") } else { plan.to_string() };
        for kv in 0..shape.kv_heads as usize {
            let index_stream = ctx.stream(l as u16, kv as u16, FileStream::Index)?;
            let data_stream = ctx.stream(l as u16, kv as u16, FileStream::Data)?;
            let index_reqs: Vec<BlockRequest> = (0..index_stream.blocks())
                .map(|b| BlockRequest::new(index_stream.locate(b).expect("in range")))
                .collect();
            let data_reqs: Vec<BlockRequest> = (0..data_stream.blocks())
                .map(|b| BlockRequest::new(data_stream.locate(b).expect("in range")))
                .collect();
            let index = PagedIndex::open(&pool, index_reqs).map_err(anyhow::Error::msg)?;
            ensure!(
                index.layout().tokens == n,
                "layer {l} head {kv}: the index holds {} tokens, the context {n}",
                index.layout().tokens
            );
            let rows = index.layout().rows_per_block;
            for qh in kv * group..(kv + 1) * group {
                for qi in 0..nq {
                    let q = &queries[(qh * nq + qi) * d..(qh * nq + qi + 1) * d];
                    let started = Instant::now();
                    let before = pool.stats();
                    let mut stats = SearchStats::default();
                    let mut win_scores = vec![0.0; win.len()];
                    index.score(&win, q, &mut win_scores, &mut stats)?;
                    let win_max = win_scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let found = match plan {
                        "full" => flat::dipr(&index, q, f32::INFINITY, f32::NEG_INFINITY, Some(p))?,
                        "flat" => flat::dipr(&index, q, args.beta, win_max, Some(p))?,
                        "topk" => topk(&index, q, args.k + win.len(), (args.k + win.len()).max(64), Some(p))?,
                        _ => diprs(
                            &index,
                            q,
                            &DiprsParams { beta: args.beta, l0: 64, window_max: win_max, prefix: Some(p) },
                        )?,
                    };
                    stats += found.stats;
                    let mut retrieved: Vec<(u32, f32)> = found
                        .ids
                        .iter()
                        .zip(&found.scores)
                        .filter(|(id, _)| !win_set.contains(id))
                        .map(|(&i, &s)| (i, s))
                        .collect();
                    if plan == "topk" {
                        retrieved.truncate(args.k);
                    }
                    if let Some(b) = args.budget {
                        retrieved.truncate(b);
                    }
                    let mut selected: Vec<(u32, f32)> =
                        win.iter().copied().zip(win_scores.iter().copied()).chain(retrieved).collect();
                    selected.sort_by_key(|s| s.0);
                    let ids: Vec<u32> = selected.iter().map(|s| s.0).collect();
                    let mut z: Vec<f32> = selected.iter().map(|s| s.1 * scale).collect();
                    let (values, _) = gather_rows(&pool, &data_reqs, rows, d, &ids)?;
                    let part = Partial::from_scores_on(ctxfs_kernels::active(), &mut z, &values, d);
                    let after = pool.stats();
                    let blocks_read =
                        (after.index.misses + after.data.misses) - (before.index.misses + before.data.misses);
                    let v = json!({
                        "layer": l, "head": qh, "query": qi, "selected": ids, "output": part.o, "lse": part.lse(),
                        "keys_scored": stats.keys_scored, "blocks_read": blocks_read,
                        "micros": started.elapsed().as_micros() as u64, "plan": plan_name,
                    });
                    if args.json {
                        serde_json::to_writer(&mut out, &v)?;
                        std::io::Write::write_all(&mut out, b"\n")?;
                    } else {
                        std::io::Write::write_fmt(
                            &mut out,
                            format_args!(
                                "layer {l} head {qh} query {qi}: {} selected ({} retrieved), lse {:.3}, {} keys scored, {} blocks read, {} µs, plan {plan_name}\n",
                                v["selected"].as_array().map_or(0, Vec::len),
                                v["selected"].as_array().map_or(0, Vec::len) - win.len(),
                                part.lse(),
                                stats.keys_scored,
                                blocks_read,
                                v["micros"]
                            ),
                        )?;
                    }
                }
            }
        }
    }
    std::io::Write::flush(&mut out)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::window;

    #[test]
    fn the_window_never_repeats_a_token_or_leaves_the_prefix() {
        assert_eq!(window(1000, (128, 512)).len(), 640);
        assert_eq!(window(600, (128, 512)), (0..600).collect::<Vec<_>>());
        assert_eq!(window(100, (128, 512)), (0..100).collect::<Vec<_>>());
        assert_eq!(window(0, (128, 512)), Vec::<u32>::new());
        let w = window(5000, (4, 8));
        assert_eq!(w, [0, 1, 2, 3, 4992, 4993, 4994, 4995, 4996, 4997, 4998, 4999]);
    }
}
