//! ctxfs-vfs: the vector file system under ctxfs.
//!
//! A store lives on one block device. It holds contexts (the KV cache of a long prompt);
//! each context has a model shape, its token ids, and one vector file per (layer, kv head)
//! made of an index stream and a data stream of blocks. All writes are copy-on-write and a
//! commit is atomic. `docs/format.md` specifies the bytes.

mod alloc;
mod blockio;
pub mod device;
mod error;
pub mod format;
pub mod fsck;
pub mod inspect;
mod rng;
mod store;
mod stream;
mod txn;

pub use alloc::Bitmap;
pub use blockio::{max_payload, BlockBuf};
pub use device::{BlockDevice, DeviceChoice, DeviceInfo};
pub use error::{BlockFault, Error, Result};
pub use format::records::{ContextRecord, DType, ModelShape};
pub use rng::SplitMix64;
pub use store::{
    probe_block_size, Context, FileStream, RangeReader, SlotStatus, Snapshot, Space, Store,
    StreamReader,
};
pub use stream::{StreamId, StreamMap};
pub use txn::{format, Txn, MIN_STORE_BLOCKS};
