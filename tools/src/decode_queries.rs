//! Decode queries from a query file (`layers.{l}.q`, shape [q_heads, n, head_dim]): one
//! step's queries of a layer, `[q_heads, head_dim]`, as `Session::attention` takes them.

use anyhow::{ensure, Context, Result};
use ctxfs_attention::kv::f32s;
use safetensors::SafeTensors;
use std::path::Path;

/// Step `s` of a layer's queries `[q_heads, n, d]`: each q head's `s`-th row.
pub fn step_of(queries: &[f32], n: usize, d: usize, s: usize) -> Vec<f32> {
    queries.chunks_exact(n * d).flat_map(|head| head[s * d..(s + 1) * d].iter().copied()).collect()
}

/// Every layer's decode queries of a generated book's query file.
pub struct DecodeQueries {
    per_layer: Vec<Vec<f32>>,
    /// Queries per q head (decode steps available).
    pub steps: usize,
    d: usize,
}

impl DecodeQueries {
    pub fn read(path: &Path, layers: usize, q_heads: usize, d: usize) -> Result<DecodeQueries> {
        let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let st = SafeTensors::deserialize(&bytes)?;
        let steps = st.tensor("layers.0.q")?.shape().get(1).copied().unwrap_or(0);
        ensure!(steps > 0, "{} holds no decode queries", path.display());
        let per_layer = (0..layers)
            .map(|l| f32s(&st, &format!("layers.{l}.q"), 0..q_heads * steps * d))
            .collect::<Result<_, _>>()?;
        Ok(DecodeQueries { per_layer, steps, d })
    }

    /// Step `s`'s queries of layer `l`, `[q_heads, head_dim]`.
    pub fn step(&self, l: usize, s: usize) -> Vec<f32> {
        step_of(&self.per_layer[l], self.steps, self.d, s)
    }
}
