//! `ctxfs._native`: the Python package's binding of [`ctxfs_attention`]. Arrays cross as
//! contiguous f32 numpy arrays (the Python layer converts other dtypes and torch tensors);
//! every call that does I/O, imports or searches releases the GIL.

// The methods take Python's keyword arguments one by one, as Python callers see them.
#![allow(clippy::too_many_arguments)]

mod errors;
mod source;

use ctxfs_attention::{describe, AttentionOptions, Db, DbConfig, Plan, Request, Window};
use ctxfs_vfs::{DType, DeviceChoice, ModelShape};
use errors::{to_py, Failure};
use numpy::{IntoPyArray, PyArray2, PyArrayMethods, PyReadonlyArrayDyn};
use pyo3::prelude::*;
use std::path::PathBuf;

fn device_choice(device: &str) -> PyResult<DeviceChoice> {
    device.parse::<DeviceChoice>().map_err(|e| errors::InputError::new_err(format!("device {device:?}: {e}")))
}

fn dtype_of(name: &str) -> PyResult<DType> {
    match name {
        "f16" | "float16" => Ok(DType::F16),
        "bf16" | "bfloat16" => Ok(DType::Bf16),
        _ => Err(errors::InputError::new_err(format!("dtype {name:?}: a context is stored as f16 or bf16"))),
    }
}

/// A contiguous f32 array's elements, borrowed (the Python layer makes arrays contiguous).
fn slice<'a>(name: &str, a: &'a PyReadonlyArrayDyn<'_, f32>) -> PyResult<&'a [f32]> {
    a.as_slice().map_err(|_| errors::InputError::new_err(format!("{name} must be a C-contiguous float32 array")))
}

fn json_to_py(py: Python<'_>, v: &serde_json::Value) -> PyResult<Py<PyAny>> {
    let json = py.import("json")?;
    Ok(json.call_method1("loads", (v.to_string(),))?.unbind())
}

/// A mounted store: its DB, buffer pool and prefix trie.
#[pyclass(module = "ctxfs._native", frozen)]
struct Store {
    db: Db,
    path: PathBuf,
}

#[pymethods]
impl Store {
    /// Formats `path` (a file, created and sized when new) and opens it for writing.
    #[staticmethod]
    #[pyo3(signature = (path, size=None, block_size=4096, force=false, pool=256 << 20, device="auto", window=(128, 512), resident_budget=None))]
    fn create(
        py: Python<'_>,
        path: PathBuf,
        size: Option<u64>,
        block_size: usize,
        force: bool,
        pool: u64,
        device: &str,
        window: (u32, u32),
        resident_budget: Option<f64>,
    ) -> PyResult<Store> {
        let choice = device_choice(device)?;
        let config = config(pool, window, resident_budget);
        let db = py
            .detach(|| -> Result<Db, Failure> {
                config.check(block_size)?;
                let store = ctxfs_vfs::mkfs::format_path(&path, size, block_size, force, choice)?;
                Ok(Db::with_store(store, config)?)
            })
            .map_err(to_py)?;
        Ok(Store { db, path })
    }

    /// Opens a store: for writing (one writer per store), or read-only beside a writer.
    #[staticmethod]
    #[pyo3(signature = (path, pool=256 << 20, device="auto", read_only=false, window=(128, 512), resident_budget=None))]
    fn open(
        py: Python<'_>,
        path: PathBuf,
        pool: u64,
        device: &str,
        read_only: bool,
        window: (u32, u32),
        resident_budget: Option<f64>,
    ) -> PyResult<Store> {
        let choice = device_choice(device)?;
        let config = config(pool, window, resident_budget);
        let db = py
            .detach(|| match read_only {
                true => Db::open_read_only(&path, choice, config),
                false => Db::open(&path, choice, config),
            })
            .map_err(|e| to_py(e.into()))?;
        Ok(Store { db, path })
    }

    #[getter]
    fn path(&self) -> PathBuf {
        self.path.clone()
    }

    /// `ctxfs inspect --json`'s summary, as a dict.
    fn inspect(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let mut v = py.detach(|| describe::store_json(self.db.store()));
        v["store"] = serde_json::json!(self.path);
        json_to_py(py, &v)
    }

    /// Checks every block of the committed state; `ctxfs fsck --json`'s report as a dict.
    fn fsck(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let report = py
            .detach(|| {
                let mut report = ctxfs_vfs::fsck::check(self.db.store().device().as_ref())?;
                self.db.check_indexes(&mut report);
                Ok::<_, ctxfs_vfs::Error>(report)
            })
            .map_err(|e| to_py(e.into()))?;
        json_to_py(py, &describe::fsck_json(&report))
    }

