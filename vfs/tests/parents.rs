//! Contexts derived from others (format version 2) on the real devices: a child reads its
//! parent's prefix without copying it, a parent deleted while children live is retired, and
//! the last child's deletion frees the retired chain above it. fsck checks the links.

mod common;
use common::*;
use ctxfs_vfs::format::{BlockKind, StreamTag};
use ctxfs_vfs::inspect::{live_blocks, LiveBlock};
use ctxfs_vfs::{device, fsck, BlockDevice, DeviceChoice, Error, ParentLink, Snapshot, SplitMix64, Store};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;

const SIZE: u64 = 8 << 20;

fn open_dev(path: &Path) -> Arc<dyn BlockDevice> {
    Arc::from(device::open_path(path, DeviceChoice::Uring, BS, ctxfs_vfs::Access::Write).unwrap())
}

/// The live blocks context `id` owns: its record chain and all its streams.
fn owned(snap: &Snapshot, id: u32) -> Vec<LiveBlock> {
    live_blocks(snap).unwrap().into_iter().filter(|b| b.owner.context == id).collect()
}

fn is_record(b: &LiveBlock) -> bool {
    b.kind == BlockKind::Catalog && b.stream == StreamTag::Meta
}

fn id_of(store: &Store, name: &str) -> u32 {
    store.snapshot().context(name).unwrap().record().id
}

fn assert_clean(dev: &dyn BlockDevice) {
    let report = fsck::check(dev).unwrap();
    assert!(report.is_clean(), "{:#?}", report.problems);
}

/// Names of the retired contexts, which keep the name they had.
fn retired(store: &Store) -> BTreeSet<String> {
    store.snapshot().retired_contexts().map(|r| r.name.clone()).collect()
}

/// Commits one change to the store and the model.
fn commit(store: &Store, model: &mut Model, rng: &mut SplitMix64, step: Step) {
    let mut txn = store.begin().unwrap();
    step(&mut txn, model, rng).unwrap();
    txn.commit().unwrap();
}

#[test]
fn a_child_reads_its_parents_prefix_without_copying_it() {
    for choice in REAL_DEVICES {
        let dir = tmpdir();
        let path = dir.path().join("child.img");
        let store = file_store(&path, 16 << 20, choice);
        let (mut model, mut rng) = (Model::new(), SplitMix64::new(1));
        // 2500 tokens take three token blocks; the child's prefix ends inside the second.
        commit(&store, &mut model, &mut rng, |t, m, r| create(t, m, r, "parent", shape(2, 2), 2500));
        let parent_id = id_of(&store, "parent");
        let parent_blocks = owned(&store.snapshot(), parent_id);
        let parent_bytes: Vec<_> =
            parent_blocks.iter().map(|b| fsck::raw_block(store.device().as_ref(), b.block).unwrap()).collect();
        let used = store.space().used;
        commit(&store, &mut model, &mut rng, |t, m, r| create_child(t, m, r, "child", "parent", 1500, 700));
        drop(store);

        let store = Store::open_path(&path, choice).unwrap();
        assert_matches(&store, &model);
        let snap = store.snapshot();
        let (child, parent) = (snap.context("child").unwrap(), snap.context("parent").unwrap());
        assert_eq!(child.parent(), Some(ParentLink { id: parent_id, prefix_tokens: 1500 }));
        assert_eq!((child.token_count(), child.own_token_count()), (2200, 700));
        assert_eq!(child.tokens().unwrap()[..1500], parent.tokens().unwrap()[..1500]);
        assert_eq!(child.own_tokens().unwrap(), model["child"].tokens[1500..]);
        assert_eq!(child.record().shape, parent.record().shape);
        // Its own streams: one token block for 700 tokens, two blocks per vector stream.
        let child_blocks = owned(&snap, child.record().id);
        let count = |kind, stream| child_blocks.iter().filter(|b| b.kind == kind && b.stream == stream).count();
        assert_eq!(count(BlockKind::Catalog, StreamTag::Tokens), 1);
        assert_eq!(count(BlockKind::Index, StreamTag::Index) + count(BlockKind::Data, StreamTag::Data), 16);
        // The parent's blocks are where they were, byte for byte, and the store grew by
        // exactly the child's blocks: nothing was copied.
        assert_eq!(owned(&snap, parent_id), parent_blocks);
        for (b, before) in parent_blocks.iter().zip(&parent_bytes) {
            assert_eq!(fsck::raw_block(store.device().as_ref(), b.block).unwrap()[..], before[..]);
        }
        assert_eq!(store.space().used - used, child_blocks.len() as u64, "{choice:?}");
        assert_clean(store.device().as_ref());
    }
}

