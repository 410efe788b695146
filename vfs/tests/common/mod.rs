//! Shared by the vfs integration tests: a seeded workload of commits, the model of what
//! should be committed, and checks that a store matches the model byte for byte.
#![allow(dead_code)]

use ctxfs_vfs::device::{self, AlignedBuf, IoOp, MemDevice};
use ctxfs_vfs::format::header::{payload as payload_of, seal, unseal};
use ctxfs_vfs::format::records::{decode_alloc_dir, decode_catalog, encode_alloc_dir, encode_catalog};
use ctxfs_vfs::format::Superblock;
use ctxfs_vfs::{
    fsck, BlockDevice, ContextRecord, DType, DeviceChoice, Error, FileStream, ModelShape, SplitMix64, Store, Txn,
};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub const BS: usize = 4096;

/// What a committed context holds.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelContext {
    pub shape: ModelShape,
    pub tokens: Vec<u32>,
    /// (layer, head, stream) → block payloads.
    pub streams: BTreeMap<(u16, u16, u8), Vec<Vec<u8>>>,
}

pub type Model = BTreeMap<String, ModelContext>;

pub fn shape(layers: u16, kv_heads: u16) -> ModelShape {
    ModelShape { layers, q_heads: kv_heads * 2, kv_heads, head_dim: 16, dtype: DType::F16 }
}

fn which(s: u8) -> FileStream {
    if s == 0 {
        FileStream::Index
    } else {
        FileStream::Data
    }
}

/// Content that differs per context, stream and block, with lengths that vary.
pub fn payload(rng: &mut SplitMix64) -> Vec<u8> {
    let len = 1 + rng.below(ctxfs_vfs::max_payload(BS) as u64) as usize;
    let seed = rng.next_u64();
    let mut r = SplitMix64::new(seed);
    (0..len).map(|_| r.next_u64() as u8).collect()
}

/// One change to apply inside a transaction, mirrored into the model.
pub fn create(
    txn: &mut Txn<'_>,
    model: &mut Model,
    rng: &mut SplitMix64,
    name: &str,
    shape: ModelShape,
    tokens: usize,
) -> Result<(), Error> {
    let toks: Vec<u32> = (0..tokens).map(|_| rng.next_u64() as u32).collect();
    txn.create_context(name, shape, &toks)?;
    model.insert(name.into(), ModelContext { shape, tokens: toks, streams: BTreeMap::new() });
    append(txn, model, rng, name, 0, 2)
}

/// A child of `parent` sharing its first `prefix` tokens, with `tokens` own tokens.
pub fn create_child(
    txn: &mut Txn<'_>,
    model: &mut Model,
    rng: &mut SplitMix64,
    name: &str,
    parent: &str,
    prefix: u64,
    tokens: usize,
) -> Result<(), Error> {
    let own: Vec<u32> = (0..tokens).map(|_| rng.next_u64() as u32).collect();
    txn.create_child_context(name, parent, prefix, &own)?;
    let from = &model[parent];
    let all = from.tokens[..prefix as usize].iter().chain(&own).copied().collect();
    model.insert(name.into(), ModelContext { shape: from.shape, tokens: all, streams: BTreeMap::new() });
    append(txn, model, rng, name, 0, 2)
}

/// Deletes a context from the store and the model.
pub fn delete(txn: &mut Txn<'_>, model: &mut Model, name: &str) -> Result<(), Error> {
    txn.delete_context(name)?;
    model.remove(name);
    Ok(())
}

/// Appends `tokens` tokens and `blocks` blocks to every stream of every file.
pub fn append(
    txn: &mut Txn<'_>,
    model: &mut Model,
    rng: &mut SplitMix64,
    name: &str,
    tokens: usize,
    blocks: usize,
) -> Result<(), Error> {
    let toks: Vec<u32> = (0..tokens).map(|_| rng.next_u64() as u32).collect();
    if !toks.is_empty() {
        txn.append_tokens(name, &toks)?;
    }
    let ctx = model.get_mut(name).expect("context in model");
    ctx.tokens.extend(&toks);
    for layer in 0..ctx.shape.layers {
        for head in 0..ctx.shape.kv_heads {
            // Every other file gets its blocks as index/data pairs, side by side on the device.
            if rng.below(2) == 0 {
                for _ in 0..blocks {
                    let (i, d) = (payload(rng), payload(rng));
                    txn.append_block_pair(name, layer, head, &i, &d)?;
                    ctx.streams.entry((layer, head, 0)).or_default().push(i);
                    ctx.streams.entry((layer, head, 1)).or_default().push(d);
                }
                continue;
            }
            for s in 0..2u8 {
                for _ in 0..blocks {
                    let p = payload(rng);
                    txn.append_block(name, layer, head, which(s), &p)?;
                    ctx.streams.entry((layer, head, s)).or_default().push(p);
                }
            }
        }
    }
    Ok(())
}

