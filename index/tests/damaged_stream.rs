//! An index stream whose blocks pass their checksums but contradict the meta block (what the
//! `index_stream` fuzz target feeds the paged readers) gives errors naming the block, never a
//! panic: records and rows beyond a block, links beyond the index, streams shorter than the
//! layout, and block counts that overflow.

use ctxfs_buffer::{BlockRequest, Blocks, BufferPool, DeviceSource, FrameHint, PoolConfig};
use ctxfs_index::paged::{gather_rows, index_payloads, row_payloads, Layout, PagedIndex, Rows};
use ctxfs_index::search::{diprs, topk};
use ctxfs_index::synth::{head, SynthParams};
use ctxfs_index::{build, flat, BuildParams, DiprsParams, Keys, MemKeys, SearchStats};
use ctxfs_vfs::device::MemDevice;
use ctxfs_vfs::{max_payload, DType, FileStream, ModelShape, Store};
use std::sync::Arc;

const D: usize = 16;

struct Head {
    index: Vec<Vec<u8>>,
    data: Vec<Vec<u8>>,
    query: Vec<f32>,
}

/// A small head's index and data payloads (600 tokens of dimension 16, degree 8 + 4).
fn small_head() -> Head {
    let h = head(&SynthParams { tokens: 600, head_dim: D, group: 1, seed: 3 }, 0, 0, 200, 1);
    let keys = MemKeys::new(D, h.keys.clone());
    let (graph, _) =
        build(&keys, &h.prefill.concat(), &BuildParams { degree: 8, extra_degree: 4, ..Default::default() });
    let (_, index) = index_payloads(&keys, &h.values, &graph, max_payload(4096));
    let data = row_payloads(Rows::F16(&h.values), D, max_payload(4096));
    Head { index, data, query: h.decode.concat()[..D].to_vec() }
}

/// The streams stored (sealed by the store, so their checksums hold); their block requests.
fn store(index: &[Vec<u8>], data: &[Vec<u8>]) -> (Store, Vec<BlockRequest>, Vec<BlockRequest>) {
    let store = ctxfs_vfs::format(Arc::new(MemDevice::new(4096, 1024))).unwrap();
    let shape = ModelShape { layers: 1, q_heads: 1, kv_heads: 1, head_dim: D as u16, dtype: DType::F16 };
    let mut txn = store.begin().unwrap();
    txn.create_context("c", shape, &[]).unwrap();
    for (blocks, stream) in [(index, FileStream::Index), (data, FileStream::Data)] {
        for b in blocks {
            txn.append_block("c", 0, 0, stream, b).unwrap();
        }
    }
    txn.commit().unwrap();
    let snap = store.snapshot();
    let ctx = snap.context("c").unwrap();
    let reqs = |stream| Blocks::of(&ctx.stream(0, 0, stream).unwrap().refs()).to_vec();
    let (index, data) = (reqs(FileStream::Index), reqs(FileStream::Data));
    drop(snap);
    (store, index, data)
}

fn pool(store: &Store) -> Arc<BufferPool> {
    let config = PoolConfig { budget_bytes: 4 << 20, ..Default::default() };
    Arc::new(BufferPool::new(Arc::new(DeviceSource::new(store.device().clone())), config).unwrap())
}

fn hints(n: usize) -> Vec<FrameHint> {
    (0..n).map(|_| FrameHint::default()).collect()
}

/// Meta block field `i` (0: version, 1: tokens, 2: dim, 3: degree, 4: entry, 5: records per
/// block, 6: rows per block, 7: element type, 8: seed stride) set to `v`.
fn set_field(meta: &mut [u8], i: usize, v: u32) {
    meta[4 + 4 * i..8 + 4 * i].copy_from_slice(&v.to_le_bytes());
}

