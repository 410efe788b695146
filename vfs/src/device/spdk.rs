//! The SPDK device: a store on an SPDK bdev (an AIO or io_uring bdev over a file or block
//! device, a local NVMe SSD driven from user space, an NVMe-oF namespace), named by the store
//! path `spdk:CONFIG.json#BDEV`. docs/spdk.md is the user's guide.
//!
//! SPDK's app framework starts once per process, on the first open, on its own reactor thread
//! (`spdk_ffi`), and is stopped when the process exits; it cannot be started a second time.
//! Devices share it: each open loads its config file unless that file was loaded already, and
//! opens the bdev; dropping the device closes the bdev (the bdev itself lives until exit).
//!
//! I/O (`spdk_ffi::run_pieces`): a batch is cut into pieces of at most 1 MiB, handed to the
//! reactor in groups of up to 32 (one message per group); each group's completions come back
//! together on a channel (one wake-up of the caller per group). Up to [`QUEUE_DEPTH`] pieces
//! of one batch are in flight. AIO and uring bdevs get the caller's memory (the kernel needs
//! nothing more); other bdevs (NVMe) get DMA buffers from the device's pool, which writes are
//! copied into and reads out of on the caller's thread.

use super::spdk_config::{Config, EnvOptions, SpdkPath};
use super::spdk_ffi::{
    self as ffi, BdevInfo, BounceBuffers, DmaBuf, Limits, OnReactor, OpenBdev, Piece, PieceBuf, Reactor,
};
use super::{check_op, AlignedBuf, BlockDevice, DeviceInfo, Geometry, IoOp, PAGE};
use crossbeam_channel::{bounded, Sender};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Pieces of one batch in flight at once.
pub const QUEUE_DEPTH: usize = 128;
/// The largest piece handed to the bdev (the bdev layer splits further as its device needs).
const MAX_PIECE: usize = 1 << 20;
const LIMITS: Limits = Limits {
    queue_depth: QUEUE_DEPTH,
    // Pieces per message to the reactor, whose completions come back in one message (one
    // wake-up of the caller): at most 32, and at most 1 MiB, so that the copies of one group
    // overlap the I/O of the group before.
    group: 32,
    group_bytes: 1 << 20,
    // Bounce memory one batch may have in flight.
    in_flight_bytes: 32 << 20,
};
/// DMA memory a device keeps for reuse between batches.
const POOL_BYTES: usize = 32 << 20;

/// Bdev modules (by product name) that hand I/O buffers to the kernel: no bounce buffers.
const ZERO_COPY_PRODUCTS: &[&str] = &["AIO disk", "URING bdev"];

/// The process's SPDK: started by the first open, never restarted.
struct Runtime {
    reactor: Reactor,
    /// The environment SPDK runs with, and the config it came from.
    env: EnvOptions,
    env_from: PathBuf,
    /// Configs loaded, and the bdevs each created (bdev name → config).
    loaded: Mutex<BTreeSet<PathBuf>>,
    created: Mutex<BTreeMap<String, PathBuf>>,
}

static RUNTIME: Mutex<Option<Result<Arc<Runtime>, String>>> = Mutex::new(None);

impl Runtime {
    /// The running SPDK with `config` loaded: starts SPDK with it the first time.
    fn with(config: &Config) -> io::Result<Arc<Runtime>> {
        let mut slot = RUNTIME.lock().unwrap_or_else(|p| p.into_inner());
        match &*slot {
            Some(Ok(rt)) => {
                let rt = rt.clone();
                drop(slot);
                rt.load(config)?;
                return Ok(rt);
            }
            Some(Err(e)) => {
                return Err(io::Error::other(format!(
                    "SPDK failed to start earlier in this process, and it can start only once per process: {e}"
                )))
            }
            None => {}
        }
        match Reactor::start(&config.env, config.spdk_json.clone()) {
            Ok(reactor) => {
                let rt = Arc::new(Runtime {
                    reactor,
                    env: config.env.clone(),
                    env_from: config.path.clone(),
                    loaded: Mutex::new([config.path.clone()].into()),
                    created: Mutex::new(config.creates.iter().map(|n| (n.clone(), config.path.clone())).collect()),
                });
                *slot = Some(Ok(rt.clone()));
                ffi::at_exit(shutdown_at_exit);
                Ok(rt)
            }
            Err(e) => {
                *slot = Some(Err(e.clone()));
                remove_runtime_dir();
                Err(io::Error::other(e))
            }
        }
    }

