//! An index stored in a vfs vector file and searched directly on buffered pages gives exactly
//! the answers of the same index in memory; storage errors come back as errors.

use ctxfs_buffer::{BlockRequest, Blocks, BufferPool, DeviceSource, FrameHint, PoolConfig};
use ctxfs_index::paged::{for_row_runs, gather_rows, index_payloads, row_payloads, PagedIndex, Rows, StoredRows};
use ctxfs_index::search::{diprs, topk, SEED_STRIDE};
use ctxfs_index::synth::{head, SynthParams};
use ctxfs_index::Pair;
use ctxfs_index::{build, flat, BuildParams, DiprsParams, Keys, MemGraph, MemKeys};
use ctxfs_vfs::device::{FaultPlan, MemDevice};
use ctxfs_vfs::{max_payload, BlockDevice, DType, DeviceChoice, FileStream, ModelShape, Store};
use half::f16;
use std::sync::Arc;

/// The payloads of `keys`' and `graph`'s index stream at 4 KiB blocks.
fn payloads(keys: &MemKeys, values: &[f16], graph: &MemGraph) -> Vec<Vec<u8>> {
    index_payloads(keys, values, graph, max_payload(4096)).1
}

fn store_index(dev: Arc<dyn BlockDevice>, dim: usize, blocks: &[Vec<u8>]) -> (Store, Vec<BlockRequest>) {
    let store = ctxfs_vfs::format(dev).unwrap();
    let shape = ModelShape { layers: 1, q_heads: 2, kv_heads: 1, head_dim: dim as u16, dtype: DType::F16 };
    let mut txn = store.begin().unwrap();
    txn.create_context("c", shape, &[]).unwrap();
    for b in blocks {
        txn.append_block("c", 0, 0, FileStream::Index, b).unwrap();
    }
    txn.commit().unwrap();
    let snap = store.snapshot();
    let reqs = Blocks::of(&snap.context("c").unwrap().stream(0, 0, FileStream::Index).unwrap().refs()).to_vec();
    drop(snap);
    (store, reqs)
}

/// The index stored on the io_uring device in a temporary file (kept while the dir lives).
fn uring_index(dim: usize, blocks: &[Vec<u8>]) -> (tempfile::TempDir, Store, Vec<BlockRequest>) {
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let path = dir.path().join("idx.img");
    std::fs::File::create(&path).unwrap().set_len(16 << 20).unwrap();
    let dev: Arc<dyn BlockDevice> =
        Arc::from(ctxfs_vfs::device::open_path(&path, DeviceChoice::Uring, 4096, ctxfs_vfs::Access::Write).unwrap());
    let (store, reqs) = store_index(dev, dim, blocks);
    (dir, store, reqs)
}

fn data() -> (MemKeys, MemGraph, Vec<f32>, Vec<f16>) {
    let p = SynthParams { tokens: 3200, head_dim: 64, group: 2, seed: 9 };
    let h = head(&p, 1, 0, 1500, 8);
    let keys = MemKeys::new(64, h.keys.clone());
    let (graph, _) =
        build(&keys, &h.prefill.concat(), &BuildParams { degree: 16, extra_degree: 8, ..Default::default() });
    (keys, graph, h.decode.concat(), h.values)
}

