use crate::units::{human_bytes, parse_size};
use anyhow::{bail, Context, Result};
use ctxfs_vfs::{device, Access, BlockDevice, DeviceChoice, Store, StoreLock};
use std::os::unix::fs::FileTypeExt;
use std::path::PathBuf;
use std::sync::Arc;

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
    let store = format_store(&args.store, args.size, args.block_size, args.force, choice)?;
    let sb = *store.snapshot().superblock();
    let info = store.device_info();
    let bytes = sb.total_blocks * sb.block_size as u64;
    if args.json {
        let v = serde_json::json!({
            "store": args.store, "block_size": sb.block_size, "blocks": sb.total_blocks, "bytes": bytes,
            "generation": sb.generation, "device": info.kind, "device_note": info.note,
        });
        println!("{v}");
    } else {
        println!(
            "formatted {}: {} blocks of {} bytes ({}), device {}",
            args.store.display(),
            sb.total_blocks,
            sb.block_size,
            human_bytes(bytes),
            info.kind
        );
        if let Some(note) = info.note {
            println!("note: {note}");
        }
    }
    Ok(())
}

/// Formats a file or block device. A file this call created is removed again on failure.
pub fn format_store(
    path: &PathBuf,
    size: Option<u64>,
    block_size: usize,
    force: bool,
    choice: DeviceChoice,
) -> Result<Store> {
    // Checked before the file is created or resized, so a bad value changes nothing.
    device::check_block_size(block_size).map_err(|e| anyhow::anyhow!("--block-size: {e}"))?;
    if device::SpdkPath::parse(path).is_some() {
        return format_spdk(path, size, block_size, force, choice);
    }
    let existed = path.exists();
    if existed {
        let meta = std::fs::metadata(path).with_context(|| format!("cannot stat {}", path.display()))?;
        if !(meta.is_file() || meta.file_type().is_block_device()) {
            bail!("{} is neither a regular file nor a block device", path.display());
        }
        if meta.file_type().is_block_device() && size.is_some() {
            bail!("--size does not apply to a block device: the store takes the whole device");
        }
    }
    let result = (|| -> Result<Store> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        // The writer lock comes before any change: a store another process uses is not resized.
        let lock = StoreLock::acquire(path, Access::Write)?;
        if existed && !force {
            refuse_existing_store(path, choice)?;
        }
        let is_block = file.metadata()?.file_type().is_block_device();
        if !is_block {
            match size {
                Some(size) => {
                    let size = size / block_size as u64 * block_size as u64;
                    file.set_len(size).with_context(|| format!("cannot size {} to {size} bytes", path.display()))?;
                }
                None if file.metadata()?.len() == 0 => {
                    bail!("{} is new or empty: give --size, e.g. --size 64G", path.display())
                }
                None => {}
            }
        }
        drop(file);
        let dev = device::open_path(path, choice, block_size)
            .with_context(|| format!("cannot open {} with O_DIRECT", path.display()))?;
        Ok(ctxfs_vfs::format_locked(Arc::from(dev), lock)?)
    })();
    // A file this run created goes again, unless another mkfs holds it.
    let locked_out = |e: &anyhow::Error| matches!(e.downcast_ref(), Some(ctxfs_vfs::Error::Locked { .. }));
    if result.as_ref().is_err_and(|e| !existed && !locked_out(e)) {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// Formats an SPDK bdev (`spdk:CONFIG.json#BDEV`): there is no file to create or size; like a
/// block device, the store takes the whole bdev.
fn format_spdk(
    path: &std::path::Path,
    size: Option<u64>,
    block_size: usize,
    force: bool,
    choice: DeviceChoice,
) -> Result<Store> {
    // The check opens the bdev on its own; SPDK opens a bdev once per process at a time.
    if !force {
        refuse_existing_store(path, choice)?;
    }
    let dev: Arc<dyn BlockDevice> = Arc::from(
        device::open_path(path, choice, block_size).with_context(|| format!("cannot open {}", path.display()))?,
    );
    let lock = StoreLock::acquire(path, Access::Write)?;
    let bytes = dev.num_blocks() * block_size as u64;
    if let Some(size) = size.filter(|&s| s / block_size as u64 * block_size as u64 != bytes) {
        bail!("--size {size} does not match {} ({bytes} bytes): the store takes the whole bdev", path.display());
    }
    Ok(ctxfs_vfs::format_locked(dev, lock)?)
}

/// Fails when `path` already holds a store: formatting over one takes `--force`.
fn refuse_existing_store(path: &std::path::Path, choice: DeviceChoice) -> Result<()> {
    if let Ok(existing) = Store::open_path_read_only(path, choice) {
        let snap = existing.snapshot();
        bail!(
            "{} already holds a ctxfs store (generation {}, {} contexts); pass --force to overwrite it",
            path.display(),
            snap.generation(),
            snap.contexts().count()
        );
    }
    Ok(())
}
