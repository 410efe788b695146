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
    /// Serving a context would hold more of its index resident than
    /// `DbConfig::resident_budget` allows; nothing was held.
    #[error(
        "context {context:?} would hold {resident_bytes} bytes resident, {:.3} of its {kv_bytes} bytes of KV cache, over the resident budget of {budget}",
        *resident_bytes as f64 / (*kv_bytes).max(1) as f64
    )]
    OverBudget { context: String, resident_bytes: u64, kv_bytes: u64, budget: f64 },
    /// A stored index or data stream disagrees with its context.
    #[error("corrupt context: {0}")]
    Corrupt(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

pub(crate) fn input<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Input(msg.into()))
}
