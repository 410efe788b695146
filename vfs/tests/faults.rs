//! Injected I/O faults: read and write errors, failed flushes, torn and misdirected writes.
//! They surface as errors naming the block, never as panics or wrong bytes, and a failed
//! commit leaves the previous state intact.

mod common;
use common::*;
use ctxfs_vfs::device::{FaultPlan, MemDevice};
use ctxfs_vfs::{fsck, Error, Store};
use std::sync::Arc;

fn reopen(mem: &MemDevice) -> (Arc<MemDevice>, Store) {
    let dev = Arc::new(MemDevice::from_image(mem.current_image(), BS));
    let store = Store::open(dev.clone()).unwrap();
    (dev, store)
}

#[test]
fn write_errors_fail_the_commit_and_keep_the_previous_state() {
    let mut failures = 0;
    for seed in 0..40 {
        let (mem, store) = mem_store(1024);
        mem.set_faults(FaultPlan { seed, write_error_rate: 0.02, ..Default::default() });
        let (committed, err) = match workload(&store, seed, |_| {}) {
            Ok(_) => continue,
            Err(stop) => (stop.committed, stop.error),
        };
        failures += 1;
        assert!(matches!(err, Error::BlockIo { .. } | Error::Poisoned(_)), "seed {seed}: {err}");
        mem.set_faults(FaultPlan::default());
        if !matches!(err, Error::Poisoned(_)) {
            // Same process: the store still serves the last commit and takes new ones.
            assert_matches(&store, &committed);
            let mut txn = store.begin().unwrap();
            txn.create_context("after", shape(1, 1), &[7]).unwrap();
            txn.commit().unwrap();
        }
        drop(store);
        let (dev, store) = reopen(&mem);
        let snap = store.snapshot();
        for name in committed.keys() {
            assert!(snap.context(name).is_ok(), "seed {seed}: committed context {name} lost");
        }
        drop(snap);
        let report = fsck::check(dev.as_ref()).unwrap();
        assert!(report.is_clean(), "seed {seed}: {:?}", report.problems);
    }
    assert!(failures >= 20, "only {failures} seeds hit a write error");
}

#[test]
fn a_failed_flush_poisons_the_store_until_it_is_reopened() {
    let (mem, store) = mem_store(1024);
    let committed = workload(&store, 1, |_| {}).unwrap();
    // Flushes fail from now on: the commit fails before or at its superblock.
    mem.set_faults(FaultPlan { fail_flush_from_op: Some(0), ..Default::default() });
    let mut txn = store.begin().unwrap();
    txn.create_context("doomed", shape(1, 1), &[1]).unwrap();
    let err = txn.commit().unwrap_err();
    assert!(matches!(err, Error::Io(_)), "{err}");
    assert_matches(&store, &committed);
    mem.set_faults(FaultPlan::default());
    let (_, store) = reopen(&mem);
    assert!(store.snapshot().context("doomed").is_err());
}

#[test]
fn a_failed_superblock_flush_is_reported_and_recovery_decides() {
    let (mem, store) = mem_store(1024);
    let committed = workload(&store, 2, |_| {}).unwrap();
    // Count the operations of the commit on a twin store, then fail only its last flush:
    // the one after the superblock write.
    let probe_ops = {
        let (probe, pstore) = mem_store(1024);
        workload(&pstore, 2, |_| {}).unwrap();
        probe.set_faults(FaultPlan::default());
        let mut t = pstore.begin().unwrap();
        t.create_context("maybe", shape(1, 1), &[1]).unwrap();
        t.commit().unwrap();
        probe.ops()
    };
    mem.set_faults(FaultPlan { fail_flush_from_op: Some(probe_ops - 1), ..Default::default() });
    let mut txn = store.begin().unwrap();
    txn.create_context("maybe", shape(1, 1), &[1]).unwrap();
    let err = txn.commit().unwrap_err();
    assert!(matches!(err, Error::Poisoned(_)), "{err}");
    assert!(matches!(store.begin().err(), Some(Error::Poisoned(_))), "no writes after an unknown outcome");
    assert_matches(&store, &committed); // readers keep the last known state
    mem.set_faults(FaultPlan::default());
    let (dev, store) = reopen(&mem);
    assert!(fsck::check(dev.as_ref()).unwrap().is_clean());
    for name in committed.keys() {
        assert!(store.snapshot().context(name).is_ok());
    }
}

