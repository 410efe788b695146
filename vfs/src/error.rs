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
    #[error("I/O error on block {block}: {source}")]
    BlockIo { block: u64, source: io::Error },
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("damaged {kind} block {block} (owner {owner}): {fault}")]
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