#[test]
fn searching_buffered_pages_gives_exactly_the_in_memory_answers() {
    let (keys, graph, queries, values) = data();
    let (_dir, store, reqs) = uring_index(64, &payloads(&keys, &values, &graph));
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), PoolConfig::default()).unwrap();
    let hints = hints_for(&reqs);
    let paged = PagedIndex::open(&pool, &reqs, &hints).unwrap();
    assert_eq!(paged.layout().tokens, 3200);
    let mem = Pair { keys: &keys, graph: &graph };
    let beta = 5.0 * 8.0;
    for q in queries.chunks(64) {
        let params = DiprsParams { beta, l0: 64, ..Default::default() };
        let (a, b) = (diprs(&mem, q, &params).unwrap(), diprs(&paged, q, &params).unwrap());
        assert_eq!(a.ids, b.ids);
        assert_eq!((a.stats.keys_scored, a.stats.hops), (b.stats.keys_scored, b.stats.hops));
        assert!(b.stats.blocks_touched > 0);
        assert_eq!(topk(&mem, q, 50, 64, Some(1000)).unwrap().ids, topk(&paged, q, 50, 64, Some(1000)).unwrap().ids);
        assert_eq!(
            flat::dipr(&mem, q, beta, f32::NEG_INFINITY, None).unwrap().ids,
            flat::dipr(&paged, q, beta, f32::NEG_INFINITY, None).unwrap().ids
        );
        // A scan streams whole key blocks; one that ends inside a block scores the same keys.
        let mut stats = Default::default();
        let scanned = flat::scan(&paged, q, 2999, &mut stats).unwrap();
        assert_eq!(scanned, flat::scan(&mem, q, 2999, &mut stats).unwrap());
        let mut one = [0.0];
        mem.score(&[1234], q, &mut one, &mut stats).unwrap();
        assert_eq!(scanned[1234], one[0]);
    }
    // A GQA group's scan in one pass scores exactly what one scan per query does.
    let group = &queries[..4 * 64];
    let together = flat::scan_many(&paged, group, 2999).unwrap();
    for (t, q) in group.chunks(64).enumerate() {
        let mut alone = Default::default();
        assert_eq!(together.scores(t), &flat::scan(&paged, q, 2999, &mut alone).unwrap()[..]);
        assert_eq!(together.stats, alone);
    }
    assert_eq!(together.stats.keys_scored, 2999);
    // The index stayed resident: the second pass reads nothing.
    let misses = pool.stats().index.misses;
    for q in queries.chunks(64) {
        diprs(&paged, q, &DiprsParams { beta, l0: 64, ..Default::default() }).unwrap();
    }
    assert_eq!(pool.stats().index.misses, misses);
}

#[test]
fn a_resident_index_answers_exactly_as_the_pinned_one_without_pins() {
    let (keys, graph, queries, values) = data();
    let (_dir, store, reqs) = uring_index(64, &payloads(&keys, &values, &graph));
    let pool =
        Arc::new(BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), PoolConfig::default()).unwrap());
    let hints = hints_for(&reqs);
    let held = pool.make_resident(&reqs).unwrap().expect("the default pool holds this index");
    let pinned = PagedIndex::open(&pool, &reqs, &hints).unwrap();
    let resident = PagedIndex::open(&pool, &reqs, &hints).unwrap().with_resident(&held).unwrap();
    let beta = 5.0 * 8.0;
    for q in queries.chunks(64) {
        let params = DiprsParams { beta, l0: 64, ..Default::default() };
        let (a, b) = (diprs(&pinned, q, &params).unwrap(), diprs(&resident, q, &params).unwrap());
        assert_eq!((a.ids, a.scores), (b.ids, b.scores));
        assert_eq!((a.stats.keys_scored, a.stats.hops), (b.stats.keys_scored, b.stats.hops));
        assert!(a.stats.blocks_touched > 0);
        assert_eq!((b.stats.blocks_touched, b.stats.blocks_read), (0, 0), "nothing pinned, nothing read");
        assert_eq!(
            topk(&pinned, q, 50, 64, Some(1000)).unwrap().ids,
            topk(&resident, q, 50, 64, Some(1000)).unwrap().ids
        );
        let mut stats = Default::default();
        assert_eq!(
            flat::scan(&pinned, q, 2999, &mut stats).unwrap(),
            flat::scan(&resident, q, 2999, &mut stats).unwrap()
        );
    }
    drop(pinned);
    let fewer: Vec<BlockRequest> = reqs[..reqs.len() - 1].to_vec();
    let partial = pool.make_resident(&fewer).unwrap().unwrap();
    let err = PagedIndex::open(&pool, &reqs, &hints).unwrap().with_resident(&partial).err().unwrap();
    assert!(err.contains("resident blocks for an index of"), "{err}");
    assert_eq!(pool.stats().index.resident_pins as usize, reqs.len() + fewer.len());
    drop((resident, partial));
}

