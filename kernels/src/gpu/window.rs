//! A session's window in GPU memory, the device buffers its attention reads and writes, and
//! the launches: window attention (split over the window), the merge, and both in one launch.
//!
//! Launch geometry. The attention kernel runs one block of 128 threads per (split of the
//! window, q head): the block reads its split's K/V rows of the q head's kv head with 16-byte
//! loads, over tiles of 32 tokens, two tiles' loads in flight ahead of their use; the q heads
//! of a GQA group read the same rows, all but the first from L2. A block's time is its chain
//! of dependent instructions (a decode step's window gives each multiprocessor a few warps),
//! so a block takes one q head, one barrier per tile, and as few tiles as the merge allows.
//! Each split leaves a partial (o, m, l) per q head, combined with the host's partial by the
//! log-sum-exp rule.
//!
//! With thread-block clusters (Hopper, sm_90), a window of at most 64 tiles is cut into the
//! fewest tiles per split such that one cluster of at most 16 blocks takes a q head's splits
//! and the device runs every cluster at once (a 640-token window of 32 q heads over 8 kv
//! heads: 10 splits of 2 tiles, 320 blocks in 32 clusters of 10). [`GpuWindow::attend_merged`]
//! then merges inside the cluster: each block sends its slices of the partial straight into
//! the shared memory of the block that merges them (`st.async`, counted on that block's
//! mbarrier), so no partial goes through global memory and no block waits for more than the
//! bytes it merges. Without clusters, and for longer windows, the splits fill the device once
//! (as many blocks as it runs at a time), each split's partial goes to global memory, and
//! `attend_merged` merges in the last block of each q head to finish. [`GpuWindow::attend`]
//! and [`GpuWindow::merge`] are the same attention and merge as two launches, so that the
//! host computes its part in between.

use super::{Gpu, GpuError};
use crate::Partial;
use cudarc::driver::{sys, CudaFunction, CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use half::f16;
use std::ffi::c_void;

/// Threads per block, tokens per tile and q heads per block: `THREADS`, `TILE` and `GMAX` in
/// kernels.cu.
pub(super) const THREADS: u32 = 128;
const TILE: usize = 32;
const GMAX: usize = 1;
/// At most this many splits per q head (`MAX_PARTS` − 1 in kernels.cu).
const MAX_SPLITS: usize = 256;
/// The most blocks of a cluster launch (`MAX_CLUSTER` in kernels.cu).
pub(super) const MAX_CLUSTER: usize = 16;
/// Windows of at most this many tiles per block of a cluster are split for the cluster launch
/// (at most a cluster's size of splits); longer ones keep the split count that fills the
/// device, and the fused launch merges in its last block.
const CLUSTER_TILES: usize = 4;

/// The launch attribute that makes a launch's blocks clusters of `size` along x.
pub(super) fn cluster_attribute(size: u32) -> sys::CUlaunchAttribute {
    let mut attribute = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        pad: [0; 4],
        // SAFETY: the value is a union of plain integers and structs of them: all zeros is a
        // valid value of each.
        value: unsafe { std::mem::zeroed() },
    };
    attribute.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: size, y: 1, z: 1 };
    attribute
}

/// Per-head query vectors on the device, `[heads][dim]` f32: the input of
/// [`GpuWindow::attend`].
pub struct GpuQueries {
    gpu: Gpu,
    heads: usize,
    dim: usize,
    data: CudaSlice<f32>,
}

impl GpuQueries {
    pub fn new(gpu: &Gpu, heads: usize, dim: usize) -> Result<GpuQueries, GpuError> {
        positive(&[(heads, "heads"), (dim, "dim")])?;
        Ok(GpuQueries { gpu: gpu.clone(), heads, dim, data: gpu.alloc(heads * dim)? })
    }

    /// Copies `q` (`heads × dim`) to the device.
    pub fn upload(&mut self, q: &[f32]) -> Result<(), GpuError> {
        expect_len(q.len(), self.heads * self.dim, "queries")?;
        Ok(self.gpu.stream.memcpy_htod(q, &mut self.data)?)
    }
}

