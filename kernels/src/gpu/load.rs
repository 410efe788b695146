//! Finding the CUDA driver and NVRTC before cudarc looks for them.
//!
//! cudarc's dynamic loading dlopens each library by bare names (`libcuda.so`, `libcuda.so.1`,
//! `libnvrtc.so`, `libnvrtc.so.13`, ...: `cudarc::get_lib_name_candidates`) and panics when
//! none loads. The driver comes with the NVIDIA driver install and is on the loader's path.
//! NVRTC often is not: it usually comes from a pip wheel (`nvidia-cuda-nvrtc`, installed as
//! `site-packages/nvidia/cu13/lib/libnvrtc.so.13`, or `nvidia/cuda_nvrtc/lib/` for CUDA 12)
//! or a toolkit outside the loader's cache. So NVRTC is taken from `CTXFS_NVRTC` (a path to
//! the library) or searched for, loaded here by its full path, and kept loaded: the dynamic
//! loader then resolves cudarc's bare `libnvrtc.so.13` to it by its soname.

use super::GpuUnavailable;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Whether the NVIDIA driver library loads.
pub(super) fn driver() -> Result<(), GpuUnavailable> {
    // SAFETY: this only dlopens the candidate names (and closes them again); loading the
    // driver library runs no initialiser with preconditions.
    if unsafe { cudarc::driver::sys::is_culib_present() } {
        Ok(())
    } else {
        Err(GpuUnavailable::new("libcuda not found: no NVIDIA driver on this machine"))
    }
}

/// Makes NVRTC loadable by cudarc, once per process; says where it came from.
pub(super) fn nvrtc() -> Result<String, GpuUnavailable> {
    static FOUND: OnceLock<Result<String, String>> = OnceLock::new();
    FOUND.get_or_init(find_nvrtc).clone().map_err(GpuUnavailable::new)
}

/// Whether cudarc's names for NVRTC resolve now.
fn nvrtc_present() -> bool {
    // SAFETY: as in `driver`: it dlopens NVRTC's candidate names and closes them again.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn find_nvrtc() -> Result<String, String> {
    if let Some(path) = std::env::var_os("CTXFS_NVRTC").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(path);
        preload(&path).map_err(|e| format!("CTXFS_NVRTC={}: cannot load it: {e}", path.display()))?;
        return if nvrtc_present() {
            Ok(format!("{} (CTXFS_NVRTC)", path.display()))
        } else {
            Err(format!(
                "CTXFS_NVRTC={} loaded, but its soname is none of cudarc's names for NVRTC (libnvrtc.so.13, ...)",
                path.display()
            ))
        };
    }
    if nvrtc_present() {
        return Ok("libnvrtc on the loader's search path".into());
    }
    let dirs = search_dirs();
    for dir in &dirs {
        for lib in nvrtc_files(dir) {
            if preload(&lib).is_ok() && nvrtc_present() {
                return Ok(lib.display().to_string());
            }
        }
    }
    Err(format!(
        "libnvrtc not found (searched the loader's path and {} directories: LD_LIBRARY_PATH, Python \
         site-packages/nvidia/*/lib, CUDA toolkits): pip install nvidia-cuda-nvrtc, or set CTXFS_NVRTC to the \
         path of libnvrtc.so.13",
        dirs.len()
    ))
}

/// Loads `path` for the rest of the process (cudarc resolves its symbols from it), after the
/// `libnvrtc-builtins` beside it, which NVRTC itself dlopens by bare name.
fn preload(path: &Path) -> Result<(), String> {
    if let Some(dir) = path.parent() {
        for builtins in files_starting(dir, "libnvrtc-builtins.so") {
            // Best effort: a wheel's NVRTC finds its builtins through its own rpath anyway.
            if let Ok(lib) = open(&builtins) {
                std::mem::forget(lib);
            }
        }
    }
    std::mem::forget(open(path)?);
    Ok(())
}

fn open(path: &Path) -> Result<libloading::Library, String> {
    // SAFETY: loading runs the library's initialisers; these are NVIDIA's NVRTC libraries,
    // whose initialisers have no preconditions.
    unsafe { libloading::Library::new(path) }.map_err(|e| {
        // libloading's message is "dlopen failed"; the loader's own reason is its source.
        match std::error::Error::source(&e) {
            Some(reason) => format!("{e}: {reason}"),
            None => e.to_string(),
        }
    })
}