#[test]
fn the_seed_values_are_the_seed_tokens_values() {
    let (keys, graph, queries, values) = data();
    let (layout, blocks) = index_payloads(&keys, &values, &graph, max_payload(4096));
    assert!(layout.seed_values && layout.seed_value_blocks() == layout.seed_blocks() && layout.seed_blocks() > 1);
    let (_dir, store, reqs) = uring_index(64, &blocks);
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), PoolConfig::default()).unwrap();
    let hints = hints_for(&reqs);
    let paged = PagedIndex::open(&pool, &reqs, &hints).unwrap();
    let rows = layout.seed_rows() as usize;
    // Three queries' weights, summed in one pass: each skips whole blocks (0) in places of
    // its own and differs row by row elsewhere; all three skip some blocks together.
    let weights: Vec<Vec<f32>> = (0..3)
        .map(|i| {
            (0..rows).map(|j| if (j / 15) % 3 == 1 || (j / 15) % 4 == i { 0.0 } else { queries[j + 7 * i] }).collect()
        })
        .collect();
    let mut got = vec![vec![0.0f32; 64]; 3];
    let mut accs: Vec<&mut [f32]> = got.iter_mut().map(|g| &mut g[..]).collect();
    let refs: Vec<&[f32]> = weights.iter().map(|w| &w[..]).collect();
    paged.sum_seed_values(&refs, &mut accs, &mut Default::default()).unwrap().unwrap();
    for (w, got) in weights.iter().zip(&got) {
        let mut want = vec![0.0f32; 64];
        for (j, w) in w.iter().enumerate() {
            let t = j * SEED_STRIDE as usize;
            for (a, v) in want.iter_mut().zip(&values[t * 64..(t + 1) * 64]) {
                *a += w * v.to_f32();
            }
        }
        let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        assert!(err <= 1e-3 * want.iter().map(|x| x.abs()).fold(1.0, f32::max), "{got:?} against {want:?}");
        // Summed alone, the same values.
        let mut alone = vec![0.0f32; 64];
        paged.sum_seed_values(&[w], &mut [&mut alone[..]], &mut Default::default()).unwrap().unwrap();
        assert_eq!(&alone, got);
    }
}

#[test]
fn a_groups_seeds_scored_at_once_are_each_querys_to_the_bit() {
    let (keys, graph, queries, values) = data();
    let (_, blocks) = index_payloads(&keys, &values, &graph, max_payload(4096));
    let (_dir, store, reqs) = uring_index(64, &blocks);
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), PoolConfig::default()).unwrap();
    let hints = hints_for(&reqs);
    let paged = PagedIndex::open(&pool, &reqs, &hints).unwrap();
    let group = &queries[..3 * 64];
    // The seed table's stride (one scan for the group) and another (scattered rows), over
    // the whole index and over a prefix of it.
    for (stride, limit) in [(SEED_STRIDE, keys.len()), (SEED_STRIDE, 1000), (50, keys.len()), (50, 777)] {
        let (mut all, mut stats) = (Vec::new(), Default::default());
        let len = paged.score_strided_many(stride, limit, group, &mut all, &mut stats).unwrap();
        assert_eq!((len, all.len()), (limit.div_ceil(stride) as usize, 3 * len), "stride {stride} limit {limit}");
        assert_eq!(stats.keys_scored, len as u64);
        for (t, q) in group.chunks(64).enumerate() {
            let mut one = Vec::new();
            paged.score_strided(stride, limit, q, &mut one, &mut Default::default()).unwrap();
            assert_eq!(&all[t * len..(t + 1) * len], &one[..], "query {t}, stride {stride} limit {limit}");
        }
    }
}

#[test]
fn older_layouts_without_seed_values_or_a_seed_table_answer_the_same() {
    let (keys, graph, queries, values) = data();
    let (layout, blocks) = index_payloads(&keys, &values, &graph, max_payload(4096));
    assert_eq!(layout.seed_stride, SEED_STRIDE);
    let mem = Pair { keys: &keys, graph: &graph };
    let params = DiprsParams { beta: 40.0, l0: 64, ..Default::default() };
    // What a layout 3 writer stored (no seed values), and a layout 2 writer (no seed table
    // either, a 36-byte meta block).
    let layout3 = (3u32, (layout.index_blocks() - layout.seed_value_blocks()) as usize, 40);
    let layout2 = (2u32, (layout.index_blocks() - 2 * layout.seed_blocks()) as usize, 36);
    for (version, len, meta) in [layout3, layout2] {
        let mut blocks = blocks.clone();
        blocks.truncate(len);
        blocks[0].truncate(meta);
        blocks[0][4..8].copy_from_slice(&version.to_le_bytes());
        let (_dir, store, reqs) = uring_index(64, &blocks);
        let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), PoolConfig::default()).unwrap();
        let hints = hints_for(&reqs);
        let old = PagedIndex::open(&pool, &reqs, &hints).unwrap();
        assert_eq!(old.layout().index_blocks(), reqs.len() as u32, "layout {version}");
        assert!(!old.layout().seed_values);
        assert_eq!(old.layout().seed_stride, if version == 3 { SEED_STRIDE } else { 0 });
        let weights = vec![1.0; old.layout().seed_rows() as usize];
        assert!(old.sum_seed_values(&[&weights], &mut [&mut [0.0; 64]], &mut Default::default()).is_none());
        for q in queries.chunks(64) {
            // Layout 2 scores the seeds from their scattered key rows instead: the same keys.
            let (a, b) = (diprs(&mem, q, &params).unwrap(), diprs(&old, q, &params).unwrap());
            assert_eq!((a.ids, a.scores, a.stats.keys_scored), (b.ids, b.scores, b.stats.keys_scored));
        }
    }
    // A newer layout is refused by name.
    let mut meta = blocks[0].clone();
    meta[4..8].copy_from_slice(&5u32.to_le_bytes());
    let err = ctxfs_index::paged::Layout::decode(&meta).unwrap_err();
    assert!(err.contains("layout version 5 (this build reads 1 to 4)"), "{err}");
}