#[test]
fn bad_child_arguments_are_refused_and_nothing_is_written() {
    let dir = tmpdir();
    let path = dir.path().join("bad.img");
    let store = file_store(&path, SIZE, DeviceChoice::Uring);
    let (mut model, mut rng) = (Model::new(), SplitMix64::new(2));
    commit(&store, &mut model, &mut rng, |t, m, r| {
        create(t, m, r, "live", shape(1, 2), 100)?;
        create(t, m, r, "gone", shape(1, 2), 100)
    });
    commit(&store, &mut model, &mut rng, |t, m, r| create_child(t, m, r, "kid", "gone", 100, 5));
    commit(&store, &mut model, &mut rng, |t, m, _| delete(t, m, "gone"));
    assert_eq!(retired(&store), ["gone".to_string()].into());
    let next_id = store.snapshot().superblock().next_context_id;
    let image = std::fs::read(&path).unwrap();

    let mut txn = store.begin().unwrap();
    let invalid = |r: Result<(), Error>| matches!(r, Err(Error::InvalidArgument(_)));
    assert!(invalid(txn.create_child_context("c", "live", 0, &[1])), "an empty prefix");
    assert!(invalid(txn.create_child_context("c", "live", 101, &[1])), "a prefix longer than the parent");
    assert!(matches!(txn.create_child_context("c", "nobody", 1, &[1]), Err(Error::NoSuchContext(_))));
    assert!(matches!(txn.create_child_context("c", "gone", 1, &[1]), Err(Error::NoSuchContext(_))), "retired");
    assert!(matches!(txn.create_child_context("kid", "live", 1, &[1]), Err(Error::ContextExists(_))));
    assert!(invalid(txn.create_child_context("", "live", 1, &[1])));
    let err = txn.create_child_context("c", "live", 101, &[1]).unwrap_err().to_string();
    assert!(err.contains("1..=100") && err.contains("101"), "{err}");
    drop(txn);
    assert!(std::fs::read(&path).unwrap() == image, "refused children write nothing");

    // A parent created in the same transaction is not committed yet.
    let mut txn = store.begin().unwrap();
    txn.create_context("fresh", shape(1, 2), &[1, 2, 3]).unwrap();
    let err = txn.create_child_context("c", "fresh", 1, &[1]).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)) && err.to_string().contains("commit it"), "{err}");
    drop(txn);

    commit(&store, &mut model, &mut rng, |t, m, r| create_child(t, m, r, "c", "live", 100, 7));
    assert_eq!(id_of(&store, "c"), next_id, "refused children take no id");
    assert_matches(&store, &model);
    assert_clean(store.device().as_ref());
}

