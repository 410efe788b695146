//! `SafetensorsKv` (what `ctxfs import` and `Db::import` read a context from) never panics on a
//! file whose header, names, shapes, dtypes, offsets or sizes lie: the input is the whole file.
//! Whatever opens is read the way an import reads it (values checked, token ids, then every
//! (layer, kv head)'s keys, values and training queries), and what a read returns has exactly
//! the length the shape says.
#![no_main]

use ctxfs_attention::{KvSource, SafetensorsKv};
use ctxfs_vfs::DType;
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

#[global_allocator]
static ALLOC: ctxfs_fuzz::Bounded = ctxfs_fuzz::Bounded;

/// One file per fuzzing process, rewritten for each input.
fn path() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| std::env::temp_dir().join(format!("ctxfs-fuzz-import-{}.safetensors", std::process::id())))
}

fuzz_target!(|data: &[u8]| {
    std::fs::write(path(), data).expect("write the input file");
    for dtype in [DType::F16, DType::Bf16] {
        let Ok(kv) = SafetensorsKv::open(path(), dtype) else { continue };
        let s = kv.shape();
        let (n, d) = (kv.token_count(), s.head_dim as usize);
        assert!(kv.tensor_bytes() <= data.len() as u64, "tensors larger than the file");
        let _ = kv.check_values(|_| {});
        if let Ok(ids) = kv.token_ids() {
            assert_eq!(ids.len(), n);
        }
        for layer in 0..s.layers as usize {
            for head in 0..s.kv_heads as usize {
                if let Ok(k) = kv.keys(layer, head) {
                    assert_eq!(k.len(), n * d);
                }
                if let Ok(v) = kv.values(layer, head) {
                    assert_eq!(v.len(), n * d);
                }
                if let Ok(q) = kv.train_queries(layer, head) {
                    assert_eq!(q.len() % d, 0);
                }
            }
        }
    }
});
