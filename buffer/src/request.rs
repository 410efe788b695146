//! What a caller asks the pool for, and what can go wrong.

use ctxfs_vfs::format::{BlockKind, Expect};
use std::sync::Arc;

/// The two kinds of block the pool treats differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlockClass {
    /// Graph and key blocks: kept resident, evicted only under real pressure.
    Index = 0,
    /// Value blocks (and anything else): streamed through a small, scan-resistant area.
    Data = 1,
}

impl BlockClass {
    pub fn name(self) -> &'static str {
        match self {
            BlockClass::Index => "index",
            BlockClass::Data => "data",
        }
    }
}

/// One block: where it is on the device and what it must be (from its vfs reference).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRequest {
    pub block: u64,
    pub expect: Expect,
}

impl BlockRequest {
    /// From a vfs stream location, e.g. `StreamReader::locate`.
    pub fn new((block, expect): (u64, Expect)) -> Self {
        BlockRequest { block, expect }
    }
    pub fn class(&self) -> BlockClass {
        if self.expect.kind == BlockKind::Index {
            BlockClass::Index
        } else {
            BlockClass::Data
        }
    }
    pub fn context(&self) -> u32 {
        self.expect.owner.context
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum BufferError {
    /// The block could not be read or failed verification. Every waiter gets the same error,
    /// and nothing is cached: the next request reads again.
    #[error(transparent)]
    Block(Arc<ctxfs_vfs::Error>),
    #[error("buffer pool exhausted: every one of the {frames} {} frames is pinned; waited {waited_ms} ms", class.name())]
    Exhausted { class: BlockClass, frames: usize, waited_ms: u64 },
    #[error("a batch of {needed} {} blocks cannot fit in the {frames} frames of the {} area; split the request or raise the budget", class.name(), class.name())]
    TooLarge { class: BlockClass, needed: usize, frames: usize },
    #[error("invalid buffer pool configuration: {0}")]
    Config(String),
}

impl BufferError {
    /// The device block the error is about, where it is about one.
    pub fn block(&self) -> Option<u64> {
        match self {
            BufferError::Block(e) => e.block(),
            _ => None,
        }
    }
}