/// One [`Partial`] per head on the device: o `[heads][dim]`, then m `[heads]`, then l
/// `[heads]`, so that a set moves in one copy.
pub struct GpuPartials {
    gpu: Gpu,
    heads: usize,
    dim: usize,
    data: CudaSlice<f32>,
}

impl GpuPartials {
    pub fn new(gpu: &Gpu, heads: usize, dim: usize) -> Result<GpuPartials, GpuError> {
        positive(&[(heads, "heads"), (dim, "dim")])?;
        Ok(GpuPartials { gpu: gpu.clone(), heads, dim, data: gpu.alloc(heads * (dim + 2))? })
    }

    pub fn heads(&self) -> usize {
        self.heads
    }

    pub fn dim(&self) -> usize {
        self.dim
    }

    /// Copies one partial per head to the device ([`Partial::empty`] for a head with none).
    pub fn upload(&mut self, parts: &[Partial]) -> Result<(), GpuError> {
        expect_len(parts.len(), self.heads, "partials")?;
        let mut packed = vec![0.0; self.heads * (self.dim + 2)];
        let (o, ml) = packed.split_at_mut(self.heads * self.dim);
        for (h, p) in parts.iter().enumerate() {
            expect_len(p.o.len(), self.dim, "a partial's o")?;
            o[h * self.dim..(h + 1) * self.dim].copy_from_slice(&p.o);
            ml[h] = p.m;
            ml[self.heads + h] = p.l;
        }
        Ok(self.gpu.stream.memcpy_htod(&packed, &mut self.data)?)
    }

    /// Copies the partials back, waiting for the work before.
    pub fn download(&self) -> Result<Vec<Partial>, GpuError> {
        let data = self.gpu.stream.clone_dtoh(&self.data)?;
        self.gpu.synchronize()?;
        let (o, ml) = data.split_at(self.heads * self.dim);
        Ok((0..self.heads)
            .map(|h| Partial { o: o[h * self.dim..(h + 1) * self.dim].to_vec(), m: ml[h], l: ml[self.heads + h] })
            .collect())
    }
}

impl Drop for GpuQueries {
    fn drop(&mut self) {
        self.gpu.freed();
    }
}

impl Drop for GpuPartials {
    fn drop(&mut self) {
        self.gpu.freed();
    }
}

impl Drop for GpuWindow {
    fn drop(&mut self) {
        self.gpu.freed();
    }
}

/// The buffers [`GpuWindow::attention`] stages host data through.
struct Staging {
    q: GpuQueries,
    host: GpuPartials,
    out: GpuPartials,
}

/// A session's window for one layer in GPU memory: keys and values of `kv_heads` heads, f16,
/// token-major (`[capacity][kv_heads][head_dim]`), growing by doubling as tokens are appended.
pub struct GpuWindow {
    gpu: Gpu,
    attend_kernel: CudaFunction,
    /// Attention blocks the device runs at once: the grid the split count aims for.
    resident_blocks: usize,
    /// The cluster kernel (attention and merge) and how many clusters of each size the device
    /// runs at once, where the device has clusters.
    cluster: Option<(CudaFunction, Vec<usize>)>,
    q_heads: usize,
    kv_heads: usize,
    dim: usize,
    len: usize,
    capacity: usize,
    keys: CudaSlice<u16>,
    values: CudaSlice<u16>,
    /// Each split's partial per q head: o `[q_heads][splits][dim]` and (m, l)
    /// `[q_heads][splits][2]`, with room for `split_capacity` splits.
    split_o: CudaSlice<f32>,
    split_ml: CudaSlice<f32>,
    split_capacity: usize,
    /// Per (kv head, chunk of q heads): the blocks of a fused launch that finished, which the
    /// last of them resets to 0 (`done` in kernels.cu).
    done: CudaSlice<u32>,
    /// The split count of the last `attend` while the window has not changed since.
    attended: Option<usize>,
    staging: Option<Staging>,
}