#[test]
fn read_errors_name_the_block_and_fsck_reports_them() {
    let (mem, store) = mem_store(1024);
    workload(&store, 3, |_| {}).unwrap();
    let snap = store.snapshot();
    let ctx = snap.context("gamma").unwrap();
    let stream = ctx.stream(0, 1, ctxfs_vfs::FileStream::Data).unwrap();
    let (bad, _) = stream.locate(1).unwrap();
    mem.set_faults(FaultPlan { bad_read_blocks: [bad].into(), ..Default::default() });
    match stream.read(1) {
        Err(Error::BlockIo { block, .. }) => assert_eq!(block, bad),
        other => panic!("expected an I/O error on block {bad}, got {:?}", other.map(|_| ())),
    }
    let results = stream.read_many(&[0, 1, 2]);
    assert!(results[0].is_ok() && results[2].is_ok(), "a read error spoils only its own block");
    assert_eq!(results[1].as_ref().err().and_then(Error::block), Some(bad));
    let report = fsck::check(mem.as_ref()).unwrap();
    assert_eq!(report.exit_code(), fsck::EXIT_UNCORRECTED);
    assert!(report.damaged_blocks().contains(&bad));
}

/// Blocks a transaction keeps in flight at most: its batches go to the device on threads of
/// their own while the next are sealed.
const IN_FLIGHT_BLOCKS: u64 = (ctxfs_vfs::WRITE_IN_FLIGHT_BYTES / BS) as u64;

/// A context of one data stream of `blocks` blocks, block `i` filled with byte `i`.
fn long_stream(txn: &mut ctxfs_vfs::Txn<'_>, name: &str, blocks: u64) -> Result<(), Error> {
    txn.create_context(name, shape(1, 1), &[1])?;
    for i in 0..blocks {
        txn.append_block(name, 0, 0, ctxfs_vfs::FileStream::Data, &[i as u8; 100])?;
    }
    Ok(())
}

