//! Decode queries from a query file (`layers.{l}.q`, shape [q_heads, n, head_dim]): one
//! step's queries of a layer, `[q_heads, head_dim]`, as `Session::attention` takes them. The
//! file is parsed by `ctxfs_attention::queries`.

use anyhow::{anyhow, ensure, Context, Result};
use ctxfs_attention::queries::{LayerQueries, QueryFile};
use std::path::Path;

/// Every layer's decode queries of a generated book's query file.
pub struct DecodeQueries {
    per_layer: Vec<LayerQueries>,
    /// Queries per q head (decode steps available).
    pub steps: usize,
}

impl DecodeQueries {
    pub fn read(path: &Path, layers: usize, q_heads: usize, d: usize) -> Result<DecodeQueries> {
        let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let at = |e: ctxfs_attention::Error| anyhow!("{}: {e}", path.display());
        let file = QueryFile::parse(&bytes).map_err(at)?;
        let per_layer: Vec<LayerQueries> =
            (0..layers).map(|l| file.layer(l, q_heads, d).map_err(at)).collect::<Result<_>>()?;
        let steps = per_layer.first().map_or(0, |q| q.steps);
        ensure!(steps > 0, "{} holds no decode queries", path.display());
        ensure!(
            per_layer.iter().all(|q| q.steps == steps),
            "{}: the layers hold different numbers of decode queries",
            path.display()
        );
        Ok(DecodeQueries { per_layer, steps })
    }

    /// Step `s`'s queries of layer `l`, `[q_heads, head_dim]`.
    pub fn step(&self, l: usize, s: usize) -> Vec<f32> {
        self.per_layer[l].step(s)
    }
}
