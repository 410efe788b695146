//! What serving a context keeps resident, part by part, against the size of its KV cache:
//! the measure of `DbConfig::resident_budget`.
//!
//! A served context holds its index streams in the pool's index area (`Db::warm`); each
//! block costs one frame of the device's block size. The KV bytes are what a server that
//! kept the cache in memory would hold: keys and values of every token, layer and kv head,
//! in the context's element type. Beside the frames, serving keeps each vector file's block
//! maps (a CRC per block and its runs of device blocks) and frame hints: they count too.
//! A session keeps the window's keys and values: a fixed number of tokens per (layer, kv
//! head), 640 by default, more than an eighth of the KV of a context of a few thousand
//! tokens. They are reported beside the budget, not in it.
//!
//! A context whose whole index exceeds the budget is served **compact**: only each vector
//! file's meta block, seed table (keys and values) and PQ codes (with the residual codes
//! that rank their candidates) are held, and the pq plan with an output error target
//! answers from the codes, scoring its candidates' keys from blocks read on demand
//! (`ctxfs_index::approx`).

use crate::db::Window;
use crate::error::{Error, Result};
use crate::layout::{files_of, map_bytes, FileBlocks};
use ctxfs_buffer::{BlockRequest, BufferPool};
use ctxfs_index::coarse::pq::PqMeta;
use ctxfs_index::coarse::{run_of, CoarseKind};
use ctxfs_index::paged::Layout;
use ctxfs_vfs::{ModelShape, Snapshot};
use serde_json::{json, Value};
use std::ops::Range;

/// A context's resident index by part, and its KV bytes. Parts are in bytes of pool frames,
/// but for `maps` and `window` (which is not resident index: a session's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Footprint {
    /// Tokens of the context (its prefix segments included).
    pub tokens: u64,
    /// Its (layer, kv head) pairs: the vector files of each segment.
    pub heads: u64,
    /// Keys and values of every token, layer and kv head.
    pub kv_bytes: u64,
    /// The index meta blocks (one per vector file).
    pub meta: u64,
    /// The graph's adjacency records.
    pub graph: u64,
    /// The full-precision keys.
    pub keys: u64,
    /// The seed table's keys and values.
    pub seeds: u64,
    /// Quest's page bounds.
    pub quest: u64,
    /// InfLLM's block representatives.
    pub infllm: u64,
    /// The PQ codes and centroids, the residual codes' included.
    pub pq: u64,
    /// The vector files' block maps and frame hints ([`FileBlocks::map_bytes`]).
    pub maps: u64,
    /// A session's window: its keys and values as stored (2 bytes an element), per (layer,
    /// kv head)
    /// ([`window_bytes`]). Not in the resident bytes.
    pub window: u64,
}

impl Footprint {
    /// The resident index: every part but a session's window.
    pub fn resident_bytes(&self) -> u64 {
        self.compact_bytes() + self.graph + self.keys + self.quest + self.infllm
    }

    /// What a compact context holds: meta blocks, seeds and PQ codes, and beside them the
    /// block maps.
    pub fn compact_bytes(&self) -> u64 {
        self.meta + self.seeds + self.pq + self.maps
    }

    /// Resident bytes per KV byte.
    pub fn ratio(&self) -> f64 {
        ratio(self.resident_bytes(), self.kv_bytes)
    }

    /// Compact bytes per KV byte.
    pub fn compact_ratio(&self) -> f64 {
        ratio(self.compact_bytes(), self.kv_bytes)
    }

    /// Compact bytes and a session's window per KV byte.
    pub fn compact_and_window_ratio(&self) -> f64 {
        ratio(self.compact_bytes() + self.window, self.kv_bytes)
    }