    /// Runs `f` on the reactor and waits for what it sends back.
    fn call<T: Send + 'static>(&self, f: impl FnOnce(&OnReactor, Sender<T>) + Send + 'static) -> io::Result<T> {
        let (tx, rx) = bounded(1);
        self.reactor.exec(move |r| f(r, tx))?;
        rx.recv().map_err(|_| io::Error::other("the SPDK reactor dropped a request (it is stopping)"))
    }

    /// Loads a config file's bdevs unless it was loaded before.
    fn load(&self, config: &Config) -> io::Result<()> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|p| p.into_inner());
        if loaded.contains(&config.path) {
            return Ok(());
        }
        if config.env_explicit && config.env != self.env {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "SPDK already runs in this process with the environment of {}; {} asks for another one \
                     (its \"ctxfs\" options and the CTXFS_SPDK_* variables apply once per process)",
                    self.env_from.display(),
                    config.path.display()
                ),
            ));
        }
        let mut created = self.created.lock().unwrap_or_else(|p| p.into_inner());
        let existing = self.call(|r, tx| {
            let _ = tx.send(ffi::bdev_names(r));
        })?;
        for name in &config.creates {
            if existing.contains(name) {
                let by = created.get(name).map_or("another config".to_string(), |p| p.display().to_string());
                return Err(io::Error::new(
                    io::ErrorKind::AlreadyExists,
                    format!(
                        "{} creates bdev {name:?}, which already exists in this process (created by {by}); \
                         bdev names must be unique per process",
                        config.path.display()
                    ),
                ));
            }
        }
        let json = config.spdk_json.clone();
        let rc = self.call(move |r, tx| {
            ffi::load_config(
                r,
                json,
                Box::new(move |rc| {
                    let _ = tx.send(rc);
                }),
            )
        })?;
        if rc == 0 {
            loaded.insert(config.path.clone());
            for name in &config.creates {
                created.insert(name.clone(), config.path.clone());
            }
        }
        Ok(())
    }
}

fn shutdown_at_exit() {
    let rt = match RUNTIME.try_lock() {
        Ok(slot) => match &*slot {
            Some(Ok(rt)) => rt.clone(),
            _ => return,
        },
        Err(_) => return,
    };
    rt.reactor.stop(Duration::from_secs(5));
    remove_runtime_dir();
}

/// DPDK leaves an empty runtime directory per process (`/var/run/dpdk/spdk_pid<PID>` for root);
/// remove it if it is empty.
fn remove_runtime_dir() {
    let name = format!("spdk_pid{}", std::process::id());
    let mut bases = vec![PathBuf::from("/var/run/dpdk"), PathBuf::from("/tmp/dpdk")];
    if let Some(xdg) = std::env::var_os("XDG_RUNTIME_DIR") {
        bases.push(PathBuf::from(xdg).join("dpdk"));
    }
    for base in bases {
        let _ = std::fs::remove_dir(base.join(&name));
    }
}

/// How `flush` makes writes durable.
enum Flush {
    /// The bdev's own flush (NVMe flush, fsync by the AIO bdev).
    Bdev,
    /// The bdev cannot flush (SPDK's uring bdev): fdatasync its backing file, named in the config.
    Sync(File),
    /// Neither: writes are as durable as the bdev makes them.
    Nothing,
}

/// DMA buffers kept for reuse, by power-of-two size class.
struct Pool {
    align: usize,
    free: Mutex<(Vec<Vec<DmaBuf>>, usize)>,
}

/// The pool, with the reactor whose environment its buffers come from.
struct Bounce<'a> {
    pool: &'a Pool,
    reactor: &'a Reactor,
}

impl BounceBuffers for Bounce<'_> {
    fn take(&self, len: usize) -> Option<DmaBuf> {
        self.pool.take(self.reactor, len)
    }
    fn give(&self, buf: DmaBuf) {
        self.pool.give(buf)
    }
}

impl Pool {
    fn class(len: usize) -> (usize, usize) {
        let size = len.next_power_of_two().max(PAGE);
        (size, (size / PAGE).trailing_zeros() as usize)
    }

    fn take(&self, reactor: &Reactor, len: usize) -> Option<DmaBuf> {
        let (size, class) = Self::class(len);
        {
            let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(buf) = free.0.get_mut(class).and_then(Vec::pop) {
                free.1 -= buf.len();
                return Some(buf);
            }
        }
        DmaBuf::alloc(reactor, size, self.align)
    }

