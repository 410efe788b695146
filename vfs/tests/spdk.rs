//! The store on SPDK bdevs (`--features spdk`): an AIO bdev and an io_uring bdev, each over a
//! file, without hugepages or PCI. Format, commits, recovery after a cut, concurrent readers,
//! corruption, injected I/O errors (SPDK's error bdev, whose I/O also takes the DMA bounce
//! buffer path that NVMe bdevs use), and the errors of a bad path, config, bdev or block size.
//! All tests of this binary share one SPDK (it starts once per process).
#![cfg(feature = "spdk")]

mod common;
use common::*;
use ctxfs_vfs::device::{self, AlignedBuf, Geometry, IoOp, SpdkDevice, SpdkPath};
use ctxfs_vfs::format::BlockKind;
use ctxfs_vfs::inspect::live_blocks;
use ctxfs_vfs::{fsck, BlockDevice, DeviceChoice, DeviceInfo, Error, FileStream, SplitMix64, Store};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, AtomicUsize, Ordering};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Aio,
    Uring,
}

const KINDS: [Kind; 2] = [Kind::Aio, Kind::Uring];

impl Kind {
    fn method(self) -> &'static str {
        match self {
            Kind::Aio => "bdev_aio_create",
            Kind::Uring => "bdev_uring_create",
        }
    }
}

/// A bdev over a fresh image file, and the store path that names it.
struct Bdev {
    image: PathBuf,
    config: PathBuf,
    name: String,
}

impl Bdev {
    fn path(&self) -> PathBuf {
        PathBuf::from(format!("spdk:{}#{}", self.config.display(), self.name))
    }
}