#[test]
fn a_batch_that_fails_while_later_ones_are_sealed_fails_its_transaction() {
    let (mem, store) = mem_store(5 * IN_FLIGHT_BLOCKS);
    let mut txn = store.begin().unwrap();
    long_stream(&mut txn, "kept", 10).unwrap();
    txn.commit().unwrap();

    mem.set_faults(FaultPlan { bad_write_blocks: (0..5 * IN_FLIGHT_BLOCKS).collect(), ..Default::default() });
    let mut txn = store.begin().unwrap();
    txn.create_context("lost", shape(1, 1), &[1]).unwrap();
    // The first full batch goes out while later ones are sealed, and is waited for once the
    // window is full: its failure shows there, naming a block it wrote, and the transaction
    // takes no more.
    let mut failed_at = None;
    for i in 0..3 * IN_FLIGHT_BLOCKS {
        if let Err(e) = txn.append_block("lost", 0, 0, ctxfs_vfs::FileStream::Data, &[1; 100]) {
            assert!(matches!(e, Error::BlockIo { .. }), "push {i}: {e}");
            failed_at = Some(i);
            break;
        }
    }
    assert!(failed_at.is_some_and(|i| i <= 2 * IN_FLIGHT_BLOCKS), "failed at {failed_at:?}");
    assert!(matches!(txn.append_block("lost", 0, 0, ctxfs_vfs::FileStream::Data, &[1; 100]), Err(Error::Poisoned(_))));
    assert!(matches!(txn.commit(), Err(Error::Poisoned(_))));

    mem.set_faults(FaultPlan::default());
    let names: Vec<String> = store.snapshot().contexts().map(|r| r.name.clone()).collect();
    assert_eq!(names, ["kept"]);
    let mut txn = store.begin().unwrap();
    long_stream(&mut txn, "after", 3 * IN_FLIGHT_BLOCKS).unwrap();
    txn.commit().unwrap();
    drop(store);
    let (dev, store) = reopen(&mem);
    let snap = store.snapshot();
    let stream = snap.context("after").unwrap().stream(0, 0, ctxfs_vfs::FileStream::Data).unwrap();
    for (i, block) in stream.read_range(0, stream.blocks()).enumerate() {
        assert_eq!(block.unwrap().payload(), [i as u8; 100], "block {i}");
    }
    drop(snap);
    let report = fsck::check(dev.as_ref()).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

#[test]
fn a_range_read_names_a_bad_block_of_a_later_batch_and_gives_the_rest() {
    let (mem, store) = mem_store(3 * ctxfs_vfs::RangeReader::BATCH_BLOCKS);
    let mut txn = store.begin().unwrap();
    let blocks = 2 * ctxfs_vfs::RangeReader::BATCH_BLOCKS + 7;
    long_stream(&mut txn, "long", blocks).unwrap();
    txn.commit().unwrap();
    let snap = store.snapshot();
    let stream = snap.context("long").unwrap().stream(0, 0, ctxfs_vfs::FileStream::Data).unwrap();
    let bad_logical = ctxfs_vfs::RangeReader::BATCH_BLOCKS + 3;
    let (bad, _) = stream.locate(bad_logical).unwrap();
    mem.set_faults(FaultPlan { bad_read_blocks: [bad].into(), ..Default::default() });
    let read: Vec<_> = stream.read_range(0, blocks).collect();
    assert_eq!(read.len() as u64, blocks);
    for (i, block) in read.iter().enumerate() {
        match block {
            Ok(b) => assert_eq!(b.payload(), [i as u8; 100], "block {i}"),
            Err(e) => assert_eq!((i as u64, e.block()), (bad_logical, Some(bad)), "{e}"),
        }
    }
    assert!(read[bad_logical as usize].is_err());
}

#[test]
fn random_read_errors_never_give_wrong_bytes() {
    let (mem, store) = mem_store(1024);
    let model = workload(&store, 4, |_| {}).unwrap();
    mem.set_faults(FaultPlan { seed: 5, read_error_rate: 0.1, ..Default::default() });
    let snap = store.snapshot();
    let (mut ok, mut failed) = (0, 0);
    for (name, want) in &model {
        let ctx = snap.context(name).unwrap();
        for ((layer, head, s), blocks) in &want.streams {
            let which = if *s == 0 { ctxfs_vfs::FileStream::Index } else { ctxfs_vfs::FileStream::Data };
            let Ok(stream) = ctx.stream(*layer, *head, which) else {
                continue;
            };
            for (l, want) in blocks.iter().enumerate() {
                match stream.read(l as u64) {
                    Ok(b) => {
                        assert_eq!(b.payload(), &want[..]);
                        ok += 1;
                    }
                    Err(e) => {
                        assert!(matches!(e, Error::BlockIo { .. }), "{e}");
                        failed += 1;
                    }
                }
            }
        }
    }
    assert!(ok > 0 && failed > 0, "{ok} ok, {failed} failed");
}

#[test]
fn torn_and_misdirected_writes_are_caught_by_checksums() {
    let (last_commit_start, total) = {
        let (mem, store) = mem_store(1024);
        mem.set_faults(FaultPlan::default());
        let mut after_each = Vec::new();
        workload(&store, 6, |_| after_each.push(mem.ops())).unwrap();
        (after_each[after_each.len() - 2], mem.ops())
    };
    // The last operations are: ..., last allocator write, flush, superblock write, flush.
    // Every write of the last commit lands in the final state, so damage to it must show.
    let writes = last_commit_start..total - 3;
    assert!(writes.end - writes.start >= 10);
    let mut cases = Vec::new();
    for op in writes.step_by(3) {
        cases.push((format!("torn write at op {op}"), FaultPlan { torn_write: Some((op, 20)), ..Default::default() }));
        cases.push((
            format!("misdirected write at op {op}"),
            FaultPlan { misdirected_write: Some((op, 1000)), ..Default::default() },
        ));
    }
    for (name, plan) in cases {
        let (mem, store) = mem_store(1024);
        mem.set_faults(plan);
        // The device reports success: the damage is silent until something reads it.
        workload(&store, 6, |_| {}).unwrap();
        mem.set_faults(FaultPlan::default());
        drop(store);
        let image = Arc::new(MemDevice::from_image(mem.current_image(), BS));
        let report = fsck::check(image.as_ref()).unwrap();
        assert_eq!(report.exit_code(), fsck::EXIT_UNCORRECTED, "{name}: {:?}", report.problems);
    }
}