    fn give(&self, buf: DmaBuf) {
        let (_, class) = Self::class(buf.len());
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        if free.1 + buf.len() <= POOL_BYTES {
            if free.0.len() <= class {
                free.0.resize_with(class + 1, Vec::new);
            }
            free.1 += buf.len();
            free.0[class].push(buf);
        }
    }
}

/// A store's device on an SPDK bdev.
pub struct SpdkDevice {
    path: String,
    rt: Arc<Runtime>,
    bdev: Arc<OpenBdev>,
    info: BdevInfo,
    geo: Geometry,
    flush: Flush,
    note: Option<String>,
    /// Bounce buffers; `None`: the bdev gets the caller's memory (bdevs over the kernel).
    pool: Option<Pool>,
}

fn errno_error(rc: i32, what: &str) -> io::Error {
    let e = io::Error::from_raw_os_error(-rc);
    io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl SpdkDevice {
    /// Opens the bdev of `spec` (starting SPDK, or loading the config, as needed). With
    /// `block_size` `None` the device uses the bdev's block size (at least a page).
    pub fn open(spec: &SpdkPath, block_size: Option<usize>) -> io::Result<SpdkDevice> {
        let display = format!("{}{}#{}", super::spdk_config::PREFIX, spec.config.display(), spec.bdev);
        if !spec.config.is_file() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{display}: SPDK config {} not found", spec.config.display()),
            ));
        }
        let config = Config::read(&spec.config).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let rt = Runtime::with(&config)?;
        let name = spec.bdev.clone();
        let opened = rt.call(move |r, tx| {
            let res = match OpenBdev::open(r, &name) {
                Ok(b) => Ok(Arc::new(b)),
                Err(rc) => Err((rc, ffi::bdev_names(r))),
            };
            let _ = tx.send(res);
        })?;
        let bdev = match opened {
            Ok(b) => b,
            Err((rc, names)) if rc == -libc::ENODEV => {
                return Err(io::Error::new(
                    io::ErrorKind::NotFound,
                    format!(
                        "{display}: no SPDK bdev named {:?} (bdevs in this process: {}); if {} should create it, \
                         SPDK's messages above say why it could not",
                        spec.bdev,
                        if names.is_empty() { "none".to_string() } else { names.join(", ") },
                        spec.config.display()
                    ),
                ))
            }
            Err((rc, _)) => return Err(errno_error(rc, &format!("{display}: cannot open SPDK bdev {:?}", spec.bdev))),
        };
        let info = bdev.info.clone();
        // From here on, dropping `dev` closes the bdev.
        let mut dev = SpdkDevice {
            path: display.clone(),
            rt,
            bdev,
            geo: Geometry { block_size: 0, num_blocks: 0 },
            flush: Flush::Nothing,
            note: None,
            // AIO and uring bdevs pass buffers to the kernel, which takes any memory aligned as
            // the store's buffers are (pages); everything else (NVMe above all) needs memory
            // from SPDK's environment.
            pool: (!ZERO_COPY_PRODUCTS.contains(&info.product.as_str()) || info.buf_align > PAGE)
                .then(|| Pool { align: info.buf_align.max(PAGE), free: Mutex::new((Vec::new(), 0)) }),
            info: info.clone(),
        };
        let bs = block_size.unwrap_or(info.block_size.max(PAGE));
        if info.block_size == 0 || !bs.is_multiple_of(info.block_size) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{display}: block size mismatch: the store uses {bs}-byte blocks, which are not whole \
                     blocks of bdev {:?} ({}-byte blocks)",
                    info.name, info.block_size
                ),
            ));
        }
        let bytes = info.num_blocks.saturating_mul(info.block_size as u64);
        dev.geo = Geometry { block_size: bs, num_blocks: bytes / bs as u64 };
        let (flush, note) = if info.flush {
            (Flush::Bdev, None)
        } else if let Some(file) = config.files.get(&spec.bdev) {
            let f = File::open(file).map_err(|e| {
                io::Error::new(e.kind(), format!("{display}: cannot open {} to flush it: {e}", file.display()))
            })?;
            (Flush::Sync(f), Some(format!("{} has no flush: ctxfs fdatasyncs {}", info.product, file.display())))
        } else {
            (
                Flush::Nothing,
                Some(format!("{} has no flush: writes are as durable as the bdev makes them", info.product)),
            )
        };
        dev.flush = flush;
        dev.note = note;
        Ok(dev)
    }

    /// About the bdev under the store.
    pub fn bdev_info(&self) -> String {
        let i = &self.info;
        format!("{} ({}, {} blocks of {} bytes)", i.name, i.product, i.num_blocks, i.block_size)
    }

    /// Whether I/O goes to the bdev straight from the caller's memory (AIO and uring bdevs)
    /// rather than through DMA bounce buffers.
    pub fn zero_copy(&self) -> bool {
        self.pool.is_none()
    }
}

