//! The GPU half of the kernels: window attention and the log-sum-exp merge on a CUDA device
//! (DESIGN.md, "Partial attention and merge": the window is attended on the GPU, the retrieved
//! set on the CPU, and the parts are merged exactly), the exact kNN of the index build
//! ([`Gpu::knn`]), and the PQ scan of a compact context's codes held in device memory
//! ([`PqScanner`]).
//!
//! Everything here is optional at run time. [`Gpu::open`] either returns a device with the
//! kernels compiled and loaded, or a [`GpuUnavailable`] that says why not (no NVIDIA driver, no
//! device, no NVRTC, `CTXFS_GPU=off`), and the caller stays on the CPU path
//! ([`Partial`](crate::Partial)). The crate links no CUDA library: cudarc loads libcuda and
//! libnvrtc when first used, and this module checks that they load before cudarc is asked
//! to (cudarc panics when a library is missing). See `load.rs` for how NVRTC is found.
//!
//! The kernels (`kernels.cu`) are compiled by NVRTC for the device's own architecture (a cubin,
//! not PTX, so an NVRTC newer than the driver still works), once per process, and cached on
//! disk under `$XDG_CACHE_HOME/ctxfs` (or `~/.cache/ctxfs`) keyed by a hash of the source, the
//! options and the architecture.
//!
//! Layouts (all row-major):
//! * a [`GpuWindow`] keeps its keys and values token-major, `[capacity][kv_heads][head_dim]`
//!   f16, so that appending tokens and growing are single contiguous copies; its `load` and
//!   `append` take the project's `[kv_heads][tokens][head_dim]` (DESIGN.md, "Data exchange");
//! * [`GpuQueries`]: `[q_heads][head_dim]` f32;
//! * [`GpuPartials`]: o `[q_heads][head_dim]`, then m `[q_heads]`, then l `[q_heads]`, f32.
//!
//! GQA: q head h reads kv head h / (q_heads / kv_heads).

mod codes;
mod compile;
mod knn;
mod load;
mod window;

pub use codes::{GpuCodes, PqScanner, MAX_GPU_SUBSPACES};
pub use window::{GpuPartials, GpuQueries, GpuWindow};

use cudarc::driver::sys::{
    self, CUdevice_attribute, CUevent_flags, CUfunction_attribute, CUgraphInstantiate_flags, CUstreamCaptureMode,
};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaSlice, CudaStream, DeviceRepr, DriverError, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The most blocks a launch's grid has along y.
const MAX_GRID_Y: usize = 65_535;

/// Head dimensions with a compiled window-attention kernel (`attend_d{D}` in `kernels.cu`).
pub const HEAD_DIMS: [usize; 5] = [64, 80, 96, 128, 256];

/// Why the GPU path is unavailable, in words for the user; the CPU path serves instead.
#[derive(Debug, Clone, thiserror::Error)]
#[error("GPU unavailable: {reason}")]
pub struct GpuUnavailable {
    reason: String,
}

impl GpuUnavailable {
    fn new(reason: impl Into<String>) -> GpuUnavailable {
        GpuUnavailable { reason: reason.into() }
    }

    pub fn reason(&self) -> &str {
        &self.reason
    }
}

/// A failed GPU operation on a device that opened.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The driver refused or failed the operation.
    #[error("CUDA: {0}")]
    Cuda(String),
    /// Arguments that do not fit: lengths, shapes, buffers of another [`Gpu`].
    #[error("{0}")]
    Invalid(String),
}

impl From<DriverError> for GpuError {
    fn from(e: DriverError) -> GpuError {
        GpuError::Cuda(e.to_string())
    }
}

/// What is opened once per process: the context, the loaded kernels and the device's
/// properties.
struct Device {
    ctx: Arc<CudaContext>,
    /// The window-attention kernels for each of [`HEAD_DIMS`], in that order.
    attend: Vec<AttendKernels>,
    merge: CudaFunction,
    /// The kNN's scores and its selection of each row's best (`knn.rs`).
    knn_scores: CudaFunction,
    knn_select: CudaFunction,
    /// The PQ scan of codes in device memory, and the passes over its scores that keep only
    /// each query's best (`codes.rs`).
    pq_scan: CudaFunction,
    pq_sample: CudaFunction,
    pq_reaching: CudaFunction,
    name: String,
    capability: (u32, u32),
    multiprocessors: usize,
    memory_bandwidth: Option<f64>,
    nvrtc: String,
}