/// An index written with another seed stride than this build's (every 96th token, as
/// stores written before the stride became prime hold) is searched at its own: its seed
/// table read in one scan, its seed values the tokens of that stride, the answers those of
/// the same search in memory.
#[test]
fn an_index_written_with_another_seed_stride_is_searched_at_its_own() {
    let (keys, graph, queries, values) = data();
    let payload = max_payload(4096);
    let (layout, blocks) = index_payloads(&keys, &values, &graph, payload);
    let old = ctxfs_index::paged::Layout { seed_stride: 96, ..layout };
    assert_ne!(old.search_stride(), SEED_STRIDE);
    let strided = |rows: &[f16]| -> Vec<f16> { rows.chunks(64).step_by(96).flatten().copied().collect() };
    let mut stored = vec![old.encode()];
    stored.extend_from_slice(&blocks[1..(1 + old.adjacency_blocks() + old.key_blocks()) as usize]);
    stored.extend(row_payloads(Rows::F16(&strided(keys.data())), 64, payload));
    stored.extend(row_payloads(Rows::F16(&strided(&values)), 64, payload));
    assert_eq!(stored.len(), old.index_blocks() as usize);
    let (_dir, store, reqs) = uring_index(64, &stored);
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), PoolConfig::default()).unwrap();
    let hints = hints_for(&reqs);
    let paged = PagedIndex::open(&pool, &reqs, &hints).unwrap();
    assert_eq!((paged.layout().seed_stride, paged.layout().search_stride()), (96, 96));
    let group = &queries[..2 * 64];
    // At its stride the seeds are one scan of the seed table; at this build's, scattered rows.
    for (stride, table) in [(96, true), (SEED_STRIDE, false)] {
        let (mut all, mut stats) = (Vec::new(), Default::default());
        let len = paged.score_strided_many(stride, keys.len(), group, &mut all, &mut stats).unwrap();
        assert_eq!(len, keys.len().div_ceil(stride) as usize);
        assert_eq!(stats.blocks_touched == u64::from(old.seed_blocks()), table, "stride {stride}: {stats:?}");
        for (q, got) in group.chunks(64).zip(all.chunks(len)) {
            let mut want = Vec::new();
            keys.score_strided(stride, keys.len(), q, &mut want, &mut Default::default()).unwrap();
            assert_eq!(got, &want[..], "stride {stride}");
        }
    }
    // The seed values are those of every 96th token.
    let mut weights = vec![0.0; old.seed_rows() as usize];
    weights[3] = 1.0;
    let mut got = [0.0f32; 64];
    paged.sum_seed_values(&[&weights], &mut [&mut got[..]], &mut Default::default()).unwrap().unwrap();
    let want: Vec<f32> = values[3 * 96 * 64..(3 * 96 + 1) * 64].iter().map(|v| v.to_f32()).collect();
    assert_eq!(&got[..], &want[..]);
    let mem = Pair { keys: &keys, graph: &graph };
    for q in queries.chunks(64) {
        let params =
            DiprsParams { beta: 40.0, l0: 64, seed_stride: Some(paged.layout().search_stride()), ..Default::default() };
        let (a, b) = (diprs(&mem, q, &params).unwrap(), diprs(&paged, q, &params).unwrap());
        assert_eq!((a.ids, a.scores, a.stats.keys_scored), (b.ids, b.scores, b.stats.keys_scored));
        assert_eq!((a.seeds.stride, b.seeds.stride), (96, 96));
    }
}

