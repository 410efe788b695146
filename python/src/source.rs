//! An import's KV source over a Python callable that returns one layer at a time: the
//! import asks for (layer, kv head) in order, so one layer is held at once, and the GIL is
//! taken only to fetch the next layer.

use ctxfs_attention::kv::first_unstorable;
use ctxfs_attention::{Error, KvSource, Result};
use ctxfs_vfs::ModelShape;
use numpy::{PyReadonlyArrayDyn, PyUntypedArrayMethods};
use pyo3::prelude::*;
use std::sync::Mutex;

/// One layer's tensors, each as row-major f32.
struct Layer {
    index: usize,
    keys: Vec<f32>,
    values: Vec<f32>,
    /// `[q_heads, rows, head_dim]`, or empty.
    queries: Vec<f32>,
}

pub struct PyLayers {
    shape: ModelShape,
    tokens: Vec<u32>,
    next_layer: Py<PyAny>,
    current: Mutex<Option<Layer>>,
    /// The Python exception a call raised, re-raised as itself once the import stops.
    raised: Mutex<Option<PyErr>>,
}

impl PyLayers {
    pub fn new(shape: ModelShape, tokens: Vec<u32>, next_layer: Py<PyAny>) -> PyLayers {
        PyLayers { shape, tokens, next_layer, current: Mutex::default(), raised: Mutex::default() }
    }

    /// The exception `next_layer` raised, if the import stopped on one.
    pub fn take_raised(&self) -> Option<PyErr> {
        self.raised.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Keeps `e`, which a Python callback of the import raised, to raise again once the
    /// import stops, and returns the error that stops it.
    pub fn raised(&self, e: PyErr) -> Error {
        let msg = e.to_string();
        *self.raised.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
        Error::Input(msg)
    }

    /// Runs `f` on layer `layer`, fetching it from Python first when it is not the one held.
    fn with_layer<T>(&self, layer: usize, f: impl FnOnce(&Layer) -> T) -> Result<T> {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_none_or(|l| l.index != layer) {
            *current = None; // the previous layer goes before the next arrives
            *current = Some(self.fetch(layer)?);
        }
        Ok(f(current.as_ref().expect("fetched above")))
    }

    fn fetch(&self, layer: usize) -> Result<Layer> {
        let s = self.shape;
        let (kv, qh, d, n) = (s.kv_heads as usize, s.q_heads as usize, s.head_dim as usize, self.tokens.len());
        Python::attach(|py| {
            let got = self.next_layer.call1(py, (layer,)).and_then(|t| {
                let (k, v, q): (PyReadonlyArrayDyn<f32>, PyReadonlyArrayDyn<f32>, Option<PyReadonlyArrayDyn<f32>>) =
                    t.extract(py)?;
                Ok((
                    k.as_array().iter().copied().collect::<Vec<f32>>(),
                    v.as_array().iter().copied().collect::<Vec<f32>>(),
                    q.map(|q| (q.shape().to_vec(), q.as_array().iter().copied().collect::<Vec<f32>>())),
                ))
            });
            let (keys, values, q) = match got {
                Ok(t) => t,
                Err(e) => return Err(self.raised(e)),
            };
            for (name, x) in [("k", &keys), ("v", &values)] {
                if x.len() != kv * n * d {
                    return Err(Error::Input(format!(
                        "layer {layer}: {name} has {} elements, expected kv_heads ({kv}) × tokens ({n}) × head_dim ({d})",
                        x.len()
                    )));
                }
            }
            let queries = match q {
                None => Vec::new(),
                Some((shape, q)) => {
                    if shape.len() != 3 || shape[0] != qh || shape[2] != d {
                        return Err(Error::Input(format!(
                            "layer {layer}: q has shape {shape:?}, expected [q_heads ({qh}), rows, head_dim ({d})]"
                        )));
                    }
                    q
                }
            };
            for (name, x, heads) in [("k", &keys, kv), ("v", &values, kv), ("q", &queries, qh)] {
                if let Some((i, why)) = first_unstorable(x, s.dtype) {
                    // [head, row, dim] of the flat index, as the caller's array is shaped.
                    let rows = x.len() / (heads * d);
                    let (head, row, dim) = (i / (rows * d), i / d % rows, i % d);
                    return Err(Error::Input(format!("layer {layer}: {name}[{head}, {row}, {dim}] {why}")));
                }
            }
            Ok(Layer { index: layer, keys, values, queries })
        })
    }
}

impl KvSource for PyLayers {
    fn shape(&self) -> ModelShape {
        self.shape
    }

    fn token_count(&self) -> usize {
        self.tokens.len()
    }

    fn token_ids(&self) -> Result<Vec<u32>> {
        Ok(self.tokens.clone())
    }

    fn keys(&self, layer: usize, head: usize) -> Result<Vec<f32>> {
        let span = self.tokens.len() * self.shape.head_dim as usize;
        self.with_layer(layer, |l| l.keys[head * span..(head + 1) * span].to_vec())
    }

    fn values(&self, layer: usize, head: usize) -> Result<Vec<f32>> {
        let span = self.tokens.len() * self.shape.head_dim as usize;
        self.with_layer(layer, |l| l.values[head * span..(head + 1) * span].to_vec())
    }

    fn train_queries(&self, layer: usize, kv_head: usize) -> Result<Vec<f32>> {
        let group = (self.shape.q_heads / self.shape.kv_heads) as usize;
        self.with_layer(layer, |l| {
            let span = l.queries.len() / self.shape.q_heads as usize;
            l.queries.get(kv_head * group * span..(kv_head + 1) * group * span).unwrap_or_default().to_vec()
        })
    }
}
