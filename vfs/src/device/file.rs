//! pread/pwrite with O_DIRECT: the fallback when io_uring is refused, and a device that can be
//! asked for. Operations of a batch run one after another (queue depth 1).

use super::{byte_len, check_op, BlockDevice, DeviceInfo, IoOp};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub struct FileDevice {
    file: File,
    path: String,
    block_size: usize,
    num_blocks: u64,
    note: Option<String>,
}

impl FileDevice {
    pub(crate) fn new(
        path: &Path,
        file: File,
        block_size: usize,
        note: Option<String>,
    ) -> io::Result<Self> {
        let num_blocks = byte_len(&file)? / block_size as u64;
        Ok(FileDevice {
            file,
            path: path.display().to_string(),
            block_size,
            num_blocks,
            note,
        })
    }

    fn run(&self, op: &mut IoOp<'_>) -> io::Result<()> {
        check_op(op, self.block_size, self.num_blocks)?;
        let offset = op.block() * self.block_size as u64;
        match op {
            IoOp::Read { buf, .. } => self.file.read_exact_at(buf, offset),
            IoOp::Write { buf, .. } => self.file.write_all_at(buf, offset),
        }
    }
}

impl BlockDevice for FileDevice {
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn num_blocks(&self) -> u64 {
        self.num_blocks
    }
    fn info(&self) -> DeviceInfo {
        DeviceInfo {
            kind: "file",
            path: self.path.clone(),
            note: self.note.clone(),
            queue_depth: 1,
        }
    }
    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<io::Result<()>> {
        ops.iter_mut().map(|op| self.run(op)).collect()
    }
    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }
}
