//! Every `unsafe` line of the SPDK device lives here: the generated bindings, the reactor
//! thread that runs SPDK's app framework, the calls into SPDK on it, DMA buffers, and the C
//! callbacks back into Rust. Everything exported is safe to use.
//!
//! Threading: SPDK's bdev calls must run on an SPDK thread. This module starts one reactor
//! thread (`ctxfs-spdk`, inside `spdk_app_start`) and runs all of ctxfs's SPDK work on its app
//! thread. Other threads hand it work with [`Reactor::exec`] (SPDK's `spdk_thread_send_msg`,
//! which any thread may call). Functions that must run on the reactor take an [`OnReactor`]
//! token, which only exists inside a job that the reactor runs and cannot leave its thread.
//! Callbacks from C catch panics: none unwinds into SPDK.

use super::spdk_config::EnvOptions;
use crossbeam_channel::{bounded, Receiver, Sender};
use std::ffi::{c_void, CStr, CString};
use std::io::{self, Write as _};
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};
use std::sync::{Mutex, OnceLock, RwLock};
use std::thread::JoinHandle;
use std::time::Duration;

#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    unnecessary_transmutes,
    clippy::all,
    clippy::pedantic
)]
mod sys {
    include!(concat!(env!("OUT_DIR"), "/spdk_bindings.rs"));
}

/// Whether SPDK's environment is up, so that DMA memory may be allocated and freed. Cleared
/// when the reactor starts stopping; buffers dropped after that are leaked, not freed into an
/// environment that is going away.
static ENV_UP: AtomicBool = AtomicBool::new(false);

fn log_error(msg: std::fmt::Arguments<'_>) {
    // Never panics (unlike eprintln!): this runs inside callbacks from C.
    let _ = writeln!(io::stderr(), "ctxfs: {msg}");
}

/// Proof that the code holding it runs on the reactor's app thread. Not `Send`: it cannot be
/// moved off that thread, and only [`run_job`] makes one.
pub struct OnReactor {
    _not_send: PhantomData<*const ()>,
}

type Job = Box<dyn FnOnce(&OnReactor) + Send>;

/// SPDK's app thread, as a pointer other threads may pass to `spdk_thread_send_msg`.
#[derive(Clone, Copy)]
struct AppThread(*mut sys::spdk_thread);

// SAFETY: the pointer is only ever passed to spdk_thread_send_msg, which SPDK documents as
// callable from any thread, and only while the reactor runs (see `Reactor::stopped`).
unsafe impl Send for AppThread {}
// SAFETY: as above; sharing the pointer value is harmless.
unsafe impl Sync for AppThread {}

/// The SPDK app framework running on its own thread.
pub struct Reactor {
    thread: AppThread,
    /// Set (under the write lock) before the stop message is sent; `exec` reads it under the
    /// read lock, so no message is sent to a thread that may be gone.
    stopped: RwLock<bool>,
    /// Signalled when `spdk_app_start` has returned and `spdk_app_fini` has run; with the
    /// reactor thread, which `stop` joins once it has.
    finished: Mutex<Option<(Receiver<()>, JoinHandle<()>)>>,
}

/// What `spdk_app_start` needs to keep alive: strings and arrays `spdk_app_opts` points to.
struct StartStrings {
    name: CString,
    hugedir: Option<CString>,
    core_mask: Option<CString>,
    iova_mode: Option<CString>,
    eal_args: CString,
}

fn cstring(what: &str, s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("SPDK option {what} contains a NUL byte"))
}

struct StartCtx {
    started: Sender<Result<AppThread, String>>,
    signalled: bool,
    /// The CPUs the reactor may run on once started (`None`: where DPDK pinned it).
    float_on: Option<libc::cpu_set_t>,
}

/// The CPUs the calling thread may run on.
fn allowed_cpus() -> Option<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is a plain bit set; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the calling thread.
    let rc = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    (rc == 0).then_some(set)
}

impl Reactor {
    /// Starts SPDK (the DPDK environment, the subsystems, then the bdevs of `config`, a JSON
    /// `{"subsystems": [...]}`) on a new thread and waits until it runs. SPDK can start only
    /// once per process, so a failure here is final for the process.
    pub fn start(env: &EnvOptions, config: Vec<u8>) -> Result<Reactor, String> {
        let (started_tx, started_rx) = bounded(1);
        let (finished_tx, finished_rx) = bounded(1);
        let env = env.clone();
        let handle = std::thread::Builder::new()
            .name("ctxfs-spdk".into())
            .spawn(move || {
                run_app(&env, config, started_tx);
                let _ = finished_tx.send(());
            })
            .map_err(|e| format!("cannot start the SPDK reactor thread: {e}"))?;
        match started_rx.recv() {
            Ok(Ok(thread)) => {
                Ok(Reactor { thread, stopped: RwLock::new(false), finished: Mutex::new(Some((finished_rx, handle))) })
            }
            Ok(Err(e)) => {
                let _ = handle.join();
                Err(e)
            }
            Err(_) => {
                let _ = handle.join();
                Err("the SPDK reactor thread ended before SPDK started".into())
            }
        }
    }

