//! Who may use a store across processes: one writer, any number of readers.
//!
//! Both kinds of lock are advisory kernel locks on the store file (or block device node, or an
//! SPDK path's config file), so a process that dies releases them with its file descriptors.
//!
//! - **The writer** holds `flock(LOCK_EX)` on the file. A second writer's `LOCK_NB` attempt
//!   fails at open, before anything is written; `/proc/locks` names the holder's pid.
//! - **A reader** holds shared open-file-description (OFD) byte locks at [`READER_PINS`]` + g`
//!   for the generation `g` it reads and at [`ROOT_PINS`]` + b` for block `b`, the first block
//!   of that state's allocator directory. A writer frees a block of generation `g` only once
//!   no pin at `g` or below is held: it asks the kernel with `F_OFD_GETLK` over the pin range
//!   before it releases quarantined blocks. A writer that opens after the reader's state was
//!   superseded twice finds that state's blocks through the pinned directory block, and holds
//!   them too. flock and OFD byte locks are independent on Linux, so readers never block the
//!   writer's lock or each other.
//!
//! A reader pins the generation it found, then reads the superblocks again: if the newest
//! generation is still the one it pinned, no block of it can have been released before the pin
//! was visible (the writer releases a generation's blocks only after committing two newer
//! ones, and checks the pins after that commit). Otherwise it pins the newer one and retries.
//! docs/format.md, "Processes", states the protocol.

use crate::error::{Error, Result};
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The first byte offset of reader pins: generation `g` is pinned by a shared lock on byte
/// `READER_PINS + g`. Far past any store's size; locks beyond the end of a file are allowed.
pub const READER_PINS: i64 = 1 << 62;
/// The first byte offset of allocator-directory pins: block `b` at `ROOT_PINS + b`.
pub const ROOT_PINS: i64 = READER_PINS + (1 << 61);
/// Generations and blocks beyond these bounds cannot be pinned.
const MAX_PINNED: u64 = 1 << 60;
/// The newest generation a store reaches: the last one a reader can pin. A writer refuses to
/// commit beyond it (a superblock that claims more is damage: 2^60 commits are out of reach).
pub const MAX_GENERATION: u64 = MAX_PINNED - 1;

/// What a process may do with a store it opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Commit transactions: takes the exclusive writer lock.
    Write,
    /// Read a committed snapshot beside a writer in another process.
    Read,
}

/// A store's lock file descriptor and the lock it holds.
#[derive(Debug)]
pub struct StoreLock {
    file: File,
    path: PathBuf,
    access: Access,
}

impl StoreLock {
    /// Opens `path`'s lock and, for [`Access::Write`], takes the writer lock or fails with
    /// [`Error::Locked`] naming the holder.
    pub fn acquire(path: &Path, access: Access) -> Result<StoreLock> {
        let path = lock_path(path);
        let file = File::open(&path).map_err(|e| io_context(&path, "cannot open for locking", e))?;
        let lock = StoreLock { file, path, access };
        if access == Access::Write {
            // SAFETY: flock on a file descriptor this struct owns; no memory is passed.
            let rc = unsafe { libc::flock(lock.file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
            if rc != 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                    return Err(Error::Locked { path: lock.path.display().to_string(), holder: lock.holder_pid() });
                }
                return Err(io_context(&lock.path, "cannot lock", e));
            }
        }
        Ok(lock)
    }

    pub fn access(&self) -> Access {
        self.access
    }

    /// Pins generation `g`, whose allocator directory starts at block `root`, for this reader.
    pub(crate) fn pin(&self, generation: u64, root: u64) -> Result<()> {
        let pin = |base, at| self.ofd(libc::F_OFD_SETLK, libc::F_RDLCK, base, at, 1).map(drop);
        pin(READER_PINS, generation)
            .and_then(|()| pin(ROOT_PINS, root))
            .map_err(|e| io_context(&self.path, "cannot pin a generation", e))
    }

    /// Drops this reader's pins of [`StoreLock::pin`].
    pub(crate) fn unpin(&self, generation: u64, root: u64) {
        // Unlocking a range this description holds cannot fail but for a closed descriptor.
        let _ = self.ofd(libc::F_OFD_SETLK, libc::F_UNLCK, READER_PINS, generation, 1);
        let _ = self.ofd(libc::F_OFD_SETLK, libc::F_UNLCK, ROOT_PINS, root, 1);
    }

