//! ctxfs-index: finding, for each decode query, the keys that matter.
//!
//! * [`build()`]: the query-guided graph per (layer, kv head), trained on prefill queries;
//! * [`search::diprs`]: the dynamic inner-product range search (window-enhanced), and
//!   [`search::topk`]: beam search; both take a prefix filter for partial-prefix reuse;
//! * [`flat`]: exact DIPR and top-k by scanning every key, through the SIMD kernels;
//! * [`coarse`]: coarse-grained selection from small per-page, per-block or per-token
//!   metadata: Quest page bounds, InfLLM block representatives, PQCache product quantisation.
//!
//! Searches are written once against the [`Keys`] and [`Graph`] traits, so they run over the
//! in-memory arrays of [`mem`] at build time and over buffered pages at query time. Every
//! search reports keys scored, hops and blocks touched.
//!
//! The search's steps and the crates around it: `docs/architecture.md` in the repository.

pub mod approx;
pub mod build;
pub mod coarse;
pub mod flat;
pub mod mem;
pub mod paged;
mod scratch;
pub mod search;
mod source;
mod stats;
pub mod synth;
pub mod target;
mod threads;

pub use build::{build, knn, BuildParams, BuildReport};
pub use coarse::{Coarse, CoarseResult};
pub use mem::{MemGraph, MemKeys, NO_NODE};
pub use search::DiprsParams;
pub use source::{Graph, Keys, Pair, SourceResult};
pub use stats::{SearchResult, SearchStats, SeedScores};
pub use target::{Estimate, MassTarget};
