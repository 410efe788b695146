//! Query files (`ctxfs query --queries`, the decode benchmarks' `*.queries.safetensors`) never
//! panic: `QueryFile::parse` on the raw input, then every layer read for a few (q heads, head
//! dim) pairs a context could have, and every step of what reads. A layer that reads holds
//! exactly `q_heads × head_dim` elements per step.
#![no_main]

use ctxfs_attention::queries::QueryFile;
use libfuzzer_sys::fuzz_target;

#[global_allocator]
static ALLOC: ctxfs_fuzz::Bounded = ctxfs_fuzz::Bounded;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = QueryFile::parse(data) else { return };
    for layer in 0..4 {
        let _ = file.has_layer(layer);
        for (q_heads, d) in [(1, 1), (2, 4), (4, 8), (1, 16), (8, 64)] {
            let Ok(q) = file.layer(layer, q_heads, d) else { continue };
            for s in 0..q.steps {
                assert_eq!(q.step(s).len(), q_heads * d);
            }
        }
    }
});
