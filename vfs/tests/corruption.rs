//! Corruption of real image files: flip bits in, zero, or swap live blocks. fsck must name
//! every damaged block and exit 4, never panic; opening must refuse damaged metadata; reading
//! damaged data must give a per-block error, never wrong bytes.

mod common;
use common::*;
use ctxfs_vfs::format::BlockKind;
use ctxfs_vfs::inspect::{live_blocks, LiveBlock};
use ctxfs_vfs::{device, fsck, BlockDevice, DeviceChoice, Error, SplitMix64, Store};
use std::collections::BTreeSet;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

const SIZE: u64 = 8 << 20;

#[derive(Debug, Clone, Copy)]
enum Damage {
    FlipBit,
    Zero,
    Swap,
}

type Workload = fn(&Store, u64) -> Result<Model, Box<Interrupted>>;
const PLAIN: Workload = |store, seed| workload(store, seed, |_| {});
/// Ends with a retired context whose blocks a live child reads.
const FAMILY: Workload = |store, seed| family_workload(store, seed, |_| {});

fn build(path: &Path, choice: DeviceChoice, work: Workload) -> (Model, Vec<LiveBlock>) {
    let store = file_store(path, SIZE, choice);
    let model = work(&store, 7).unwrap();
    let live = live_blocks(&store.snapshot()).unwrap();
    (model, live)
}

/// A fresh store on an image file named `name` in a new scratch directory (returned, to keep
/// it alive), through io_uring.
fn uring_image(name: &str) -> (tempfile::TempDir, std::path::PathBuf, Store) {
    let dir = tmpdir();
    let img = dir.path().join(name);
    let store = file_store(&img, SIZE, DeviceChoice::Uring);
    (dir, img, store)
}

/// Creates a small context of each name, one commit each.
fn commit_each(store: &Store, model: &mut Model, rng: &mut SplitMix64, names: &[&str]) {
    for name in names {
        let mut txn = store.begin().unwrap();
        create(&mut txn, model, rng, name, shape(1, 1), 30).unwrap();
        txn.commit().unwrap();
    }
}

fn open_dev(path: &Path, choice: DeviceChoice) -> Arc<dyn BlockDevice> {
    Arc::from(device::open_path(path, choice, BS, ctxfs_vfs::Access::Write).unwrap())
}

fn read_raw(path: &Path, block: u64) -> Vec<u8> {
    let mut buf = vec![0; BS];
    std::fs::File::open(path).unwrap().read_exact_at(&mut buf, block * BS as u64).unwrap();
    buf
}

fn write_raw(path: &Path, block: u64, data: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, block * BS as u64).unwrap();
    f.sync_all().unwrap();
}

/// Damages blocks and returns those whose bytes changed.
fn damage(path: &Path, rng: &mut SplitMix64, how: Damage, targets: &[u64]) -> Vec<u64> {
    let mut changed = Vec::new();
    match how {
        Damage::FlipBit => {
            for &b in targets {
                let mut data = read_raw(path, b);
                let bit = rng.below((BS * 8) as u64) as usize;
                data[bit / 8] ^= 1 << (bit % 8);
                write_raw(path, b, &data);
                changed.push(b);
            }
        }
        Damage::Zero => {
            for &b in targets {
                write_raw(path, b, &vec![0; BS]);
                changed.push(b);
            }
        }
        Damage::Swap => {
            for pair in targets.chunks_exact(2) {
                let (a, b) = (read_raw(path, pair[0]), read_raw(path, pair[1]));
                write_raw(path, pair[0], &b);
                write_raw(path, pair[1], &a);
                changed.extend_from_slice(pair);
            }
        }
    }
    changed
}

