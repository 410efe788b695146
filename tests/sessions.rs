//! import → reopen → session → attention, against exact attention computed independently.

use ctxfs_attention::{
    AttentionOptions, Db, DbConfig, KvSource, Plan, PqCodes, Request, Rules, SafetensorsKv, Session,
};
use ctxfs_index::coarse::pq::PqParams;
use ctxfs_index::search::SEED_STRIDE;
use ctxfs_integration::{book, book_of_dim, exact, mkfs, rel_err, widen, Book};
use ctxfs_vfs::{DType, DeviceChoice, SplitMix64};
use half::f16;
use std::path::Path;

const N: usize = 8192;

fn open(store: &Path) -> Db {
    Db::open(store, DeviceChoice::Auto, DbConfig { pool_bytes: 64 << 20, ..Default::default() }).expect("open the db")
}

/// A DB whose data area is far smaller than the context's values and whose optimizer scans
/// no context whole: it takes neither the scan rule nor the coarse plans' ample-memory rule,
/// so it picks DIPRS beyond layer 0. It opens read-only, as a second server beside the
/// writer would.
fn lean(store: &Path) -> Db {
    let rules = Rules { scan_context: 0, ..Default::default() };
    let small = DbConfig { pool_bytes: 24 << 20, data_fraction: 0.05, rules, ..Default::default() };
    Db::open_read_only(store, DeviceChoice::Auto, small).expect("open the db")
}

/// A book imported into a fresh store.
fn imported(dir: &Path) -> (Book, std::path::PathBuf) {
    let b = book(dir, N, 2, 4, 2, 11);
    let store = mkfs(dir, 256);
    let db = open(&store);
    let src = SafetensorsKv::open(&b.path, DType::F16).unwrap();
    src.check_values(|_| {}).unwrap();
    let report = db.import("book", &src, |_| Ok(())).unwrap();
    assert_eq!((report.tokens, report.heads), (N, 4));
    (b, store)
}

/// The share of q head `qh`'s exact DIPR set (over the book's keys of `layer`) that
/// `selected` (ascending) holds.
fn dipr_recall(b: &Book, layer: usize, qh: usize, q: &[f32], beta: f32, selected: &[u32]) -> f64 {
    let d = b.shape.head_dim as usize;
    let h = b.head(layer, qh / (b.shape.q_heads / b.shape.kv_heads) as usize);
    let qv = &q[qh * d..(qh + 1) * d];
    let s: Vec<f32> = h.keys.chunks_exact(d).map(|k| k.iter().zip(qv).map(|(a, b)| a.to_f32() * b).sum()).collect();
    let best = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let dipr: Vec<u32> = (0..N as u32).filter(|&t| s[t as usize] >= best - beta).collect();
    dipr.iter().filter(|t| selected.binary_search(t).is_ok()).count() as f64 / dipr.len() as f64
}

fn opts(plan: Plan, beta: f32) -> AttentionOptions {
    AttentionOptions { plan: Some(plan), beta: Some(beta), detail: true, ..Default::default() }
}

/// Exact attention of every q head of `layer` over the book's tokens `ids`, plus extra
/// (keys, values) rows per kv head.
fn exact_layer(b: &Book, layer: usize, q: &[f32], ids: &[u32], extra: Option<&[(Vec<f16>, Vec<f16>)]>) -> Vec<f32> {
    let d = b.shape.head_dim as usize;
    let group = (b.shape.q_heads / b.shape.kv_heads) as usize;
    let scale = 1.0 / (d as f32).sqrt();
    let mut out = Vec::new();
    for qh in 0..b.shape.q_heads as usize {
        let h = b.head(layer, qh / group);
        let (mut keys, mut values) = (widen(&h.keys), widen(&h.values));
        let mut all = ids.to_vec();
        if let Some(extra) = extra {
            let (k, v) = &extra[qh / group];
            let base = keys.len() / d;
            // The extra rows follow the book's rows; their ids there are base.. .
            keys.extend(widen(k));
            values.extend(widen(v));
            all.extend((0..(k.len() / d) as u32).map(|i| base as u32 + i));
        }
        out.extend(exact(&keys, &values, d, &all, &q[qh * d..(qh + 1) * d], scale).0);
    }
    out
}

#[test]
fn import_reopen_attend_exactly_and_dipr_recall() {
    let dir = tempfile::tempdir().unwrap();
    let (b, store) = imported(dir.path());
    let db = open(&store);
    let (session, remaining) = db.create_session(&b.tokens).unwrap();
    assert_eq!((remaining, session.prefix_tokens()), (0, N as u32));
    assert_eq!(session.reused_context(), Some(("book", false)));
    let all: Vec<u32> = (0..N as u32).collect();
    let d = b.shape.head_dim as usize;
    let beta = 5.0 * (d as f32).sqrt();
    let lean_db = lean(&store);
    let lean = lean_db.open_session("book", None).unwrap();
    let (mut recall, mut queries, mut scored) = (0.0, 0, 0u64);
    for layer in 0..2 {
        for step in 0..4 {
            let q = b.decode_step(layer, step);
            let want = exact_layer(&b, layer, &q, &all, None);
            let full = session.attention_with(layer, &q, &opts(Plan::Full, 0.0)).unwrap();
            assert_eq!(full.choice.label(), "full");
            assert!(rel_err(&full.output, &want) <= 1e-3, "full: {}", rel_err(&full.output, &want));
            // Without a β the range is the tail estimate's, ln(97 / error target) logits.
            let given = session.attention_with(layer, &q, &AttentionOptions { beta: None, ..opts(Plan::Flat, 0.0) });
            let tails_beta = (SEED_STRIDE as f32 / Rules::default().error_target).ln() * (d as f32).sqrt();
            let tails = session.attention_with(layer, &q, &opts(Plan::Flat, tails_beta)).unwrap();
            let selected =
                |a: &ctxfs_attention::Attention| a.heads.iter().map(|h| h.selected.clone()).collect::<Vec<_>>();
            assert_eq!(selected(&given.unwrap()), selected(&tails), "the default range");
            let wide = session.attention_with(layer, &q, &opts(Plan::Diprs, 1e9)).unwrap();
            assert!(rel_err(&wide.output, &want) <= 1e-3, "β large: {}", rel_err(&wide.output, &want));
            for plan in [Plan::Quest, Plan::Infllm, Plan::Pq] {
                // A budget covering the context selects all of it: exact attention.
                let every = AttentionOptions { budget: Some(N), ..opts(plan, 0.0) };
                let a = session.attention_with(layer, &q, &every).unwrap();
                assert!(rel_err(&a.output, &want) <= 1e-3, "{plan:?} whole: {}", rel_err(&a.output, &want));
                let some = AttentionOptions { budget: Some(1024), ..opts(plan, 0.0) };
                let a = session.attention_with(layer, &q, &some).unwrap();
                assert!(a.heads.iter().all(|h| h.retrieved <= 1024 && h.selected.len() <= 640 + 1024));
                assert!(rel_err(&a.output, &want) < 0.5, "{plan:?} at 1K: {}", rel_err(&a.output, &want));
            }
            let auto = session.attention_with(
                layer,
                &q,
                &AttentionOptions { beta: Some(beta), detail: true, ..Default::default() },
            );
            // An 8K context is within the scan's reach: the optimizer scans, with its target.
            let auto = auto.unwrap();
            assert_eq!((auto.choice.label(), auto.choice.error_target), ("flat".into(), Some(0.02)));
            assert!(auto.heads.iter().all(|h| h.estimated_error.is_some()));
            let window = lean.window_tokens().to_vec();
            let lean =
                lean.attention_with(layer, &q, &AttentionOptions { detail: true, ..Default::default() }).unwrap();
            assert_eq!(lean.choice.label(), if layer == 0 { "flat" } else { "graph-diprs" });
            if layer == 0 {
                // Layer 0 of a long context is scanned: the scan cuts each query's range where
                // the optimizer's error target asks, whatever the head dimension.
                assert_eq!(lean.choice.error_target, Some(Rules::default().error_target));
                let err = rel_err(&lean.output, &want);
                assert!(err <= 0.04, "layer 0 scanned with the target: error {err}");
            }
            if layer > 0 {
                // The walk's tokens come with the other tokens of their value blocks.
                let rows = key_rows_per_block(d as u32);
                for r in &lean.heads {
                    let found: Vec<u32> =
                        r.selected.iter().copied().filter(|t| !window.contains(t) && !r.tail.contains(t)).collect();
                    let whole = found.iter().all(|t| {
                        block_tokens(t / rows, rows, N as u32, &window).all(|u| found.binary_search(&u).is_ok())
                    });
                    assert!(whole, "a block of the walk's tokens was attended in part");
                }
            }
            let auto = session.attention_with(layer, &q, &opts(Plan::Diprs, beta)).unwrap();
            for (qh, r) in auto.heads.iter().enumerate() {
                recall += dipr_recall(&b, layer, qh, &q, beta, &r.selected);
                queries += 1;
                scored += r.stats.keys_scored;
            }
        }
    }
    let recall = recall / queries as f64;
    let scored = scored as f64 / queries as f64 / N as f64;
    println!("DIPRS: DIPR recall {recall:.3}, keys scored {:.1}%", scored * 100.0);
    // The range found on the codes holds nearly all of it (the test prints it).
    assert!(recall >= 0.95, "DIPR recall {recall}");
}