    fn delete(&self, py: Python<'_>, name: &str) -> PyResult<()> {
        py.detach(|| self.db.delete(name)).map_err(|e| to_py(e.into()))
    }

    /// Reads a context's index into the pool and holds it resident (what a server does
    /// once per context before serving it).
    fn warm(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        let r = py.detach(|| self.db.warm(name)).map_err(|e| to_py(e.into()))?;
        json_to_py(
            py,
            &serde_json::json!({"blocks": r.blocks, "read": r.read, "held": r.held,
                "resident_bytes": r.resident_bytes, "kv_bytes": r.kv_bytes, "resident_over_kv": r.resident_over_kv(),
                "compact": r.compact, "residual_streamed": r.residual_streamed}),
        )
    }

    /// What serving a context holds resident, part by part, against its KV bytes.
    fn footprint(&self, py: Python<'_>, name: &str) -> PyResult<Py<PyAny>> {
        let f = py.detach(|| self.db.footprint(name)).map_err(|e| to_py(e.into()))?;
        json_to_py(py, &f.to_json())
    }

    fn pool_stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let v = py.detach(|| describe::pool_json(&self.db.pool_stats()));
        json_to_py(py, &v)
    }

    /// Imports a context. `next_layer(l)` returns layer l's `(k, v, q)`: k and v float32
    /// `[kv_heads, tokens, head_dim]`, q float32 `[q_heads, rows, head_dim]` or None; it is
    /// called once per layer, in order, so only one layer is held at a time. `progress(done,
    /// total)` is told the vector files written.
    #[pyo3(signature = (name, tokens, layers, q_heads, kv_heads, head_dim, next_layer, dtype="f16", progress=None))]
    fn import_kv(
        &self,
        py: Python<'_>,
        name: &str,
        tokens: Vec<u32>,
        layers: u16,
        q_heads: u16,
        kv_heads: u16,
        head_dim: u16,
        next_layer: Py<PyAny>,
        dtype: &str,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Py<PyAny>> {
        let shape = ModelShape { layers, q_heads, kv_heads, head_dim, dtype: dtype_of(dtype)? };
        let total = layers as u64 * kv_heads as u64;
        let source = source::PyLayers::new(shape, tokens, next_layer);
        let report = py.detach(|| {
            let mut done = 0u64;
            self.db.import(name, &source, |_| {
                done += 1;
                match &progress {
                    // What the callback raises (a KeyboardInterrupt too) stops the import
                    // before its commit and is raised again below.
                    Some(p) => Python::attach(|py| p.call1(py, (done, total)).map(drop)).map_err(|e| source.raised(e)),
                    None => Ok(()),
                }
            })
        });
        if let Some(raised) = source.take_raised() {
            return Err(raised);
        }
        let report = report.map_err(|e| to_py(e.into()))?;
        write_report(py, &report)
    }

    /// A session on `tokens`, reusing the longest stored prefix (at most `max_reuse`
    /// tokens). Returns the session and how many tokens it reuses.
    #[pyo3(signature = (tokens, max_reuse=None))]
    fn create_session(&self, py: Python<'_>, tokens: Vec<u32>, max_reuse: Option<usize>) -> PyResult<(Session, usize)> {
        if tokens.is_empty() {
            return Err(errors::InputError::new_err("a session needs the prompt's token ids: none were given"));
        }
        let cap = max_reuse.unwrap_or(tokens.len()).min(tokens.len());
        let (mut session, _) = py.detach(|| self.db.create_session(&tokens[..cap])).map_err(|e| match (cap, &e) {
            // No prefix to reuse and no shape to start from: say why there was none.
            (0, ctxfs_attention::Error::Input(_)) => errors::InputError::new_err(
                "max_reuse is 0: the session reuses no stored prefix, and a session without one needs a model shape \
                 this store does not configure",
            ),
            _ => to_py(e.into()),
        })?;
        let reused = session.prefix_tokens() as usize;
        session.append_tokens(&tokens[cap..]);
        Ok((Session::new(session), reused))
    }

    /// A session on the first `prefix` tokens (all by default) of a named context.
    #[pyo3(signature = (name, prefix=None))]
    fn open_session(&self, py: Python<'_>, name: &str, prefix: Option<u32>) -> PyResult<Session> {
        let session = py.detach(|| self.db.open_session(name, prefix)).map_err(|e| to_py(e.into()))?;
        Ok(Session::new(session))
    }

    /// The GPU's name when sessions use one, otherwise why they do not.
    fn gpu_status(&self, py: Python<'_>) -> String {
        py.detach(|| self.db.gpu_status().to_string())
    }

    /// Bytes of compact contexts' PQ codes the GPU holds now and the most it may hold;
    /// `None` without a GPU.
    fn gpu_codes_bytes(&self, py: Python<'_>) -> Option<(u64, u64)> {
        py.detach(|| self.db.gpu_codes_bytes())
    }
}

