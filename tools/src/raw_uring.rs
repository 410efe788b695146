//! The baseline the benchmarks compare against: a plain O_DIRECT io_uring loop over a scratch
//! file, keeping a fixed number of operations in flight. No checksums, no metadata.

use anyhow::{Context, Result};
use ctxfs_vfs::device::AlignedBuf;
use io_uring::{opcode, types, IoUring};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

pub struct RawFile {
    file: File,
    ring: IoUring,
    /// Set when this made the file ([`RawFile::create`]).
    _scratch: Option<Scratch>,
}

/// A file [`RawFile::create`] made: removed when it drops, and on Ctrl-C or SIGTERM before.
struct Scratch {
    path: PathBuf,
    _on_signal: crate::scratch_files::Registered,
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    Read,
    Write,
}

/// The raw loop's ring; the benchmark measures io_uring itself, so a kernel that refuses it
/// fails the run, saying so.
fn raw_ring() -> Result<IoUring> {
    IoUring::new(256).map_err(|e| match ctxfs_vfs::device::refusal_note(&e) {
        Some(_) => anyhow::anyhow!(
            "the raw io_uring baseline cannot run: io_uring setup refused ({e}); the kernel has it disabled \
             (sysctl kernel.io_uring_disabled) or a seccomp filter blocks it"
        ),
        None => anyhow::Error::new(e).context("cannot set up the raw baseline's io_uring"),
    })
}

impl RawFile {
    /// Creates `path` (which must not exist) of `len` bytes and opens it with O_DIRECT; the
    /// file is removed again when the `RawFile` drops.
    pub fn create(path: &Path, len: u64) -> Result<RawFile> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            // Never over a file that exists: the path is derived from the store's.
            .create_new(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .with_context(|| {
                format!(
                    "cannot create raw scratch file {} (it must not exist; a bench io that was killed leaves it \
                     behind: delete it if so)",
                    path.display()
                )
            })?;
        // The file is this call's: a failure below removes it again, as dropping the RawFile does.
        let scratch = Scratch { path: path.to_path_buf(), _on_signal: crate::scratch_files::register(path) };
        file.set_len(len)?;
        Ok(RawFile { file, ring: raw_ring()?, _scratch: Some(scratch) })
    }

    /// Opens an existing file (a store) with O_DIRECT, to read it raw.
    pub fn open(path: &Path) -> Result<RawFile> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(RawFile { file, ring: raw_ring()?, _scratch: None })
    }

    /// Runs every (offset, len) operation with `depth` in flight; `len` ≤ `slot_len`.
    pub fn run(&mut self, dir: Dir, ops: &[u64], op_len: usize, depth: usize) -> Result<()> {
        let mut bufs: Vec<AlignedBuf> = (0..depth).map(|_| AlignedBuf::zeroed(op_len)).collect();
        for (i, b) in bufs.iter_mut().enumerate() {
            b.fill(i as u8 ^ 0x5a);
        }
        let mut free: Vec<usize> = (0..depth).collect();
        let mut next = 0;
        let mut in_flight = 0;
        while next < ops.len() || in_flight > 0 {
            while next < ops.len() {
                let Some(slot) = free.pop() else { break };
                let ptr = bufs[slot].as_mut_ptr();
                let fd = types::Fd(self.file.as_raw_fd());
                let entry = match dir {
                    Dir::Read => opcode::Read::new(fd, ptr, op_len as u32).offset(ops[next]).build(),
                    Dir::Write => opcode::Write::new(fd, ptr, op_len as u32).offset(ops[next]).build(),
                };
                // SAFETY: `bufs[slot]` lives until this function returns, which happens only
                // after every pushed entry has completed; a slot is reused only after its
                // completion was reaped; the ring has 256 entries and at most `depth` ≤ 256
                // are pushed without a reap.
                unsafe { self.ring.submission().push(&entry.user_data(slot as u64)) }.expect("queue has room");
                next += 1;
                in_flight += 1;
            }
            self.ring.submit_and_wait(1)?;
            let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            for (slot, res) in done {
                in_flight -= 1;
                free.push(slot as usize);
                anyhow::ensure!(
                    res == op_len as i32,
                    "raw {} returned {res}",
                    if dir == Dir::Read { "read" } else { "write" }
                );
            }
        }
        Ok(())
    }

    /// Reads `out.len()` bytes from `offset` into `out` with `depth` operations of `op_len`
    /// bytes in flight (the last one shorter). `out` must be aligned for O_DIRECT, as an
    /// `AlignedBuf` is, and its length a multiple of 4096.
    pub fn read_at(&mut self, offset: u64, out: &mut [u8], op_len: usize, depth: usize) -> Result<()> {
        let ops = out.len().div_ceil(op_len);
        let base = out.as_mut_ptr();
        let (mut next, mut in_flight) = (0, 0);
        while next < ops || in_flight > 0 {
            while next < ops && in_flight < depth {
                let len = op_len.min(out.len() - next * op_len);
                // SAFETY: `next * op_len + len <= out.len()`: the pointer stays inside `out`.
                let ptr = unsafe { base.add(next * op_len) };
                let entry = opcode::Read::new(types::Fd(self.file.as_raw_fd()), ptr, len as u32)
                    .offset(offset + (next * op_len) as u64)
                    .build()
                    .user_data(len as u64);
                // SAFETY: `out` is borrowed mutably until this function returns, which happens
                // only after every pushed read has completed; the reads target disjoint parts
                // of it; at most `depth` ≤ 256 entries are pushed without a reap.
                unsafe { self.ring.submission().push(&entry) }.expect("queue has room");
                next += 1;
                in_flight += 1;
            }
            self.ring.submit_and_wait(1)?;
            let done: Vec<(u64, i32)> = self.ring.completion().map(|c| (c.user_data(), c.result())).collect();
            for (len, res) in done {
                in_flight -= 1;
                anyhow::ensure!(res == len as i32, "raw read returned {res} of {len} bytes");
            }
        }
        Ok(())
    }

    pub fn sync(&self) -> Result<()> {
        Ok(self.file.sync_data()?)
    }
}
