use crate::units::{human_bytes, parse_size};
use anyhow::Result;
use ctxfs_vfs::{mkfs, DeviceChoice};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct Args {
    /// A file (created if missing) or a block device.
    store: PathBuf,
    /// Size of the store file, e.g. 64G (required when the file is new or empty).
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Block size in bytes: a power of two from 4096 to 65536.
    #[arg(long, default_value_t = 4096, value_parser = crate::values::block_size)]
    block_size: usize,
    /// Overwrite an existing ctxfs store, or a file or device that holds any other data.
    #[arg(long)]
    force: bool,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    let store = mkfs::format_path(&args.store, args.size, args.block_size, args.force, choice)?;
    let sb = *store.snapshot().superblock();
    let info = store.device_info();
    let bytes = sb.total_blocks * sb.block_size as u64;
    let shortfall = host_shortfall(&args.store, bytes);
    if args.json {
        let v = serde_json::json!({
            "store": args.store, "block_size": sb.block_size, "blocks": sb.total_blocks, "bytes": bytes,
            "generation": sb.generation, "device": info.kind, "device_note": info.note,
            "host_shortfall_bytes": shortfall,
        });
        outln!("{v}")?;
    } else {
        outln!(
            "formatted {}: {} blocks of {} bytes ({}), device {}",
            args.store.display(),
            sb.total_blocks,
            sb.block_size,
            human_bytes(bytes),
            info.kind
        )?;
        if let Some(note) = info.note {
            outln!("note: {note}")?;
        }
        if let Some(short) = shortfall {
            outln!(
                "note: the file system holding {} lacks {} of what the store's blocks need: the store file is \
                 sparse, and writes to it fail once that file system is full",
                args.store.display(),
                human_bytes(short)
            )?;
        }
    }
    Ok(())
}

/// How many more bytes a store file's host file system would need to hold every block of the
/// store's `bytes`, when it has too few (a sparse file takes space only as it is written).
fn host_shortfall(path: &Path, bytes: u64) -> Option<u64> {
    let meta = std::fs::metadata(path).ok().filter(|m| m.is_file())?;
    let unwritten = bytes.saturating_sub(meta.blocks() * 512);
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c_path` is a NUL-terminated path and `st` room for the one struct statvfs fills.
    if unsafe { libc::statvfs(c_path.as_ptr(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    let free = st.f_bavail * st.f_frsize;
    (unwritten > free).then(|| unwritten - free)
}