/// An attention call's options, a dict of every key as `ctxfs.Session` passes them (`None`:
/// the default): `plan` forces a plan; `beta`, `budget` and `scale` override the optimizer's;
/// `tail` turns the tail estimate on or off; `target_error` asks for an output error instead
/// of a fixed β; `k` is how many tokens top-k retrieves.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
struct CallOptions {
    plan: Option<String>,
    beta: Option<f32>,
    budget: Option<usize>,
    scale: Option<f32>,
    tail: Option<bool>,
    target_error: Option<f32>,
    k: Option<usize>,
}

impl CallOptions {
    fn attention_options(&self) -> PyResult<AttentionOptions> {
        let defaults = AttentionOptions::default();
        Ok(AttentionOptions {
            plan: self.plan.as_deref().map(|p| p.parse::<Plan>().map_err(errors::InputError::new_err)).transpose()?,
            beta: self.beta,
            budget: self.budget,
            scale: self.scale,
            tail: self.tail,
            target_error: self.target_error,
            k: self.k.unwrap_or(defaults.k),
            ..defaults
        })
    }
}

fn config(pool: u64, window: (u32, u32), resident_budget: Option<f64>) -> DbConfig {
    DbConfig {
        pool_bytes: pool,
        window: Window { init: window.0, recent: window.1 },
        resident_budget,
        ..Default::default()
    }
}

fn write_report(py: Python<'_>, r: &ctxfs_attention::WriteReport) -> PyResult<Py<PyAny>> {
    json_to_py(
        py,
        &serde_json::json!({"tokens": r.tokens, "heads": r.heads, "blocks": r.blocks, "seconds": r.seconds,
            "build_seconds": r.build_seconds()}),
    )
}

/// A session: a prompt's reused prefix, its window and the tokens it added. Attention calls
/// share it (many threads may run them at once); `update` and `append_tokens` take it alone.
#[pyclass(module = "ctxfs._native", frozen)]
struct Session {
    inner: std::sync::RwLock<ctxfs_attention::Session>,
    /// The session's shape, which never changes: read without its lock.
    shape: ModelShape,
}

impl Session {
    fn new(session: ctxfs_attention::Session) -> Session {
        Session { shape: session.shape(), inner: std::sync::RwLock::new(session) }
    }

    // The lock is only ever taken with the GIL released (`py.detach`), and no Python runs
    // while it is held: a thread holding the GIL and waiting for the lock would otherwise
    // wait for a holder that waits for the GIL.
    fn read(&self) -> std::sync::RwLockReadGuard<'_, ctxfs_attention::Session> {
        self.inner.read().unwrap_or_else(|e| e.into_inner())
    }
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, ctxfs_attention::Session> {
        self.inner.write().unwrap_or_else(|e| e.into_inner())
    }

    fn info_json(&self) -> serde_json::Value {
        let s = self.read();
        let shape = self.shape;
        serde_json::json!({
            "shape": {"layers": shape.layers, "q_heads": shape.q_heads, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "dtype": shape.dtype.name()},
            "prefix_tokens": s.prefix_tokens(),
            "reused_context": s.reused_context().map(|(n, _)| n),
            "filtered": s.reused_context().is_some_and(|(_, f)| f),
            "window_tokens": s.window_tokens().len(),
            "new_tokens": s.new_tokens().len(),
            "updated_rows": (0..shape.layers as usize).map(|l| s.updated_rows(l)).collect::<Vec<_>>(),
            "device": s.device(),
        })
    }
}

/// One attention call's answer: outputs `[rows, q_heads, head_dim]`, log-sum-exps `[rows,
/// q_heads]`, and per row the plan, the tokens retrieved, the keys scored and, with an error
/// target, the largest error any head estimated.
type AttentionOut<'py> = (Bound<'py, PyArray2<f32>>, Bound<'py, PyArray2<f32>>, Vec<(String, u64, u64, Option<f32>)>);

