//! Locks that recover from poisoning. What attention guards with them (the file cache, the
//! prefix trie, a session's windows, warm-start tokens and costs) changes by whole-value
//! inserts, replacements and takes, so a thread that panicked holding one cannot have left
//! it half written, and one failed call must not take down every later call on the DB.

use std::sync::{Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn read<T>(l: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    l.read().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn write<T>(l: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    l.write().unwrap_or_else(|p| p.into_inner())
}