fn hints_for(reqs: &[BlockRequest]) -> Vec<FrameHint> {
    reqs.iter().map(|_| FrameHint::default()).collect()
}

#[test]
fn a_pool_smaller_than_the_index_gives_the_same_answers() {
    let (keys, graph, queries, values) = data();
    let (_dir, store, reqs) = uring_index(64, &payloads(&keys, &values, &graph));
    // 48 index frames for an index of more blocks: searches evict as they go, so the
    // per-index pins stop at their cap and frame hints go stale.
    let config = PoolConfig { budget_bytes: 64 * 4096, data_fraction: 0.25, ..Default::default() };
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), config).unwrap();
    assert!(reqs.len() > 2 * 48, "{} index blocks", reqs.len());
    let hints = hints_for(&reqs);
    let mem = Pair { keys: &keys, graph: &graph };
    for q in queries.chunks(64) {
        // A new index per query, as sessions open one per call; the hints outlive it.
        let paged = PagedIndex::open(&pool, &reqs, &hints).unwrap();
        let params = DiprsParams { beta: 40.0, l0: 64, ..Default::default() };
        let (a, b) = (diprs(&mem, q, &params).unwrap(), diprs(&paged, q, &params).unwrap());
        assert_eq!((a.ids, a.scores), (b.ids, b.scores));
    }
    assert!(pool.stats().index.evictions > 0, "the index did not fit, so it was evicted");
}

#[test]
fn an_unreadable_index_block_is_an_error_not_a_panic() {
    let (keys, graph, queries, values) = data();
    let mem = Arc::new(MemDevice::new(4096, 2048));
    let (store, reqs) = store_index(mem.clone(), 64, &payloads(&keys, &values, &graph));
    let bad = reqs[reqs.len() / 2].block; // a key block
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), PoolConfig::default()).unwrap();
    let hints = hints_for(&reqs);
    let paged = PagedIndex::open(&pool, &reqs, &hints).unwrap();
    mem.set_faults(FaultPlan { bad_read_blocks: [bad].into(), ..Default::default() });
    let q = &queries[..64];
    let err = flat::dipr(&paged, q, 40.0, f32::NEG_INFINITY, None).unwrap_err();
    assert_eq!(err.block(), Some(bad), "{err}");
}

#[test]
fn rows_read_in_runs_are_the_rows_asked_for_in_order() {
    let (keys, graph, _, values) = data();
    let (layout, _) = index_payloads(&keys, &values, &graph, max_payload(4096));
    let (_dir, store, reqs) = uring_index(64, &row_payloads(Rows::F16(&values), 64, max_payload(4096)));
    let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), PoolConfig::default()).unwrap();
    let r = layout.rows_per_block;
    // Runs inside a block, one across a block boundary, gaps, a step back, the last token.
    let ids = [0, 1, 2, r - 2, r - 1, r, r + 1, 2 * r + 5, 7, 8, 2999];
    let row = |t: u32| values[t as usize * 64..(t as usize + 1) * 64].iter().copied();
    // In the stored type, the stored values.
    let (rows, io) = gather_rows(&pool, &reqs, &layout, &ids).unwrap();
    assert_eq!(rows, StoredRows::F16(ids.iter().flat_map(|&t| row(t)).collect()));
    assert_eq!(io.pinned, 4);
    // Summed a run at a time, as a session sums retrieved values.
    let weights: Vec<f32> = (0..ids.len()).map(|i| 1.0 / (i + 1) as f32).collect();
    let (mut sum, mut runs) = (vec![0.0f32; 64], Vec::new());
    for_row_runs(&pool, &reqs, &layout, &ids, |i, rows| {
        let n = rows.len() / 64;
        runs.push((i, n));
        rows.accumulate_rows(&mut sum, &weights[i..i + n]);
    })
    .unwrap();
    assert_eq!(runs, [(0, 3), (3, 2), (5, 2), (7, 1), (8, 2), (10, 1)]);
    let mut want = vec![0.0f32; 64];
    for (&t, &w) in ids.iter().zip(&weights) {
        want.iter_mut().zip(row(t)).for_each(|(a, x)| *a += w * x.to_f32());
    }
    for (a, b) in sum.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} against {b}");
    }
}

