//! On-disk format v2 (v1 stays readable). docs/format.md is the byte-level specification of everything here.

pub mod codec;
pub mod header;
pub mod records;
pub mod superblock;

pub use header::{BlockHeader, BlockKind, BlockRef, Expect, Owner, StreamTag, HEADER_LEN, REF_LEN};
pub use superblock::{Superblock, FORMAT_VERSION, OLDEST_READABLE_VERSION, SUPERBLOCK_SLOTS};
