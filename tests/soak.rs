//! A soak of one DB: threads serve sessions (attention, update, store, delete) while another
//! imports and deletes contexts. Every session checks each answer against exact attention over
//! its own tokens, so one reading another's tokens (or a block reused under it) fails; at the
//! end fsck is clean and every context still committed reads back as it was written.
//!
//! The default run is short. The long one is ignored by default:
//! `cargo test --release -p ctxfs-integration --test soak -- --ignored --nocapture`.

use ctxfs_attention::{AttentionOptions, Db, DbConfig, Plan, SafetensorsKv};
use ctxfs_integration::{book, exact, mkfs, rel_err, widen, Book};
use ctxfs_vfs::{DType, DeviceChoice, SplitMix64};
use half::f16;
use std::sync::atomic::{AtomicUsize, Ordering};

const TOKENS: usize = 2048;
const SESSION_THREADS: usize = 3;
/// Tokens each session adds to the book's.
const NEW_TOKENS: usize = 64;

/// Operations done, by kind.
#[derive(Default)]
struct Counts {
    attention: AtomicUsize,
    update: AtomicUsize,
    store: AtomicUsize,
    delete: AtomicUsize,
    import: AtomicUsize,
}

/// A session's own rows: per layer, `(k, v)` of its new tokens for every kv head, rounded to
/// f16 as the store keeps them.
type OwnRows = Vec<(Vec<f32>, Vec<f32>)>;

fn own_rows(b: &Book, seed: u64) -> OwnRows {
    let d = b.shape.head_dim as usize;
    let kv = b.shape.kv_heads as usize;
    let mut rng = SplitMix64::new(seed);
    (0..b.shape.layers)
        .map(|_| {
            let mut rows = || {
                (0..kv * NEW_TOKENS * d)
                    .map(|_| f16::from_f32(rng.next_f64() as f32 - 0.5).to_f32())
                    .collect::<Vec<_>>()
            };
            (rows(), rows())
        })
        .collect()
}

/// Exact attention of `q` (all q heads of `layer`) over the book's tokens then `own`'s.
fn expected(b: &Book, own: &OwnRows, layer: usize, q: &[f32]) -> Vec<f32> {
    let d = b.shape.head_dim as usize;
    let group = (b.shape.q_heads / b.shape.kv_heads) as usize;
    let ids: Vec<u32> = (0..(TOKENS + NEW_TOKENS) as u32).collect();
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = Vec::new();
    for (qh, qv) in q.chunks_exact(d).enumerate() {
        let h = qh / group;
        let span = h * NEW_TOKENS * d..(h + 1) * NEW_TOKENS * d;
        let keys: Vec<f32> =
            widen(&b.head(layer, h).keys).into_iter().chain(own[layer].0[span.clone()].iter().copied()).collect();
        let values: Vec<f32> =
            widen(&b.head(layer, h).values).into_iter().chain(own[layer].1[span].iter().copied()).collect();
        out.extend(exact(&keys, &values, d, &ids, qv, scale).0);
    }
    out
}

fn full() -> AttentionOptions {
    AttentionOptions { plan: Some(Plan::Full), ..Default::default() }
}

