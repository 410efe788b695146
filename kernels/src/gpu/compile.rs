//! Compiling the kernels with NVRTC, and the disk cache of compiled images.
//!
//! NVRTC builds a cubin for the device's own architecture (`sm_90` on Hopper) rather than PTX:
//! the driver refuses PTX from an NVRTC newer than itself (pip readily installs one), while a
//! cubin from any NVRTC of the same major version loads. The image is cached on disk, keyed
//! by a hash of the source, the options and the architecture, so only the first process on a
//! machine pays the compile (about 2 s).

use cudarc::nvrtc::{result, sys};
use std::ffi::CString;
use std::path::{Path, PathBuf};

const SOURCE: &str = include_str!("kernels.cu");

fn options(capability: (u32, u32)) -> Vec<String> {
    vec![format!("--gpu-architecture=sm_{}{}", capability.0, capability.1), "--std=c++17".into()]
}

/// FNV-1a, 64 bits: unlike `DefaultHasher`, the same in every Rust release, as a key on disk
/// must be.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for &byte in part.iter().chain(&[0xff]) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    hash
}

/// `$XDG_CACHE_HOME/ctxfs`, else `~/.cache/ctxfs`.
fn cache_dir() -> Option<PathBuf> {
    let base = match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(&std::env::var_os("HOME")?).join(".cache"),
    };
    Some(base.join("ctxfs"))
}

/// The cache file's name: the architecture, and a hash of the source and the options.
fn cache_name(capability: (u32, u32)) -> String {
    let key = fnv1a(&[SOURCE.as_bytes(), options(capability).join(" ").as_bytes()]);
    format!("kernels-sm{}{}-{key:016x}.cubin", capability.0, capability.1)
}

fn cache_path(capability: (u32, u32)) -> Option<PathBuf> {
    Some(cache_dir()?.join(cache_name(capability)))
}

/// The image the disk cache holds for `capability`, if any.
pub(super) fn cached(capability: (u32, u32)) -> Option<Vec<u8>> {
    let image = std::fs::read(cache_path(capability)?).ok()?;
    image.starts_with(b"\x7fELF").then_some(image)
}

/// Compiles the kernels for `capability` (NVRTC must be loadable: `load::nvrtc`) and stores
/// the image in the disk cache. Storing is best effort: without a writable cache each process
/// compiles once.
pub(super) fn build(capability: (u32, u32)) -> Result<Vec<u8>, String> {
    let image = compile(capability)?;
    if let Some(path) = cache_path(capability) {
        let _ = store(&path, &image);
    }
    Ok(image)
}

/// Writes `image` to `path` through a temporary file and a rename, so that a concurrent
/// reader sees the whole image or none.
fn store(path: &Path, image: &[u8]) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, image)?;
    std::fs::rename(&tmp, path)
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: `self.0` came from `create_program` and is destroyed only here.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

fn compile(capability: (u32, u32)) -> Result<Vec<u8>, String> {
    let arch = format!("sm_{}{}", capability.0, capability.1);
    let source = CString::new(SOURCE).expect("kernels.cu holds no NUL");
    // `source` outlives `program` (dropped first, in reverse order of declaration), as NVRTC
    // requires.
    let program = Program(
        result::create_program(&source, Some(c"ctxfs_kernels.cu"))
            .map_err(|e| format!("NVRTC could not create the program: {e}"))?,
    );
    // SAFETY (this and the calls below): `program.0` is a live program from `create_program`.
    if let Err(e) = unsafe { result::compile_program(program.0, &options(capability)) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(program.0) }.unwrap_or_default();
        // c_char is i8 on x86-64 and u8 on aarch64: the cast is a no-op on one of them.
        #[allow(clippy::unnecessary_cast)]
        let log: Vec<u8> = log.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
        return Err(format!("NVRTC failed to compile the kernels for {arch} ({e}): {}", String::from_utf8_lossy(&log)));
    }
    let mut size = 0usize;
    // SAFETY: as above; `size` is a valid place for the size.
    unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) }
        .result()
        .map_err(|e| format!("NVRTC produced no {arch} image: {e}"))?;
    let mut image = vec![0u8; size];
    // SAFETY: as above; `image` has the `size` bytes NVRTC asked for.
    unsafe { sys::nvrtcGetCUBIN(program.0, image.as_mut_ptr().cast()) }
        .result()
        .map_err(|e| format!("NVRTC produced no {arch} image: {e}"))?;
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs NVRTC, not a GPU: catches errors in kernels.cu on any machine that has NVRTC.
    #[test]
    fn the_kernels_compile_for_hopper() {
        if let Err(e) = super::super::load::nvrtc() {
            eprintln!("skipped: {}", e.reason());
            return;
        }
        let image = compile((9, 0)).unwrap();
        assert!(image.starts_with(b"\x7fELF"));
        for name in [
            "attend_d64",
            "attend_d80",
            "attend_d96",
            "attend_d128",
            "attend_d256",
            "attend_cluster_d64",
            "attend_cluster_d128",
            "merge",
            "knn_scores",
            "knn_select",
            "pq_scan",
            "pq_sample",
            "pq_reaching",
        ] {
            assert!(image.windows(name.len()).any(|w| w == name.as_bytes()), "{name} missing from the image");
        }
    }

    #[test]
    fn the_cache_key_follows_source_options_and_architecture() {
        let hopper = cache_name((9, 0));
        assert!(hopper.starts_with("kernels-sm90-") && hopper.ends_with(".cubin"), "{hopper}");
        assert_eq!(hopper, cache_name((9, 0)));
        assert_ne!(hopper[13..], cache_name((8, 0))[13..], "the options name the architecture");
        assert_ne!(fnv1a(&[b"ab", b"c"]), fnv1a(&[b"a", b"bc"]));
    }
}
