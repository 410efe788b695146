//! What the integration tests share: a generated context written as a real safetensors
//! file, a store on a real file (io_uring, O_DIRECT), and exact attention computed the
//! obvious way, independent of the code under test. The crates they exercise together are
//! described in `docs/architecture.md`.

use ctxfs_index::synth::{head, HeadData, SynthParams};
use ctxfs_vfs::{device, DType, DeviceChoice, ModelShape};
use half::f16;
use safetensors::tensor::{Dtype, TensorView};
use std::path::{Path, PathBuf};

pub struct Book {
    pub shape: ModelShape,
    pub tokens: Vec<u32>,
    /// Per (layer, kv head), layer-major.
    pub heads: Vec<HeadData>,
    pub path: PathBuf,
}

impl Book {
    pub fn head(&self, layer: usize, kv: usize) -> &HeadData {
        &self.heads[layer * self.shape.kv_heads as usize + kv]
    }

    /// Decode step `i`'s queries of `layer`, `[q_heads, head_dim]`.
    pub fn decode_step(&self, layer: usize, i: usize) -> Vec<f32> {
        let d = self.shape.head_dim as usize;
        let group = (self.shape.q_heads / self.shape.kv_heads) as usize;
        let mut out = Vec::new();
        for kv in 0..self.shape.kv_heads as usize {
            for g in 0..group {
                out.extend_from_slice(&self.head(layer, kv).decode[g][i * d..(i + 1) * d]);
            }
        }
        out
    }
}

/// A generated context of `n` tokens, written to `dir/book.safetensors`.
pub fn book(dir: &Path, n: usize, layers: u16, q_heads: u16, kv_heads: u16, seed: u64) -> Book {
    book_of_dim(dir, n, layers, q_heads, kv_heads, 64, seed)
}

/// [`book`] with head dimension `d`.
pub fn book_of_dim(dir: &Path, n: usize, layers: u16, q_heads: u16, kv_heads: u16, d: usize, seed: u64) -> Book {
    let shape = ModelShape { layers, q_heads, kv_heads, head_dim: d as u16, dtype: DType::F16 };
    let group = (q_heads / kv_heads) as usize;
    let p = SynthParams { tokens: n, head_dim: d, group, seed };
    let prefill = (n / 8).clamp(64, 2048);
    let heads: Vec<HeadData> = (0..layers as usize)
        .flat_map(|l| (0..kv_heads as usize).map(move |h| (l, h)))
        .map(|(l, h)| head(&p, l, h, prefill, 8))
        .collect();
    let tokens: Vec<u32> = (0..n as u32).map(|t| t.wrapping_mul(2_654_435_761) % 50_000).collect();
    let mut blobs: Vec<(String, Vec<u8>, Vec<usize>, Dtype)> = Vec::new();
    for l in 0..layers as usize {
        let hs = &heads[l * kv_heads as usize..(l + 1) * kv_heads as usize];
        let cat = |f: &dyn Fn(&HeadData) -> Vec<u8>| hs.iter().flat_map(f).collect::<Vec<u8>>();
        blobs.push((
            format!("layers.{l}.k"),
            cat(&|h| bytemuck::cast_slice(&h.keys).to_vec()),
            vec![kv_heads as usize, n, d],
            Dtype::F16,
        ));
        blobs.push((
            format!("layers.{l}.v"),
            cat(&|h| bytemuck::cast_slice(&h.values).to_vec()),
            vec![kv_heads as usize, n, d],
            Dtype::F16,
        ));
        let q: Vec<u8> = hs.iter().flat_map(|h| h.prefill.iter().flatten().flat_map(|x| x.to_le_bytes())).collect();
        blobs.push((format!("layers.{l}.q"), q, vec![q_heads as usize, prefill, d], Dtype::F32));
    }
    let ids: Vec<u8> = tokens.iter().flat_map(|&t| (t as i64).to_le_bytes()).collect();
    blobs.push(("tokens".into(), ids, vec![n], Dtype::I64));
    let views: Vec<(String, TensorView<'_>)> = blobs
        .iter()
        .map(|(name, data, shape, dt)| (name.clone(), TensorView::new(*dt, shape.clone(), data).expect("consistent")))
        .collect();
    let path = dir.join("book.safetensors");
    safetensors::serialize_to_file(views, &None, &path).expect("write the book");
    Book { shape, tokens, heads, path }
}

/// An empty store of `mib` MiB on a real file, through the real device.
pub fn mkfs(dir: &Path, mib: u64) -> PathBuf {
    let path = dir.join("store.ctxfs");
    std::fs::File::create(&path).and_then(|f| f.set_len(mib << 20)).expect("create the store file");
    let dev =
        device::open_path(&path, DeviceChoice::Auto, 4096, ctxfs_vfs::Access::Write).expect("open the store file");
    ctxfs_vfs::format(std::sync::Arc::from(dev)).expect("format");
    path
}

/// Exact attention of `q` over the rows `ids` of `keys` and `values`, in f64: (o, lse).
pub fn exact(keys: &[f32], values: &[f32], d: usize, ids: &[u32], q: &[f32], scale: f32) -> (Vec<f32>, f32) {
    let z: Vec<f64> = ids
        .iter()
        .map(|&t| {
            let k = &keys[t as usize * d..(t as usize + 1) * d];
            k.iter().zip(q).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64
        })
        .collect();
    let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
    let l: f64 = w.iter().sum();
    let mut o = vec![0.0f64; d];
    for (&t, &wi) in ids.iter().zip(&w) {
        for (acc, v) in o.iter_mut().zip(&values[t as usize * d..(t as usize + 1) * d]) {
            *acc += wi * *v as f64;
        }
    }
    (o.iter().map(|x| (x / l) as f32).collect(), (m + l.ln()) as f32)
}

/// Halves widened to f32.
pub fn widen(x: &[f16]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

/// ‖a − b‖ / ‖b‖.
pub fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}