impl GpuWindow {
    /// An empty window with room for `capacity` tokens.
    pub fn new(
        gpu: &Gpu,
        q_heads: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
    ) -> Result<GpuWindow, GpuError> {
        positive(&[(q_heads, "q_heads"), (kv_heads, "kv_heads")])?;
        if !q_heads.is_multiple_of(kv_heads) {
            return Err(GpuError::Invalid(format!("{q_heads} q heads do not form groups of {kv_heads} kv heads")));
        }
        let kernels = gpu.attend_kernels(head_dim)?.clone();
        let capacity = capacity.max(1);
        let row = kv_heads * head_dim;
        let split_capacity = 1;
        Ok(GpuWindow {
            gpu: gpu.clone(),
            attend_kernel: kernels.attend,
            resident_blocks: kernels.resident,
            cluster: kernels.cluster,
            q_heads,
            kv_heads,
            dim: head_dim,
            len: 0,
            capacity,
            keys: gpu.alloc(capacity * row)?,
            values: gpu.alloc(capacity * row)?,
            split_o: gpu.alloc(q_heads * split_capacity * head_dim)?,
            split_ml: gpu.alloc(q_heads * split_capacity * 2)?,
            split_capacity,
            done: gpu.alloc(kv_heads * (q_heads / kv_heads).div_ceil(GMAX))?,
            attended: None,
            staging: None,
        })
    }