impl BlockDevice for SpdkDevice {
    fn geometry(&self) -> Geometry {
        self.geo
    }

    fn info(&self) -> DeviceInfo {
        DeviceInfo { kind: "spdk", path: self.path.clone(), note: self.note.clone(), queue_depth: QUEUE_DEPTH as u32 }
    }

    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<io::Result<()>> {
        let mut results: Vec<io::Result<()>> = ops.iter().map(|op| check_op(op, self.geo)).collect();
        let (bs, bdev_bs) = (self.geo.block_size as u64, self.info.block_size);
        let mut pieces = Vec::new();
        let mut owner = Vec::new();
        for (i, op) in ops.iter_mut().enumerate() {
            if results[i].is_err() {
                continue;
            }
            let start = op.block() * bs / bdev_bs as u64;
            let at = |k: usize| start + (k * MAX_PIECE / bdev_bs) as u64;
            match op {
                IoOp::Read { buf, .. } => {
                    for (k, chunk) in buf.chunks_mut(MAX_PIECE).enumerate() {
                        let num_blocks = (chunk.len() / bdev_bs) as u64;
                        pieces.push(Piece { buf: PieceBuf::Read(chunk), offset_blocks: at(k), num_blocks });
                        owner.push(i);
                    }
                }
                IoOp::Write { buf, .. } => {
                    for (k, chunk) in buf.chunks(MAX_PIECE).enumerate() {
                        let num_blocks = (chunk.len() / bdev_bs) as u64;
                        pieces.push(Piece { buf: PieceBuf::Write(chunk), offset_blocks: at(k), num_blocks });
                        owner.push(i);
                    }
                }
            }
        }
        let bounce = self.pool.as_ref().map(|pool| Bounce { pool, reactor: &self.rt.reactor });
        let done = ffi::run_pieces(
            &self.rt.reactor,
            &self.bdev,
            &mut pieces,
            bounce.as_ref().map(|b| b as &dyn BounceBuffers),
            &LIMITS,
        );
        for (i, res) in done.into_iter().enumerate() {
            let Err(rc) = res else { continue };
            if results[owner[i]].is_ok() {
                results[owner[i]] = Err(if rc == -libc::ENOMEM {
                    io::Error::new(
                        io::ErrorKind::OutOfMemory,
                        "SPDK DMA memory exhausted (raise \"mem_size_mb\" in the SPDK config)",
                    )
                } else {
                    io::Error::from_raw_os_error(-rc)
                });
            }
        }
        results
    }

    fn flush(&self) -> io::Result<()> {
        match &self.flush {
            Flush::Bdev => {
                let bdev = self.bdev.clone();
                let res = self.rt.call(move |r, tx| {
                    bdev.flush(
                        r,
                        Box::new(move |res| {
                            let _ = tx.send(res);
                        }),
                    )
                })?;
                res.map_err(|rc| io::Error::from_raw_os_error(-rc))
            }
            Flush::Sync(file) => file.sync_data(),
            Flush::Nothing => Ok(()),
        }
    }
}

impl Drop for SpdkDevice {
    fn drop(&mut self) {
        let bdev = self.bdev.clone();
        let _ = self.rt.call(move |r, tx| {
            bdev.close(r);
            let _ = tx.send(());
        });
    }
}

/// The first `len` bytes of an SPDK store path (`len` a multiple of the page size); what
/// lies beyond the bdev's end reads as zeros.
pub fn read_prefix(spec: &SpdkPath, len: usize) -> io::Result<AlignedBuf> {
    let dev = SpdkDevice::open(spec, None)?;
    let bs = dev.geo.block_size;
    let have = dev.geo.num_blocks.saturating_mul(bs as u64).min(len as u64) as usize / bs * bs;
    let mut buf = AlignedBuf::zeroed(len);
    if have > 0 {
        let res = dev.submit(&mut [IoOp::Read { block: 0, buf: &mut buf[..have] }]);
        res.into_iter().next().unwrap_or(Ok(()))?;
    }
    Ok(buf)
}
