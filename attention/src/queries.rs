//! Query files: a safetensors file of `layers.{l}.q` tensors, each of shape
//! `[q_heads, n, head_dim]` (f32, f16 or bf16), q head after q head, row `s` of each q head
//! being decode step `s`'s query. `ctxfs query` and the decode benchmarks read them. A
//! capture file (`python -m ctxfs.capture`) holds a model's prefill queries there and its
//! decode steps' queries in `layers.{l}.decode_q`, of the same layout
//! ([`QueryFile::decode_steps`] reads those).
//!
//! Parsing checks everything the file says against what it holds (safetensors' own header
//! checks: offsets, shapes and dtype sizes agree with the data) and against the context it is
//! read for (q heads, head dimension), before allocating: a layer's queries take at most the
//! bytes its tensor holds, as f32.

use crate::error::{input, Error, Result};
use crate::kv::f32s;
use safetensors::SafeTensors;

/// A parsed query file, borrowing its bytes.
pub struct QueryFile<'a> {
    st: SafeTensors<'a>,
    /// The name of each layer's tensor after `layers.{l}.`: `q`, or `decode_q`.
    tensor: &'static str,
}

/// One layer's decode queries: `steps` rows of `d` per q head, as f32.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerQueries {
    data: Vec<f32>,
    /// Decode steps available (queries per q head).
    pub steps: usize,
    d: usize,
}

impl<'a> QueryFile<'a> {
    /// Parses the header of a query file (the whole file's bytes).
    pub fn parse(bytes: &'a [u8]) -> Result<QueryFile<'a>> {
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| Error::Input(format!("not a safetensors file: {}", describe_error(&e))))?;
        Ok(QueryFile { st, tensor: "q" })
    }

    /// The same file read for its `layers.{l}.decode_q` tensors: a capture file's decode
    /// steps, in place of its prefill queries.
    pub fn decode_steps(self) -> QueryFile<'a> {
        QueryFile { tensor: "decode_q", ..self }
    }

    /// The name of each layer's tensor after `layers.{l}.`: `q`, or `decode_q`.
    pub fn tensor(&self) -> &'static str {
        self.tensor
    }

    fn name(&self, layer: usize) -> String {
        format!("layers.{layer}.{}", self.tensor)
    }

    /// Whether the file has the layer's tensor (`layers.{layer}.q`, or `.decode_q`).
    pub fn has_layer(&self, layer: usize) -> bool {
        self.st.tensor(&self.name(layer)).is_ok()
    }

    /// The highest layer the file holds this kind of tensor for.
    pub fn last_layer(&self) -> Option<usize> {
        let suffix = format!(".{}", self.tensor);
        self.st
            .names()
            .into_iter()
            .filter_map(|name| name.strip_prefix("layers.")?.strip_suffix(suffix.as_str())?.parse::<usize>().ok())
            .max()
    }

    /// Layer `layer`'s queries, checked to be `[q_heads, n, d]` (`d` at least 1).
    pub fn layer(&self, layer: usize, q_heads: usize, d: usize) -> Result<LayerQueries> {
        let name = self.name(layer);
        let t = self.st.tensor(&name).map_err(|_| Error::Input(format!("missing tensor {name}")))?;
        let shape = t.shape();
        if shape.len() != 3 || shape[0] != q_heads || shape[2] != d || d == 0 {
            return input(format!(
                "{name} has shape {shape:?}, expected [{q_heads}, n, {d}]: the context's q heads, any number of \
                 queries, its head dim"
            ));
        }
        let steps = shape[1];
        // The header check made the element count fit the data, so this product cannot overflow.
        let data = f32s(&self.st, &name, 0..q_heads * steps * d)?;
        Ok(LayerQueries { data, steps, d })
    }
}

impl LayerQueries {
    /// Step `s`'s queries, `[q_heads, head_dim]`: each q head's `s`-th row (`s < steps`).
    pub fn step(&self, s: usize) -> Vec<f32> {
        assert!(s < self.steps, "step {s} of {} decode queries", self.steps);
        step_of(&self.data, self.steps, self.d, s)
    }
}

/// What is wrong with a file, in words (the library's own message is its variant's name).
fn describe_error(e: &safetensors::SafeTensorError) -> String {
    use safetensors::SafeTensorError as E;
    match e {
        E::HeaderTooSmall => "shorter than its 8-byte header length".into(),
        E::InvalidHeaderLength | E::HeaderTooLarge => "its header length does not fit the file".into(),
        E::InvalidHeader | E::InvalidHeaderStart => "its header is not a UTF-8 JSON object".into(),
        E::InvalidHeaderDeserialization | E::JsonError(_) => "its header is not valid safetensors JSON".into(),
        E::MetadataIncompleteBuffer => "its tensors do not cover its data exactly (truncated or padded)".into(),
        E::InvalidOffset(name) => format!("tensor {name}'s data offsets are invalid"),
        E::TensorInvalidInfo | E::ValidationOverflow => "a tensor's shape and dtype disagree with its offsets".into(),
        other => format!("{other}"),
    }
}

/// Step `s` of a layer's queries `[q_heads, n, d]` (row after row): each q head's `s`-th row.
pub fn step_of(queries: &[f32], n: usize, d: usize, s: usize) -> Vec<f32> {
    queries.chunks_exact(n * d).flat_map(|head| head[s * d..(s + 1) * d].iter().copied()).collect()
}