    /// Tokens in the window.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Tokens the window holds before it must grow.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn q_heads(&self) -> usize {
        self.q_heads
    }

    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    pub fn head_dim(&self) -> usize {
        self.dim
    }

    /// Replaces the window's tokens by `keys` and `values`, each `[kv_heads][tokens][head_dim]`.
    pub fn load(&mut self, keys: &[f16], values: &[f16]) -> Result<(), GpuError> {
        let tokens = self.rows(keys, values)?;
        self.len = 0;
        self.put(keys, values, tokens)
    }

    /// Appends tokens (a session's `update`): `keys` and `values` each
    /// `[kv_heads][tokens][head_dim]`. Grows the window to twice its capacity (or to what is
    /// needed) when they do not fit.
    pub fn append(&mut self, keys: &[f16], values: &[f16]) -> Result<(), GpuError> {
        let tokens = self.rows(keys, values)?;
        self.put(keys, values, tokens)
    }

    /// Tokens in `keys` and `values`, checked against the window's shape.
    fn rows(&self, keys: &[f16], values: &[f16]) -> Result<usize, GpuError> {
        let row = self.kv_heads * self.dim;
        if keys.len() != values.len() || !keys.len().is_multiple_of(row) {
            return Err(GpuError::Invalid(format!(
                "{} key and {} value elements are not whole [{} kv heads][tokens][{} dims] arrays",
                keys.len(),
                values.len(),
                self.kv_heads,
                self.dim
            )));
        }
        Ok(keys.len() / row)
    }

    /// Writes `tokens` rows after the window's `len`, growing it first if needed.
    fn put(&mut self, keys: &[f16], values: &[f16], tokens: usize) -> Result<(), GpuError> {
        let total = self.len + tokens;
        if total > i32::MAX as usize {
            return Err(GpuError::Invalid(format!("a window of {total} tokens is beyond the kernels' 32-bit indices")));
        }
        self.attended = None;
        if tokens == 0 {
            return Ok(());
        }
        if total > self.capacity {
            self.grow(total.max(self.capacity * 2))?;
        }
        let row = self.kv_heads * self.dim;
        let at = self.len * row..total * row;
        let stream = &self.gpu.stream;
        stream.memcpy_htod(&token_major(keys, self.kv_heads, self.dim), &mut self.keys.slice_mut(at.clone()))?;
        stream.memcpy_htod(&token_major(values, self.kv_heads, self.dim), &mut self.values.slice_mut(at))?;
        self.len = total;
        Ok(())
    }

    /// Moves the window to new buffers of `capacity` tokens.
    fn grow(&mut self, capacity: usize) -> Result<(), GpuError> {
        let used = self.len * self.kv_heads * self.dim;
        let mut keys = self.gpu.alloc(capacity * self.kv_heads * self.dim)?;
        let mut values = self.gpu.alloc(capacity * self.kv_heads * self.dim)?;
        if used > 0 {
            let stream = &self.gpu.stream;
            stream.memcpy_dtod(&self.keys.slice(..used), &mut keys.slice_mut(..used))?;
            stream.memcpy_dtod(&self.values.slice(..used), &mut values.slice_mut(..used))?;
        }
        // The old buffers are freed in stream order, after the copies.
        self.gpu.freed();
        self.keys = keys;
        self.values = values;
        self.capacity = capacity;
        Ok(())
    }

    /// (splits, tokens per split, q-head blocks per kv head, whether a cluster takes each q
    /// head's splits) for the current length: the same for `attend` and `attend_merged`, so
    /// that both give the same partials.
    fn plan(&self) -> (usize, usize, usize, bool) {
        let chunks = (self.q_heads / self.kv_heads).div_ceil(GMAX);
        if self.len == 0 {
            return (0, 0, chunks, false);
        }
        let wanted = self.resident_blocks.div_ceil(self.kv_heads * chunks).max(1);
        let tiles = self.len.div_ceil(TILE);
        let clusters = self.kv_heads * chunks;
        // The fewest tiles per split such that a cluster takes every split and all clusters
        // run at once.
        let clustered = self.cluster.as_ref().and_then(|(_, capacity)| {
            (1..=CLUSTER_TILES.min(tiles))
                .find(|per| capacity.get(tiles.div_ceil(*per)).is_some_and(|&n| n >= clusters))
        });
        let per_split = match clustered {
            Some(per) => per,
            None => tiles.div_ceil(tiles.min(wanted).min(MAX_SPLITS)),
        } * TILE;
        (self.len.div_ceil(per_split), per_split, chunks, clustered.is_some())
    }

    /// Launches the window's attention for every q head (asynchronous): one partial per split
    /// and q head, kept on the device for [`merge`](Self::merge). The window stays as it is
    /// until then, so the host can compute its own part meanwhile.
    pub fn attend(&mut self, q: &GpuQueries, scale: f32) -> Result<(), GpuError> {
        self.launch_attend(q, scale, None)
    }

    /// [`attend`](Self::attend) and [`merge`](Self::merge) in one launch, for callers that have
    /// the host partials before the window's attention starts: each cluster of a q head's splits
    /// merges them (see the module's launch geometry), or else the last of those splits to
    /// finish. `out` gets what `merge` would give, to the bit. A later `merge` needs an
    /// `attend` first.
    pub fn attend_merged(
        &mut self,
        q: &GpuQueries,
        scale: f32,
        host: Option<&GpuPartials>,
        out: &mut GpuPartials,
    ) -> Result<(), GpuError> {
        self.check_merge_buffers(host, out)?;
        self.launch_attend(q, scale, Some((host, out)))?;
        if self.attended == Some(0) {
            // An empty window launches no attention: the merge kernel passes the host's part on.
            self.merge(host, out)?;
        }
        Ok(())
    }

    /// The attention launch; with `fused`, its last blocks merge into the output partials.
    fn launch_attend(
        &mut self,
        q: &GpuQueries,
        scale: f32,
        fused: Option<(Option<&GpuPartials>, &mut GpuPartials)>,
    ) -> Result<(), GpuError> {
        // Set again only once the launch is submitted: `merge` trusts it to fit the buffers.
        self.attended = None;
        self.gpu.check_same(&q.gpu, "the queries")?;
        expect_shape((q.heads, q.dim), (self.q_heads, self.dim), "queries")?;
        let (splits, per_split, chunks, clustered) = self.plan();
        if splits == 0 {
            self.attended = Some(0);
            return Ok(());
        }
        if let (Some((host, out)), Some((kernel, _)), true) = (&fused, &self.cluster, clustered) {
            let grid = (splits as u32, self.kv_heads as u32, chunks as u32);
            self.launch_cluster(kernel, grid, q, scale, per_split, *host, out)?;
            // The splits' partials stayed in the cluster: `merge` needs an `attend` first.
            return Ok(());
        }
        if splits > self.split_capacity {
            let split_o = self.gpu.alloc(self.q_heads * splits * self.dim)?;
            let split_ml = self.gpu.alloc(self.q_heads * splits * 2)?;
            self.gpu.freed();
            self.split_o = split_o;
            self.split_ml = split_ml;
            self.split_capacity = splits;
        }
        let cfg = LaunchConfig {
            grid_dim: (splits as u32, self.kv_heads as u32, chunks as u32),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (len, kv_heads, group, per_split) =
            (self.len as i32, self.kv_heads as i32, (self.q_heads / self.kv_heads) as i32, per_split as i32);
        let is_fused = i32::from(fused.is_some());
        let has_host = i32::from(fused.as_ref().is_some_and(|(host, _)| host.is_some()));
        // Unfused, the kernel reads neither `host` nor `out`: any device pointers fill the slots.
        // Shared borrows pass the pointers as well as exclusive ones would: event tracking is off
        // (mod.rs), so an argument's mutability records nothing.
        let (host_data, out_data) = match &fused {
            Some((host, out)) => (host.map_or(&self.split_ml, |h| &h.data), &out.data),
            None => (&self.split_ml, &self.split_ml),
        };
        let mut launch = self.gpu.stream.launch_builder(&self.attend_kernel);
        launch
            .arg(&self.keys)
            .arg(&self.values)
            .arg(&q.data)
            .arg(&self.split_o)
            .arg(&self.split_ml)
            .arg(&len)
            .arg(&kv_heads)
            .arg(&group)
            .arg(&per_split)
            .arg(&scale)
            .arg(&is_fused)
            .arg(host_data)
            .arg(&has_host)
            .arg(out_data)
            .arg(&mut self.done);
        // SAFETY: the arguments match `attend_d{dim}(const Vec16* keys, const Vec16* values,
        // const float* q, float* split_o, float* split_ml, int len, int kv_heads, int group,
        // int tokens_per_block, float scale, int fused, const float* host, int has_host,
        // float* out, unsigned* done)` in order and type, and the kernel was chosen for this
        // window's head dim. Block (s, h, z) reads tokens [s·per_split, (s+1)·per_split) ∩
        // [0, len) of kv head h < kv_heads: `keys` and `values` hold capacity ≥ len tokens of
        // kv_heads × dim f16 (16-byte aligned allocations, dim a multiple of 8); it reads the q
        // rows of q heads h·group + z·GMAX + [0, GMAX) ∩ group, within the q_heads × dim floats
        // `q` holds (checked above); it writes split s < splits of those heads, within the
        // q_heads × splits × dim and × 2 floats of `split_o` and `split_ml` (grown above).
        // grid.x = splits covers every token once (splits · per_split ≥ len), and grid.z =
        // chunks covers the group. Fused, it counts in done[h·chunks + z] (kv_heads × chunks
        // zeroed u32 at `new`, each back to 0 when its last block has counted), and that last
        // block reads those splits and host's q_heads × (dim + 2) floats when has_host is 1,
        // and writes those q heads of out's q_heads × (dim + 2) floats (both shapes checked by
        // `check_merge_buffers`); splits + 1 ≤ MAX_PARTS, its shared weights (MAX_SPLITS).
        // Unfused it touches neither host, out nor done.
        unsafe { launch.launch(cfg) }?;
        self.attended = Some(splits);
        Ok(())
    }

    /// The fused launch as clusters (`attend_cluster_d{dim}`): grid (splits, kv heads, chunks),
    /// a cluster per (kv head, chunk) of its `splits` blocks.
    #[allow(clippy::too_many_arguments)]
    fn launch_cluster(
        &self,
        kernel: &CudaFunction,
        grid: (u32, u32, u32),
        q: &GpuQueries,
        scale: f32,
        per_split: usize,
        host: Option<&GpuPartials>,
        out: &GpuPartials,
    ) -> Result<(), GpuError> {
        let stream = &self.gpu.stream;
        stream.context().bind_to_thread()?;
        // Event tracking is off (mod.rs): the pointers come with nothing to record.
        let (mut keys, mut values, mut queries) =
            (self.keys.device_ptr(stream).0, self.values.device_ptr(stream).0, q.data.device_ptr(stream).0);
        // Without host partials the kernel reads none; any device pointer fills the slot.
        let mut host_data = host.map_or(&self.split_ml, |h| &h.data).device_ptr(stream).0;
        let mut out_data = out.data.device_ptr(stream).0;
        let (mut len, mut kv_heads, mut group, mut per_split, mut scale) =
            (self.len as i32, self.kv_heads as i32, (self.q_heads / self.kv_heads) as i32, per_split as i32, scale);
        let mut has_host = i32::from(host.is_some());
        fn arg<T>(value: &mut T) -> *mut c_void {
            (value as *mut T).cast()
        }
        let mut args = [
            arg(&mut keys),
            arg(&mut values),
            arg(&mut queries),
            arg(&mut len),
            arg(&mut kv_heads),
            arg(&mut group),
            arg(&mut per_split),
            arg(&mut scale),
            arg(&mut host_data),
            arg(&mut has_host),
            arg(&mut out_data),
        ];
        let mut attribute = cluster_attribute(grid.0);
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: THREADS,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: stream.cu_stream(),
            attrs: &mut attribute,
            numAttrs: 1,
        };
        // SAFETY: `args` points to one value per parameter of `attend_cluster_d{dim}(const
        // Vec16* keys, const Vec16* values, const float* q, int len, int kv_heads, int group,
        // int tokens_per_block, float scale, const float* host, int has_host, float* out)`, in
        // order and of its type (device pointers are CUdeviceptr), all alive for the call, which
        // copies them; the kernel was chosen for this window's head dim. The clusters are
        // (splits, 1, 1) blocks, splits = grid.x a size the driver runs clusters of for this
        // kernel (`plan` checks `cluster_capacity`, mod.rs) ≤ MAX_CLUSTER, so every block of a
        // (kv head, chunk) is in one cluster, as the kernel's merge in shared memory requires. Block
        // (s, h, z) reads what `attend_d{dim}` reads (see `launch_attend`): tokens of kv head
        // h < kv_heads within len ≤ capacity, q rows h·group + z·GMAX + [0, GMAX) ∩ group of
        // `q`'s q_heads × dim floats (checked by the caller); it reads host's q_heads × (dim + 2)
        // floats only when has_host is 1, and writes those q heads of out's q_heads × (dim + 2)
        // floats (both shapes checked by `check_merge_buffers`). The stream and the context
        // (made current above) are this window's.
        unsafe { sys::cuLaunchKernelEx(&config, kernel.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()?;
        Ok(())
    }

    /// Merges the partials of the last [`attend`](Self::attend) with `host` (one partial per q
    /// head, from the host: the retrieved set's attention), one launch, into `out`: per q head
    /// the exact combination, as [`Partial::merge`] of the window's and the host's partial
    /// would give. Without `host`, `out` is the window's own partial.
    pub fn merge(&self, host: Option<&GpuPartials>, out: &mut GpuPartials) -> Result<(), GpuError> {
        let splits = self.attended.ok_or_else(|| {
            GpuError::Invalid("merge needs the window's attend first (again after load or append)".into())
        })?;
        self.check_merge_buffers(host, out)?;
        let group = self.q_heads / self.kv_heads;
        let cfg = LaunchConfig {
            grid_dim: (self.kv_heads as u32, group.div_ceil(GMAX) as u32, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // Without host partials the kernel reads none; any device pointer fills the slot.
        let host_data = host.map_or(&self.split_ml, |h| &h.data);
        let (splits_arg, has_host, q_heads, group, dim) =
            (splits as i32, i32::from(host.is_some()), self.q_heads as i32, group as i32, self.dim as i32);
        let mut launch = self.gpu.stream.launch_builder(&self.gpu.device.merge);
        launch
            .arg(&self.split_o)
            .arg(&self.split_ml)
            .arg(&splits_arg)
            .arg(host_data)
            .arg(&has_host)
            .arg(&mut out.data)
            .arg(&q_heads)
            .arg(&group)
            .arg(&dim);
        // SAFETY: the arguments match `merge(const float* split_o, const float* split_ml, int
        // splits, const float* host, int has_host, float* out, int q_heads, int group, int dim)`
        // in order and type. Block (h, z) reads splits [0, splits) of q heads h·group + z·GMAX
        // + [0, GMAX) ∩ group, which the last attend wrote (splits ≤ split_capacity, so within the
        // q_heads × split_capacity × dim and × 2 floats of `split_o` and `split_ml`; with no
        // splits it reads none); it reads `host` only when has_host is 1, and then within its
        // q_heads × (dim + 2) floats; it writes those heads of `out`, q_heads × (dim + 2)
        // floats (shapes checked above). splits + 1 ≤ MAX_PARTS, the kernel's shared weights
        // (MAX_SPLITS in `plan`).
        unsafe { launch.launch(cfg) }?;
        Ok(())
    }

    /// The merge's output and host partials: of this window's `Gpu`, with its shape.
    fn check_merge_buffers(&self, host: Option<&GpuPartials>, out: &GpuPartials) -> Result<(), GpuError> {
        self.gpu.check_same(&out.gpu, "the output partials")?;
        expect_shape((out.heads, out.dim), (self.q_heads, self.dim), "output partials")?;
        if let Some(host) = host {
            self.gpu.check_same(&host.gpu, "the host partials")?;
            expect_shape((host.heads, host.dim), (self.q_heads, self.dim), "host partials")?;
        }
        Ok(())
    }

    /// Attention of `q` (`q_heads × head_dim`) over the window, merged with `host` (one partial
    /// per q head) when given: uploads, one fused launch and the download in one call, for callers
    /// that have the host partials before the window's attention starts. Returns one partial
    /// per q head; its [`Partial::lse`] is the log-sum-exp of everything merged.
    pub fn attention(&mut self, q: &[f32], scale: f32, host: Option<&[Partial]>) -> Result<Vec<Partial>, GpuError> {
        let mut staging = match self.staging.take() {
            Some(staging) => staging,
            None => Staging {
                q: GpuQueries::new(&self.gpu, self.q_heads, self.dim)?,
                host: GpuPartials::new(&self.gpu, self.q_heads, self.dim)?,
                out: GpuPartials::new(&self.gpu, self.q_heads, self.dim)?,
            },
        };
        let result = self.attention_through(&mut staging, q, scale, host);
        self.staging = Some(staging);
        result
    }

    fn attention_through(
        &mut self,
        staging: &mut Staging,
        q: &[f32],
        scale: f32,
        host: Option<&[Partial]>,
    ) -> Result<Vec<Partial>, GpuError> {
        staging.q.upload(q)?;
        if let Some(host) = host {
            staging.host.upload(host)?;
        }
        self.attend_merged(&staging.q, scale, host.map(|_| &staging.host), &mut staging.out)?;
        staging.out.download()
    }
}

/// `[kv_heads][tokens][dim]` as the window's `[tokens][kv_heads][dim]`, in raw f16 bits.
fn token_major(rows: &[f16], kv_heads: usize, dim: usize) -> Vec<u16> {
    let rows: &[u16] = bytemuck::cast_slice(rows);
    let tokens = rows.len() / (kv_heads * dim);
    if kv_heads == 1 || tokens == 1 {
        return rows.to_vec();
    }
    let mut out = vec![0u16; rows.len()];
    for (h, head) in rows.chunks_exact(tokens * dim).enumerate() {
        for (t, row) in head.chunks_exact(dim).enumerate() {
            out[(t * kv_heads + h) * dim..][..dim].copy_from_slice(row);
        }
    }
    out
}

fn positive(values: &[(usize, &str)]) -> Result<(), GpuError> {
    match values.iter().find(|(v, _)| *v == 0) {
        Some((_, name)) => Err(GpuError::Invalid(format!("{name} must be positive"))),
        None => Ok(()),
    }
}

fn expect_len(got: usize, want: usize, what: &str) -> Result<(), GpuError> {
    if got == want {
        Ok(())
    } else {
        Err(GpuError::Invalid(format!("{what}: {got} elements, expected {want}")))
    }
}

fn expect_shape(got: (usize, usize), want: (usize, usize), what: &str) -> Result<(), GpuError> {
    if got == want {
        Ok(())
    } else {
        Err(GpuError::Invalid(format!(
            "{what}: {} heads × {} dims, the window has {} × {}",
            got.0, got.1, want.0, want.1
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_major_interleaves_the_heads() {
        // 2 kv heads × 3 tokens × 2 dims, element = 100·head + 10·token + dim.
        let rows: Vec<f16> = (0..2)
            .flat_map(|h| (0..3).flat_map(move |t| (0..2).map(move |d| f16::from_f32((100 * h + 10 * t + d) as f32))))
            .collect();
        let got: Vec<f32> = token_major(&rows, 2, 2).iter().map(|&b| f16::from_bits(b).to_f32()).collect();
        assert_eq!(got, [0., 1., 100., 101., 10., 11., 110., 111., 20., 21., 120., 121.]);
    }
}
