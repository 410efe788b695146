//! The store on the real devices (io_uring and pread/pwrite, O_DIRECT) over real files:
//! format, commits, recovery on reopen, concurrent readers during commits.

mod common;
use common::*;
use ctxfs_vfs::{device, fsck, BlockDevice, DeviceChoice, FileStream, Store};
use std::sync::Arc;

#[test]
fn workload_round_trips_on_real_devices() {
    for choice in REAL_DEVICES {
        let dir = tmpdir();
        let path = dir.path().join("store.img");
        let store = file_store(&path, 16 << 20, choice);
        assert_eq!(store.device_info().kind, if choice == DeviceChoice::Uring { "uring" } else { "file" });
        let mut models = Vec::new();
        let model = workload(&store, 21, |m| {
            models.push(m.clone());
        })
        .unwrap();
        assert_matches(&store, &model);
        drop(store);
        let store = Store::open_path(&path, choice).unwrap();
        assert_matches(&store, &model);
        let report = fsck::check(store.device().as_ref()).unwrap();
        assert!(report.is_clean(), "{choice:?}: {:?}", report.problems);
        let live = ctxfs_vfs::inspect::live_blocks(&store.snapshot()).unwrap();
        assert_eq!(report.blocks_checked, live.len() as u64, "fsck reads every live block once");
    }
}

#[test]
fn auto_device_is_uring_here() {
    let dir = tmpdir();
    let path = dir.path().join("auto.img");
    file_store(&path, 1 << 20, DeviceChoice::File);
    let store = Store::open_path(&path, DeviceChoice::Auto).unwrap();
    let info = store.device_info();
    assert_eq!(info.kind, "uring", "io_uring is available on the test machines: {info:?}");
    assert!(info.note.is_none());
}

#[test]
fn readers_keep_reading_while_a_writer_commits() {
    let dir = tmpdir();
    let path = dir.path().join("concurrent.img");
    let store = Arc::new(file_store(&path, 32 << 20, DeviceChoice::Uring));
    readers_survive_churn(store);
}

#[test]
fn open_refuses_a_store_of_another_format_version() {
    let dir = tmpdir();
    let path = dir.path().join("v3.img");
    drop(file_store(&path, 1 << 20, DeviceChoice::Uring));
    // Rewrite both superblocks as version 3, with valid checksums.
    let dev: Arc<dyn BlockDevice> =
        Arc::from(device::open_path(&path, DeviceChoice::File, BS, ctxfs_vfs::Access::Write).unwrap());
    for slot in 0..2u64 {
        let raw = fsck::raw_block(dev.as_ref(), slot).unwrap();
        let (h, _) = ctxfs_vfs::format::header::unseal(&raw).unwrap();
        let mut payload = ctxfs_vfs::format::header::payload(&raw, &h).to_vec();
        payload[8..12].copy_from_slice(&3u32.to_le_bytes());
        let mut buf = device::AlignedBuf::zeroed(BS);
        ctxfs_vfs::format::header::seal(&mut buf, &h, &payload);
        let r = dev.submit(&mut [device::IoOp::Write { block: slot, buf: &buf }]);
        r.into_iter().for_each(|r| r.unwrap());
    }
    let err = Store::open_path(&path, DeviceChoice::Uring).err().expect("must refuse");
    let msg = err.to_string();
    assert!(msg.contains("unsupported format version 3") && msg.contains("reads versions 1 to 2"), "{msg}");
}

