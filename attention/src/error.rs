//! What the DB and sessions fail with. Input errors are found before anything is written.

use ctxfs_buffer::BufferError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Store(#[from] ctxfs_vfs::Error),
    #[error(transparent)]
    Buffer(#[from] BufferError),
    /// Bad input: wrong shapes, dtypes, non-finite values, unknown layers.
    #[error("{0}")]
    Input(String),
    /// The store lacks the space an import or store needs; nothing was written.
    #[error("store full: {0}")]
    Full(String),
    /// A stored index or data stream disagrees with its context.
    #[error("corrupt context: {0}")]
    Corrupt(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn input<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Input(msg.into()))
}
