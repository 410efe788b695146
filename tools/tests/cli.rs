//! The `ctxfs` binary as a user runs it: mkfs, inspect, fsck and bench on real files, their
//! exit codes, and the JSON contracts other tools rely on.

use serde_json::Value;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Command, Output};

fn ctxfs(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ctxfs")).args(args).env_remove("CTXFS_DEVICE").output().expect("run ctxfs")
}

fn ok(args: &[&str]) -> String {
    let out = ctxfs(args);
    assert!(
        out.status.success(),
        "ctxfs {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(args: &[&str]) -> Value {
    serde_json::from_str(&ok(args)).unwrap_or_else(|e| panic!("ctxfs {args:?}: not JSON: {e}"))
}

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap()
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A store with the demo's context in it.
fn demo_store(dir: &Path) -> std::path::PathBuf {
    ok(&["demo", "--dir", p(dir)]);
    dir.join("store.ctxfs")
}

#[test]
fn mkfs_creates_a_store_and_refuses_to_overwrite_one() {
    let dir = tmp();
    let store = dir.path().join("s.ctxfs");
    let v = json(&["mkfs", p(&store), "--size", "16M", "--json"]);
    assert_eq!(v["blocks"], 4096);
    assert_eq!(v["block_size"], 4096);
    assert_eq!(v["device"], "uring");
    assert_eq!(std::fs::metadata(&store).unwrap().len(), 16 << 20);
    let again = ctxfs(&["mkfs", p(&store), "--size", "16M"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds a ctxfs store"));
    ok(&["mkfs", p(&store), "--size", "8M", "--force", "--block-size", "8192"]);
    let v = json(&["inspect", p(&store), "--json"]);
    assert_eq!(v["superblock"]["block_size"], 8192);
    assert_eq!(v["superblock"]["blocks"], 1024);
}

#[test]
fn mkfs_rejects_bad_input_and_leaves_nothing_behind() {
    let dir = tmp();
    let store = dir.path().join("new.ctxfs");
    let out = ctxfs(&["mkfs", p(&store)]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("give --size"), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!store.exists(), "a failed mkfs must not leave a file behind");
    for (args, why) in [
        (vec!["--size", "16M", "--block-size", "5000"], "power of two"),
        (vec!["--size", "12Q"], "unknown unit"),
        (vec!["--size", "64K"], "at least"),
    ] {
        let mut full = vec!["mkfs", p(&store)];
        full.extend(args);
        let out = ctxfs(&full);
        assert!(!out.status.success(), "{full:?} succeeded");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(why),
            "{full:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(!store.exists());
    }
}

#[test]
fn inspect_shows_contexts_files_and_every_live_block() {
    let dir = tmp();
    let store = demo_store(dir.path());
    let v = json(&["inspect", p(&store), "--json"]);
    assert_eq!(v["device"]["kind"], "uring");
    assert_eq!(v["format_version"], 1);
    let ctx = &v["contexts"][0];
    assert_eq!(ctx["name"], "demo-book");
    assert_eq!(ctx["tokens"], 16384);
    assert_eq!(ctx["shape"]["kv_heads"], 2);
    let files = ctx["files"].as_array().unwrap();
    assert_eq!(files.len(), 8);
    // 15 vectors of 128 f16 per 4 KiB block.
    assert_eq!(files[3]["data"]["blocks"], 16384_u64.div_ceil(15));

    let one = json(&["inspect", p(&store), "demo-book", "--layer", "1", "--head", "1", "--json"]);
    assert_eq!(one["owner"], "context 1 layer 1 head 1");
    assert_eq!(one["index"]["blocks"], 16384_u64.div_ceil(15));
    let extents: u64 = one["data"]["extents"].as_array().unwrap().iter().map(|e| e["blocks"].as_u64().unwrap()).sum();
    assert_eq!(extents, 16384_u64.div_ceil(15));

    let blocks = json(&["inspect", p(&store), "--blocks", "--json"]);
    let blocks = blocks.as_array().unwrap();
    let used = v["space"]["used_blocks"].as_u64().unwrap();
    assert_eq!(blocks.len() as u64, used, "every allocated block is listed once");
    let mut seen = std::collections::BTreeSet::new();
    for b in blocks {
        assert!(seen.insert(b["block"].as_u64().unwrap()));
        let kind = b["kind"].as_str().unwrap();
        assert!(["superblock", "catalog", "alloc", "extent", "index", "data"].contains(&kind), "{kind}");
        assert!(b["owner"].is_string());
    }
    let count = |k: &str| blocks.iter().filter(|b| b["kind"] == k).count();
    assert_eq!(count("superblock"), 2);
    assert_eq!(count("data"), 8 * 16384_usize.div_ceil(15));
    assert!(ok(&["inspect", p(&store)]).contains("demo-book"));
}

#[test]
fn fsck_exit_codes_follow_e2fsck() {
    let dir = tmp();
    let store = demo_store(dir.path());
    let v = json(&["fsck", p(&store), "--json"]);
    assert_eq!(v["clean"], true);
    assert_eq!(v["exit_code"], 0);

    // Damage one data block: found, named, exit 4; repair without --drop-damaged leaves it.
    let blocks = json(&["inspect", p(&store), "--blocks", "--json"]);
    let victim = blocks.as_array().unwrap().iter().find(|b| b["kind"] == "data").unwrap()["block"].as_u64().unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&store).unwrap();
    f.write_all_at(&[0xFF; 64], victim * 4096 + 100).unwrap();
    f.sync_all().unwrap();
    let out = ctxfs(&["fsck", p(&store), "--json"]);
    assert_eq!(out.status.code(), Some(4));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let named: Vec<u64> = v["problems"].as_array().unwrap().iter().filter_map(|p| p["block"].as_u64()).collect();
    assert_eq!(named, vec![victim]);
    assert_eq!(v["problems"][0]["context"], "demo-book");
    let human = String::from_utf8(ctxfs(&["fsck", p(&store)]).stdout).unwrap();
    assert!(human.contains(&format!("block {victim}")), "{human}");
    assert_eq!(ctxfs(&["fsck", p(&store), "--repair"]).status.code(), Some(4));
    // Dropping the damaged context is a correction: exit 1, then clean.
    assert_eq!(ctxfs(&["fsck", p(&store), "--repair", "--drop-damaged"]).status.code(), Some(1));
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
    assert_eq!(json(&["inspect", p(&store), "--json"])["contexts"].as_array().unwrap().len(), 0);

    // Not a store, or missing: operational error, exit 8 (or 4 when it is readable garbage).
    assert_eq!(ctxfs(&["fsck", p(&dir.path().join("missing"))]).status.code(), Some(8));
    let junk = dir.path().join("junk");
    std::fs::write(&junk, vec![7u8; 1 << 20]).unwrap();
    assert_eq!(ctxfs(&["fsck", p(&junk)]).status.code(), Some(4));
}

#[test]
fn the_file_device_can_be_chosen_and_inspect_says_so() {
    let dir = tmp();
    let store = dir.path().join("f.ctxfs");
    ok(&["--device", "file", "mkfs", p(&store), "--size", "8M"]);
    let v = json(&["--device", "file", "inspect", p(&store), "--json"]);
    assert_eq!(v["device"]["kind"], "file");
    assert_eq!(v["device"]["queue_depth"], 1);
    let out = Command::new(env!("CARGO_BIN_EXE_ctxfs"))
        .args(["inspect", p(&store), "--json"])
        .env("CTXFS_DEVICE", "file")
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["device"]["kind"], "file");
}

#[test]
fn bench_io_reports_ratios_and_cleans_up() {
    let dir = tmp();
    let store = dir.path().join("b.ctxfs");
    ok(&["mkfs", p(&store), "--size", "64M"]);
    let v = json(&["bench", "io", p(&store), "--mib", "8", "--random-reads", "2048", "--json"]);
    for k in ["seq_write_vs_raw", "seq_read_vs_raw", "random_read_vs_raw"] {
        let r = v["ratios"][k].as_f64().unwrap();
        assert!(r > 0.05 && r < 20.0, "{k} = {r}");
    }
    assert!(v["ctxfs"]["random_read_iops"].as_f64().unwrap() > 0.0);
    // The scratch context and the raw scratch file are gone; the store is clean.
    assert_eq!(json(&["inspect", p(&store), "--json"])["contexts"].as_array().unwrap().len(), 0);
    assert!(!store.with_extension("bench-raw").exists());
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
}

/// Runs ctxfs in a child whose `io_uring_setup` calls fail with EPERM, as under Docker's
/// default seccomp profile.
#[cfg(target_arch = "x86_64")]
fn ctxfs_without_io_uring(args: &[&str]) -> Output {
    use std::os::unix::process::CommandExt;
    fn refuse_io_uring() -> std::io::Result<()> {
        const SYS_IO_URING_SETUP: u32 = 425;
        // Classic BPF: load the syscall number; if io_uring_setup return EPERM, else allow.
        let filter = [
            libc::sock_filter { code: 0x20, jt: 0, jf: 0, k: 0 }, // ld  [nr]
            libc::sock_filter { code: 0x15, jt: 0, jf: 1, k: SYS_IO_URING_SETUP }, // jeq
            libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x0005_0000 | libc::EPERM as u32 }, // ret ERRNO
            libc::sock_filter { code: 0x06, jt: 0, jf: 0, k: 0x7fff_0000 }, // ret ALLOW
        ];
        let prog = libc::sock_fprog { len: filter.len() as u16, filter: filter.as_ptr() as *mut _ };
        // SAFETY: plain prctl calls with valid arguments; `prog` and `filter` outlive them
        // (the kernel copies the program during the call).
        let rc = unsafe {
            if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            libc::prctl(libc::PR_SET_SECCOMP, 2 /* SECCOMP_MODE_FILTER */, &prog as *const libc::sock_fprog)
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ctxfs"));
    cmd.args(args).env_remove("CTXFS_DEVICE");
    // SAFETY: the closure runs in the forked child before exec and only makes prctl system
    // calls; it allocates nothing and touches no lock.
    unsafe { cmd.pre_exec(refuse_io_uring) };
    cmd.output().expect("run ctxfs")
}

#[cfg(target_arch = "x86_64")]
#[test]
fn a_refused_io_uring_falls_back_to_pread_and_inspect_says_so() {
    let dir = tmp();
    let store = dir.path().join("seccomp.ctxfs");
    let out = ctxfs_without_io_uring(&["mkfs", p(&store), "--size", "8M", "--json"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["device"], "file");
    let out = ctxfs_without_io_uring(&["inspect", p(&store), "--json"]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["device"]["kind"], "file");
    let note = v["device"]["note"].as_str().unwrap();
    assert!(note.contains("io_uring setup refused") && note.contains("pread/pwrite"), "{note}");
    let human = String::from_utf8(ctxfs_without_io_uring(&["inspect", p(&store)]).stdout).unwrap();
    assert!(human.contains("io_uring setup refused"), "{human}");
    // Asking for io_uring explicitly is an error, not a silent fallback.
    let out = ctxfs_without_io_uring(&["--device", "uring", "inspect", p(&store)]);
    assert!(!out.status.success());
    // Without the filter, the same store opens on io_uring again.
    assert_eq!(json(&["inspect", p(&store), "--json"])["device"]["kind"], "uring");
}

#[test]
fn bench_buffer_compares_cold_reads_with_raw_and_reports_hot_hits() {
    let dir = tmp();
    let store = dir.path().join("bb.ctxfs");
    ok(&["mkfs", p(&store), "--size", "64M"]);
    let v = json(&[
        "bench",
        "buffer",
        p(&store),
        "--mib",
        "16",
        "--reads",
        "2048",
        "--threads",
        "2",
        "--rounds",
        "1",
        "--json",
    ]);
    let r = v["ratios"]["random_read_vs_raw"].as_f64().unwrap();
    assert!(r > 0.05 && r < 20.0, "ratio {r}");
    assert!(v["hot"]["hits_per_sec_per_thread"].as_f64().unwrap() > 1000.0);
    let stats = &v["stats"];
    // The hot set is 1024 index blocks, read once each and then only hit.
    assert_eq!(stats["index"]["misses"], 1024);
    assert_eq!(stats["index"]["evictions"], 0);
    let (hits, misses) = (stats["data"]["hits"].as_u64().unwrap(), stats["data"]["misses"].as_u64().unwrap());
    assert_eq!(hits + misses, 2048, "every read is a hit or a miss: {stats}");
    assert!(misses >= 2048 * 9 / 10, "cold reads mostly miss: {stats}");
    assert!(stats["allocated_bytes"].as_u64().unwrap() <= stats["budget_bytes"].as_u64().unwrap());
    assert_eq!(json(&["inspect", p(&store), "--json"])["contexts"].as_array().unwrap().len(), 0);
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
}

#[test]
fn inspect_buffer_loads_every_index_block_and_says_whether_it_fits() {
    let dir = tmp();
    let store = demo_store(dir.path());
    let index_blocks = 8 * 16384_u64.div_ceil(15);
    let v = json(&["inspect", p(&store), "--buffer", "--json"]);
    assert_eq!(v["index_blocks"], index_blocks);
    assert_eq!(v["index_resident"], true);
    assert_eq!(v["stats"]["index"]["misses"], index_blocks);
    assert_eq!(v["stats"]["index"]["bytes_read"], index_blocks * 4096);
    let small = json(&["inspect", p(&store), "--buffer", "--budget", "8M", "--json"]);
    assert_eq!(small["index_resident"], false);
    assert!(small["stats"]["index"]["evictions"].as_u64().unwrap() > 0);
}

#[test]
fn gen_writes_the_documented_safetensors_layout_and_reports_its_statistics() {
    use safetensors::SafeTensors;
    let dir = tmp();
    let out = dir.path().join("ctx.safetensors");
    let v = json(&["gen", p(&out), "--tokens", "2048", "--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--queries", "100", "--decode-queries", "5", "--seed", "3", "--json"]);
    assert!(v["mahalanobis_ratio"].as_f64().unwrap() > 10.0, "{v}");
    let heads = v["heads"].as_array().unwrap();
    assert_eq!(heads.len(), 4);
    assert!(heads.iter().all(|h| h["tokens_for_90_percent"].as_u64().unwrap() >= 1));
    let bytes = std::fs::read(&out).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for l in 0..2 {
        assert_eq!(st.tensor(&format!("layers.{l}.k")).unwrap().shape(), &[2, 2048, 64]);
        assert_eq!(st.tensor(&format!("layers.{l}.v")).unwrap().shape(), &[2, 2048, 64]);
        assert_eq!(st.tensor(&format!("layers.{l}.q")).unwrap().shape(), &[4, 100, 64]);
    }
    let tokens = st.tensor("tokens").unwrap();
    assert_eq!((tokens.dtype(), tokens.shape()), (safetensors::Dtype::I64, &[2048][..]));
    let qbytes = std::fs::read(dir.path().join("ctx.queries.safetensors")).unwrap();
    let qs = SafeTensors::deserialize(&qbytes).unwrap();
    let q = qs.tensor("layers.1.q").unwrap();
    assert_eq!((q.dtype(), q.shape()), (safetensors::Dtype::F32, &[4, 5, 64][..]));
    // Same seed, same bytes; nothing half-written is left behind.
    let again = dir.path().join("again.safetensors");
    ok(&["gen", p(&again), "--tokens", "2048", "--layers", "2", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64", "--queries", "100", "--decode-queries", "5", "--seed", "3"]);
    assert_eq!(std::fs::read(&again).unwrap(), bytes);
    let bad = ctxfs(&["gen", p(&dir.path().join("bad.safetensors")), "--tokens", "10", "--q-heads", "3", "--kv-heads", "2"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("multiple of kv heads"));
    assert!(!dir.path().join("bad.safetensors").exists() && !dir.path().join("bad.safetensors.partial").exists());
}