/// One session thread's work: `rounds` sessions, each on the book plus its own tokens.
fn serve(db: &Db, b: &Book, thread: usize, rounds: usize, counts: &Counts) {
    let d = b.shape.head_dim as usize;
    let q_heads = b.shape.q_heads as usize;
    for round in 0..rounds {
        let seed = (thread * 1_000_003 + round) as u64;
        let own = own_rows(b, seed);
        let ids: Vec<u32> = (0..NEW_TOKENS as u32).map(|i| 10_000_000 + (seed as u32) * 1000 + i).collect();
        let prompt: Vec<u32> = b.tokens.iter().copied().chain(ids.iter().copied()).collect();
        let (mut session, remaining) = db.create_session(&prompt).unwrap();
        assert_eq!(remaining, NEW_TOKENS, "thread {thread} round {round}: the book is reused");
        let mut rng = SplitMix64::new(seed ^ 0xabc);
        for (layer, (k, v)) in own.iter().enumerate() {
            let q: Vec<f32> = (0..q_heads * NEW_TOKENS * d).map(|_| rng.next_f64() as f32).collect();
            session.update(layer, &q, k, v).unwrap();
            counts.update.fetch_add(1, Ordering::Relaxed);
        }
        for layer in 0..b.shape.layers as usize {
            let q: Vec<f32> = (0..q_heads * d).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect();
            let got = session.attention_with(layer, &q, &full()).unwrap();
            let err = rel_err(&got.output, &expected(b, &own, layer, &q));
            assert!(err <= 1e-3, "thread {thread} round {round} layer {layer}: error {err} against its own tokens");
            counts.attention.fetch_add(1, Ordering::Relaxed);
        }
        // Every other session is stored, read back through a new session, and deleted.
        if round % 2 == 0 {
            let name = format!("s{thread}-{round}");
            db.store_session(&session, &name).unwrap();
            counts.store.fetch_add(1, Ordering::Relaxed);
            let reopened = db.open_session(&name, None).unwrap();
            let q: Vec<f32> = (0..q_heads * d).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect();
            let got = reopened.attention_with(0, &q, &full()).unwrap();
            let err = rel_err(&got.output, &expected(b, &own, 0, &q));
            assert!(err <= 1e-3, "{name} read back: error {err}");
            counts.attention.fetch_add(1, Ordering::Relaxed);
            drop(reopened);
            if round % 4 == 0 {
                db.delete(&name).unwrap();
                counts.delete.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn soak(rounds: usize, imports: usize) -> Counts {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let b = book(dir.path(), TOKENS, 2, 4, 2, 21);
    let other_dir = dir.path().join("other");
    std::fs::create_dir(&other_dir).unwrap();
    let other = book(&other_dir, 1024, 2, 4, 2, 22);
    let store = mkfs(dir.path(), 512);
    let db = Db::open(&store, DeviceChoice::Auto, DbConfig { pool_bytes: 32 << 20, ..Default::default() }).unwrap();
    db.import("book", &SafetensorsKv::open(&b.path, DType::F16).unwrap(), |_| Ok(())).unwrap();
    let book_before = db.open_session("book", None).unwrap();
    let probe: Vec<f32> = (0..4 * 64).map(|i| (i % 7) as f32 * 0.1).collect();
    let book_answer = book_before.attention_with(1, &probe, &full()).unwrap().output;
    drop(book_before);
    let counts = Counts::default();
    std::thread::scope(|s| {
        for t in 0..SESSION_THREADS {
            let (db, b, counts) = (&db, &b, &counts);
            s.spawn(move || serve(db, b, t, rounds, counts));
        }
        s.spawn(|| {
            let src = SafetensorsKv::open(&other.path, DType::F16).unwrap();
            for j in 0..imports {
                db.import(&format!("imp-{j}"), &src, |_| Ok(())).unwrap();
                counts.import.fetch_add(1, Ordering::Relaxed);
                if j > 0 {
                    db.delete(&format!("imp-{}", j - 1)).unwrap();
                    counts.delete.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    });
    let report = ctxfs_vfs::fsck::check(db.store().device().as_ref()).unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    // What is still committed reads back as written.
    let book_after = db.open_session("book", None).unwrap();
    assert_eq!(book_after.attention_with(1, &probe, &full()).unwrap().output, book_answer, "the book is unchanged");
    let snap = db.store().snapshot();
    let names: Vec<String> = snap.contexts().map(|c| c.name.clone()).collect();
    let stored = names.iter().filter(|n| n.starts_with('s')).count();
    assert_eq!(stored, SESSION_THREADS * rounds.div_ceil(2) - SESSION_THREADS * rounds.div_ceil(4));
    let imported: Vec<&String> = names.iter().filter(|n| n.starts_with("imp-")).collect();
    assert_eq!(imported, [&format!("imp-{}", imports - 1)], "each import but the last was deleted");
    // A snapshot keeps its store's blocks, and so its writer lock, until it goes.
    drop((book_after, snap, db));
    // And after a reopen.
    let db = Db::open(&store, DeviceChoice::Auto, DbConfig::default()).unwrap();
    let again = db.open_session("book", None).unwrap();
    assert_eq!(again.attention_with(1, &probe, &full()).unwrap().output, book_answer);
    counts
}

fn print(counts: &Counts) -> usize {
    let (a, u, s, d, i) = (
        counts.attention.load(Ordering::Relaxed),
        counts.update.load(Ordering::Relaxed),
        counts.store.load(Ordering::Relaxed),
        counts.delete.load(Ordering::Relaxed),
        counts.import.load(Ordering::Relaxed),
    );
    println!("soak: {a} attention calls, {u} updates, {s} stores, {d} deletes, {i} imports; none lost");
    a + u + s + d + i
}

#[test]
fn sessions_serve_while_contexts_come_and_go() {
    assert!(print(&soak(8, 6)) > 100);
}

/// The long soak: `cargo test --release -p ctxfs-integration --test soak -- --ignored --nocapture`.
#[test]
#[ignore = "long: run on purpose, see the file's doc"]
fn a_long_soak() {
    assert!(print(&soak(200, 120)) > 3000);
}