#[test]
fn a_deleted_parent_is_retired_until_its_last_child_goes() {
    let dir = tmpdir();
    let path = dir.path().join("retire.img");
    let store = file_store(&path, SIZE, DeviceChoice::Uring);
    let (mut model, mut rng) = (Model::new(), SplitMix64::new(3));
    let used_empty = store.space().used;
    commit(&store, &mut model, &mut rng, |t, m, r| create(t, m, r, "p", shape(1, 2), 3000));
    commit(&store, &mut model, &mut rng, |t, m, r| create_child(t, m, r, "c", "p", 2000, 500));
    let (p_id, c_id) = (id_of(&store, "p"), id_of(&store, "c"));
    let p_tokens = model["p"].tokens.clone();
    let p_blocks: Vec<_> = owned(&store.snapshot(), p_id).into_iter().filter(|b| !is_record(b)).collect();
    let used = store.space().used;

    commit(&store, &mut model, &mut rng, |t, m, _| delete(t, m, "p"));
    let snap = store.snapshot();
    assert!(matches!(snap.context("p"), Err(Error::NoSuchContext(_))));
    assert_eq!(snap.contexts().map(|c| c.name.as_str()).collect::<Vec<_>>(), ["c"]);
    let p = snap.context_by_id(p_id).unwrap();
    assert!(p.record().retired && p.record().name == "p");
    assert_eq!(snap.retired_contexts().map(|r| r.id).collect::<Vec<_>>(), [p_id]);
    // Only its record was rewritten; every stream block is still allocated where it was.
    let still: Vec<_> = owned(&snap, p_id).into_iter().filter(|b| !is_record(b)).collect();
    assert_eq!(still, p_blocks);
    assert_eq!(store.space().used, used);
    drop(snap);

    // The name is free again.
    commit(&store, &mut model, &mut rng, |t, m, r| create(t, m, r, "p", shape(1, 1), 5));
    drop(store);
    let store = Store::open_path(&path, DeviceChoice::Uring).unwrap();
    assert_matches(&store, &model);
    assert_eq!(store.snapshot().context("c").unwrap().tokens().unwrap()[..2000], p_tokens[..2000]);
    assert_eq!(retired(&store), ["p".to_string()].into());
    assert_clean(store.device().as_ref());

    // The last child goes, and the retired parent with it.
    let used = store.space().used;
    let freed = (owned(&store.snapshot(), p_id).len() + owned(&store.snapshot(), c_id).len()) as u64;
    commit(&store, &mut model, &mut rng, |t, m, _| delete(t, m, "c"));
    assert!(retired(&store).is_empty());
    assert!(owned(&store.snapshot(), p_id).is_empty() && owned(&store.snapshot(), c_id).is_empty());
    assert_eq!(used - store.space().used, freed, "the allocator got back every block of both");
    assert!(store.space().reclaimable >= freed);
    commit(&store, &mut model, &mut rng, |t, m, _| delete(t, m, "p"));
    assert_eq!(store.space().used, used_empty);
    assert_matches(&store, &model);
    assert_clean(store.device().as_ref());
}

#[test]
fn a_retirement_and_a_child_in_one_transaction() {
    let dir = tmpdir();
    let store = file_store(&dir.path().join("one.img"), SIZE, DeviceChoice::Uring);
    let (mut model, mut rng) = (Model::new(), SplitMix64::new(4));
    let used_empty = store.space().used;
    commit(&store, &mut model, &mut rng, |t, m, r| {
        create(t, m, r, "p", shape(1, 1), 1100)?;
        create(t, m, r, "q", shape(1, 1), 10)
    });
    // Appended to, given a child and deleted in one go: retired, with the appended tokens.
    commit(&store, &mut model, &mut rng, |t, m, r| {
        append(t, m, r, "p", 100, 1)?;
        create_child(t, m, r, "c", "p", 1150, 3)?;
        delete(t, m, "p")?;
        // A child made and deleted again leaves its parent as it was.
        create_child(t, m, r, "d", "q", 10, 1)?;
        delete(t, m, "d")?;
        delete(t, m, "q")
    });
    assert_eq!(retired(&store), ["p".to_string()].into());
    assert_matches(&store, &model);
    assert_clean(store.device().as_ref());
    commit(&store, &mut model, &mut rng, |t, m, _| delete(t, m, "c"));
    assert!(retired(&store).is_empty());
    assert_eq!(store.space().used, used_empty);
    assert_clean(store.device().as_ref());
}

#[test]
fn a_chain_of_three_deleted_in_every_order() {
    const NAMES: [&str; 3] = ["g", "p", "c"];
    let orders = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
    let dir = tmpdir();
    for (n, order) in orders.iter().enumerate() {
        for one_commit in [false, true] {
            let path = dir.path().join(format!("chain{n}{one_commit}.img"));
            let store = file_store(&path, SIZE, DeviceChoice::Uring);
            let (mut model, mut rng) = (Model::new(), SplitMix64::new(n as u64));
            let used_empty = store.space().used;
            commit(&store, &mut model, &mut rng, |t, m, r| create(t, m, r, "g", shape(1, 2), 1200));
            commit(&store, &mut model, &mut rng, |t, m, r| create_child(t, m, r, "p", "g", 1000, 300));
            commit(&store, &mut model, &mut rng, |t, m, r| create_child(t, m, r, "c", "p", 1100, 200));
            let mut deleted = Vec::new();
            let mut txn = store.begin().unwrap();
            for &i in order {
                delete(&mut txn, &mut model, NAMES[i]).unwrap();
                deleted.push(i);
                if !one_commit || deleted.len() == 3 {
                    txn.commit().unwrap();
                    // A deleted context stays retired while a later one in the chain lives.
                    let live_below = |i: usize| (i + 1..3).any(|j| !deleted.contains(&j));
                    let want: BTreeSet<String> =
                        deleted.iter().filter(|&&i| live_below(i)).map(|&i| NAMES[i].to_string()).collect();
                    assert_eq!(retired(&store), want, "order {order:?} after deleting {deleted:?}");
                    assert_matches(&store, &model);
                    assert_clean(store.device().as_ref());
                    txn = store.begin().unwrap();
                }
            }
            drop(txn);
            assert_eq!(store.space().used, used_empty, "order {order:?}: every block is back");
            drop(store);
            let store = Store::open_path(&path, DeviceChoice::Uring).unwrap();
            assert!(store.snapshot().contexts().next().is_none() && retired(&store).is_empty());
        }
    }
}

