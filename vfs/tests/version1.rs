//! A format version 1 store stays readable, and its first commit upgrades it to version 2.
//! The version 1 image is made by rewriting a store's records and superblocks with version 1
//! bytes built by hand from docs/format.md, so the test does not trust the encoder it checks.

mod common;
use common::*;
use ctxfs_vfs::format::records::StreamRoot;
use ctxfs_vfs::format::{Superblock, FORMAT_VERSION};
use ctxfs_vfs::inspect::live_blocks;
use ctxfs_vfs::{device, fsck, BlockDevice, ContextRecord, DeviceChoice, SplitMix64, Store};
use std::path::Path;
use std::sync::Arc;

/// A context record in the version 1 layout (magic "CCTX", no flags or parent link).
fn encode_v1(r: &ContextRecord) -> Vec<u8> {
    fn root(b: &mut Vec<u8>, s: &StreamRoot) {
        b.extend(s.blocks.to_le_bytes());
        b.extend(s.bytes.to_le_bytes());
        b.extend((s.extents.len() as u32).to_le_bytes());
        for e in &s.extents {
            b.extend(e.block.to_le_bytes());
            b.extend(e.crc.to_le_bytes());
            b.extend(0u32.to_le_bytes());
        }
    }
    assert!(r.parent.is_none() && !r.retired, "version 1 has no parent links");
    let mut b = b"CCTX".to_vec();
    b.extend(r.id.to_le_bytes());
    b.extend((r.name.len() as u16).to_le_bytes());
    b.extend(r.name.as_bytes());
    for v in [r.shape.layers, r.shape.q_heads, r.shape.kv_heads, r.shape.head_dim] {
        b.extend(v.to_le_bytes());
    }
    b.extend([r.shape.dtype as u8, 0, 0, 0]);
    b.extend(r.created_unix_ms.to_le_bytes());
    root(&mut b, &r.tokens);
    b.extend((r.files.len() as u32).to_le_bytes());
    for f in &r.files {
        root(&mut b, &f.index);
        root(&mut b, &f.data);
    }
    b
}

fn open_dev(path: &Path) -> Arc<dyn BlockDevice> {
    Arc::from(device::open_path(path, DeviceChoice::Uring, BS, ctxfs_vfs::Access::Write).unwrap())
}

fn slot_versions(dev: &dyn BlockDevice) -> Vec<u32> {
    (0..2).map(|s| Superblock::decode(&fsck::raw_block(dev, s).unwrap(), s).unwrap().format_version).collect()
}

/// The magic of a context's record, read from its first record block.
fn record_magic(store: &Store, name: &str) -> Vec<u8> {
    let snap = store.snapshot();
    let id = snap.context(name).unwrap().record().id;
    let block = live_blocks(&snap)
        .unwrap()
        .into_iter()
        .find(|b| b.owner.context == id && b.stream == ctxfs_vfs::format::StreamTag::Meta)
        .unwrap()
        .block;
    let raw = fsck::raw_block(store.device().as_ref(), block).unwrap();
    let h = ctxfs_vfs::format::header::unseal(&raw).unwrap().0;
    ctxfs_vfs::format::header::payload(&raw, &h)[16..20].to_vec()
}

#[test]
fn the_v2_record_is_the_v1_record_with_links_inserted() {
    let dir = tmpdir();
    let store = file_store(&dir.path().join("layout.img"), 1 << 20, DeviceChoice::Uring);
    let mut txn = store.begin().unwrap();
    txn.create_context("demo", shape(1, 2), &[1, 2, 3]).unwrap();
    txn.commit().unwrap();
    let rec = store.snapshot().context("demo").unwrap().record().clone();
    let (v1, v2) = (encode_v1(&rec), rec.encode());
    // §9: flags, parent id and prefix tokens (16 zero bytes) follow created_unix_ms at 30 + N.
    let at = 30 + rec.name.len();
    assert_eq!(&v2[..4], b"CCX2");
    assert_eq!(v2[4..at], v1[4..at]);
    assert_eq!(v2[at..at + 16], [0; 16]);
    assert_eq!(v2[at + 16..], v1[at..]);
    assert_eq!(ContextRecord::decode(&v1).unwrap(), rec);
}

#[test]
fn a_version_1_store_opens_and_its_first_commit_upgrades_it() {
    let dir = tmpdir();
    let path = dir.path().join("v1.img");
    let store = file_store(&path, 8 << 20, DeviceChoice::Uring);
    let mut model = workload(&store, 5, |_| {}).unwrap();
    drop(store);
    let dev = open_dev(&path);
    // Both states, as a version 1 build would have left them.
    for slot in 0..2 {
        rewrite_state(dev.as_ref(), slot, 1, |rec| Some(encode_v1(rec)));
    }
    assert_eq!(slot_versions(dev.as_ref()), [1, 1]);
    drop(dev);

    let store = Store::open_path(&path, DeviceChoice::Uring).unwrap();
    assert_eq!(store.snapshot().superblock().format_version, 1);
    assert_matches(&store, &model);
    for rec in store.snapshot().contexts() {
        assert!(rec.parent.is_none() && !rec.retired, "{rec:?}");
        assert_eq!(record_magic(&store, &rec.name), b"CCTX");
    }
    let report = fsck::check(store.device().as_ref()).unwrap();
    assert!(report.is_clean(), "{:#?}", report.problems);

    // The first commit writes version 2; a version 1 context can be a parent.
    let mut rng = SplitMix64::new(1);
    let mut txn = store.begin().unwrap();
    create_child(&mut txn, &mut model, &mut rng, "kid", "gamma", 4000, 10).unwrap();
    txn.commit().unwrap();
    assert_eq!(store.snapshot().superblock().format_version, FORMAT_VERSION);
    drop(store);
    let store = Store::open_path(&path, DeviceChoice::Uring).unwrap();
    assert_eq!(slot_versions(store.device().as_ref()).iter().filter(|&&v| v == 2).count(), 1);
    assert_matches(&store, &model);
    // Records are rewritten in the new layout only when their context changes.
    assert_eq!(record_magic(&store, "gamma"), b"CCTX");
    assert_eq!(record_magic(&store, "kid"), b"CCX2");
    let mut txn = store.begin().unwrap();
    txn.append_tokens("gamma", &[5]).unwrap();
    txn.commit().unwrap();
    model.get_mut("gamma").unwrap().tokens.push(5);
    assert_eq!(record_magic(&store, "gamma"), b"CCX2");
    assert_eq!(slot_versions(store.device().as_ref()), [2, 2]);
    assert_matches(&store, &model);
    let report = fsck::check(store.device().as_ref()).unwrap();
    assert!(report.is_clean(), "{:#?}", report.problems);
}
