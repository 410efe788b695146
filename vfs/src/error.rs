//! Error types. Every error that concerns a block names the block, so that a user (and fsck)
//! can say exactly where the damage is.

use crate::format::Expect;
use std::io;

/// What went wrong with one block when it was read back and checked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockFault {
    #[error("bad magic {found:#010x}")]
    BadMagic { found: u32 },
    #[error("checksum mismatch: block holds {stored:#010x}, contents hash to {computed:#010x}")]
    ChecksumMismatch { stored: u32, computed: u32 },
    #[error("checksum {found:#010x} differs from {expected:#010x} recorded by its parent (lost or misdirected write)")]
    ReferenceMismatch { expected: u32, found: u32 },
    #[error("header says {field} = {found}, expected {expected} (misdirected write)")]
    HeaderMismatch { field: &'static str, expected: u64, found: u64 },
    #[error("malformed contents: {0}")]
    Malformed(String),
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("I/O error on block {block}: {source}{}", io_hint(.source))]
    BlockIo { block: u64, source: io::Error },
    #[error("I/O error: {0}{hint}", hint = io_hint(.0))]
    Io(#[from] io::Error),
    #[error("damaged {kind} block {block} (owner {owner}): {fault}{hint}", hint = damage_hint(kind))]
    Damaged {
        block: u64,
        kind: &'static str,
        owner: String,
        fault: BlockFault,
        /// What the reference that led here expected, when a reference did.
        expected: Option<Box<Expect>>,
    },
    #[error("not a ctxfs store: {0}")]
    NotAStore(String),
    #[error("context {name:?} (id {id}) cannot be read: {why}; the store's other contexts are served as usual, and `ctxfs fsck --repair --drop-damaged` drops it")]
    DamagedContext { name: String, id: u32, block: Option<u64>, why: String },
    #[error("unsupported format version {found} (this build reads versions {oldest} to {newest}); {hint}")]
    UnsupportedVersion { found: u32, oldest: u32, newest: u32, hint: &'static str },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("no context named {0:?}")]
    NoSuchContext(String),
    #[error("no context with id {0}")]
    NoSuchContextId(u32),
    #[error("a context named {0:?} already exists")]
    ContextExists(String),
    #[error("store is full: {needed} more blocks needed, {free} free; {held} more were freed but are still held, for open readers of older states or until the next commit, and come free when those readers close")]
    StoreFull { needed: u64, free: u64, held: u64 },
    #[error("no space can be handed out while another process reads generation {generation} or older of this store, a state older than the one this writer opened (its blocks are not known here); close that reader and reopen")]
    HeldForReader { generation: u64 },
    #[error("store was poisoned by an earlier failed commit ({0}); reopen it to recover the last committed state")]
    Poisoned(String),
    #[error("{path} is open for writing by {}; a store has one writer at a time (readers may open it read-only beside it)", holder.map_or("another open store of this process (or a session or DB still holding one)".to_string(), |pid| format!("process {pid}")))]
    Locked { path: String, holder: Option<u32> },
    #[error("the store is open read-only: {0} needs it opened for writing")]
    ReadOnly(&'static str),
    #[error("device has crashed (simulated)")]
    Crashed,
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What to do about a damaged block of `kind`, where the store can mend it on its own.
fn damage_hint(kind: &str) -> &'static str {
    match kind {
        "alloc" => "; the allocator is rebuilt from what the contexts reference by `ctxfs fsck --repair`",
        _ => "",
    }
}

/// What an I/O error most likely means for a store, where its own text does not say: the
/// limit or host state to look at.
fn io_hint(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::ENOSPC) => {
            "; the file system holding the store file is full (a store file is sparse: its blocks take space there \
             only when first written; free space there, or put the store where there is room)"
        }
        Some(libc::EDQUOT) => "; the disk quota of the store file's owner is used up",
        Some(libc::EFBIG) => "; the file is larger than the file size limit allows (`ulimit -f`)",
        Some(libc::ECANCELED) => {
            "; the kernel cancelled the request, as it does when it cannot start an io_uring worker thread (the \
             process or thread limit, `ulimit -u`, is reached; `--device file` needs no worker threads)"
        }
        Some(libc::EMFILE) => "; the open-file limit (`ulimit -n`) is reached",
        Some(libc::EROFS) => "; the file system is mounted read-only",
        Some(libc::EPERM) => {
            "; the device refuses it (a block device set read-only refuses writes: `blockdev --getro`)"
        }
        _ => "",
    }
}

impl Error {
    /// A block that failed verification against the reference that led to it.
    pub fn mismatch(block: u64, expect: &Expect, fault: BlockFault) -> Error {
        Error::Damaged {
            block,
            kind: expect.kind.name(),
            owner: expect.owner.to_string(),
            fault,
            expected: Some(Box::new(*expect)),
        }
    }

    /// Damage found without a reference to compare against (structure checks).
    pub fn damaged(block: u64, kind: &'static str, owner: impl Into<String>, fault: BlockFault) -> Error {
        Error::Damaged { block, kind, owner: owner.into(), fault, expected: None }
    }

    /// The block this error is about, where it is about one.
    pub fn block(&self) -> Option<u64> {
        match self {
            Error::BlockIo { block, .. } | Error::Damaged { block, .. } => Some(*block),
            Error::DamagedContext { block, .. } => *block,
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_io_error_says_what_limit_or_host_state_to_look_at() {
        let on_block = |errno| Error::BlockIo { block: 9, source: io::Error::from_raw_os_error(errno) }.to_string();
        assert!(on_block(libc::ENOSPC).contains("the file system holding the store file is full"));
        assert!(on_block(libc::ECANCELED).contains("ulimit -u"));
        assert!(on_block(libc::EFBIG).contains("ulimit -f"));
        assert!(Error::Io(io::Error::from_raw_os_error(libc::EMFILE)).to_string().contains("ulimit -n"));
        assert!(on_block(libc::EIO).ends_with("(os error 5)"), "no hint where none applies");
    }
}
