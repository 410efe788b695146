//! Block devices: one trait, three implementations (io_uring, pread/pwrite, in-memory with
//! fault injection), and a fourth with the `spdk` feature (an SPDK bdev, for store paths
//! `spdk:CONFIG.json#BDEV`). Everything above this module sees only [`BlockDevice`].

mod aligned;
mod file;
mod mem;
#[cfg(feature = "spdk")]
mod spdk;
mod spdk_config;
#[cfg(feature = "spdk")]
mod spdk_ffi;
mod uring;

pub use aligned::{AlignedBuf, PAGE};
pub use file::FileDevice;
pub use mem::{CrashMode, FaultPlan, MemDevice};
#[cfg(feature = "spdk")]
pub use spdk::SpdkDevice;
pub use spdk_config::SpdkPath;
pub use uring::UringDevice;

use crate::lock::Access;
use std::fs::{File, OpenOptions};
use std::io::{self, Seek, SeekFrom};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// Smallest and largest block sizes a store may use. Blocks are whole pages so that every
/// buffer is O_DIRECT-safe on 4Kn devices.
pub const MIN_BLOCK_SIZE: usize = PAGE;
pub const MAX_BLOCK_SIZE: usize = 64 * 1024;

/// Whether a store may use `block_size`: a power of two from [`MIN_BLOCK_SIZE`] to
/// [`MAX_BLOCK_SIZE`], so every block is whole O_DIRECT-safe pages and slot 1 can be found.
pub fn check_block_size(block_size: usize) -> Result<(), String> {
    if (MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&block_size) && block_size.is_power_of_two() {
        Ok(())
    } else {
        Err(format!("block size {block_size} must be a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE}"))
    }
}

/// One operation of a batch. A buffer may cover several consecutive blocks (coalesced I/O);
/// its length is a multiple of the block size and its address is page aligned.
pub enum IoOp<'a> {
    Read { block: u64, buf: &'a mut [u8] },
    Write { block: u64, buf: &'a [u8] },
}

impl IoOp<'_> {
    pub fn block(&self) -> u64 {
        match self {
            IoOp::Read { block, .. } | IoOp::Write { block, .. } => *block,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            IoOp::Read { buf, .. } => buf.len(),
            IoOp::Write { buf, .. } => buf.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn addr(&self) -> usize {
        match self {
            IoOp::Read { buf, .. } => buf.as_ptr() as usize,
            IoOp::Write { buf, .. } => buf.as_ptr() as usize,
        }
    }
}

/// Which implementation backs a store, and why, for `inspect`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub kind: &'static str,
    pub path: String,
    /// Why this device was chosen when it was not the one asked for.
    pub note: Option<String>,
    pub queue_depth: u32,
}

/// A device's fixed shape: its block size and how many blocks it has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub block_size: usize,
    pub num_blocks: u64,
}

impl Geometry {
    /// The geometry of an open file or block device.
    fn of(file: &File, block_size: usize) -> io::Result<Geometry> {
        Ok(Geometry { block_size, num_blocks: byte_len(file)? / block_size as u64 })
    }
}

pub trait BlockDevice: Send + Sync {
    fn geometry(&self) -> Geometry;
    fn block_size(&self) -> usize {
        self.geometry().block_size
    }
    fn num_blocks(&self) -> u64 {
        self.geometry().num_blocks
    }
    fn info(&self) -> DeviceInfo;
    /// Runs every operation of the batch and returns one result per operation, in order.
    /// Operations of one batch may complete in any order; callers never put a read and a
    /// write of the same block in one batch.
    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<io::Result<()>>;
    /// Makes every completed write durable.
    fn flush(&self) -> io::Result<()>;
}

/// Rejects an operation that is out of range or not O_DIRECT-safe, before it reaches a device.
pub(crate) fn check_op(op: &IoOp<'_>, geo: Geometry) -> io::Result<()> {
    let Geometry { block_size, num_blocks } = geo;
    let len = op.len();
    if len == 0 || !len.is_multiple_of(block_size) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("I/O length {len} is not a positive multiple of the block size {block_size}"),
        ));
    }
    if !op.addr().is_multiple_of(PAGE) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "I/O buffer is not page aligned"));
    }
    let blocks = (len / block_size) as u64;
    if op.block().checked_add(blocks).is_none_or(|end| end > num_blocks) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("blocks {}..{} lie beyond the device end ({num_blocks} blocks)", op.block(), op.block() + blocks),
        ));
    }
    Ok(())
}

