//! Buffers whose address and length suit O_DIRECT: 4096-byte aligned, whole pages.

/// The alignment every device buffer has. Block sizes are multiples of it.
pub const PAGE: usize = 4096;

#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C, align(4096))]
struct Page([u8; PAGE]);

/// A zeroed, page-aligned byte buffer. Alignment comes from the element type, so no
/// `unsafe` allocation code is needed.
#[derive(Clone)]
pub struct AlignedBuf {
    pages: Vec<Page>,
}

impl AlignedBuf {
    /// A buffer of `len` bytes; `len` must be a multiple of [`PAGE`].
    pub fn zeroed(len: usize) -> Self {
        assert!(len.is_multiple_of(PAGE), "aligned buffer length {len} is not a multiple of {PAGE}");
        AlignedBuf { pages: vec![Page([0; PAGE]); len / PAGE] }
    }

    pub fn len(&self) -> usize {
        self.pages.len() * PAGE
    }

    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    pub fn as_slice(&self) -> &[u8] {
        bytemuck::cast_slice(&self.pages)
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        bytemuck::cast_slice_mut(&mut self.pages)
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len())
    }
}