/// Head dimensions other models have, 130 among them (not a multiple of 4: the codes take
/// 26 subspaces of 5 dimensions): each imports, and is served held whole and compact, by the
/// optimizer's plans within their error target and by a budget covering the context exactly.
#[test]
fn every_head_dimension_is_imported_and_served_whole_and_compact() {
    const TOKENS: usize = 6000;
    for d in [80, 130, 256] {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let b = book_of_dim(dir.path(), TOKENS, 2, 4, 2, d, 5);
        let store = mkfs(dir.path(), 256);
        let src = SafetensorsKv::open(&b.path, DType::F16).unwrap();
        open(&store).import("book", &src, |_| Ok(())).unwrap_or_else(|e| panic!("d {d}: import: {e}"));
        let all: Vec<u32> = (0..TOKENS as u32).collect();
        for (how, budget, plan) in [("whole", None, "flat"), ("compact", Some(0.125), "pq")] {
            let config = DbConfig { pool_bytes: 64 << 20, resident_budget: budget, ..Default::default() };
            let db = Db::open(&store, DeviceChoice::Auto, config).unwrap();
            let session = db.open_session("book", None).unwrap();
            for layer in 0..2 {
                for step in 0..2 {
                    let q = b.decode_step(layer, step);
                    let want = exact_layer(&b, layer, &q, &all, None);
                    let auto = session.attention_with(layer, &q, &AttentionOptions::default()).unwrap();
                    let targeted = (auto.choice.label(), auto.choice.error_target);
                    assert_eq!(targeted, (plan.to_string(), Some(Rules::default().error_target)), "d {d} {how}");
                    let err = rel_err(&auto.output, &want);
                    assert!(err <= 0.04, "d {d} {how} layer {layer}: {} error {err}", auto.choice.label());
                    let every = AttentionOptions { budget: Some(TOKENS), ..opts(Plan::Pq, 0.0) };
                    let a = session.attention_with(layer, &q, &every).unwrap();
                    assert!(rel_err(&a.output, &want) <= 1e-3, "d {d} {how}: {}", rel_err(&a.output, &want));
                }
            }
        }
    }
}

/// The error's device block, where it names one.
fn block_of(e: &ctxfs_attention::Error) -> Option<u64> {
    match e {
        ctxfs_attention::Error::Store(e) => e.block(),
        ctxfs_attention::Error::Buffer(e) => e.block(),
        _ => None,
    }
}

#[test]
fn a_block_damaged_on_disk_fails_every_call_that_reads_it_naming_it() {
    use std::os::unix::fs::FileExt;
    let dir = tempfile::tempdir().unwrap();
    let (b, store) = imported(dir.path());
    // A value block and a key block of layer 1, kv head 0 (the key rows follow the index
    // stream's meta block and adjacency).
    let (value, key) = {
        let vfs = ctxfs_vfs::Store::open_path_read_only(&store, DeviceChoice::Auto).unwrap();
        let snap = vfs.snapshot();
        let ctx = snap.context("book").unwrap();
        let data = ctx.stream(1, 0, ctxfs_vfs::FileStream::Data).unwrap();
        let index = ctx.stream(1, 0, ctxfs_vfs::FileStream::Index).unwrap();
        let layout = ctxfs_index::paged::Layout::decode(index.read(0).unwrap().payload()).unwrap();
        (data.locate(3).unwrap().0, index.locate(1 + layout.adjacency_blocks() as u64 + 2).unwrap().0)
    };
    let (q0, q1) = (b.decode_step(0, 0), b.decode_step(1, 0));
    let full = opts(Plan::Full, 0.0);
    let compact = DbConfig { pool_bytes: 64 << 20, resident_budget: Some(0.125), ..Default::default() };
    let configs = [DbConfig { pool_bytes: 64 << 20, ..Default::default() }, compact];
    let answers = |config: &DbConfig| {
        let db = Db::open_read_only(&store, DeviceChoice::Auto, config.clone()).unwrap();
        let s = db.open_session("book", None).unwrap();
        (s.attention_with(0, &q0, &full).map(|a| a.output), s.attention_with(1, &q1, &full).map(|a| a.output))
    };
    let before: Vec<(Vec<f32>, Vec<f32>)> =
        configs.iter().map(answers).map(|(a, b)| (a.unwrap(), b.unwrap())).collect();
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&store).unwrap();
    for damaged in [value, key] {
        let at = damaged * 4096 + 100; // in the payload, past the 40-byte header
        let mut byte = [0u8];
        file.read_exact_at(&mut byte, at).unwrap();
        file.write_all_at(&[byte[0] ^ 0x5a], at).unwrap();
        file.sync_all().unwrap();
        for (config, (layer0, _)) in configs.iter().zip(&before) {
            let db = Db::open_read_only(&store, DeviceChoice::Auto, config.clone()).unwrap();
            let s = db.open_session("book", None).unwrap();
            // Twice: a failed read is not cached, so the second call reads the block again.
            for _ in 0..2 {
                let e = s.attention_with(1, &q1, &full).expect_err("layer 1 reads the damaged block");
                assert_eq!(block_of(&e), Some(damaged), "{e}");
                assert!(e.to_string().contains(&format!("block {damaged}")), "{e}");
            }
            // Layer 0 never reads it: the same answer as before the damage.
            assert_eq!(&s.attention_with(0, &q0, &full).unwrap().output, layer0);
        }
        file.write_all_at(&byte, at).unwrap();
        file.sync_all().unwrap();
    }
    // Repaired by hand, the block serves the same answers again.
    let after: Vec<_> = configs.iter().map(answers).map(|(a, b)| (a.unwrap(), b.unwrap())).collect();
    assert_eq!(after, before);
}

#[test]
fn a_partial_prefix_session_uses_only_tokens_below_p() {
    let dir = tempfile::tempdir().unwrap();
    let (b, store) = imported(dir.path());
    let db = open(&store);
    let p = 5000usize;
    let prompt: Vec<u32> = b.tokens[..p].iter().copied().chain([900_001, 900_002]).collect();
    let (mut session, remaining) = db.create_session(&prompt).unwrap();
    assert_eq!((remaining, session.prefix_tokens()), (2, p as u32));
    assert_eq!(session.reused_context(), Some(("book", true)));
    let below: Vec<u32> = (0..p as u32).collect();
    for layer in 0..2 {
        let q = b.decode_step(layer, 1);
        let plans =
            [Plan::Diprs, Plan::GraphDiprs, Plan::Topk, Plan::Flat, Plan::Full, Plan::Quest, Plan::Infllm, Plan::Pq];
        for plan in plans {
            let a = session.attention_with(layer, &q, &opts(plan, 40.0)).unwrap();
            assert!(a.heads.iter().all(|h| h.selected.iter().all(|&t| (t as usize) < p)), "{plan:?} left the prefix");
            if matches!(plan, Plan::Diprs | Plan::GraphDiprs | Plan::Flat) {
                // The tail estimate samples the prefix only.
                let tailed = AttentionOptions { tail: Some(true), ..opts(plan, 40.0) };
                let t = session.attention_with(layer, &q, &tailed).unwrap();
                assert!(t.heads.iter().all(|h| h.tail_seeds > 0 && h.tail.iter().all(|&s| (s as usize) < p)));
            }
            if plan != Plan::Full {
                assert_eq!(a.choice.label(), format!("{}+prefix", plan.name()));
            }
        }
        let full = session.attention_with(layer, &q, &opts(Plan::Full, 0.0)).unwrap();
        let want = exact_layer(&b, layer, &q, &below, None);
        assert!(rel_err(&full.output, &want) <= 1e-3);
    }
    // The prompt's two new tokens, then attention covers them exactly.
    let d = b.shape.head_dim as usize;
    let mut rng = SplitMix64::new(5);
    let mut extra = Vec::new();
    for layer in 0..2 {
        let k: Vec<f32> = (0..2 * 2 * d).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect();
        let v: Vec<f32> = (0..2 * 2 * d).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect();
        session.update(layer, &[], &k, &v).unwrap();
        extra.push((k, v));
    }
    for (layer, (k, v)) in extra.iter().enumerate() {
        let q = b.decode_step(layer, 2);
        let a = session.attention_with(layer, &q, &opts(Plan::Full, 0.0)).unwrap();
        assert!(a.heads.iter().all(|h| h.selected.ends_with(&[p as u32, p as u32 + 1])));
        let rows: Vec<(Vec<f16>, Vec<f16>)> = (0..2)
            .map(|h| {
                let f = |x: &[f32]| x[h * 2 * d..(h + 1) * 2 * d].iter().map(|&x| f16::from_f32(x)).collect();
                (f(k), f(v))
            })
            .collect();
        let want = exact_layer(&b, layer, &q, &below, Some(&rows));
        assert!(rel_err(&a.output, &want) <= 1e-3, "{}", rel_err(&a.output, &want));
    }
}

