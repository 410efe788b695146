//! The synchronisation primitives of the pin/evict/load protocol: std's, or loom's when the
//! crate is built with `--cfg loom` so the models in tests/loom.rs can explore interleavings.

#[cfg(loom)]
pub(crate) use loom::sync::{
    atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard,
};
#[cfg(loom)]
pub(crate) fn yield_now() {
    loom::thread::yield_now();
}

#[cfg(not(loom))]
pub(crate) use std::sync::{
    atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering},
    Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard,
};
#[cfg(not(loom))]
pub(crate) fn yield_now() {
    std::thread::yield_now();
}

/// Locks, recovering from poisoning: a panicking holder never leaves frame contents half
/// written (states change only after I/O completes), so the data is still consistent.
pub(crate) fn lock<T>(m: &Mutex<T>) -> crate::sync::MutexGuardOf<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(loom)]
pub(crate) type MutexGuardOf<'a, T> = loom::sync::MutexGuard<'a, T>;
#[cfg(not(loom))]
pub(crate) type MutexGuardOf<'a, T> = std::sync::MutexGuard<'a, T>;