    /// `bytes` per token of one (layer, kv head): the unit of the budget's arithmetic (64 at
    /// d = 128 in f16 is an eighth of the KV).
    pub fn per_token_and_head(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.tokens * self.heads).max(1) as f64
    }

    pub fn to_json(&self) -> Value {
        json!({
            "tokens": self.tokens, "heads": self.heads, "kv_bytes": self.kv_bytes,
            "resident_bytes": self.resident_bytes(), "resident_over_kv": self.ratio(),
            "compact_bytes": self.compact_bytes(), "compact_over_kv": self.compact_ratio(),
            "compact_and_window_over_kv": self.compact_and_window_ratio(),
            "parts": {"meta": self.meta, "graph": self.graph, "keys": self.keys, "seeds": self.seeds,
                "quest": self.quest, "infllm": self.infllm, "pq": self.pq, "maps": self.maps, "window": self.window},
        })
    }
}

pub(crate) fn ratio(resident: u64, kv: u64) -> f64 {
    if kv == 0 {
        0.0
    } else {
        resident as f64 / kv as f64
    }
}

/// What serving a context would hold, known without reading an index block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Planned {
    /// Its KV bytes (all its tokens).
    pub kv_bytes: u64,
    /// The bytes of its whole index.
    pub whole: u64,
    /// What is held beside the pool's frames however it is served: the block maps and
    /// frame hints.
    pub beside: u64,
}

impl Planned {
    pub fn of(snap: &Snapshot, name: &str) -> Result<Planned> {
        let ctx = snap.context(name)?;
        let (mut blocks, mut maps) = (0u64, 0u64);
        for f in files_of(snap, name)? {
            let c = snap.context_by_id(f.context)?;
            let index = c.stream(f.layer, f.head, ctxfs_vfs::FileStream::Index)?.refs();
            blocks += index.len();
            maps += map_bytes(&index, &c.stream(f.layer, f.head, ctxfs_vfs::FileStream::Data)?.refs());
        }
        Ok(Planned {
            kv_bytes: kv_bytes(&ctx.record().shape, ctx.token_count()),
            whole: blocks * snap.block_size() as u64,
            beside: maps,
        })
    }

    /// Whether it is served compact under `budget`: its whole index, with what is held
    /// beside it, exceeds it.
    pub fn compact(&self, budget: Option<f64>) -> bool {
        budget.is_some_and(|b| (self.whole + self.beside) as f64 > b * self.kv_bytes as f64)
    }
}

/// The bytes a session holds for the window of a context of `tokens` tokens: its keys and
/// values in their stored type (f16 or bf16, 2 bytes an element), for every (layer, kv
/// head).
pub fn window_bytes(shape: &ModelShape, tokens: u64, window: &Window) -> u64 {
    let rows = u64::from(window.len(u32::try_from(tokens).unwrap_or(u32::MAX)));
    let files = u64::from(shape.layers) * u64::from(shape.kv_heads);
    rows * 2 * u64::from(shape.head_dim) * 2 * files
}

fn kv_bytes(shape: &ModelShape, tokens: u64) -> u64 {
    let per_token = 2 * shape.layers as u64 * shape.kv_heads as u64 * shape.head_dim as u64 * shape.dtype.size() as u64;
    tokens * per_token
}

/// One vector file's index stream, part by part, as ranges of its logical blocks.
pub(crate) struct IndexParts {
    pub layout: Layout,
    /// The seed table's key and value blocks.
    pub seeds: Range<usize>,
    /// The coarse runs after the graph index, in stream order.
    pub runs: Vec<(CoarseKind, Range<usize>)>,
    /// Blocks of residual codes at the end of the PQ run (0 without them).
    pub residual: usize,
}