/// Which device to open a store path with. A store path `spdk:CONFIG.json#BDEV` always opens
/// an SPDK bdev (with the `spdk` feature), whatever the choice.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// io_uring, falling back to pread/pwrite when ring setup is refused.
    #[default]
    Auto,
    Uring,
    File,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "uring" => Ok(DeviceChoice::Uring),
            "file" => Ok(DeviceChoice::File),
            _ => Err(format!("unknown device {s:?} (expected auto, uring or file)")),
        }
    }
}

impl DeviceChoice {
    /// `CTXFS_DEVICE=auto|uring|file` overrides the default, so that the whole test suite
    /// and the CLI can be run on either real device.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var("CTXFS_DEVICE") {
            Ok(v) if !v.is_empty() => v.parse().map_err(|e| format!("CTXFS_DEVICE: {e}")),
            _ => Ok(DeviceChoice::Auto),
        }
    }
}

/// Opens `path` (a regular file or a block device) with O_DIRECT; for writing too with
/// [`Access::Write`] (a reader needs no write permission: a read-only file, mount or another
/// user's store serves it).
pub(crate) fn open_direct(path: &Path, access: Access) -> io::Result<File> {
    // Checked before the open, which would wait forever on a pipe for a writer.
    if let Ok(meta) = std::fs::metadata(path) {
        refuse_other_file_types(path, &meta)?;
    }
    let file = OpenOptions::new().read(true).write(access == Access::Write).custom_flags(libc::O_DIRECT).open(path);
    match file {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => Err(io::Error::new(
            io::ErrorKind::Unsupported,
            format!("{}: the file system does not support O_DIRECT", path.display()),
        )),
        Err(e) => {
            let what = match access {
                Access::Write => "reading and writing",
                Access::Read => "reading",
            };
            Err(io::Error::new(e.kind(), format!("{}: cannot open for {what}: {e}", path.display())))
        }
        ok => ok,
    }
}

/// Fails unless `meta` is a regular file's or a block device's: a store lives on nothing else.
pub(crate) fn refuse_other_file_types(path: &Path, meta: &std::fs::Metadata) -> io::Result<()> {
    if meta.is_file() || meta.file_type().is_block_device() {
        return Ok(());
    }
    Err(io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("{} is neither a regular file nor a block device", path.display()),
    ))
}

/// Makes a file device's completed writes durable ([`BlockDevice::flush`]), and fails when
/// its file is now shorter than the store: cut by another process while open, it lost the
/// blocks beyond its end, and a commit must not point at them.
pub(crate) fn sync_whole(file: &File, geo: Geometry, path: &str) -> io::Result<()> {
    file.sync_data()?;
    let meta = file.metadata()?;
    let bytes = geo.num_blocks * geo.block_size as u64;
    if meta.is_file() && meta.len() < bytes {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{path} was cut to {} bytes while open, but the store holds {bytes} bytes: the blocks beyond its \
                 end are lost, and nothing more is committed; extend the file back (truncate -s {bytes}), then run \
                 ctxfs fsck",
                meta.len()
            ),
        ));
    }
    Ok(())
}

/// Size in bytes of a regular file or a block device.
pub(crate) fn byte_len(file: &File) -> io::Result<u64> {
    let meta = file.metadata()?;
    if meta.file_type().is_block_device() {
        // A block device reports length 0 in its metadata; seeking to the end gives its size.
        let mut f = file;
        f.seek(SeekFrom::End(0))
    } else {
        Ok(meta.len())
    }
}

/// Opens a store path with the chosen real device, for `access`; `spdk:CONFIG.json#BDEV`
/// opens that SPDK bdev.
pub fn open_path(
    path: &Path,
    choice: DeviceChoice,
    block_size: usize,
    access: Access,
) -> io::Result<Box<dyn BlockDevice>> {
    if let Some(spec) = SpdkPath::parse(path) {
        return open_spdk(path, spec, block_size);
    }
    let file = open_direct(path, access)?;
    open_file(path, file, choice, block_size)
}

#[cfg(feature = "spdk")]
fn open_spdk(_: &Path, spec: Result<SpdkPath, String>, block_size: usize) -> io::Result<Box<dyn BlockDevice>> {
    let spec = spec.map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    Ok(Box::new(SpdkDevice::open(&spec, Some(block_size))?))
}