#[test]
fn the_family_workload_retires_and_frees_as_it_goes() {
    let dir = tmpdir();
    let path = dir.path().join("family.img");
    let store = file_store(&path, SIZE, DeviceChoice::Uring);
    let mut counts = Vec::new();
    let model = family_workload(&store, 9, |_| counts.push(retired(&store).len())).unwrap();
    assert_eq!(counts, [0, 0, 1, 1, 2, 0, 1]);
    drop(store);
    let store = Store::open_path(&path, DeviceChoice::Uring).unwrap();
    assert_matches(&store, &model);
    assert_clean(store.device().as_ref());
}

/// A store with context "p" retired and its child "c" living; returns the active slot and the
/// ids of "p" and "c".
fn retired_parent_image(path: &Path) -> (u64, u32, u32) {
    let store = file_store(path, SIZE, DeviceChoice::Uring);
    let (mut model, mut rng) = (Model::new(), SplitMix64::new(5));
    commit(&store, &mut model, &mut rng, |t, m, r| create(t, m, r, "p", shape(1, 1), 500));
    commit(&store, &mut model, &mut rng, |t, m, r| create_child(t, m, r, "c", "p", 400, 50));
    let (p, c) = (id_of(&store, "p"), id_of(&store, "c"));
    commit(&store, &mut model, &mut rng, |t, m, _| delete(t, m, "p"));
    (store.snapshot().superblock().slot(), p, c)
}

#[test]
fn fsck_frees_a_retired_context_that_nothing_descends_from() {
    let dir = tmpdir();
    let path = dir.path().join("leak.img");
    let (slot, p, _) = retired_parent_image(&path);
    let dev = open_dev(&path);
    tamper(dev.as_ref(), slot, "c", |r| r.parent = None);
    let report = fsck::check(dev.as_ref()).unwrap();
    assert_eq!(report.exit_code(), fsck::EXIT_UNCORRECTED);
    let leak: Vec<_> = report.problems.iter().filter(|p| p.fix == fsck::Fix::FreeRetired).collect();
    assert_eq!(leak.len(), 1, "{:#?}", report.problems);
    assert!(leak[0].message.contains(&format!("retired context {p}")) && leak[0].message.contains("no live"));
    assert_eq!(report.problems.len(), 1, "{:#?}", report.problems);

    let used = Store::open(dev.clone()).unwrap().space().used;
    let p_blocks = owned(&Store::open(dev.clone()).unwrap().snapshot(), p).len() as u64;
    let repaired = fsck::repair(dev.clone(), false).unwrap();
    assert_eq!(repaired.exit_code(), fsck::EXIT_CORRECTED, "{repaired:#?}");
    assert!(repaired.repaired.iter().any(|r| r.contains("freed retired context")), "{:?}", repaired.repaired);
    let store = Store::open(dev.clone()).unwrap();
    assert!(retired(&store).is_empty());
    assert_eq!(used - store.space().used, p_blocks);
    drop(store);
    assert_clean(dev.as_ref());
}

