//! The Python exception each failure raises, carrying the Rust message (the classes are
//! `ctxfs/errors.py`'s).

use pyo3::import_exception;
use pyo3::prelude::*;

// Defined in Python (`ctxfs/errors.py`), so each can also derive from the built-in exception
// a caller would catch for its kind (`InputError` is a `ValueError`, ...): a class made here
// has one base.
import_exception!(ctxfs.errors, InputError);
import_exception!(ctxfs.errors, StoreFullError);
import_exception!(ctxfs.errors, ExistsError);
import_exception!(ctxfs.errors, NotFoundError);
import_exception!(ctxfs.errors, CorruptError);
import_exception!(ctxfs.errors, LockedError);
import_exception!(ctxfs.errors, ReadOnlyError);
import_exception!(ctxfs.errors, NotAStoreError);
import_exception!(ctxfs.errors, IoError);
import_exception!(ctxfs.errors, OverBudgetError);

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