    /// The oldest generation another open file description pins, if any.
    pub(crate) fn oldest_pinned_elsewhere(&self) -> Result<Option<u64>> {
        // Each answer names some pin in the range asked about: asking below it again ends at
        // the lowest.
        let mut oldest = None;
        while let Some(at) = self.pin_within(READER_PINS, 0, oldest.unwrap_or(MAX_PINNED))? {
            oldest = Some(at);
        }
        Ok(oldest)
    }

    /// Every generation and every allocator directory block other open file descriptions pin.
    pub(crate) fn pins_elsewhere(&self) -> Result<(Vec<u64>, Vec<u64>)> {
        Ok((self.all_pins(READER_PINS)?, self.all_pins(ROOT_PINS)?))
    }

    /// Every pin of one range held elsewhere: each answer splits the range asked about in two.
    fn all_pins(&self, base: i64) -> Result<Vec<u64>> {
        let (mut found, mut ranges) = (Vec::new(), vec![(0, MAX_PINNED)]);
        while let Some((lo, hi)) = ranges.pop() {
            if let Some(at) = self.pin_within(base, lo, hi)? {
                found.push(at);
                ranges.extend([(lo, at), (at + 1, hi)]);
            }
        }
        found.sort_unstable();
        Ok(found)
    }

    /// A pin in `[lo, hi)` of the range at `base` that another open file description holds.
    fn pin_within(&self, base: i64, lo: u64, hi: u64) -> Result<Option<u64>> {
        if lo >= hi {
            return Ok(None);
        }
        let hit = self
            .ofd(libc::F_OFD_GETLK, libc::F_WRLCK, base, lo, (hi - lo) as i64)
            .map_err(|e| io_context(&self.path, "cannot look for readers", e))?;
        // A lock the answer names lies in the range asked about, which lies in this pin range.
        Ok(hit.map(|start| ((start - base) as u64).max(lo)))
    }

    /// One OFD lock command over `len` bytes from pin `at` of the range at `base`. Returns the start of a conflicting lock, for `F_OFD_GETLK`.
    fn ofd(&self, cmd: libc::c_int, kind: libc::c_int, base: i64, at: u64, len: i64) -> io::Result<Option<i64>> {
        if at >= MAX_PINNED {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("{at} is beyond the pin range")));
        }
        let start = base + at as i64;
        let mut fl =
            libc::flock { l_type: kind as i16, l_whence: libc::SEEK_SET as i16, l_start: start, l_len: len, l_pid: 0 };
        // SAFETY: `fl` is a valid, initialised `struct flock` that lives across the call; the
        // OFD commands require l_pid to be 0, as set.
        let rc = unsafe { libc::fcntl(self.file.as_raw_fd(), cmd, &mut fl as *mut libc::flock) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok((cmd == libc::F_OFD_GETLK && fl.l_type != libc::F_UNLCK as i16).then_some(fl.l_start))
    }

    /// The pid holding the writer lock, from `/proc/locks` (absent elsewhere than Linux);
    /// `None` when it is this process: another store open here holds it.
    fn holder_pid(&self) -> Option<u32> {
        let meta = self.file.metadata().ok()?;
        let id = format!("{:02x}:{:02x}:{}", libc::major(meta.dev()), libc::minor(meta.dev()), meta.ino());
        let locks = std::fs::read_to_string("/proc/locks").ok()?;
        locks
            .lines()
            .find_map(|line| {
                let f: Vec<&str> = line.split_whitespace().collect();
                // "N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE START END"
                (f.get(1) == Some(&"FLOCK") && f.get(3) == Some(&"WRITE") && f.get(5) == Some(&id.as_str()))
                    .then(|| f.get(4)?.parse().ok())
                    .flatten()
            })
            .filter(|&pid| pid != std::process::id())
    }
}

/// The file a store path is locked through: the path itself, or an SPDK path's config file.
fn lock_path(path: &Path) -> PathBuf {
    match crate::device::SpdkPath::parse(path) {
        Some(Ok(spdk)) => spdk.config,
        _ => path.to_path_buf(),
    }
}

fn io_context(path: &Path, what: &str, e: io::Error) -> Error {
    Error::Io(io::Error::new(e.kind(), format!("{}: {what}: {e}", path.display())))
}
