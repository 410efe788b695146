//! One writer, many readers: the writer lock and the readers' pins (`vfs/src/lock.rs`), on
//! real files. Each store here is opened through its own open file description, as another
//! process would open it, so the kernel's locks decide, not this process's bookkeeping.

mod common;

use common::{file_store, tmpdir};
use ctxfs_vfs::{DType, DeviceChoice, Error, FileStream, ModelShape, Snapshot, Store};
use std::collections::BTreeSet;
use std::path::Path;

const SHAPE: ModelShape = ModelShape { layers: 1, q_heads: 1, kv_heads: 1, head_dim: 64, dtype: DType::F16 };
/// Blocks of data each context gets: enough that reuse of a freed context's blocks shows.
const BLOCKS: usize = 40;

fn put(store: &Store, name: &str, fill: u8) {
    let mut txn = store.begin().unwrap();
    txn.create_context(name, SHAPE, &[1, 2, 3]).unwrap();
    for i in 0..BLOCKS {
        txn.append_block(name, 0, 0, FileStream::Data, &[fill.wrapping_add(i as u8); 3000]).unwrap();
    }
    txn.commit().unwrap();
}

fn delete(store: &Store, name: &str) {
    let mut txn = store.begin().unwrap();
    txn.delete_context(name).unwrap();
    txn.commit().unwrap();
}

/// Reads every data block of `name` through `snap` and checks its bytes.
fn intact(snap: &Snapshot, name: &str, fill: u8) {
    let s = snap.context(name).unwrap().stream(0, 0, FileStream::Data).unwrap();
    for i in 0..BLOCKS as u64 {
        let b = s.read(i).unwrap_or_else(|e| panic!("{name} block {i}: {e}"));
        assert!(b.payload().iter().all(|&x| x == fill.wrapping_add(i as u8)), "{name} block {i}");
    }
}

fn blocks_of(snap: &Snapshot, name: &str) -> BTreeSet<u64> {
    let s = snap.context(name).unwrap().stream(0, 0, FileStream::Data).unwrap();
    (0..s.blocks()).map(|l| s.locate(l).unwrap().0).collect()
}

fn writer(path: &Path) -> Store {
    Store::open_path(path, DeviceChoice::Uring).unwrap()
}

fn reader(path: &Path) -> Store {
    Store::open_path_read_only(path, DeviceChoice::Uring).unwrap()
}

#[test]
fn a_second_writer_is_refused_and_readers_are_not() {
    let dir = tmpdir();
    let path = dir.path().join("s.img");
    drop(file_store(&path, 4 << 20, DeviceChoice::Uring));
    let w = writer(&path);
    match Store::open_path(&path, DeviceChoice::Uring) {
        Err(e @ Error::Locked { .. }) => {
            assert!(e.to_string().contains("another open store"), "the holder is in this process: {e}");
            let Error::Locked { holder, path: p } = e else { unreachable!() };
            assert_eq!(holder, None, "not this process's own pid");
            assert!(p.ends_with("s.img"));
        }
        other => panic!("a second writer must be refused: {:?}", other.map(|_| ())),
    }
    let r = reader(&path);
    assert!(matches!(r.begin().err(), Some(Error::ReadOnly(_))));
    put(&w, "a", 1);
    assert!(r.snapshot().context("a").is_err(), "a reader sees the state it opened");
    assert!(reader(&path).snapshot().context("a").is_ok(), "a new reader sees the newest");
    drop(w);
    drop(writer(&path));
}

