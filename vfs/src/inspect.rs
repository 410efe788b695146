//! What a committed state consists of, block by block, for `inspect` and for tests that
//! damage live blocks on purpose.

use crate::error::Result;
use crate::format::{BlockKind, Owner, StreamTag, SUPERBLOCK_SLOTS};
use crate::store::{load_bitmap, Snapshot};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveBlock {
    pub block: u64,
    pub kind: BlockKind,
    pub stream: StreamTag,
    pub owner: Owner,
}

/// Every block the snapshot's state references, plus both superblock slots, by block number.
pub fn live_blocks(snap: &Snapshot) -> Result<Vec<LiveBlock>> {
    let dev = snap.dev.as_ref();
    let meta = |block, kind, owner| LiveBlock { block, kind, stream: StreamTag::Meta, owner };
    let mut out: Vec<LiveBlock> =
        (0..SUPERBLOCK_SLOTS).map(|b| meta(b, BlockKind::Superblock, Owner::SYSTEM)).collect();
    out.extend(snap.catalog_blocks.iter().map(|&b| meta(b, BlockKind::Catalog, Owner::SYSTEM)));
    let (_, chunks, dir) = load_bitmap(dev, &snap.superblock)?;
    out.extend(dir.iter().chain(chunks.iter().map(|c| &c.block)).map(|&b| meta(b, BlockKind::Alloc, Owner::SYSTEM)));
    for ctx in snap.contexts.values().chain(snap.retired.values()) {
        let owner = Owner::context(ctx.record.id);
        out.extend(ctx.record_blocks.iter().map(|&b| meta(b, BlockKind::Catalog, owner)));
        for s in ctx.streams() {
            let map = s.map(dev, snap.generation())?;
            let live = |block, kind| LiveBlock { block, kind, stream: s.id.tag, owner: s.id.owner };
            out.extend(s.root.extents.iter().map(|r| live(r.block, BlockKind::Extent)));
            out.extend(map.device_blocks().map(|b| live(b, s.id.kind())));
        }
    }
    out.sort_by_key(|b| b.block);
    Ok(out)
}