#[test]
fn update_store_reopen_round_trips_and_survives_deleting_the_parent() {
    let dir = tempfile::tempdir().unwrap();
    let (b, store) = imported(dir.path());
    let p = 6000usize;
    let added = 300usize;
    let d = b.shape.head_dim as usize;
    let new_ids: Vec<u32> = (0..added as u32).map(|i| 800_000 + i).collect();
    let prompt: Vec<u32> = b.tokens[..p].iter().copied().chain(new_ids.iter().copied()).collect();
    let mut rows = Vec::new();
    {
        let db = open(&store);
        let (mut session, remaining) = db.create_session(&prompt).unwrap();
        assert_eq!(remaining, added);
        let mut rng = SplitMix64::new(9);
        for layer in 0..2 {
            let mut gen = |n: usize| (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect::<Vec<f32>>();
            let (q, k, v) = (gen(4 * added * d), gen(2 * added * d), gen(2 * added * d));
            session.update(layer, &q, &k, &v).unwrap();
            rows.push((k, v));
        }
        let before = db.store().space();
        let report = db.store_session(&session, "book+300").unwrap();
        assert_eq!((report.tokens, report.heads), (added, 4));
        let used = before.free - db.store().space().free;
        println!("stored 300 tokens on a {p}-token prefix: {} blocks written, {used} blocks used", report.blocks);
        // The prefix is thousands of blocks; the new tokens' streams are tens per file, most
        // of them their PQ centroids (256 per 4-dimensional subspace: 32 KiB at d = 64).
        assert!(report.blocks < 300, "only the new tokens are written: {} blocks", report.blocks);
        assert!(db.store_session(&session, "book+300").is_err(), "a second store under the same name is refused");
    }
    let prefix: Vec<u32> = (0..p as u32).collect();
    let extra = |layer: usize| -> Vec<(Vec<f16>, Vec<f16>)> {
        let (k, v) = &rows[layer];
        (0..2)
            .map(|h| {
                let f = |x: &[f32]| x[h * added * d..(h + 1) * added * d].iter().map(|&x| f16::from_f32(x)).collect();
                (f(k), f(v))
            })
            .collect()
    };
    let check = |db: &Db| {
        let child = db.open_session("book+300", None).unwrap();
        assert_eq!(child.prefix_tokens(), (p + added) as u32);
        for layer in 0..2 {
            let q = b.decode_step(layer, 3);
            let want = exact_layer(&b, layer, &q, &prefix, Some(&extra(layer)));
            for (plan, beta) in [(Plan::Full, 0.0), (Plan::Diprs, 1e9), (Plan::Flat, 1e9)] {
                let a = child.attention_with(layer, &q, &opts(plan, beta)).unwrap();
                assert!(rel_err(&a.output, &want) <= 1e-3, "{plan:?}: {}", rel_err(&a.output, &want));
            }
        }
    };
    let db = open(&store);
    check(&db);
    let (again, remaining) = db.create_session(&prompt).unwrap();
    assert_eq!((remaining, again.reused_context()), (0, Some(("book+300", false))));
    db.delete("book").unwrap();
    assert!(db.open_session("book", None).is_err());
    drop((again, db));
    let db = open(&store);
    check(&db);
    let report = ctxfs_vfs::fsck::check(db.store().device().as_ref()).unwrap();
    assert!(report.is_clean(), "{report:?}");
}

#[test]
fn a_session_whose_reused_context_was_replaced_is_not_stored_over_the_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let (b, store) = imported(dir.path());
    let (p, added) = (3000usize, 50usize);
    let d = b.shape.head_dim as usize;
    let prompt: Vec<u32> = b.tokens[..p].iter().copied().chain(900_000..900_000 + added as u32).collect();
    let db = open(&store);
    let (mut session, _) = db.create_session(&prompt).unwrap();
    let mut rng = SplitMix64::new(4);
    for layer in 0..2 {
        let mut gen = |n: usize| (0..n).map(|_| rng.next_f64() as f32 - 0.5).collect::<Vec<f32>>();
        session.update(layer, &gen(4 * added * d), &gen(2 * added * d), &gen(2 * added * d)).unwrap();
    }
    // Another writer replaces "book" while the session runs: a new context under the name.
    db.delete("book").unwrap();
    let src = SafetensorsKv::open(&b.path, DType::F16).unwrap();
    db.import("book", &src, |_| Ok(())).unwrap();
    let err = db.store_session(&session, "book+50").expect_err("the session's prefix is gone");
    assert!(err.to_string().contains("was replaced since the session opened"), "{err}");
    assert!(db.open_session("book+50", None).is_err(), "nothing was stored");
}

/// Session by session and call by call, the same plans and bit-identical outputs; a
/// difference names the first call that differs.
fn assert_same_runs(serial: &[Vec<(String, Vec<f32>)>], parallel: &[Vec<(String, Vec<f32>)>], what: &str) {
    assert_eq!(serial.len(), parallel.len());
    for (i, (a, b)) in serial.iter().zip(parallel).enumerate() {
        for (call, ((plan_a, o_a), (plan_b, o_b))) in a.iter().zip(b).enumerate() {
            let diff = o_a.iter().zip(o_b).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
            assert!(
                plan_a == plan_b && o_a == o_b,
                "{what}: session {i}, call {call}: serial {plan_a} vs concurrent {plan_b}, largest difference {diff:e}"
            );
        }
    }
}

#[test]
fn eight_concurrent_sessions_match_serial_runs_before_and_after_warming() {
    let dir = tempfile::tempdir().unwrap();
    let (b, store) = imported(dir.path());
    let db = open(&store);
    let prefixes = [N, 3000, N, 7000, 2000, N, 5000, 6500];
    // Each call's plan (with `@gpu` where the window was attended there) and output.
    let run = |i: usize| -> Vec<(String, Vec<f32>)> {
        let s = db.open_session("book", Some(prefixes[i] as u32)).unwrap();
        let calls = (0..4)
            .flat_map(|step| (0..2).map(move |layer| (step, layer)))
            .map(|(step, layer)| {
                let a = s.attention(layer, &b.decode_step(layer, (step + i) % 8)).unwrap();
                (a.plan(), a.output)
            })
            .collect();
        let device = s.device();
        assert!(!device.contains("failed"), "session {i}: {device}");
        calls
    };
    let serial: Vec<_> = (0..8).map(run).collect();
    let parallel = || -> Vec<_> {
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..8).map(|i| s.spawn(move || run(i))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    };
    assert_same_runs(&serial, &parallel(), "cold");
    // Warmed, the index is held resident and read without pins: the same answers, and no
    // index block read again.
    let warm = db.warm("book").unwrap();
    assert_eq!(warm.held, warm.blocks, "held whole");
    assert!(warm.read > 0 && warm.read < warm.blocks, "the runs above had read part of it: {warm:?}");
    let st = db.pool_stats();
    assert!(warm.blocks > 1000 && st.index.resident_pins == warm.blocks, "{warm:?} {st:?}");
    assert_eq!(st.index.resident_pins, st.index.resident_frames, "every index block held, each once");
    assert_same_runs(&serial, &parallel(), "warmed");
    assert_eq!(db.pool_stats().index.misses, st.index.misses);
    // An index area too small for the whole index holds what fits; the rest is searched
    // through pins, with the same answers.
    let small_pool = DbConfig { pool_bytes: 8 << 20, ..Default::default() };
    let small = Db::open_read_only(&store, DeviceChoice::Auto, small_pool).unwrap();
    let warm = small.warm("book").unwrap();
    assert!(warm.held > 0 && warm.held < warm.blocks, "{warm:?}");
    // The plan is fixed: the optimizer's depends on the pool (a data area holding every
    // value picks a coarse plan).
    let (s, big) = (small.open_session("book", None).unwrap(), db.open_session("book", None).unwrap());
    for (step, layer) in (0..4).flat_map(|step| (0..2).map(move |layer| (step, layer))) {
        let (q, o) = (b.decode_step(layer, step), opts(Plan::Diprs, 50.0));
        assert_eq!(s.attention_with(layer, &q, &o).unwrap().output, big.attention_with(layer, &q, &o).unwrap().output);
    }
    // The footprint's parts add up to the blocks held, against the context's K + V bytes.
    let f = db.footprint("book").unwrap();
    let full = db.warm("book").unwrap();
    assert_eq!(f.resident_bytes(), full.resident_bytes, "{f:?} {full:?}");
    // The frames held, and the block maps beside them.
    assert!(f.maps > 0 && f.maps < f.meta + f.graph, "{f:?}");
    assert_eq!(full.resident_bytes, full.held * 4096 + f.maps);
    assert_eq!(f.kv_bytes, full.kv_bytes);
    let shape = b.shape;
    assert_eq!(f.kv_bytes, N as u64 * shape.layers as u64 * shape.kv_heads as u64 * shape.head_dim as u64 * 2 * 2);
    assert!(f.graph > 0 && f.keys > 0 && f.seeds > 0 && f.quest > 0 && f.infllm > 0 && f.pq > 0, "{f:?}");
    // A budget the whole index meets holds it all; one below holds the compact parts.
    let over = |budget: f64| DbConfig { resident_budget: Some(budget), ..Default::default() };
    let at = Db::open_read_only(&store, DeviceChoice::Auto, over(f.ratio())).unwrap();
    let whole = at.warm("book").unwrap();
    assert_eq!((whole.resident_over_kv(), whole.compact), (f.ratio(), false));
    let tight = Db::open_read_only(&store, DeviceChoice::Auto, over(f.ratio() * 0.99)).unwrap();
    let compact = tight.warm("book").unwrap();
    assert!(compact.compact && compact.resident_bytes == f.compact_bytes(), "{compact:?} {f:?}");
    assert_eq!(tight.pool_stats().index.resident_pins, compact.held);
    assert!(Db::open_read_only(&store, DeviceChoice::Auto, over(-1.0)).is_err(), "a negative budget");
}

