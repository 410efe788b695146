//! Where an import reads a context's KV cache from: the [`KvSource`] trait, and its
//! safetensors implementation (DESIGN.md "Data exchange"): `layers.{l}.k` and `layers.{l}.v`
//! of shape [kv_heads, tokens, head_dim], optionally `layers.{l}.q` [q_heads, n, head_dim]
//! (prefill queries that train the index) and `tokens` [tokens]; f32, f16 or bf16.
//!
//! The file is memory-mapped and read one (layer, kv head) at a time, so an import's memory
//! is bounded by one head's keys and values, not by the file.

use crate::error::{input, Error, Result};
use ctxfs_vfs::{DType, ModelShape};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

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

/// A memory-mapped safetensors context file, its shapes checked on open.
pub struct SafetensorsKv {
    map: memmap2::Mmap,
    shape: ModelShape,
    tokens: usize,
    /// Prefill queries per layer (0 when the layer has none).
    queries: Vec<usize>,
}

impl SafetensorsKv {
    /// Opens and checks a context file: tensor names, shapes and dtypes agree. Values are
    /// checked by [`SafetensorsKv::check_values`].
    pub fn open(path: &Path, dtype: DType) -> Result<SafetensorsKv> {
        let file =
            std::fs::File::open(path).map_err(|e| Error::Input(format!("cannot open {}: {e}", path.display())))?;
        // SAFETY: the file is mapped read-only and not modified while mapped; a concurrent
        // truncation by another process would fault the read, the usual caveat of mapped input.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .map_err(|e| Error::Input(format!("cannot map {}: {e}", path.display())))?;
        let st = parse(&map, path)?;
        let layers = (0..).take_while(|l| st.tensor(&format!("layers.{l}.k")).is_ok()).count();
        if layers == 0 {
            return input(format!("{} has no layers.0.k tensor", path.display()));
        }
        let k0 = shape_of(&st, "layers.0.k", &[None, None, None])?;
        let (kv, n, d) = (k0[0], k0[1], k0[2]);
        let q_heads = st.tensor("layers.0.q").map_or(kv, |t| t.shape().first().copied().unwrap_or(0));
        if n == 0 || n > u32::MAX as usize / 2 {
            return input(format!("{}: {n} tokens (expected 1..2^31)", path.display()));
        }
        let narrow = |x: usize, what: &str| {
            u16::try_from(x).map_err(|_| Error::Input(format!("{}: {x} {what} is too many", path.display())))
        };
        let shape = ModelShape {
            layers: narrow(layers, "layers")?,
            q_heads: narrow(q_heads, "q heads")?,
            kv_heads: narrow(kv, "kv heads")?,
            head_dim: narrow(d, "head dim")?,
            dtype,
        };
        shape.validate().map_err(|e| Error::Input(format!("{}: {e}", path.display())))?;
        let mut queries = Vec::with_capacity(layers);
        for l in 0..layers {
            shape_of(&st, &format!("layers.{l}.k"), &[Some(kv), Some(n), Some(d)])?;
            shape_of(&st, &format!("layers.{l}.v"), &[Some(kv), Some(n), Some(d)])?;
            let qname = format!("layers.{l}.q");
            queries.push(match st.tensor(&qname) {
                Ok(_) => shape_of(&st, &qname, &[Some(q_heads), None, Some(d)])?[1],
                Err(_) => 0,
            });
        }
        if st.tensor("tokens").is_ok() {
            shape_of(&st, "tokens", &[Some(n)])?;
        }
        drop(st);
        Ok(SafetensorsKv { map, shape, tokens: n, queries })
    }

    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.map).expect("parsed on open")
    }

    /// Checks every key, value and query is finite and fits the stored dtype, reporting the
    /// first offender by tensor and element. One sequential pass over the file, run before an
    /// import writes anything.
    pub fn check_values(&self, mut progress: impl FnMut(u64)) -> Result<()> {
        let st = self.st();
        for l in 0..self.shape.layers as usize {
            for part in ["k", "v", "q"] {
                let name = format!("layers.{l}.{part}");
                if let Ok(t) = st.tensor(&name) {
                    check_finite(&name, t.dtype(), t.data(), self.shape.dtype)?;
                    progress(t.data().len() as u64);
                }
            }
        }
        Ok(())
    }

    /// Bytes [`SafetensorsKv::check_values`] reads.
    pub fn tensor_bytes(&self) -> u64 {
        let st = self.st();
        st.tensors().iter().filter(|(n, _)| n.starts_with("layers.")).map(|(_, t)| t.data().len() as u64).sum()
    }

    fn head(&self, name: &str, head: usize, rows: usize) -> Result<Vec<f32>> {
        let d = self.shape.head_dim as usize;
        f32s(&self.st(), name, head * rows * d..(head + 1) * rows * d)
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
        let st = self.st();
        let Ok(t) = st.tensor("tokens") else {
            return Ok((0..self.tokens as u32).collect());
        };
        let data = t.data();
        let ids: Vec<i64> = match t.dtype() {
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
        let d = self.shape.head_dim as usize;
        let name = format!("layers.{layer}.q");
        f32s(&self.st(), &name, kv_head * group * m * d..(kv_head + 1) * group * m * d)
    }
}

