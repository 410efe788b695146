//! Writing contexts: `Db::import` streams a whole KV cache in, one (layer, kv head) at a
//! time, building each head's graph index; `Db::store` persists a session's own tokens on
//! top of the prefix it reused, indexing only those (a delta searched alongside the
//! parent's index). Each is one transaction: nothing is visible until its commit, and an
//! interrupted one leaves only unreferenced blocks, which were never marked allocated.

use crate::db::Db;
use crate::error::{input, Error, Result};
use crate::kv::KvSource;
use crate::session::Session;
use ctxfs_index::coarse::infllm::{Infllm, InfllmParams};
use ctxfs_index::coarse::pq::{Pq, PqParams};
use ctxfs_index::coarse::quest::{Quest, QuestParams};
use ctxfs_index::paged::{index_payloads_of, row_payloads, Layout, Rows};
use ctxfs_index::{build, BuildParams, MemKeys};
use ctxfs_vfs::{max_payload, DType, FileStream, ModelShape, Txn};
use half::{bf16, f16};
use std::time::{Duration, Instant};

/// What writing a context did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WriteReport {
    /// Tokens indexed and written (a stored session's own tokens, not its prefix).
    pub tokens: usize,
    pub heads: usize,
    pub blocks: u64,
    pub seconds: f64,
    /// The graph build's phases.
    pub knn: Duration,
    /// Heads whose kNN ran on a GPU (`BuildParams::gpu`).
    pub knn_gpu_heads: usize,
    pub projection: Duration,
    pub enhancement: Duration,
    /// Reading the keys, values and training queries from the source (an import's only).
    pub read: Duration,
    /// The coarse indexes: Quest and InfLLM...
    pub coarse: Duration,
    /// ...and the PQ codes (k-means and encoding).
    pub pq: Duration,
    /// Encoding the blocks and appending them to the transaction (written as its queue
    /// fills), and the commit.
    pub write: Duration,
}

impl WriteReport {
    pub fn build_seconds(&self) -> f64 {
        (self.knn + self.projection + self.enhancement).as_secs_f64()
    }

    /// Each phase's seconds per head, by name, the graph build's first.
    pub fn phases_per_head(&self) -> [(&'static str, f64); 7] {
        let per = |d: Duration| d.as_secs_f64() / self.heads.max(1) as f64;
        [
            ("knn", per(self.knn)),
            ("projection", per(self.projection)),
            ("enhancement", per(self.enhancement)),
            ("read", per(self.read)),
            ("coarse", per(self.coarse)),
            ("pq", per(self.pq)),
            ("write", per(self.write)),
        ]
    }
}

/// Blocks one head of `n` tokens takes: its index stream and its data stream.
fn head_blocks(n: usize, d: usize, degree: usize, payload: usize) -> u64 {
    let l = Layout::new(n as u32, d as u32, degree as u32, 0, DType::F16, payload);
    (l.index_blocks() + l.key_blocks()) as u64
}

/// Refuses a write the store cannot hold before anything is written. Extent and record
/// blocks add under 1% (a 4-byte CRC per block mapped, and a 16-byte run for each key and
/// value block, which lie side by side); 2% is reserved.
fn check_space(db: &Db, shape: &ModelShape, n: usize, build: &BuildParams) -> Result<u64> {
    let bs = db.store().device().block_size();
    let payload = max_payload(bs);
    // A key row, and each coarse record, must fit a block: else the build fails after hours.
    let d = shape.head_dim as usize;
    let key_row = d * shape.dtype.size();
    let fits = if key_row > payload {
        Err(format!("a key row of {key_row} bytes does not fit a block payload of {payload} bytes"))
    } else {
        ctxfs_index::coarse::check_records_fit(d, payload)
    };
    if let Err(why) = fits {
        return input(format!(
            "head dim {d} needs larger blocks than this store's {bs} bytes ({why}): format the store with a larger \
             --block-size"
        ));
    }
    // The sequence edges take slots of a node's record, as the build lists them.
    let degree = build.degree + build.extra_degree;
    // Coarse metadata: Quest's page bounds (d/4 bytes a token), InfLLM's representatives and
    // PQ codes (a few bytes a token), PQ's centroids, and their meta blocks.
    let coarse = (n * (d / 4 + 16)).div_ceil(payload) as u64 + 256 * d as u64 * 2 / payload as u64 + 8;
    let per_head = head_blocks(n, d, degree, payload) + coarse;
    let tokens = (n * 4).div_ceil(payload) as u64;
    let needed = per_head * shape.files() as u64 + tokens;
    let needed = needed + needed / 50 + 16;
    let mut space = db.store().space();
    let mut held = String::new();
    // Blocks freed by the last commit: one more commit releases them, unless readers hold
    // them. Taken where they would make the difference, and already when the estimate comes
    // near the free space, not only beyond it (the estimate is not exact); a write refused
    // even so commits nothing.
    let near = needed + needed / 8 + 64 > space.free;
    if space.reclaimable > 0 && near && needed <= space.free + space.reclaimable {
        db.store().reclaim()?;
        space = db.store().space();
        // After it, a few are always the reclaim's own old metadata: readers are named only
        // where the blocks they hold would make the difference.
        if space.reclaimable > 0 && needed > space.free && needed <= space.free + space.reclaimable {
            held = format!(
                "; {} more were freed but are held for open readers of older states, and come free when they close",
                space.reclaimable
            );
        }
    }
    if needed > space.free {
        return Err(Error::Full(format!(
            "this write needs about {needed} blocks, the store has {} free{held}",
            space.free
        )));
    }
    Ok(needed)
}

/// One head to write: its keys and values (rows of `dim`), and the queries that train its
/// graph (the keys themselves when there are none).
struct Head<'a> {
    layer: usize,
    head: usize,
    dim: usize,
    /// Block payload bytes.
    payload: usize,
    keys: &'a [f32],
    values: &'a [f32],
    train: Vec<f32>,
    /// The product quantisation to store, if any.
    pq: Option<PqParams>,
}

