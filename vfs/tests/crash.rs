//! Crash consistency: run a workload of commits on the in-memory device, crash after every
//! single write and every flush in turn, and check what recovery finds. Two workloads: plain
//! contexts, and contexts derived from others (children, retirement, freeing retired chains).

mod common;
use common::*;
use ctxfs_vfs::device::{CrashMode, FaultPlan, MemDevice};
use ctxfs_vfs::{fsck, Store};
use std::sync::Arc;

const BLOCKS: u64 = 1024;

type Workload = fn(&Store, u64) -> Result<Model, Box<Interrupted>>;
const PLAIN: Workload = |store, seed| workload(store, seed, |_| {});
const FAMILY: Workload = |store, seed| family_workload(store, seed, |_| {});

/// Runs the workload with a crash after `crash_after` operations; returns the recovered store,
/// the last committed model and the model of the commit in flight.
fn crash_at(
    work: Workload,
    crash_after: u64,
    mode: CrashMode,
    seed: u64,
) -> Option<(Arc<MemDevice>, Store, Model, Model)> {
    let (mem, store) = mem_store(BLOCKS);
    mem.set_faults(FaultPlan { seed, crash_after_ops: Some(crash_after), crash_mode: mode, ..Default::default() });
    let (committed, attempted) = match work(&store, seed) {
        Ok(_) => return None, // the workload finished before the crash point
        Err(stop) => (stop.committed, stop.attempted),
    };
    mem.crash();
    drop(store);
    let recovered = Arc::new(MemDevice::from_image(mem.durable_image(), BS));
    let store =
        Store::open(recovered.clone()).unwrap_or_else(|e| panic!("crash point {crash_after}: reopen failed: {e}"));
    Some((recovered, store, committed, attempted))
}

/// Operations the whole workload takes on the mem device.
fn workload_ops(work: Workload, seed: u64) -> u64 {
    let (mem, store) = mem_store(BLOCKS);
    mem.set_faults(FaultPlan::default());
    work(&store, seed).unwrap();
    mem.ops()
}

fn run_crash_points(work: Workload, mode: CrashMode, seed: u64, allow_torn_fallback: bool) -> u64 {
    let total = workload_ops(work, seed);
    let mut tried = 0;
    for point in 0..total {
        let Some((dev, store, committed, attempted)) = crash_at(work, point, mode, seed) else {
            continue;
        };
        tried += 1;
        // Exactly the last committed state, or (when the superblock of the commit in flight
        // reached the medium) that commit's state. Never anything in between.
        let is_old = matches(&store, &committed);
        let is_new = !is_old && matches(&store, &attempted);
        assert!(
            is_old || is_new,
            "crash point {point}: recovered state is neither the committed nor the attempted one"
        );
        if mode == CrashMode::DropUnflushed {
            assert!(is_old, "crash point {point}: an unflushed commit became visible");
        }
        let report = fsck::check(dev.as_ref()).unwrap();
        let real: Vec<_> = report
            .problems
            .iter()
            .filter(|p| !(allow_torn_fallback && p.fix == fsck::Fix::RewriteFallbackSuperblock))
            .collect();
        assert!(real.is_empty(), "crash point {point}: fsck found {real:?}");
        // The recovered store takes new commits and stays consistent.
        let mut txn = store.begin().unwrap();
        txn.create_context("after-crash", shape(1, 1), &[1, 2, 3]).unwrap();
        txn.commit().unwrap();
        drop(store);
        let report = fsck::check(dev.as_ref()).unwrap();
        assert!(report.is_clean(), "crash point {point}: fsck after a new commit found {:?}", report.problems);
    }
    println!("{mode:?}: tried {tried} crash points of {total} operations");
    assert!(tried > 100, "too few crash points: {tried}");
    tried
}

#[test]
fn crash_after_every_write_and_flush_drops_unflushed_writes() {
    let tried: u64 = (1..=4).map(|seed| run_crash_points(PLAIN, CrashMode::DropUnflushed, seed, false)).sum();
    println!("crash points tried in all: {tried}");
}

#[test]
fn crash_with_a_torn_last_write() {
    for (seed, keep) in [(2, 1000), (5, 20), (6, 3000)] {
        run_crash_points(PLAIN, CrashMode::TearLast { keep }, seed, true);
    }
}

#[test]
fn crash_keeping_a_random_subset_of_unflushed_writes() {
    for seed in [3, 7, 8] {
        run_crash_points(PLAIN, CrashMode::KeepRandom, seed, true);
    }
}

#[test]
fn crash_while_children_are_created_and_parents_retired_or_freed() {
    for seed in [1, 2] {
        run_crash_points(FAMILY, CrashMode::DropUnflushed, seed, false);
    }
    run_crash_points(FAMILY, CrashMode::TearLast { keep: 100 }, 3, true);
    run_crash_points(FAMILY, CrashMode::TearLast { keep: 2000 }, 4, true);
    run_crash_points(FAMILY, CrashMode::KeepRandom, 5, true);
}

#[test]
fn crash_then_repair_rewrites_a_torn_fallback_superblock() {
    // Crash while the superblock of each commit is being written, torn at 100 bytes.
    let total = workload_ops(PLAIN, 4);
    let mut torn_superblocks = 0;
    for point in 0..total {
        let Some((dev, store, committed, _)) = crash_at(PLAIN, point, CrashMode::TearLast { keep: 100 }, 4) else {
            continue;
        };
        drop(store);
        let report = fsck::check(dev.as_ref()).unwrap();
        if report.problems.iter().any(|p| p.fix == fsck::Fix::RewriteFallbackSuperblock) {
            torn_superblocks += 1;
            let repaired = fsck::repair(dev.clone(), false).unwrap();
            assert_eq!(repaired.exit_code(), fsck::EXIT_CORRECTED, "{repaired:?}");
            let store = Store::open(dev.clone()).unwrap();
            assert_matches(&store, &committed);
        }
    }
    assert!(torn_superblocks >= 5, "only {torn_superblocks} crash points tore a superblock");
}
