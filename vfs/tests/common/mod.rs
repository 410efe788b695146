//! Shared by the vfs integration tests: a seeded workload of commits, the model of what
//! should be committed, and checks that a store matches the model byte for byte.
#![allow(dead_code)]

use ctxfs_vfs::device::{self, MemDevice};
use ctxfs_vfs::{BlockDevice, DType, DeviceChoice, Error, FileStream, ModelShape, SplitMix64, Store, Txn};
use std::collections::BTreeMap;
use std::path::Path;
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

/// A workload of commits: creates, appends and deletes. `on_commit` sees the model after each
/// successful commit. Returns the first error (a crash or an injected fault) or the final model.
pub fn workload(store: &Store, seed: u64, mut on_commit: impl FnMut(&Model)) -> Result<Model, Box<Interrupted>> {
    let mut rng = SplitMix64::new(seed);
    let mut model = Model::new();
    type Step = fn(&mut Txn<'_>, &mut Model, &mut SplitMix64) -> Result<(), Error>;
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
    let dev: Arc<dyn BlockDevice> = Arc::from(device::open_path(path, choice, BS).unwrap());
    ctxfs_vfs::format(dev).unwrap()
}

/// The real devices the suite runs on.
pub const REAL_DEVICES: [DeviceChoice; 2] = [DeviceChoice::Uring, DeviceChoice::File];

pub fn tmpdir() -> tempfile::TempDir {
    // Beside the build, on a disk file system: O_DIRECT is refused by tmpfs.
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}