    /// Runs `job` on the reactor, after the jobs sent before it. Fails only when the reactor
    /// has stopped; then the job is dropped without running.
    pub fn exec(&self, job: impl FnOnce(&OnReactor) + Send + 'static) -> io::Result<()> {
        let stopped = self.stopped.read().unwrap_or_else(|p| p.into_inner());
        if *stopped {
            return Err(io::Error::other("SPDK has been shut down in this process (it cannot be restarted)"));
        }
        self.send(Box::new(job))
    }

    fn send(&self, job: Job) -> io::Result<()> {
        let raw: *mut Job = Box::into_raw(Box::new(job));
        let mut retries = 0;
        loop {
            // SAFETY: spdk_thread_send_msg may be called from any thread. The app thread is
            // alive: callers hold `stopped`'s lock and saw it false (or are `stop`, which sends
            // the last message). On success the message owns `raw` and run_job frees it.
            let rc = unsafe { sys::spdk_thread_send_msg(self.thread.0, Some(run_job), raw.cast()) };
            if rc == 0 {
                return Ok(());
            }
            // The message pool is shared by all SPDK threads; a burst can drain it for a moment.
            if rc == -libc::ENOMEM && retries < 100_000 {
                retries += 1;
                std::thread::sleep(Duration::from_micros(50));
                continue;
            }
            // SAFETY: the message was not queued, so `raw` (from Box::into_raw above) is still
            // owned here and is freed exactly once.
            drop(unsafe { Box::from_raw(raw) });
            return Err(io::Error::new(
                io::Error::from_raw_os_error(-rc).kind(),
                format!("cannot pass a request to the SPDK reactor: {}", io::Error::from_raw_os_error(-rc)),
            ));
        }
    }

    /// Stops the app framework (bdevs are closed and unregistered, the environment is torn
    /// down) and waits up to `wait` for it. Later `exec` calls fail.
    pub fn stop(&self, wait: Duration) {
        {
            let mut stopped = self.stopped.write().unwrap_or_else(|p| p.into_inner());
            if *stopped {
                return;
            }
            ENV_UP.store(false, Ordering::Release);
            let job: Job = Box::new(|_| {
                // SAFETY: runs on the app thread, once; spdk_app_stop begins the shutdown that
                // makes spdk_app_start return on the reactor thread.
                unsafe { sys::spdk_app_stop(0) }
            });
            if self.send(job).is_err() {
                return;
            }
            *stopped = true;
        }
        if let Some((rx, handle)) = self.finished.lock().unwrap_or_else(|p| p.into_inner()).take() {
            // Join the thread once it has finished: `stop` runs at process exit, and a reactor
            // thread still exiting (freeing its malloc caches) while the exit handlers tear
            // DPDK's memory down aborted the process ("malloc_consolidate(): invalid chunk
            // size", about 1 run in 80 under load). After a timeout it is left running.
            if rx.recv_timeout(wait).is_ok() {
                let _ = handle.join();
            }
        }
    }
}

