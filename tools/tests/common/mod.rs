//! What the `ctxfs` binary's tests share: running it, scratch directories on a disk file
//! system, small generated contexts, and reading a stored context back.
#![allow(dead_code)]

use serde_json::Value;
use std::path::Path;
use std::process::{Command, Output};

/// Runs ctxfs in `cwd` with `env` set (and `CTXFS_DEVICE` unset: each test says its device).
pub fn ctxfs_in(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ctxfs"));
    cmd.current_dir(cwd).args(args).env_remove("CTXFS_DEVICE").envs(env.iter().copied());
    cmd.output().expect("run ctxfs")
}

/// Starts ctxfs with `args` (and `CTXFS_DEVICE` unset), its standard output and error piped.
pub fn spawn_piped<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_ctxfs"))
        .args(args)
        .env_remove("CTXFS_DEVICE")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start ctxfs")
}

pub fn ctxfs(args: &[&str]) -> Output {
    ctxfs_in(Path::new("."), args, &[])
}

/// Runs ctxfs in `cwd`, which must succeed; its standard output.
pub fn ok_in(cwd: &Path, args: &[&str]) -> String {
    let out = ctxfs_in(cwd, args, &[]);
    assert!(
        out.status.success(),
        "ctxfs {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

pub fn ok(args: &[&str]) -> String {
    ok_in(Path::new("."), args)
}

pub fn json(args: &[&str]) -> Value {
    serde_json::from_str(&ok(args)).unwrap_or_else(|e| panic!("ctxfs {args:?}: not JSON: {e}"))
}

pub fn tmp() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

pub fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// Runs `ctxfs gen OUT` with `flags` (split at spaces), which must succeed; its standard output.
pub fn gen(out: &Path, flags: &str) -> String {
    ok(&[&["gen", p(out)][..], &flags.split_whitespace().collect::<Vec<_>>()].concat())
}

/// A small generated context, for tests that import many times.
pub fn small_context(dir: &Path) -> std::path::PathBuf {
    let ctx = dir.join("small.safetensors");
    gen(&ctx, "--tokens 2048 --layers 1 --q-heads 2 --kv-heads 1 --head-dim 64 --queries 64 --decode-queries 1");
    ctx
}

/// A store of `size` at `dir`/s.ctxfs holding [`small_context`] as `name`: (the context
/// file, the store).
pub fn small_store(dir: &Path, size: &str, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let ctx = small_context(dir);
    let store = dir.join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", size]);
    ok(&["import", p(&store), p(&ctx), "--name", name]);
    (ctx, store)
}

/// The names of a store's live contexts, as `inspect --json` lists them.
pub fn context_names(store: &Path) -> Vec<String> {
    let v = json(&["inspect", p(store), "--json"]);
    v["contexts"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap().to_string()).collect()
}

pub fn stderr_of(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Every block of every stream of a context, as one hash per stream.
pub fn context_digest(snap: &ctxfs_vfs::Snapshot, name: &str) -> Vec<u64> {
    use std::hash::{Hash, Hasher};
    let ctx = snap.context(name).unwrap();
    let shape = ctx.record().shape;
    let mut out = vec![{
        let mut h = std::collections::hash_map::DefaultHasher::new();
        ctx.tokens().unwrap().hash(&mut h);
        h.finish()
    }];
    for layer in 0..shape.layers {
        for head in 0..shape.kv_heads {
            for which in [ctxfs_vfs::FileStream::Index, ctxfs_vfs::FileStream::Data] {
                let s = ctx.stream(layer, head, which).unwrap();
                let mut h = std::collections::hash_map::DefaultHasher::new();
                for b in s.read_range(0, s.blocks()) {
                    b.unwrap_or_else(|e| panic!("{name} layer {layer} head {head}: {e}")).payload().hash(&mut h);
                }
                out.push(h.finish());
            }
        }
    }
    out
}

/// The device blocks of a context's vector files.
pub fn device_blocks(snap: &ctxfs_vfs::Snapshot, name: &str) -> std::collections::BTreeSet<u64> {
    let ctx = snap.context(name).unwrap();
    let shape = ctx.record().shape;
    let mut out = std::collections::BTreeSet::new();
    for layer in 0..shape.layers {
        for head in 0..shape.kv_heads {
            for which in [ctxfs_vfs::FileStream::Index, ctxfs_vfs::FileStream::Data] {
                let s = ctx.stream(layer, head, which).unwrap();
                out.extend((0..s.blocks()).map(|l| s.locate(l).unwrap().0));
            }
        }
    }
    out
}
