//! io_uring with O_DIRECT: the default device. The file is registered with each ring (fixed
//! file), saving a file-table lookup per operation. Buffers are not registered: they belong
//! to callers (the buffer manager's frames, the writer's batches) and registering them per
//! batch costs more than it saves.

use super::{check_op, sync_whole, BlockDevice, DeviceInfo, Geometry, IoOp};
use io_uring::{opcode, types, IoUring};
use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::sync::Mutex;

/// Entries per ring; a batch larger than this is pipelined through the ring.
pub const RING_DEPTH: u32 = 128;

pub struct UringDevice {
    file: File,
    path: String,
    geo: Geometry,
    /// Idle rings. A thread takes one for the length of a batch, so concurrent callers never
    /// share a submission queue and need no lock while their I/O runs.
    rings: Mutex<Vec<IoUring>>,
}

impl UringDevice {
    pub(crate) fn new(path: &Path, file: File, block_size: usize) -> io::Result<Self> {
        let geo = Geometry::of(&file, block_size)?;
        let dev = UringDevice { file, path: path.display().to_string(), geo, rings: Mutex::new(Vec::new()) };
        // Set up one ring now, so that a refusal (EPERM, ENOSYS) shows at open time.
        let ring = dev.new_ring()?;
        dev.rings.lock().unwrap_or_else(|p| p.into_inner()).push(ring);
        Ok(dev)
    }

    fn new_ring(&self) -> io::Result<IoUring> {
        // Completions are reaped by the thread that submitted them, which waits in the kernel
        // for them (`run_batch`): their work can wait for that thread's next entry instead of
        // interrupting it (kernels before 5.19 refuse the flag: a plain ring then).
        let ring = match IoUring::builder().setup_coop_taskrun().build(RING_DEPTH) {
            Ok(ring) => ring,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => IoUring::new(RING_DEPTH)?,
            Err(e) => return Err(e),
        };
        ring.submitter().register_files(&[self.file.as_raw_fd()])?;
        Ok(ring)
    }

    fn take_ring(&self) -> io::Result<IoUring> {
        let idle = self.rings.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match idle {
            Some(ring) => Ok(ring),
            None => self.new_ring(),
        }
    }

    fn return_ring(&self, ring: IoUring) {
        self.rings.lock().unwrap_or_else(|p| p.into_inner()).push(ring);
    }

    /// Runs the valid operations of a batch through `ring`, resubmitting short transfers,
    /// and returns only when nothing of the batch is left in flight.
    fn run_batch(&self, ring: &mut IoUring, ops: &mut [IoOp<'_>], results: &mut [io::Result<()>]) {
        let mut done = vec![0usize; ops.len()];
        let mut queue: VecDeque<usize> = (0..ops.len()).filter(|&i| results[i].is_ok()).collect();
        let mut in_flight = 0usize;
        loop {
            while in_flight < RING_DEPTH as usize {
                let Some(i) = queue.pop_front() else { break };
                let offset = ops[i].block() * self.geo.block_size as u64 + done[i] as u64;
                let entry = match &mut ops[i] {
                    IoOp::Read { buf, .. } => {
                        let rest = &mut buf[done[i]..];
                        opcode::Read::new(types::Fixed(0), rest.as_mut_ptr(), rest.len() as u32).offset(offset).build()
                    }
                    IoOp::Write { buf, .. } => {
                        let rest = &buf[done[i]..];
                        opcode::Write::new(types::Fixed(0), rest.as_ptr(), rest.len() as u32).offset(offset).build()
                    }
                };
                // SAFETY: the entry points into a buffer borrowed by `ops` for the whole of this
                // call, and this function does not return before every pushed entry has
                // completed (`in_flight` reaches 0), so the kernel never touches freed memory.
                // The queue has room: at most RING_DEPTH entries are pushed before a reap.
                let pushed = unsafe { ring.submission().push(&entry.user_data(i as u64)) };
                debug_assert!(pushed.is_ok(), "submission queue full below its depth");
                in_flight += 1;
            }
            if in_flight == 0 {
                return;
            }
            if let Err(e) = ring.submit_and_wait(1) {
                // EINTR, EAGAIN and EBUSY are transient. Anything else: entries are still in
                // flight, so keep reaping and waiting; buffers must not be released early.
                if !matches!(e.raw_os_error(), Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)) {
                    std::thread::sleep(std::time::Duration::from_millis(1));
                }
            }
            for cqe in ring.completion() {
                let i = cqe.user_data() as usize;
                in_flight -= 1;
                let res = cqe.result();
                if res == -libc::EAGAIN || res == -libc::EINTR {
                    queue.push_back(i);
                } else if res < 0 {
                    results[i] = Err(io::Error::from_raw_os_error(-res));
                } else if res == 0 {
                    results[i] = Err(io::Error::new(io::ErrorKind::UnexpectedEof, "device returned no data"));
                } else {
                    done[i] += res as usize;
                    if done[i] < ops[i].len() {
                        queue.push_back(i);
                    }
                }
            }
        }
    }
}

impl BlockDevice for UringDevice {
    fn geometry(&self) -> Geometry {
        self.geo
    }
    fn info(&self) -> DeviceInfo {
        DeviceInfo { kind: "uring", path: self.path.clone(), note: None, queue_depth: RING_DEPTH }
    }
    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<io::Result<()>> {
        let mut results: Vec<io::Result<()>> = ops.iter().map(|op| check_op(op, self.geo)).collect();
        let mut ring = match self.take_ring() {
            Ok(ring) => ring,
            Err(e) => return ops.iter().map(|_| Err(io::Error::new(e.kind(), e.to_string()))).collect(),
        };
        self.run_batch(&mut ring, ops, &mut results);
        self.return_ring(ring);
        results
    }
    fn flush(&self) -> io::Result<()> {
        sync_whole(&self.file, self.geo, &self.path)
    }
}