#[test]
fn fsck_reports_broken_parent_links() {
    let dir = tmpdir();
    let pristine = dir.path().join("links.img");
    let (slot, p, c) = retired_parent_image(&pristine);
    type Tamper = (&'static str, fn(&mut ctxfs_vfs::ContextRecord, u32, u32), &'static str);
    let cases: [Tamper; 5] = [
        ("c", |r, _, _| r.parent = Some(ParentLink { id: 77, prefix_tokens: 1 }), "parent context 77 does not exist"),
        ("c", |r, p, _| r.parent = Some(ParentLink { id: p, prefix_tokens: 501 }), "exceeds the 500 tokens"),
        ("c", |r, p, _| r.parent = Some(ParentLink { id: p, prefix_tokens: 0 }), "prefix of 0 tokens"),
        ("c", |r, _, _| r.shape.head_dim = 32, "differs from parent context"),
        ("p", |r, _, c| r.parent = Some(ParentLink { id: c, prefix_tokens: 1 }), "loop back"),
    ];
    for (n, (name, change, message)) in cases.into_iter().enumerate() {
        let img = dir.path().join(format!("case{n}.img"));
        std::fs::copy(&pristine, &img).unwrap();
        let dev = open_dev(&img);
        tamper(dev.as_ref(), slot, name, |r| change(r, p, c));
        let report = fsck::check(dev.as_ref()).unwrap();
        assert_eq!(report.exit_code(), fsck::EXIT_UNCORRECTED);
        let found = report.problems.iter().find(|pr| pr.message.contains(message));
        let found = found.unwrap_or_else(|| panic!("case {n}: no {message:?} in {:#?}", report.problems));
        assert_eq!(found.fix, fsck::Fix::None);
        let store = Store::open(dev.clone()).unwrap();
        let snap = store.snapshot();
        let child = snap.context("c").unwrap();
        assert_eq!(child.own_tokens().unwrap().len(), 50, "case {n}: its own tokens still read");
        if n < 2 || n == 4 {
            // Reading through the broken link is an error naming a record block, never a panic or a hang.
            let err = child.tokens().unwrap_err();
            assert!(matches!(err, Error::Damaged { .. }) && err.block().is_some(), "case {n}: {err}");
        }
        drop(snap);
        drop(store);
        // Repair cannot mend a link, but the store stays usable: deleting the child cleans up.
        let after = fsck::repair(dev.clone(), false).unwrap();
        assert_eq!(after.exit_code(), fsck::EXIT_UNCORRECTED, "case {n}: {after:#?}");
        let store = Store::open(dev.clone()).unwrap();
        let mut txn = store.begin().unwrap();
        txn.delete_context("c").unwrap();
        txn.commit().unwrap();
        drop(store);
        let report = fsck::repair(dev.clone(), false).unwrap();
        assert!(report.problems.is_empty(), "case {n}: {:#?}", report.problems);
    }
}

#[test]
fn dropping_a_damaged_context_takes_its_descendants_and_frees_unneeded_parents() {
    let dir = tmpdir();
    let pristine = dir.path().join("drop.img");
    let (_, p, c) = retired_parent_image(&pristine);
    // Damage to the retired parent, then to the child.
    for (n, (victim, dropped)) in [(p, vec![p, c]), (c, vec![c, p])].into_iter().enumerate() {
        let img = dir.path().join(format!("drop{n}.img"));
        std::fs::copy(&pristine, &img).unwrap();
        let dev = open_dev(&img);
        let block = {
            let store = Store::open(dev.clone()).unwrap();
            let snap = store.snapshot();
            owned(&snap, victim).iter().find(|b| b.kind == BlockKind::Data).unwrap().block
        };
        let mut buf = device::AlignedBuf::zeroed(BS);
        buf.fill(0xAB);
        dev.submit(&mut [device::IoOp::Write { block, buf: &buf }]).pop().unwrap().unwrap();
        assert_eq!(fsck::repair(dev.clone(), false).unwrap().exit_code(), fsck::EXIT_UNCORRECTED);
        let report = fsck::repair(dev.clone(), true).unwrap();
        assert_eq!(report.exit_code(), fsck::EXIT_CORRECTED, "case {n}: {report:#?}");
        assert_eq!(report.repaired.len(), 2, "case {n}: {:?}", report.repaired);
        let store = Store::open(dev.clone()).unwrap();
        let snap = store.snapshot();
        assert!(snap.contexts().next().is_none() && snap.retired_contexts().next().is_none());
        for id in dropped {
            assert!(owned(&snap, id).is_empty());
        }
    }
}
