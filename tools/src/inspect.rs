use crate::units::{count, human_bytes};
use anyhow::{bail, Result};
use ctxfs_attention::describe::{self, context_blocks, hex};
use ctxfs_vfs::{inspect::live_blocks, DeviceChoice, FileStream, Store};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct Args {
    store: PathBuf,
    /// Describe one vector file of this context (with --layer and --head).
    #[arg(requires_all = ["layer", "head"])]
    context: Option<String>,
    /// The vector file's layer.
    #[arg(long, requires = "context")]
    layer: Option<u16>,
    /// The vector file's kv head.
    #[arg(long, requires = "context")]
    head: Option<u16>,
    /// List every live block with its kind and owner.
    #[arg(long, conflicts_with = "context")]
    blocks: bool,
    /// Open every context for serving: load all index blocks into a buffer pool of
    /// `--budget` bytes, and show the pool's statistics.
    #[arg(long, conflicts_with_all = ["context", "blocks"])]
    buffer: bool,
    /// Buffer pool budget for --buffer.
    #[arg(long, default_value = "256M", value_parser = crate::values::positive_size, requires = "buffer")]
    budget: u64,
    /// Print JSON instead of text (with --blocks, one array).
    #[arg(long)]
    json: bool,
}

impl Args {
    /// `inspect STORE` with no other options.
    pub fn summary_of(store: PathBuf) -> Args {
        Args { store, context: None, layer: None, head: None, blocks: false, buffer: false, budget: 0, json: false }
    }
}

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    let store = Store::open_path_read_only(&args.store, choice)?;
    // The report is written whole at the end: a reader that closes the pipe early (`| head`)
    // ends the command quietly (main), instead of failing a print halfway.
    let mut o = String::new();
    let done = if args.blocks {
        list_blocks(&store, args.json, &mut o)
    } else if args.buffer {
        buffer(&store, args.budget, args.json, &mut o)
    } else {
        match (&args.context, args.layer, args.head) {
            (Some(name), Some(layer), Some(head)) => vector_file(&store, name, layer, head, args.json, &mut o),
            (Some(_), _, _) => bail!("describing a vector file needs both --layer and --head"),
            _ => summary(&store, &args.store, args.json, &mut o),
        }
    };
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(o.as_bytes())?;
    stdout.flush()?;
    done
}