/// Builds one head's graph and appends its index and data streams, in the context's element
/// type. A bf16 context's graph is built on an f16 copy of its keys scaled by a power of two
/// into f16's range (inner-product order is unchanged by a positive scale; the stored keys
/// are the bf16 ones); it stores no coarse indexes, whose metadata is f16.
fn write_head(
    txn: &mut Txn<'_>,
    name: &str,
    dtype: DType,
    h: Head<'_>,
    params: &BuildParams,
    r: &mut WriteReport,
) -> Result<()> {
    let payload = h.payload;
    let scale = match dtype {
        DType::F16 => 1.0,
        DType::Bf16 => f16_scale(h.keys),
    };
    let keys = MemKeys::new(h.dim, h.keys.iter().map(|&x| f16::from_f32(x * scale)).collect());
    let train = if h.train.is_empty() { keys.data().iter().map(|x| x.to_f32()).collect() } else { h.train.clone() };
    let (graph, built) = build(&keys, &train, params);
    r.knn += built.knn;
    r.knn_gpu_heads += usize::from(built.knn_on_gpu);
    r.projection += built.projection;
    r.enhancement += built.enhancement;
    let (l, hd) = (h.layer as u16, h.head as u16);
    let (bf_keys, bf_values): (Vec<bf16>, Vec<bf16>);
    let (key_rows, value_rows, values16);
    match dtype {
        DType::F16 => {
            values16 = h.values.iter().map(|&x| f16::from_f32(x)).collect::<Vec<f16>>();
            key_rows = Rows::F16(keys.data());
            value_rows = Rows::F16(&values16);
        }
        DType::Bf16 => {
            bf_keys = h.keys.iter().map(|&x| bf16::from_f32(x)).collect();
            bf_values = h.values.iter().map(|&x| bf16::from_f32(x)).collect();
            key_rows = Rows::Bf16(&bf_keys);
            value_rows = Rows::Bf16(&bf_values);
        }
    }
    let mut t = Instant::now();
    let (layout, mut index) = index_payloads_of(key_rows, value_rows, h.dim, &graph, payload);
    r.write += t.elapsed();
    if dtype == DType::F16 {
        // The coarse indexes follow the graph index in the index stream (docs/format.md §19).
        let coarse = |e: String| Error::Input(format!("layer {l} head {hd}: coarse index: {e}"));
        t = Instant::now();
        index.extend(Quest::build(&keys, &QuestParams::default()).and_then(|q| q.payloads(payload)).map_err(coarse)?);
        let infllm = Infllm::build(&keys, if h.train.is_empty() { &[] } else { &train }, &InfllmParams::default());
        index.extend(infllm.and_then(|i| i.payloads(payload)).map_err(coarse)?);
        r.coarse += t.elapsed();
        if let Some(pq) = &h.pq {
            t = Instant::now();
            index.extend(Pq::build(&keys, pq).and_then(|q| q.payloads(payload)).map_err(coarse)?);
            r.pq += t.elapsed();
        }
    }
    t = Instant::now();
    let data = row_payloads(value_rows, h.dim, payload);
    // Key block j and value block j hold the same tokens' rows: side by side on the device,
    // one read returns a candidate's key and value (docs/format.md §19).
    let keys_from = 1 + layout.adjacency_blocks() as usize;
    assert_eq!(layout.key_blocks() as usize, data.len(), "a key block per value block");
    for b in &index[..keys_from] {
        txn.append_block(name, l, hd, FileStream::Index, b)?;
    }
    for (k, v) in index[keys_from..].iter().zip(&data) {
        txn.append_block_pair(name, l, hd, k, v)?;
    }
    for b in &index[keys_from + data.len()..] {
        txn.append_block(name, l, hd, FileStream::Index, b)?;
    }
    txn.finish_file(name, l, hd)?;
    r.write += t.elapsed();
    r.blocks += (index.len() + data.len()) as u64;
    r.heads += 1;
    Ok(())
}

/// A power of two that brings the largest key magnitude within f16's range (1 when it is).
fn f16_scale(keys: &[f32]) -> f32 {
    let top = keys.iter().fold(0f32, |m, x| m.max(x.abs()));
    let limit = f16::MAX.to_f32() / 2.0;
    if top <= limit {
        1.0
    } else {
        (limit / top).log2().floor().exp2()
    }
}