fn corruption_trials(choice: DeviceChoice, work: Workload) {
    let dir = tmpdir();
    let pristine = dir.path().join("pristine.img");
    let (_, live) = build(&pristine, choice, work);
    let active_slot = Store::open(open_dev(&pristine, choice)).unwrap().snapshot().superblock().slot();
    // Damage to the active superblock is a fallback case of its own (tested below).
    let candidates: Vec<u64> = live.iter().map(|b| b.block).filter(|&b| b != active_slot).collect();
    let mut rng = SplitMix64::new(11);
    let mut trials = 0;
    let mut blind_trials = 0;
    for trial in 0..60 {
        let img = dir.path().join(format!("trial{trial}.img"));
        std::fs::copy(&pristine, &img).unwrap();
        let how = [Damage::FlipBit, Damage::Zero, Damage::Swap][trial % 3];
        let n = if matches!(how, Damage::Swap) { 2 } else { 1 + rng.below(3) as usize };
        let mut targets: Vec<u64> = (0..n).map(|_| candidates[rng.below(candidates.len() as u64) as usize]).collect();
        targets.sort();
        targets.dedup();
        if matches!(how, Damage::Swap) && targets.len() != 2 {
            continue;
        }
        let changed = damage(&img, &mut rng, how, &targets);
        let dev = open_dev(&img, choice);
        let report = fsck::check(dev.as_ref()).unwrap();
        assert_eq!(report.exit_code(), fsck::EXIT_UNCORRECTED, "trial {trial} {how:?} {changed:?}: {report:?}");
        let named = report.damaged_blocks();
        let hiding = |p: &fsck::Problem| p.fix == fsck::Fix::FallBackToOlderState || p.kind == "extent";
        let blind =
            report.problems.iter().any(hiding) && report.problems.iter().any(|p| p.fix == fsck::Fix::RebuildAllocator);
        if blind {
            // The allocator and the metadata above the damage (the newest catalog, or an
            // extent block) are both unreadable: a zeroed block below them cannot be told
            // from free space. The damaged metadata itself is still named.
            assert!(changed.iter().any(|b| named.contains(b)), "trial {trial}: nothing named");
            blind_trials += 1;
            continue;
        }
        for b in &changed {
            assert!(
                named.contains(b),
                "trial {trial} {how:?}: damaged block {b} not named; fsck named {named:?}: {:#?}",
                report.problems
            );
        }
        check_reads(&img, choice, &live, &changed);
        trials += 1;
        std::fs::remove_file(&img).unwrap();
    }
    println!("{choice:?}: {trials} corruption trials, {blind_trials} with metadata and allocator both unreadable");
    assert!(trials >= 45 && blind_trials <= 5, "{trials} trials, {blind_trials} blind");
}