#[test]
fn a_bf16_context_holds_values_beyond_f16_and_attends_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let n = 4096 + 1024;
    let b = book(dir.path(), n, 1, 4, 2, 21);
    let d = b.shape.head_dim as usize;
    // The same context in f32 with two channels far beyond f16's range (65,504).
    let big = |x: &[f16], channel: usize| -> Vec<f32> {
        x.iter().enumerate().map(|(i, v)| v.to_f32() * if i % d == channel { 30_000.0 } else { 1.0 }).collect()
    };
    let keys: Vec<Vec<f32>> = (0..2).map(|h| big(&b.head(0, h).keys, 0)).collect();
    let values: Vec<Vec<f32>> = (0..2).map(|h| big(&b.head(0, h).values, 1)).collect();
    let bytes = |x: &[Vec<f32>]| -> Vec<u8> { x.iter().flatten().flat_map(|v| v.to_le_bytes()).collect() };
    // Prefill queries of the 4 q heads, their big channel scaled down as the keys' went up.
    let queries: Vec<Vec<f32>> = (0..2)
        .flat_map(|h| b.head(0, h).prefill.clone())
        .map(|q| q.iter().enumerate().map(|(i, x)| if i % d == 0 { x / 30_000.0 } else { *x }).collect())
        .collect();
    let m = queries[0].len() / d;
    let (kb, vb, qb) = (bytes(&keys), bytes(&values), bytes(&queries));
    // A context file of f32 keys and values `[2, n, d]` (and queries `[4, m, d]`), and what
    // checking it as `dtype` says.
    let checked = |file: &str, v: &[u8], q: Option<&[u8]>, dtype: DType| -> Option<String> {
        let f32s = |shape: Vec<usize>, data| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape, data).unwrap()
        };
        let mut views = vec![("layers.0.k", f32s(vec![2, n, d], &kb)), ("layers.0.v", f32s(vec![2, n, d], v))];
        views.extend(q.map(|q| ("layers.0.q", f32s(vec![4, m, d], q))));
        let path = dir.path().join(file);
        safetensors::serialize_to_file(views, &None, &path).unwrap();
        SafetensorsKv::open(&path, dtype).unwrap().check_values(|_| {}).err().map(|e| e.to_string())
    };
    let err = checked("wide.safetensors", &vb, Some(&qb), DType::F16).unwrap();
    assert!(err.contains("out of the f16 range"), "{err}");
    assert_eq!(checked("wide.safetensors", &vb, Some(&qb), DType::Bf16), None);

    let store = mkfs(dir.path(), 128);
    let db = open(&store);
    let src = SafetensorsKv::open(&dir.path().join("wide.safetensors"), DType::Bf16).unwrap();
    db.import("wide", &src, |_| Ok(())).unwrap();
    drop(db);
    let db = open(&store);
    let session = db.open_session("wide", None).unwrap();
    assert_eq!(session.shape().dtype, DType::Bf16);
    let round = |x: &[f32]| -> Vec<f32> { x.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect() };
    let all: Vec<u32> = (0..n as u32).collect();
    let scale = 1.0 / (d as f32).sqrt();
    for step in 0..3 {
        // Queries scaled down with the keys' big channel, so scores stay in a sane range.
        let q: Vec<f32> = b
            .decode_step(0, step)
            .iter()
            .enumerate()
            .map(|(i, x)| if i % d == 0 { x / 30_000.0 } else { *x })
            .collect();
        let want: Vec<f32> = (0..4)
            .flat_map(|qh| {
                let h = qh / 2;
                exact(&round(&keys[h]), &round(&values[h]), d, &all, &q[qh * d..(qh + 1) * d], scale).0
            })
            .collect();
        for (plan, beta) in [(Plan::Full, 0.0), (Plan::Diprs, 1e9), (Plan::Flat, 1e9)] {
            let a = session.attention_with(0, &q, &opts(plan, beta)).unwrap();
            assert!(rel_err(&a.output, &want) <= 1e-3, "{plan:?}: {}", rel_err(&a.output, &want));
        }
        // Without codes (a bf16 context stores none), DIPRS walks the graph, and says so.
        let a = session.attention_with(0, &q, &opts(Plan::Diprs, 40.0)).unwrap();
        assert_eq!(a.choice.label(), "graph-diprs");
        assert!(a.heads.iter().all(|h| h.stats.keys_scored < n as u64 && h.stats.hops > 0), "DIPRS walks the graph");
    }
    // A coarse plan needs metadata a bf16 context does not store: refused, not wrong.
    let err = session.attention_with(0, &b.decode_step(0, 0), &opts(Plan::Quest, 0.0)).unwrap_err().to_string();
    assert!(err.contains("no quest index"), "{err}");

    // bf16 holds magnitudes whose f32 sums would overflow: beyond 2^48 nothing is taken,
    // and scores beyond f32 (a huge scale) are refused, not answered as infinities.
    let mut huge = vb.clone();
    huge[4 * 77..4 * 78].copy_from_slice(&1e35f32.to_le_bytes());
    let err = checked("huge.safetensors", &huge, None, DType::Bf16).unwrap();
    assert!(err.contains("layers.0.v element 77 = 1e35 is beyond 2^48"), "{err}");
    let mut q = b.decode_step(0, 0);
    q[5] = 1e20;
    let err = session.attention_with(0, &q, &opts(Plan::Full, 0.0)).unwrap_err().to_string();
    assert!(err.contains("q[5] = 1e20 is beyond 2^48"), "{err}");
    let loud = AttentionOptions { scale: Some(1e38), ..opts(Plan::Full, 0.0) };
    let err = session.attention_with(0, &b.decode_step(0, 0), &loud).unwrap_err().to_string();
    assert!(err.contains("overflowed f32"), "{err}");
}

/// A session's graph DIPRS search starts from the tokens the same q head's last search returned
/// (decode queries drift slowly): the beam that finds the best region is skipped, fewer keys
/// are scored, and the answers are about as complete as searches that start afresh (here,
/// 8,192 tokens: DIPR recall 0.989 against 0.994; `ctxfs bench search`'s warm row at 128K:
/// 0.971 against 0.969).
#[test]
fn a_decode_step_starts_from_the_last_steps_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let (b, store) = imported(dir.path());
    let db = open(&store);
    let warm = db.open_session("book", None).unwrap();
    let afresh = db.open_session("book", None).unwrap();
    let d = b.shape.head_dim as usize;
    let beta = 5.0 * (d as f32).sqrt();
    let layer = 1;
    let (mut recall, mut hops, mut scored) = ([0.0f64; 2], [0u64; 2], [0u64; 2]);
    for step in 0..8 {
        let q = b.decode_step(layer, step);
        let cold = AttentionOptions { warm_start: false, ..opts(Plan::GraphDiprs, beta) };
        let answers = [
            warm.attention_with(layer, &q, &opts(Plan::GraphDiprs, beta)).unwrap(),
            afresh.attention_with(layer, &q, &cold).unwrap(),
        ];
        if step == 0 {
            // Nothing to start from yet: the same search.
            assert_eq!(answers[0].output, answers[1].output);
            for (w, a) in answers[0].heads.iter().zip(&answers[1].heads) {
                assert_eq!((w.stats.keys_scored, w.stats.hops), (a.stats.keys_scored, a.stats.hops));
            }
            continue;
        }
        for (i, a) in answers.iter().enumerate() {
            for (qh, r) in a.heads.iter().enumerate() {
                let t = r.timing;
                assert!(t.value_wait <= t.values && t.search + t.values <= t.total, "{t:?}");
                recall[i] += dipr_recall(&b, layer, qh, &q, beta, &r.selected);
                hops[i] += r.stats.hops;
                scored[i] += r.stats.keys_scored;
            }
        }
    }
    let searches = 7.0 * b.shape.q_heads as f64;
    let (warm_recall, afresh_recall) = (recall[0] / searches, recall[1] / searches);
    println!("from the last step: recall {warm_recall:.3}, {} hops, {} keys scored; afresh: recall {afresh_recall:.3}, {} hops, {} keys scored", hops[0], scored[0], hops[1], scored[1]);
    assert!(warm_recall >= afresh_recall - 0.01, "recall {warm_recall} against {afresh_recall} afresh");
    assert!(scored[0] < scored[1], "{} keys scored against {} afresh: the beam ran", scored[0], scored[1]);
}