#[test]
fn meta_blocks_whose_records_or_counts_overflow_are_errors() {
    let h = small_head();
    let layout = Layout::decode(&h.index[0]).unwrap();
    let cases: [&[(usize, u32)]; 5] = [
        // Found by the fuzzer: a record count far beyond a block; the first adjacency lookup
        // sliced past the block's payload.
        &[(5, u32::MAX - 0x1400)],
        // Found by the fuzzer in the check that refuses it: records · degree · 4 overflowed u64.
        &[(5, u32::MAX), (3, u32::MAX)],
        &[(6, u32::MAX), (2, u32::MAX)],
        // One more row per block than fit.
        &[(6, (max_payload(4096) / (2 * D)) as u32 + 1)],
        // A block count beyond u32: every token its own adjacency and key block.
        &[(1, u32::MAX), (5, 1), (6, 1), (8, 1)],
    ];
    for fields in cases {
        let mut index = h.index.clone();
        for &(i, v) in fields {
            set_field(&mut index[0], i, v);
        }
        let (store, reqs, _) = store(&index, &h.data);
        let pool = pool(&store);
        let hints = hints(reqs.len());
        let e = PagedIndex::open(&pool, &reqs, &hints).err().unwrap_or_else(|| panic!("{fields:?} opened"));
        assert!(e.contains("index meta block"), "{fields:?}: {e}");
    }
    assert!(Layout::decode(&h.index[0]).is_ok_and(|l| l == layout));
}

#[test]
fn short_blocks_and_links_beyond_the_index_are_errors_naming_the_block() {
    let h = small_head();
    let l = Layout::decode(&h.index[0]).unwrap();
    let q = &h.query;
    let params = DiprsParams { beta: 5.0, l0: 8, ..Default::default() };
    let first_key = 1 + l.adjacency_blocks() as usize;
    let seed_values = (l.index_blocks() - l.seed_value_blocks()) as usize;
    // (logical block, damage): every adjacency block cut short; a link to a node beyond the
    // tokens in every record of one; key blocks and seed value blocks cut short.
    let mut cases: Vec<(usize, Vec<u8>)> = Vec::new();
    for b in 1..first_key {
        cases.push((b, h.index[b][..12].to_vec()));
        let mut beyond = h.index[b].clone();
        for rec in beyond.chunks_exact_mut(4 * l.degree as usize) {
            rec[..4].copy_from_slice(&l.tokens.to_le_bytes());
        }
        cases.push((b, beyond));
    }
    cases.push((first_key, h.index[first_key][..100].to_vec()));
    cases.push((seed_values, Vec::new()));
    for (b, damaged) in cases {
        let mut index = h.index.clone();
        index[b] = damaged;
        let (store, reqs, data) = store(&index, &h.data);
        let pool = pool(&store);
        let hints = hints(reqs.len());
        let paged = PagedIndex::open(&pool, &reqs, &hints).unwrap();
        let block = Some(reqs[b].block);
        let mut stats = SearchStats::default();
        let mut failed = 0;
        for e in [
            diprs(&paged, q, &params).err(),
            // As wide as the keys, the climb visits every node's record.
            diprs(&paged, q, &DiprsParams { l0: l.tokens as usize, ..params }).err(),
            topk(&paged, q, 10, 32, None).err(),
            flat::scan(&paged, q, l.tokens, &mut stats).err(),
            paged.gather_keys(&(0..l.tokens).collect::<Vec<_>>()).err(),
            paged
                .sum_seed_values(&[&vec![1.0; l.seed_rows() as usize]], &mut [&mut [0.0; D]], &mut stats)
                .unwrap()
                .err(),
        ]
        .into_iter()
        .flatten()
        {
            assert_eq!(e.block(), block, "logical block {b}: {e}");
            failed += 1;
        }
        assert!(failed > 0, "logical block {b}: the damage went unnoticed");
        // The data stream is intact.
        gather_rows(&pool, &data, &l, &[0, l.tokens - 1]).unwrap();
    }
}

#[test]
fn tokens_beyond_the_index_or_its_data_stream_are_errors() {
    let h = small_head();
    let (store, reqs, data) = store(&h.index, &h.data[..h.data.len() - 1]);
    let pool = pool(&store);
    let hints = hints(reqs.len());
    let paged = PagedIndex::open(&pool, &reqs, &hints).unwrap();
    let l = *paged.layout();
    let (q, mut stats) = (&h.query, SearchStats::default());
    // As a coarse index that disagrees with the graph index would ask.
    assert!(paged.score(&[0, l.tokens], q, &mut [0.0; 2], &mut stats).is_err());
    assert!(paged.gather_keys(&[l.tokens + 7]).is_err());
    assert!(paged.score_range(l.tokens - 1, q, &mut [0.0; 2], &mut stats).is_err());
    // A data stream one block short of the layout.
    assert!(gather_rows(&pool, &data, &l, &[0, l.tokens - 1]).is_err());
    gather_rows(&pool, &data, &l, &[0, 1]).unwrap();
    paged.score(&[0, l.tokens - 1], q, &mut [0.0; 2], &mut stats).unwrap();
}
