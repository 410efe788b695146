//! Files a command makes and removes again (a `.partial` output before it is moved into place,
//! a benchmark's raw file), removed on Ctrl-C or SIGTERM too: an interrupted `gen` or `bench
//! io` leaves none of its hundreds of MiB behind.
//!
//! A signal handler may only make async-signal-safe calls, so the paths are held as C strings
//! in a fixed table of atomic pointers that the handler reads without a lock, and it removes
//! them with `unlink(2)` before `_exit(2)`.
//!
//! What a store transaction wrote (a benchmark's scratch context) cannot be undone from a
//! handler. While a command holds [`defer_interrupts`], the first signal is only recorded: the
//! command sees it at its next [`check_interrupt`], returns [`Interrupted`] through its own
//! clean-up, and `main` exits with 128 + the signal. A second signal exits at once.

use std::ffi::{c_char, CString};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicUsize, Ordering};
use std::sync::Once;

/// Scratch files alive at once, at the most (a command makes one or two).
const SLOTS: usize = 8;

static PATHS: [AtomicPtr<c_char>; SLOTS] = [const { AtomicPtr::new(std::ptr::null_mut()) }; SLOTS];
static HANDLER: Once = Once::new();

/// A registered scratch file: removed by the signal handler while this lives. Dropping it
/// only unregisters the path (the owner removes or renames the file).
pub struct Registered {
    slot: Option<usize>,
}

/// Registers `path` for removal on SIGINT or SIGTERM. With every slot taken, the file is
/// simply not removed on a signal.
pub fn register(path: &Path) -> Registered {
    HANDLER.call_once(install);
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else { return Registered { slot: None } };
    let ptr = c.into_raw();
    for (i, p) in PATHS.iter().enumerate() {
        if p.compare_exchange(std::ptr::null_mut(), ptr, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            return Registered { slot: Some(i) };
        }
    }
    // SAFETY: `ptr` came from `CString::into_raw` above and was published nowhere.
    drop(unsafe { CString::from_raw(ptr) });
    Registered { slot: None }
}

impl Drop for Registered {
    fn drop(&mut self) {
        if let Some(i) = self.slot {
            // Leaked, not freed: a handler running now may still read it; a few bytes per file.
            PATHS[i].store(std::ptr::null_mut(), Ordering::Release);
        }
    }
}

/// Live [`Deferred`] guards.
static DEFERRING: AtomicUsize = AtomicUsize::new(0);
/// The signal recorded while deferring (0: none).
static PENDING: AtomicI32 = AtomicI32::new(0);

/// While the guard lives, a first SIGINT or SIGTERM is recorded for [`check_interrupt`]
/// instead of ending the process.
pub struct Deferred(());

pub fn defer_interrupts() -> Deferred {
    HANDLER.call_once(install);
    DEFERRING.fetch_add(1, Ordering::AcqRel);
    Deferred(())
}

impl Drop for Deferred {
    fn drop(&mut self) {
        DEFERRING.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The signal a deferred interrupt came with, as an error for the command to return.
#[derive(Debug)]
pub struct Interrupted(pub i32);

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = if self.0 == libc::SIGTERM { "SIGTERM" } else { "SIGINT" };
        write!(f, "interrupted by {name}")
    }
}

impl std::error::Error for Interrupted {}

/// Fails with [`Interrupted`] once a deferred signal has come.
pub fn check_interrupt() -> Result<(), Interrupted> {
    match PENDING.load(Ordering::Acquire) {
        0 => Ok(()),
        signal => Err(Interrupted(signal)),
    }
}

extern "C" fn on_signal(signal: libc::c_int) {
    // Atomics are async-signal-safe: they take no lock.
    if DEFERRING.load(Ordering::Acquire) > 0
        && PENDING.compare_exchange(0, signal, Ordering::AcqRel, Ordering::Acquire).is_ok()
    {
        return;
    }
    for p in &PATHS {
        let path = p.load(Ordering::Acquire);
        if !path.is_null() {
            // SAFETY: a registered pointer is a NUL-terminated string that is never freed;
            // unlink is async-signal-safe.
            unsafe { libc::unlink(path) };
        }
    }
    // SAFETY: _exit is async-signal-safe; 128 + signal is the shell's convention.
    unsafe { libc::_exit(128 + signal) };
}

fn install() {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction is valid (empty mask, no flags), and `on_signal` only
        // makes async-signal-safe calls.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}
