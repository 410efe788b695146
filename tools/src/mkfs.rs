use crate::units::{human_bytes, parse_size};
use anyhow::Result;
use ctxfs_vfs::{mkfs, DeviceChoice};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    /// A file (created if missing) or a block device.
    store: PathBuf,
    /// Size of the store file, e.g. 64G (required when the file is new or empty).
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Block size in bytes: a power of two from 4096 to 65536.
    #[arg(long, default_value_t = 4096)]
    block_size: usize,
    /// Overwrite an existing ctxfs store.
    #[arg(long)]
    force: bool,
    #[arg(long)]
    json: bool,
}

pub fn run(args: Args, choice: DeviceChoice) -> Result<()> {
    let store = mkfs::format_path(&args.store, args.size, args.block_size, args.force, choice)?;
    let sb = *store.snapshot().superblock();
    let info = store.device_info();
    let bytes = sb.total_blocks * sb.block_size as u64;
    if args.json {
        let v = serde_json::json!({
            "store": args.store, "block_size": sb.block_size, "blocks": sb.total_blocks, "bytes": bytes,
            "generation": sb.generation, "device": info.kind, "device_note": info.note,
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
    }
    Ok(())
}
