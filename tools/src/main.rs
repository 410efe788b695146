//! The `ctxfs` command: make, inspect and check stores (`mkfs`, `inspect`, `fsck`), bring
//! contexts in and answer attention over them (`gen`, `import`, `query`), and the demo and
//! benchmarks (`demo`, `bench`). README.md has a tour; `docs/cli.md` every option, and
//! `docs/architecture.md` how the crates under this one fit together.

/// `print!` to standard output that returns the write's error, as [`OutputLost`], where
/// `print!` panics: a closed pipe reaches `main` as an error, which exits quietly (the reader
/// stopped reading).
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        write!(std::io::stdout(), $($arg)*).map_err($crate::OutputLost)
    }};
}

/// `println!` as [`out!`] is `print!`.
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout(), $($arg)*).map_err($crate::OutputLost)
    }};
}

/// A write to standard output that failed: what the command did is done; its report is lost.
#[derive(Debug, thiserror::Error)]
#[error("cannot write to standard output: {0}")]
pub struct OutputLost(#[source] std::io::Error);

mod bench;
mod bench_buffer;
mod bench_codes;
mod bench_decode;
mod bench_gpu;
mod bench_gpu_knn;
mod bench_gpu_pq;
mod bench_io;
mod bench_search;
mod decode_queries;
mod delete;
mod demo;
mod disk_stat;
mod fsck_cmd;
mod gen;
mod import;
mod inspect;
mod mkfs;
mod progress;
mod query;
mod raw_uring;
mod scratch_files;
mod st_write;
mod units;
mod values;

use clap::{Parser, Subcommand};
use ctxfs_vfs::DeviceChoice;

use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "ctxfs", version, about = "A persistent vector file system for the KV caches of long LLM prompts")]
struct Cli {
    /// Block device implementation: auto (io_uring, falling back to pread/pwrite when the
    /// kernel refuses io_uring), uring, or file. Defaults to $CTXFS_DEVICE or auto.
    #[arg(long, global = true)]
    device: Option<DeviceChoice>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create an empty store on a file (created if missing) or a block device.
    Mkfs(mkfs::Args),
    /// Show a store: superblocks, device, space, contexts and vector files.
    Inspect(inspect::Args),
    /// Check every block and structure; optionally repair what is safe to repair.
    Fsck(fsck_cmd::Args),
    /// Measure the store against raw O_DIRECT io_uring loops.
    Bench {
        #[command(subcommand)]
        which: BenchCommand,
    },
    /// Run the end-to-end demonstration on an embedded default store.
    Demo(demo::Args),
    /// Generate a synthetic context (KV cache, prefill queries, token ids) and decode queries
    /// that look like real attention; print the statistics achieved.
    Gen(gen::Args),
    /// Import a safetensors context (KV cache, prefill queries, token ids) and index it.
    Import(import::Args),
    /// Attention for each (layer, q head, query) of a query file over a stored context.
    Query(query::Args),
    /// Delete a context by name.
    Delete(delete::Args),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Sequential write, sequential read and 4 KiB random read (queue depth 32) through the
    /// store, side by side with a raw io_uring loop over a scratch file beside it.
    Io(bench_io::Args),
    /// Cold 4 KiB random block reads through the buffer manager against a raw io_uring loop
    /// over the same blocks of the same file, and hot hits per second per thread.
    Buffer(bench_buffer::Args),
    /// Every search method side by side on generated attention at equal windows.
    Search(bench_search::Args),
    /// A GQA group's best tokens from a compact context's PQ codes on one core: from every
    /// score against only the tokens reaching a cut from the run's sample codes.
    Codes(bench_codes::Args),
    /// Decode steps of a Llama-3-8B-shaped 128K-token context on disk, against exact
    /// attention over the same store and against loading the full KV, then attending.
    Decode(bench_decode::Args),
    /// Window attention and the merge on the GPU, against the memory bandwidth and torch SDPA.
    Gpu(bench_gpu::Args),
}