/// The window-attention kernels of one head dim.
#[derive(Clone)]
struct AttendKernels {
    /// `attend_d{D}`: the splits' partials, merged by the last block when fused.
    attend: CudaFunction,
    /// How many blocks of `attend` the device runs at once.
    resident: usize,
    /// `attend_cluster_d{D}`, the attention and the merge in one launch of thread-block
    /// clusters, and how many clusters of each size (the index) the device runs at once;
    /// `None` where the device launches no clusters of at least 2 blocks.
    cluster: Option<(CudaFunction, Vec<usize>)>,
}

/// A CUDA device with the ctxfs kernels loaded, and a stream of its own. Work submitted through
/// one `Gpu` (and the windows and buffers made with it) runs in submission order; separate
/// `Gpu`s (one per session, say) run concurrently. Cloning shares the stream.
#[derive(Clone)]
pub struct Gpu {
    device: Arc<Device>,
    stream: Arc<CudaStream>,
    capture: Arc<Capture>,
}

/// What keeps graphs from using freed memory. A graph replays launches with the device
/// addresses they had, so allocating while capturing is refused (the address would be the
/// graph's own), and every free of a buffer of the stream is counted: a graph replays only
/// while no buffer was freed (or moved by a growing window) since its capture began.
#[derive(Default)]
struct Capture {
    capturing: AtomicBool,
    frees: AtomicU64,
}

/// Launches recorded by [`Gpu::capture`], replayed with one call: a fixed sequence of launches
/// costs one submission instead of one per kernel.
pub struct GpuGraph {
    graph: CudaGraph,
    capture: Arc<Capture>,
    frees: u64,
}

impl GpuGraph {
    /// Replays the recorded launches on the stream they were recorded from (asynchronous),
    /// with the arguments they had: a window attends the tokens it had at the capture.
    pub fn launch(&self) -> Result<(), GpuError> {
        if self.capture.frees.load(Ordering::SeqCst) != self.frees {
            return Err(GpuError::Invalid(
                "a buffer of this Gpu was freed or moved (a window grew, say) since the graph was captured; capture again"
                    .into(),
            ));
        }
        Ok(self.graph.launch()?)
    }
}

/// `CTXFS_GPU=off` (or `0`, `false`, `no`, `cpu`) keeps everything on the CPU.
fn disabled_by_env() -> Option<String> {
    let value = std::env::var("CTXFS_GPU").ok()?;
    matches!(value.to_ascii_lowercase().as_str(), "off" | "0" | "false" | "no" | "cpu")
        .then(|| format!("CTXFS_GPU={value}"))
}

impl Gpu {
    /// Device 0 with the kernels loaded, on a new stream. The driver, NVRTC and the compiled
    /// kernels are set up by the first call in the process; later calls reuse them (or repeat
    /// the first call's reason for failing).
    pub fn open() -> Result<Gpu, GpuUnavailable> {
        if let Some(setting) = disabled_by_env() {
            return Err(GpuUnavailable::new(format!("disabled by {setting}")));
        }
        static DEVICE: OnceLock<Result<Arc<Device>, GpuUnavailable>> = OnceLock::new();
        let device = DEVICE.get_or_init(|| Device::open().map(Arc::new)).clone()?;
        Gpu::on_new_stream(device).map_err(|e| GpuUnavailable::new(format!("cannot create a CUDA stream: {e}")))
    }

    /// The same device on a new stream of its own: work on it runs beside this `Gpu`'s.
    pub fn with_own_stream(&self) -> Result<Gpu, GpuError> {
        Ok(Gpu::on_new_stream(self.device.clone())?)
    }

    fn on_new_stream(device: Arc<Device>) -> Result<Gpu, DriverError> {
        let stream = device.ctx.new_stream()?;
        Ok(Gpu { device, stream, capture: Arc::default() })
    }

    /// The device's name, e.g. "NVIDIA H200".
    pub fn name(&self) -> &str {
        &self.device.name
    }

    pub fn compute_capability(&self) -> (u32, u32) {
        self.device.capability
    }

    pub fn multiprocessors(&self) -> usize {
        self.device.multiprocessors
    }

    /// Peak memory bandwidth in bytes per second, 2 × memory clock × bus width / 8 as the driver
    /// reports them; `None` where it reports neither.
    pub fn memory_bandwidth(&self) -> Option<f64> {
        self.device.memory_bandwidth
    }

    /// Which NVRTC library compiled the kernels (or "cache" when they came from the disk cache).
    pub fn nvrtc(&self) -> &str {
        &self.device.nvrtc
    }