/// Bdev names are unique per process: every test makes its own.
fn unique(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!("{prefix}{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

fn write_config(path: &Path, calls: &str) {
    let text = format!(r#"{{"subsystems": [{{"subsystem": "bdev", "config": [{calls}]}}]}}"#);
    std::fs::write(path, text).unwrap();
}

/// An AIO or uring bdev with `bdev_block_size`-byte blocks over a new file of `size` bytes.
fn bdev_with(dir: &Path, kind: Kind, size: u64, bdev_block_size: usize) -> Bdev {
    let name = unique(match kind {
        Kind::Aio => "aio",
        Kind::Uring => "uring",
    });
    let image = dir.join(format!("{name}.img"));
    std::fs::File::create(&image).unwrap().set_len(size).unwrap();
    let config = dir.join(format!("{name}.json"));
    // A relative file name is taken relative to the config's directory.
    let call = format!(
        r#"{{"method": "{}", "params": {{"name": "{name}", "filename": "{name}.img", "block_size": {bdev_block_size}}}}}"#,
        kind.method()
    );
    write_config(&config, &call);
    Bdev { image, config, name }
}

fn bdev(dir: &Path, kind: Kind, size: u64) -> Bdev {
    bdev_with(dir, kind, size, BS)
}

fn open_dev(b: &Bdev) -> Arc<dyn BlockDevice> {
    Arc::from(device::open_path(&b.path(), DeviceChoice::Auto, BS, ctxfs_vfs::Access::Write).unwrap())
}

fn format(b: &Bdev) -> Store {
    ctxfs_vfs::format(open_dev(b)).unwrap()
}

fn write_raw(path: &Path, block: u64, data: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, block * BS as u64).unwrap();
    f.sync_all().unwrap();
}

fn read_raw(path: &Path, block: u64) -> Vec<u8> {
    let mut buf = vec![0; BS];
    std::fs::File::open(path).unwrap().read_exact_at(&mut buf, block * BS as u64).unwrap();
    buf
}

#[test]
fn workload_round_trips_on_aio_and_uring_bdevs() {
    for kind in KINDS {
        let dir = tmpdir();
        let b = bdev(dir.path(), kind, 16 << 20);
        let store = format(&b);
        let info = store.device_info();
        assert_eq!(info.kind, "spdk", "{kind:?}: {info:?}");
        assert!(info.queue_depth >= 32, "{info:?}");
        let model = workload(&store, 21, |_| {}).unwrap();
        assert_matches(&store, &model);
        drop(store);
        // Reopened as another program would: the block size is probed through SPDK too.
        let store = Store::open_path(&b.path(), DeviceChoice::Auto).unwrap();
        assert_matches(&store, &model);
        let report = fsck::check(store.device().as_ref()).unwrap();
        assert!(report.is_clean(), "{kind:?}: {:?}", report.problems);
        let live = live_blocks(&store.snapshot()).unwrap();
        assert_eq!(report.blocks_checked, live.len() as u64);
        drop(store);
        // The same bytes through the kernel: SPDK wrote the file ctxfs's own devices read.
        let store = Store::open_path(&b.image, DeviceChoice::Uring).unwrap();
        assert_matches(&store, &model);
    }
}

#[test]
fn family_workload_round_trips() {
    for kind in KINDS {
        let dir = tmpdir();
        let b = bdev(dir.path(), kind, 16 << 20);
        let model = family_workload(&format(&b), 5, |_| {}).unwrap();
        let store = Store::open_path(&b.path(), DeviceChoice::Auto).unwrap();
        assert_matches(&store, &model);
        assert!(fsck::check(store.device().as_ref()).unwrap().is_clean());
    }
}

/// Batches of every shape from several threads at once: single blocks, runs that span the
/// 1 MiB pieces the device cuts batches into, batches deeper than its queue.
#[test]
fn concurrent_batches_of_all_sizes_round_trip() {
    for kind in KINDS {
        let dir = tmpdir();
        let b = bdev(dir.path(), kind, 64 << 20);
        let dev = open_dev(&b);
        let per_thread = dev.num_blocks() / 4;
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let dev = dev.clone();
                std::thread::spawn(move || {
                    let mut rng = SplitMix64::new(t);
                    let base = t * per_thread;
                    for round in 0..6 {
                        // Disjoint runs of 1..=700 blocks, 1..=300 of them per batch.
                        let mut runs = Vec::new();
                        let mut at = base;
                        while runs.len() < 1 + rng.below(300) as usize {
                            let len = if round % 2 == 0 { 1 } else { 1 + rng.below(700) };
                            if at + len > base + per_thread {
                                break;
                            }
                            runs.push((at, len));
                            at += len + rng.below(3);
                        }
                        let mut bufs: Vec<AlignedBuf> = runs
                            .iter()
                            .map(|&(blk, len)| {
                                let mut buf = AlignedBuf::zeroed(len as usize * BS);
                                for (i, chunk) in buf.chunks_mut(8).enumerate() {
                                    chunk.copy_from_slice(&(blk * 1_000_003 + i as u64 + round).to_le_bytes());
                                }
                                buf
                            })
                            .collect();
                        let mut ops: Vec<IoOp<'_>> =
                            runs.iter().zip(&bufs).map(|(&(block, _), buf)| IoOp::Write { block, buf }).collect();
                        assert!(dev.submit(&mut ops).into_iter().all(|r| r.is_ok()));
                        let mut back: Vec<AlignedBuf> = bufs.iter().map(|b| AlignedBuf::zeroed(b.len())).collect();
                        let mut ops: Vec<IoOp<'_>> = runs
                            .iter()
                            .zip(back.iter_mut())
                            .map(|(&(block, _), buf)| IoOp::Read { block, buf })
                            .collect();
                        assert!(dev.submit(&mut ops).into_iter().all(|r| r.is_ok()));
                        drop(ops);
                        for (i, (a, b)) in bufs.iter_mut().zip(&back).enumerate() {
                            assert!(
                                a[..] == b[..],
                                "thread {t} round {round}: run {i} {:?} read back other bytes",
                                runs[i]
                            );
                        }
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        dev.flush().unwrap();
        // Out-of-range and misaligned operations are refused before they reach SPDK.
        let (mut a, mut b) = (AlignedBuf::zeroed(BS), AlignedBuf::zeroed(BS));
        let end = dev.num_blocks();
        let r = dev.submit(&mut [IoOp::Read { block: end, buf: &mut a }, IoOp::Read { block: 0, buf: &mut b[..512] }]);
        assert!(r.iter().all(|r| r.as_ref().is_err_and(|e| e.kind() == io::ErrorKind::InvalidInput)), "{r:?}");
    }
}

#[test]
fn readers_keep_reading_while_a_writer_commits() {
    let dir = tmpdir();
    let b = bdev(dir.path(), Kind::Uring, 32 << 20);
    let store = Arc::new(format(&b));
    readers_survive_churn(store);
}

/// Passes the first `left` writes and flushes through, then fails every later one: what
/// reaches the bdev is exactly a prefix of what the store wrote, as after a power cut.
struct Cut {
    inner: Arc<dyn BlockDevice>,
    left: AtomicI64,
}

impl Cut {
    fn pass(&self) -> bool {
        self.left.fetch_sub(1, Ordering::SeqCst) > 0
    }
}

impl BlockDevice for Cut {
    fn geometry(&self) -> Geometry {
        self.inner.geometry()
    }
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }
    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<io::Result<()>> {
        let pass: Vec<bool> = ops.iter().map(|op| matches!(op, IoOp::Read { .. }) || self.pass()).collect();
        let mut through: Vec<IoOp<'_>> = ops
            .iter_mut()
            .zip(&pass)
            .filter(|(_, &p)| p)
            .map(|(op, _)| match op {
                IoOp::Read { block, buf } => IoOp::Read { block: *block, buf: &mut buf[..] },
                IoOp::Write { block, buf } => IoOp::Write { block: *block, buf: &buf[..] },
            })
            .collect();
        let mut done = self.inner.submit(&mut through).into_iter();
        pass.iter()
            .map(|&p| if p { done.next().unwrap() } else { Err(io::Error::from_raw_os_error(libc::EIO)) })
            .collect()
    }
    fn flush(&self) -> io::Result<()> {
        if self.pass() {
            self.inner.flush()
        } else {
            Err(io::Error::from_raw_os_error(libc::EIO))
        }
    }
}

#[test]
fn recovery_after_a_cut_finds_the_last_commit_or_the_one_in_flight() {
    for kind in KINDS {
        let dir = tmpdir();
        let b = bdev(dir.path(), kind, 8 << 20);
        let cut = |left: i64| {
            let dev = Arc::new(Cut { inner: open_dev(&b), left: AtomicI64::new(i64::MAX) });
            let store = ctxfs_vfs::format(dev.clone()).unwrap();
            dev.left.store(left, Ordering::SeqCst);
            (dev, store)
        };
        let (dev, store) = cut(i64::MAX);
        workload(&store, 3, |_| {}).unwrap();
        let total = i64::MAX - dev.left.load(Ordering::SeqCst);
        drop(store);
        let mut tried = 0;
        let mut new_states = 0;
        for point in (0..total).step_by((total as usize / 24).max(1)) {
            let (_, store) = cut(point);
            let Err(stop) = workload(&store, 3, |_| {}) else { continue };
            drop(store);
            let store = Store::open(open_dev(&b)).unwrap_or_else(|e| panic!("{kind:?} cut at {point}: reopen: {e}"));
            let is_old = matches(&store, &stop.committed);
            let is_new = !is_old && matches(&store, &stop.attempted);
            assert!(is_old || is_new, "{kind:?} cut at {point}: neither the committed nor the attempted state");
            new_states += is_new as usize;
            let report = fsck::check(store.device().as_ref()).unwrap();
            assert!(report.is_clean(), "{kind:?} cut at {point}: {:?}", report.problems);
            let mut txn = store.begin().unwrap();
            txn.create_context("after-cut", shape(1, 1), &[1, 2, 3]).unwrap();
            txn.commit().unwrap();
            assert!(fsck::check(store.device().as_ref()).unwrap().is_clean());
            tried += 1;
        }
        assert!(tried >= 20, "{kind:?}: only {tried} cut points");
        println!("{kind:?}: {tried} cut points of {total} operations, {new_states} recovered the commit in flight");
    }
}

#[test]
fn fsck_names_damaged_blocks_and_reads_refuse_them() {
    for kind in KINDS {
        let dir = tmpdir();
        let b = bdev(dir.path(), kind, 8 << 20);
        let store = format(&b);
        workload(&store, 7, |_| {}).unwrap();
        let live = live_blocks(&store.snapshot()).unwrap();
        let active = store.snapshot().superblock().slot();
        drop(store);
        let candidates: Vec<u64> = live.iter().map(|l| l.block).filter(|&b| b != active).collect();
        let mut rng = SplitMix64::new(11);
        for trial in 0..24 {
            let block = candidates[rng.below(candidates.len() as u64) as usize];
            let original = read_raw(&b.image, block);
            let mut bad = original.clone();
            if trial % 2 == 0 {
                let bit = rng.below((BS * 8) as u64) as usize;
                bad[bit / 8] ^= 1 << (bit % 8);
            } else {
                bad.fill(0);
            }
            write_raw(&b.image, block, &bad);
            let dev = open_dev(&b);
            let report = fsck::check(dev.as_ref()).unwrap();
            assert_eq!(report.exit_code(), fsck::EXIT_UNCORRECTED, "{kind:?} trial {trial} block {block}");
            assert!(report.damaged_blocks().contains(&block), "{kind:?} trial {trial}: {:?}", report.problems);
            match Store::open(dev) {
                Err(e) => assert_eq!(e.block(), Some(block), "{kind:?} trial {trial}: {e}"),
                Ok(store) => {
                    let kind_of = live.iter().find(|l| l.block == block).unwrap().kind;
                    if matches!(kind_of, BlockKind::Data | BlockKind::Index) {
                        let snap = store.snapshot();
                        let hit = snap.contexts().any(|c| {
                            let ctx = snap.context(&c.name).unwrap();
                            (0..c.shape.layers).any(|l| {
                                (0..c.shape.kv_heads).any(|h| {
                                    [FileStream::Index, FileStream::Data].into_iter().any(|w| {
                                        let s = ctx.stream(l, h, w).unwrap();
                                        (0..s.blocks()).any(|i| match s.read(i) {
                                            Err(Error::Damaged { block: at, .. }) => at == block,
                                            Err(e) => panic!("{e}"),
                                            Ok(_) => false,
                                        })
                                    })
                                })
                            })
                        });
                        assert!(hit, "{kind:?} trial {trial}: damaged block {block} read as good");
                    }
                }
            }
            write_raw(&b.image, block, &original);
        }
        // A damaged active superblock: recovery falls back, repair (through SPDK) rewrites it.
        let mut sb = read_raw(&b.image, active);
        sb[100] ^= 0x40;
        write_raw(&b.image, active, &sb);
        let store = Store::open(open_dev(&b)).unwrap();
        assert_ne!(store.snapshot().superblock().slot(), active);
        drop(store);
        let repaired = fsck::repair(open_dev(&b), false).unwrap();
        assert_eq!(repaired.exit_code(), fsck::EXIT_CORRECTED, "{repaired:?}");
        assert!(fsck::check(open_dev(&b).as_ref()).unwrap().is_clean());
    }
}

/// An AIO bdev under SPDK's error bdev (`EE_<name>`), whose faults are injected by loading
/// further configs that call `bdev_error_inject_error`.
struct Faulty {
    dir: PathBuf,
    base: Bdev,
    ee: String,
}

impl Faulty {
    fn new(dir: &Path) -> Faulty {
        let mut base = bdev(dir, Kind::Aio, 8 << 20);
        let call = format!(
            r#"{{"method": "bdev_aio_create", "params": {{"name": "{0}", "filename": "{0}.img", "block_size": 4096}}}},
               {{"method": "bdev_error_create", "params": {{"base_name": "{0}"}}}}"#,
            base.name
        );
        write_config(&base.config, &call);
        let ee = format!("EE_{}", base.name);
        base.name = ee.clone();
        Faulty { dir: dir.to_path_buf(), base, ee }
    }

    /// Makes the next `num` I/Os of `io_type` fail in the way `error_type` says.
    fn inject(&self, io_type: &str, error_type: &str, num: u32, extra: &str) {
        let config = self.dir.join(format!("{}.json", unique("inject")));
        let call = format!(
            r#"{{"method": "bdev_error_inject_error", "params": {{"name": "{}", "io_type": "{io_type}",
               "error_type": "{error_type}", "num": {num}{extra}}}}}"#,
            self.ee
        );
        write_config(&config, &call);
        // Opening a path loads its config (once per process): that runs the injection.
        let path = PathBuf::from(format!("spdk:{}#{}", config.display(), self.ee));
        drop(device::open_path(&path, DeviceChoice::Auto, BS, ctxfs_vfs::Access::Write).unwrap());
    }
}

