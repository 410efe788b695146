//! Where a context's tokens are stored. A context made by `Db::store` on top of a reused
//! prefix holds only its own tokens and links to its parent (format §9), so a token
//! sequence resolves to a chain of *segments*, one per stored context, oldest first.

use crate::error::{Error, Result};
use ctxfs_buffer::{Blocks, FrameHint, ResidentBlocks};
use ctxfs_vfs::{FileStream, Snapshot, StreamRefs};
use std::sync::OnceLock;

/// Longest parent chain followed; a longer one is treated as corrupt (a cycle).
pub const MAX_CHAIN: usize = 4096;

/// Tokens `base .. base + usable` of a sequence, held by `context` as its own tokens
/// `0 .. usable` (of `own`; fewer are usable when a child reuses only part of them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub context: u32,
    pub base: u32,
    pub usable: u32,
    pub own: u32,
}

impl Segment {
    /// The search filter: `Some(usable)` when only part of the segment's index qualifies.
    pub fn filter(&self) -> Option<u32> {
        (self.usable < self.own).then_some(self.usable)
    }
}

/// The segments holding the first `prefix` tokens of context `id`, oldest first.
pub fn segments(snap: &Snapshot, id: u32, prefix: u32) -> Result<Vec<Segment>> {
    let mut out = Vec::new();
    let mut at = Some(id);
    // Tokens of the sequence still to place: an ancestor contributes only what lies below
    // the point where its child branched off.
    let mut limit = prefix;
    while let Some(cid) = at {
        if out.len() == MAX_CHAIN {
            return Err(Error::Corrupt(format!("context {id}: parent chain longer than {MAX_CHAIN}")));
        }
        let ctx = snap.context_by_id(cid)?;
        let own = u32::try_from(ctx.own_token_count())
            .map_err(|_| Error::Corrupt(format!("context {cid}: {} tokens", ctx.own_token_count())))?;
        let parent = ctx.parent();
        let base = parent.map_or(0, |p| p.prefix_tokens as u32);
        if base < limit {
            out.push(Segment { context: cid, base, usable: own.min(limit - base), own });
        }
        limit = limit.min(base);
        at = parent.map(|p| p.id);
    }
    out.reverse();
    Ok(out)
}

/// One vector file of a token sequence: a segment's context, a layer and a kv head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileId {
    pub context: u32,
    pub layer: u16,
    pub head: u16,
}

impl FileId {
    /// How errors name it.
    pub fn name(&self) -> String {
        format!("context {} layer {} head {}", self.context, self.layer, self.head)
    }
}

/// Every vector file of context `name` and of the prefix it stands on, segment by segment.
pub fn files_of(snap: &Snapshot, name: &str) -> Result<Vec<FileId>> {
    let ctx = snap.context(name)?;
    let shape = ctx.record().shape;
    let mut out = Vec::new();
    for seg in segments(snap, ctx.record().id, ctx.token_count() as u32)? {
        for layer in 0..shape.layers {
            out.extend((0..shape.kv_heads).map(|head| FileId { context: seg.context, layer, head }));
        }
    }
    Ok(out)
}

/// The block locations of one vector file (layer, kv head) of one stored context: its
/// index and data streams' maps, from which each block's request is made when it is read
/// (a request per block kept for as long as the file is served would take 40 bytes; the
/// map, kept by the snapshot anyway, 4 and its runs).
#[derive(Debug)]
pub struct FileBlocks {
    index: StreamRefs,
    data: StreamRefs,
    /// Where each index block was last found in the pool: searches skip the page table.
    pub index_hints: Box<[FrameHint]>,
    /// The index blocks held resident, once the context is warmed ([`crate::Db::warm`]).
    pub resident: OnceLock<ResidentBlocks>,
    /// The blocks a compact context holds instead (meta, seed table, PQ codes): the codes
    /// are read straight from their frames (`compact_pq`), the rest through pins that
    /// always hit.
    pub compact: OnceLock<ResidentBlocks>,
    /// Where `compact` holds the PQ run: (its first index block, that block's place among
    /// the held ones). Scans and refinements read the held codes without pins.
    pub compact_pq: OnceLock<(usize, usize)>,
}

/// [`FileBlocks::map_bytes`] of a file whose streams are `index` and `data`.
pub(crate) fn map_bytes(index: &StreamRefs, data: &StreamRefs) -> u64 {
    let hints = index.len() as usize * std::mem::size_of::<FrameHint>();
    (index.memory_bytes() + data.memory_bytes() + hints) as u64
}

impl FileBlocks {
    pub fn locate(snap: &Snapshot, context: u32, layer: u16, head: u16) -> Result<FileBlocks> {
        let ctx = snap.context_by_id(context)?;
        let all = |which| -> Result<StreamRefs> {
            let refs = ctx.stream(layer, head, which)?.refs();
            // A map read whole covers every block; the last one's place proves it.
            match refs.len().checked_sub(1) {
                Some(last) if refs.locate(last).is_none() => {
                    Err(Error::Corrupt(format!("context {context} layer {layer} head {head}: block {last} unmapped")))
                }
                _ => Ok(refs),
            }
        };
        let index = all(FileStream::Index)?;
        let index_hints = (0..index.len()).map(|_| FrameHint::default()).collect();
        Ok(FileBlocks {
            index,
            data: all(FileStream::Data)?,
            index_hints,
            resident: OnceLock::new(),
            compact: OnceLock::new(),
            compact_pq: OnceLock::new(),
        })
    }

    /// The index stream's blocks.
    pub fn index(&self) -> Blocks<'_> {
        Blocks::of(&self.index)
    }

    /// The data stream's blocks.
    pub fn data(&self) -> Blocks<'_> {
        Blocks::of(&self.data)
    }

    /// Bytes of memory the file's block maps and frame hints take while it is served.
    pub fn map_bytes(&self) -> u64 {
        map_bytes(&self.index, &self.data)
    }
}