fn parse<'a>(bytes: &'a [u8], path: &Path) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes)
        .map_err(|e| Error::Input(format!("{} is not a safetensors file: {e}", path.display())))
}

/// A tensor's shape, checked against what is expected (`None` matches any size).
fn shape_of(st: &SafeTensors<'_>, name: &str, expect: &[Option<usize>]) -> Result<Vec<usize>> {
    let t = st.tensor(name).map_err(|_| Error::Input(format!("missing tensor {name}")))?;
    let shape = t.shape().to_vec();
    let fits = shape.len() == expect.len() && shape.iter().zip(expect).all(|(s, e)| e.is_none_or(|e| e == *s));
    if !fits {
        let dims: Vec<String> = expect.iter().map(|e| e.map_or("_".into(), |v| v.to_string())).collect();
        return input(format!("tensor {name} has shape {shape:?}, expected [{}]", dims.join(", ")));
    }
    Ok(shape)
}

/// Elements `range` of a tensor as f32.
pub fn f32s(st: &SafeTensors<'_>, name: &str, range: std::ops::Range<usize>) -> Result<Vec<f32>> {
    let t = st.tensor(name).map_err(|_| Error::Input(format!("missing tensor {name}")))?;
    let size = element_size(name, t.dtype())?;
    let data = t.data();
    if range.end * size > data.len() {
        return input(format!("tensor {name} is shorter than its shape says"));
    }
    let bytes = &data[range.start * size..range.end * size];
    let out: Vec<f32> = match t.dtype() {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        _ => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
    };
    if let Some(i) = out.iter().position(|x| !x.is_finite()) {
        return input(format!("tensor {name} holds a non-finite value ({}) at element {}", out[i], range.start + i));
    }
    Ok(out)
}

fn element_size(name: &str, dtype: Dtype) -> Result<usize> {
    match dtype {
        Dtype::F32 => Ok(4),
        Dtype::F16 | Dtype::BF16 => Ok(2),
        other => input(format!("tensor {name} has dtype {other:?}; expected F32, F16 or BF16")),
    }
}

/// Finds the first non-finite element, or one the stored dtype cannot hold, by its bits.
fn check_finite(name: &str, dtype: Dtype, data: &[u8], stored: DType) -> Result<()> {
    let bad = |i: usize, v: f32, why: &str| input(format!("tensor {name} element {i} = {v} {why}"));
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
                if stored == DType::F16 && v.to_f32().abs() > f16::MAX.to_f32() {
                    return bad(i, v.to_f32(), "is out of the f16 range (import with --dtype bf16)");
                }
            }
        }
        Dtype::F32 => {
            let limit = match stored {
                DType::F16 => f16::MAX.to_f32(),
                DType::Bf16 => bf16::MAX.to_f32(),
            };
            for (i, c) in data.chunks_exact(4).enumerate() {
                let v = f32::from_le_bytes(c.try_into().expect("4 bytes"));
                if !v.is_finite() {
                    return bad(i, v, "is not finite");
                }
                if v.abs() > limit {
                    return bad(i, v, &format!("is out of the {} range", stored.name()));
                }
            }
        }
        other => return input(format!("tensor {name} has dtype {other:?}; expected F32, F16 or BF16")),
    }
    Ok(())
}