/// Where a workload stopped: the last committed model, the one being committed, and why.
#[derive(Debug)]
pub struct Interrupted {
    pub committed: Model,
    pub attempted: Model,
    pub error: Error,
}

/// One transaction's changes, mirrored into the model.
pub type Step = fn(&mut Txn<'_>, &mut Model, &mut SplitMix64) -> Result<(), Error>;

/// A workload of commits: creates, appends and deletes. `on_commit` sees the model after each
/// successful commit. Returns the first error (a crash or an injected fault) or the final model.
pub fn workload(store: &Store, seed: u64, on_commit: impl FnMut(&Model)) -> Result<Model, Box<Interrupted>> {
    let steps: [Step; 6] = [
        |t, m, r| create(t, m, r, "alpha", shape(2, 2), 1500),
        |t, m, r| create(t, m, r, "beta", shape(1, 1), 10),
        |t, m, r| append(t, m, r, "alpha", 700, 1),
        |t, m, r| {
            t.delete_context("beta")?;
            m.remove("beta");
            create(t, m, r, "gamma", shape(1, 2), 3000)
        },
        |t, m, _| {
            t.delete_context("alpha")?;
            m.remove("alpha");
            Ok(())
        },
        |t, m, r| append(t, m, r, "gamma", 2000, 3),
    ];
    run_steps(store, seed, &steps, on_commit)
}

/// A workload of contexts derived from others: children and a grandchild share prefixes,
/// parents are retired while children live, a retired name is reused, and deleting the last
/// child frees the retired chain above it. It ends with one context retired.
pub fn family_workload(store: &Store, seed: u64, on_commit: impl FnMut(&Model)) -> Result<Model, Box<Interrupted>> {
    let steps: [Step; 7] = [
        |t, m, r| create(t, m, r, "base", shape(1, 2), 1500),
        |t, m, r| {
            create_child(t, m, r, "kid", "base", 1200, 300)?;
            create_child(t, m, r, "kid2", "base", 1500, 10)
        },
        |t, m, r| {
            delete(t, m, "base")?;
            create(t, m, r, "base", shape(1, 1), 20)
        },
        |t, m, r| {
            create_child(t, m, r, "grandkid", "kid", 1400, 50)?;
            append(t, m, r, "kid", 100, 1)
        },
        |t, m, _| {
            delete(t, m, "kid")?;
            delete(t, m, "kid2")
        },
        |t, m, r| {
            delete(t, m, "grandkid")?;
            append(t, m, r, "base", 30, 1)
        },
        |t, m, r| {
            create_child(t, m, r, "heir", "base", 40, 1200)?;
            delete(t, m, "base")
        },
    ];
    run_steps(store, seed, &steps, on_commit)
}

fn run_steps(
    store: &Store,
    seed: u64,
    steps: &[Step],
    mut on_commit: impl FnMut(&Model),
) -> Result<Model, Box<Interrupted>> {
    let mut rng = SplitMix64::new(seed);
    let mut model = Model::new();
    for step in steps {
        let mut attempt = model.clone();
        let r = store.begin().and_then(|mut txn| {
            step(&mut txn, &mut attempt, &mut rng)?;
            txn.commit()
        });
        match r {
            Ok(_) => {
                model = attempt;
                on_commit(&model);
            }
            Err(error) => return Err(Box::new(Interrupted { committed: model, attempted: attempt, error })),
        }
    }
    Ok(model)
}

/// The first way the store differs from the model (names, shapes, tokens, every block), if any.
pub fn difference(store: &Store, model: &Model) -> Option<String> {
    let snap = store.snapshot();
    let names: Vec<&str> = snap.contexts().map(|c| c.name.as_str()).collect();
    let expected: Vec<&str> = model.keys().map(String::as_str).collect();
    if names != expected {
        return Some(format!("contexts {names:?}, expected {expected:?}"));
    }
    for (name, want) in model {
        let ctx = match snap.context(name) {
            Ok(c) => c,
            Err(e) => return Some(format!("{name}: {e}")),
        };
        if ctx.record().shape != want.shape {
            return Some(format!("{name}: shape {:?}, expected {:?}", ctx.record().shape, want.shape));
        }
        match ctx.tokens() {
            Ok(t) if t == want.tokens => {}
            Ok(t) => return Some(format!("{name}: {} tokens differ from the {} expected", t.len(), want.tokens.len())),
            Err(e) => return Some(format!("{name}: tokens: {e}")),
        }
        for layer in 0..want.shape.layers {
            for head in 0..want.shape.kv_heads {
                for s in 0..2u8 {
                    let at = format!("{name} layer {layer} head {head} stream {s}");
                    let stream = match ctx.stream(layer, head, which(s)) {
                        Ok(st) => st,
                        Err(e) => return Some(format!("{at}: {e}")),
                    };
                    let blocks = want.streams.get(&(layer, head, s)).cloned().unwrap_or_default();
                    if stream.blocks() != blocks.len() as u64 {
                        return Some(format!("{at}: {} blocks, expected {}", stream.blocks(), blocks.len()));
                    }
                    let logicals: Vec<u64> = (0..stream.blocks()).collect();
                    for (l, (got, want)) in stream.read_many(&logicals).into_iter().zip(&blocks).enumerate() {
                        match got {
                            Ok(b) if b.payload() == &want[..] => {}
                            Ok(_) => return Some(format!("{at}: block {l} holds other bytes")),
                            Err(e) => return Some(format!("{at}: block {l}: {e}")),
                        }
                    }
                }
            }
        }
    }
    None
}

/// Checks that the store holds exactly the model.
pub fn assert_matches(store: &Store, model: &Model) {
    if let Some(d) = difference(store, model) {
        panic!("store differs from the model: {d}");
    }
}

/// Whether the store matches the model (for crash outcomes that may be either of two states).
pub fn matches(store: &Store, model: &Model) -> bool {
    difference(store, model).is_none()
}

pub fn mem_store(blocks: u64) -> (Arc<MemDevice>, Store) {
    let mem = Arc::new(MemDevice::new(BS, blocks));
    let store = ctxfs_vfs::format(mem.clone()).unwrap();
    (mem, store)
}

/// A store on a real file, through the chosen real device.
pub fn file_store(path: &Path, size: u64, choice: DeviceChoice) -> Store {
    std::fs::File::create(path).unwrap().set_len(size).unwrap();
    let dev: Arc<dyn BlockDevice> = Arc::from(device::open_path(path, choice, BS, ctxfs_vfs::Access::Write).unwrap());
    ctxfs_vfs::format(dev).unwrap()
}

/// The real devices the suite runs on.
pub const REAL_DEVICES: [DeviceChoice; 2] = [DeviceChoice::Uring, DeviceChoice::File];

pub fn tmpdir() -> tempfile::TempDir {
    // Beside the build, on a disk file system: O_DIRECT is refused by tmpfs.
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

/// Rewrites the state in superblock `slot` in place: `record` may give a context record new
/// bytes, and the catalog and the superblock (with `format_version`) are resealed to match.
/// Every block stays where it is, so the checksums up the tree change and nothing else; this
/// makes states the library would never write. Chains must be one block long.
pub fn rewrite_state(
    dev: &dyn BlockDevice,
    slot: u64,
    format_version: u32,
    mut record: impl FnMut(&ContextRecord) -> Option<Vec<u8>>,
) {
    let mut sb = Superblock::decode(&fsck::raw_block(dev, slot).unwrap(), slot).unwrap();
    let mut entries = decode_catalog(&read_chain_block(dev, sb.catalog.block)).unwrap();
    for entry in &mut entries {
        let rec = ContextRecord::decode(&read_chain_block(dev, entry.record.block)).unwrap();
        if let Some(blob) = record(&rec) {
            entry.record.crc = write_chain_block(dev, entry.record.block, &blob);
        }
    }
    sb.catalog.crc = write_chain_block(dev, sb.catalog.block, &encode_catalog(&entries));
    sb.format_version = format_version;
    let mut buf = AlignedBuf::zeroed(dev.block_size());
    sb.encode_into(&mut buf);
    dev.submit(&mut [IoOp::Write { block: slot, buf: &buf }]).pop().unwrap().unwrap();
    dev.flush().unwrap();
}

/// Rewrites context `name`'s record in the state in superblock `slot` (see [`rewrite_state`]).
pub fn tamper(dev: &dyn BlockDevice, slot: u64, name: &str, change: impl Fn(&mut ContextRecord)) {
    rewrite_state(dev, slot, ctxfs_vfs::format::FORMAT_VERSION, |rec| {
        (rec.name == name).then(|| {
            let mut rec = rec.clone();
            change(&mut rec);
            rec.encode()
        })
    });
}

/// Rewrites the allocator bitmap of the state in superblock `slot` with `bits` of its first
/// chunk changed by `change` (bytes as stored), resealing the chunk, the directory and the
/// superblock: a state whose checksums hold and whose bitmap the library would never write.
/// The directory must be one block long.
pub fn rewrite_bitmap(dev: &dyn BlockDevice, slot: u64, change: impl FnOnce(&mut Vec<u8>)) {
    let mut sb = Superblock::decode(&fsck::raw_block(dev, slot).unwrap(), slot).unwrap();
    let (total, mut chunks) = decode_alloc_dir(&read_chain_block(dev, sb.alloc.block)).unwrap();
    let raw = fsck::raw_block(dev, chunks[0].block).unwrap();
    let (mut h, _) = unseal(&raw).unwrap();
    let mut bits = payload_of(&raw, &h).to_vec();
    change(&mut bits);
    h.payload_len = bits.len() as u32;
    let mut buf = AlignedBuf::zeroed(dev.block_size());
    chunks[0].crc = seal(&mut buf, &h, &bits);
    dev.submit(&mut [IoOp::Write { block: chunks[0].block, buf: &buf }]).pop().unwrap().unwrap();
    sb.alloc.crc = write_chain_block(dev, sb.alloc.block, &encode_alloc_dir(total, &chunks));
    let mut buf = AlignedBuf::zeroed(dev.block_size());
    sb.encode_into(&mut buf);
    dev.submit(&mut [IoOp::Write { block: slot, buf: &buf }]).pop().unwrap().unwrap();
    dev.flush().unwrap();
}

/// The blob piece of a chain block that ends its chain.
fn read_chain_block(dev: &dyn BlockDevice, block: u64) -> Vec<u8> {
    let raw = fsck::raw_block(dev, block).unwrap();
    let (h, _) = unseal(&raw).unwrap();
    let payload = payload_of(&raw, &h);
    assert!(payload[..16].iter().all(|&b| b == 0), "chain at block {block} is longer than one block");
    payload[16..].to_vec()
}

/// Reseals a one-block chain with a new blob, keeping its header; returns the new CRC.
fn write_chain_block(dev: &dyn BlockDevice, block: u64, blob: &[u8]) -> u32 {
    let raw = fsck::raw_block(dev, block).unwrap();
    let (mut h, _) = unseal(&raw).unwrap();
    let payload: Vec<u8> = [0u8; 16].iter().chain(blob).copied().collect();
    h.payload_len = payload.len() as u32;
    let mut buf = AlignedBuf::zeroed(dev.block_size());
    let crc = seal(&mut buf, &h, &payload);
    dev.submit(&mut [IoOp::Write { block, buf: &buf }]).pop().unwrap().unwrap();
    crc
}

/// Readers keep reading a snapshot of context "stable" while a writer deletes it and churns
/// the store, so freed blocks would be reused if quarantine ignored live readers; every read
/// is checked, and fsck is clean after.
pub fn readers_survive_churn(store: Arc<Store>) {
    let mut rng = ctxfs_vfs::SplitMix64::new(1);
    let mut model = Model::new();
    let mut txn = store.begin().unwrap();
    create(&mut txn, &mut model, &mut rng, "stable", shape(1, 2), 5000).unwrap();
    append(&mut txn, &mut model, &mut rng, "stable", 0, 20).unwrap();
    txn.commit().unwrap();
    let expected = model["stable"].clone();
    let snap = store.snapshot();
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..4)
        .map(|t| {
            let (snap, stop, expected) = (snap.clone(), stop.clone(), expected.clone());
            std::thread::spawn(move || {
                let mut reads = 0u64;
                // An old snapshot reads its own state even while that state is deleted.
                while !stop.load(Ordering::Relaxed) || reads < 200 {
                    let ctx = snap.context("stable").unwrap();
                    let head = (t % 2) as u16;
                    let stream = ctx.stream(0, head, FileStream::Data).unwrap();
                    let l = reads % stream.blocks();
                    assert_eq!(stream.read(l).unwrap().payload(), &expected.streams[&(0, head, 1)][l as usize][..]);
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    // The writer deletes what the readers read and fills the store with new data, again
    // and again, so freed blocks would be reused if quarantine ignored live readers.
    for round in 0..12 {
        let mut txn = store.begin().unwrap();
        if round == 0 {
            txn.delete_context("stable").unwrap();
        }
        let name = format!("churn{round}");
        create(&mut txn, &mut model, &mut rng, &name, shape(1, 2), 2000).unwrap();
        append(&mut txn, &mut model, &mut rng, &name, 0, 20).unwrap();
        txn.commit().unwrap();
        if round >= 2 {
            let mut txn = store.begin().unwrap();
            txn.delete_context(&format!("churn{}", round - 2)).unwrap();
            txn.commit().unwrap();
        }
    }
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
    assert!(reads >= 800);
    drop(snap);
    let report = fsck::check(store.device().as_ref()).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}
