//! The index stream's paged readers never panic on damaged blocks that still pass the checksum.
//! A small head (graph index: meta, adjacency, key rows, seeds, seed values; then Quest, InfLLM
//! and PQ runs, and a PQ run with residual codes of a longer head; and its data stream) is
//! built once. Input: 2 bytes (blocks cut from the end of
//! the index stream, budget and prefix), then 6-byte edits of one block's payload (block u8,
//! op u8, offset u16 LE, value u16 LE; see `edit`). Every edited block is re-sealed with its new
//! CRC, as the reference to it would carry, so the damage reaches the decoders behind the
//! checksum. Opening, searching, scanning, gathering and every coarse selection must not panic.
#![no_main]

use ctxfs_buffer::{BlockRequest, BlockSource, BufferError, BufferPool, FrameHint, PoolConfig};
use ctxfs_index::coarse::infllm::{Infllm, InfllmParams, PagedInfllm};
use ctxfs_index::coarse::pq::{PagedPq, Pq, PqParams, SAMPLE_STRIDE};
use ctxfs_index::coarse::quest::{PagedQuest, Quest, QuestParams};
use ctxfs_index::coarse::{run_of, CoarseKind};
use ctxfs_index::paged::{gather_rows, index_payloads, row_payloads, PagedIndex, Rows};
use ctxfs_index::search::{diprs, topk};
use ctxfs_index::synth::{head, SynthParams};
use ctxfs_index::{build, flat, BuildParams, Coarse, DiprsParams, Keys, MemKeys, SearchStats};
use ctxfs_vfs::format::header::{seal, verify, BlockKind, Expect, Owner, StreamTag};
use ctxfs_vfs::format::BlockHeader;
use ctxfs_vfs::max_payload;
use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

#[global_allocator]
static ALLOC: ctxfs_fuzz::Bounded = ctxfs_fuzz::Bounded;

const BS: usize = 4096;
const D: usize = 16;
const TOKENS: usize = 600;
/// Tokens of the PQ run with residual codes.
const RESIDUAL_TOKENS: usize = 32_768;

struct Pristine {
    /// The index stream's payloads, then the data stream's.
    payloads: Vec<Vec<u8>>,
    index_blocks: usize,
    queries: Vec<f32>,
}

fn pristine() -> &'static Pristine {
    static P: OnceLock<Pristine> = OnceLock::new();
    P.get_or_init(|| {
        let h = head(&SynthParams { tokens: TOKENS, head_dim: D, group: 1, seed: 3 }, 0, 0, 200, 2);
        let keys = MemKeys::new(D, h.keys.clone());
        let prefill = h.prefill.concat();
        let params = BuildParams { degree: 8, extra_degree: 4, ..Default::default() };
        let (graph, _) = build(&keys, &prefill, &params);
        let payload = max_payload(BS);
        let (_, mut payloads) = index_payloads(&keys, &h.values, &graph, payload);
        payloads.extend(Quest::build(&keys, &QuestParams::default()).unwrap().payloads(payload).unwrap());
        payloads.extend(Infllm::build(&keys, &prefill, &InfllmParams::default()).unwrap().payloads(payload).unwrap());
        payloads.extend(Pq::build(&keys, &PqParams::M2B6).unwrap().payloads(payload).unwrap());
        // A run with residual codes, which a build makes from 32,768 tokens (of 8 channels
        // here, so that it stays small): its residual centroid and code blocks too.
        let long = head(&SynthParams { tokens: RESIDUAL_TOKENS, head_dim: 8, group: 1, seed: 5 }, 0, 0, 16, 1);
        let codes = Pq::build(&MemKeys::new(8, long.keys), &PqParams::scan_codes(8)).unwrap();
        assert!(codes.residual_table(&[0.0; 8]).unwrap().is_some(), "residual codes");
        payloads.extend(codes.payloads(payload).unwrap());
        let index_blocks = payloads.len();
        payloads.extend(row_payloads(Rows::F16(&h.values), D, payload));
        Pristine { payloads, index_blocks, queries: h.decode.concat() }
    })
}

/// Applies one 6-byte edit: op 0 sets a byte, 1 writes a little-endian u32 (4-aligned, where
/// the meta blocks keep their fields), 2 writes `u32::MAX - value`, 3 resizes the payload
/// (zero-filled) to `offset` bytes at most the block's payload.
fn edit(payloads: &mut [Vec<u8>], e: &[u8]) {
    let p = &mut payloads[e[0] as usize % payloads.len()];
    let (op, at, v) = (e[1] % 4, u16::from_le_bytes([e[2], e[3]]) as usize, u16::from_le_bytes([e[4], e[5]]));
    match op {
        3 => p.resize(at.min(max_payload(BS)), 0),
        _ if p.is_empty() => {}
        0 => {
            let i = at % p.len();
            p[i] = v as u8;
        }
        _ if p.len() < 4 => {}
        _ => {
            let i = (at % (p.len() - 3)) & !3;
            let word = if op == 1 { v as u32 } else { u32::MAX - v as u32 };
            p[i..i + 4].copy_from_slice(&word.to_le_bytes());
        }
    }
}

/// Blocks sealed in memory, served as a device would: read, then verified against the request.
struct Sealed(Vec<Vec<u8>>);

impl BlockSource for Sealed {
    fn block_size(&self) -> usize {
        BS
    }
    fn blocks(&self) -> u64 {
        self.0.len() as u64
    }
    fn load(&self, reqs: &[BlockRequest], bufs: &mut [&mut [u8]]) -> Vec<Result<BlockHeader, BufferError>> {
        reqs.iter()
            .zip(bufs.iter_mut())
            .map(|(r, buf)| {
                buf.copy_from_slice(&self.0[r.block as usize]);
                verify(buf, &r.expect)
                    .map_err(|f| BufferError::Block(Arc::new(ctxfs_vfs::Error::mismatch(r.block, &r.expect, f))))
            })
            .collect()
    }
}

