//! ctxfs-vfs: the vector file system under ctxfs.
//!
//! A store lives on one block device. It holds contexts (the KV cache of a long prompt);
//! each context has a model shape, its token ids, and one vector file per (layer, kv head)
//! made of an index stream and a data stream of blocks. A context may begin with the first
//! tokens of another (its parent) and share that prefix's blocks instead of copying them.
//! All writes are copy-on-write and a commit is atomic. `docs/format.md` specifies the bytes;
//! `docs/architecture.md` shows where this crate sits under the others.
//!
//! ```
//! use ctxfs_vfs::{device::MemDevice, DType, FileStream, ModelShape, Store};
//! use std::sync::Arc;
//!
//! # fn main() -> ctxfs_vfs::Result<()> {
//! // A real store uses `Store::open_path` on a file or NVMe device; memory keeps this short.
//! let dev = Arc::new(MemDevice::new(4096, 256));
//! let store = ctxfs_vfs::format(dev.clone())?;
//! let shape = ModelShape { layers: 1, q_heads: 4, kv_heads: 2, head_dim: 64, dtype: DType::F16 };
//!
//! let mut txn = store.begin()?;
//! txn.create_context("book", shape, &[101, 102, 103])?;
//! txn.append_block("book", 0, 1, FileStream::Data, b"values of tokens 0..15")?;
//! txn.commit()?;
//!
//! let store = Store::open(dev)?; // what a restart finds
//! let snap = store.snapshot();
//! let book = snap.context("book")?;
//! assert_eq!(book.tokens()?, [101, 102, 103]);
//! let data = book.stream(0, 1, FileStream::Data)?;
//! assert_eq!(data.read(0)?.payload(), b"values of tokens 0..15");
//! # Ok(())
//! # }
//! ```

mod alloc;
mod blockio;
pub mod device;
mod error;
pub mod format;
pub mod fsck;
pub mod inspect;
pub mod lock;
pub mod mkfs;
mod rng;
mod store;
mod stream;
mod txn;

pub use alloc::Bitmap;
pub use blockio::{max_payload, BlockBuf};

/// Bytes a transaction's sequential writes keep in flight, at most (batches of 1 MiB).
pub const WRITE_IN_FLIGHT_BYTES: usize = blockio::WriteQueue::IN_FLIGHT_BYTES;
pub use device::{BlockDevice, DeviceChoice, DeviceInfo};
pub use error::{BlockFault, Error, Result};
pub use format::records::{ContextRecord, DType, ModelShape, ParentLink};
pub use lock::{Access, StoreLock};
pub use rng::SplitMix64;
pub use store::{
    probe_block_size, Context, FileStream, RangeReader, SlotStatus, Snapshot, Space, Store, StreamReader, StreamRefs,
};
pub use stream::{StreamId, StreamMap};
pub use txn::{format, format_locked, Txn, MIN_STORE_BLOCKS};