#[cfg(not(feature = "spdk"))]
fn open_spdk(path: &Path, spec: Result<SpdkPath, String>, _: usize) -> io::Result<Box<dyn BlockDevice>> {
    spec.map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    Err(no_spdk(path))
}

#[cfg(feature = "spdk")]
fn read_spdk_prefix(_: &Path, spec: Result<SpdkPath, String>, len: usize) -> io::Result<AlignedBuf> {
    let spec = spec.map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    spdk::read_prefix(&spec, len)
}

#[cfg(not(feature = "spdk"))]
fn read_spdk_prefix(path: &Path, spec: Result<SpdkPath, String>, _: usize) -> io::Result<AlignedBuf> {
    spec.map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    Err(no_spdk(path))
}

#[cfg(not(feature = "spdk"))]
fn no_spdk(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::Unsupported,
        format!(
            "{}: this build has no SPDK support; build with the cargo feature `spdk` (docs/spdk.md)",
            path.display()
        ),
    )
}

pub(crate) fn open_file(
    path: &Path,
    file: File,
    choice: DeviceChoice,
    block_size: usize,
) -> io::Result<Box<dyn BlockDevice>> {
    match choice {
        DeviceChoice::File => Ok(Box::new(FileDevice::new(path, file, block_size, None)?)),
        DeviceChoice::Uring => match UringDevice::new(path, file, block_size) {
            Ok(dev) => Ok(Box::new(dev)),
            Err(e) if refusal_note(&e).is_some() => Err(io::Error::new(
                e.kind(),
                format!(
                    "{}: io_uring setup refused ({e}): the kernel has it disabled (sysctl kernel.io_uring_disabled) \
                     or a seccomp filter blocks it; --device auto or file reads and writes with pread/pwrite",
                    path.display()
                ),
            )),
            Err(e) => Err(e),
        },
        DeviceChoice::Auto => {
            let spare = file.try_clone()?;
            match UringDevice::new(path, file, block_size) {
                Ok(dev) => Ok(Box::new(dev)),
                Err(e) => match refusal_note(&e) {
                    Some(note) => Ok(Box::new(FileDevice::new(path, spare, block_size, Some(note))?)),
                    None => Err(e),
                },
            }
        }
    }
}

/// When io_uring setup fails because the kernel refuses it (disabled by sysctl or seccomp:
/// EPERM; not built in: ENOSYS), the store falls back to pread/pwrite, and `inspect` shows
/// this note. Any other failure is an error.
pub fn refusal_note(e: &io::Error) -> Option<String> {
    matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::ENOSYS))
        .then(|| format!("io_uring setup refused ({e}); using pread/pwrite with O_DIRECT"))
}

/// Reads the first `len` bytes of a path with O_DIRECT; used to find the superblocks before
/// the block size is known. Errors name the path.
pub fn read_prefix(path: &Path, len: usize) -> io::Result<AlignedBuf> {
    use std::os::unix::fs::FileExt;
    if let Some(spec) = SpdkPath::parse(path) {
        return read_spdk_prefix(path, spec, len)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())));
    }
    let file = open_direct(path, Access::Read)?;
    let mut buf = AlignedBuf::zeroed(len);
    let mut done = 0;
    while done < len {
        let n = file
            .read_at(&mut buf[done..], done as u64)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_refused_ring_falls_back() {
        assert!(refusal_note(&io::Error::from_raw_os_error(libc::EPERM)).is_some_and(|n| n.contains("pread/pwrite")));
        assert!(refusal_note(&io::Error::from_raw_os_error(libc::ENOSYS)).is_some());
        assert!(refusal_note(&io::Error::from_raw_os_error(libc::ENOMEM)).is_none());
        assert!(refusal_note(&io::Error::from_raw_os_error(libc::EINVAL)).is_none());
    }

    #[cfg(not(feature = "spdk"))]
    #[test]
    fn spdk_paths_say_what_is_missing() {
        let err = open_path(Path::new("spdk:bdev.json#aio0"), DeviceChoice::Auto, 4096, Access::Write).err().unwrap();
        assert_eq!(err.kind(), io::ErrorKind::Unsupported);
        assert!(err.to_string().contains("feature `spdk`"), "{err}");
        let err = read_prefix(Path::new("spdk:bdev.json"), 8192).err().unwrap();
        assert!(err.to_string().contains("spdk:CONFIG.json#BDEV"), "{err}");
    }
}