/// The reactor thread: `spdk_app_start` returns only when the app stops (or fails to start).
fn run_app(env: &EnvOptions, config: Vec<u8>, started: Sender<Result<AppThread, String>>) {
    let strings = (|| -> Result<StartStrings, String> {
        let mut eal_args = "--no-shconf --log-level=lib.eal:4".to_string();
        if let Some(extra) = &env.eal_args {
            eal_args.push(' ');
            eal_args.push_str(extra);
        }
        Ok(StartStrings {
            name: cstring("name", "ctxfs")?,
            hugedir: env.hugedir.as_deref().map(|s| cstring("hugedir", s)).transpose()?,
            core_mask: env.core_mask.as_deref().map(|s| cstring("core_mask", s)).transpose()?,
            iova_mode: env.iova_mode.as_deref().map(|s| cstring("iova_mode", s)).transpose()?,
            eal_args: cstring("eal_args", &eal_args)?,
        })
    })();
    let strings = match strings {
        Ok(s) => s,
        Err(e) => {
            let _ = started.send(Err(e));
            return;
        }
    };
    let mut pci = Vec::new();
    for addr in &env.pci_allowed {
        let text = match cstring("pci_allowed", addr) {
            Ok(t) => t,
            Err(e) => {
                let _ = started.send(Err(e));
                return;
            }
        };
        // SAFETY: spdk_pci_addr is plain integers, for which all-zero is valid.
        let mut parsed: sys::spdk_pci_addr = unsafe { std::mem::zeroed() };
        // SAFETY: `parsed` is a valid out-parameter and `text` is NUL-terminated; the parser
        // touches nothing else and needs no environment.
        if unsafe { sys::spdk_pci_addr_parse(&mut parsed, text.as_ptr()) } != 0 {
            let _ = started.send(Err(format!("SPDK option pci_allowed: {addr:?} is not a PCI address (0000:5e:00.0)")));
            return;
        }
        pci.push(parsed);
    }

    // SAFETY: spdk_app_opts is a C struct of pointers, integers and bools, for which all-zero
    // is a valid value; spdk_app_opts_init then sets each field to its default.
    let mut opts: sys::spdk_app_opts = unsafe { std::mem::zeroed() };
    // SAFETY: `opts` is a valid spdk_app_opts of the size passed, which is how SPDK versions
    // the struct (it fills in only the fields that size covers).
    unsafe { sys::spdk_app_opts_init(&mut opts, std::mem::size_of::<sys::spdk_app_opts>()) };
    opts.name = strings.name.as_ptr();
    opts.json_data = config.as_ptr() as *mut c_void;
    opts.json_data_size = config.len();
    // A failing call (say, a bdev over a missing file) must not take SPDK down for the
    // process: its error is logged and the open that wanted the bdev says it is missing.
    opts.json_config_ignore_errors = true;
    opts.rpc_addr = ptr::null();
    opts.no_huge = !env.hugepages;
    let default_mem = opts.mem_size;
    opts.mem_size = env.mem_size_mb.unwrap_or(if env.hugepages { default_mem } else { 512 });
    opts.no_pci = !env.pci;
    if let Some(h) = &strings.hugedir {
        opts.hugedir = h.as_ptr();
    }
    if let Some(m) = &strings.core_mask {
        opts.reactor_mask = m.as_ptr();
    }
    if let Some(i) = &strings.iova_mode {
        opts.iova_mode = i.as_ptr();
    }
    opts.env_context = strings.eal_args.as_ptr() as *mut c_void;
    if !pci.is_empty() {
        opts.pci_allowed = pci.as_mut_ptr();
        opts.num_pci_addr = pci.len();
    }
    opts.print_level = env.log_level;
    // ctxfs is a library inside someone else's process: SPDK must not take SIGINT/SIGTERM,
    // nor (unless asked) lock cores against other SPDK processes.
    opts.disable_signal_handlers = true;
    opts.disable_cpumask_locks = !env.cpumask_locks;
    opts.interrupt_mode = env.interrupt_mode;

    // DPDK pins the reactor to its core. Without a core mask there is no dedicated core: let the
    // reactor run wherever the process may, so it need not wait for whatever else runs there.
    let float_on = if env.core_mask.is_none() { allowed_cpus() } else { None };
    let ctx = Box::into_raw(Box::new(StartCtx { started: started.clone(), signalled: false, float_on }));
    // SAFETY: `opts` and everything it points to (`strings`, `config`, `pci`) live until this
    // call returns; app_started runs during the call, on this thread, and is the only user of
    // `ctx` until the call returns.
    let rc = unsafe { sys::spdk_app_start(&mut opts, Some(app_started), ctx.cast()) };
    // SAFETY: `ctx` came from Box::into_raw above and SPDK no longer uses it.
    let ctx = unsafe { Box::from_raw(ctx) };
    ENV_UP.store(false, Ordering::Release);
    if !ctx.signalled {
        let _ = started.send(Err(format!(
            "SPDK environment initialisation failed (spdk_app_start returned {rc}); SPDK's and DPDK's messages \
             above say why. Without NVMe hardware use the defaults (no hugepages, no PCI); see docs/spdk.md"
        )));
    }
    // SAFETY: once, on the thread that ran spdk_app_start, after it returned: SPDK's apps do
    // exactly this.
    unsafe { sys::spdk_app_fini() };
    drop((strings, pci, config));
}

/// `spdk_app_start`'s start function: SPDK is up, its bdevs are configured.
unsafe extern "C" fn app_started(arg: *mut c_void) {
    // SAFETY: `arg` is the StartCtx run_app passed to spdk_app_start; it lives until that call
    // returns, and this runs during the call on the same thread.
    let ctx = unsafe { &mut *(arg as *mut StartCtx) };
    ctx.signalled = true;
    ENV_UP.store(true, Ordering::Release);
    if let Some(set) = &ctx.float_on {
        // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is this (the reactor)
        // thread. SPDK knows its threads by lcore id, not by CPU, so moving is harmless.
        unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) };
    }
    // SAFETY: this runs on an SPDK thread, the app thread, which spdk_get_thread returns.
    let thread = unsafe { sys::spdk_get_thread() };
    let _ = ctx.started.send(Ok(AppThread(thread)));
}

/// Runs one job sent by `Reactor::send`.
unsafe extern "C" fn run_job(arg: *mut c_void) {
    // SAFETY: `arg` is the Box<Job> that `send` leaked; SPDK delivers each message once.
    let job = unsafe { Box::from_raw(arg as *mut Job) };
    let token = OnReactor { _not_send: PhantomData };
    if catch_unwind(AssertUnwindSafe(move || job(&token))).is_err() {
        log_error(format_args!("a task on the SPDK reactor panicked; it was abandoned"));
    }
}

