//! A store and an fsck report as JSON: what `ctxfs inspect --json` and `ctxfs fsck --json`
//! print and what the Python package returns as dicts, built in one place.

use ctxfs_buffer::{ClassStats, PoolStats};
use ctxfs_vfs::format::records::StreamRoot;
use ctxfs_vfs::fsck::Report;
use ctxfs_vfs::{ContextRecord, Store};
use serde_json::{json, Value};

fn stream_json(s: &StreamRoot) -> Value {
    json!({"blocks": s.blocks, "bytes": s.bytes, "extent_blocks": s.extents.len()})
}

/// A context's blocks (data and extent blocks of every stream) and payload bytes. Summed
/// saturating: the counts are the record's, which inspection prints without loading the maps
/// that would check them.
pub fn context_blocks(c: &ContextRecord) -> (u64, u64) {
    let streams = std::iter::once(&c.tokens).chain(c.files.iter().flat_map(|f| [&f.index, &f.data]));
    streams.fold((0u64, 0u64), |(b, n), s| {
        (b.saturating_add(s.blocks).saturating_add(s.extents.len() as u64), n.saturating_add(s.bytes))
    })
}

/// Lower-case hex of a byte string (store ids).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// One committed context: name, shape, tokens, parent, blocks and its vector files.
pub fn context_json(c: &ContextRecord) -> Value {
    let (blocks, bytes) = context_blocks(c);
    let kv = c.shape.kv_heads as usize;
    json!({
        "name": c.name, "id": c.id,
        "shape": {"layers": c.shape.layers, "q_heads": c.shape.q_heads, "kv_heads": c.shape.kv_heads, "head_dim": c.shape.head_dim, "dtype": c.shape.dtype.name()},
        "tokens": c.token_count(), "own_tokens": c.own_token_count(),
        "parent": c.parent.map(|p| json!({"id": p.id, "prefix_tokens": p.prefix_tokens})),
        "blocks": blocks, "bytes": bytes, "created_unix_ms": c.created_unix_ms,
        "files": c.files.iter().enumerate().map(|(i, f)| json!({
            "layer": i / kv, "head": i % kv, "index": stream_json(&f.index), "data": stream_json(&f.data),
        })).collect::<Vec<_>>(),
    })
}

/// The store's committed state: format, superblock slots, device, space and contexts.
pub fn store_json(store: &Store) -> Value {
    let snap = store.snapshot();
    let sb = *snap.superblock();
    let info = store.device_info();
    let space = store.space();
    let bs = sb.block_size as u64;
    let slots: Vec<Value> = store
        .slots()
        .iter()
        .map(|s| match &s.result {
            Ok(sb) => json!({"slot": s.slot, "valid": true, "generation": sb.generation}),
            Err(e) => json!({"slot": s.slot, "valid": false, "error": e}),
        })
        .collect();
    json!({
        "format_version": sb.format_version,
        "retired_contexts": snap.retired_contexts().map(|c| json!({"id": c.id, "name": c.name, "blocks": context_blocks(c).0})).collect::<Vec<_>>(),
        "superblock": {
            "generation": sb.generation, "slot": sb.slot(), "block_size": sb.block_size, "blocks": sb.total_blocks,
            "store_id": hex(&sb.store_id), "commit_unix_ms": sb.commit_unix_ms, "next_context_id": sb.next_context_id,
        },
        "slots": slots,
        "device": {"kind": info.kind, "path": info.path, "queue_depth": info.queue_depth, "note": info.note},
        "space": {"blocks": sb.total_blocks, "used_blocks": space.used, "free_blocks": space.free, "free_bytes": space.free * bs, "used_bytes": space.used * bs, "reclaimable_blocks": space.reclaimable},
        "contexts": snap.contexts().map(context_json).collect::<Vec<_>>(),
        "damaged_contexts": snap.damaged_contexts().map(|d| json!({"id": d.entry.id, "name": d.entry.name, "block": d.block, "error": d.why})).collect::<Vec<_>>(),
    })
}

/// An fsck report; `exit_code` has `ctxfs fsck`'s meaning (0 clean, 1 corrected, 4 left
/// uncorrected).
pub fn fsck_json(r: &Report) -> Value {
    let problems: Vec<_> = r
        .problems
        .iter()
        .map(|p| json!({"block": p.block, "kind": p.kind, "owner": p.owner, "context": p.context, "message": p.message, "fix": p.fix.name()}))
        .collect();
    json!({
        "clean": r.is_clean(), "exit_code": r.exit_code(), "generation": r.active_generation,
        "fallback_generation": r.fallback_generation, "contexts": r.contexts, "retired_contexts": r.retired_contexts, "blocks_checked": r.blocks_checked,
        "problems": problems, "repaired": r.repaired,
    })
}

/// A buffer pool's statistics, per block class.
pub fn pool_json(s: &PoolStats) -> Value {
    let class = |c: &ClassStats| {
        json!({
            "hits": c.hits, "misses": c.misses, "first_reads": c.first_reads, "hit_ratio": c.hit_ratio(), "bytes_read": c.bytes_read,
            "evictions": c.evictions, "resident_frames": c.resident_frames, "capacity_frames": c.capacity_frames,
            "resident_pins": c.resident_pins,
        })
    };
    json!({
        "budget_bytes": s.budget_bytes, "data_fraction": s.data_fraction, "block_size": s.block_size,
        "allocated_bytes": s.allocated_bytes, "overhead_bytes": s.overhead_bytes,
        "index": class(&s.index), "data": class(&s.data),
    })
}