impl IndexParts {
    /// Reads the meta block and each coarse run's meta block of `file` through `pool`.
    /// `what` names the file in errors.
    pub fn read(pool: &BufferPool, file: &FileBlocks, what: &str) -> Result<IndexParts> {
        let corrupt = |e: String| Error::Corrupt(format!("{what}: {e}"));
        let index = file.index();
        let first = index.first().ok_or_else(|| corrupt("an empty index stream".into()))?;
        let layout = Layout::decode(pool.get(&first)?.payload())
            .map_err(|e| corrupt(format!("index meta block {}: {e}", first.block)))?;
        let graph_end = layout.index_blocks() as usize;
        if graph_end > index.len() {
            return Err(corrupt(format!("{} index blocks for a graph index of {graph_end}", index.len())));
        }
        let seeds_from = graph_end - (layout.seed_blocks() + layout.seed_value_blocks()) as usize;
        let (mut runs, mut at, mut residual) = (Vec::new(), graph_end, 0);
        while at < index.len() {
            let meta = pool.get(&index.at(at))?;
            let run_error =
                |e: String| corrupt(format!("the coarse run at index block {at} (block {}): {e}", index.at(at).block));
            let (kind, blocks) = run_of(meta.payload()).map_err(run_error)?;
            if blocks == 0 || at + blocks > index.len() {
                return Err(corrupt(format!("a coarse run of {blocks} blocks at block {at} overruns the stream")));
            }
            if kind == CoarseKind::Pq {
                residual = PqMeta::decode(meta.payload()).map_err(run_error)?.residual_blocks();
            }
            runs.push((kind, at..at + blocks));
            at += blocks;
        }
        Ok(IndexParts { layout, seeds: seeds_from..graph_end, runs, residual })
    }

    /// The PQ run, if the file has one.
    pub fn pq(&self) -> Option<Range<usize>> {
        self.runs.iter().find(|r| r.0 == CoarseKind::Pq).map(|r| r.1.clone())
    }

    /// The blocks a compact context holds: the meta block, the seed table and the PQ run,
    /// its residual codes only where `residual` asks (`None` without a PQ run).
    pub fn compact(&self, file: &FileBlocks, residual: bool) -> Option<Vec<BlockRequest>> {
        let (pq, held_at) = self.compact_pq()?;
        let end = if residual { pq.end } else { pq.end - self.residual };
        let index = file.index();
        let mut blocks = vec![index.at(0)];
        blocks.extend(index.range(self.seeds.clone()).iter());
        debug_assert_eq!(blocks.len(), held_at);
        blocks.extend(index.range(pq.start..end).iter());
        Some(blocks)
    }

    /// The PQ run and where [`IndexParts::compact`]'s blocks hold its first block.
    pub fn compact_pq(&self) -> Option<(Range<usize>, usize)> {
        Some((self.pq()?, 1 + self.seeds.len()))
    }
}

/// Measures `name`'s footprint, reading each vector file's meta blocks through `pool`, a
/// session's window being `window`.
pub fn measure(pool: &BufferPool, snap: &Snapshot, name: &str, window: &Window) -> Result<Footprint> {
    let ctx = snap.context(name)?;
    let shape = ctx.record().shape;
    let tokens = ctx.token_count();
    let bs = snap.block_size() as u64;
    let heads = u64::from(shape.layers) * u64::from(shape.kv_heads);
    let mut f = Footprint {
        tokens,
        heads,
        kv_bytes: kv_bytes(&shape, tokens),
        window: window_bytes(&shape, tokens, window),
        ..Footprint::default()
    };
    for id in files_of(snap, name)? {
        let file = FileBlocks::locate(snap, id.context, id.layer, id.head)?;
        // Counted as `Db::warm` counts them: every file's, an empty one's too.
        f.maps += file.map_bytes();
        if file.index().is_empty() {
            continue;
        }
        let p = IndexParts::read(pool, &file, &id.name())?;
        let blocks = |n: u32| u64::from(n) * bs;
        f.meta += bs;
        f.graph += blocks(p.layout.adjacency_blocks());
        f.keys += blocks(p.layout.key_blocks());
        f.seeds += p.seeds.len() as u64 * bs;
        for (kind, run) in &p.runs {
            let part = match kind {
                CoarseKind::Quest => &mut f.quest,
                CoarseKind::Infllm => &mut f.infllm,
                CoarseKind::Pq => &mut f.pq,
            };
            *part += run.len() as u64 * bs;
        }
    }
    Ok(f)
}