#[pymethods]
impl Session {
    /// Attention of `rows` decode queries `[rows, q_heads * head_dim]` over `layer`, each row
    /// on its own (as one decode step), with `options` ([`CallOptions`]).
    fn attention<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        q: PyReadonlyArrayDyn<'py, f32>,
        options: CallOptions,
    ) -> PyResult<AttentionOut<'py>> {
        let opts = options.attention_options()?;
        let shape = self.shape;
        let width = shape.q_heads as usize * shape.head_dim as usize;
        let q = slice("q", &q)?;
        if q.is_empty() || !q.len().is_multiple_of(width) {
            return Err(errors::InputError::new_err(format!(
                "attention of layer {layer}: q has {} elements, expected rows × q_heads ({}) × head_dim ({})",
                q.len(),
                shape.q_heads,
                shape.head_dim
            )));
        }
        let rows = q.len() / width;
        let (out, lse, reports) = py
            .detach(|| -> ctxfs_attention::Result<_> {
                let session = self.read();
                let (mut out, mut lse, mut reports) = (Vec::with_capacity(q.len()), Vec::new(), Vec::new());
                for row in q.chunks(width) {
                    let a = session.attention_with(layer, row, &opts)?;
                    out.extend_from_slice(&a.output);
                    lse.extend(a.heads.iter().map(|h| h.lse));
                    let retrieved = a.heads.iter().map(|h| h.retrieved as u64).sum();
                    let scored = a.heads.iter().map(|h| h.stats.keys_scored).sum();
                    let estimated = a.heads.iter().filter_map(|h| h.estimated_error).reduce(f32::max);
                    reports.push((a.plan(), retrieved, scored, estimated));
                }
                Ok((out, lse, reports))
            })
            .map_err(|e| to_py(e.into()))?;
        let out = out.into_pyarray(py).reshape([rows, width])?;
        let lse = lse.into_pyarray(py).reshape([rows, shape.q_heads as usize])?;
        Ok((out, lse, reports))
    }

    /// Refuses what `attention` would refuse of `options`, before any call runs.
    fn check_options(&self, options: CallOptions) -> PyResult<()> {
        options.attention_options()?.validate().map_err(|e| to_py(e.into()))
    }

    /// Appends tokens to `layer`: k and v float32 `[kv_heads, t, head_dim]`, q float32
    /// `[q_heads, t, head_dim]` or None. Nothing changes when the input is refused.
    #[pyo3(signature = (layer, q, k, v))]
    fn update(
        &self,
        py: Python<'_>,
        layer: usize,
        q: Option<PyReadonlyArrayDyn<'_, f32>>,
        k: PyReadonlyArrayDyn<'_, f32>,
        v: PyReadonlyArrayDyn<'_, f32>,
    ) -> PyResult<()> {
        let q = match &q {
            Some(q) => slice("q", q)?,
            None => &[],
        };
        let (k, v) = (slice("k", &k)?, slice("v", &v)?);
        py.detach(|| self.write().update(layer, q, k, v)).map_err(|e| to_py(e.into()))
    }

    /// Ids of tokens generated after the prompt, in order.
    fn append_tokens(&self, py: Python<'_>, ids: Vec<u32>) {
        py.detach(|| self.write().append_tokens(&ids));
    }

    /// Persists the session's own tokens as context `name`, on top of the prefix it reused.
    fn store(&self, py: Python<'_>, store: &Store, name: &str) -> PyResult<Py<PyAny>> {
        let report = py.detach(|| store.db.store_session(&self.read(), name)).map_err(|e| to_py(e.into()))?;
        write_report(py, &report)
    }

    /// The plan an attention call on `layer` would run, and why.
    #[pyo3(signature = (layer, plan=None))]
    fn plan(&self, py: Python<'_>, layer: usize, plan: Option<&str>) -> PyResult<Py<PyAny>> {
        let forced = plan.map(|p| p.parse::<Plan>().map_err(errors::InputError::new_err)).transpose()?;
        if layer >= self.shape.layers as usize {
            return Err(errors::InputError::new_err(format!(
                "layer {layer} does not exist: the model's layers are 0 to {}",
                self.shape.layers - 1
            )));
        }
        let c = py.detach(|| self.read().choice(layer, Request { forced, error_target: None }));
        json_to_py(
            py,
            &serde_json::json!({"plan": c.label(), "reason": c.reason, "filtered": c.filtered, "forced": c.forced, "error_target": c.error_target, "budgeted": c.budgeted}),
        )
    }

    /// What the session holds: its shape, reused prefix, window and own tokens, and where
    /// attention runs.
    fn info(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let v = py.detach(|| self.info_json());
        json_to_py(py, &v)
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Store>()?;
    m.add_class::<Session>()?;
    Ok(())
}
