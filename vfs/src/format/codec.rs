//! Little-endian field encoding. Every on-disk structure is written and read field by field
//! through these two types; nothing is ever a memory dump of a Rust struct.

use crate::error::BlockFault;

#[derive(Default)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.0.extend_from_slice(v);
        self
    }
    /// A string as u16 length then UTF-8 bytes.
    pub fn str(&mut self, v: &str) -> &mut Self {
        let len = u16::try_from(v.len()).expect("names are validated to at most 255 bytes");
        self.u16(len).bytes(v.as_bytes())
    }
}

/// A bounds-checked reader; running off the end is a [`BlockFault::Malformed`], never a panic.
pub struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Dec<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Dec { buf, pos: 0, what }
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], BlockFault> {
        if n > self.remaining() {
            return Err(BlockFault::Malformed(format!(
                "{} truncated: needs {n} bytes at offset {}, {} left",
                self.what,
                self.pos,
                self.remaining()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn array<const N: usize>(&mut self) -> Result<[u8; N], BlockFault> {
        Ok(self.bytes(N)?.try_into().expect("length checked"))
    }
    pub fn u8(&mut self) -> Result<u8, BlockFault> {
        Ok(self.array::<1>()?[0])
    }
    pub fn u16(&mut self) -> Result<u16, BlockFault> {
        Ok(u16::from_le_bytes(self.array()?))
    }
    pub fn u32(&mut self) -> Result<u32, BlockFault> {
        Ok(u32::from_le_bytes(self.array()?))
    }
    pub fn u64(&mut self) -> Result<u64, BlockFault> {
        Ok(u64::from_le_bytes(self.array()?))
    }
    /// A name: 1..=255 bytes of UTF-8 without control characters.
    pub fn str(&mut self) -> Result<String, BlockFault> {
        let len = self.u16()? as usize;
        if len == 0 || len > crate::format::records::MAX_NAME_LEN {
            return Err(BlockFault::Malformed(format!("{}: name of {len} bytes", self.what)));
        }
        let raw = self.bytes(len)?;
        let name = String::from_utf8(raw.to_vec())
            .map_err(|_| BlockFault::Malformed(format!("{}: name is not UTF-8", self.what)))?;
        if name.chars().any(char::is_control) {
            return Err(BlockFault::Malformed(format!("{}: name has control characters", self.what)));
        }
        Ok(name)
    }
    /// A count of items each at least `min_item` bytes long, checked against what is left so
    /// that a damaged count cannot make a reader allocate without bound.
    pub fn count(&mut self, min_item: usize) -> Result<usize, BlockFault> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_item) > self.remaining() {
            return Err(BlockFault::Malformed(format!("{}: count {n} exceeds the bytes left", self.what)));
        }
        Ok(n)
    }
    pub fn expect_magic(&mut self, magic: &[u8; 4]) -> Result<(), BlockFault> {
        let found = self.array::<4>()?;
        if &found != magic {
            return Err(BlockFault::Malformed(format!("{}: magic {:?}, expected {:?}", self.what, found, magic)));
        }
        Ok(())
    }
    pub fn finish(&self) -> Result<(), BlockFault> {
        if self.remaining() != 0 {
            return Err(BlockFault::Malformed(format!("{}: {} trailing bytes", self.what, self.remaining())));
        }
        Ok(())
    }
}