/// Runs `hook` once when the process exits normally (`exit`, or returning from `main`).
pub fn at_exit(hook: fn()) {
    static HOOK: OnceLock<fn()> = OnceLock::new();
    extern "C" fn run_hook() {
        if let Some(hook) = HOOK.get() {
            let _ = catch_unwind(*hook);
        }
    }
    if HOOK.set(hook).is_ok() {
        // SAFETY: registers a plain function without arguments; it catches panics.
        unsafe { libc::atexit(run_hook) };
    }
}

/// Memory SPDK can do I/O on (pinned, translatable for NVMe), from SPDK's environment.
pub struct DmaBuf {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a DmaBuf owns its memory exclusively, and SPDK's allocator may be called from any
// thread.
unsafe impl Send for DmaBuf {}

impl DmaBuf {
    /// A zeroed buffer; `None` when SPDK's memory is exhausted or SPDK is not running.
    pub fn alloc(_reactor: &Reactor, len: usize, align: usize) -> Option<DmaBuf> {
        if len == 0 || !ENV_UP.load(Ordering::Acquire) {
            return None;
        }
        // SAFETY: the environment is up (a Reactor exists and has not stopped); the allocator
        // is thread-safe and returns null on failure.
        let p = unsafe { sys::spdk_dma_zmalloc(len, align, ptr::null_mut()) };
        NonNull::new(p.cast()).map(|ptr| DmaBuf { ptr, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` bytes this buffer owns, initialised (zmalloc), and
        // borrowed here for the lifetime of `&self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in as_slice, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for DmaBuf {
    fn drop(&mut self) {
        if ENV_UP.load(Ordering::Acquire) {
            // SAFETY: the pointer came from spdk_dma_zmalloc and is freed once; the environment
            // is up.
            unsafe { sys::spdk_dma_free(self.ptr.as_ptr().cast()) };
        }
    }
}

/// What ctxfs needs to know about a bdev.
#[derive(Debug, Clone)]
pub struct BdevInfo {
    pub name: String,
    /// The module's description, e.g. "AIO disk", "URING bdev", "NVMe disk".
    pub product: String,
    pub block_size: usize,
    pub num_blocks: u64,
    /// Alignment SPDK wants for I/O buffers.
    pub buf_align: usize,
    pub flush: bool,
}

/// The names of all bdevs, in SPDK's order.
pub fn bdev_names(_: &OnReactor) -> Vec<String> {
    let mut names = Vec::new();
    // SAFETY: on the app thread (token); the bdev list is only changed on this thread.
    let mut bdev = unsafe { sys::spdk_bdev_first() };
    while !bdev.is_null() {
        // SAFETY: `bdev` is a registered bdev; its name is a NUL-terminated string it owns.
        names.push(unsafe { CStr::from_ptr(sys::spdk_bdev_get_name(bdev)) }.to_string_lossy().into_owned());
        // SAFETY: as above.
        bdev = unsafe { sys::spdk_bdev_next(bdev) };
    }
    names
}

struct LoadCtx {
    json: Vec<u8>,
    done: Option<Box<dyn FnOnce(i32) + Send>>,
}

/// Runs the calls of a JSON config (`{"subsystems": [...]}`) that are allowed at run time;
/// `done` gets 0 or a negative errno. Calls that fail are logged by SPDK and skipped.
pub fn load_config(_: &OnReactor, json: Vec<u8>, done: Box<dyn FnOnce(i32) + Send>) {
    let ctx = Box::new(LoadCtx { json, done: Some(done) });
    let (data, len) = (ctx.json.as_ptr() as *mut c_void, ctx.json.len());
    let raw = Box::into_raw(ctx);
    // SAFETY: on the app thread, as SPDK requires; it copies the JSON (which also stays alive
    // in the context) and calls config_loaded once with `raw`.
    unsafe { sys::spdk_subsystem_load_config(data, len as _, Some(config_loaded), raw.cast(), false) };
}

unsafe extern "C" fn config_loaded(rc: i32, arg: *mut c_void) {
    // SAFETY: `arg` is the LoadCtx leaked by load_config, delivered once.
    let mut ctx = unsafe { Box::from_raw(arg as *mut LoadCtx) };
    if let Some(done) = ctx.done.take() {
        if catch_unwind(AssertUnwindSafe(move || done(rc))).is_err() {
            log_error(format_args!("a config-load callback panicked"));
        }
    }
}

/// An open bdev: descriptor and I/O channel, both of the app thread.
struct BdevState {
    desc: AtomicPtr<sys::spdk_bdev_desc>,
    channel: AtomicPtr<sys::spdk_io_channel>,
    bdev: AtomicPtr<sys::spdk_bdev>,
    /// Set once the descriptor is closed: SPDK then no longer calls `bdev_event` with it.
    closed: AtomicBool,
}

impl BdevState {
    fn empty() -> BdevState {
        BdevState {
            desc: AtomicPtr::new(ptr::null_mut()),
            channel: AtomicPtr::new(ptr::null_mut()),
            bdev: AtomicPtr::new(ptr::null_mut()),
            closed: AtomicBool::new(true),
        }
    }

    /// Releases the channel and the descriptor, once. On the app thread only.
    fn close(&self, _: &OnReactor) {
        let channel = self.channel.swap(ptr::null_mut(), Ordering::AcqRel);
        let desc = self.desc.swap(ptr::null_mut(), Ordering::AcqRel);
        if !channel.is_null() {
            // SAFETY: on the app thread (token), which got this channel; it is put once
            // (swapped out above).
            unsafe { sys::spdk_put_io_channel(channel) };
        }
        if !desc.is_null() {
            // SAFETY: on the app thread (token), which opened the descriptor; closed once.
            unsafe { sys::spdk_bdev_close(desc) };
        }
        self.closed.store(true, Ordering::Release);
    }
}

/// A bdev opened for reading and writing. Its I/O functions run on the reactor only; it may be
/// dropped anywhere (if it was not closed, its state is leaked rather than freed under SPDK).
pub struct OpenBdev {
    state: Box<BdevState>,
    pub info: BdevInfo,
}

impl Drop for OpenBdev {
    fn drop(&mut self) {
        if !self.state.closed.load(Ordering::Acquire) {
            // SPDK may still call bdev_event with this state: keep it alive for good.
            Box::leak(std::mem::replace(&mut self.state, Box::new(BdevState::empty())));
        }
    }
}

/// Bdev events: a removed bdev (hot unplug, deletion, SPDK stopping) must have its
/// descriptors closed.
unsafe extern "C" fn bdev_event(kind: sys::spdk_bdev_event_type, _bdev: *mut sys::spdk_bdev, arg: *mut c_void) {
    if kind == sys::SPDK_BDEV_EVENT_REMOVE {
        // SAFETY: `arg` is the BdevState of an open descriptor; it is not freed while the
        // descriptor is open (OpenBdev's Drop leaks it), and SPDK calls this on the app thread.
        let state = unsafe { &*(arg as *const BdevState) };
        state.close(&OnReactor { _not_send: PhantomData });
    }
}

/// What an I/O does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IoKind {
    Read,
    Write,
    Flush,
}

/// The memory of one I/O: a bounce buffer from SPDK's environment, or the caller's own memory
/// (only for bdevs that hand buffers to the kernel, which needs no DMA-able memory).
enum IoMem {
    Dma(DmaBuf),
    Caller { ptr: NonNull<u8>, len: usize },
}

// SAFETY: a DmaBuf is Send; caller memory is only made by run_pieces, which keeps the borrow it
// comes from alive and untouched until the I/O using it has completed, and gives each piece of
// memory to one I/O at a time.
unsafe impl Send for IoMem {}

impl IoMem {
    fn len(&self) -> usize {
        match self {
            IoMem::Dma(d) => d.len(),
            IoMem::Caller { len, .. } => *len,
        }
    }

    fn ptr(&mut self) -> *mut c_void {
        match self {
            IoMem::Dma(d) => d.ptr.as_ptr().cast(),
            IoMem::Caller { ptr, .. } => ptr.as_ptr().cast(),
        }
    }
}

/// Called on the reactor when an I/O ends, with its memory back and `Err(-errno)` on failure.
type Completion = Box<dyn FnOnce(Option<IoMem>, Result<(), i32>) + Send>;

struct IoCtx {
    bdev: std::sync::Arc<OpenBdev>,
    kind: IoKind,
    buf: Option<IoMem>,
    offset_blocks: u64,
    num_blocks: u64,
    done: Option<Completion>,
    wait: sys::spdk_bdev_io_wait_entry,
}

impl OpenBdev {
    /// Opens `name` for writing; `Err(-errno)`: -ENODEV when there is no such bdev.
    pub fn open(_: &OnReactor, name: &str) -> Result<OpenBdev, i32> {
        let cname = CString::new(name).map_err(|_| -libc::EINVAL)?;
        let state = Box::new(BdevState::empty());
        let mut desc = ptr::null_mut();
        let event_ctx = &*state as *const BdevState as *mut c_void;
        // SAFETY: on the app thread (token); `cname` is NUL-terminated; `event_ctx` stays valid
        // while the descriptor is open (see OpenBdev's Drop); `desc` is a valid out-pointer.
        let rc = unsafe { sys::spdk_bdev_open_ext(cname.as_ptr(), true, Some(bdev_event), event_ctx, &mut desc) };
        if rc != 0 {
            return Err(rc);
        }
        // SAFETY: `desc` was just opened on this thread.
        let bdev = unsafe { sys::spdk_bdev_desc_get_bdev(desc) };
        // SAFETY: as above; the channel belongs to this (the app) thread.
        let channel = unsafe { sys::spdk_bdev_get_io_channel(desc) };
        state.desc.store(desc, Ordering::Release);
        state.bdev.store(bdev, Ordering::Release);
        state.closed.store(false, Ordering::Release);
        if channel.is_null() {
            state.close(&OnReactor { _not_send: PhantomData });
            return Err(-libc::ENOMEM);
        }
        state.channel.store(channel, Ordering::Release);
        // SAFETY: `bdev` is the open descriptor's bdev; these getters only read it, and the
        // product name is a NUL-terminated string the module owns.
        let info = unsafe {
            BdevInfo {
                name: name.to_string(),
                product: CStr::from_ptr(sys::spdk_bdev_get_product_name(bdev)).to_string_lossy().into_owned(),
                block_size: sys::spdk_bdev_get_block_size(bdev) as usize,
                num_blocks: sys::spdk_bdev_get_num_blocks(bdev),
                buf_align: sys::spdk_bdev_get_buf_align(bdev),
                flush: sys::spdk_bdev_io_type_supported(bdev, sys::SPDK_BDEV_IO_TYPE_FLUSH),
            }
        };
        Ok(OpenBdev { state, info })
    }

    /// Closes the descriptor (I/O after this fails with ENODEV).
    pub fn close(&self, r: &OnReactor) {
        self.state.close(r);
    }

    /// Flushes the whole bdev; `done` gets `Err(-errno)` on failure. Called on the reactor.
    pub fn flush(self: &std::sync::Arc<Self>, r: &OnReactor, done: Box<dyn FnOnce(Result<(), i32>) + Send>) {
        let blocks = self.info.num_blocks;
        self.submit(r, IoKind::Flush, None, 0, blocks, Box::new(move |_, res| done(res)));
    }

    /// Starts an I/O of `num_blocks` bdev blocks at `offset_blocks`. Reads and writes need
    /// memory of at least that many bytes. `done` is always called, once, on the reactor.
    fn submit(
        self: &std::sync::Arc<Self>,
        _: &OnReactor,
        kind: IoKind,
        buf: Option<IoMem>,
        offset_blocks: u64,
        num_blocks: u64,
        done: Completion,
    ) {
        let fits = buf.as_ref().map_or(0, |b| b.len() as u64) >= num_blocks * self.info.block_size as u64;
        if kind != IoKind::Flush && !fits {
            finish(buf, Some(done), Err(-libc::EINVAL));
            return;
        }
        // SAFETY: the wait entry is plain data (pointers, a bool, list links); all-zero is a
        // valid value, and it is filled in before SPDK sees it.
        let wait: sys::spdk_bdev_io_wait_entry = unsafe { std::mem::zeroed() };
        issue(Box::new(IoCtx { bdev: self.clone(), kind, buf, offset_blocks, num_blocks, done: Some(done), wait }));
    }
}

fn finish(buf: Option<IoMem>, done: Option<Completion>, res: Result<(), i32>) {
    if let Some(done) = done {
        if catch_unwind(AssertUnwindSafe(move || done(buf, res))).is_err() {
            log_error(format_args!("an I/O completion panicked"));
        }
    }
}

fn finish_ctx(mut ctx: Box<IoCtx>, res: Result<(), i32>) {
    let (buf, done) = (ctx.buf.take(), ctx.done.take());
    drop(ctx);
    finish(buf, done, res);
}

/// Submits (or resubmits) an I/O. Runs on the app thread only: from `OpenBdev::submit`
/// (token) or from `io_retry`, which SPDK calls on the thread that queued the wait.
fn issue(mut ctx: Box<IoCtx>) {
    let desc = ctx.bdev.state.desc.load(Ordering::Acquire);
    let channel = ctx.bdev.state.channel.load(Ordering::Acquire);
    let bdev = ctx.bdev.state.bdev.load(Ordering::Acquire);
    if desc.is_null() || channel.is_null() {
        return finish_ctx(ctx, Err(-libc::ENODEV));
    }
    let data = ctx.buf.as_mut().map_or(ptr::null_mut(), IoMem::ptr);
    let (kind, offset, count) = (ctx.kind, ctx.offset_blocks, ctx.num_blocks);
    let raw = Box::into_raw(ctx);
    // SAFETY: on the app thread (see above), with the descriptor and channel it opened, both
    // still open (checked above; only this thread closes them). `data` is memory of at least
    // `count` blocks (checked in submit) that the context owns (a DMA buffer) or stands for
    // (caller memory, kept alive by run_pieces) until io_done takes `raw` back; SPDK calls
    // io_done exactly once when it accepts the I/O (rc 0).
    let rc = unsafe {
        match kind {
            IoKind::Read => sys::spdk_bdev_read_blocks(desc, channel, data, offset, count, Some(io_done), raw.cast()),
            IoKind::Write => sys::spdk_bdev_write_blocks(desc, channel, data, offset, count, Some(io_done), raw.cast()),
            IoKind::Flush => sys::spdk_bdev_flush_blocks(desc, channel, offset, count, Some(io_done), raw.cast()),
        }
    };
    if rc == 0 {
        return;
    }
    // SAFETY: SPDK refused the I/O, so it did not take `raw`; it is owned here again.
    let mut ctx = unsafe { Box::from_raw(raw) };
    if rc != -libc::ENOMEM {
        return finish_ctx(ctx, Err(rc));
    }
    // Out of bdev_io structures for the moment: SPDK calls io_retry when one is free.
    ctx.wait.bdev = bdev;
    ctx.wait.cb_fn = Some(io_retry);
    let raw = Box::into_raw(ctx);
    // SAFETY: `raw` is a valid, leaked IoCtx; the entry inside it stays put until io_retry
    // reclaims the box, which SPDK calls once on this thread.
    let rc = unsafe {
        (*raw).wait.cb_arg = raw.cast();
        sys::spdk_bdev_queue_io_wait(bdev, channel, &mut (*raw).wait)
    };
    if rc != 0 {
        // SAFETY: not queued, so `raw` is owned here again.
        finish_ctx(unsafe { Box::from_raw(raw) }, Err(rc));
    }
}

unsafe extern "C" fn io_retry(arg: *mut c_void) {
    // SAFETY: `arg` is the IoCtx leaked by issue for this wait entry, delivered once.
    let ctx = unsafe { Box::from_raw(arg as *mut IoCtx) };
    if catch_unwind(AssertUnwindSafe(move || issue(ctx))).is_err() {
        log_error(format_args!("resubmitting an I/O panicked"));
    }
}

unsafe extern "C" fn io_done(io: *mut sys::spdk_bdev_io, success: bool, arg: *mut c_void) {
    // SAFETY: `arg` is the IoCtx that issue leaked for this I/O; SPDK completes an I/O once.
    let ctx = unsafe { Box::from_raw(arg as *mut IoCtx) };
    let res = if success {
        Ok(())
    } else {
        let mut aio = 0;
        // SAFETY: `io` is the completed I/O, valid until spdk_bdev_free_io below.
        unsafe { sys::spdk_bdev_io_get_aio_status(io, &mut aio) };
        // The AIO status shares its storage with the NVMe status: it is the kernel's errno
        // only from the modules over the kernel (AIO, uring); anything else is EIO.
        let kernel = matches!(ctx.bdev.info.product.as_str(), "AIO disk" | "URING bdev");
        Err(if kernel && (-4095..0).contains(&aio) { aio } else { -libc::EIO })
    };
    // SAFETY: every completed I/O is freed once, on its thread (this one), after its status
    // was read.
    unsafe { sys::spdk_bdev_free_io(io) };
    let _ = catch_unwind(AssertUnwindSafe(move || finish_ctx(ctx, res)));
}

/// One piece of a batch: caller memory to read into or write from, and where on the bdev.
pub struct Piece<'a> {
    pub buf: PieceBuf<'a>,
    pub offset_blocks: u64,
    pub num_blocks: u64,
}

pub enum PieceBuf<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl PieceBuf<'_> {
    fn len(&self) -> usize {
        match self {
            PieceBuf::Read(b) => b.len(),
            PieceBuf::Write(b) => b.len(),
        }
    }
}

/// Where bounce buffers come from and go back to.
pub trait BounceBuffers {
    /// A buffer of at least `len` bytes; `None` when SPDK's memory is exhausted.
    fn take(&self, len: usize) -> Option<DmaBuf>;
    fn give(&self, buf: DmaBuf);
}

/// How much of a batch is in flight at once.
pub struct Limits {
    /// Pieces in flight.
    pub queue_depth: usize,
    /// Pieces per message to the reactor (their completions come back in one message).
    pub group: usize,
    /// Bytes per group, past its first piece.
    pub group_bytes: usize,
    /// Bytes in flight, past the first piece.
    pub in_flight_bytes: usize,
}

struct Done {
    piece: usize,
    mem: Option<IoMem>,
    res: Result<(), i32>,
}

/// The completions of one group, sent back together when the last one arrives.
struct Group {
    done: Mutex<Vec<Done>>,
    size: usize,
    tx: Sender<Vec<Done>>,
}

impl Group {
    fn report(&self, d: Done) {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        done.push(d);
        if done.len() == self.size {
            let _ = self.tx.send(std::mem::take(&mut *done));
        }
    }
}

/// Reports its piece exactly once: with the I/O's result, or, if it is dropped before its I/O
/// was submitted (the reactor stopped, a task panicked), with ECANCELED.
struct Reporter {
    group: std::sync::Arc<Group>,
    piece: usize,
    mem: Option<IoMem>,
    reported: bool,
}

impl Reporter {
    fn report(mut self, mem: Option<IoMem>, res: Result<(), i32>) {
        self.reported = true;
        self.group.report(Done { piece: self.piece, mem, res });
    }
}

impl Drop for Reporter {
    fn drop(&mut self) {
        if !self.reported {
            self.group.report(Done { piece: self.piece, mem: self.mem.take(), res: Err(-libc::ECANCELED) });
        }
    }
}

/// Runs every piece on the bdev and returns one result per piece (`Err(-errno)`), when none is
/// in flight any more. With `bounce`, writes are copied into DMA buffers before and reads out
/// of them after their I/O (on this thread); without, the bdev gets the caller's memory.
pub fn run_pieces(
    reactor: &Reactor,
    bdev: &std::sync::Arc<OpenBdev>,
    pieces: &mut [Piece<'_>],
    bounce: Option<&dyn BounceBuffers>,
    limits: &Limits,
) -> Vec<Result<(), i32>> {
    let n = pieces.len();
    let lens: Vec<usize> = pieces.iter().map(|p| p.buf.len()).collect();
    let mut results = vec![Ok(()); n];
    let (tx, rx) = crossbeam_channel::unbounded::<Vec<Done>>();
    let (mut next, mut in_flight, mut bytes) = (0, 0usize, 0usize);
    loop {
        // Fill the window, a group (one message) at a time.
        while next < n && in_flight < limits.queue_depth {
            let (mut group, mut group_bytes) = (Vec::new(), 0);
            while next < n && group.len() < limits.group && in_flight + group.len() < limits.queue_depth {
                let len = lens[next];
                let busy = in_flight + group.len() > 0;
                if (!group.is_empty() && group_bytes + len > limits.group_bytes)
                    || (busy && bytes + len > limits.in_flight_bytes)
                {
                    break;
                }
                let piece = &mut pieces[next];
                let (kind, mem) = match (bounce, &mut piece.buf) {
                    (None, PieceBuf::Read(b)) => {
                        (IoKind::Read, IoMem::Caller { ptr: NonNull::from(&mut **b).cast(), len: b.len() })
                    }
                    (None, PieceBuf::Write(b)) => {
                        (IoKind::Write, IoMem::Caller { ptr: NonNull::from(&**b).cast(), len: b.len() })
                    }
                    (Some(pool), buf) => match pool.take(len) {
                        Some(mut dma) => match buf {
                            PieceBuf::Write(src) => {
                                dma.as_mut_slice()[..len].copy_from_slice(src);
                                (IoKind::Write, IoMem::Dma(dma))
                            }
                            PieceBuf::Read(_) => (IoKind::Read, IoMem::Dma(dma)),
                        },
                        None if busy => break, // wait for buffers to come back
                        None => {
                            results[next] = Err(-libc::ENOMEM);
                            next += 1;
                            continue;
                        }
                    },
                };
                group.push((next, kind, mem, piece.offset_blocks, piece.num_blocks));
                group_bytes += len;
                bytes += len;
                next += 1;
            }
            if group.is_empty() {
                break;
            }
            in_flight += group.len();
            send_group(reactor, bdev, group, &tx);
        }
        if in_flight == 0 {
            if next >= n {
                return results;
            }
            continue;
        }
        // Wait for a group, then take whatever else has arrived. (This function holds a
        // sender, so the channel never closes: with caller memory in flight, it must not
        // return before every piece has reported.)
        let Ok(first) = rx.recv() else { continue };
        for done in std::iter::once(first).chain(rx.try_iter()).flatten() {
            in_flight -= 1;
            bytes -= lens[done.piece];
            match done.res {
                Ok(()) => {
                    if let (PieceBuf::Read(dst), Some(IoMem::Dma(dma))) = (&mut pieces[done.piece].buf, &done.mem) {
                        dst.copy_from_slice(&dma.as_slice()[..dst.len()]);
                    }
                }
                Err(rc) => results[done.piece] = Err(rc),
            }
            if let (Some(pool), Some(IoMem::Dma(dma))) = (bounce, done.mem) {
                pool.give(dma);
            }
        }
    }
}

/// Hands a group to the reactor in one message. Every piece reports, whatever happens.
fn send_group(
    reactor: &Reactor,
    bdev: &std::sync::Arc<OpenBdev>,
    group: Vec<(usize, IoKind, IoMem, u64, u64)>,
    tx: &Sender<Vec<Done>>,
) {
    let sink = std::sync::Arc::new(Group {
        done: Mutex::new(Vec::with_capacity(group.len())),
        size: group.len(),
        tx: tx.clone(),
    });
    let reporters: Vec<(Reporter, IoKind, u64, u64)> = group
        .into_iter()
        .map(|(piece, kind, mem, offset, count)| {
            (Reporter { group: sink.clone(), piece, mem: Some(mem), reported: false }, kind, offset, count)
        })
        .collect();
    let bdev = bdev.clone();
    // If the reactor has stopped, the job is dropped with its reporters, which report ECANCELED.
    let _ = reactor.exec(move |r| {
        for (mut reporter, kind, offset, count) in reporters {
            let mem = reporter.mem.take();
            bdev.submit(r, kind, mem, offset, count, Box::new(move |mem, res| reporter.report(mem, res)));
        }
    });
}
