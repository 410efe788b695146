//! The Python exceptions: `ctxfs.Error` and one subclass per kind of failure, each carrying
//! the Rust message.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(ctxfs, Error, PyException, "A ctxfs operation failed.");
create_exception!(
    ctxfs,
    InputError,
    Error,
    "Bad input (shape, dtype, non-finite value, unknown layer or plan); nothing was written."
);
create_exception!(
    ctxfs,
    StoreFullError,
    Error,
    "The store lacks the space an import or store needs; nothing was written."
);
create_exception!(ctxfs, ExistsError, Error, "A context with that name already exists.");
create_exception!(ctxfs, NotFoundError, Error, "No context with that name.");
create_exception!(ctxfs, CorruptError, Error, "A block or stream failed verification; the message names the block.");
create_exception!(ctxfs, LockedError, Error, "Another writer holds the store.");
create_exception!(ctxfs, ReadOnlyError, Error, "The store is open read-only.");
create_exception!(ctxfs, NotAStoreError, Error, "The path holds no ctxfs store (or one this build cannot read).");
create_exception!(ctxfs, IoError, Error, "The device failed an I/O.");
create_exception!(
    ctxfs,
    OverBudgetError,
    Error,
    "Serving the context would hold more of its index resident than the store's resident_budget allows."
);

/// A failure of any layer below, as one type for `?` in the binding.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    #[error(transparent)]
    Attention(#[from] ctxfs_attention::Error),
    #[error(transparent)]
    Store(#[from] ctxfs_vfs::Error),
}

fn from_store(e: &ctxfs_vfs::Error) -> fn(String) -> PyErr {
    use ctxfs_vfs::Error as V;
    match e {
        V::InvalidArgument(_) => InputError::new_err,
        V::StoreFull { .. } | V::HeldForReader { .. } => StoreFullError::new_err,
        V::ContextExists(_) => ExistsError::new_err,
        V::NoSuchContext(_) | V::NoSuchContextId(_) => NotFoundError::new_err,
        V::Damaged { .. } | V::DamagedContext { .. } | V::Poisoned(_) => CorruptError::new_err,
        V::Locked { .. } => LockedError::new_err,
        V::ReadOnly(_) => ReadOnlyError::new_err,
        V::NotAStore(_) | V::UnsupportedVersion { .. } => NotAStoreError::new_err,
        V::BlockIo { .. } | V::Io(_) | V::Crashed => IoError::new_err,
    }
}

/// The Python exception for a failure, with its message.
pub fn to_py(e: Failure) -> PyErr {
    use ctxfs_attention::Error as A;
    let make = match &e {
        Failure::Store(s) | Failure::Attention(A::Store(s)) => from_store(s),
        Failure::Attention(A::Buffer(ctxfs_buffer::BufferError::Block(s))) => from_store(s),
        Failure::Attention(A::Input(_)) => InputError::new_err,
        Failure::Attention(A::Full(_)) => StoreFullError::new_err,
        Failure::Attention(A::Corrupt(_)) => CorruptError::new_err,
        Failure::Attention(A::OverBudget { .. }) => OverBudgetError::new_err,
        // A pool the caller configured that cannot be built.
        Failure::Attention(A::Buffer(ctxfs_buffer::BufferError::Config(_))) => InputError::new_err,
        Failure::Attention(A::Buffer(_)) => IoError::new_err,
    };
    make(e.to_string())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("Error", py.get_type::<Error>())?;
    m.add("InputError", py.get_type::<InputError>())?;
    m.add("StoreFullError", py.get_type::<StoreFullError>())?;
    m.add("ExistsError", py.get_type::<ExistsError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("CorruptError", py.get_type::<CorruptError>())?;
    m.add("LockedError", py.get_type::<LockedError>())?;
    m.add("ReadOnlyError", py.get_type::<ReadOnlyError>())?;
    m.add("NotAStoreError", py.get_type::<NotAStoreError>())?;
    m.add("IoError", py.get_type::<IoError>())?;
    m.add("OverBudgetError", py.get_type::<OverBudgetError>())?;
    Ok(())
}