#[test]
fn bad_input_is_refused_and_nothing_is_written() {
    let (mem, store) = mem_store(256);
    let before = mem.current_image();
    let mut txn = store.begin().unwrap();
    assert!(txn.create_context("", shape(1, 1), &[]).is_err());
    assert!(txn.create_context(&"x".repeat(256), shape(1, 1), &[]).is_err());
    let mut bad = shape(1, 2);
    bad.q_heads = 3;
    assert!(txn.create_context("bad-gqa", bad, &[]).is_err());
    txn.create_context("ok", shape(1, 1), &[]).unwrap();
    assert!(matches!(txn.create_context("ok", shape(1, 1), &[]), Err(ctxfs_vfs::Error::ContextExists(_))));
    assert!(txn.append_block("ok", 1, 0, FileStream::Data, &[1]).is_err(), "layer out of range");
    assert!(txn.append_block("ok", 0, 0, FileStream::Data, &vec![0; BS]).is_err(), "payload too large");
    drop(txn);
    assert_eq!(mem.current_image(), before, "an abandoned transaction changes nothing visible");
    // A full store refuses with StoreFull and keeps its committed state.
    let mut txn = store.begin().unwrap();
    txn.create_context("big", shape(1, 1), &[]).unwrap();
    let err =
        (0..1000).map(|_| txn.append_block("big", 0, 0, FileStream::Data, &[9; 100])).find_map(Result::err).unwrap();
    assert!(matches!(err, ctxfs_vfs::Error::StoreFull { .. }), "{err}");
    drop(txn);
    assert!(fsck::check(mem.as_ref()).unwrap().is_clean());
}

/// A stream reserves blocks in runs that double up to 256; a writer done with a file gives
/// back what its streams reserved and did not write, and the next file of the same commit
/// gets it: an import of many files does not run out of space with every file's spare
/// reservation held.
#[test]
fn a_finished_files_spare_reservation_is_free_for_the_next_file() {
    let fill = |finish: bool| {
        let (_, store) = mem_store(256);
        let mut txn = store.begin().unwrap();
        txn.create_context("c", shape(1, 2), &[]).unwrap();
        // Runs of 4, 8, 16 and 32 blocks: 33 written leave 27 of the last run reserved.
        for _ in 0..33 {
            txn.append_block("c", 0, 0, FileStream::Data, &[1; 100]).unwrap();
        }
        if finish {
            txn.finish_file("c", 0, 0).unwrap();
        }
        (0..1000).take_while(|_| txn.append_block("c", 0, 1, FileStream::Data, &[2; 100]).is_ok()).count()
    };
    let (held, given_back) = (fill(false), fill(true));
    assert_eq!(given_back, held + 27, "the second file wrote {held} blocks beside the held reservation");
}

#[test]
fn fsck_reports_progress_up_to_every_allocated_block() {
    let (mem, store) = mem_store(1024);
    workload(&store, 30, |_| {}).unwrap();
    let allocated = store.snapshot().superblock().allocated_blocks;
    drop(store);
    let seen = std::sync::Mutex::new(Vec::new());
    let report = fsck::check_with(mem.as_ref(), &|done, total| seen.lock().unwrap().push((done, total))).unwrap();
    assert!(report.is_clean());
    let seen = seen.into_inner().unwrap();
    assert!(seen.len() > 3, "progress was reported {} times", seen.len());
    assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0), "progress never goes back");
    assert_eq!(*seen.last().unwrap(), (report.blocks_checked, allocated));
    assert_eq!(report.blocks_checked, allocated, "a clean store: every allocated block is checked once");
}

