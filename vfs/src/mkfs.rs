//! Formatting a store at a path: a file (created and sized when new), a block device or an
//! SPDK bdev. Shared by `ctxfs mkfs`, the demo, the benchmarks and the Python package.

use crate::device::{self, BlockDevice, DeviceChoice};
use crate::txn::refuse_readers;
use crate::{format_locked, Access, Error, Result, Store, StoreLock, MIN_STORE_BLOCKS};
use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;

/// An I/O error that names the path and what was being done to it.
fn io_at(what: &str, path: &Path, e: io::Error) -> Error {
    Error::Io(io::Error::new(e.kind(), format!("cannot {what} {}: {e}", path.display())))
}

/// Formats a file or block device (`size` sizes a file, rounded down to whole blocks; a new or
/// empty file needs one). An existing store, or a file or device whose first MiB holds
/// anything, is overwritten only with `force`. A file this call created is removed again on
/// failure.
pub fn format_path(
    path: &Path,
    size: Option<u64>,
    block_size: usize,
    force: bool,
    choice: DeviceChoice,
) -> Result<Store> {
    // Checked before the file is created or resized, so a bad value changes nothing.
    device::check_block_size(block_size).map_err(|e| Error::InvalidArgument(format!("block size: {e}")))?;
    if let Some(blocks) = size.map(|s| s / block_size as u64).filter(|&b| b < MIN_STORE_BLOCKS) {
        return Err(Error::InvalidArgument(format!(
            "a size of {blocks} blocks of {block_size} bytes is too small: a store needs at least {MIN_STORE_BLOCKS} \
             ({} bytes)",
            MIN_STORE_BLOCKS * block_size as u64
        )));
    }
    if device::SpdkPath::parse(path).is_some() {
        return format_spdk(path, size, block_size, force, choice);
    }
    let existed = path.exists();
    if existed {
        let meta = std::fs::metadata(path).map_err(|e| io_at("stat", path, e))?;
        device::refuse_other_file_types(path, &meta).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        if meta.file_type().is_block_device() && size.is_some() {
            return Err(Error::InvalidArgument(
                "a size does not apply to a block device: the store takes the whole device".into(),
            ));
        }
    }
    let result = (|| -> Result<Store> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| io_at("open", path, e))?;
        // The writer lock comes before any change: a store another process uses is not resized.
        let lock = StoreLock::acquire(path, Access::Write)?;
        if existed && !force {
            refuse_existing_store(path, choice)?;
            refuse_existing_data(&file, path)?;
        }
        refuse_readers(&lock, "formatting")?;
        let is_block = file.metadata()?.file_type().is_block_device();
        if !is_block {
            match size {
                Some(size) => {
                    let size = size / block_size as u64 * block_size as u64;
                    file.set_len(size).map_err(|e| {
                        Error::Io(io::Error::new(
                            e.kind(),
                            format!("cannot size {} to {size} bytes: {e}", path.display()),
                        ))
                    })?;
                }
                None if file.metadata()?.len() == 0 => {
                    return Err(Error::InvalidArgument(format!(
                        "{} is new or empty: give --size, e.g. --size 64G (Python: Store.create(path, size=...))",
                        path.display()
                    )))
                }
                None => {}
            }
        }
        drop(file);
        // Its errors name the path.
        let dev = device::open_path(path, choice, block_size, Access::Write)?;
        format_locked(Arc::from(dev), lock)
    })();
    // A file this call created goes again, unless another process formatting it holds it.
    if result.as_ref().is_err_and(|e| !existed && !matches!(e, Error::Locked { .. })) {
        let _ = std::fs::remove_file(path);
    }
    result
}

/// Formats an SPDK bdev (`spdk:CONFIG.json#BDEV`): there is no file to create or size; like a
/// block device, the store takes the whole bdev.
fn format_spdk(path: &Path, size: Option<u64>, block_size: usize, force: bool, choice: DeviceChoice) -> Result<Store> {
    // The check opens the bdev on its own; SPDK opens a bdev once per process at a time.
    if !force {
        refuse_existing_store(path, choice)?;
    }
    let dev: Arc<dyn BlockDevice> =
        Arc::from(device::open_path(path, choice, block_size, Access::Write).map_err(|e| io_at("open", path, e))?);
    let lock = StoreLock::acquire(path, Access::Write)?;
    let bytes = dev.num_blocks() * block_size as u64;
    if let Some(size) = size.filter(|&s| s / block_size as u64 * block_size as u64 != bytes) {
        return Err(Error::InvalidArgument(format!(
            "size {size} does not match {} ({bytes} bytes): the store takes the whole bdev",
            path.display()
        )));
    }
    format_locked(dev, lock)
}

/// Bytes at the start of an existing file or block device that must all be zero for mkfs to
/// format it without `force`: they cover both superblocks at every block size, and the
/// signatures other formats put first.
const PROBE_BYTES: u64 = 1 << 20;

/// Fails when the first [`PROBE_BYTES`] of `file` (not a store that opens) hold anything: it
/// may be a damaged store that `fsck` should see first, or someone's data mistaken for a store.
/// A fresh device or a file just sized by `truncate` reads zeros there.
fn refuse_existing_data(file: &std::fs::File, path: &Path) -> Result<()> {
    use std::io::Read;
    let mut head = Vec::new();
    file.take(PROBE_BYTES).read_to_end(&mut head).map_err(|e| io_at("read", path, e))?;
    match head.iter().position(|&b| b != 0) {
        None => Ok(()),
        Some(at) => Err(Error::InvalidArgument(format!(
            "{} holds data but no ctxfs store that opens (a nonzero byte at offset {at}); run `ctxfs fsck` if it \
             was a store, or pass --force (force=True in Python) to overwrite it",
            path.display()
        ))),
    }
}

/// Fails when `path` already holds a store: formatting over one takes `force`.
fn refuse_existing_store(path: &Path, choice: DeviceChoice) -> Result<()> {
    if let Ok(existing) = Store::open_path_read_only(path, choice) {
        let snap = existing.snapshot();
        return Err(Error::InvalidArgument(format!(
            "{} already holds a ctxfs store (generation {}, {} contexts); pass --force (force=True in Python) to overwrite it",
            path.display(),
            snap.generation(),
            snap.contexts().count()
        )));
    }
    Ok(())
}
