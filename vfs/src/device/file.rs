//! pread/pwrite with O_DIRECT: the fallback when io_uring is refused, and a device that can be
//! asked for. Operations of a batch run one after another (queue depth 1).

use super::{check_op, sync_whole, BlockDevice, DeviceInfo, Geometry, IoOp};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

pub struct FileDevice {
    file: File,
    path: String,
    geo: Geometry,
    note: Option<String>,
}

impl FileDevice {
    pub(crate) fn new(path: &Path, file: File, block_size: usize, note: Option<String>) -> io::Result<Self> {
        let geo = Geometry::of(&file, block_size)?;
        Ok(FileDevice { file, path: path.display().to_string(), geo, note })
    }

    fn run(&self, op: &mut IoOp<'_>) -> io::Result<()> {
        check_op(op, self.geo)?;
        let offset = op.block() * self.geo.block_size as u64;
        match op {
            IoOp::Read { buf, .. } => self.file.read_exact_at(buf, offset),
            IoOp::Write { buf, .. } => self.file.write_all_at(buf, offset),
        }
    }
}

impl BlockDevice for FileDevice {
    fn geometry(&self) -> Geometry {
        self.geo
    }
    fn info(&self) -> DeviceInfo {
        DeviceInfo { kind: "file", path: self.path.clone(), note: self.note.clone(), queue_depth: 1 }
    }
    fn submit(&self, ops: &mut [IoOp<'_>]) -> Vec<io::Result<()>> {
        ops.iter_mut().map(|op| self.run(op)).collect()
    }
    fn flush(&self) -> io::Result<()> {
        sync_whole(&self.file, self.geo, &self.path)
    }
}