#[test]
fn readers_of_several_generations_keep_their_blocks_across_writers() {
    let dir = tmpdir();
    let path = dir.path().join("s.img");
    drop(file_store(&path, 8 << 20, DeviceChoice::Uring));
    let w = writer(&path);
    put(&w, "a", 10);
    let r1 = reader(&path);
    put(&w, "b", 20);
    let r2 = reader(&path);
    let (s1, s2) = (r1.snapshot(), r2.snapshot());
    let (a_blocks, b_blocks) = (blocks_of(&s1, "a"), blocks_of(&s2, "b"));
    // The writer frees both; its own commits must not hand their blocks out again.
    delete(&w, "a");
    delete(&w, "b");
    put(&w, "c", 30);
    drop(w);
    // Writers that open after both readers' states were superseded find them through the
    // pinned allocator directories.
    for round in 0..3u8 {
        let w = writer(&path);
        let name = format!("n{round}");
        put(&w, &name, 40 + round);
        let fresh = blocks_of(&w.snapshot(), &name);
        assert!(fresh.is_disjoint(&a_blocks) && fresh.is_disjoint(&b_blocks), "round {round}");
    }
    intact(&s1, "a", 10);
    intact(&s2, "b", 20);
    intact(&s2, "a", 10);
    // When the older reader goes, the blocks only it read become free; those the newer one
    // reads stay held.
    drop((s1, r1));
    let w = writer(&path);
    put(&w, "d", 50);
    put(&w, "e", 60);
    let reused: BTreeSet<u64> =
        ["d", "e"].iter().flat_map(|n| blocks_of(&w.snapshot(), n)).filter(|b| a_blocks.contains(b)).collect();
    assert!(reused.is_empty(), "a's blocks are still in the newer reader's state: {reused:?}");
    intact(&s2, "b", 20);
    drop((s2, r2));
    put(&w, "f", 70);
    put(&w, "g", 80);
    let later: BTreeSet<u64> = ["f", "g"].iter().flat_map(|n| blocks_of(&w.snapshot(), n)).collect();
    assert!(!later.is_disjoint(&a_blocks), "with every reader gone, freed blocks are reused");
    assert!(ctxfs_vfs::fsck::check(w.device().as_ref()).unwrap().is_clean());
}