    /// Waits for everything submitted through this `Gpu`.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        Ok(self.stream.synchronize()?)
    }

    /// The device time `submit` takes: CUDA events recorded on the stream before and after
    /// what it submits. Waits for the end event.
    pub fn time(&self, submit: impl FnOnce() -> Result<(), GpuError>) -> Result<Duration, GpuError> {
        let start = self.device.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = self.device.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?;
        start.record(&self.stream)?;
        submit()?;
        end.record(&self.stream)?;
        let ms = start.elapsed_ms(&end)?;
        Ok(Duration::from_secs_f64(f64::from(ms) / 1e3))
    }

    /// Records the launches `submit` makes through this `Gpu` into a graph instead of running
    /// them. Only launches can be recorded: uploads, downloads and allocations fail while
    /// capturing, so run the launches once before capturing them (a window sizes its scratch
    /// buffers on its first attend).
    pub fn capture(&self, submit: impl FnOnce() -> Result<(), GpuError>) -> Result<GpuGraph, GpuError> {
        let frees = self.capture.frees.load(Ordering::SeqCst);
        self.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        self.capture.capturing.store(true, Ordering::SeqCst);
        let submitted = submit();
        self.capture.capturing.store(false, Ordering::SeqCst);
        // End the capture whatever happened, or the stream stays in capture mode.
        let graph = self.stream.end_capture(CUgraphInstantiate_flags(0));
        submitted?;
        let graph = graph?.ok_or_else(|| GpuError::Invalid("nothing was captured".into()))?;
        let graph = GpuGraph { graph, capture: self.capture.clone(), frees };
        if self.capture.frees.load(Ordering::SeqCst) != frees {
            return Err(GpuError::Invalid("a buffer was freed while capturing, and the graph would use it".into()));
        }
        Ok(graph)
    }

    /// A zeroed device buffer of `len` elements on this `Gpu`'s stream.
    fn alloc<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>, GpuError> {
        if self.capture.capturing.load(Ordering::SeqCst) {
            return Err(GpuError::Invalid(
                "allocating while capturing a graph: run the launches once before capturing them".into(),
            ));
        }
        Ok(self.stream.alloc_zeros(len)?)
    }

    /// Notes that a buffer of this `Gpu` is being freed: graphs captured before cannot replay.
    fn freed(&self) {
        self.capture.frees.fetch_add(1, Ordering::SeqCst);
    }

    /// Whether `other` submits to the same stream: buffers may only be combined within one.
    fn same(&self, other: &Gpu) -> bool {
        Arc::ptr_eq(&self.stream, &other.stream)
    }

    fn check_same(&self, other: &Gpu, what: &str) -> Result<(), GpuError> {
        if self.same(other) {
            Ok(())
        } else {
            Err(GpuError::Invalid(format!(
                "{what} belongs to another Gpu (stream); open buffers with the window's Gpu"
            )))
        }
    }

    /// The window-attention kernels for `head_dim`.
    fn attend_kernels(&self, head_dim: usize) -> Result<&AttendKernels, GpuError> {
        HEAD_DIMS.iter().position(|&d| d == head_dim).map(|i| &self.device.attend[i]).ok_or_else(|| {
            GpuError::Invalid(format!("head dim {head_dim} has no GPU kernel (supported: {HEAD_DIMS:?})"))
        })
    }
}