impl Db {
    /// Imports a context: every (layer, kv head) of `source`, indexed, in one commit.
    /// `progress` is told the KV bytes done after each head; an error it returns stops the
    /// import (a caller's cancel) with nothing committed. The name must be new, the input
    /// well-formed (check values first, e.g. `SafetensorsKv::check_values`), and the store
    /// large enough; otherwise nothing is written.
    pub fn import(
        &self,
        name: &str,
        source: &dyn KvSource,
        mut progress: impl FnMut(u64) -> Result<()>,
    ) -> Result<WriteReport> {
        let started = Instant::now();
        let shape = source.shape();
        shape.validate().map_err(Error::Input)?;
        if self.store().snapshot().context(name).is_ok() {
            return Err(ctxfs_vfs::Error::ContextExists(name.to_string()).into());
        }
        let n = source.token_count();
        if n == 0 {
            return input("a context needs at least one token: the source holds none");
        }
        let ids = source.token_ids()?;
        if ids.len() != n {
            return input(format!("{} token ids for {n} tokens", ids.len()));
        }
        let params = self.config().build.clone();
        check_space(self, &shape, n, &params)?;
        let d = shape.head_dim as usize;
        let payload = max_payload(self.store().device().block_size());
        let mut report = WriteReport { tokens: n, ..Default::default() };
        let mut txn = self.store().begin()?;
        txn.create_context(name, shape, &ids)?;
        for layer in 0..shape.layers as usize {
            for head in 0..shape.kv_heads as usize {
                let reading = Instant::now();
                let keys = source.keys(layer, head)?;
                let values = source.values(layer, head)?;
                let train = source.train_queries(layer, head)?;
                report.read += reading.elapsed();
                write_head(
                    &mut txn,
                    name,
                    shape.dtype,
                    Head {
                        layer,
                        head,
                        dim: d,
                        payload,
                        keys: &keys,
                        values: &values,
                        train,
                        pq: self.config().pq.params(d),
                    },
                    &params,
                    &mut report,
                )?;
                progress((n * d * 4) as u64)?;
            }
        }
        let committing = Instant::now();
        txn.commit()?;
        report.write += committing.elapsed();
        self.inner.remember(name)?;
        report.seconds = started.elapsed().as_secs_f64();
        Ok(report)
    }

    /// Persists a session as context `name`: its own tokens only, every layer updated with
    /// the same number of them and their ids known ([`Session::append_tokens`]). A session
    /// that reused a prefix becomes a child of that context: the prefix's blocks are shared,
    /// not copied or re-indexed.
    pub fn store_session(&self, session: &Session, name: &str) -> Result<WriteReport> {
        let started = Instant::now();
        let shape = session.shape();
        let rows = session.updated_rows(0);
        for l in 1..shape.layers as usize {
            if session.updated_rows(l) != rows {
                return input(format!(
                    "layer {l} has {} new tokens, layer 0 has {rows}: update every layer before storing",
                    session.updated_rows(l)
                ));
            }
        }
        if rows == 0 {
            return input("the session has no new tokens to store");
        }
        if session.new_tokens().len() != rows {
            return input(format!(
                "the session has {rows} new tokens but {} token ids (append the ids of generated tokens)",
                session.new_tokens().len()
            ));
        }
        if self.store().snapshot().context(name).is_ok() {
            return Err(ctxfs_vfs::Error::ContextExists(name.to_string()).into());
        }
        let params = self.config().build.clone();
        check_space(self, &shape, rows, &params)?;
        let d = shape.head_dim as usize;
        let payload = max_payload(self.store().device().block_size());
        let mut report = WriteReport { tokens: rows, ..Default::default() };
        let mut txn = self.store().begin()?;
        match session.reuse() {
            Some(r) => {
                // The link goes by name: the context must be the one the session read, not
                // another imported under its name since (the writer lock holds it now).
                let now = self.store().snapshot().context(&r.name).map(|c| c.record().id);
                if now.is_ok_and(|id| id != r.context) {
                    return input(format!(
                        "context {:?}, whose prefix the session reused, was replaced since the session opened: \
                         the stored context would link to the new one",
                        r.name
                    ));
                }
                txn.create_child_context(name, &r.name, r.prefix as u64, session.new_tokens())?
            }
            None => txn.create_context(name, shape, session.new_tokens())?,
        }
        for layer in 0..shape.layers as usize {
            let fresh = session.fresh_layer(layer);
            for head in 0..shape.kv_heads as usize {
                let h = Head {
                    layer,
                    head,
                    dim: d,
                    payload,
                    keys: &fresh.keys[head],
                    values: &fresh.values[head],
                    train: fresh.queries[head].clone(),
                    pq: self.config().pq.params(d),
                };
                write_head(&mut txn, name, shape.dtype, h, &params, &mut report)?;
            }
        }
        txn.commit()?;
        self.inner.remember(name)?;
        report.seconds = started.elapsed().as_secs_f64();
        Ok(report)
    }
}