#[test]
fn block_pairs_lie_side_by_side_and_stay_one_run_in_memory() {
    let dir = tmpdir();
    let path = dir.path().join("pairs.img");
    let store = file_store(&path, 16 << 20, DeviceChoice::Uring);
    let mut rng = ctxfs_vfs::SplitMix64::new(5);
    let mut txn = store.begin().unwrap();
    txn.create_context("c", shape(1, 1), &[1, 2, 3]).unwrap();
    let meta = payload(&mut rng);
    txn.append_block("c", 0, 0, FileStream::Index, &meta).unwrap();
    let pairs: Vec<(Vec<u8>, Vec<u8>)> = (0..300).map(|_| (payload(&mut rng), payload(&mut rng))).collect();
    for (i, (index, data)) in pairs.iter().enumerate() {
        assert_eq!(txn.append_block_pair("c", 0, 0, index, data).unwrap(), (1 + i as u64, i as u64));
    }
    // Refused pairs take no block: the commit below leaves nothing unreachable (fsck).
    let too_large = vec![0; BS];
    assert!(txn.append_block_pair("c", 0, 0, &too_large, &[1]).is_err());
    assert!(txn.append_block_pair("c", 0, 0, &[1], &too_large).is_err());
    assert!(txn.append_block_pair("c", 1, 0, &[1], &[1]).is_err(), "layer out of range");
    let tail = payload(&mut rng);
    txn.append_block("c", 0, 0, FileStream::Index, &tail).unwrap();
    txn.commit().unwrap();
    drop(store);

    let store = Store::open_path(&path, DeviceChoice::Uring).unwrap();
    let snap = store.snapshot();
    let ctx = snap.context("c").unwrap();
    let (index, data) = (ctx.stream(0, 0, FileStream::Index).unwrap(), ctx.stream(0, 0, FileStream::Data).unwrap());
    for j in 0..pairs.len() as u64 {
        let (k, v) = (index.locate(1 + j).unwrap().0, data.locate(j).unwrap().0);
        assert_eq!(v, k + 1, "pair {j}: index block at {k}, data block at {v}");
    }
    // The pairs' 300 blocks of each stream are one run of step 2 in memory (on disk, one
    // run each: docs/format.md §10).
    let steps: Vec<u64> = data.map().runs().map(|r| r.3).collect();
    assert_eq!(steps, [2], "data runs {:?}", data.map().runs().collect::<Vec<_>>());
    assert!(index.map().runs().count() <= 3, "index runs {:?}", index.map().runs().collect::<Vec<_>>());
    let mut want_index = vec![meta];
    want_index.extend(pairs.iter().map(|p| p.0.clone()));
    want_index.push(tail);
    let logicals: Vec<u64> = (0..index.blocks()).collect();
    for (got, want) in index.read_many(&logicals).into_iter().zip(&want_index) {
        assert_eq!(got.unwrap().payload(), &want[..]);
    }
    let logicals: Vec<u64> = (0..data.blocks()).collect();
    for (got, want) in data.read_many(&logicals).into_iter().zip(&pairs) {
        assert_eq!(got.unwrap().payload(), &want.1[..]);
    }
    let report = fsck::check(store.device().as_ref()).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

/// A store file cut short by another process while a transaction writes: the commit fails
/// before its superblock, naming the cut, on both real devices; the state before stays.
#[test]
fn a_store_file_cut_short_while_open_commits_nothing() {
    for choice in REAL_DEVICES {
        let dir = tmpdir();
        let path = dir.path().join("s.ctxfs");
        let size = 8 << 20;
        let store = file_store(&path, size, choice);
        let mut txn = store.begin().unwrap();
        txn.create_context("kept", shape(1, 1), &[1]).unwrap();
        txn.commit().unwrap();
        let mut txn = store.begin().unwrap();
        txn.create_context("cut", shape(1, 1), &[1]).unwrap();
        for _ in 0..64 {
            txn.append_block("cut", 0, 0, FileStream::Data, &[7; 1000]).unwrap();
        }
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(1 << 20).unwrap();
        let err = txn.commit().unwrap_err().to_string();
        assert!(
            err.contains("was cut to 1048576 bytes while open") && err.contains("truncate -s"),
            "{choice:?}: {err}"
        );
        drop(store);
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(size).unwrap();
        let store = Store::open_path(&path, choice).unwrap();
        assert!(store.snapshot().context("kept").is_ok() && store.snapshot().context("cut").is_err(), "{choice:?}");
    }
}

/// A pipe, a directory or a character device given as a store is refused at once, by name,
/// without opening it (a pipe's open would wait for a writer forever).
#[test]
fn a_path_that_is_no_file_or_block_device_is_refused_at_once() {
    let dir = tmpdir();
    let fifo = dir.path().join("fifo");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for path in [fifo.as_path(), dir.path(), std::path::Path::new("/dev/null")] {
        for open in [Store::open_path, Store::open_path_read_only] {
            let err = open(path, DeviceChoice::Auto).err().expect("refused").to_string();
            assert!(err.contains("is neither a regular file nor a block device"), "{path:?}: {err}");
        }
    }
}