/// Key block `j` written beside value block `j` (as `ctxfs import` places them); the
/// other index blocks apart. Returns the index and data streams' requests.
fn store_side_by_side(
    dev: Arc<dyn BlockDevice>,
    index: &[Vec<u8>],
    values: &[Vec<u8>],
    keys_from: usize,
    paired: bool,
) -> (Store, Vec<BlockRequest>, Vec<BlockRequest>) {
    let store = ctxfs_vfs::format(dev).unwrap();
    let shape = ModelShape { layers: 1, q_heads: 2, kv_heads: 1, head_dim: 64, dtype: DType::F16 };
    let mut txn = store.begin().unwrap();
    txn.create_context("c", shape, &[]).unwrap();
    let keys = keys_from..keys_from + values.len();
    for b in &index[..keys.start] {
        txn.append_block("c", 0, 0, FileStream::Index, b).unwrap();
    }
    for (k, v) in index[keys.clone()].iter().zip(values) {
        if paired {
            txn.append_block_pair("c", 0, 0, k, v).unwrap();
        } else {
            txn.append_block("c", 0, 0, FileStream::Index, k).unwrap();
        }
    }
    for b in &index[keys.end..] {
        txn.append_block("c", 0, 0, FileStream::Index, b).unwrap();
    }
    for v in values.iter().filter(|_| !paired) {
        txn.append_block("c", 0, 0, FileStream::Data, v).unwrap();
    }
    txn.commit().unwrap();
    let snap = store.snapshot();
    let ctx = snap.context("c").unwrap();
    let reqs = |which| Blocks::of(&ctx.stream(0, 0, which).unwrap().refs()).to_vec();
    let (i, d) = (reqs(FileStream::Index), reqs(FileStream::Data));
    drop(snap);
    (store, i, d)
}

#[test]
fn a_key_block_read_brings_the_value_block_beside_it_and_nothing_else() {
    let (keys, graph, queries, values) = data();
    let (layout, index) = index_payloads(&keys, &values, &graph, max_payload(4096));
    let value_blocks = row_payloads(Rows::F16(&values), 64, max_payload(4096));
    let keys_from = 1 + layout.adjacency_blocks() as usize;
    // 450 candidates (more than a batch of pins) in runs of 3 neighbours, some of them
    // across a block boundary, in 97 key blocks.
    let ids: Vec<u32> = (0..150).flat_map(|i| [i * 20, i * 20 + 1, i * 20 + 2]).collect();
    let blocks = ids.iter().map(|&t| t / layout.rows_per_block).collect::<std::collections::BTreeSet<_>>().len() as u64;
    for (paired, with_values, values_read) in [(true, true, blocks), (true, false, 0), (false, true, 0)] {
        let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let path = dir.path().join("pairs.img");
        std::fs::File::create(&path).unwrap().set_len(16 << 20).unwrap();
        let dev: Arc<dyn BlockDevice> = Arc::from(
            ctxfs_vfs::device::open_path(&path, DeviceChoice::Uring, 4096, ctxfs_vfs::Access::Write).unwrap(),
        );
        let (store, reqs, data) = store_side_by_side(dev, &index, &value_blocks, keys_from, paired);
        let pool = BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), PoolConfig::default()).unwrap();
        let hints = hints_for(&reqs);
        let mut paged = PagedIndex::open(&pool, &reqs, &hints).unwrap();
        if with_values {
            paged = paged.with_values(&data);
        }
        let case = format!("paired {paired}, with values {with_values}");
        let (mut got, mut want) = (vec![0.0; ids.len()], vec![0.0; ids.len()]);
        let mut stats = Default::default();
        paged.score(&ids, &queries[..64], &mut got, &mut stats).unwrap();
        keys.score(&ids, &queries[..64], &mut want, &mut stats).unwrap();
        assert_eq!(got, want, "{case}");
        let st = pool.stats();
        assert_eq!(st.data.misses, values_read, "{case}: value blocks read with the keys");
        // The values of every candidate, summed next: read with their keys, they are hits.
        let mut rows = 0;
        for_row_runs(&pool, &data, &layout, &ids, |_, r| rows += r.len() / 64).unwrap();
        assert_eq!(rows, ids.len());
        assert_eq!(pool.stats().data.misses, blocks, "{case}: each value block read once");
    }
}
