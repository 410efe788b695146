//! Where an import reads a context's KV cache from: the [`KvSource`] trait, and its
//! safetensors implementation (DESIGN.md "Data exchange"): `layers.{l}.k` and `layers.{l}.v`
//! of shape [kv_heads, tokens, head_dim], optionally `layers.{l}.q` [q_heads, n, head_dim]
//! (prefill queries that train the index) and `tokens` (`[tokens]`); f32, f16 or bf16.
//!
//! Only the header is parsed up front; tensor data is read with positioned reads, one (layer,
//! kv head) at a time, so an import's memory is bounded by one head's keys and values, not by
//! the file (a memory map would leave the whole file resident in the importer).

use crate::error::{input, Error, Result};
use ctxfs_vfs::{DType, ModelShape};
use half::{bf16, f16};
use safetensors::tensor::Metadata;
use safetensors::{Dtype, SafeTensors};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Opens an input file for reading; anything but a regular file is refused, and a pipe is
/// refused at once rather than waited on for a writer.
pub fn open_regular_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"));
    }
    Ok(file)
}

/// Largest header accepted (safetensors' own limit).
const MAX_HEADER: u64 = 100_000_000;

/// The largest magnitude of a key, value or query element attention takes, 2^48. Its sums
/// are f32: within it no product of a query and a key (head dim at most 4,096) and no sum of
/// values (fewer than 2^31 tokens) overflows. bf16 holds larger ones, f16 none.
pub const MAX_MAGNITUDE: f32 = 281_474_976_710_656.0;

/// The largest magnitude a context stored as `dtype` holds: the type's largest value (beyond
/// it an element would be stored as infinity), at most [`MAX_MAGNITUDE`].
fn largest_storable(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => f16::MAX.to_f32(),
        DType::Bf16 => bf16::MAX.to_f32(),
    }
    .min(MAX_MAGNITUDE)
}

/// The first element of `x` that a context stored as `dtype` cannot hold (not finite, or
/// beyond the largest magnitude the type holds, at most [`MAX_MAGNITUDE`]), and why, as
/// "= value is …".
pub fn first_unstorable(x: &[f32], dtype: DType) -> Option<(usize, String)> {
    first_beyond(x, largest_storable(dtype), beyond(dtype))
}

/// The first element of a query that attention cannot take (not finite, or beyond
/// [`MAX_MAGNITUDE`]), and why, as [`first_unstorable`] says it.
pub(crate) fn first_unattendable(q: &[f32]) -> Option<(usize, String)> {
    first_beyond(q, MAX_MAGNITUDE, BEYOND_ATTENTION)
}

fn first_beyond(x: &[f32], max: f32, why_beyond: &str) -> Option<(usize, String)> {
    let i = x.iter().position(|x| !x.is_finite() || x.abs() > max)?;
    let why = if x[i].is_finite() { why_beyond } else { "is not finite" };
    Some((i, format!("= {} {why}", shown(x[i]))))
}

/// An element as an error message shows it: in exponent form when large.
fn shown(x: f32) -> String {
    if x.abs() >= 1e7 {
        format!("{x:e}")
    } else {
        x.to_string()
    }
}

/// A context's KV cache, one (layer, kv head) at a time.
pub trait KvSource: Sync {
    /// The model shape; `dtype` is how the context is stored.
    fn shape(&self) -> ModelShape;
    fn token_count(&self) -> usize;
    /// The token ids (for prefix reuse).
    fn token_ids(&self) -> Result<Vec<u32>>;
    /// Keys of one head, row after row.
    fn keys(&self, layer: usize, head: usize) -> Result<Vec<f32>>;
    /// Values of one head, row after row.
    fn values(&self, layer: usize, head: usize) -> Result<Vec<f32>>;
    /// Prefill queries of every q head of the kv head's GQA group, row after row; empty when
    /// the source has none (the keys then train the graph).
    fn train_queries(&self, layer: usize, kv_head: usize) -> Result<Vec<f32>>;
}