#[test]
fn the_tail_estimate_brings_dipr_answers_closer_to_exact_attention() {
    let dir = tempfile::tempdir().unwrap();
    let (b, store) = imported(dir.path());
    let db = open(&store);
    let session = db.open_session("book", None).unwrap();
    let window: Vec<u32> = session.window_tokens().to_vec();
    let all: Vec<u32> = (0..N as u32).collect();
    let d = b.shape.head_dim as usize;
    // A narrow range, as a diffuse head's budget leaves: most of the mass is outside it.
    let beta = 2.0 * (d as f32).sqrt();
    let lean_db = lean(&store);
    let lean = lean_db.open_session("book", None).unwrap();
    let (mut bare_err, mut tail_err, mut heads) = (0.0, 0.0, 0);
    for layer in 0..2 {
        for step in 0..4 {
            let q = b.decode_step(layer, step);
            let want = exact_layer(&b, layer, &q, &all, None);
            for plan in [Plan::Diprs, Plan::GraphDiprs, Plan::Flat] {
                // A forced plan gives the bare DIPR answer unless asked for the estimate.
                // Each search afresh, so both retrieve the same tokens.
                let bare = AttentionOptions { warm_start: false, ..opts(plan, beta) };
                let tailed = AttentionOptions { tail: Some(true), ..bare.clone() };
                let bare = session.attention_with(layer, &q, &bare).unwrap();
                let tailed = session.attention_with(layer, &q, &tailed).unwrap();
                for (h, (r, t)) in bare.heads.iter().zip(&tailed.heads).enumerate() {
                    assert_eq!((r.tail_seeds, r.tail.len()), (0, 0));
                    assert!(t.tail_seeds > 0 && t.tail.len() == t.tail_seeds, "{plan:?}: no seed left out");
                    for s in &t.tail {
                        // A seed left out: every 97th token, neither retrieved nor in the window.
                        assert!(s % SEED_STRIDE == 0 && window.binary_search(s).is_err(), "{plan:?}: seed {s}");
                        assert!(t.selected.binary_search(s).is_ok() && r.selected.binary_search(s).is_err());
                    }
                    let span = h * d..(h + 1) * d;
                    bare_err += rel_err(&bare.output[span.clone()], &want[span.clone()]);
                    tail_err += rel_err(&tailed.output[span.clone()], &want[span]);
                    heads += 1;
                }
            }
            // The optimizer's plans estimate the tail, and retrieve at most its budget: the
            // walk's other tokens of the same key blocks come with them, no more blocks.
            let auto =
                lean.attention_with(layer, &q, &AttentionOptions { detail: true, ..Default::default() }).unwrap();
            assert_eq!(auto.choice.label(), if layer == 0 { "flat" } else { "graph-diprs" });
            let rows = (ctxfs_vfs::max_payload(4096) / (2 * d)) as u32;
            for h in &auto.heads {
                let blocks: std::collections::BTreeSet<u32> =
                    h.selected.iter().filter(|t| window.binary_search(t).is_err()).map(|t| t / rows).collect();
                assert!(h.tail_seeds > 0 && blocks.len() <= 1024, "{} seeds, {} blocks", h.tail_seeds, blocks.len());
            }
        }
    }
    let (bare_err, tail_err) = (bare_err / heads as f64, tail_err / heads as f64);
    println!("output error against exact attention: bare DIPR {bare_err:.3}, with the tail estimate {tail_err:.3}");
    // Measured 0.368 bare, 0.285 with the estimate.
    assert!(tail_err < 0.85 * bare_err, "the tail estimate did not help: {tail_err} against {bare_err}");
}

/// An answer that retrieves every seed leaves its tail estimate empty, with nothing to sum:
/// with an error target (its tail summed at once) as without one (summed with the rest of
/// the group's), the answer is exact attention's.
#[test]
fn an_answer_that_retrieves_every_seed_has_an_empty_tail() {
    let dir = tempfile::tempdir().unwrap();
    let (b, store) = imported(dir.path());
    let db = open(&store);
    let session = db.open_session("book", None).unwrap();
    let all: Vec<u32> = (0..N as u32).collect();
    let d = b.shape.head_dim as usize;
    let q = b.decode_step(1, 0);
    let want = exact_layer(&b, 1, &q, &all, None);
    let mut empty_with_target = 0;
    // (A forced pq with the tail and no target is the codes' best, which does not read its
    // negligible candidates: it retrieves every seed only with a target.)
    let answers = [Plan::Flat, Plan::Diprs, Plan::Pq]
        .into_iter()
        .flat_map(|plan| [None, Some(1e-9)].map(|target_error| (plan, target_error)))
        .filter(|&(plan, target_error)| plan != Plan::Pq || target_error.is_some());
    for (plan, target_error) in answers {
        let opts = AttentionOptions { tail: Some(true), target_error, budget: Some(N), ..opts(plan, 1e9) };
        let a = session.attention_with(1, &q, &opts).unwrap();
        for (h, head) in a.heads.iter().enumerate() {
            let why = format!("{plan:?} target {target_error:?} head {h}");
            // A range wide enough for every token leaves no seed out.
            assert!(target_error.is_some() || head.tail_seeds == 0, "{why}");
            empty_with_target += usize::from(target_error.is_some() && head.tail_seeds == 0);
            let span = h * d..(h + 1) * d;
            let err = rel_err(&a.output[span.clone()], &want[span]);
            assert!(err < 1e-3, "{why}: {err}");
        }
    }
    assert!(empty_with_target > 0, "no answer with a target retrieved every seed");
}

