//! What the benchmarks share: scratch contexts, medians over interleaved rounds, ratios.

use anyhow::Result;
use ctxfs_vfs::Store;

/// The middle value (the upper middle for an even count); 0 for no values.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

pub fn ratio(ours: f64, baseline: f64) -> f64 {
    if baseline > 0.0 {
        ours / baseline
    } else {
        0.0
    }
}

/// A context name no user context has: the benchmark's own scratch data.
pub fn scratch_name(bench: &str) -> String {
    format!("bench-{bench}-{}", std::process::id())
}

/// Deletes a scratch context (if it is there) and commits once more, so the space it held is
/// free for the next round.
pub fn drop_scratch(store: &Store, name: &str) -> Result<()> {
    match store.begin().and_then(|mut t| t.delete_context(name).and_then(|()| t.commit())) {
        Ok(_) | Err(ctxfs_vfs::Error::NoSuchContext(_)) => {}
        Err(e) => return Err(e.into()),
    }
    store.begin()?.commit()?;
    Ok(())
}

/// Makes room for `blocks` blocks, committing once if freed space is waiting for it.
pub fn ensure_free(store: &Store, blocks: u64) -> Result<()> {
    let space = store.space();
    if space.free < blocks && space.free + space.reclaimable >= blocks {
        store.begin()?.commit()?;
    }
    let free = store.space().free;
    anyhow::ensure!(free >= blocks, "the store has {free} free blocks; the benchmark needs {blocks} (make it smaller)");
    Ok(())
}
