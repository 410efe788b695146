//! Runs of block requests, logical block `i` at position `i`: a list, or part of a stream
//! whose requests are made on demand from its map.
//!
//! A served vector file is read through its index and data streams for as long as it is
//! served. A request listed per block takes 40 bytes; made from the stream's map, which the
//! snapshot keeps anyway, it costs a lookup in the map's runs and nothing per block.

use crate::request::BlockRequest;
use ctxfs_vfs::StreamRefs;
use std::ops::Range;

/// Block requests by position ([`get`](Self::get)): a slice of listed requests, or a range of
/// a stream's blocks. Cheap to copy and to narrow ([`range`](Self::range)).
#[derive(Debug, Clone, Copy)]
pub enum Blocks<'a> {
    Listed(&'a [BlockRequest]),
    Mapped { stream: &'a StreamRefs, from: u64, len: usize },
}

impl<'a> Blocks<'a> {
    /// Every block of `stream`.
    pub fn of(stream: &'a StreamRefs) -> Blocks<'a> {
        Blocks::Mapped { stream, from: 0, len: stream.len() as usize }
    }

    pub fn len(&self) -> usize {
        match self {
            Blocks::Listed(l) => l.len(),
            Blocks::Mapped { len, .. } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The request of position `i`; `None` past the end (or where the stream's map lacks the
    /// block, which a map read whole never does).
    pub fn get(&self, i: usize) -> Option<BlockRequest> {
        match self {
            Blocks::Listed(l) => l.get(i).copied(),
            Blocks::Mapped { stream, from, len } => {
                (i < *len).then(|| stream.locate(from + i as u64).map(BlockRequest::new)).flatten()
            }
        }
    }

    /// The request of position `i`.
    ///
    /// # Panics
    /// Past the end, as indexing does.
    pub fn at(&self, i: usize) -> BlockRequest {
        self.get(i).unwrap_or_else(|| panic!("block {i} of {}", self.len()))
    }

    pub fn first(&self) -> Option<BlockRequest> {
        self.get(0)
    }

    /// Positions `r` of these, as positions `0..r.len()`.
    ///
    /// # Panics
    /// Where `r` reaches past the end, as slicing does.
    pub fn range(&self, r: Range<usize>) -> Blocks<'a> {
        assert!(r.start <= r.end && r.end <= self.len(), "blocks {r:?} of {}", self.len());
        match *self {
            Blocks::Listed(l) => Blocks::Listed(&l[r]),
            Blocks::Mapped { stream, from, .. } => Blocks::Mapped { stream, from: from + r.start as u64, len: r.len() },
        }
    }

    /// Positions `n..` of these, as positions `0..`.
    pub fn skip(&self, n: usize) -> Blocks<'a> {
        self.range(n..self.len())
    }

    /// Every request, in order (a position the map lacks is left out).
    pub fn iter(&self) -> impl Iterator<Item = BlockRequest> + '_ {
        (0..self.len()).filter_map(|i| self.get(i))
    }

    pub fn to_vec(&self) -> Vec<BlockRequest> {
        self.iter().collect()
    }
}

impl<'a> From<&'a [BlockRequest]> for Blocks<'a> {
    fn from(l: &'a [BlockRequest]) -> Self {
        Blocks::Listed(l)
    }
}

impl<'a> From<&'a Vec<BlockRequest>> for Blocks<'a> {
    fn from(l: &'a Vec<BlockRequest>) -> Self {
        Blocks::Listed(l)
    }
}
