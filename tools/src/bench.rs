//! What the benchmarks share: scratch contexts, medians over interleaved rounds, ratios.

use anyhow::Result;
use ctxfs_attention::{AttentionOptions, Plan};
use ctxfs_vfs::Store;

/// The middle value (the upper middle for an even count); 0 for no values.
pub fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// The median of `runs` timed calls of `f`, in seconds (what `f` returns is dropped inside
/// the timing).
pub fn timed_median<T>(runs: usize, f: &dyn Fn() -> anyhow::Result<T>) -> anyhow::Result<f64> {
    let times = (0..runs)
        .map(|_| {
            let t = std::time::Instant::now();
            drop(f()?);
            Ok(t.elapsed().as_secs_f64())
        })
        .collect::<anyhow::Result<Vec<f64>>>()?;
    Ok(median(times))
}

/// The exact DIPR set a benchmark measures DIPR recall against: the flat plan at AlayaDB's
/// β = √d·ln 100, whatever range the plans under test search (`AttentionOptions::beta`).
pub fn exact_dipr_reference(head_dim: usize, options: &AttentionOptions) -> AttentionOptions {
    let beta = (head_dim as f32).sqrt() * 100f32.ln();
    AttentionOptions { plan: Some(Plan::Flat), beta: Some(beta), ..options.clone() }
}

pub fn ratio(ours: f64, baseline: f64) -> f64 {
    if baseline > 0.0 {
        ours / baseline
    } else {
        0.0
    }
}

/// The process's peak resident memory since it started or [`reset_peak_rss`] (Linux
/// `VmHWM`); `None` where the kernel does not say.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib = status.lines().find_map(|l| l.strip_prefix("VmHWM:"))?.trim().trim_end_matches("kB").trim();
    kib.parse::<u64>().ok().map(|k| k << 10)
}

/// CPU time the process has used, all its threads together, in seconds.
pub fn process_cpu_seconds() -> f64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid, writable timespec; CLOCK_PROCESS_CPUTIME_ID is supported on
    // every Linux this runs on, and a failure leaves `t` at zero (returned as such).
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Starts [`peak_rss_bytes`] over from the current resident memory (Linux: `5` written to
/// `/proc/self/clear_refs`), so that a phase's peak is its own.
pub fn reset_peak_rss() {
    // Where the kernel refuses, the peak stays the process's: an upper bound still.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// A context name no user context has: the benchmark's own scratch data.
pub fn scratch_name(bench: &str) -> String {
    format!("{SCRATCH_PREFIX}{bench}-{}", std::process::id())
}

const SCRATCH_PREFIX: &str = "bench-";

/// The benchmarks that write a scratch context ([`scratch_name`]).
pub const SCRATCH_BENCHES: [&str; 2] = ["io", "buffer"];

/// The process that made `name`, when it is the scratch context of `bench` ([`scratch_name`]).
pub fn scratch_pid(name: &str, bench: &str) -> Option<u32> {
    let pid = name.strip_prefix(SCRATCH_PREFIX)?.strip_prefix(bench)?.strip_prefix('-')?;
    pid.bytes().all(|b| b.is_ascii_digit()).then(|| pid.parse().ok()).flatten()
}

/// Deletes the scratch contexts (`bench-io-PID`, `bench-buffer-PID`) a killed benchmark left
/// behind. Only a store's one writer runs a benchmark, so none of them is in use. Returns
/// their names.
pub fn sweep_scratch(store: &Store) -> Result<Vec<String>> {
    let is_scratch = |name: &str| SCRATCH_BENCHES.iter().any(|bench| scratch_pid(name, bench).is_some());
    let stale: Vec<String> = store.snapshot().contexts().map(|c| c.name.clone()).filter(|n| is_scratch(n)).collect();
    for name in &stale {
        drop_scratch(store, name)?;
    }
    Ok(stale)
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
    let free = match space.free < blocks && space.free + space.reclaimable >= blocks {
        true => store.reclaim()?,
        false => space.free,
    };
    anyhow::ensure!(free >= blocks, "the store has {free} free blocks; the benchmark needs {blocks} (make it smaller)");
    Ok(())
}

/// A buffer pool for serving a store: every index block resident, plus a data-block cache of
/// a share of the data blocks, its memory mapped when the DB opens (what `demo` and `bench
/// decode` serve with).
pub struct Serving {
    pub config: ctxfs_attention::DbConfig,
    pub index_bytes: u64,
    pub cache_bytes: u64,
}

impl Serving {
    /// A pool holding every index block and a data cache of `data_share` of the data blocks.
    pub fn size(path: &std::path::Path, choice: ctxfs_vfs::DeviceChoice, data_share: f64) -> Result<Serving> {
        let (index_bytes, data_bytes) = stream_bytes(path, choice)?;
        Ok(Serving::of(index_bytes, (data_bytes as f64 * data_share) as u64, None))
    }

    /// A pool for a context served compact under `budget` (per KV byte of its `kv_bytes`):
    /// the budget's bytes held, then a cache of `data_share` of the index and data streams'
    /// bytes, half for key blocks (the keys its candidates read, in the index area) and
    /// half for value blocks. A key block and its value block are read together (they lie
    /// side by side on the device), so each cache holds as many of them: a value evicted
    /// before its key would cost a read of its own.
    pub fn compact(
        path: &std::path::Path,
        choice: ctxfs_vfs::DeviceChoice,
        data_share: f64,
        budget: f64,
        kv_bytes: u64,
    ) -> Result<Serving> {
        let (index_bytes, data_bytes) = stream_bytes(path, choice)?;
        let half = ((index_bytes + data_bytes) as f64 * data_share / 2.0) as u64;
        Ok(Serving::of((budget * kv_bytes as f64) as u64 + half, half, Some(budget)))
    }

    /// A serving pool of `index_bytes` for index blocks and `cache_bytes` for data blocks.
    fn of(index_bytes: u64, cache_bytes: u64, resident_budget: Option<f64>) -> Serving {
        // Slack beyond the index for the pool's own rounding, and a floor for the data area.
        let pool_bytes = index_bytes + cache_bytes + (8 << 20);
        let data_fraction = (cache_bytes + (4 << 20)) as f64 / pool_bytes as f64;
        let config = ctxfs_attention::DbConfig {
            pool_bytes,
            data_fraction,
            populate_pool: true,
            resident_budget,
            ..Default::default()
        };
        Serving { config, index_bytes, cache_bytes }
    }
}

/// Bytes of the index streams and of the data streams of every stored context.
fn stream_bytes(path: &std::path::Path, choice: ctxfs_vfs::DeviceChoice) -> Result<(u64, u64)> {
    let store = ctxfs_vfs::Store::open_path_read_only(path, choice)?;
    let bs = store.device().block_size() as u64;
    let snap = store.snapshot();
    let (mut index, mut data) = (0, 0);
    for rec in snap.contexts() {
        let ctx = snap.context(&rec.name)?;
        for l in 0..rec.shape.layers {
            for h in 0..rec.shape.kv_heads {
                index += ctx.stream(l, h, ctxfs_vfs::FileStream::Index)?.blocks() * bs;
                data += ctx.stream(l, h, ctxfs_vfs::FileStream::Data)?.blocks() * bs;
            }
        }
    }
    Ok((index, data))
}