fn main() -> ExitCode {
    // A write past the file size limit (`ulimit -f`) then fails as an error the command
    // reports and cleans up after, where the signal would kill it without a word.
    // SAFETY: sets a signal's disposition to "ignore"; no handler runs, no memory is shared.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // fsck's exit codes follow e2fsck's, where a usage error is 16 (clap's is 2, which
            // there means "corrected, reboot").
            if subcommand().as_deref() == Some("fsck") && e.use_stderr() {
                let _ = e.print();
                // fsck prints an error object with --json, whatever the error.
                if std::env::args().any(|a| a == "--json") {
                    // clap's message up to its usage line, on one line.
                    let text = e.render().to_string();
                    let message = text.split("\n\n").next().unwrap_or_default().trim_start_matches("error: ");
                    let error = message.split_whitespace().collect::<Vec<_>>().join(" ");
                    println!("{}", serde_json::json!({"exit_code": fsck_cmd::EXIT_USAGE, "error": error}));
                }
                return ExitCode::from(fsck_cmd::EXIT_USAGE);
            }
            e.exit();
        }
    };
    // Only commands that open a store read the device choice: a bad CTXFS_DEVICE fails them.
    let opens_no_store = matches!(
        cli.command,
        Command::Gen(_) | Command::Bench { which: BenchCommand::Search(_) | BenchCommand::Gpu(_) }
    );
    let device = match cli.device.map(Ok).unwrap_or_else(DeviceChoice::from_env) {
        Ok(d) => d,
        Err(_) if opens_no_store => DeviceChoice::Auto,
        Err(e) => {
            eprintln!("ctxfs: {e}");
            return ExitCode::from(2);
        }
    };
    let changes_store = matches!(cli.command, Command::Mkfs(_) | Command::Import(_) | Command::Delete(_));
    let result = match cli.command {
        Command::Mkfs(args) => mkfs::run(args, device),
        Command::Inspect(args) => inspect::run(args, device),
        Command::Fsck(args) => return fsck_cmd::run(args, device),
        Command::Bench { which: BenchCommand::Io(args) } => bench_io::run(args, device),
        Command::Bench { which: BenchCommand::Buffer(args) } => bench_buffer::run(args, device),
        Command::Bench { which: BenchCommand::Search(args) } => bench_search::run(args),
        Command::Bench { which: BenchCommand::Codes(args) } => bench_codes::run(args, device),
        Command::Bench { which: BenchCommand::Decode(args) } => bench_decode::run(args, device),
        Command::Bench { which: BenchCommand::Gpu(args) } => bench_gpu::run(args),
        Command::Demo(args) => demo::run(args, device),
        Command::Gen(args) => gen::run(args),
        Command::Import(args) => import::run(args, device),
        Command::Delete(args) => delete::run(args, device),
        Command::Query(args) => query::run(args, device),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // A reader that stopped reading (`| head`) is not a failure.
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            let committed = match e.chain().any(|c| c.is::<OutputLost>()) && changes_store {
                true => " (the command's change to the store is committed; only its report is lost)",
                false => "",
            };
            eprintln!("ctxfs: {}{committed}", message(&e));
            // An interrupt the command cleaned up after exits as the signal would have.
            match e.chain().find_map(|c| c.downcast_ref::<scratch_files::Interrupted>()) {
                Some(scratch_files::Interrupted(signal)) => ExitCode::from((128 + signal) as u8),
                None => ExitCode::FAILURE,
            }
        }
    }
}

/// The first argument that is neither an option nor `--device`'s value: the subcommand.
fn subcommand() -> Option<String> {
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--device" => {
                args.next();
            }
            a if a.starts_with('-') => {}
            _ => return Some(a),
        }
    }
    None
}

/// The error and its causes, `: `-joined, leaving out a cause whose text the message already
/// ends with (an error that prints its source, as `I/O error: {0}` does, and also names it as
/// its source would otherwise print it twice).
fn message(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let part = cause.to_string();
        if text.is_empty() {
            text = part;
        } else if !text.ends_with(&part) {
            text = format!("{text}: {part}");
        }
    }
    text
}