#[test]
fn injected_read_errors_and_corruption_name_the_block() {
    let dir = tmpdir();
    let f = Faulty::new(dir.path());
    let spec = SpdkPath::parse(&f.base.path()).unwrap().unwrap();
    assert!(!SpdkDevice::open(&spec, None).unwrap().zero_copy(), "the error bdev goes through bounce buffers");
    let store = format(&f.base);
    let model = workload(&store, 3, |_| {}).unwrap();
    let snap = store.snapshot();
    let ctx = snap.context("gamma").unwrap();
    let stream = ctx.stream(0, 1, FileStream::Data).unwrap();
    let (bad, _) = stream.locate(1).unwrap();
    f.inject("read", "failure", 1, "");
    match stream.read(1) {
        Err(Error::BlockIo { block, source }) => {
            assert_eq!(block, bad);
            assert!(source.to_string().contains("os error 5"), "EIO, as from the kernel's devices: {source}");
        }
        other => panic!("expected an I/O error on block {bad}, got {:?}", other.map(|_| ())),
    }
    assert!(stream.read(1).is_ok(), "the injected error is spent");
    // Corrupted data: the checksum catches it and names the block.
    f.inject("read", "corrupt_data", 1, r#", "corrupt_offset": 200, "corrupt_value": 90"#);
    match stream.read(1) {
        Err(Error::Damaged { block, .. }) => assert_eq!(block, bad),
        other => panic!("expected damage on block {bad}, got {:?}", other.map(|_| ())),
    }
    // Out of bdev_io structures for a while: SPDK queues and retries; nothing fails.
    f.inject("read", "nomem", 20, "");
    assert_matches(&store, &model);
}

#[test]
fn injected_write_and_flush_errors_fail_the_commit_and_keep_the_last_state() {
    for (io_type, num) in [("write", 1), ("flush", 1), ("write", 1000)] {
        let dir = tmpdir();
        let f = Faulty::new(dir.path());
        let store = format(&f.base);
        let committed = workload(&store, 4, |_| {}).unwrap();
        f.inject(io_type, "failure", num, "");
        let mut txn = store.begin().unwrap();
        txn.create_context("doomed", shape(1, 1), &[1]).unwrap();
        txn.append_block("doomed", 0, 0, FileStream::Data, &[1; 100]).unwrap();
        let err = txn.commit().unwrap_err();
        assert!(matches!(err, Error::BlockIo { .. } | Error::Io(_) | Error::Poisoned(_)), "{io_type}: {err}");
        assert_matches(&store, &committed);
        drop(store);
        f.inject(io_type, "failure", 0, ""); // num 0: injection off
        let store = Store::open_path(&f.base.path(), DeviceChoice::Auto).unwrap();
        assert_matches(&store, &committed);
        assert!(fsck::check(store.device().as_ref()).unwrap().is_clean(), "{io_type}");
    }
}

#[test]
fn other_block_sizes() {
    let dir = tmpdir();
    // A store of 16 KiB blocks on a bdev of 512-byte blocks; the block size is probed.
    let b = bdev_with(dir.path(), Kind::Aio, 8 << 20, 512);
    let dev: Arc<dyn BlockDevice> =
        Arc::from(device::open_path(&b.path(), DeviceChoice::Auto, 16384, ctxfs_vfs::Access::Write).unwrap());
    assert_eq!(dev.num_blocks(), 512);
    let store = ctxfs_vfs::format(dev).unwrap();
    let mut txn = store.begin().unwrap();
    txn.create_context("big-blocks", shape(1, 1), &[1, 2, 3]).unwrap();
    txn.append_block("big-blocks", 0, 0, FileStream::Data, &[7; 9000]).unwrap();
    txn.commit().unwrap();
    drop(store);
    let store = Store::open_path(&b.path(), DeviceChoice::Auto).unwrap();
    assert_eq!(store.device().block_size(), 16384);
    let snap = store.snapshot();
    let stream = snap.context("big-blocks").unwrap().stream(0, 0, FileStream::Data).unwrap();
    assert_eq!(stream.read(0).unwrap().payload(), &[7; 9000][..]);
    // A bdev whose blocks are larger than the store's: refused, saying why.
    let b = bdev_with(dir.path(), Kind::Uring, 8 << 20, 8192);
    let err = device::open_path(&b.path(), DeviceChoice::Auto, 4096, ctxfs_vfs::Access::Write).err().unwrap();
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    assert!(err.to_string().contains("block size mismatch"), "{err}");
    // With the bdev's own block size it works, and the probe finds it.
    drop(
        ctxfs_vfs::format(Arc::from(
            device::open_path(&b.path(), DeviceChoice::Auto, 8192, ctxfs_vfs::Access::Write).unwrap(),
        ))
        .unwrap(),
    );
    assert_eq!(Store::open_path(&b.path(), DeviceChoice::Auto).unwrap().device().block_size(), 8192);
}

#[test]
fn bad_paths_configs_and_bdevs_are_named() {
    let dir = tmpdir();
    let d = dir.path();
    let open = |path: String| {
        device::open_path(Path::new(&path), DeviceChoice::Auto, BS, ctxfs_vfs::Access::Write).err().expect(&path)
    };
    let err = open(format!("spdk:{}", d.join("x.json").display()));
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    assert!(err.to_string().contains("spdk:CONFIG.json#BDEV"), "{err}");
    let err = open(format!("spdk:{}#x", d.join("missing.json").display()));
    assert_eq!(err.kind(), io::ErrorKind::NotFound);
    assert!(err.to_string().contains("missing.json"), "{err}");
    std::fs::write(d.join("broken.json"), "{\"subsystems\": [").unwrap();
    let err = open(format!("spdk:{}#x", d.join("broken.json").display()));
    assert!(err.to_string().contains("broken.json") && err.to_string().contains("not valid JSON"), "{err}");
    // A config whose bdev cannot be created (its file is missing): SPDK logs why, the open
    // says the bdev is missing and lists those that exist; SPDK keeps running.
    let name = unique("nofile");
    write_config(
        &d.join("nofile.json"),
        &format!(r#"{{"method": "bdev_aio_create", "params": {{"name": "{name}", "filename": "nowhere.img"}}}}"#),
    );
    let err = open(format!("spdk:{}#{name}", d.join("nofile.json").display()));
    assert_eq!(err.kind(), io::ErrorKind::NotFound);
    assert!(err.to_string().contains(&format!("no SPDK bdev named {name:?}")), "{err}");
    let b = bdev(d, Kind::Aio, 1 << 20);
    let err = open(format!("spdk:{}#not-there", b.config.display()));
    assert!(err.to_string().contains(&b.name), "the bdevs that exist are listed: {err}");
    // Bdev names are unique per process.
    let twin = d.join("twin.json");
    write_config(
        &twin,
        &format!(
            r#"{{"method": "bdev_aio_create", "params": {{"name": "{}", "filename": "{}"}}}}"#,
            b.name,
            b.image.display()
        ),
    );
    let err = open(format!("spdk:{}#{}", twin.display(), b.name));
    assert_eq!(err.kind(), io::ErrorKind::AlreadyExists, "{err}");
    // The environment is set once per process.
    std::fs::write(d.join("huge.json"), r#"{"ctxfs": {"hugepages": true, "core_mask": "0x3"}, "subsystems": []}"#)
        .unwrap();
    let err = open(format!("spdk:{}#{}", d.join("huge.json").display(), b.name));
    assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    assert!(err.to_string().contains("already runs in this process"), "{err}");
    // A file store path of the same text is not an SPDK path.
    assert_eq!(SpdkPath::parse(Path::new("./spdk:x.json#a")), None);
    // Reading an SPDK store's prefix (what Store::open_path does first) works before a format.
    let prefix = device::read_prefix(&b.path(), 8192).unwrap();
    assert!(prefix.iter().all(|&x| x == 0));
    let dev = SpdkDevice::open(&SpdkPath::parse(&b.path()).unwrap().unwrap(), None).unwrap();
    assert!(dev.bdev_info().contains("AIO"), "{}", dev.bdev_info());
    assert!(dev.zero_copy(), "an AIO bdev takes the caller's memory");
}