/// Seals each payload as block `i` of its stream and returns the blocks and their requests.
fn seal_all(payloads: &[Vec<u8>], index_blocks: usize) -> (Vec<Vec<u8>>, Vec<BlockRequest>) {
    let owner = Owner::file(1, 0, 0);
    payloads
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (kind, stream, logical) = if i < index_blocks {
                (BlockKind::Index, StreamTag::Index, i)
            } else {
                (BlockKind::Data, StreamTag::Data, i - index_blocks)
            };
            let h = BlockHeader {
                kind,
                stream,
                owner,
                payload_len: p.len() as u32,
                logical: logical as u64,
                generation: 1,
            };
            let mut block = vec![0u8; BS];
            let crc = seal(&mut block, &h, p);
            let expect = Expect { kind, stream, owner, logical: logical as u64, crc, max_generation: 1 };
            (block, BlockRequest { block: i as u64, expect })
        })
        .unzip()
}

fuzz_target!(|data: &[u8]| {
    let Some((&[cut, knobs], edits)) = data.split_first_chunk::<2>() else { return };
    let p = pristine();
    let mut payloads = p.payloads.clone();
    for e in edits.chunks_exact(6) {
        edit(&mut payloads, e);
    }
    let (blocks, reqs) = seal_all(&payloads, p.index_blocks);
    let index = &reqs[..p.index_blocks - (cut % 4) as usize];
    let data_reqs = &reqs[p.index_blocks..];
    let config = PoolConfig {
        budget_bytes: 256 * BS as u64,
        data_fraction: 0.25,
        wait: Duration::from_millis(1),
        shards: 4,
        populate: false,
    };
    let pool = Arc::new(BufferPool::new(Arc::new(Sealed(blocks)), config).unwrap());
    let hints: Vec<FrameHint> = index.iter().map(|_| FrameHint::default()).collect();
    let Ok(paged) = PagedIndex::open(&pool, index, &hints) else { return };
    let l = *paged.layout();
    let q = &p.queries[..D];
    if l.dim as usize != D {
        // A session refuses an index of another dimension than its context's.
        return;
    }
    let budget = 16 * (knobs & 0x1F) as usize;
    let prefix = (knobs & 0x20 != 0).then_some(l.tokens / 2);
    let mut stats = SearchStats::default();
    let _ = diprs(&paged, q, &DiprsParams { beta: 5.0, l0: 8, ..Default::default() });
    let _ = topk(&paged, q, 10, 16, prefix);
    let _ = flat::scan_many(&paged, &p.queries[..2 * D], l.tokens);
    let ends: Vec<u32> = [0, l.tokens / 2, l.tokens.saturating_sub(1)].into_iter().filter(|&t| t < l.tokens).collect();
    let _ = paged.gather_keys(&ends);
    let _ = gather_rows(&pool, data_reqs, &l, &ends);
    let mut acc = [0.0f32; D];
    if l.seed_rows() <= 4096 {
        let _ = paged.sum_seed_values(&[&vec![1.0; l.seed_rows() as usize]], &mut [&mut acc], &mut stats);
    }
    if let Ok(Some(held)) = pool.make_resident(index) {
        if let Ok(resident) = PagedIndex::open(&pool, index, &hints).and_then(|i| i.with_resident(&held)) {
            let _ = diprs(&resident, q, &DiprsParams { beta: 5.0, l0: 8, ..Default::default() });
            let _ = flat::scan(&resident, q, l.tokens, &mut stats);
        }
    }
    // The coarse runs after the graph index, walked as a session walks them; the tokens a
    // selection returns are scored on the graph index's keys.
    let mut at = l.index_blocks() as usize;
    while at < index.len() {
        let Ok(meta) = pool.get(&index[at]) else { return };
        let Ok((kind, len)) = run_of(meta.payload()) else { return };
        drop(meta);
        if at + len > index.len() {
            return;
        }
        let run = &index[at..at + len];
        let selected = match kind {
            CoarseKind::Quest => PagedQuest::open(&pool, run).map(|c| {
                let _ = c.page_scores_many(&p.queries[..2 * D], prefix);
                c.select(q, budget, prefix)
            }),
            CoarseKind::Infllm => PagedInfllm::open(&pool, run).map(|c| c.select(q, budget, prefix)),
            CoarseKind::Pq => PagedPq::open(&pool, run).map(|c| {
                // The kept scans read the sample blocks a damaged meta block may claim.
                let _ = c.token_best_many(&p.queries[..2 * D], prefix, budget, SAMPLE_STRIDE);
                let median = |_: usize, sample: &[f32]| sample.get(sample.len() / 2).copied();
                let _ = c.token_above_many(&p.queries[..2 * D], prefix, SAMPLE_STRIDE, &median);
                // The residual codes a damaged meta block may claim, looked up at both ends
                // and the middle.
                let (dim, n) = (c.meta().dim as usize, c.meta().tokens);
                if let Ok(Some(table)) = c.residual_table(&p.queries[..dim.min(D)], &mut stats) {
                    let mut ids = vec![0, n / 2, n.saturating_sub(1)];
                    ids.dedup();
                    let _ = c.refine(&table, &ids, &mut vec![0.0; ids.len()], &mut stats);
                }
                c.select(q, budget, prefix)
            }),
        };
        if let Ok(Ok(sel)) = selected {
            let mut scores = vec![0.0; sel.ids.len()];
            let _ = paged.score(&sel.ids, q, &mut scores, &mut stats);
        }
        at += len;
    }
});