impl Device {
    fn open() -> Result<Device, GpuUnavailable> {
        load::driver()?;
        // `load` keeps cudarc from panicking over a missing library; this catches whatever else
        // a broken installation makes it panic over (a missing symbol, say).
        match std::panic::catch_unwind(AssertUnwindSafe(Device::init)) {
            Ok(device) => device,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .or_else(|| panic.downcast_ref::<&str>().copied())
                    .unwrap_or("(no message)");
                Err(GpuUnavailable::new(format!("the CUDA libraries failed: {message}")))
            }
        }
    }

    fn init() -> Result<Device, GpuUnavailable> {
        let ctx = CudaContext::new(0).map_err(|e| GpuUnavailable::new(format!("no usable CUDA device: {e}")))?;
        // SAFETY: cudarc's event tracking orders a buffer's uses across streams. Every buffer
        // made here is used only on the stream of the `Gpu` that allocated it (the window and
        // buffer methods refuse another `Gpu`'s buffers) and freed in that stream's order, so
        // the tracking is not needed; it would add an event record and wait per buffer to
        // every launch, and waits on events recorded outside a capture break `Gpu::capture`.
        // No buffer exists yet: this context is new.
        unsafe { ctx.disable_event_tracking() };
        let unavailable = |e: DriverError| GpuUnavailable::new(e.to_string());
        let (major, minor) = ctx.compute_capability().map_err(unavailable)?;
        let capability = (major as u32, minor as u32);
        let multiprocessors =
            ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_err(unavailable)? as usize;
        // kHz and bits; a driver may report 0 for the clock.
        let clock = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE).unwrap_or(0);
        let bus = ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH).unwrap_or(0);
        let memory_bandwidth = (clock > 0 && bus > 0).then(|| 2.0 * f64::from(clock) * 1e3 * f64::from(bus) / 8.0);
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());

        let load = |image: Vec<u8>| ctx.load_module(Ptx::from_binary(image));
        let refused = |e: DriverError| GpuUnavailable::new(format!("the driver refused the compiled kernels: {e}"));
        // NVRTC is needed only when the disk cache has no image this driver accepts (one written
        // by another NVRTC, say).
        let cached = compile::cached(capability).and_then(|image| load(image).ok());
        let (module, nvrtc) = match cached {
            Some(module) => (module, "cache".to_string()),
            None => {
                let nvrtc = load::nvrtc()?;
                let image = compile::build(capability).map_err(GpuUnavailable::new)?;
                (load(image).map_err(refused)?, nvrtc)
            }
        };
        let function = |name: &str| {
            module.load_function(name).map_err(|e| GpuUnavailable::new(format!("kernel {name} missing: {e}")))
        };
        // Asked here, where the context is current: cudarc's occupancy query does not make it so,
        // and fails on a thread that has not used CUDA yet (a session's worker, say).
        let resident = |kernel: &CudaFunction| {
            let per_multiprocessor = kernel
                .occupancy_max_active_blocks_per_multiprocessor(window::THREADS, 0, None)
                .map_err(|e| GpuUnavailable::new(format!("the occupancy of the attention kernel: {e}")))?;
            Ok::<_, GpuUnavailable>(multiprocessors * (per_multiprocessor as usize).max(1))
        };
        let attend = HEAD_DIMS
            .iter()
            .map(|d| {
                let attend = function(&format!("attend_d{d}"))?;
                let resident = resident(&attend)?;
                let cluster = function(&format!("attend_cluster_d{d}"))?;
                let cluster = cluster_capacity(&cluster, capability).map(|capacity| (cluster, capacity));
                Ok(AttendKernels { attend, resident, cluster })
            })
            .collect::<Result<_, GpuUnavailable>>()?;
        let merge = function("merge")?;
        let (knn_scores, knn_select) = (function("knn_scores")?, function("knn_select")?);
        let (pq_scan, pq_sample, pq_reaching) =
            (function("pq_scan")?, function("pq_sample")?, function("pq_reaching")?);
        Ok(Device {
            ctx,
            attend,
            merge,
            knn_scores,
            knn_select,
            pq_scan,
            pq_sample,
            pq_reaching,
            name,
            capability,
            multiprocessors,
            memory_bandwidth,
            nvrtc,
        })
    }
}

/// For each cluster size up to [`window::MAX_CLUSTER`] blocks (the index), how many clusters
/// of `kernel` the device runs at once (0: none, or not allowed); `None` where it runs no
/// clusters of at least 2 blocks (before Hopper, sm_90, say). Sizes above 8 are non-portable:
/// allowed on the kernel first, then the driver says whether they fit.
fn cluster_capacity(kernel: &CudaFunction, capability: (u32, u32)) -> Option<Vec<usize>> {
    if capability.0 < 9 {
        return None;
    }
    let non_portable =
        kernel.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1).is_ok();
    let active = |size: usize| {
        if size > 8 && !non_portable {
            return 0;
        }
        let mut attribute = window::cluster_attribute(size as u32);
        let config = sys::CUlaunchConfig {
            gridDimX: size as u32,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: window::THREADS,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: 0,
            hStream: std::ptr::null_mut(),
            attrs: &mut attribute,
            numAttrs: 1,
        };
        let mut clusters = 0;
        // SAFETY: `clusters` is a valid place for the count, `config` a complete launch
        // configuration whose one attribute `attrs` points to (alive for the call), and the
        // function handle is `kernel`'s, loaded in this context, which is current (`init`).
        let asked = unsafe { sys::cuOccupancyMaxActiveClusters(&mut clusters, kernel.cu_function(), &config) };
        if asked.result().is_ok() {
            clusters.max(0) as usize
        } else {
            0
        }
    };
    let capacity: Vec<usize> = (0..=window::MAX_CLUSTER).map(|size| if size == 0 { 0 } else { active(size) }).collect();
    capacity[2..].iter().any(|&n| n > 0).then_some(capacity)
}