/// Opening refuses damaged metadata with an error naming a damaged block; damaged content
/// blocks give a per-block error and every other block reads back intact.
fn check_reads(img: &Path, choice: DeviceChoice, live: &[LiveBlock], changed: &[u64]) {
    let kind_of = |b: u64| live.iter().find(|l| l.block == b).map(|l| l.kind).unwrap();
    let metadata_hit = changed.iter().any(|&b| {
        matches!(kind_of(b), BlockKind::Catalog | BlockKind::Alloc)
            && live.iter().any(|l| l.block == b && l.stream == ctxfs_vfs::format::StreamTag::Meta)
    });
    let store = match Store::open(open_dev(img, choice)) {
        Ok(store) => store,
        Err(e) => {
            assert!(metadata_hit, "open failed though no metadata was damaged: {e}");
            let block = e.block().unwrap_or_else(|| panic!("open error names no block: {e}"));
            assert!(changed.contains(&block), "open error names block {block}, damaged were {changed:?}: {e}");
            return;
        }
    };
    let snap = store.snapshot();
    // A context whose record is damaged is left out, naming the block; the others are served.
    for d in snap.damaged_contexts() {
        assert!(
            d.block.is_some_and(|b| changed.contains(&b)),
            "context {:?} damaged elsewhere: {}",
            d.entry.name,
            d.why
        );
    }
    for ctx in snap.contexts() {
        let c = snap.context(&ctx.name).unwrap();
        for layer in 0..ctx.shape.layers {
            for head in 0..ctx.shape.kv_heads {
                for which in [ctxfs_vfs::FileStream::Index, ctxfs_vfs::FileStream::Data] {
                    let stream = match c.stream(layer, head, which) {
                        Ok(s) => s,
                        Err(e) => {
                            assert!(e.block().is_some_and(|b| changed.contains(&b)), "stream open error {e}");
                            continue;
                        }
                    };
                    for l in 0..stream.blocks() {
                        let (block, _) = stream.locate(l).unwrap();
                        match stream.read(l) {
                            Ok(_) => assert!(!changed.contains(&block), "damaged block {block} read as good"),
                            Err(Error::Damaged { block: b, .. }) => assert_eq!(b, block),
                            Err(e) => panic!("unexpected error {e}"),
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn fsck_names_every_damaged_block_on_uring() {
    corruption_trials(DeviceChoice::Uring, PLAIN);
}

#[test]
fn fsck_names_every_damaged_block_on_file_device() {
    corruption_trials(DeviceChoice::File, PLAIN);
}

#[test]
fn fsck_names_every_damaged_block_of_retired_contexts_and_children() {
    corruption_trials(DeviceChoice::Uring, FAMILY);
}

#[test]
fn damaged_active_superblock_falls_back_and_repair_revives_the_older_state() {
    let (dir, img, store) = uring_image("sb.img");
    let mut before_last = None;
    let model = workload(&store, 8, |m| before_last = Some(m.clone())).unwrap();
    let slot = store.snapshot().superblock().slot();
    drop(store);
    let _ = model;
    let mut rng = SplitMix64::new(1);
    damage(&img, &mut rng, Damage::FlipBit, &[slot]);
    // Recovery takes the newest valid superblock: the previous commit.
    let store = Store::open(open_dev(&img, DeviceChoice::Uring)).unwrap();
    let mut models = Vec::new();
    workload(&file_store(&dir.path().join("replay.img"), SIZE, DeviceChoice::Uring), 8, |m| models.push(m.clone()))
        .unwrap();
    assert_matches(&store, &models[models.len() - 2]);
    drop(store);
    let report = fsck::check(open_dev(&img, DeviceChoice::Uring).as_ref()).unwrap();
    assert_eq!(report.exit_code(), fsck::EXIT_UNCORRECTED);
    assert!(report.damaged_blocks().contains(&slot));
    let repaired = fsck::repair(open_dev(&img, DeviceChoice::Uring), false).unwrap();
    assert_eq!(repaired.exit_code(), fsck::EXIT_CORRECTED, "{repaired:?}");
    assert!(fsck::check(open_dev(&img, DeviceChoice::Uring).as_ref()).unwrap().is_clean());
}

#[test]
fn repair_falls_back_when_the_newest_catalog_is_damaged() {
    let (_dir, img, store) = uring_image("cat.img");
    let mut models = Vec::new();
    workload(&store, 9, |m| models.push(m.clone())).unwrap();
    let snap = store.snapshot();
    let catalog = live_blocks(&snap)
        .unwrap()
        .into_iter()
        .find(|b| b.kind == BlockKind::Catalog && b.owner == ctxfs_vfs::format::Owner::SYSTEM)
        .unwrap()
        .block;
    drop(snap);
    drop(store);
    write_raw(&img, catalog, &vec![0; BS]);
    let err = Store::open(open_dev(&img, DeviceChoice::Uring)).err().expect("open must refuse a damaged catalog");
    assert_eq!(err.block(), Some(catalog), "{err}");
    let report = fsck::repair(open_dev(&img, DeviceChoice::Uring), false).unwrap();
    assert_eq!(report.exit_code(), fsck::EXIT_CORRECTED, "{report:?}");
    let store = Store::open(open_dev(&img, DeviceChoice::Uring)).unwrap();
    assert_matches(&store, &models[models.len() - 2]);
}

/// `fsck --repair --drop-damaged`: it must correct every problem and leave the store clean.
/// Returns the store reopened.
fn repair_dropping(dev: &Arc<dyn BlockDevice>) -> Store {
    let repaired = fsck::repair(dev.clone(), true).unwrap();
    assert_eq!(repaired.exit_code(), fsck::EXIT_CORRECTED, "{repaired:#?}");
    assert!(fsck::check(dev.as_ref()).unwrap().is_clean());
    Store::open(dev.clone()).unwrap()
}

/// The first extent reference of the record's first file stream that has one.
fn first_extent(r: &mut ctxfs_vfs::ContextRecord) -> Option<&mut ctxfs_vfs::format::BlockRef> {
    r.files.iter_mut().flat_map(|f| [&mut f.index, &mut f.data]).find_map(|s| s.extents.first_mut())
}

#[test]
fn repair_drops_a_damaged_context_only_when_asked() {
    let (_dir, img, store) = uring_image("drop.img");
    let model = workload(&store, 10, |_| {}).unwrap();
    let live = live_blocks(&store.snapshot()).unwrap();
    drop(store);
    let victim = live.iter().find(|b| b.kind == BlockKind::Data).unwrap();
    write_raw(&img, victim.block, &vec![0xAB; BS]);
    let report = fsck::repair(open_dev(&img, DeviceChoice::Uring), false).unwrap();
    assert_eq!(report.exit_code(), fsck::EXIT_UNCORRECTED, "without --drop-damaged nothing is dropped");
    let store = Store::open(open_dev(&img, DeviceChoice::Uring)).unwrap();
    assert_eq!(store.snapshot().contexts().count(), model.len());
    drop(store);
    let store = repair_dropping(&open_dev(&img, DeviceChoice::Uring));
    let names: Vec<String> = store.snapshot().contexts().map(|c| c.name.clone()).collect();
    assert_eq!(names.len(), model.len() - 1, "exactly the damaged context is dropped: {names:?}");
}

#[test]
fn repair_keeps_a_block_a_dropped_context_shares_with_the_catalog() {
    // Found by the fsck_damage fuzzer: a record whose stream root points at the catalog's
    // block is damaged; dropping it freed that block from the allocation, and the commit that
    // then freed the old catalog freed it twice.
    let (_dir, img, store) = uring_image("shared.img");
    let model = workload(&store, 11, |_| {}).unwrap();
    let snap = store.snapshot();
    let (slot, catalog) = (snap.superblock().slot(), snap.superblock().catalog.block);
    drop(snap);
    drop(store);
    let victim = model.keys().next().unwrap().clone();
    let dev = open_dev(&img, DeviceChoice::Uring);
    tamper(dev.as_ref(), slot, &victim, |r| r.files[0].index.extents[0].block = catalog);
    let report = fsck::check(dev.as_ref()).unwrap();
    assert!(report.damaged_blocks().contains(&catalog), "{:#?}", report.problems);
    let store = repair_dropping(&dev);
    let names: Vec<String> = store.snapshot().contexts().map(|c| c.name.clone()).collect();
    assert!(!names.contains(&victim) && names.len() == model.len() - 1, "{names:?}");
}

#[test]
fn repair_drops_the_context_whose_reference_is_wrong_and_keeps_the_block_s_owner() {
    // Context `a`'s record is resealed with its first index extent pointing at `b`'s. The
    // block's header names `b`, so `a`'s reference fails verification: `a` is damaged and `b`,
    // whose reference holds, is intact; dropping `a` must leave `b` and its block alone.
    let (_dir, img, store) = uring_image("pointed.img");
    let (mut model, mut rng) = (Model::new(), SplitMix64::new(12));
    let mut txn = store.begin().unwrap();
    for name in ["a", "b", "c"] {
        create(&mut txn, &mut model, &mut rng, name, shape(1, 2), 40).unwrap();
    }
    txn.commit().unwrap();
    let (a, b) = ("a".to_string(), "b".to_string());
    let snap = store.snapshot();
    let slot = snap.superblock().slot();
    let target = *first_extent(&mut snap.context(&b).unwrap().record().clone()).expect("b has blocks");
    drop(snap);
    drop(store);
    let dev = open_dev(&img, DeviceChoice::Uring);
    tamper(dev.as_ref(), slot, &a, |r| *first_extent(r).expect("a has blocks") = target);
    let report = fsck::check(dev.as_ref()).unwrap();
    let damaged: BTreeSet<_> =
        report.problems.iter().filter(|p| p.fix == fsck::Fix::DropContext).filter_map(|p| p.context.clone()).collect();
    assert_eq!(damaged, BTreeSet::from([a.clone()]), "{:#?}", report.problems);
    assert!(
        report.problems.iter().any(|p| p.block == Some(target.block) && p.message.contains("referenced twice")),
        "{:#?}",
        report.problems
    );
    model.remove(&a);
    assert_matches(&repair_dropping(&dev), &model);
}

#[test]
fn a_commit_over_a_bitmap_that_calls_a_referenced_block_free_is_refused_naming_it() {
    // The state's checksums hold, but its bitmap calls the catalog block free: the next
    // commit frees the old catalog, which the bitmap says was never held.
    let (_dir, img, store) = uring_image("bitmap.img");
    let model = workload(&store, 14, |_| {}).unwrap();
    let snap = store.snapshot();
    let (slot, catalog, generation) = (snap.superblock().slot(), snap.superblock().catalog.block, snap.generation());
    drop(snap);
    drop(store);
    let dev = open_dev(&img, DeviceChoice::Uring);
    let b = catalog as usize;
    rewrite_bitmap(dev.as_ref(), slot, |bits| bits[b / 8] &= !(1 << (b % 8)));
    let store = Store::open(dev.clone()).unwrap();
    let mut txn = store.begin().unwrap();
    txn.delete_context(model.keys().next().unwrap()).unwrap();
    match txn.commit() {
        Err(e @ Error::Damaged { .. }) => assert_eq!(e.block(), Some(catalog), "{e}"),
        other => panic!("the commit went ahead: {other:?}"),
    }
    // Nothing was committed, and the store still serves what it held.
    assert_eq!(store.snapshot().generation(), generation);
    assert_matches(&store, &model);
    drop(store);
    assert_eq!(Store::open(dev.clone()).unwrap().snapshot().generation(), generation);
}

#[test]
fn a_short_bitmap_chunk_is_refused_at_open() {
    // A chunk one byte short would read the blocks it leaves out as free, to be handed out
    // again over live data.
    let (_dir, img, store) = uring_image("short.img");
    workload(&store, 15, |_| {}).unwrap();
    let slot = store.snapshot().superblock().slot();
    drop(store);
    let dev = open_dev(&img, DeviceChoice::Uring);
    rewrite_bitmap(dev.as_ref(), slot, |bits| {
        bits.pop();
    });
    match Store::open(dev.clone()) {
        Err(e @ Error::Damaged { .. }) => assert!(e.to_string().contains("bitmap chunk 0 holds"), "{e}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a short bitmap chunk was read as free blocks"),
    }
}

#[test]
fn a_token_count_its_blocks_cannot_hold_makes_its_context_damaged_and_is_repaired() {
    // Appending reads the last token block by the record's count: a count beyond the blocks
    // must not reach it.
    let (_dir, img, store) = uring_image("tokens.img");
    let (mut model, mut rng) = (Model::new(), SplitMix64::new(13));
    let mut txn = store.begin().unwrap();
    for name in ["a", "b"] {
        create(&mut txn, &mut model, &mut rng, name, shape(1, 2), 40).unwrap();
    }
    txn.commit().unwrap();
    let slot = store.snapshot().superblock().slot();
    drop(store);
    let dev = open_dev(&img, DeviceChoice::Uring);
    let token_block = ctxfs_vfs::max_payload(BS) as u64 / 4 * 4;
    tamper(dev.as_ref(), slot, "a", |r| r.tokens.bytes = r.tokens.blocks * token_block + 4);
    // The store opens around the damaged context: "a" is refused by name, "b" is served,
    // and a commit keeps "a" in the catalog, its name taken, for fsck to drop.
    let store = Store::open(dev.clone()).unwrap();
    match store.snapshot().context("a") {
        Err(e @ Error::DamagedContext { .. }) => assert!(e.to_string().contains("token stream says"), "{e}"),
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a token count beyond its blocks was accepted"),
    }
    let mut txn = store.begin().unwrap();
    assert!(matches!(txn.create_context("a", shape(1, 1), &[]), Err(Error::DamagedContext { .. })));
    create(&mut txn, &mut model, &mut rng, "c", shape(1, 1), 10).unwrap();
    txn.commit().unwrap();
    assert_eq!(store.snapshot().damaged_contexts().count(), 1);
    let mut b_and_c = model.clone();
    b_and_c.remove("a");
    assert_matches(&store, &b_and_c);
    drop(store);
    let report = fsck::check(dev.as_ref()).unwrap();
    assert!(
        report.problems.iter().any(|p| p.context.as_deref() == Some("a") && p.fix == fsck::Fix::DropContext),
        "{:#?}",
        report.problems
    );
    model.remove("a");
    assert_matches(&repair_dropping(&dev), &model);
}

#[test]
fn fsck_never_panics_on_random_damage() {
    let dir = tmpdir();
    for work in [PLAIN, FAMILY] {
        let pristine = dir.path().join("p.img");
        build(&pristine, DeviceChoice::Uring, work);
        let pristine_bytes = std::fs::read(&pristine).unwrap();
        let mut rng = SplitMix64::new(99);
        for _ in 0..40 {
            let mut image = pristine_bytes.clone();
            for _ in 0..1 + rng.below(200) {
                let at = rng.below(image.len() as u64 / 16) as usize; // mostly metadata-dense start
                image[at] = rng.next_u64() as u8;
            }
            let mem: Arc<dyn BlockDevice> = Arc::new(device::MemDevice::from_image(image, BS));
            let _ = fsck::check(mem.as_ref()).unwrap();
            let _ = fsck::repair(mem.clone(), true);
            if let Ok(store) = Store::open(mem) {
                let snap = store.snapshot();
                for c in snap.contexts() {
                    let _ = snap.context(&c.name).unwrap().tokens();
                }
            }
        }
    }
}

#[test]
fn a_superblock_claiming_more_blocks_than_the_device_is_invalid() {
    // Found by the fsck_damage fuzzer: a valid-CRC superblock claiming 2^56 blocks made fsck
    // size a bitmap from it and abort.
    let (_dir, img, store) = uring_image("huge.img");
    workload(&store, 12, |_| {}).unwrap();
    let slot = store.snapshot().superblock().slot();
    drop(store);
    let dev = open_dev(&img, DeviceChoice::Uring);
    let raw = fsck::raw_block(dev.as_ref(), slot).unwrap();
    let (h, _) = ctxfs_vfs::format::header::unseal(&raw).unwrap();
    let mut payload = ctxfs_vfs::format::header::payload(&raw, &h).to_vec();
    payload[16..24].copy_from_slice(&(1u64 << 56).to_le_bytes());
    let mut buf = device::AlignedBuf::zeroed(BS);
    ctxfs_vfs::format::header::seal(&mut buf, &h, &payload);
    dev.submit(&mut [device::IoOp::Write { block: slot, buf: &buf }]).pop().unwrap().unwrap();
    let report = fsck::check(dev.as_ref()).unwrap();
    assert_eq!(report.exit_code(), fsck::EXIT_UNCORRECTED);
    assert!(
        report.problems.iter().any(|p| p.block == Some(slot) && p.message.contains("describes")),
        "{:?}",
        report.problems
    );
    // Recovery takes the other slot: the previous commit.
    let store = Store::open(dev.clone()).unwrap();
    assert_eq!(store.snapshot().generation() % 2, 1 - slot);
    drop(store);
    assert_eq!(fsck::repair(dev.clone(), false).unwrap().exit_code(), fsck::EXIT_CORRECTED);
}

/// A superblock at the last generation a reader can pin takes no further commit: the writer
/// refuses before writing anything, and the store stays as it was.
#[test]
fn no_commit_follows_the_last_generation() {
    use ctxfs_vfs::lock::MAX_GENERATION;
    let (dev, store) = mem_store(512);
    workload(&store, 5, |_| {}).unwrap();
    let mut sb = *store.snapshot().superblock();
    drop(store);
    // The same slot, so its parity must be kept: MAX_GENERATION is odd.
    sb.generation = MAX_GENERATION - u64::from(sb.slot() == 0);
    let mut buf = device::AlignedBuf::zeroed(BS);
    sb.encode_into(&mut buf);
    dev.submit(&mut [device::IoOp::Write { block: sb.slot(), buf: &buf }]).pop().unwrap().unwrap();
    let store = Store::open(dev.clone()).unwrap();
    let mut commits = 0;
    let refused = loop {
        match store.begin() {
            Ok(txn) => {
                txn.commit().unwrap();
                commits += 1;
            }
            Err(e) => break e,
        }
        assert!(commits <= 1, "committed past generation {}", store.snapshot().generation());
    };
    assert!(refused.to_string().contains("last a store reaches"), "{refused}");
    assert_eq!(store.snapshot().generation(), MAX_GENERATION);
    drop(store);
    assert_eq!(Store::open(dev).unwrap().snapshot().generation(), MAX_GENERATION);
}

/// A store file cut short is refused as truncated, saying how long it must be, not as
/// "not a store"; extended back, it opens and checks clean (the blocks cut were free).
#[test]
fn a_store_file_cut_short_is_refused_as_truncated() {
    let (_dir, img, store) = uring_image("cut.img");
    workload(&store, 7, |_| {}).unwrap();
    drop(store);
    let file = std::fs::OpenOptions::new().write(true).open(&img).unwrap();
    file.set_len(SIZE - 3 * BS as u64).unwrap();
    let err = Store::open_path_read_only(&img, DeviceChoice::Uring).err().expect("refused");
    let text = err.to_string();
    assert!(text.contains("store truncated") && text.contains(&format!("truncate -s {SIZE}")), "{text}");
    file.set_len(SIZE).unwrap();
    let dev = open_dev(&img, DeviceChoice::Uring);
    assert_eq!(fsck::check(dev.as_ref()).unwrap().exit_code(), fsck::EXIT_CLEAN);
    drop(dev);
    // Cut within the second superblock's block: that slot is gone with the rest.
    file.set_len(BS as u64 + 1).unwrap();
    let err = Store::open_path_read_only(&img, DeviceChoice::Uring).err().expect("refused").to_string();
    assert!(err.contains("store truncated") && err.contains(&format!("truncate -s {SIZE}")), "{err}");
}

/// The record of a context the newest commit created, damaged: `--repair` leaves it for
/// `--drop-damaged` (what its problem says) and keeps the newest commit, the other contexts
/// served meanwhile; `--drop-damaged` drops it alone.
#[test]
fn a_damaged_record_is_dropped_only_when_asked_never_by_falling_back() {
    let (_dir, img, store) = uring_image("record.img");
    let (mut model, mut rng) = (Model::new(), SplitMix64::new(17));
    commit_each(&store, &mut model, &mut rng, &["old", "new"]);
    let (generation, record) = {
        let snap = store.snapshot();
        let live = live_blocks(&snap).unwrap();
        let id = snap.context("new").unwrap().record().id;
        let owner = ctxfs_vfs::format::Owner::context(id);
        let record = live.iter().find(|b| b.owner == owner && b.stream == ctxfs_vfs::format::StreamTag::Meta).unwrap();
        (snap.generation(), record.block)
    };
    drop(store);
    std::fs::OpenOptions::new().write(true).open(&img).unwrap().write_all_at(&[0u8; BS], record * BS as u64).unwrap();
    let dev = open_dev(&img, DeviceChoice::Uring);
    let report = fsck::repair(dev.clone(), false).unwrap();
    assert_eq!(report.exit_code(), fsck::EXIT_UNCORRECTED, "{report:#?}");
    assert!(report.repaired.is_empty(), "{:?}", report.repaired);
    let store = Store::open(dev.clone()).unwrap();
    assert_eq!(store.snapshot().generation(), generation, "the newest commit stays");
    let mut old = model.clone();
    old.remove("new");
    assert_matches(&store, &old);
    drop(store);
    assert_matches(&repair_dropping(&dev), &old);
}

/// The record of one context damaged, then the newest catalog: repair falls back to the older
/// state, whose only damage is that context (which the store serves around), and with
/// `--drop-damaged` drops it there. Deleting while it is damaged retires only contexts older
/// than it (one it may name as parent) and frees the newer.
#[test]
fn repair_falls_back_past_a_damaged_record_and_deletes_free_what_it_cannot_name() {
    let (_dir, img, store) = uring_image("fallback.img");
    let (mut model, mut rng) = (Model::new(), SplitMix64::new(19));
    commit_each(&store, &mut model, &mut rng, &["a", "b"]);
    let block_of = |store: &Store, kind: BlockKind, owner: ctxfs_vfs::format::Owner| {
        let live = live_blocks(&store.snapshot()).unwrap();
        live.iter()
            .find(|b| b.kind == kind && b.owner == owner && b.stream == ctxfs_vfs::format::StreamTag::Meta)
            .unwrap()
            .block
    };
    let b_record = block_of(&store, BlockKind::Catalog, ctxfs_vfs::format::Owner::context(2));
    drop(store);
    let zero = |block: u64| {
        std::fs::OpenOptions::new().write(true).open(&img).unwrap().write_all_at(&[0u8; BS], block * BS as u64).unwrap()
    };
    zero(b_record);
    model.remove("b");
    let dev = open_dev(&img, DeviceChoice::Uring);
    let store = Store::open(dev.clone()).unwrap();
    // "c" is newer than the damaged "b": deleting it frees its blocks; "a" is older: retired.
    let used = store.space().used;
    let mut txn = store.begin().unwrap();
    create(&mut txn, &mut model, &mut rng, "c", shape(1, 1), 30).unwrap();
    txn.commit().unwrap();
    let mut txn = store.begin().unwrap();
    delete(&mut txn, &mut model, "c").unwrap();
    txn.commit().unwrap();
    store.begin().unwrap().commit().unwrap();
    assert!(store.space().used <= used + 2, "c's blocks were kept: {} against {used}", store.space().used);
    assert_eq!(store.snapshot().retired_contexts().count(), 0);
    let mut txn = store.begin().unwrap();
    delete(&mut txn, &mut model, "a").unwrap();
    txn.commit().unwrap();
    assert_eq!(store.snapshot().retired_contexts().count(), 1, "a, which b may name as parent, is kept");
    let mut txn = store.begin().unwrap();
    create(&mut txn, &mut model, &mut rng, "d", shape(1, 1), 30).unwrap();
    txn.commit().unwrap();
    let catalog = store.snapshot().superblock().catalog.block;
    drop(store);
    zero(catalog);
    // Plain repair falls back (to the state with "c" deleted, "b" still damaged) and leaves
    // "b" for --drop-damaged, which drops it.
    let report = fsck::repair(dev.clone(), false).unwrap();
    assert!(report.repaired.iter().any(|r| r.contains("fell back")), "{report:#?}");
    assert_eq!(report.exit_code(), fsck::EXIT_UNCORRECTED, "{report:#?}");
    model.remove("d");
    assert_matches(&Store::open(dev.clone()).unwrap(), &model);
    assert_matches(&repair_dropping(&dev), &model);
}