fn summary(store: &Store, path: &std::path::Path, json: bool, o: &mut String) -> Result<()> {
    let snap = store.snapshot();
    let sb = *snap.superblock();
    let info = store.device_info();
    let space = store.space();
    let (available, used) = (space.free, space.used);
    let bs = sb.block_size as u64;
    if json {
        let mut v = describe::store_json(store);
        v["store"] = json!(path);
        writeln!(o, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    writeln!(o, "store       {}", path.display())?;
    writeln!(
        o,
        "format      v{}, block size {} B, {} blocks ({})",
        sb.format_version,
        sb.block_size,
        sb.total_blocks,
        human_bytes(sb.total_blocks * bs)
    )?;
    writeln!(o, "superblock  generation {} in slot {}, store id {}", sb.generation, sb.slot(), hex(&sb.store_id))?;
    for s in store.slots() {
        match &s.result {
            Ok(sb) => writeln!(o, "  slot {}    valid, generation {}", s.slot, sb.generation)?,
            Err(e) => writeln!(o, "  slot {}    INVALID: {e}", s.slot)?,
        }
    }
    writeln!(
        o,
        "device      {} (queue depth {}){}",
        info.kind,
        info.queue_depth,
        info.note.map(|n| format!(" — {n}")).unwrap_or_default()
    )?;
    writeln!(
        o,
        "space       {} used, {} free ({} free blocks){}",
        human_bytes(used * bs),
        human_bytes(available * bs),
        available,
        if space.reclaimable > 0 {
            format!(", {} freed, reusable after the next commit", human_bytes(space.reclaimable * bs))
        } else {
            String::new()
        }
    )?;
    let retired: Vec<String> =
        snap.retired_contexts().map(|c| format!("id {} ({} blocks)", c.id, context_blocks(c).0)).collect();
    writeln!(
        o,
        "contexts    {}{}",
        snap.contexts().count(),
        if retired.is_empty() {
            String::new()
        } else {
            format!("; retired (deleted, kept for their children): {}", retired.join(", "))
        }
    )?;
    for d in snap.damaged_contexts() {
        writeln!(
            o,
            "damaged     {:?} (id {}): {} (ctxfs fsck --repair --drop-damaged drops it)",
            d.entry.name, d.entry.id, d.why
        )?;
    }
    for c in snap.contexts() {
        let (blocks, bytes) = context_blocks(c);
        let sh = &c.shape;
        writeln!(
            o,
            "\n  {:?} (id {}): {}{}, {} × {} ({}), head dim {}, {}; {}, {}",
            c.name,
            c.id,
            count(c.token_count(), "token"),
            c.parent
                .map(|p| format!(
                    " (the first {} of context {}, then {} own)",
                    p.prefix_tokens,
                    p.id,
                    c.own_token_count()
                ))
                .unwrap_or_default(),
            count(sh.layers, "layer"),
            count(sh.kv_heads, "kv head"),
            count(sh.q_heads, "q head"),
            sh.head_dim,
            sh.dtype.name(),
            count(blocks, "block"),
            human_bytes(bytes)
        )?;
        writeln!(o, "    vector files (index blocks / data blocks):")?;
        let kv = sh.kv_heads as usize;
        for (layer, files) in c.files.chunks(kv).enumerate() {
            let cells: Vec<String> = files.iter().map(|f| format!("{}/{}", f.index.blocks, f.data.blocks)).collect();
            writeln!(o, "      layer {layer:>3}: {}", cells.join("  "))?;
        }
    }
    Ok(())
}

fn vector_file(store: &Store, name: &str, layer: u16, head: u16, json: bool, o: &mut String) -> Result<()> {
    let snap = store.snapshot();
    let ctx = snap.context(name)?;
    let mut parts = Vec::new();
    for which in [FileStream::Index, FileStream::Data] {
        let s = ctx.stream(layer, head, which)?;
        let runs: Vec<Value> = s
            .map()
            .runs()
            .map(|(logical, start, len, step)| json!({"logical": logical, "block": start, "blocks": len, "step": step}))
            .collect();
        parts.push((which, s.blocks(), s.bytes(), runs));
    }
    let owner = ctxfs_vfs::format::Owner::file(ctx.record().id, layer, head);
    if json {
        let mut v = json!({"context": name, "layer": layer, "head": head, "owner": owner.to_string()});
        for (which, blocks, bytes, runs) in parts {
            v[if which == FileStream::Index { "index" } else { "data" }] =
                json!({"blocks": blocks, "bytes": bytes, "extents": runs});
        }
        writeln!(o, "{}", serde_json::to_string_pretty(&v)?)?;
        return Ok(());
    }
    writeln!(o, "vector file {name:?} layer {layer} head {head} ({owner})")?;
    for (which, blocks, bytes, runs) in parts {
        writeln!(o, "  {:?} stream: {blocks} blocks, {} in {} extents", which, human_bytes(bytes), runs.len())?;
        for r in runs.iter().take(20) {
            let (start, len, step) = (r["block"].as_u64(), r["blocks"].as_u64(), r["step"].as_u64());
            let (start, len, step) = (start.unwrap_or(0), len.unwrap_or(0), step.unwrap_or(1));
            let every = if step > 1 { format!(", every {step}") } else { String::new() };
            writeln!(
                o,
                "    logical {:>8} → blocks {start}..{}{every}",
                r["logical"],
                start + len.saturating_sub(1) * step + 1
            )?;
        }
        if runs.len() > 20 {
            writeln!(o, "    … {} more extents (use --json)", runs.len() - 20)?;
        }
    }
    Ok(())
}

fn list_blocks(store: &Store, json: bool, o: &mut String) -> Result<()> {
    let snap = store.snapshot();
    let names: std::collections::BTreeMap<u32, &str> = snap.contexts().map(|c| (c.id, c.name.as_str())).collect();
    let blocks = live_blocks(&snap)?;
    if json {
        let list: Vec<Value> = blocks
            .iter()
            .map(|b| {
                json!({
                    "block": b.block, "kind": b.kind.name(), "owner": b.owner.to_string(), "stream": b.stream.name(),
                    "context": names.get(&b.owner.context),
                })
            })
            .collect();
        writeln!(o, "{}", serde_json::to_string(&list)?)?;
        return Ok(());
    }
    writeln!(o, "{:>10}  {:<10}  {:<7}  owner", "block", "kind", "stream")?;
    for b in &blocks {
        let ctx = names.get(&b.owner.context).map(|n| format!(" ({n:?})")).unwrap_or_default();
        writeln!(o, "{:>10}  {:<10}  {:<7}  {}{ctx}", b.block, b.kind.name(), b.stream.name(), b.owner)?;
    }
    Ok(())
}

/// One context's resident index by part against its KV bytes, and what it holds served
/// compact.
pub(crate) fn footprint_text(name: &str, f: &ctxfs_attention::Footprint) -> String {
    use crate::units::human_bytes;
    let per_token = |b: u64| f.per_token_and_head(b);
    let mut o = format!(
        "context {name:?}: resident_bytes / kv_bytes = {} / {} = {:.3} ({:.0} B per token and kv head: graph {:.0}, keys {:.0}, seeds {:.1}, quest {:.0}, infllm {:.1}, pq {:.1}, meta {:.2}, block maps {:.2}; beside them a session's window {:.2})\n",
        human_bytes(f.resident_bytes()),
        human_bytes(f.kv_bytes),
        f.ratio(),
        per_token(f.resident_bytes()),
        per_token(f.graph),
        per_token(f.keys),
        per_token(f.seeds),
        per_token(f.quest),
        per_token(f.infllm),
        per_token(f.pq),
        per_token(f.meta),
        per_token(f.maps),
        per_token(f.window),
    );
    o += &format!(
        "  served compact (meta, seeds, PQ codes and block maps): {} = {:.3} of the KV ({:.1} B per token and kv head); with a session's window {:.3}\n",
        human_bytes(f.compact_bytes()),
        f.compact_ratio(),
        per_token(f.compact_bytes()),
        f.compact_and_window_ratio(),
    );
    o
}

/// Loads every index block of every context through a buffer pool, as a server opening the
/// store would, and reports what it cost and whether the index stays resident.
fn buffer(store: &Store, budget: u64, json: bool, o: &mut String) -> Result<()> {
    use ctxfs_buffer::{BufferPool, DeviceSource, PoolConfig};
    let config = PoolConfig { budget_bytes: budget, ..Default::default() };
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), config)?;
    let snap = store.snapshot();
    let started = std::time::Instant::now();
    let mut index_blocks = 0;
    // (context, why): a context whose index could not be read is reported once, by its first error.
    let mut failed: Vec<(&str, String)> = Vec::new();
    for c in snap.contexts() {
        match pool.open_context(&snap, &c.name) {
            Ok(n) => index_blocks += n,
            Err(e) => failed.push((&c.name, e.to_string())),
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let stats = pool.stats();
    let mut footprints = Vec::new();
    let opened: Vec<_> = snap.contexts().filter(|c| failed.iter().all(|(name, _)| *name != c.name)).collect();
    for c in opened {
        // A session's window as sessions take it by default.
        match ctxfs_attention::footprint::measure(&pool, &snap, &c.name, &ctxfs_attention::Window::default()) {
            Ok(f) => footprints.push((c.name.clone(), f)),
            Err(e) => failed.push((&c.name, e.to_string())),
        }
    }
    let fits = stats.index.evictions == 0 && failed.is_empty();
    let errors: Vec<String> = failed.iter().map(|(name, e)| format!("context {name:?}: {e}")).collect();
    if json {
        let contexts: Vec<_> = footprints
            .iter()
            .map(|(name, f)| {
                let mut v = f.to_json();
                v["name"] = json!(name);
                v
            })
            .collect();
        let v = json!({
            "index_blocks": index_blocks, "seconds": secs, "index_resident": fits,
            "contexts": contexts, "errors": errors, "stats": ctxfs_attention::describe::pool_json(&stats),
        });
        writeln!(o, "{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        let contexts = count(snap.contexts().count() as u64, "context");
        writeln!(o, "loaded {} of {contexts} in {secs:.3} s", count(index_blocks as u64, "index block"))?;
        o.push_str(&crate::bench_buffer::stats_text(&stats));
        for (name, f) in &footprints {
            o.push_str(&footprint_text(name, f));
        }
        if fits {
            writeln!(o, "the whole index stays resident in this budget")?;
        } else if stats.index.evictions > 0 {
            writeln!(o, "the index does NOT fit: {} index evictions; raise --budget", stats.index.evictions)?;
        }
        for e in &errors {
            writeln!(o, "error: {e}")?;
        }
    }
    anyhow::ensure!(failed.is_empty(), "the index of {} could not be read", count(failed.len() as u64, "context"));
    Ok(())
}