/// An error target on real attention (SmolLM2-135M, layer 15, 4,096 tokens of prose: the
/// dataset in tests/data): the flat scan cuts each query's range where the mass it leaves
/// out meets the target, and widens it once when the error estimated from the values misses.
#[test]
fn an_error_target_is_met_on_real_attention() {
    let dir = tempfile::tempdir().unwrap();
    let (store, db, src) = real_prose(dir.path());
    let session = db.open_session("prose", None).unwrap();
    let (met, answers, share) = target_answers(&session, &src, Some(Plan::Flat), 0.01);
    println!("flat: error ≤ 0.01 on {met} of {answers} answers, {:.1}% of the tokens beyond the window", share * 100.0);
    assert!(met as f64 >= 0.9 * answers as f64, "met on {met} of {answers}");
    assert!(share < 0.5, "the target retrieved {:.1}% of the tokens", share * 100.0);
    // DIPRS on the codes, asked for a target, cuts where the target asks, not at a β.
    let (met, answers, share) = target_answers(&session, &src, Some(Plan::Diprs), 0.01);
    println!(
        "diprs: error ≤ 0.01 on {met} of {answers} answers, {:.1}% of the tokens beyond the window",
        share * 100.0
    );
    assert!(met as f64 >= 0.9 * answers as f64, "met on {met} of {answers}");
    // A target must be a positive number.
    let d = session.shape().head_dim as usize;
    let bad = AttentionOptions { target_error: Some(f32::NAN), ..Default::default() };
    let err = session.attention_with(0, &vec![0.1; session.shape().q_heads as usize * d], &bad).unwrap_err();
    assert!(err.to_string().contains("error target"), "{err}");
    // The budgeted plans cannot widen toward a target: asked for one, they refuse, never
    // answer with a target they ignored.
    for plan in [Plan::Quest, Plan::Infllm, Plan::Topk] {
        let fixed = AttentionOptions { plan: Some(plan), target_error: Some(0.01), ..Default::default() };
        let err = session.attention_with(0, &vec![0.1; session.shape().q_heads as usize * d], &fixed).unwrap_err();
        assert!(err.to_string().contains("takes a fixed budget"), "{plan:?}: {err}");
    }
    // Full attention attends every token: a budget would make it a top-k, so it is refused.
    let q = vec![0.1; session.shape().q_heads as usize * d];
    let capped = AttentionOptions { plan: Some(Plan::Full), budget: Some(100), ..Default::default() };
    let err = session.attention_with(0, &q, &capped).unwrap_err();
    assert!(err.to_string().contains("attends every token exactly"), "{err}");
    // The tail asked of a forced pq makes it the compact plan's selection, the seeds left out
    // estimating the rest; the plans that make no tail estimate refuse it.
    let tailed = AttentionOptions { plan: Some(Plan::Pq), tail: Some(true), budget: Some(16), ..Default::default() };
    let bare = AttentionOptions { tail: None, ..tailed.clone() };
    let (tailed, bare) =
        (session.attention_with(0, &q, &tailed).unwrap(), session.attention_with(0, &q, &bare).unwrap());
    assert!(tailed.heads.iter().all(|h| h.tail_seeds > 0), "{:?}", tailed.heads.iter().map(|h| h.tail_seeds));
    assert!(bare.heads.iter().all(|h| h.tail_seeds == 0));
    for plan in [Plan::Full, Plan::Topk, Plan::Quest, Plan::Infllm] {
        let asked = AttentionOptions { plan: Some(plan), tail: Some(true), ..Default::default() };
        let err = session.attention_with(0, &q, &asked).unwrap_err();
        assert!(err.to_string().contains("estimates no tail"), "{plan:?}: {err}");
    }
    drop((session, db));

    // Under a resident budget of about an eighth of the KV, the context is served compact: only
    // its meta blocks, seed tables and PQ codes are held, and the optimizer answers from the
    // codes with the same target, reading its candidates' keys on demand. (At 4,096 tokens
    // and d = 64 the codes alone are an eighth, their block maps 0.4% more: `PROSE_BUDGET`.)
    let rules = Rules { short_context: 0, scan_context: 0, ..Default::default() };
    let budget = DbConfig { resident_budget: Some(PROSE_BUDGET), rules, ..Default::default() };
    let compact = Db::open_read_only(&store, DeviceChoice::Auto, budget).unwrap();
    let warm = compact.warm("prose").unwrap();
    let f = compact.footprint("prose").unwrap();
    assert!(warm.compact && warm.resident_over_kv() <= PROSE_BUDGET, "{warm:?}");
    assert_eq!(warm.resident_bytes, f.compact_bytes(), "{f:?}");
    assert!(f.ratio() > PROSE_BUDGET, "the whole index would not fit: {f:?}");
    let session = compact.open_session("prose", None).unwrap();
    assert!(session.is_compact());
    let choice = session.choice(3, Request { forced: None, error_target: Some(0.01) });
    assert_eq!((choice.plan, choice.error_target), (Plan::Pq, Some(0.01)));
    let (met, answers, share) = target_answers(&session, &src, None, 0.01);
    println!(
        "compact: error ≤ 0.01 on {met} of {answers} answers, {:.1}% of the tokens beyond the window",
        share * 100.0
    );
    assert!(met as f64 >= 0.9 * answers as f64, "met on {met} of {answers}");
    assert!(share < 0.6, "the codes retrieved {:.1}% of the tokens", share * 100.0);
    // Without a target, beyond the scan's reach, the codes' best candidates within the budget
    // (`Rules::codes_budget`), scored exactly with every other token of their key blocks, the
    // tail estimated: of those, the least attended that together hold a thousandth of the
    // mass are not read.
    let choice = session.choice(3, Request::default());
    assert_eq!((choice.plan, choice.error_target), (Plan::Pq, None), "{}", choice.reason);
    let best = layer0_answers(&session, &src, &AttentionOptions::default());
    let errors: Vec<f64> = best.iter().map(|a| a.0).collect();
    let mean = errors.iter().sum::<f64>() / errors.len() as f64;
    println!(
        "compact, the codes' best {} candidates and their blocks: mean error {mean:.4}, {:.1}% of the tokens beyond the window",
        Rules::default().codes_budget,
        retrieved_share(&src, &best) * 100.0,
    );
    assert!(mean <= 0.02, "mean output error {mean}");
    let blocks = block_fill(&session, &src);
    println!(
        "compact: at most {} key blocks an answer; the tokens of its blocks it left out hold at most {:.5} of its attention",
        blocks.most, blocks.left_out_share
    );
    assert!(blocks.most <= Rules::default().codes_budget, "more blocks than candidates: {blocks:?}");
    // What the candidates' blocks hold beyond them is attended but for the negligible share.
    assert!(blocks.left_out_share <= 2e-3, "a block's tokens that matter were left out: {blocks:?}");
    // A budget below even the codes is refused, holding nothing.
    let tiny = DbConfig { resident_budget: Some(f.compact_ratio() * 0.9), ..Default::default() };
    let tiny = Db::open_read_only(&store, DeviceChoice::Auto, tiny).unwrap();
    match tiny.warm("prose") {
        Err(e @ ctxfs_attention::Error::OverBudget { .. }) => assert!(e.to_string().contains("\"prose\""), "{e}"),
        other => panic!("expected OverBudget, got {other:?}"),
    }
    // A session is refused as warm is, warmed or not: it would be served beyond the budget.
    match tiny.open_session("prose", None) {
        Err(ctxfs_attention::Error::OverBudget { .. }) => {}
        other => panic!("expected OverBudget, got {:?}", other.map(|_| ())),
    }
    assert_eq!(tiny.pool_stats().index.resident_pins, 0, "nothing held");
}

/// Served compact on a GPU machine, a group's scan of the codes runs on the device, from a
/// copy of them made on first use: the same scores as the CPU's scan, so the same tokens are
/// retrieved and the answers agree. Without a GPU it checks the CPU path and says so.
#[test]
fn the_codes_scanned_on_the_gpu_select_what_the_cpu_selects() {
    let dir = tempfile::tempdir().unwrap();
    let (store, db, src) = real_prose(dir.path());
    drop(db);
    let rules = Rules { short_context: 0, scan_context: 0, ..Default::default() };
    let compact = Db::open_read_only(
        &store,
        DeviceChoice::Auto,
        DbConfig { resident_budget: Some(PROSE_BUDGET), rules, ..Default::default() },
    )
    .unwrap();
    compact.warm("prose").unwrap();
    let session = compact.open_session("prose", None).unwrap();
    let shape = session.shape();
    let d = shape.head_dim as usize;
    let mut rng = SplitMix64::new(3);
    for step in 0..4 {
        // Keys of the context as queries, scaled: peaked attention, as a decode step has.
        let q: Vec<f32> = (0..shape.q_heads as usize)
            .flat_map(|qh| {
                let h = qh / (shape.q_heads / shape.kv_heads) as usize;
                let t = (rng.next_u64() % src.token_count() as u64) as usize;
                src.keys(0, h).unwrap()[t * d..(t + 1) * d].iter().map(|x| x * 3.0).collect::<Vec<_>>()
            })
            .collect();
        for opts in [AttentionOptions::default(), AttentionOptions { target_error: Some(0.01), ..Default::default() }] {
            let opts = AttentionOptions { detail: true, ..opts };
            let gpu = session.attention_with(0, &q, &opts).unwrap();
            let cpu = session.attention_with(0, &q, &AttentionOptions { cpu_only: true, ..opts.clone() }).unwrap();
            assert_eq!(gpu.choice.plan, Plan::Pq);
            for (g, c) in gpu.heads.iter().zip(&cpu.heads) {
                assert_eq!(g.selected, c.selected, "step {step}: the same tokens");
            }
            assert!(rel_err(&gpu.output, &cpu.output) < 1e-4, "step {step}");
        }
    }
    match compact.gpu_codes_bytes() {
        Some((held, budget)) => {
            let codes = src.token_count() as u64 * (d as u64 / 4) * shape.kv_heads as u64;
            assert_eq!(held, codes, "every kv head's codes of layer 0 held, within {budget}");
        }
        None => eprintln!("skipped the GPU half: {}", compact.gpu_status()),
    }
}

/// A resident budget that serves "prose" compact: its PQ codes, seed tables and meta blocks
/// are an eighth of its KV, and their block maps beside them 0.4% of it.
const PROSE_BUDGET: f64 = 0.13;

/// The real attention of tests/data (SmolLM2-135M, layer 15, 4,096 tokens of prose)
/// imported as "prose" into a fresh store under `dir`: the store, its DB and the source.
fn real_prose(dir: &Path) -> (std::path::PathBuf, Db, SafetensorsKv) {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/data/smollm2-prose-4k.safetensors");
    let store = mkfs(dir, 64);
    let db = open(&store);
    let src = SafetensorsKv::open(Path::new(data), DType::F16).unwrap();
    db.import("prose", &src, |_| Ok(())).unwrap();
    (store, db, src)
}

