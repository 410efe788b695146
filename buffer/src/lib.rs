//! ctxfs-buffer: the buffer manager the query layer reads through.
//!
//! * Frames of the block size under a byte budget, split into an **index area** (graph and
//!   key blocks: stay resident, evicted only under real pressure, coldest context first) and
//!   a small **data area** (value blocks: scan-resistant 2Q, never pushes index blocks out).
//! * A page table of one atomic slot per device block: a hit is one load and one frame read
//!   lock. A reader can keep a [`FrameHint`] per block it reads often and skip the table.
//! * [`ResidentBlocks`] hold a served context's index blocks in their frames, read without
//!   latches (a pin per block costs more than the search's work on it).
//! * [`Blocks`]: the requests of a stream's blocks by position, listed or made on demand
//!   from the stream's map (a served file keeps 4 bytes per block, not a 40-byte request).
//! * [`PageGuard`]s pin a block and give zero-copy `&[u32]`, `&[f16]`, `&[bf16]` views.
//! * A [`Prefetcher`] thread reads blocks a caller will need soon (a search's value blocks)
//!   while the caller goes on computing.
//! * Batched reads: the misses of a request go to the device as one submission, blocks at
//!   most [`RUN_GAP`] apart coalesced; concurrent requests for one block share one read; an
//!   I/O error or a checksum failure reaches every waiter and is not cached.
//!
//! Memory: frame buffers are slots of one allocation of the budget, mapped as frames are
//! first used (or all at once, [`PoolConfig::populate`]), so they never exceed it; beyond it
//! the pool holds frame descriptors and table entries ([`PoolStats::overhead`]) and the
//! device source's fixed staging buffers.
//!
//! Where the pool sits in a decode query's path: `docs/architecture.md` in the repository.

mod arena;
mod blocks;
mod frame;
mod guard;
mod hint;
mod policy;
mod pool;
mod prefetcher;
mod request;
mod resident;
mod source;
mod stats;
mod sync;
mod table;

pub use blocks::Blocks;
pub use guard::PageGuard;
pub use hint::FrameHint;
pub use pool::{BufferPool, PoolConfig};
pub use prefetcher::{Prefetched, Prefetcher};
pub use request::{BlockClass, BlockRequest, BufferError};
pub use resident::ResidentBlocks;
pub use source::{BlockSource, DeviceSource, RUN_BLOCKS, RUN_GAP, STAGING_BUFFERS, STAGING_BUFFER_BYTES};
pub use stats::{ClassStats, PoolStats};
