//! The I/O counters of the block device under a file (Linux's `/sys/dev/block/MAJ:MIN/stat`,
//! Documentation/block/stat.rst): what a run's reads cost the disk after the kernel merged
//! adjacent requests, and how long the disk took to serve them. The counters are the whole
//! device's, so other processes' I/O in the same interval is counted too.

use serde_json::{json, Value};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The counters of a device, read at one instant.
pub struct DiskStat {
    at: Instant,
    /// Read requests completed, after merging.
    reads: u64,
    /// Read requests merged into others before they reached the device.
    read_merges: u64,
    /// Milliseconds the completed reads spent, from issue to completion, summed.
    read_ms: u64,
    /// Milliseconds the device had at least one request in flight.
    busy_ms: u64,
}

pub struct Disk {
    stat: PathBuf,
    name: String,
}

impl Disk {
    /// The device holding `path`, when the kernel exposes its counters (not on overlay or
    /// network file systems, whose device numbers name no block device).
    pub fn of(path: &Path) -> Option<Disk> {
        let dev = std::fs::metadata(path).ok()?.dev();
        let name = format!("{}:{}", libc::major(dev), libc::minor(dev));
        let stat = PathBuf::from(format!("/sys/dev/block/{name}/stat"));
        let disk = Disk { stat, name };
        disk.read().map(|_| disk)
    }

    pub fn read(&self) -> Option<DiskStat> {
        let at = Instant::now();
        let (reads, read_merges, read_ms, busy_ms) = parse(&std::fs::read_to_string(&self.stat).ok()?)?;
        Some(DiskStat { at, reads, read_merges, read_ms, busy_ms })
    }

    /// Reads, merges, mean read latency and busy share from `from` to now, per `per` units
    /// of work (steps).
    pub fn since(&self, from: &DiskStat, per: f64) -> Value {
        let Some(to) = self.read() else { return Value::Null };
        let reads = to.reads.saturating_sub(from.reads);
        let elapsed_ms = to.at.duration_since(from.at).as_secs_f64() * 1e3;
        json!({
            "device": self.name,
            "reads": reads as f64 / per,
            "read_merges": to.read_merges.saturating_sub(from.read_merges) as f64 / per,
            "read_latency_ms": to.read_ms.saturating_sub(from.read_ms) as f64 / reads.max(1) as f64,
            "busy_fraction": to.busy_ms.saturating_sub(from.busy_ms) as f64 / elapsed_ms.max(1e-9),
        })
    }
}

/// (reads, read merges, read milliseconds, busy milliseconds) of a stat file's fields 1, 2,
/// 4 and 10.
fn parse(text: &str) -> Option<(u64, u64, u64, u64)> {
    let f: Vec<u64> = text.split_whitespace().map(str::parse).collect::<Result<_, _>>().ok()?;
    match f[..] {
        [reads, read_merges, _, read_ms, _, _, _, _, _, busy_ms, ..] => Some((reads, read_merges, read_ms, busy_ms)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_stat_line_gives_its_read_counters() {
        // Linux 5.5+ lines carry 17 fields; older ones 11 or 15.
        let line = "  290385   12066 21417846   415473  1203386   909174 64069314  3189740        0  1019692  3691700    0 0 0 0 86932 86487\n";
        assert_eq!(super::parse(line), Some((290385, 12066, 415473, 1019692)));
        assert_eq!(super::parse("1 2 3 4 5 6 7 8 9 10 11"), Some((1, 2, 4, 10)));
        assert_eq!(super::parse("1 2 3"), None);
        assert_eq!(super::parse("1 2 x 4 5 6 7 8 9 10 11"), None);
    }
}
