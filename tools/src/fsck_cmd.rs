use crate::bench::{scratch_pid, SCRATCH_BENCHES};
use crate::units::count;
use ctxfs_attention::{Db, DbConfig};
use ctxfs_vfs::format::Superblock;
use ctxfs_vfs::fsck::{self, Report, EXIT_OPERATIONAL};
use ctxfs_vfs::{device, probe_block_size, Access, BlockDevice, DeviceChoice, Error, StoreLock};
use serde_json::json;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct Args {
    store: PathBuf,
    /// Repair what is safe: free leaked blocks, mark referenced blocks allocated, rebuild the
    /// allocator, rewrite a damaged fallback superblock, fall back to the older state.
    #[arg(long)]
    repair: bool,
    /// With --repair: also drop contexts whose blocks are unreadable.
    #[arg(long, requires = "repair")]
    drop_damaged: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// e2fsck's exit code for a usage or syntax error.
pub const EXIT_USAGE: u8 = 16;

/// Exit codes follow e2fsck: 0 clean, 1 corrected, 4 left uncorrected, 8 operational error,
/// 16 a usage error.
pub fn run(args: Args, choice: DeviceChoice) -> ExitCode {
    match check(&args, choice) {
        Ok(mut report) => {
            check_indexes(&args, choice, &mut report);
            match print(&args, &report) {
                // A reader that stopped reading (`| head`) changes nothing of the verdict.
                Err(crate::OutputLost(e)) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    let repaired = match report.repaired.is_empty() {
                        true => "",
                        false => "; its repairs are committed",
                    };
                    eprintln!(
                        "ctxfs fsck: cannot write the report to standard output: {e} (the check's verdict was exit \
                         code {}{repaired})",
                        report.exit_code()
                    );
                    ExitCode::from(EXIT_OPERATIONAL as u8)
                }
                _ => ExitCode::from(report.exit_code() as u8),
            }
        }
        Err(e) => {
            if args.json {
                let _ = outln!("{}", json!({"exit_code": EXIT_OPERATIONAL, "error": e.to_string()}));
            }
            eprintln!("ctxfs fsck: {e}");
            ExitCode::from(EXIT_OPERATIONAL as u8)
        }
    }
}

/// Adds what the block walk cannot judge: each vector file's index against its context's
/// record (`Db::check_indexes`). Where the store does not open, the walk has said why.
fn check_indexes(args: &Args, choice: DeviceChoice, report: &mut Report) {
    let Ok(block_size) = ctxfs_vfs::probe_block_size(&args.store) else {
        return;
    };
    let config = DbConfig { gpu: false, ..DbConfig::streaming(block_size) };
    if let Ok(db) = Db::open_read_only(&args.store, choice, config) {
        db.check_indexes(report);
        explain_bench_scratch(report);
    }
}

/// `ctxfs bench io`'s and `bench buffer`'s scratch contexts hold test bytes in their index
/// streams, not an index: while their benchmark runs that is no problem, and one that a
/// killed run left is named as such, once, with how to remove it.
fn explain_bench_scratch(report: &mut Report) {
    let mut named = std::collections::BTreeSet::new();
    report.problems.retain_mut(|p| {
        let scratch = |c: &String| SCRATCH_BENCHES.iter().find_map(|&b| Some((b, scratch_pid(c, b)?)));
        let Some((name, (bench, pid))) =
            p.context.clone().filter(|_| p.kind == "index").and_then(|c| Some((c.clone(), scratch(&c)?)))
        else {
            return true;
        };
        if process_alive(pid) || !named.insert(name.clone()) {
            return false;
        }
        p.block = None;
        p.message = format!(
            "the scratch context of a `ctxfs bench {bench}` (process {pid}) that did not finish: its index stream \
             holds test bytes, not an index; `ctxfs delete STORE {name}` or the next `ctxfs bench io` or `bench \
             buffer` on this store removes it"
        );
        true
    });
}

fn process_alive(pid: u32) -> bool {
    // Zero and what is negative as a pid_t name process groups, not a process.
    let Some(pid) = libc::pid_t::try_from(pid).ok().filter(|&p| p > 0) else {
        return false;
    };
    // SAFETY: signal 0 only asks whether the process exists; nothing is delivered.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

fn check(args: &Args, choice: DeviceChoice) -> Result<Report, Error> {
    // With both superblocks damaged the block size is unknown; 4096 (the default) lets
    // fsck still read the device and report what it finds. Without a block magic in either
    // slot the path never held a store, and there is nothing to check.
    let block_size = match probe_block_size(&args.store) {
        Ok(bs) => bs,
        Err(Error::NotAStore(_))
            if Superblock::magic_in(&device::read_prefix(&args.store, 2 * device::MAX_BLOCK_SIZE)?) =>
        {
            4096
        }
        Err(e) => return Err(e),
    };
    // A repair writes: it is the store's one writer. A check reads a pinned state beside one.
    let access = if args.repair { Access::Write } else { Access::Read };
    let lock = StoreLock::acquire(&args.store, access)?;
    let dev: Arc<dyn BlockDevice> = Arc::from(device::open_path(&args.store, choice, block_size, access)?);
    let bar = crate::progress::blocks_bar(0, if args.repair { "fsck --repair" } else { "fsck" });
    let progress = |done: u64, total: u64| {
        bar.set_length(total);
        bar.set_position(done);
    };
    let report = if args.repair {
        fsck::repair_locked(dev, &lock, args.drop_damaged, &progress)
    } else {
        fsck::check_pinned(dev.as_ref(), lock, &progress)
    };
    bar.finish_and_clear();
    report
}

fn print(args: &Args, r: &Report) -> Result<(), crate::OutputLost> {
    if args.json {
        let v = ctxfs_attention::describe::fsck_json(r);
        return outln!("{v}");
    }
    for action in &r.repaired {
        outln!("repaired: {action}")?;
    }
    for p in &r.problems {
        let at = p.block.map(|b| format!("block {b}")).unwrap_or_else(|| "store".into());
        let ctx = p.context.as_ref().map(|c| format!(", context {c:?}")).unwrap_or_default();
        let fix = if p.fix == fsck::Fix::None { String::new() } else { format!(" [repair: {}]", p.fix.name()) };
        outln!("{at}: {} (owner {}{ctx}): {}{fix}", p.kind, p.owner, p.message)?;
    }
    let generation =
        r.active_generation.map(|g| format!("generation {g}")).unwrap_or_else(|| "no usable superblock".into());
    let verdict = match r.exit_code() {
        fsck::EXIT_CLEAN => "clean".to_string(),
        fsck::EXIT_CORRECTED => "errors corrected".to_string(),
        _ => format!("{} left uncorrected", count(r.problems.len() as u64, "problem")),
    };
    let retired = match r.retired_contexts {
        0 => String::new(),
        n => format!(" ({n} retired)"),
    };
    outln!(
        "{}: {generation}, {}{retired}, {} checked: {verdict}",
        args.store.display(),
        count(r.contexts as u64, "context"),
        count(r.blocks_checked, "block")
    )
}