/// Directories that may hold NVRTC, most specific first.
fn search_dirs() -> Vec<PathBuf> {
    let env_paths = |name: &str| std::env::var_os(name).map(|v| std::env::split_paths(&v).collect::<Vec<_>>());
    let mut dirs: Vec<PathBuf> = env_paths("LD_LIBRARY_PATH").unwrap_or_default();

    // Python installations: virtual environments and conda first, then whatever python sits on
    // PATH (a venv's bin/ is on PATH when it is activated, /opt/torch/.venv/bin in some images),
    // then the usual prefixes.
    let mut roots: Vec<PathBuf> =
        ["VIRTUAL_ENV", "CONDA_PREFIX"].iter().filter_map(std::env::var_os).map(PathBuf::from).collect();
    roots.extend(env_paths("PATH").unwrap_or_default().iter().filter_map(|bin| bin.parent().map(Path::to_path_buf)));
    if let Some(home) = std::env::var_os("HOME") {
        roots.push(Path::new(&home).join(".local"));
        roots.extend(subdirs(&Path::new(&home).join(".pyenv/versions")));
    }
    roots.extend(["/usr/local", "/usr", "/opt/conda"].map(PathBuf::from));
    for opt in subdirs(Path::new("/opt")) {
        roots.push(opt.join(".venv"));
        roots.push(opt);
    }
    let mut sites: Vec<PathBuf> = env_paths("PYTHONPATH").unwrap_or_default();
    for root in &roots {
        for lib in ["lib", "lib64"] {
            for python in files_starting(&root.join(lib), "python3") {
                sites.push(python.join("site-packages"));
                sites.push(python.join("dist-packages"));
            }
        }
    }
    sites.push("/usr/lib/python3/dist-packages".into());
    for site in &sites {
        for wheel in ["cu13", "cuda_nvrtc", "cu12"] {
            dirs.push(site.join("nvidia").join(wheel).join("lib"));
        }
    }

    // CUDA toolkits: the environment's, then the installed ones, newest first.
    let mut toolkits: Vec<PathBuf> =
        ["CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"].iter().filter_map(std::env::var_os).map(PathBuf::from).collect();
    let mut installed = files_starting(Path::new("/usr/local"), "cuda");
    installed.sort_by(|a, b| b.cmp(a));
    toolkits.extend(installed);
    toolkits.push("/opt/cuda".into());
    for toolkit in &toolkits {
        dirs.push(toolkit.join("lib64"));
        dirs.push(toolkit.join("targets").join(format!("{}-linux", std::env::consts::ARCH)).join("lib"));
    }

    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| d.is_dir() && seen.insert(d.clone()));
    dirs
}

/// The NVRTC libraries in `dir`, newest major version first (`libnvrtc.so.13` before
/// `libnvrtc.so.12`; the unversioned development link last).
fn nvrtc_files(dir: &Path) -> Vec<PathBuf> {
    let major = |p: &PathBuf| {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        name.strip_prefix("libnvrtc.so.").and_then(|v| v.split('.').next()?.parse::<u32>().ok()).unwrap_or(0)
    };
    let mut files = files_starting(dir, "libnvrtc.so");
    files.sort_by_key(|p| std::cmp::Reverse(major(p)));
    files
}

/// Entries of `dir` whose names start with `prefix`, sorted by name.
fn files_starting(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut found: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .collect();
    found.sort();
    found
}

fn subdirs(dir: &Path) -> Vec<PathBuf> {
    files_starting(dir, "").into_iter().filter(|p| p.is_dir()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvrtc_files_prefer_the_newest_major_version() {
        let dir = std::env::temp_dir().join(format!("ctxfs-nvrtc-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for name in ["libnvrtc.so", "libnvrtc.so.12", "libnvrtc.so.13.0.88", "libnvrtc-builtins.so.13.0", "other"] {
            std::fs::write(dir.join(name), b"").unwrap();
        }
        let names: Vec<String> =
            nvrtc_files(&dir).iter().map(|p| p.file_name().unwrap().to_string_lossy().into_owned()).collect();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(names, ["libnvrtc.so.13.0.88", "libnvrtc.so.12", "libnvrtc.so"]);
    }
}
