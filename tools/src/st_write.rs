//! Writing safetensors files as a stream: the header is computed up front from the tensors'
//! shapes, then each tensor's bytes are written in order, so a book-scale file never has to
//! be held in memory. The file appears under its name only once complete.

use anyhow::{ensure, Context, Result};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F16,
    F32,
    I64,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::F16 => "F16",
            Dtype::F32 => "F32",
            Dtype::I64 => "I64",
        }
    }
    fn size(self) -> u64 {
        match self {
            Dtype::F16 => 2,
            Dtype::F32 => 4,
            Dtype::I64 => 8,
        }
    }
}

pub struct TensorSpec {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
}

impl TensorSpec {
    fn bytes(&self) -> u64 {
        self.shape.iter().product::<usize>() as u64 * self.dtype.size()
    }
}

pub struct StreamWriter {
    out: BufWriter<std::fs::File>,
    tmp: PathBuf,
    /// Removes `tmp` on Ctrl-C.
    _scratch: crate::scratch_files::Registered,
    path: PathBuf,
    sizes: Vec<(String, u64)>,
    next: usize,
    written: u64,
}

impl StreamWriter {
    /// Starts writing `path`, which must not exist unless `replace` is given; even then it
    /// must be a regular file (a directory, a link, a device or a pipe there is never
    /// replaced).
    pub fn create(
        path: &Path,
        specs: &[TensorSpec],
        metadata: &[(&str, String)],
        replace: bool,
    ) -> Result<StreamWriter> {
        refuse_target(path, replace)?;
        let mut header = serde_json::Map::new();
        let meta: serde_json::Map<String, serde_json::Value> =
            metadata.iter().map(|(k, v)| (k.to_string(), v.clone().into())).collect();
        header.insert("__metadata__".into(), meta.into());
        let mut at = 0u64;
        for s in specs {
            let end = at + s.bytes();
            header.insert(
                s.name.clone(),
                serde_json::json!({"dtype": s.dtype.name(), "shape": s.shape, "data_offsets": [at, end]}),
            );
            at = end;
        }
        let mut json = serde_json::to_vec(&serde_json::Value::Object(header))?;
        while json.len() % 8 != 0 {
            json.push(b' ');
        }
        let tmp = path.with_extension("safetensors.partial");
        let file = std::fs::File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        let mut w = StreamWriter {
            out: BufWriter::with_capacity(1 << 20, file),
            _scratch: crate::scratch_files::register(&tmp),
            tmp,
            path: path.to_path_buf(),
            sizes: specs.iter().map(|s| (s.name.clone(), s.bytes())).collect(),
            next: 0,
            written: 0,
        };
        // Written through `w`: if the header cannot be, dropping it removes the file.
        w.out.write_all(&(json.len() as u64).to_le_bytes())?;
        w.out.write_all(&json)?;
        Ok(w)
    }

    /// Appends bytes of the current tensor; moves to the next tensor when it is complete.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let mut rest = bytes;
        while !rest.is_empty() {
            ensure!(self.next < self.sizes.len(), "more data than the tensors declared");
            let (name, size) = &self.sizes[self.next];
            let take = ((size - self.written) as usize).min(rest.len());
            self.out.write_all(&rest[..take]).with_context(|| format!("writing {name} to {}", self.tmp.display()))?;
            self.written += take as u64;
            rest = &rest[take..];
            if self.written == *size {
                self.next += 1;
                self.written = 0;
            }
        }
        Ok(())
    }

    /// Checks every tensor is complete and syncs the file, still under its temporary name.
    fn seal(&mut self) -> Result<()> {
        while self.next < self.sizes.len() && self.sizes[self.next].1 == 0 {
            self.next += 1;
        }
        ensure!(
            self.next == self.sizes.len(),
            "tensor {} is incomplete",
            self.sizes.get(self.next).map_or("?", |s| s.0.as_str())
        );
        self.out
            .flush()
            .and_then(|()| self.out.get_ref().sync_all())
            .with_context(|| format!("writing {}", self.tmp.display()))
    }

    /// Seals every file, then moves them all into place: of files that belong together (a
    /// context and its queries), none appears when writing any of them fails.
    pub fn finish_together(mut files: Vec<StreamWriter>) -> Result<()> {
        for f in &mut files {
            f.seal()?;
        }
        for f in &files {
            std::fs::rename(&f.tmp, &f.path).with_context(|| format!("cannot move {} into place", f.path.display()))?;
        }
        Ok(())
    }
}

/// Fails unless `path` is free to write: absent, or a regular file and `replace` given.
fn refuse_target(path: &Path, replace: bool) -> Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("cannot look at {}", path.display())),
    };
    ensure!(
        meta.is_file(),
        "{} exists and is not a regular file (a directory, link, device or pipe); choose another output path",
        path.display()
    );
    ensure!(replace, "{} already exists; pass --force to replace it", path.display());
    Ok(())
}

impl Drop for StreamWriter {
    fn drop(&mut self) {
        // An unfinished file is removed; a finished one was renamed already.
        let _ = std::fs::remove_file(&self.tmp);
    }
}
