//! Without the `spdk` feature this does nothing. With it, it finds SPDK (SPDK_DIR, else
//! pkg-config's own search path), links its libraries, and generates bindings for the part of
//! SPDK that `src/device/spdk_ffi.rs` uses.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "spdk")]
    spdk::main();
}

#[cfg(feature = "spdk")]
mod spdk {
    use std::env;
    use std::path::PathBuf;
    use std::process::Command;

    /// The SPDK libraries ctxfs needs: the app framework with the bdev subsystem (which brings
    /// every bdev module: AIO, uring, NVMe/NVMe-oF, ...), the DPDK environment, and the system
    /// libraries SPDK's archives depend on.
    const PACKAGES: &[&str] =
        &["spdk_event", "spdk_event_bdev", "spdk_bdev_aio", "spdk_bdev_uring", "spdk_bdev_nvme", "spdk_env_dpdk"];

    /// Everything bound, and nothing else (bindgen's allowlist).
    const FUNCTIONS: &[&str] = &[
        "spdk_app_opts_init",
        "spdk_app_start",
        "spdk_app_stop",
        "spdk_app_fini",
        "spdk_subsystem_load_config",
        "spdk_get_thread",
        "spdk_thread_send_msg",
        "spdk_put_io_channel",
        "spdk_pci_addr_parse",
        "spdk_dma_zmalloc",
        "spdk_dma_free",
        "spdk_bdev_first",
        "spdk_bdev_next",
        "spdk_bdev_get_by_name",
        "spdk_bdev_get_name",
        "spdk_bdev_get_product_name",
        "spdk_bdev_get_block_size",
        "spdk_bdev_get_num_blocks",
        "spdk_bdev_get_buf_align",
        "spdk_bdev_io_type_supported",
        "spdk_bdev_open_ext",
        "spdk_bdev_close",
        "spdk_bdev_desc_get_bdev",
        "spdk_bdev_get_io_channel",
        "spdk_bdev_read_blocks",
        "spdk_bdev_write_blocks",
        "spdk_bdev_flush_blocks",
        "spdk_bdev_free_io",
        "spdk_bdev_queue_io_wait",
        "spdk_bdev_io_get_aio_status",
    ];
    const TYPES: &[&str] = &["spdk_app_opts", "spdk_bdev_io_wait_entry", "spdk_pci_addr", "spdk_log_level"];
    const CONSTANTS: &[&str] = &["SPDK_BDEV_EVENT_.*", "SPDK_BDEV_IO_TYPE_(READ|WRITE|FLUSH)", "SPDK_LOG_.*"];

    const HELP: &str = "\
build SPDK with the project's script and point SPDK_DIR at the prefix it prints:

    export SPDK_DIR=$(bash tools/spdk/build-spdk.sh ../shared/vendor/spdk/spdk-*.tar.gz)

(or make SPDK's lib/pkgconfig visible to pkg-config through PKG_CONFIG_PATH). docs/spdk.md has the details.";

    fn fail(what: &str) -> ! {
        eprintln!("\nctxfs-vfs with feature `spdk`: {what}\n\n{HELP}\n");
        std::process::exit(1);
    }

    pub fn main() {
        for var in ["SPDK_DIR", "PKG_CONFIG_PATH", "PKG_CONFIG_LIBDIR"] {
            println!("cargo:rerun-if-env-changed={var}");
        }
        let mut pc_path: Vec<PathBuf> = Vec::new();
        if let Some(dir) = env::var_os("SPDK_DIR").filter(|d| !d.is_empty()) {
            let dir = PathBuf::from(dir);
            let pc = dir.join("lib/pkgconfig");
            if !pc.join("spdk_event.pc").is_file() {
                fail(&format!("SPDK_DIR={} holds no lib/pkgconfig/spdk_event.pc", dir.display()));
            }
            pc_path.push(pc);
        }
        pc_path.extend(
            env::var_os("PKG_CONFIG_PATH").map(|p| env::split_paths(&p).collect::<Vec<_>>()).unwrap_or_default(),
        );
        let pc_path = env::join_paths(&pc_path).expect("PKG_CONFIG_PATH entries");
        let pkg_config = |args: &[&str]| -> Result<String, String> {
            let out = Command::new("pkg-config")
                .env("PKG_CONFIG_PATH", &pc_path)
                .args(args)
                .args(PACKAGES)
                .output()
                .map_err(|e| format!("cannot run pkg-config: {e}"))?;
            if !out.status.success() {
                return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
            }
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        };
        let libs = pkg_config(&["--libs", "--static"])
            .unwrap_or_else(|e| fail(&format!("SPDK not found through SPDK_DIR or pkg-config ({e})")));
        let syslibs = {
            let out = Command::new("pkg-config")
                .env("PKG_CONFIG_PATH", &pc_path)
                .args(["--libs", "--static", "spdk_syslibs"])
                .output()
                .unwrap_or_else(|e| fail(&format!("cannot run pkg-config: {e}")));
            String::from_utf8_lossy(&out.stdout).trim().to_string()
        };
        let cflags = pkg_config(&["--cflags"]).unwrap_or_else(|e| fail(&e));
        link(&libs, &syslibs);
        bind(&cflags);
    }

    /// SPDK's own archives are linked whole and statically: its bdev modules and subsystems
    /// register themselves from constructors that nothing references, which a plain static
    /// link (or `--as-needed` with the shared libraries) would drop. DPDK and the system
    /// libraries stay shared. Link kinds and search paths reach every binary that links
    /// ctxfs-vfs (the `ctxfs` command included), which `cargo:rustc-link-arg` would not.
    fn link(libs: &str, syslibs: &str) {
        let mut seen = std::collections::HashSet::new();
        for flag in libs.split_whitespace().chain(syslibs.split_whitespace()) {
            if let Some(dir) = flag.strip_prefix("-L") {
                if seen.insert(flag.to_string()) {
                    println!("cargo:rustc-link-search=native={dir}");
                }
            } else if let Some(lib) = flag.strip_prefix("-l") {
                if !seen.insert(flag.to_string()) {
                    continue;
                }
                if lib.starts_with("spdk_") {
                    println!("cargo:rustc-link-lib=static:+whole-archive,-bundle={lib}");
                } else {
                    println!("cargo:rustc-link-lib=dylib={lib}");
                }
            }
            // -pthread and the like: the Rust standard library links libpthread already.
        }
    }

    fn bind(cflags: &str) {
        let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
        let header = out.join("spdk_wrapper.h");
        std::fs::write(
            &header,
            "#include <spdk/stdinc.h>\n#include <spdk/env.h>\n#include <spdk/event.h>\n#include <spdk/init.h>\n\
             #include <spdk/thread.h>\n#include <spdk/bdev.h>\n#include <spdk/log.h>\n",
        )
        .expect("write the bindgen header");
        let mut builder = bindgen::Builder::default()
            .header(header.display().to_string())
            .clang_args(cflags.split_whitespace().filter(|f| f.starts_with("-I") || f.starts_with("-D")))
            .allowlist_recursively(true)
            .default_enum_style(bindgen::EnumVariation::Consts)
            .prepend_enum_name(false)
            .generate_comments(false)
            .layout_tests(true)
            .derive_default(false)
            .derive_debug(false);
        for f in FUNCTIONS {
            builder = builder.allowlist_function(f);
        }
        for t in TYPES {
            builder = builder.allowlist_type(t);
        }
        for c in CONSTANTS {
            builder = builder.allowlist_var(c);
        }
        let bindings = builder.generate().unwrap_or_else(|e| {
            fail(&format!("bindgen could not read SPDK's headers ({e}); it needs libclang (Debian: libclang-dev)"))
        });
        bindings.write_to_file(out.join("spdk_bindings.rs")).expect("write the SPDK bindings");
    }
}