/// DIPRS on real attention, found on the PQ codes: it holds nearly all of the range that
/// exact scores give, more than the walk of the graph (`graph-diprs`) finds, while scoring
/// only a small share of the keys exactly.
#[test]
fn the_dipr_range_on_the_codes_holds_on_real_attention() {
    let dir = tempfile::tempdir().unwrap();
    let (_, db, src) = real_prose(dir.path());
    let session = db.open_session("prose", None).unwrap();
    let shape = session.shape();
    let (d, kv) = (shape.head_dim as usize, shape.kv_heads as usize);
    let group = (shape.q_heads / shape.kv_heads) as usize;
    let n = src.token_count();
    let beta = (d as f32).sqrt() * 100f32.ln();
    let keys: Vec<Vec<f32>> = (0..kv).map(|h| widen(&to_halves(&src.keys(0, h).unwrap()))).collect();
    let decode: Vec<Vec<Vec<f32>>> = (0..kv).map(|h| src.decode_queries(0, h).unwrap().unwrap()).collect();
    // Per plan: the summed recall, the answers, and the keys scored.
    let plans = [Plan::Diprs, Plan::GraphDiprs];
    let mut sums = [(0.0f64, 0usize, 0u64); 2];
    for step in 0..8 {
        let q: Vec<f32> = decode
            .iter()
            .flat_map(|per_head| per_head.iter().flat_map(|g| &g[step * d..(step + 1) * d]))
            .copied()
            .collect();
        for (plan, sum) in plans.iter().zip(&mut sums) {
            let a = session.attention_with(0, &q, &opts(*plan, beta)).unwrap();
            assert_eq!(a.choice.plan, *plan);
            for (qh, r) in a.heads.iter().enumerate() {
                let qv = &q[qh * d..(qh + 1) * d];
                let s: Vec<f32> =
                    keys[qh / group].chunks_exact(d).map(|k| k.iter().zip(qv).map(|(a, b)| a * b).sum()).collect();
                let best = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let range: Vec<u32> = (0..n as u32).filter(|&t| s[t as usize] >= best - beta).collect();
                let held = range.iter().filter(|t| r.selected.binary_search(t).is_ok()).count();
                *sum = (sum.0 + held as f64 / range.len() as f64, sum.1 + 1, sum.2 + r.stats.keys_scored);
            }
        }
    }
    let [(codes, answers, codes_scored), (graph, _, graph_scored)] = sums;
    let (codes, graph) = (codes / answers as f64, graph / answers as f64);
    let scored = |k: u64| k as f64 / (answers * n) as f64;
    println!(
        "DIPR recall at β = √d·ln 100: codes {codes:.3} scoring {:.1}% of the keys, graph {graph:.3} scoring {:.1}%",
        scored(codes_scored) * 100.0,
        scored(graph_scored) * 100.0
    );
    assert!(codes >= 0.95 && codes >= graph, "codes {codes}, graph {graph}");
    assert!(scored(codes_scored) < 0.2, "the codes scored {:.1}% of the keys", scored(codes_scored) * 100.0);
}

/// Answers of layer 0 for the first 8 decode steps of `src` with an output error target
/// (and `plan`, or the optimizer's): how many met it against exact attention, of how many,
/// and the share of the tokens beyond the window retrieved.
fn target_answers(session: &Session, src: &SafetensorsKv, plan: Option<Plan>, target: f32) -> (usize, usize, f64) {
    let opts = AttentionOptions { plan, target_error: Some(target), ..Default::default() };
    let answered = layer0_answers(session, src, &opts);
    let met = answered.iter().filter(|a| a.0 <= f64::from(target)).count();
    for a in &answered {
        let estimate = a.2.expect("a target reports its estimate");
        assert!(estimate.is_finite() && estimate >= 0.0, "{estimate}");
    }
    (met, answered.len(), retrieved_share(src, &answered))
}

/// The share of the tokens beyond the window (640) that `answered` retrieved.
fn retrieved_share(src: &SafetensorsKv, answered: &[(f64, usize, Option<f32>)]) -> f64 {
    let beyond = src.token_count() as f64 - 640.0;
    answered.iter().map(|a| a.1).sum::<usize>() as f64 / (answered.len() as f64 * beyond)
}

/// Each q head's answer of layer 0 for the first 8 decode steps of `src` under `opts`: its
/// output error against exact attention, the tokens it retrieved beyond the window, and the
/// error it estimated (with a target).
fn layer0_answers(session: &Session, src: &SafetensorsKv, opts: &AttentionOptions) -> Vec<(f64, usize, Option<f32>)> {
    let shape = session.shape();
    let (d, kv) = (shape.head_dim as usize, shape.kv_heads as usize);
    let group = (shape.q_heads / shape.kv_heads) as usize;
    let n = src.token_count() as u32;
    let all: Vec<u32> = (0..n).collect();
    let keys: Vec<Vec<f32>> = (0..kv).map(|h| widen(&to_halves(&src.keys(0, h).unwrap()))).collect();
    let values: Vec<Vec<f32>> = (0..kv).map(|h| widen(&to_halves(&src.values(0, h).unwrap()))).collect();
    let decode: Vec<Vec<Vec<f32>>> = (0..kv).map(|h| src.decode_queries(0, h).unwrap().unwrap()).collect();
    let mut answered = Vec::new();
    for step in 0..8 {
        // All q heads of the step, head after head.
        let mut q = Vec::new();
        for per_head in &decode {
            for g in per_head {
                q.extend_from_slice(&g[step * d..(step + 1) * d]);
            }
        }
        let a = session.attention_with(0, &q, opts).unwrap();
        for (qh, r) in a.heads.iter().enumerate() {
            let h = qh / group;
            let want = exact(&keys[h], &values[h], d, &all, &q[qh * d..(qh + 1) * d], 1.0 / (d as f32).sqrt()).0;
            answered.push((rel_err(&a.output[qh * d..(qh + 1) * d], &want), r.retrieved, r.estimated_error));
        }
    }
    answered
}

/// The key blocks that the first 2 decode steps' answers of layer 0 retrieve from: the most
/// one answer touched, and the largest share of an answer's exact
/// attention that the tokens of its blocks left out hold (outside the window, not
/// retrieved).
#[derive(Debug)]
struct BlockFill {
    most: usize,
    left_out_share: f64,
}

fn block_fill(session: &Session, src: &SafetensorsKv) -> BlockFill {
    let shape = session.shape();
    let (d, group) = (shape.head_dim as usize, (shape.q_heads / shape.kv_heads) as usize);
    let (n, rows) = (src.token_count() as u32, key_rows_per_block(shape.head_dim.into()));
    let all: Vec<u32> = (0..n).collect();
    let window = session.window_tokens().to_vec();
    let keys: Vec<Vec<f32>> =
        (0..shape.kv_heads as usize).map(|h| widen(&to_halves(&src.keys(0, h).unwrap()))).collect();
    let values: Vec<Vec<f32>> =
        (0..shape.kv_heads as usize).map(|h| widen(&to_halves(&src.values(0, h).unwrap()))).collect();
    let decode: Vec<Vec<Vec<f32>>> =
        (0..shape.kv_heads as usize).map(|h| src.decode_queries(0, h).unwrap().unwrap()).collect();
    let (opts, scale) = (AttentionOptions { detail: true, ..Default::default() }, 1.0 / (d as f32).sqrt());
    let (mut most, mut left_out_share) = (0, 0.0f64);
    for step in 0..2 {
        let q: Vec<f32> = decode.iter().flatten().flat_map(|g| g[step * d..(step + 1) * d].to_vec()).collect();
        let a = session.attention_with(0, &q, &opts).unwrap();
        for (qh, r) in a.heads.iter().enumerate() {
            let retrieved: Vec<u32> =
                r.selected.iter().copied().filter(|t| !window.contains(t) && !r.tail.contains(t)).collect();
            let mut blocks: Vec<u32> = retrieved.iter().map(|t| t / rows).collect();
            blocks.dedup();
            most = most.max(blocks.len());
            let left_out: Vec<u32> = blocks
                .iter()
                .flat_map(|&b| block_tokens(b, rows, n, &window))
                .filter(|t| retrieved.binary_search(t).is_err())
                .collect();
            if !left_out.is_empty() {
                // Their share of the exact attention: exp(their log-sum-exp − everyone's).
                let (k, v, q) = (&keys[qh / group], &values[qh / group], &q[qh * d..(qh + 1) * d]);
                let lse = |ids: &[u32]| exact(k, v, d, ids, q, scale).1 as f64;
                left_out_share = left_out_share.max((lse(&left_out) - lse(&all)).exp());
            }
        }
    }
    BlockFill { most, left_out_share }
}

/// Key rows per 4 KiB block at head dimension `d`, as the index lays them out (and the values
/// alike: docs/format.md, "Key blocks", "Value blocks").
fn key_rows_per_block(d: u32) -> u32 {
    ctxfs_index::paged::Layout::new(0, d, 1, 0, DType::F16, ctxfs_vfs::max_payload(4096)).rows_per_block
}

/// The tokens of block `b` (`rows` a block, `n` in all) outside `window`.
fn block_tokens(b: u32, rows: u32, n: u32, window: &[u32]) -> impl Iterator<Item = u32> + '_ {
    (b * rows..((b + 1) * rows).min(n)).filter(move |t| !window.contains(t))
}

fn to_halves(x: &[f32]) -> Vec<f16> {
    x.iter().map(|&v| f16::from_f32(v)).collect()
}

