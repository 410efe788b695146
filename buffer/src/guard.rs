//! A pinned block and zero-copy typed views of its payload.

use crate::frame::FrameData;
use crate::sync::RwLockReadGuard;
use ctxfs_vfs::format::header::payload;
use ctxfs_vfs::format::BlockHeader;
use half::{bf16, f16};

/// Holds a block in memory: while it lives, the frame cannot be evicted or reused.
pub struct PageGuard<'a> {
    data: RwLockReadGuard<'a, FrameData>,
    header: BlockHeader,
    read_here: bool,
    frame: usize,
}

impl<'a> PageGuard<'a> {
    pub(crate) fn new(
        data: RwLockReadGuard<'a, FrameData>,
        header: BlockHeader,
        read_here: bool,
        frame: usize,
    ) -> Self {
        PageGuard { data, header, read_here, frame }
    }

    /// The frame holding the block.
    pub(crate) fn frame(&self) -> usize {
        self.frame
    }

    /// Whether the call that returned this guard read the block from the device (a miss it
    /// paid for), so callers can count their own I/O while other threads share the pool.
    pub fn read_here(&self) -> bool {
        self.read_here
    }

    pub fn block(&self) -> u64 {
        self.data.block
    }

    pub fn header(&self) -> &BlockHeader {
        &self.header
    }

    pub fn payload(&self) -> &[u8] {
        payload(&self.data.buf, &self.header)
    }

    /// The payload as whole elements of `T` (a trailing partial element is left out). The
    /// payload starts 40 bytes into a page-aligned frame, so it is aligned for any `T` of
    /// alignment up to 8.
    fn view<T: bytemuck::Pod>(&self) -> &[T] {
        let p = self.payload();
        let whole = p.len() - p.len() % std::mem::size_of::<T>();
        bytemuck::cast_slice(&p[..whole])
    }

    /// Adjacency lists and other `u32` records.
    pub fn as_u32(&self) -> &[u32] {
        self.view()
    }

    pub fn as_f16(&self) -> &[f16] {
        self.view()
    }

    pub fn as_bf16(&self) -> &[bf16] {
        self.view()
    }

    pub fn as_f32(&self) -> &[f32] {
        self.view()
    }
}
