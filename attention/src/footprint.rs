//! What serving a context keeps resident, part by part, against the size of its KV cache:
//! the measure of `DbConfig::resident_budget`.
//!
//! A served context holds its index streams in the pool's index area (`Db::warm`); each
//! block costs one frame of the device's block size. The KV bytes are what a server that
//! kept the cache in memory would hold: keys and values of every token, layer and kv head,
//! in the context's element type.

use crate::error::{Error, Result};
use crate::layout::{segments, FileBlocks};
use ctxfs_buffer::BufferPool;
use ctxfs_index::paged::Layout;
use ctxfs_vfs::Snapshot;
use serde_json::{json, Value};

/// A context's resident index by part, and its KV bytes. Parts are in bytes of pool frames.
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
    /// Quest, InfLLM and PQ runs.
    pub coarse: u64,
}

impl Footprint {
    pub fn resident_bytes(&self) -> u64 {
        self.meta + self.graph + self.keys + self.seeds + self.coarse
    }

    /// Resident bytes per KV byte.
    pub fn ratio(&self) -> f64 {
        ratio(self.resident_bytes(), self.kv_bytes)
    }

    /// `bytes` per token of one (layer, kv head): the unit of the budget's arithmetic (64 at
    /// d = 128 in f16 is an eighth of the KV).
    pub fn per_token_and_head(&self, bytes: u64) -> f64 {
        bytes as f64 / (self.tokens * self.heads).max(1) as f64
    }

    pub fn to_json(&self) -> Value {
        json!({
            "tokens": self.tokens, "heads": self.heads, "kv_bytes": self.kv_bytes, "resident_bytes": self.resident_bytes(),
            "resident_over_kv": self.ratio(),
            "parts": {"meta": self.meta, "graph": self.graph, "keys": self.keys, "seeds": self.seeds, "coarse": self.coarse},
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

/// The KV bytes of `name` (all its tokens) and the index blocks serving it would hold, with
/// no block read.
pub(crate) fn planned(snap: &Snapshot, name: &str) -> Result<(u64, u64)> {
    let ctx = snap.context(name)?;
    let shape = ctx.record().shape;
    let tokens = ctx.token_count();
    let mut blocks = 0u64;
    for seg in segments(snap, ctx.record().id, tokens as u32)? {
        let seg_ctx = snap.context_by_id(seg.context)?;
        for layer in 0..shape.layers {
            for head in 0..shape.kv_heads {
                blocks += seg_ctx.stream(layer, head, ctxfs_vfs::FileStream::Index)?.blocks();
            }
        }
    }
    Ok((kv_bytes(&shape, tokens), blocks * snap.block_size() as u64))
}

fn kv_bytes(shape: &ctxfs_vfs::ModelShape, tokens: u64) -> u64 {
    let per_token = 2 * shape.layers as u64 * shape.kv_heads as u64 * shape.head_dim as u64 * shape.dtype.size() as u64;
    tokens * per_token
}

/// Measures `name`'s footprint, reading each vector file's index meta block through `pool`.
pub fn measure(pool: &BufferPool, snap: &Snapshot, name: &str) -> Result<Footprint> {
    let ctx = snap.context(name)?;
    let shape = ctx.record().shape;
    let tokens = ctx.token_count();
    let bs = snap.block_size() as u64;
    let heads = u64::from(shape.layers) * u64::from(shape.kv_heads);
    let mut f = Footprint { tokens, heads, kv_bytes: kv_bytes(&shape, tokens), ..Footprint::default() };
    for seg in segments(snap, ctx.record().id, tokens as u32)? {
        for layer in 0..shape.layers {
            for head in 0..shape.kv_heads {
                let file = FileBlocks::locate(snap, seg.context, layer, head)?;
                let Some(first) = file.index.first() else { continue };
                let meta = pool.get(first)?;
                let layout = Layout::decode(meta.payload()).map_err(|e| {
                    Error::Corrupt(format!("context {} layer {layer} head {head}: index meta block: {e}", seg.context))
                })?;
                f.meta += bs;
                f.graph += u64::from(layout.adjacency_blocks()) * bs;
                f.keys += u64::from(layout.key_blocks()) * bs;
                f.seeds += u64::from(layout.seed_blocks() + layout.seed_value_blocks()) * bs;
                // The coarse runs follow the graph index's blocks.
                f.coarse += (file.index.len() as u64).saturating_sub(u64::from(layout.index_blocks())) * bs;
            }
        }
    }
    Ok(f)
}