/// A context long enough for sample codes (24,576 tokens at d = 64): DIPRS scans only the
/// scores near each query's range, and a forced `pq` plan keeps only each query's best, and
/// both answer as the range and the budget ask.
#[test]
fn a_long_context_finds_its_range_and_its_best_from_the_scores_it_kept() {
    const LONG: usize = 24_576;
    let dir = tempfile::tempdir().unwrap();
    let b = book(dir.path(), LONG, 1, 4, 1, 13);
    let store = mkfs(dir.path(), 256);
    let db = open(&store);
    let src = SafetensorsKv::open(&b.path, DType::F16).unwrap();
    db.import("long", &src, |_| Ok(())).unwrap();
    let session = db.open_session("long", None).unwrap();
    let d = b.shape.head_dim as usize;
    let beta = 5.0 * (d as f32).sqrt();
    let keys = widen(&b.head(0, 0).keys);
    let (mut recall, mut answers) = (0.0, 0);
    for step in 0..4 {
        let q = b.decode_step(0, step);
        let ranged = session.attention_with(0, &q, &opts(Plan::Diprs, beta)).unwrap();
        let best = session.attention_with(0, &q, &AttentionOptions { budget: Some(512), ..opts(Plan::Pq, 0.0) });
        let best = best.unwrap();
        for (qh, (r, p)) in ranged.heads.iter().zip(&best.heads).enumerate() {
            let qv = &q[qh * d..(qh + 1) * d];
            let s: Vec<f32> = keys.chunks_exact(d).map(|k| k.iter().zip(qv).map(|(a, b)| a * b).sum()).collect();
            let top = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let range: Vec<u32> = (0..LONG as u32).filter(|&t| s[t as usize] >= top - beta).collect();
            recall += range.iter().filter(|t| r.selected.binary_search(t).is_ok()).count() as f64 / range.len() as f64;
            answers += 1;
            assert!(r.stats.keys_scored < LONG as u64 / 4, "{} keys scored", r.stats.keys_scored);
            assert!(p.retrieved <= 512 && p.retrieved > 0, "{} retrieved", p.retrieved);
        }
    }
    let recall = recall / answers as f64;
    println!("DIPRS on a {LONG}-token context: DIPR recall {recall:.3}");
    assert!(recall >= 0.95, "DIPR recall {recall}");
}

/// Served compact beyond the scan's reach (the codes' best 1,024 beyond the window), a
/// context imported with residual codes (an import makes them from 32,768 tokens) reads the
/// keys of fewer candidates than one imported without, for answers as close to exact
/// attention, and holds their bytes within the budget. A DIPR range on its codes reads fewer
/// keys too, for as much of the range.
#[test]
fn residual_codes_read_fewer_keys_for_answers_as_close() {
    const LONG: usize = 32_768;
    let dir = tempfile::tempdir().unwrap();
    let b = book(dir.path(), LONG, 1, 4, 1, 17);
    let store = mkfs(dir.path(), 512);
    let d = b.shape.head_dim as usize;
    let bare = PqParams { residual: 0, ..PqParams::scan_codes(d) };
    for (name, pq) in [("with", PqCodes::Scan), ("without", PqCodes::Params(bare))] {
        let db = Db::open(&store, DeviceChoice::Auto, DbConfig { pq, ..Default::default() }).unwrap();
        db.import(name, &SafetensorsKv::open(&b.path, DType::F16).unwrap(), |_| Ok(())).unwrap();
    }
    let rules = Rules { short_context: 0, scan_context: 0, ..Default::default() };
    let budget = DbConfig { resident_budget: Some(0.125), rules, ..Default::default() };
    let db = Db::open_read_only(&store, DeviceChoice::Auto, budget).unwrap();
    let (with, without) = (db.footprint("with").unwrap(), db.footprint("without").unwrap());
    // 8 residual code bytes per token and kv head, and their centroids (32 KiB).
    let added = (with.compact_bytes() - without.compact_bytes()) as f64 / LONG as f64;
    assert!((8.0..=10.0).contains(&added) && with.compact_ratio() <= 0.125, "{with:?} {without:?}");
    let (keys, values) = (widen(&b.head(0, 0).keys), widen(&b.head(0, 0).values));
    let all: Vec<u32> = (0..LONG as u32).collect();
    // Per context: keys scored, and the sum of output errors against exact attention; then
    // for DIPRS (β = 5·√d, whose candidates the residual codes refine as well): keys scored
    // and the summed DIPR recall.
    let mut measured = [(0u64, 0.0f64); 2];
    let mut ranged = [(0u64, 0.0f64); 2];
    let beta = 5.0 * (d as f32).sqrt();
    for ((m, r), name) in measured.iter_mut().zip(&mut ranged).zip(["with", "without"]) {
        assert!(db.warm(name).unwrap().compact);
        let session = db.open_session(name, None).unwrap();
        for step in 0..4 {
            let q = b.decode_step(0, step);
            let a = session.attention(0, &q).unwrap();
            assert_eq!(a.choice.label(), "pq");
            let range = session.attention_with(0, &q, &opts(Plan::Diprs, beta)).unwrap();
            for (qh, (h, found)) in a.heads.iter().zip(&range.heads).enumerate() {
                let qv = &q[qh * d..(qh + 1) * d];
                let want = exact(&keys, &values, d, &all, qv, 1.0 / (d as f32).sqrt()).0;
                m.0 += h.stats.keys_scored;
                m.1 += rel_err(&a.output[qh * d..(qh + 1) * d], &want);
                let s: Vec<f32> = keys.chunks_exact(d).map(|k| k.iter().zip(qv).map(|(a, b)| a * b).sum()).collect();
                let top = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let dipr: Vec<u32> = all.iter().copied().filter(|&t| s[t as usize] >= top - beta).collect();
                let held = dipr.iter().filter(|t| found.selected.binary_search(t).is_ok()).count();
                *r = (r.0 + found.stats.keys_scored, r.1 + held as f64 / dipr.len() as f64);
            }
        }
    }
    // A budget between the two holds the codes without their residual codes, which the
    // sessions then read through the pool: the same answers.
    let between = (with.compact_ratio() + without.compact_ratio()) / 2.0;
    let lean = DbConfig { resident_budget: Some(between), rules, ..Default::default() };
    let lean = Db::open_read_only(&store, DeviceChoice::Auto, lean).unwrap();
    let warm = lean.warm("with").unwrap();
    assert!(warm.compact && warm.residual_streamed && warm.resident_over_kv() <= between, "{warm:?}");
    assert!(!db.warm("with").unwrap().residual_streamed);
    let (held, streamed) = (db.open_session("with", None).unwrap(), lean.open_session("with", None).unwrap());
    let q = b.decode_step(0, 5);
    assert_eq!(streamed.attention(0, &q).unwrap().output, held.attention(0, &q).unwrap().output);
    let [(with_keys, with_err), (without_keys, without_err)] = measured;
    println!(
        "residual codes: {with_keys} keys scored, error sum {with_err:.4}; without: {without_keys}, {without_err:.4}"
    );
    assert!((with_keys as f64) < 0.9 * without_keys as f64, "{with_keys} against {without_keys} keys");
    assert!(with_err <= 1.2 * without_err, "error {with_err} against {without_err}");
    let [(with_keys, with_recall), (without_keys, without_recall)] = ranged.map(|(k, r)| (k, r / 16.0));
    println!("DIPRS, residual codes: {with_keys} keys scored, recall {with_recall:.4}; without: {without_keys}, {without_recall:.4}");
    assert!(with_keys < without_keys, "{with_keys} against {without_keys} keys");
    assert!(
        with_recall >= 0.95 && with_recall >= without_recall - 0.01,
        "recall {with_recall} against {without_recall}"
    );
}

/// A context whose record says another element type than its vector files' indexes (every
/// checksum holding: what a writer's bug would leave) is refused by its sessions, naming the
/// index meta block, and reported by fsck's index check; the other context is served.
#[test]
fn an_index_of_another_shape_than_its_record_is_refused_and_reported() {
    use ctxfs_vfs::FileStream;
    let dir = tempfile::tempdir().unwrap();
    let (b, store) = imported(dir.path());
    let db = open(&store);
    {
        let snap = db.store().snapshot();
        let book = snap.context("book").unwrap();
        let twin = ctxfs_vfs::ModelShape { dtype: DType::Bf16, ..b.shape };
        let mut txn = db.store().begin().unwrap();
        txn.create_context("twin", twin, &book.tokens().unwrap()).unwrap();
        for layer in 0..b.shape.layers {
            for head in 0..b.shape.kv_heads {
                for which in [FileStream::Index, FileStream::Data] {
                    let s = book.stream(layer, head, which).unwrap();
                    for l in 0..s.blocks() {
                        txn.append_block("twin", layer, head, which, s.read(l).unwrap().payload()).unwrap();
                    }
                }
            }
        }
        txn.commit().unwrap();
    }
    drop(db);
    let db = open(&store);
    let mut report = ctxfs_vfs::fsck::Report::default();
    db.check_indexes(&mut report);
    let files = (b.shape.layers * b.shape.kv_heads) as usize;
    assert_eq!(report.problems.len(), files, "{:#?}", report.problems);
    for p in &report.problems {
        assert_eq!(p.context.as_deref(), Some("twin"));
        assert!(
            p.block.is_some() && p.message.contains("in f16, the record") && p.message.contains("in bf16"),
            "{p:?}"
        );
    }
    let session = db.open_session("twin", None).unwrap();
    let err = session.attention(1, &b.decode_step(1, 0)).unwrap_err();
    assert!(err.to_string().contains("index meta block"), "{err}");
    let session = db.open_session("book", None).unwrap();
    session.attention(1, &b.decode_step(1, 0)).unwrap();
}