/// A safetensors context file, its header parsed and shapes checked on open.
pub struct SafetensorsKv {
    file: std::fs::File,
    path: std::path::PathBuf,
    meta: Metadata,
    /// File offset of the data section.
    data_start: u64,
    shape: ModelShape,
    tokens: usize,
    /// Prefill queries per layer (0 when the layer has none).
    queries: Vec<usize>,
}

/// Bytes read per call while checking values.
const CHECK_CHUNK: usize = 8 << 20;

impl SafetensorsKv {
    /// Opens and checks a context file: header, tensor names, shapes and dtypes agree. Values
    /// are checked by [`SafetensorsKv::check_values`].
    pub fn open(path: &Path, dtype: DType) -> Result<SafetensorsKv> {
        Self::open_with_q_heads(path, dtype, None)
    }

    /// [`SafetensorsKv::open`] for a model of `q_heads` query heads, which a file without
    /// prefill queries cannot say (it is then one per kv head); a file with them must agree.
    pub fn open_with_q_heads(path: &Path, dtype: DType, q_heads: Option<usize>) -> Result<SafetensorsKv> {
        let bad = |why: String| Error::Input(format!("{} is not a safetensors file: {why}", path.display()));
        let file = open_regular_file(path).map_err(|e| Error::Input(format!("cannot open {}: {e}", path.display())))?;
        let len = file.metadata().map_err(|e| bad(e.to_string()))?.len();
        let mut head = [0u8; 8];
        file.read_exact_at(&mut head, 0).map_err(|_| bad("shorter than its 8-byte header length".into()))?;
        let n = u64::from_le_bytes(head);
        if n > MAX_HEADER || 8 + n > len {
            return Err(bad(format!("header length {n} does not fit the file's {len} bytes")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8).map_err(|e| bad(e.to_string()))?;
        let meta: Metadata = serde_json::from_slice(&header).map_err(|e| bad(e.to_string()))?;
        let data_len = len - 8 - n;
        // The header is parsed without safetensors' own checks (they need the whole file in
        // memory): every tensor must lie within the data and hold exactly what its shape and
        // dtype say, so that no read or allocation below trusts a size the data does not back.
        for (name, info) in meta.tensors() {
            let (from, to) = info.data_offsets;
            if from > to || to as u64 > data_len {
                return Err(bad(format!(
                    "tensor {name} has data offsets {from}..{to} outside the file's {data_len} data bytes"
                )));
            }
            let bytes = info.shape.iter().try_fold(info.dtype.size(), |n, &s| n.checked_mul(s));
            if bytes != Some(to - from) {
                return Err(bad(format!(
                    "tensor {name} of shape {:?} and dtype {:?} holds {} bytes",
                    info.shape,
                    info.dtype,
                    to - from
                )));
            }
        }
        let mut kv = SafetensorsKv {
            file,
            path: path.to_path_buf(),
            meta,
            data_start: 8 + n,
            shape: ModelShape { layers: 1, q_heads: 1, kv_heads: 1, head_dim: 1, dtype },
            tokens: 0,
            queries: Vec::new(),
        };
        let layers = (0..).take_while(|l| kv.meta.info(&format!("layers.{l}.k")).is_some()).count();
        if layers == 0 {
            return input(format!("{} has no layers.0.k tensor", path.display()));
        }
        // Layers are numbered from 0 without gaps: one beyond the run is not silently dropped.
        let beyond = kv.meta.tensors().keys().filter_map(|name| layer_of(name)).filter(|&l| l >= layers).min();
        if let Some(l) = beyond {
            return input(format!(
                "{} has tensors of layer {l} but no layers.{layers}.k: layers must be numbered 0.. without gaps",
                path.display()
            ));
        }
        let k0 = kv.shape_of("layers.0.k", &[None, None, None])?;
        let (heads, n, d) = (k0[0], k0[1], k0[2]);
        // The q heads: as the first layer with prefill queries has them, as the caller says,
        // or (neither) one per kv head.
        let in_file = (0..layers).find_map(|l| {
            let t = kv.meta.info(&format!("layers.{l}.q"))?;
            Some((l, t.shape.first().copied().unwrap_or(0)))
        });
        let q_heads = match (q_heads, in_file) {
            (Some(said), Some((l, found))) if said != found => {
                return input(format!("{}: {said} q heads were given, but layers.{l}.q holds {found}", path.display()));
            }
            (Some(said), _) => said,
            (None, Some((_, found))) => found,
            (None, None) => heads,
        };
        if n == 0 || n > u32::MAX as usize / 2 {
            return input(format!("{}: {n} tokens (expected 1..2^31)", path.display()));
        }
        let narrow = |x: usize, what: &str| {
            u16::try_from(x).map_err(|_| Error::Input(format!("{}: {x} {what} is too many", path.display())))
        };
        let shape = ModelShape {
            layers: narrow(layers, "layers")?,
            q_heads: narrow(q_heads, "q heads")?,
            kv_heads: narrow(heads, "kv heads")?,
            head_dim: narrow(d, "head dim")?,
            dtype,
        };
        shape.validate().map_err(|e| Error::Input(format!("{}: {e}", path.display())))?;
        for l in 0..layers {
            for part in ["k", "v"] {
                let name = format!("layers.{l}.{part}");
                kv.shape_of(&name, &[Some(heads), Some(n), Some(d)])?;
                element_size(&name, kv.meta.info(&name).expect("checked").dtype)?;
            }
            let qname = format!("layers.{l}.q");
            kv.queries.push(match kv.meta.info(&qname) {
                Some(t) => {
                    element_size(&qname, t.dtype)?;
                    kv.shape_of(&qname, &[Some(q_heads), None, Some(d)])?[1]
                }
                None => 0,
            });
        }
        if kv.meta.info("tokens").is_some() {
            kv.shape_of("tokens", &[Some(n)])?;
        }
        kv.shape = shape;
        kv.tokens = n;
        Ok(kv)
    }

    /// A tensor's shape, checked against what is expected (`None` matches any size).
    fn shape_of(&self, name: &str, expect: &[Option<usize>]) -> Result<Vec<usize>> {
        let t = self.meta.info(name).ok_or_else(|| Error::Input(format!("missing tensor {name}")))?;
        let fits = t.shape.len() == expect.len() && t.shape.iter().zip(expect).all(|(s, e)| e.is_none_or(|e| e == *s));
        if !fits {
            let dims: Vec<String> = expect.iter().map(|e| e.map_or("_".into(), |v| v.to_string())).collect();
            return input(format!("tensor {name} has shape {:?}, expected [{}]", t.shape, dims.join(", ")));
        }
        Ok(t.shape.clone())
    }

    /// Bytes `[from, from + len)` of a tensor's data.
    fn read(&self, name: &str, from: usize, len: usize) -> Result<Vec<u8>> {
        let t = self.meta.info(name).ok_or_else(|| Error::Input(format!("missing tensor {name}")))?;
        if from + len > t.data_offsets.1 - t.data_offsets.0 {
            return input(format!("tensor {name} is shorter than its shape says"));
        }
        let mut buf = vec![0u8; len];
        self.file
            .read_exact_at(&mut buf, self.data_start + (t.data_offsets.0 + from) as u64)
            .map_err(|e| Error::Input(format!("cannot read tensor {name} of {}: {e}", self.path.display())))?;
        Ok(buf)
    }

    /// Checks every key, value and query is finite and fits the stored dtype, reporting the
    /// first offender by tensor and element. One sequential pass over the file, run before an
    /// import writes anything; `progress` is told the bytes checked.
    pub fn check_values(&self, mut progress: impl FnMut(u64)) -> Result<()> {
        for l in 0..self.shape.layers as usize {
            for part in ["k", "v", "q"] {
                let name = format!("layers.{l}.{part}");
                let Some(t) = self.meta.info(&name) else { continue };
                let size = element_size(&name, t.dtype)?;
                let total = t.data_offsets.1 - t.data_offsets.0;
                let chunk = CHECK_CHUNK / size * size;
                let mut at = 0;
                while at < total {
                    let len = chunk.min(total - at);
                    check_finite(&name, t.dtype, &self.read(&name, at, len)?, at / size, self.shape.dtype)?;
                    progress(len as u64);
                    at += len;
                }
            }
        }
        Ok(())
    }

    /// Bytes [`SafetensorsKv::check_values`] reads.
    pub fn tensor_bytes(&self) -> u64 {
        self.meta
            .tensors()
            .iter()
            .filter(|(n, _)| n.starts_with("layers.") && [".k", ".v", ".q"].iter().any(|p| n.ends_with(p)))
            .map(|(_, t)| (t.data_offsets.1 - t.data_offsets.0) as u64)
            .sum()
    }

    /// The file's `__metadata__` (string pairs), if it has one.
    pub fn metadata(&self) -> Option<&std::collections::HashMap<String, String>> {
        self.meta.metadata().as_ref()
    }

    /// Decode queries of every q head of a kv head's GQA group, from `layers.{layer}.decode_q`
    /// (`[q_heads, steps, head_dim]`, written by `python -m ctxfs.capture`): one `steps ×
    /// head_dim` block per q head. None when the file has none; an import ignores them.
    pub fn decode_queries(&self, layer: usize, kv_head: usize) -> Result<Option<Vec<Vec<f32>>>> {
        let name = format!("layers.{layer}.decode_q");
        if self.meta.info(&name).is_none() {
            return Ok(None);
        }
        let (qh, d) = (self.shape.q_heads as usize, self.shape.head_dim as usize);
        let steps = self.shape_of(&name, &[Some(qh), None, Some(d)])?[1];
        let group = qh / self.shape.kv_heads as usize;
        let heads = (kv_head * group..(kv_head + 1) * group).map(|h| self.head(&name, h, steps));
        Ok(Some(heads.collect::<Result<_>>()?))
    }

    /// Rows `head * rows .. (head + 1) * rows` of a `[heads, rows, head_dim]` tensor, as f32.
    fn head(&self, name: &str, head: usize, rows: usize) -> Result<Vec<f32>> {
        let d = self.shape.head_dim as usize;
        let t = self.meta.info(name).ok_or_else(|| Error::Input(format!("missing tensor {name}")))?;
        let size = element_size(name, t.dtype)?;
        let bytes = self.read(name, head * rows * d * size, rows * d * size)?;
        decode(name, t.dtype, &bytes, head * rows * d)
    }
}

impl KvSource for SafetensorsKv {
    fn shape(&self) -> ModelShape {
        self.shape
    }
    fn token_count(&self) -> usize {
        self.tokens
    }
    fn token_ids(&self) -> Result<Vec<u32>> {
        let Some(t) = self.meta.info("tokens") else {
            return Ok((0..self.tokens as u32).collect());
        };
        let data = self.read("tokens", 0, t.data_offsets.1 - t.data_offsets.0)?;
        let ids: Vec<i64> = match t.dtype {
            Dtype::I64 => data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes"))).collect(),
            Dtype::I32 => {
                data.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4 bytes")) as i64).collect()
            }
            Dtype::U32 => {
                data.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")) as i64).collect()
            }
            other => return input(format!("tensor tokens has dtype {other:?}; expected I64, I32 or U32")),
        };
        ids.into_iter()
            .enumerate()
            .map(|(i, t)| u32::try_from(t).map_err(|_| Error::Input(format!("token {i} has id {t}, outside 0..2^32"))))
            .collect()
    }
    fn keys(&self, layer: usize, head: usize) -> Result<Vec<f32>> {
        self.head(&format!("layers.{layer}.k"), head, self.tokens)
    }
    fn values(&self, layer: usize, head: usize) -> Result<Vec<f32>> {
        self.head(&format!("layers.{layer}.v"), head, self.tokens)
    }
    fn train_queries(&self, layer: usize, kv_head: usize) -> Result<Vec<f32>> {
        let m = self.queries[layer];
        if m == 0 {
            return Ok(Vec::new());
        }
        let group = (self.shape.q_heads / self.shape.kv_heads) as usize;
        self.head(&format!("layers.{layer}.q"), kv_head, group * m)
    }
}

/// Elements `range` of a tensor of an in-memory safetensors file (a query file) as f32.
pub fn f32s(st: &SafeTensors<'_>, name: &str, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
    let t = st.tensor(name).map_err(|_| Error::Input(format!("missing tensor {name}")))?;
    let size = element_size(name, t.dtype())?;
    let data = t.data();
    if range.start > range.end || range.end.checked_mul(size).is_none_or(|end| end > data.len()) {
        return input(format!("tensor {name} is shorter than its shape says"));
    }
    decode(name, t.dtype(), &data[range.start * size..range.end * size], range.start)
}

/// Elements of `dtype` as f32, refusing non-finite ones (`first`: the index of the first, for
/// the message).
fn decode(name: &str, dtype: Dtype, bytes: &[u8], first: usize) -> Result<Vec<f32>> {
    let out: Vec<f32> = match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return input(format!("tensor {name} has dtype {other:?}; expected F32, F16 or BF16")),
    };
    if let Some(i) = out.iter().position(|x| !x.is_finite()) {
        return input(format!("tensor {name} element {} = {} is not finite", first + i, out[i]));
    }
    Ok(out)
}

/// The layer of a `layers.{l}.k`, `.v` or `.q` tensor's name.
fn layer_of(name: &str) -> Option<usize> {
    let (layer, part) = name.strip_prefix("layers.")?.split_once('.')?;
    ["k", "v", "q"].contains(&part).then(|| layer.parse().ok()).flatten()
}

fn element_size(name: &str, dtype: Dtype) -> Result<usize> {
    match dtype {
        Dtype::F32 => Ok(4),
        Dtype::F16 | Dtype::BF16 => Ok(2),
        other => input(format!("tensor {name} has dtype {other:?}; expected F32, F16 or BF16")),
    }
}

/// Why an element beyond [`MAX_MAGNITUDE`] is refused.
const BEYOND_ATTENTION: &str = "is beyond 2^48 in magnitude, the most attention takes (its sums are f32)";

/// Why an element beyond [`largest_storable`] is refused.
fn beyond(stored: DType) -> &'static str {
    match stored {
        DType::F16 => "is out of the f16 range (import it as bf16: --dtype bf16, dtype=\"bf16\" in Python)",
        DType::Bf16 => BEYOND_ATTENTION,
    }
}