/// Readers open, read every context and close while a writer commits as fast as it can: the
/// pin and its re-check race against commits, and no reader may meet a reused block.
#[test]
fn readers_opening_during_commits_never_meet_a_reused_block() {
    let dir = tmpdir();
    let path = dir.path().join("s.img");
    drop(file_store(&path, 8 << 20, DeviceChoice::Uring));
    let commits = 80u32;
    let done = std::sync::atomic::AtomicBool::new(false);
    let opened = std::sync::atomic::AtomicU64::new(0);
    std::thread::scope(|s| {
        s.spawn(|| {
            let w = writer(&path);
            for i in 0..commits {
                put(&w, &format!("c{i}"), i as u8);
                if i >= 2 {
                    delete(&w, &format!("c{}", i - 2));
                }
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        for _ in 0..4 {
            s.spawn(|| {
                while !done.load(std::sync::atomic::Ordering::SeqCst) {
                    let r = reader(&path);
                    let snap = r.snapshot();
                    let names: Vec<String> = snap.contexts().map(|c| c.name.clone()).collect();
                    for name in names {
                        let fill: u8 = name[1..].parse::<u32>().unwrap() as u8;
                        intact(&snap, &name, fill);
                    }
                    opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    assert!(opened.into_inner() >= 4, "the readers ran beside the writer");
    let r = reader(&path);
    assert_eq!(r.snapshot().contexts().count(), 2);
    assert!(ctxfs_vfs::fsck::check(r.device().as_ref()).unwrap().is_clean());
}

/// A writer that cannot read a reader's pinned allocator directory knows nothing of that
/// state's blocks: it hands out none of the free ones, saying why, until the reader is gone.
#[test]
fn an_unreadable_pinned_directory_holds_every_free_block() {
    let dir = tmpdir();
    let path = dir.path().join("s.img");
    drop(file_store(&path, 4 << 20, DeviceChoice::Uring));
    let w = writer(&path);
    put(&w, "a", 1);
    let r = reader(&path);
    let root = r.snapshot().superblock().alloc.block;
    delete(&w, "a");
    put(&w, "b", 2);
    drop(w);
    // Damage the reader's directory block where the writer would read it.
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0x5a; 64], root * 4096 + 100).unwrap();
    f.sync_all().unwrap();
    let w = writer(&path);
    let err = {
        let mut txn = w.begin().unwrap();
        txn.create_context("c", SHAPE, &[1]).unwrap();
        match txn.append_block("c", 0, 0, FileStream::Data, &[3; 100]) {
            Err(e) => e,
            Ok(_) => txn.commit().expect_err("no block may be handed out"),
        }
    };
    assert!(matches!(err, Error::HeldForReader { .. }), "{err}");
    drop(w);
    drop(r);
    let w = writer(&path);
    put(&w, "c", 3);
    intact(&w.snapshot(), "c", 3);
}

#[test]
fn an_open_transaction_neither_blocks_space_nor_lets_its_own_thread_begin_another() {
    let dir = tmpdir();
    let path = dir.path().join("s.img");
    drop(file_store(&path, 4 << 20, DeviceChoice::Uring));
    let w = writer(&path);
    let before = w.space();
    let txn = w.begin().unwrap();
    // A progress callback inspecting the store runs on the thread that holds the writer.
    assert_eq!(w.space(), before, "the last commit's counts, without waiting");
    match w.begin() {
        Err(Error::InvalidArgument(why)) => assert!(why.contains("still open"), "{why}"),
        other => panic!("a nested begin must be refused, not wait on itself: {:?}", other.map(|_| ())),
    }
    // Another thread's begin waits for it, then runs.
    std::thread::scope(|s| {
        let other = s.spawn(|| w.begin().map(|t| t.commit()).is_ok());
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!other.is_finished(), "the second writer waits for the first");
        drop(txn);
        assert!(other.join().unwrap());
    });
    put(&w, "a", 1);
    assert!(w.space().used > before.used, "a commit publishes its counts");
}

#[test]
fn a_resizing_format_is_refused_while_another_store_reads_and_changes_nothing() {
    let dir = tmpdir();
    let path = dir.path().join("s.img");
    drop(file_store(&path, 4 << 20, DeviceChoice::Uring));
    put(&writer(&path), "a", 7);
    let r = reader(&path);
    let err = ctxfs_vfs::mkfs::format_path(&path, Some(1 << 20), 4096, true, DeviceChoice::Uring)
        .err()
        .expect("formatting under a reader is refused");
    assert!(err.to_string().contains("close it before formatting"), "{err}");
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 4 << 20, "not resized");
    intact(&r.snapshot(), "a", 7);
    drop(r);
    intact(&reader(&path).snapshot(), "a", 7);
}

/// How this process has `path` open: the access mode (`O_RDONLY`, `O_WRONLY` or `O_RDWR`)
/// of every file descriptor on it, from /proc.
fn access_modes(path: &Path) -> Vec<i32> {
    let path = path.canonicalize().unwrap();
    let mut modes = Vec::new();
    for fd in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if std::fs::read_link(fd.path()).is_ok_and(|target| target == path) {
            let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.file_name().to_string_lossy()));
            let Ok(info) = info else { continue };
            let flags = info.lines().find_map(|l| l.strip_prefix("flags:")).unwrap().trim();
            modes.push(i32::from_str_radix(flags, 8).unwrap() & libc::O_ACCMODE);
        }
    }
    modes
}

#[test]
fn a_reader_opens_the_store_for_reading_only() {
    let dir = tmpdir();
    let path = dir.path().join("s.ctxfs");
    for choice in common::REAL_DEVICES {
        drop(file_store(&path, 4 << 20, choice));
        put(&writer(&path), "a", 1);
        let store = Store::open_path_read_only(&path, choice).unwrap();
        // A file the process may not write (read-only, on a read-only mount, another user's)
        // serves it.
        let modes = access_modes(&path);
        assert!(!modes.is_empty() && modes.iter().all(|&m| m == libc::O_RDONLY), "{choice:?}: {modes:?}");
        intact(&store.snapshot(), "a", 1);
        assert!(matches!(store.begin(), Err(Error::ReadOnly(_))));
        drop(store);
        let store = writer(&path);
        assert!(access_modes(&path).contains(&libc::O_RDWR), "{choice:?}");
        drop(store);
    }
}