/// Finds the first non-finite element, or one the stored dtype cannot hold, by its bits.
fn check_finite(name: &str, dtype: Dtype, data: &[u8], first: usize, stored: DType) -> Result<()> {
    let bad = |i: usize, v: f32, why: &str| input(format!("tensor {name} element {} = {} {why}", first + i, shown(v)));
    match dtype {
        Dtype::F16 => {
            for (i, c) in data.chunks_exact(2).enumerate() {
                let v = f16::from_le_bytes([c[0], c[1]]);
                if !v.is_finite() {
                    return bad(i, v.to_f32(), "is not finite");
                }
            }
        }
        Dtype::BF16 => {
            for (i, c) in data.chunks_exact(2).enumerate() {
                let v = bf16::from_le_bytes([c[0], c[1]]);
                if !v.is_finite() {
                    return bad(i, v.to_f32(), "is not finite");
                }
                if v.to_f32().abs() > largest_storable(stored) {
                    return bad(i, v.to_f32(), beyond(stored));
                }
            }
        }
        Dtype::F32 => {
            for (i, c) in data.chunks_exact(4).enumerate() {
                let v = f32::from_le_bytes(c.try_into().expect("4 bytes"));
                if !v.is_finite() {
                    return bad(i, v, "is not finite");
                }
                if v.abs() > largest_storable(stored) {
                    return bad(i, v, beyond(stored));
                }
            }
        }
        other => return input(format!("tensor {name} has dtype {other:?}; expected F32, F16 or BF16")),
    }
    Ok(())
}
