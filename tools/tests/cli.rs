//! The `ctxfs` binary as a user runs it: mkfs, inspect, fsck and bench on real files, their
//! exit codes, and the JSON contracts other tools rely on.

mod common;

use common::*;
use serde_json::Value;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::Path;
use std::process::{Command, Output};

/// A query line's plan, without the `@gpu` a GPU machine adds.
fn plan(r: &Value) -> &str {
    r["plan"].as_str().unwrap().trim_end_matches("@gpu")
}

/// A store with the demo's context in it.
fn demo_store(dir: &Path) -> std::path::PathBuf {
    ok(&["demo", "--dir", p(dir), "--tokens", "4096", "--steps", "2"]);
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

/// A file that is not a store is someone's data: mkfs leaves it alone without --force, and
/// formats a file that reads all zeros (one just sized by `truncate`).
#[test]
fn mkfs_refuses_a_file_holding_data_without_force() {
    let dir = tmp();
    let notes = dir.path().join("notes.txt");
    std::fs::write(&notes, b"not a store").unwrap();
    let out = ctxfs(&["mkfs", p(&notes), "--size", "16M"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("holds data but no ctxfs store") && err.contains("offset 0"), "{err}");
    assert_eq!(std::fs::read(&notes).unwrap(), b"not a store", "the file is left as it was");
    ok(&["mkfs", p(&notes), "--size", "16M", "--force"]);

    let zeros = dir.path().join("zeros.img");
    std::fs::File::create(&zeros).unwrap().set_len(16 << 20).unwrap();
    ok(&["mkfs", p(&zeros)]);
    json(&["inspect", p(&zeros), "--json"]);
}

/// A store path that does not exist is named in the error, once.
#[test]
fn a_missing_store_is_named_in_the_error() {
    let dir = tmp();
    let store = dir.path().join("missing.ctxfs");
    for args in [vec!["inspect", p(&store)], vec!["query", p(&store), "--context", "a", "--queries", p(&store)]] {
        let out = ctxfs(&args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("missing.ctxfs: cannot open for reading: No such file"), "{args:?}: {err}");
        assert_eq!(err.matches("No such file").count(), 1, "{args:?}: {err}");
    }
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
    // A size too small for a store changes no existing file, store or not.
    let other = dir.path().join("other.bin");
    std::fs::write(&other, vec![7u8; 1 << 20]).unwrap();
    let out = ctxfs(&["mkfs", p(&other), "--size", "4096", "--force"]);
    assert!(stderr_of(&out).contains("too small"), "{}", stderr_of(&out));
    assert_eq!(std::fs::read(&other).unwrap(), vec![7u8; 1 << 20], "untouched");
}

#[test]
fn a_reader_that_closes_the_pipe_early_ends_inspect_quietly() {
    let dir = tmp();
    let store = demo_store(dir.path());
    let mut child = spawn_piped(&["inspect", p(&store), "--blocks"]);
    drop(child.stdout.take()); // `| head -0`
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{:?}: {}", out.status, stderr_of(&out));
    assert!(!stderr_of(&out).contains("panicked"), "{}", stderr_of(&out));
}

#[test]
fn inspect_shows_contexts_files_and_every_live_block() {
    let dir = tmp();
    let store = demo_store(dir.path());
    let v = json(&["inspect", p(&store), "--json"]);
    assert_eq!(v["device"]["kind"], "uring");
    assert_eq!(v["format_version"], 2);
    let ctx = &v["contexts"][0];
    assert_eq!(ctx["name"], "demo-book");
    assert_eq!(ctx["tokens"], 4096);
    assert_eq!(ctx["parent"], Value::Null);
    assert_eq!(ctx["shape"]["kv_heads"], 2);
    let files = ctx["files"].as_array().unwrap();
    assert_eq!(files.len(), 4);
    // 15 vectors of 128 f16 per 4 KiB block.
    let rows = 4096_u64.div_ceil(15);
    assert_eq!(files[3]["data"]["blocks"], rows);

    let one = json(&["inspect", p(&store), "demo-book", "--layer", "1", "--head", "1", "--json"]);
    assert_eq!(one["owner"], "context 1 layer 1 head 1");
    // The index stream: a meta block, the adjacency records, then the keys.
    let index = one["index"]["blocks"].as_u64().unwrap();
    assert!(index > 1 + rows && index == files[3]["index"]["blocks"], "{index}");
    let extents: u64 = one["data"]["extents"].as_array().unwrap().iter().map(|e| e["blocks"].as_u64().unwrap()).sum();
    assert_eq!(extents, rows);
    // Each key block lies just before the value block of the same tokens: the data stream
    // is one run of every other block, and the index stream has its twin one block earlier.
    let data = &one["data"]["extents"][0];
    assert_eq!((data["step"].as_u64(), data["blocks"].as_u64()), (Some(2), Some(rows)), "{}", one["data"]);
    let twin = data["block"].as_u64().unwrap() - 1;
    let keys = one["index"]["extents"].as_array().unwrap().iter().find(|e| e["block"] == twin);
    let keys = keys.map(|e| (e["step"].as_u64(), e["blocks"].as_u64()));
    assert_eq!(keys, Some((Some(2), Some(rows))), "{}", one["index"]);

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
    assert_eq!(count("data"), 4 * 4096_usize.div_ceil(15));
    assert!(ok(&["inspect", p(&store)]).contains("demo-book"));
}

#[test]
fn fsck_exit_codes_follow_e2fsck() {
    let dir = tmp();
    let store = demo_store(dir.path());
    let v = json(&["fsck", p(&store), "--json"]);
    assert_eq!(v["clean"], true);
    assert_eq!(v["exit_code"], 0);
    // A usage error is e2fsck's 16, and with --json an error object too.
    let usage = ctxfs(&["fsck", p(&store), "--drop-damaged", "--json"]);
    assert_eq!(usage.status.code(), Some(16));
    let v: Value = serde_json::from_slice(&usage.stdout).unwrap();
    assert_eq!(v["exit_code"], 16);
    assert!(v["error"].as_str().unwrap().contains("--repair"), "{v}");

    // Damage one data block: found, named, exit 4; repair without --drop-damaged leaves it.
    let blocks = json(&["inspect", p(&store), "--blocks", "--json"]);
    let victim = blocks.as_array().unwrap().iter().find(|b| b["kind"] == "data").unwrap()["block"].as_u64().unwrap();
    // A damaged index block is one problem: the index check leaves out a file the block walk
    // already found bad, where it would fail on the same block again.
    let index = blocks.as_array().unwrap().iter().find(|b| b["kind"] == "index").unwrap()["block"].as_u64().unwrap();
    let copy = dir.path().join("index-damaged.ctxfs");
    std::fs::copy(&store, &copy).unwrap();
    std::fs::OpenOptions::new().write(true).open(&copy).unwrap().write_all_at(&[0xFF; 64], index * 4096 + 100).unwrap();
    let out = ctxfs(&["fsck", p(&copy), "--json"]);
    let problems = serde_json::from_slice::<Value>(&out.stdout).unwrap()["problems"].clone();
    assert_eq!(problems.as_array().unwrap().len(), 1, "{problems}");
    assert_eq!(problems[0]["block"].as_u64(), Some(index), "{problems}");
    std::fs::remove_file(&copy).unwrap();
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
    let generation = |s: &std::path::Path| json(&["inspect", p(s), "--json"])["superblock"]["generation"].clone();
    let before = generation(&store);
    assert_eq!(ctxfs(&["fsck", p(&store), "--repair"]).status.code(), Some(4));
    assert_eq!(generation(&store), before, "a repair with nothing it may do commits nothing");
    // Beside a reader in another process, a repair that would write and a resizing mkfs are
    // refused before they change a byte.
    let reader = ctxfs_vfs::Store::open_path_read_only(&store, ctxfs_vfs::DeviceChoice::Auto).unwrap();
    let len = std::fs::metadata(&store).unwrap().len();
    for args in
        [&["fsck", p(&store), "--repair", "--drop-damaged"][..], &["mkfs", p(&store), "--size", "8M", "--force"]]
    {
        let out = ctxfs(args);
        assert_eq!(out.status.code(), if args[0] == "fsck" { Some(8) } else { Some(1) }, "ctxfs {args:?}");
        assert!(stderr_of(&out).contains("another process is reading the store"), "{}", stderr_of(&out));
    }
    assert_eq!(std::fs::metadata(&store).unwrap().len(), len, "not resized");
    assert_eq!(ctxfs(&["fsck", p(&store), "--repair"]).status.code(), Some(4), "nothing to write: not refused");
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(4), "the damage is still there, untouched");
    drop(reader);
    // Dropping the damaged context is a correction: exit 1, then clean.
    assert_eq!(ctxfs(&["fsck", p(&store), "--repair", "--drop-damaged"]).status.code(), Some(1));
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
    assert!(context_names(&store).is_empty());

    // Missing, or never a store: operational error, exit 8.
    assert_eq!(ctxfs(&["fsck", p(&dir.path().join("missing"))]).status.code(), Some(8));
    let junk = dir.path().join("junk");
    std::fs::write(&junk, vec![7u8; 1 << 20]).unwrap();
    assert_eq!(ctxfs(&["fsck", p(&junk)]).status.code(), Some(8));
    // A store whose two superblocks are both damaged is still a store: problems, exit 4.
    let f = std::fs::OpenOptions::new().write(true).open(&store).unwrap();
    for slot in 0..2u64 {
        f.write_all_at(&[0xAB; 64], slot * 4096 + 200).unwrap();
    }
    f.sync_all().unwrap();
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(4));
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
        assert!(r.is_finite() && r > 0.0, "{k} = {r}");
    }
    assert!(v["ctxfs"]["random_read_iops"].as_f64().unwrap() > 0.0);
    // The raw loop keeps as many bytes in flight as the store: a 4 MiB write batch, an 8 MiB
    // range read of 4 KiB blocks.
    assert_eq!(v["in_flight_bytes"]["sequential_write"], 4 << 20);
    assert_eq!(v["in_flight_bytes"]["sequential_read"], 8 << 20);
    // The scratch context and the raw scratch file are gone; the store is clean.
    assert!(context_names(&store).is_empty());
    assert!(!store.with_extension("bench-raw").exists());
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
    // A file where the scratch file would go is the user's: refused, and left as it was.
    std::fs::write(store.with_extension("bench-raw"), b"keep").unwrap();
    let out = ctxfs(&["bench", "io", p(&store), "--mib", "1", "--random-reads", "64", "--rounds", "1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr_of(&out).contains("must not exist"), "{}", stderr_of(&out));
    assert_eq!(std::fs::read(store.with_extension("bench-raw")).unwrap(), b"keep");
}

#[test]
fn bench_decode_builds_its_store_at_the_block_size_asked_for() {
    let dir = tmp();
    let bad = ctxfs(&["bench", "decode", "--dir", p(dir.path()), "--tokens", "4096", "--block-size", "12288"]);
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(err.contains("--block-size") && err.contains("power of two"), "{err}");
    assert!(!dir.path().join("store.ctxfs").exists(), "a refused run formats nothing");

    let args = ["bench", "decode", "--dir", p(dir.path()), "--tokens", "4096", "--layers", "1", "--steps", "2"];
    // The steps alone: no baseline is measured, and the loader's file is not written.
    let steps = json(&[&args[..], &["--block-size", "8192", "--steps-only", "--json"]].concat());
    assert!(steps["import"].is_object() && steps["decode_step_seconds"].as_f64().unwrap() > 0.0, "{steps}");
    assert!(steps["time_to_first_output_seconds"].as_f64().unwrap() > 0.0);
    for k in ["quality", "raw_load", "ratios", "exact_step_seconds", "dram_exact_step_seconds", "store_1k_on_top"] {
        assert!(steps[k].is_null(), "{k}: {}", steps[k]);
    }
    assert!(!dir.path().join("kv.raw").exists());
    // The whole run reuses the store the steps-only run built.
    let v = json(&[&args[..], &["--block-size", "8192", "--json"]].concat());
    assert!(v["import"].is_null(), "{}", v["import"]);
    let store = dir.path().join("store.ctxfs");
    assert_eq!(json(&["inspect", p(&store), "--json"])["superblock"]["block_size"].as_u64(), Some(8192));
    let ios = v["ios_per_step"].as_f64().unwrap();
    assert_eq!(v["bytes_per_step"].as_f64(), Some(ios * 8192.0));
    assert!(v["decode_step_seconds"].as_f64().unwrap() > 0.0);
    // The step's CPU time, and over the threads it ran on, what it would take without waits.
    let cpu = &v["step_cpu"];
    let threads = cpu["threads"].as_f64().unwrap();
    assert!(threads >= 1.0 && cpu["seconds"].as_f64().unwrap() > 0.0, "{cpu}");
    // serde_json's float parsing may differ from the printed value by an ulp.
    let (bound, quotient) = (cpu["bound_seconds"].as_f64().unwrap(), cpu["seconds"].as_f64().unwrap() / threads);
    assert!((bound - quotient).abs() <= 1e-9 * quotient, "{cpu}");
    // The loader baseline read exactly the K+V bytes and answered as exact attention does.
    let raw = &v["raw_load"];
    assert_eq!(raw["kv_bytes"].as_u64(), Some(4096 * 8 * 2 * 128 * 2));
    assert!(raw["output_error_vs_exact"].as_f64().unwrap() <= 1e-3, "{raw}");
    assert!(raw["seconds"].as_f64().unwrap() > 0.0);
    // Time to first output of a context not yet resident counts the index read.
    let parts = v["db_open_seconds"].as_f64().unwrap()
        + v["index_warm_extrapolated_seconds"].as_f64().unwrap()
        + v["session_open_seconds"].as_f64().unwrap()
        + v["cold_step_seconds"].as_f64().unwrap();
    let first = v["time_to_first_output_seconds"].as_f64().unwrap();
    assert!((first - parts).abs() <= 1e-9 * first, "{first} against {parts}");
    // Quality of the steps it timed, against exact attention.
    let q = &v["quality"];
    assert_eq!(q["heads_measured"].as_u64(), Some(2 * 32));
    let (recall, error) = (q["dipr_recall"].as_f64().unwrap(), q["output_error"].as_f64().unwrap());
    assert!((0.5..=1.0).contains(&recall) && error < 0.5, "{q}");
    for k in ["first_output_vs_raw_load", "resident_first_output_vs_dram_exact", "step_vs_dram_exact", "step_vs_exact"]
    {
        assert!(v["ratios"][k].as_f64().unwrap() > 0.0, "{k}");
    }
    // The same context at another block size is rebuilt, not reused.
    json(&[&args[..], &["--json"]].concat());
    assert_eq!(json(&["inspect", p(&store), "--json"])["superblock"]["block_size"].as_u64(), Some(4096));
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
    assert!(r.is_finite() && r > 0.0, "ratio {r}");
    assert!(v["hot"]["hits_per_sec_per_thread"].as_f64().unwrap() > 0.0);
    let stats = &v["stats"];
    // The hot set is 1024 index blocks, read once each and then only hit.
    assert_eq!(stats["index"]["misses"], 1024);
    assert_eq!(stats["index"]["evictions"], 0);
    let (hits, misses) = (stats["data"]["hits"].as_u64().unwrap(), stats["data"]["misses"].as_u64().unwrap());
    assert_eq!(hits + misses, 2048, "every read is a hit or a miss: {stats}");
    assert!(misses >= 2048 * 9 / 10, "cold reads mostly miss: {stats}");
    assert!(stats["allocated_bytes"].as_u64().unwrap() <= stats["budget_bytes"].as_u64().unwrap());
    assert!(context_names(&store).is_empty());
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
}

#[test]
fn inspect_buffer_loads_every_index_block_and_says_whether_it_fits() {
    let dir = tmp();
    let store = demo_store(dir.path());
    let files = json(&["inspect", p(&store), "--json"])["contexts"][0]["files"].clone();
    let index_blocks: u64 = files.as_array().unwrap().iter().map(|f| f["index"]["blocks"].as_u64().unwrap()).sum();
    // 2 layers × 2 kv heads of 4096 tokens: meta, adjacency and key blocks each.
    assert!(index_blocks > 4 * (4096 / 15), "{index_blocks}");
    let v = json(&["inspect", p(&store), "--buffer", "--json"]);
    assert_eq!(v["index_blocks"], index_blocks);
    assert_eq!(v["index_resident"], true);
    assert_eq!(v["stats"]["index"]["misses"], index_blocks);
    assert_eq!(v["stats"]["index"]["bytes_read"], index_blocks * 4096);
    // The context's resident index, part by part, against its K + V bytes.
    let ctx = &v["contexts"][0];
    let part = |k: &str| ctx["parts"][k].as_u64().unwrap();
    let parts: u64 = ["meta", "graph", "keys", "seeds", "quest", "infllm", "pq"].into_iter().map(part).sum();
    assert_eq!(parts, index_blocks * 4096);
    // Beside the frames, the block maps: a CRC per block of both streams, their runs, and a
    // frame hint per index block, far less than a listed request's 40 bytes per block.
    let data_blocks: u64 = files.as_array().unwrap().iter().map(|f| f["data"]["blocks"].as_u64().unwrap()).sum();
    let maps = part("maps");
    assert!(maps >= 4 * (index_blocks + data_blocks) && maps < 12 * (index_blocks + data_blocks), "{maps}");
    assert_eq!(ctx["compact_bytes"].as_u64(), Some(part("meta") + part("seeds") + part("pq") + maps));
    let resident = index_blocks * 4096 + maps;
    assert_eq!(ctx["resident_bytes"].as_u64(), Some(resident));
    // 4096 tokens × 2 layers × 2 kv heads × d = 128, K and V, 2 bytes each.
    let kv = 4096 * 2 * 2 * 128 * 2 * 2;
    assert_eq!(ctx["kv_bytes"], kv);
    let ratio = ctx["resident_over_kv"].as_f64().unwrap();
    assert!((ratio - resident as f64 / kv as f64).abs() < 1e-9, "{ratio}");
    // A session's window, beside the budget: 640 tokens' keys and values as stored per file.
    assert_eq!(part("window"), 640 * 128 * 2 * 2 * 4);
    let with_window = ctx["compact_and_window_over_kv"].as_f64().unwrap();
    assert!((with_window - (ctx["compact_bytes"].as_u64().unwrap() + part("window")) as f64 / kv as f64).abs() < 1e-9);
    let small = json(&["inspect", p(&store), "--buffer", "--budget", "2M", "--json"]);
    assert_eq!(small["index_resident"], false);
    assert!(small["stats"]["index"]["evictions"].as_u64().unwrap() > 0);
}

/// A small generated context: 2 layers, 4 q heads over 2 kv heads, d = 64, seed 3.
const GEN_SMALL: &str =
    "--tokens 2048 --layers 2 --q-heads 4 --kv-heads 2 --head-dim 64 --queries 100 --decode-queries 5 --seed 3";

#[test]
fn gen_writes_the_documented_safetensors_layout_and_reports_its_statistics() {
    use safetensors::SafeTensors;
    let dir = tmp();
    let out = dir.path().join("ctx.safetensors");
    let v: Value = serde_json::from_str(&gen(&out, &format!("{GEN_SMALL} --json"))).unwrap();
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
    gen(&again, GEN_SMALL);
    assert_eq!(std::fs::read(&again).unwrap(), bytes);
    // What is already there is replaced only with --force, and never unless a regular file:
    // a store, a pipe or a device given as OUT by mistake stays.
    let store = dir.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "16M"]);
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for (out, force, why) in [
        (&again, false, "already exists; pass --force"),
        (&store, false, "already exists; pass --force"),
        (&fifo, true, "not a regular file"),
    ] {
        let mut args = vec!["gen", p(out)];
        args.extend(GEN_SMALL.split_whitespace().chain(force.then_some("--force")));
        let refused = ctxfs(&args);
        assert_eq!(refused.status.code(), Some(1), "{out:?}: {}", stderr_of(&refused));
        assert!(stderr_of(&refused).contains(why), "{out:?}: {}", stderr_of(&refused));
    }
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    ok(&["inspect", p(&store)]);
    gen(&again, &format!("{} --force", GEN_SMALL.replace("--seed 3", "--seed 1")));
    assert_ne!(std::fs::read(&again).unwrap(), bytes);
    let bad =
        ctxfs(&["gen", p(&dir.path().join("bad.safetensors")), "--tokens", "10", "--q-heads", "3", "--kv-heads", "2"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("multiple of kv heads"));
    assert!(!dir.path().join("bad.safetensors").exists() && !dir.path().join("bad.safetensors.partial").exists());
    for (flags, why) in [
        (["--q-heads", "0"], "must be positive"),
        (["--head-dim", "1"], "2..=4096"),
        (["--head-dim", "4097"], "2..=4096"),
    ] {
        let bad = ctxfs(&[&["gen", p(&dir.path().join("bad.safetensors")), "--tokens", "10"][..], &flags].concat());
        assert_eq!(bad.status.code(), Some(1), "{flags:?}: {}", stderr_of(&bad));
        assert!(stderr_of(&bad).contains(why), "{flags:?}: {}", stderr_of(&bad));
    }
}

/// Exact attention in f64 from the generated file, for one (layer, q head, query).
fn exact_attention(
    ctx: &Path,
    queries: &Path,
    l: usize,
    qh: usize,
    qi: usize,
    group: usize,
    prefix: usize,
) -> (Vec<f64>, f64) {
    use safetensors::SafeTensors;
    let (kb, qb) = (std::fs::read(ctx).unwrap(), std::fs::read(queries).unwrap());
    let (st, qs) = (SafeTensors::deserialize(&kb).unwrap(), SafeTensors::deserialize(&qb).unwrap());
    let k = st.tensor(&format!("layers.{l}.k")).unwrap();
    let v = st.tensor(&format!("layers.{l}.v")).unwrap();
    let q = qs.tensor(&format!("layers.{l}.q")).unwrap();
    let (n, d) = (k.shape()[1], k.shape()[2]);
    let nq = q.shape()[1];
    let half = |b: &[u8], i: usize| half::f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f64();
    let qv: Vec<f64> = (0..d)
        .map(|j| f32::from_le_bytes(q.data()[4 * ((qh * nq + qi) * d + j)..][..4].try_into().unwrap()) as f64)
        .collect();
    let kv = qh / group;
    let z: Vec<f64> = (0..prefix)
        .map(|t| (0..d).map(|j| qv[j] * half(k.data(), (kv * n + t) * d + j)).sum::<f64>() / (d as f64).sqrt())
        .collect();
    let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let w: Vec<f64> = z.iter().map(|x| (x - m).exp()).collect();
    let l_sum: f64 = w.iter().sum();
    let o =
        (0..d).map(|j| (0..prefix).map(|t| w[t] * half(v.data(), (kv * n + t) * d + j)).sum::<f64>() / l_sum).collect();
    (o, m + l_sum.ln())
}

fn lines(out: &str) -> Vec<Value> {
    out.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

fn rel_err(o: &Value, want: &[f64]) -> f64 {
    let got: Vec<f64> = o.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b).powi(2)).sum::<f64>().sqrt();
    num / want.iter().map(|b| b * b).sum::<f64>().sqrt()
}

#[test]
fn import_then_query_matches_exact_attention() {
    let dir = tmp();
    let ctx = dir.path().join("c.safetensors");
    let queries = dir.path().join("c.queries.safetensors");
    gen(
        &ctx,
        "--tokens 3000 --layers 2 --q-heads 4 --kv-heads 2 --head-dim 64 --queries 400 --decode-queries 3 --seed 5",
    );
    let store = dir.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "64M"]);
    let imported = json(&["import", p(&store), p(&ctx), "--name", "book", "--json"]);
    assert_eq!((imported["tokens"].as_u64(), imported["layers"].as_u64()), (Some(3000), Some(2)));
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
    let again = ctxfs(&["import", p(&store), p(&ctx), "--name", "book"]);
    assert!(!again.status.success() && String::from_utf8_lossy(&again.stderr).contains("already exists"));

    let base = ["query", p(&store), "--context", "book", "--queries", p(&queries), "--layer", "1", "--json"];
    let run = |extra: &[&str]| lines(&ok(&[&base[..], extra].concat()));
    // full: every token, exact.
    let full = run(&["--mode", "full"]);
    assert_eq!(full.len(), 4 * 3, "one line per (q head, query)");
    for r in &full {
        for f in [
            "layer",
            "head",
            "query",
            "selected",
            "output",
            "lse",
            "keys_scored",
            "blocks_read",
            "micros",
            "plan",
            "tail_seeds",
        ] {
            assert!(!r[f].is_null(), "field {f} missing: {r}");
        }
        let (qh, qi) = (r["head"].as_u64().unwrap() as usize, r["query"].as_u64().unwrap() as usize);
        let (o, lse) = exact_attention(&ctx, &queries, 1, qh, qi, 2, 3000);
        assert_eq!(r["selected"].as_array().unwrap().len(), 3000);
        assert!(rel_err(&r["output"], &o) <= 1e-3, "full attention error {}", rel_err(&r["output"], &o));
        assert!((r["lse"].as_f64().unwrap() - lse).abs() < 1e-3);
        assert_eq!(plan(r), "full");
    }
    // DIPRS with β large is exact; with the default β it selects fewer tokens.
    for r in run(&["--mode", "diprs", "--beta", "1e9"]) {
        let (o, _) = exact_attention(
            &ctx,
            &queries,
            1,
            r["head"].as_u64().unwrap() as usize,
            r["query"].as_u64().unwrap() as usize,
            2,
            3000,
        );
        assert!(rel_err(&r["output"], &o) <= 1e-3);
        assert_eq!(r["selected"].as_array().unwrap().len(), 3000);
    }
    // β = 2·√d: tokens within e^-2 of the best weight. Diffuse heads may keep everything.
    let sparse = run(&["--mode", "diprs", "--beta", "16"]);
    assert!(sparse.iter().all(|r| plan(r) == "diprs"));
    assert!(
        sparse.iter().any(|r| r["selected"].as_array().unwrap().len() < 1500),
        "DIPRS selected everything everywhere"
    );
    // DIPRS found on the PQ codes holds every token of the graph walk's range (a generated
    // context's, which the graph finds), from exact scores of a few of the keys.
    let on_graph = run(&["--mode", "graph-diprs", "--beta", "16"]);
    for (c, g) in sparse.iter().zip(&on_graph) {
        assert_eq!(plan(g), "graph-diprs");
        let ids = |r: &Value| r["selected"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect::<Vec<_>>();
        let from_codes = ids(c);
        let missed = ids(g).iter().filter(|t| from_codes.binary_search(t).is_err()).count();
        assert!(missed * 20 <= ids(g).len(), "the codes missed {missed} of the graph's {}", ids(g).len());
        assert!(c["keys_scored"].as_u64().unwrap() < 3000, "{c}");
    }
    // --tail on: the seeds the range left out estimate the rest of the softmax; their values
    // entered the output, so they are in `selected` too. A forced mode has none by default.
    let tailed = run(&["--mode", "diprs", "--beta", "16", "--tail", "on"]);
    let count = |r: &Value, f: &str| r[f].as_array().map_or(0, Vec::len) as u64;
    for (t, s) in tailed.iter().zip(&sparse) {
        assert_eq!(s["tail_seeds"].as_u64(), Some(0), "{s}");
        assert_eq!(count(t, "selected") - count(s, "selected"), t["tail_seeds"].as_u64().unwrap());
    }
    assert!(tailed.iter().all(|r| r["tail_seeds"].as_u64().unwrap() > 0), "a range left no seed out");
    let bad_tail = ctxfs(&[&base[..], &["--tail", "maybe"]].concat());
    assert!(String::from_utf8_lossy(&bad_tail.stderr).contains("expected on or off"));
    // --target-error: β is cut per query where the output error is estimated to meet it; the
    // answer is then close to exact attention, and reports its estimate.
    let (mut met, mut estimated) = (0, 0);
    let targeted = run(&["--mode", "flat", "--target-error", "0.02"]);
    for r in &targeted {
        let (qh, qi) = (r["head"].as_u64().unwrap() as usize, r["query"].as_u64().unwrap() as usize);
        let (o, _) = exact_attention(&ctx, &queries, 1, qh, qi, 2, 3000);
        met += usize::from(rel_err(&r["output"], &o) <= 0.02);
        estimated += usize::from(r["estimated_error"].as_f64().is_some_and(|e| (0.0..1.0).contains(&e)));
    }
    assert_eq!(estimated, targeted.len(), "every answer reports its estimate");
    assert!(met * 10 >= targeted.len() * 9, "met on {met} of {}", targeted.len());
    assert!(sparse.iter().all(|r| r["estimated_error"].is_null()), "no target, no estimate");
    let bad_target = ctxfs(&[&base[..], &["--target-error", "0"]].concat());
    assert_eq!(bad_target.status.code(), Some(2), "a usage error");
    assert!(String::from_utf8_lossy(&bad_target.stderr).contains("--target-error"));
    // --resident-budget below the whole index: served compact, from the PQ codes, with the
    // target met as by the scan; below even the codes, refused with the context named. (At
    // 3,000 tokens the codes' centroids weigh as much as the codes: a quarter, not an
    // eighth, holds them.)
    let (mut met, compact) = (0, run(&["--mode", "pq", "--target-error", "0.02", "--resident-budget", "0.25"]));
    for r in &compact {
        let (qh, qi) = (r["head"].as_u64().unwrap() as usize, r["query"].as_u64().unwrap() as usize);
        let (o, _) = exact_attention(&ctx, &queries, 1, qh, qi, 2, 3000);
        met += usize::from(rel_err(&r["output"], &o) <= 0.02);
        assert_eq!(plan(r), "pq");
    }
    assert!(met * 10 >= compact.len() * 9, "met on {met} of {}", compact.len());
    let refused = ctxfs(&[&base[..], &["--resident-budget", "0.001"]].concat());
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("resident"), "{refused:?}");
    // A reused prefix: only tokens below it, and the window is that of the prefix.
    for r in run(&["--mode", "diprs", "--prefix", "1000"]) {
        let sel: Vec<u64> = r["selected"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
        assert!(sel.iter().all(|&t| t < 1000));
        assert!(sel.contains(&999) && sel.contains(&0), "the window is the prefix's");
        assert_eq!(plan(&r), "diprs+prefix");
    }
    // auto: 3,000 tokens is a short context, attended in full (the other rules are unit-tested
    // in ctxfs-attention's plan module, and met at scale by the demo).
    let auto0 =
        lines(&ok(&["query", p(&store), "--context", "book", "--queries", p(&queries), "--layer", "0", "--json"]));
    assert!(auto0.iter().all(|r| plan(r) == "full"));
    let topk = run(&["--mode", "topk", "--k", "50"]);
    assert!(topk.iter().all(|r| r["selected"].as_array().unwrap().len() == 640 + 50));
    // The coarse modes: at most the budget beyond the window, from the metadata stored at import.
    for mode in ["quest", "infllm", "pq"] {
        for r in run(&["--mode", mode, "--budget", "256"]) {
            let n = r["selected"].as_array().unwrap().len();
            assert!(n > 640 && n <= 640 + 256, "{mode}: {n} selected");
            assert_eq!(plan(&r), mode);
        }
    }
    let bad_mode = ctxfs(&["query", p(&store), "--context", "book", "--queries", p(&queries), "--mode", "hnsw"]);
    assert!(String::from_utf8_lossy(&bad_mode.stderr).contains("unknown mode \"hnsw\" (expected auto,"));
    let bad = ctxfs(&["query", p(&store), "--context", "book", "--queries", p(&queries), "--layer", "7"]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("layer 7"), "{}", String::from_utf8_lossy(&bad.stderr));
    // A NaN in layer 1's queries is found before layer 0 is answered: nothing on stdout.
    let poisoned = dir.path().join("poisoned.queries.safetensors");
    let mut bytes = std::fs::read(&queries).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let meta: Value = serde_json::from_slice(&bytes[8..8 + header]).unwrap();
    let at = 8 + header + meta["layers.1.q"]["data_offsets"][0].as_u64().unwrap() as usize;
    match meta["layers.1.q"]["dtype"].as_str().unwrap() {
        "F32" => bytes[at..at + 4].copy_from_slice(&f32::NAN.to_le_bytes()),
        "F16" => bytes[at..at + 2].copy_from_slice(&0x7e00u16.to_le_bytes()),
        other => panic!("a query tensor of {other}"),
    }
    std::fs::write(&poisoned, &bytes).unwrap();
    let out = ctxfs(&["query", p(&store), "--context", "book", "--queries", p(&poisoned), "--json"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    assert!(out.stdout.is_empty() && stderr_of(&out).contains("layers.1.q"), "{}", stderr_of(&out));
}

#[test]
fn import_refuses_non_finite_input_and_writes_nothing() {
    let dir = tmp();
    let ctx = dir.path().join("c.safetensors");
    gen(&ctx, "--tokens 500 --layers 1 --q-heads 2 --kv-heads 1 --head-dim 32 --queries 50");
    // Poison one value of layers.0.v with a NaN (f16 0x7e00).
    let mut bytes = std::fs::read(&ctx).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let meta: Value = serde_json::from_slice(&bytes[8..8 + header]).unwrap();
    let at = 8 + header + meta["layers.0.v"]["data_offsets"][0].as_u64().unwrap() as usize + 2 * 777;
    bytes[at..at + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
    std::fs::write(&ctx, &bytes).unwrap();
    let store = dir.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "16M"]);
    let before = json(&["inspect", p(&store), "--json"]);
    let out = ctxfs(&["import", p(&store), p(&ctx), "--name", "poisoned"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not finite") && err.contains("layers.0.v") && err.contains("777"), "{err}");
    let after = json(&["inspect", p(&store), "--json"]);
    assert_eq!(after["contexts"], before["contexts"]);
    assert_eq!(after["superblock"]["generation"], before["superblock"]["generation"], "nothing was committed");
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
}

#[test]
fn a_file_without_prefill_queries_takes_its_q_heads_from_the_command_line() {
    let dir = tmp();
    let (full, ctx) = (dir.path().join("full.safetensors"), dir.path().join("noq.safetensors"));
    let queries = dir.path().join("full.queries.safetensors");
    gen(&full, "--tokens 600 --layers 1 --q-heads 4 --kv-heads 2 --head-dim 64 --queries 8 --decode-queries 2");
    let bytes = std::fs::read(&full).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<_> = st.tensors().into_iter().filter(|(name, _)| name != "layers.0.q").collect();
    safetensors::serialize_to_file(kept, &None, &ctx).unwrap();
    // Blocks of 16 KiB: the import sizes its pool for them.
    let store = dir.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "64M", "--block-size", "16384"]);
    let query = |context: &str| ctxfs(&["query", p(&store), "--context", context, "--queries", p(&queries)]);

    // Without --q-heads the file says one per kv head, and the model's queries do not fit.
    ok(&["import", p(&store), p(&ctx), "--name", "guessed"]);
    let out = query("guessed");
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr_of(&out).contains("expected [2, n, 64]: the context's q heads"), "{}", stderr_of(&out));

    let imported = json(&["import", p(&store), p(&ctx), "--name", "told", "--q-heads", "4", "--json"]);
    assert_eq!(imported["q_heads"], 4);
    assert_eq!(lines(&ok(&["query", p(&store), "--context", "told", "--queries", p(&queries), "--json"])).len(), 4 * 2);
    for (file, q_heads, says) in [
        (&ctx, "3", "q heads (3) must be a multiple of kv heads (2)"),
        (&full, "2", "2 q heads were given, but layers.0.q holds 4"),
    ] {
        let out = ctxfs(&["import", p(&store), p(file), "--name", "bad", "--q-heads", q_heads]);
        assert_eq!(out.status.code(), Some(1));
        assert!(stderr_of(&out).contains(says), "{}", stderr_of(&out));
    }
    assert_eq!(context_names(&store), ["guessed", "told"]);
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));

    // A query file for more layers than the context has is refused, not answered in part.
    let two = dir.path().join("two.safetensors");
    gen(&two, "--tokens 600 --layers 2 --q-heads 4 --kv-heads 2 --head-dim 64 --queries 8 --decode-queries 2");
    let two_queries = dir.path().join("two.queries.safetensors");
    let out = ctxfs(&["query", p(&store), "--context", "told", "--queries", p(&two_queries)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr_of(&out).contains("holds layers.1.q, but the context has 1 layer"), "{}", stderr_of(&out));
}

#[test]
fn bench_search_reports_every_method_against_exact_attention() {
    let args = ["--tokens", "4000", "--head-dim", "64", "--heads", "1", "--queries", "2", "--seeds", "1,5", "--json"];
    let all = json(&[&["bench", "search"][..], &args].concat());
    assert_eq!(all["datasets"].as_array().unwrap().len(), 1, "the generator alone");
    let v = &all["datasets"][0];
    assert_eq!(v["dataset"], "generator");
    let rows = v["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["method"].as_str().unwrap()).collect();
    let methods = [
        "flat",
        "topk k=100",
        "topk k=2000",
        "diprs beta=5·√d",
        "graph diprs beta=5·√d",
        "graph diprs beta=5·√d all-cold",
        "graph diprs beta=5·√d warm",
        "graph diprs filtered 20%",
        "graph diprs 20% prefix graph",
        "flat 20% prefix",
        "graph diprs filtered 50%",
        "diprs filtered 20%",
        "diprs filtered 50%",
    ];
    for m in methods {
        assert!(names.contains(&m), "{m} missing from {names:?}");
    }
    let row = |name: &str| rows.iter().find(|r| r["method"] == name).unwrap();
    for flat in ["flat", "flat 20% prefix", "flat 50% prefix"] {
        assert_eq!(row(flat)["dipr_recall"].as_f64(), Some(1.0), "{flat} is the exact DIPR set");
        assert_eq!(row(flat)["keys_scored_fraction"].as_f64(), Some(1.0), "{flat} scores its prefix");
    }
    for r in rows {
        let rec = r["recovery"].as_f64().unwrap();
        assert!((0.0..=1.0 + 1e-4).contains(&rec), "{r}");
        assert!(r["dipr_recall"].as_f64().unwrap() <= 1.0);
    }
    // Speed-ups are ratios of sums over every group step, each head's sums reported.
    let total = |name: &str| row(name)["total_us"].as_f64().unwrap();
    for (key, name) in [("diprs", "diprs beta=5·√d"), ("graph_diprs", "graph diprs beta=5·√d")] {
        let speedup = v["ratios"][format!("{key}_vs_flat_speedup")].as_f64().unwrap();
        assert!((speedup - total("flat") / total(name)).abs() <= 1e-9 * speedup, "{key}: {speedup}");
    }
    // The codes' DIPRS splits its step: the seeds and the scan, then the exact scores.
    let (scan, step) = (
        row("diprs beta=5·√d")["scan_median_us"].as_f64().unwrap(),
        row("diprs beta=5·√d")["latency_median_us"].as_f64().unwrap(),
    );
    assert!(scan > 0.0 && scan < step, "scan {scan} µs of a {step} µs step");
    assert!(row("flat")["scan_median_us"].is_null(), "the flat plan scans no codes");
    // The seeds and the scan are part of every step: they bound how fast DIPRS can be.
    let bound = v["ratios"]["diprs_scan_bound_speedup"].as_f64().unwrap();
    let diprs = v["ratios"]["diprs_vs_flat_speedup"].as_f64().unwrap();
    assert!(bound > diprs, "the scan alone {bound}× the flat plan, DIPRS {diprs}×");
    let heads = v["per_head"].as_array().unwrap();
    assert_eq!(heads.len(), 2, "one head per seed");
    assert_eq!((heads[0]["tuning_seed"].as_bool(), heads[1]["tuning_seed"].as_bool()), (Some(true), Some(false)));
    let head_sum: f64 = heads.iter().map(|h| h["flat_us"].as_f64().unwrap()).sum();
    assert!((head_sum - total("flat")).abs() <= 1e-6 * head_sum, "the heads' sums add up to the row's");
    // Each head's DIPR ranges outside the window are what the flat plan selects beyond it.
    let share = heads.iter().map(|h| h["dipr_range_share"].as_f64().unwrap()).sum::<f64>() / heads.len() as f64;
    let (range, flat_selected) = (share * 4000.0, row("flat")["selected_tokens"].as_f64().unwrap());
    assert!(range > 0.0, "the ranges hold tokens beyond the window");
    assert!((range + 640.0 - flat_selected).abs() <= 1e-6 * flat_selected, "{range} + 640 ≠ {flat_selected}");
    let range_cost: f64 =
        heads.iter().map(|h| h["flat_us"].as_f64().unwrap() * h["dipr_range_share"].as_f64().unwrap()).sum();
    let range_bound = v["ratios"]["dipr_range_bound_speedup"].as_f64().unwrap();
    assert!((range_bound - total("flat") / range_cost).abs() <= 1e-6 * range_bound, "{range_bound}");
    for k in [
        "graph_diprs_warm_vs_flat_speedup",
        "graph_diprs_all_cold_vs_flat_speedup",
        "filtered20_vs_prefix_graph_latency",
        "codes_filtered20_vs_flat_prefix_speedup",
    ] {
        assert!(v["ratios"][k].as_f64().unwrap() > 0.0, "{k}");
    }
    assert!(v["ratios"]["filtered50_vs_flat_prefix_speedup"].as_f64().unwrap() > 0.0);
    // The all-cold row is the same search, timed without the warm-up: the same answers.
    for field in ["dipr_recall", "keys_scored_fraction", "output_error", "selected_tokens"] {
        assert_eq!(row("graph diprs beta=5·√d")[field], row("graph diprs beta=5·√d all-cold")[field], "{field}");
    }
    // A filtered search answers over the prefix exactly as a flat scan of the prefix would.
    assert_eq!(
        row("graph diprs filtered 20%")["exact_dipr_output_error"],
        row("flat 20% prefix")["exact_dipr_output_error"]
    );
    let costs = &v["row_costs"];
    let (flat_ns, scattered_ns) = (costs["flat_row_ns"].as_f64().unwrap(), costs["scattered_row_ns"].as_f64().unwrap());
    assert!(flat_ns > 0.0 && scattered_ns > 0.0, "{costs}");
    let cost_ratio = v["ratios"]["scattered_vs_flat_row_cost"].as_f64().unwrap();
    assert!((cost_ratio - scattered_ns / flat_ns).abs() <= 1e-6 * cost_ratio, "{cost_ratio} against {costs}");
    assert_eq!(costs["probe_rows"].as_u64(), Some(1024));
    assert_eq!(v["build"].as_array().unwrap().len(), 2);
}

/// A context file of many thin layers: large against one head's working set.
fn thin_layers(dir: &Path) -> std::path::PathBuf {
    let ctx = dir.join("thin.safetensors");
    gen(&ctx, "--tokens 8192 --layers 32 --q-heads 1 --kv-heads 1 --head-dim 64 --queries 256 --decode-queries 1");
    ctx
}

/// Peak resident memory of a running child, polled until it exits (VmHWM only grows).
fn peak_rss_kib(child: &mut std::process::Child) -> (std::process::ExitStatus, u64) {
    let mut peak = 0;
    loop {
        if let Ok(s) = std::fs::read_to_string(format!("/proc/{}/status", child.id())) {
            if let Some(kib) = s.lines().find_map(|l| l.strip_prefix("VmHWM:")) {
                peak = peak.max(kib.trim().trim_end_matches("kB").trim().parse().unwrap_or(0));
            }
        }
        if let Some(status) = child.try_wait().unwrap() {
            return (status, peak);
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn import_streams_a_file_larger_than_its_memory_and_buffer_budget() {
    let dir = tmp();
    let ctx = thin_layers(dir.path());
    let file_kib = std::fs::metadata(&ctx).unwrap().len() / 1024;
    let store = dir.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "512M"]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ctxfs"))
        .args(["import", p(&store), p(&ctx), "--name", "thin", "--json"])
        .env_remove("CTXFS_DEVICE")
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (status, peak) = peak_rss_kib(&mut child);
    assert!(status.success());
    // The import's buffer pool is 16 MiB, its writes hold 5 MiB (4 in flight, 1 being
    // sealed), and one head is held at a time: its peak (32–39 MiB, alone and beside the
    // other tests; each thread's allocator arena and stack count too) stays well below the
    // 67 MiB it reads, which an import holding the file would exceed.
    assert!(file_kib > 60 * 1024, "{file_kib} KiB");
    assert!(peak < 48 * 1024, "peak RSS {peak} KiB for a {file_kib} KiB file");
    let v = json(&["inspect", p(&store), "--json"]);
    assert_eq!(v["contexts"][0]["name"], "thin");
    assert_eq!(v["contexts"][0]["shape"]["layers"], 32);
}

#[test]
fn an_interrupted_import_leaves_nothing_visible_and_no_space_lost() {
    let dir = tmp();
    let ctx = thin_layers(dir.path());
    let store = dir.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "512M"]);
    let before = json(&["inspect", p(&store), "--json"]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ctxfs"))
        .args(["import", p(&store), p(&ctx), "--name", "thin"])
        .env_remove("CTXFS_DEVICE")
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(child.try_wait().unwrap().is_none(), "the import must still be running to be interrupted");
    child.kill().unwrap();
    assert!(!child.wait().unwrap().success());
    let after = json(&["inspect", p(&store), "--json"]);
    assert_eq!(after["contexts"], before["contexts"], "nothing visible");
    assert_eq!(after["superblock"]["generation"], before["superblock"]["generation"]);
    assert_eq!(after["space"]["free_blocks"], before["space"]["free_blocks"], "no space lost");
    // The blocks it wrote were never allocated by a commit: fsck finds nothing to reclaim.
    let out = ctxfs(&["fsck", p(&store), "--repair"]);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    ok(&["import", p(&store), p(&ctx), "--name", "thin"]);
}

#[test]
fn an_interrupted_gen_leaves_no_partial_file() {
    let dir = tmp();
    let out = dir.path().join("big.safetensors");
    let partial = out.with_extension("safetensors.partial");
    let run = interrupted(&["gen", p(&out), "--tokens", "262144", "--layers", "8"], &partial, 0);
    assert_eq!(run.status.code(), Some(130), "{}", stderr_of(&run));
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "left behind: {left:?}");
}

/// Runs ctxfs with `args`, sends it SIGINT `then_ms` after `appears` exists, and returns what
/// it printed and how it ended.
fn interrupted(args: &[&str], appears: &Path, then_ms: u64) -> Output {
    let child = spawn_piped(args);
    let started = std::time::Instant::now();
    while !appears.exists() {
        assert!(started.elapsed().as_secs() < 60, "{args:?} never made {}", appears.display());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(then_ms));
    assert!(Command::new("kill").args(["-INT", &child.id().to_string()]).status().unwrap().success());
    child.wait_with_output().unwrap()
}

/// Ctrl-C stops `bench io` at its next step: its scratch context and raw file go, and it
/// exits with 130. A scratch context a killed run left (`bench-io-PID`, `bench-buffer-PID`) is
/// deleted by the next run; a context merely named alike is not.
#[test]
fn an_interrupted_bench_leaves_no_scratch_and_the_next_sweeps_a_killed_ones() {
    let dir = tmp();
    let store = dir.path().join("b.ctxfs");
    ok(&["mkfs", p(&store), "--size", "1G"]);
    let small = small_context(dir.path());
    for name in ["bench-buffer-77", "bench-io-notes"] {
        ok(&["import", p(&store), p(&small), "--name", name]);
    }
    let raw = store.with_extension("bench-raw");
    let out = interrupted(&["bench", "io", p(&store), "--mib", "256", "--rounds", "50"], &raw, 500);
    assert_eq!(out.status.code(), Some(130), "{}", stderr_of(&out));
    assert!(stderr_of(&out).contains("interrupted by SIGINT"), "{}", stderr_of(&out));
    assert!(!raw.exists());
    let names: Vec<String> = context_names(&store);
    assert_eq!(names, ["bench-io-notes"]);
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
}

#[test]
fn a_head_dim_whose_records_need_larger_blocks_is_refused_before_building() {
    let dir = tmp();
    let ctx = dir.path().join("wide.safetensors");
    gen(&ctx, "--tokens 1024 --layers 1 --q-heads 1 --kv-heads 1 --head-dim 600");
    let (small, large) = (dir.path().join("4k.ctxfs"), dir.path().join("8k.ctxfs"));
    ok(&["mkfs", p(&small), "--size", "16M"]);
    let out = ctxfs(&["import", p(&small), p(&ctx), "--name", "w"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr_of(&out).contains("--block-size"), "{}", stderr_of(&out));
    ok(&["mkfs", p(&large), "--size", "32M", "--block-size", "8192"]);
    ok(&["import", p(&large), p(&ctx), "--name", "w"]);
}

#[test]
fn import_into_a_full_store_is_refused_before_writing() {
    let dir = tmp();
    let ctx = thin_layers(dir.path());
    let store = dir.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "16M"]);
    let before = json(&["inspect", p(&store), "--json"]);
    let out = ctxfs(&["import", p(&store), p(&ctx), "--name", "thin"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("store full") && err.contains("blocks"), "{err}");
    let after = json(&["inspect", p(&store), "--json"]);
    assert_eq!(after["superblock"]["generation"], before["superblock"]["generation"], "nothing was committed");
    assert_eq!(after["space"], before["space"]);
    // The same name twice: the second import is refused, the first context untouched.
    let big = dir.path().join("big.ctxfs");
    ok(&["mkfs", p(&big), "--size", "512M"]);
    ok(&["import", p(&big), p(&ctx), "--name", "thin"]);
    let again = ctxfs(&["import", p(&big), p(&ctx), "--name", "thin"]);
    assert!(String::from_utf8_lossy(&again.stderr).contains("already exists"));
}

#[test]
fn a_second_writer_is_refused_naming_the_holder_and_readers_work_beside_it() {
    let dir = tmp();
    let (ctx, store) = small_store(dir.path(), "64M", "a");
    let before = json(&["inspect", p(&store), "--json"]);
    let writer = ctxfs_vfs::Store::open_path(&store, ctxfs_vfs::DeviceChoice::Auto).unwrap();
    let holder = format!("open for writing by process {}", std::process::id());
    for args in [
        &["import", p(&store), p(&ctx), "--name", "b"][..],
        &["delete", p(&store), "a"],
        &["mkfs", p(&store), "--size", "64M", "--force"],
        &["fsck", p(&store), "--repair"],
    ] {
        let out = ctxfs(args);
        assert!(!out.status.success(), "ctxfs {args:?} must be refused");
        assert!(stderr_of(&out).contains(&holder), "ctxfs {args:?}: {}", stderr_of(&out));
    }
    // A second writer in the same process is refused too, without a pid to name.
    let err = ctxfs_vfs::Store::open_path(&store, ctxfs_vfs::DeviceChoice::Auto).err().expect("second writer");
    assert!(matches!(err, ctxfs_vfs::Error::Locked { .. }), "{err}");
    // Readers work beside the writer.
    assert_eq!(json(&["inspect", p(&store), "--json"])["contexts"], before["contexts"]);
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
    drop(writer);
    let after = json(&["inspect", p(&store), "--json"]);
    assert_eq!(after["superblock"]["generation"], before["superblock"]["generation"], "nothing was written");
    assert_eq!(after["space"], before["space"]);
    // The lock dies with its holder: the refused import now runs.
    ok(&["import", p(&store), p(&ctx), "--name", "b"]);
}

#[test]
fn concurrent_imports_are_both_kept_or_the_second_is_refused() {
    let dir = tmp();
    let ctx = small_context(dir.path());
    let store = dir.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "256M"]);
    let mut kept = Vec::new();
    for round in 0..4 {
        let names = [format!("r{round}a"), format!("r{round}b")];
        let children: Vec<_> = names
            .iter()
            .map(|name| {
                Command::new(env!("CARGO_BIN_EXE_ctxfs"))
                    .args(["import", p(&store), p(&ctx), "--name", name])
                    .env_remove("CTXFS_DEVICE")
                    .stderr(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::null())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for (name, child) in names.iter().zip(children) {
            let out = child.wait_with_output().unwrap();
            if out.status.success() {
                kept.push(name.clone());
            } else {
                assert!(stderr_of(&out).contains("open for writing by process"), "{name}: {}", stderr_of(&out));
            }
        }
        let listed: Vec<String> = context_names(&store);
        let mut want = kept.clone();
        want.sort();
        let mut listed = listed;
        listed.sort();
        assert_eq!(listed, want, "every import that said it succeeded is in the store");
    }
    assert!(!kept.is_empty());
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
}

#[test]
fn the_space_a_delete_freed_is_taken_by_the_next_import_that_needs_it() {
    let dir = tmp();
    // Room for one such context, not two.
    let (ctx, store) = small_store(dir.path(), "1200K", "a");
    let out = ctxfs(&["import", p(&store), p(&ctx), "--name", "b"]);
    assert!(stderr_of(&out).contains("store full"), "{}", stderr_of(&out));
    // The fallback state still holds a's blocks after the delete: the import commits once
    // more to free them, then takes them.
    ok(&["delete", p(&store), "a"]);
    ok(&["import", p(&store), p(&ctx), "--name", "b"]);
    assert_eq!(context_names(&store), ["b"]);
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
}

#[test]
fn a_reader_keeps_its_snapshot_while_writer_processes_reuse_space() {
    let dir = tmp();
    let (ctx, store) = small_store(dir.path(), "128M", "a");
    let reader = ctxfs_vfs::Store::open_path_read_only(&store, ctxfs_vfs::DeviceChoice::Auto).unwrap();
    let snap = reader.snapshot();
    let digest = context_digest(&snap, "a");
    assert!(reader.begin().is_err(), "a read-only store refuses transactions");
    // Each command is its own writer process. The allocator hands out the lowest free blocks
    // first, so without the reader's pins "c" and "d" would land on "a"'s blocks.
    ok(&["delete", p(&store), "a"]);
    ok(&["import", p(&store), p(&ctx), "--name", "b"]);
    ok(&["import", p(&store), p(&ctx), "--name", "c"]);
    ok(&["delete", p(&store), "b"]);
    ok(&["import", p(&store), p(&ctx), "--name", "d"]);
    assert_eq!(context_digest(&snap, "a"), digest, "the reader's snapshot is intact");
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
    let held = device_blocks(&snap, "a");
    drop(snap);
    drop(reader);
    // With the reader gone, the next writer reuses what it held.
    ok(&["import", p(&store), p(&ctx), "--name", "e"]);
    let now = ctxfs_vfs::Store::open_path_read_only(&store, ctxfs_vfs::DeviceChoice::Auto).unwrap().snapshot();
    for name in ["c", "d"] {
        assert!(device_blocks(&now, name).is_disjoint(&held), "{name} was written while a reader held the blocks");
    }
    assert!(!device_blocks(&now, "e").is_disjoint(&held), "the blocks are free once the reader is gone");
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
}

#[test]
fn fsck_on_something_that_is_not_a_store_says_so_and_exits_8() {
    let dir = tmp();
    let ctx = small_context(dir.path());
    let out = ctxfs(&["fsck", p(&ctx)]);
    assert_eq!(out.status.code(), Some(8), "{}", String::from_utf8_lossy(&out.stdout));
    let err = stderr_of(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("not a ctxfs store"), "{err}");
    assert!(out.stdout.is_empty());
}

/// `ctxfs query --json | head -1`: a reader that stops early is not an error.
#[test]
fn query_into_a_closed_pipe_exits_quietly() {
    use std::io::BufRead;
    let dir = tmp();
    // Enough decode queries that the answers overflow the pipe after its reader is gone.
    let ctx = dir.path().join("many.safetensors");
    gen(&ctx, "--tokens 2048 --layers 1 --q-heads 2 --kv-heads 1 --head-dim 64 --queries 64 --decode-queries 256");
    let store = dir.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "64M"]);
    ok(&["import", p(&store), p(&ctx), "--name", "small"]);
    let queries = ctx.with_extension("queries.safetensors");
    for json in [true, false] {
        let mut args = vec!["query", p(&store), "--context", "small", "--queries", p(&queries)];
        if json {
            args.push("--json");
        }
        let mut child = spawn_piped(&args);
        let mut first = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
        assert!(!first.is_empty(), "one line came out");
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "json {json}: {}", stderr_of(&out));
        assert!(out.stderr.is_empty(), "json {json}: {}", stderr_of(&out));
    }
}

/// Every command's report into a pipe its reader closed first: no panic, exit as if read.
#[test]
fn reports_into_a_closed_pipe_exit_quietly() {
    let dir = tmp();
    let store = dir.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "16M"]);
    let gen_out = dir.path().join("g.safetensors");
    let fresh = dir.path().join("fresh.ctxfs");
    let commands: [&[&str]; 5] = [
        &["bench", "search", "--tokens", "4096", "--heads", "1", "--queries", "2", "--seeds", "1"],
        &[
            "gen",
            p(&gen_out),
            "--tokens",
            "1024",
            "--layers",
            "1",
            "--q-heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "32",
        ],
        &["fsck", p(&store)],
        &["inspect", p(&store)],
        &["mkfs", p(&fresh), "--size", "16M"],
    ];
    for args in commands {
        let mut child = spawn_piped(args);
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{args:?}: {:?} {}", out.status, stderr_of(&out));
        assert!(out.stderr.is_empty(), "{args:?}: {}", stderr_of(&out));
    }
}

/// A capture file (tests/data: SmolLM2's keys, values, prefill and decode queries) is a context
/// to import and, with `--decode`, the decode steps to replay over it; without them, `--decode`
/// names the tensor it missed.
#[test]
fn query_decode_replays_a_capture_files_decode_steps() {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/smollm2-prose-4k.safetensors");
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "64M"]);
    ok(&["import", p(&store), data, "--name", "prose"]);
    let base = ["query", p(&store), "--context", "prose", "--queries", data, "--json"];
    // The file's layer 0: 9 q heads, 16 decode steps (and 512 prefill queries).
    let decode = lines(&ok(&[&base[..], &["--decode"]].concat()));
    assert_eq!(decode.len(), 9 * 16);
    assert_eq!(decode.iter().map(|r| r["query"].as_u64().unwrap()).max(), Some(15));
    let full = lines(&ok(&[&base[..], &["--decode", "--mode", "full"]].concat()));
    let prefill = lines(&ok(&[&base[..], &["--mode", "full", "--layer", "0"]].concat()));
    assert_eq!(prefill.len(), 9 * 512, "without --decode, the prefill queries");
    assert_ne!(full[0]["output"], prefill[0]["output"], "another query, another output");
    // A generated query file has no decode_q tensors.
    let ctx = dir.path().join("c.safetensors");
    gen(&ctx, "--tokens 3000 --layers 1 --q-heads 9 --kv-heads 3 --head-dim 64");
    let queries = dir.path().join("c.queries.safetensors");
    let out = ctxfs(&["query", p(&store), "--context", "prose", "--queries", p(&queries), "--decode"]);
    assert!(!out.status.success());
    assert!(stderr_of(&out).contains("layers.{l}.decode_q"), "{}", stderr_of(&out));
}

/// Real attention (SmolLM2-135M, layer 15, 4,096 tokens of prose: tests/data, written by
/// `python -m ctxfs.capture`) is a dataset beside the generator: every row per dataset.
#[test]
fn bench_search_measures_captured_attention_beside_the_generator() {
    let data = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/data/smollm2-prose-4k.safetensors");
    // At AlayaDB's range, √d·ln 100 (4.61·√d), instead of the default 5·√d.
    let args = [
        "--tokens",
        "4000",
        "--head-dim",
        "64",
        "--heads",
        "1",
        "--queries",
        "2",
        "--seeds",
        "1",
        "--data",
        data,
        "--beta",
        "4.61",
    ];
    let all = json(&[&["bench", "search"][..], &args, &["--json"]].concat());
    let sets = all["datasets"].as_array().unwrap();
    assert_eq!(
        sets.iter().map(|s| s["dataset"].as_str().unwrap()).collect::<Vec<_>>(),
        ["generator", "smollm2-prose-4k"]
    );
    let real = &sets[1];
    assert_eq!(
        (real["tokens"].as_u64(), real["head_dim"].as_u64(), real["group"].as_u64()),
        (Some(4096), Some(64), Some(3))
    );
    let heads = real["per_head"].as_array().unwrap();
    assert_eq!(heads.len(), 3, "one layer of 3 kv heads");
    assert!(heads.iter().all(|h| h["layer"] == "15"), "{heads:?}");
    assert_eq!(real["steps_per_head"].as_u64(), Some(2), "--queries caps the captured steps");
    let flat = real["rows"].as_array().unwrap().iter().find(|r| r["method"] == "flat").unwrap();
    assert_eq!(flat["dipr_recall"].as_f64(), Some(1.0));
    assert_eq!(real["reference_beta_sqrt_d"].as_f64(), Some(4.61));
    let diprs = real["rows"].as_array().unwrap().iter().find(|r| r["method"] == "diprs beta=4.61·√d").unwrap();
    let recall = diprs["dipr_recall"].as_f64().unwrap();
    assert!((0.5..=1.0).contains(&recall), "{recall}");
    assert!(real["ratios"]["graph_diprs_vs_flat_speedup"].as_f64().unwrap() > 0.0);
    let refused = ctxfs(&["bench", "search", "--beta", "0"]);
    assert_eq!(refused.status.code(), Some(2), "a usage error: {refused:?}");
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not a positive number"), "{refused:?}");
    // The target rows: the share of queries that met --target-error (default 0.01), and the
    // tokens retrieved against the oracle's (the fewest best-scoring tokens that meet it).
    for name in ["flat target", "graph diprs target", "pq target"] {
        let row = real["rows"].as_array().unwrap().iter().find(|r| r["method"] == name).unwrap();
        assert_eq!(row["target_error"].as_f64(), Some(0.01), "{row}");
        let met = row["target_met"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&met) && row["tokens_vs_oracle"].as_f64().unwrap() > 0.0, "{row}");
    }
}

/// Damage to one context's token ids or record leaves the store's other contexts served,
/// imported beside and checked; the damaged record is named, listed, and dropped by fsck.
#[test]
fn one_damaged_context_leaves_the_others_served() {
    let dir = tmp();
    let ctx = small_context(dir.path());
    let queries = ctx.with_extension("queries.safetensors");
    let clean = dir.path().join("clean.ctxfs");
    ok(&["mkfs", p(&clean), "--size", "64M"]);
    for name in ["a", "b"] {
        ok(&["import", p(&clean), p(&ctx), "--name", name]);
    }
    let blocks: Vec<Value> = serde_json::from_value(json(&["inspect", p(&clean), "--blocks", "--json"])).unwrap();
    let first_of = |stream: &str| {
        blocks.iter().find(|b| b["context"] == "a" && b["kind"] == "catalog" && b["stream"] == stream).unwrap()["block"]
            .as_u64()
            .unwrap()
    };
    for (stream, served_by_name) in [("tokens", true), ("meta", false)] {
        let store = dir.path().join(format!("{stream}.ctxfs"));
        std::fs::copy(&clean, &store).unwrap();
        let block = first_of(stream);
        std::fs::OpenOptions::new().write(true).open(&store).unwrap().write_all_at(&[0u8; 4096], block * 4096).unwrap();
        let query =
            |name: &str| ctxfs(&["query", p(&store), "--context", name, "--queries", p(&queries), "--layer", "0"]);
        assert!(query("b").status.success(), "{stream}: {}", stderr_of(&query("b")));
        // Token ids are not needed to answer attention; a damaged record is named.
        let a = query("a");
        assert_eq!(a.status.success(), served_by_name, "{stream}: {}", stderr_of(&a));
        if !served_by_name {
            assert!(stderr_of(&a).contains(&format!("block {block}")), "{}", stderr_of(&a));
            let damaged = json(&["inspect", p(&store), "--json"])["damaged_contexts"].clone();
            assert_eq!(damaged[0]["name"], "a", "{damaged}");
        }
        ok(&["import", p(&store), p(&ctx), "--name", "c"]);
        assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(4), "{stream}");
        assert_eq!(ctxfs(&["fsck", p(&store), "--repair", "--drop-damaged"]).status.code(), Some(1), "{stream}");
        assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0), "{stream}");
        assert!(query("b").status.success() && query("c").status.success());
    }
}

/// A report that cannot be written (standard output a full disk, not a closed pipe) fails the
/// command, saying that the change it made is committed all the same; fsck gives its verdict.
#[test]
fn a_report_that_cannot_be_written_says_the_change_is_committed() {
    let dir = tmp();
    let (ctx, store) = small_store(dir.path(), "64M", "a");
    let into_full_disk = |args: &[&str]| {
        let full = std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap();
        Command::new(env!("CARGO_BIN_EXE_ctxfs")).args(args).env_remove("CTXFS_DEVICE").stdout(full).output().unwrap()
    };
    let out = into_full_disk(&["import", p(&store), p(&ctx), "--name", "b"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr_of(&out));
    let err = stderr_of(&out);
    assert!(
        err.contains("cannot write to standard output") && err.contains("change to the store is committed"),
        "{err}"
    );
    assert_eq!(context_names(&store), ["a", "b"]);
    let out = into_full_disk(&["inspect", p(&store)]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!stderr_of(&out).contains("committed"), "{}", stderr_of(&out));
    let out = into_full_disk(&["fsck", p(&store)]);
    assert_eq!(out.status.code(), Some(8));
    assert!(stderr_of(&out).contains("the check's verdict was exit code 0"), "{}", stderr_of(&out));
}

/// A write past the file size limit (`ulimit -f`) is an error the command reports and cleans
/// up after, not a silent kill by SIGXFSZ.
#[test]
fn a_file_size_limit_fails_as_an_error_that_leaves_nothing_behind() {
    let dir = tmp();
    let (store, out) = (dir.path().join("s.ctxfs"), dir.path().join("g.safetensors"));
    for cmd in [
        format!("mkfs {} --size 64M", p(&store)),
        format!("gen {} --tokens 65536 --layers 1 --q-heads 2 --kv-heads 1", p(&out)),
    ] {
        let run = Command::new("bash")
            .arg("-c")
            .arg(format!("ulimit -f 1024; exec {} {cmd}", env!("CARGO_BIN_EXE_ctxfs")))
            .env_remove("CTXFS_DEVICE")
            .output()
            .unwrap();
        assert_eq!(run.status.code(), Some(1), "{cmd}: {:?} {}", run.status, stderr_of(&run));
        assert!(stderr_of(&run).contains("File too large"), "{cmd}: {}", stderr_of(&run));
    }
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A pipe given as an input file is refused at once (an open would wait for a writer).
#[test]
fn a_pipe_given_as_an_input_file_is_refused_at_once() {
    let dir = tmp();
    let (_, store) = small_store(dir.path(), "64M", "a");
    let fifo = dir.path().join("fifo");
    assert!(Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    for (args, why) in [
        (vec!["import", p(&store), p(&fifo), "--name", "b"], "not a regular file"),
        (vec!["query", p(&store), "--context", "a", "--queries", p(&fifo)], "not a regular file"),
        (vec!["inspect", p(&fifo)], "neither a regular file nor a block device"),
    ] {
        let out = ctxfs(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", stderr_of(&out));
        assert!(stderr_of(&out).contains(why), "{args:?}: {}", stderr_of(&out));
    }
}

/// `bench buffer`'s scratch context holds test bytes in its index stream, `bench io`'s in its
/// data stream beside an empty index: fsck leaves them out while the benchmark that made
/// them runs, and names one a killed run left, once, with its benchmark.
#[test]
fn fsck_names_a_killed_benchs_scratch_context_and_skips_a_running_ones() {
    let dir = tmp();
    let (_, store) = small_store(dir.path(), "64M", "a");
    let scratch = |bench: &str, pid: u32| {
        let name = format!("bench-{bench}-{pid}");
        let s = ctxfs_vfs::Store::open_path(&store, ctxfs_vfs::DeviceChoice::Auto).unwrap();
        let shape =
            ctxfs_vfs::ModelShape { layers: 1, q_heads: 1, kv_heads: 1, head_dim: 128, dtype: ctxfs_vfs::DType::F16 };
        let stream = if bench == "io" { ctxfs_vfs::FileStream::Data } else { ctxfs_vfs::FileStream::Index };
        let mut txn = s.begin().unwrap();
        txn.create_context(&name, shape, &[]).unwrap();
        for _ in 0..4 {
            txn.append_block(&name, 0, 0, stream, &[0x5a; 4000]).unwrap();
        }
        txn.commit().unwrap();
        name
    };
    // This test's process stands for the running benchmarks.
    scratch("buffer", std::process::id());
    scratch("io", std::process::id());
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
    // Beyond the largest pid Linux hands out: no process has them.
    let left = [scratch("buffer", 4_194_305), scratch("io", 4_194_306)];
    let out = ctxfs(&["fsck", p(&store), "--json"]);
    assert_eq!(out.status.code(), Some(4), "{}", stderr_of(&out));
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    let problems = report["problems"].as_array().unwrap();
    assert_eq!(problems.len(), 2, "{problems:?}");
    for (problem, (name, bench)) in problems.iter().zip(left.iter().zip(["buffer", "io"])) {
        assert_eq!(problem["context"], name.as_str());
        let message = problem["message"].as_str().unwrap();
        assert!(message.contains("did not finish") && message.contains(&format!("bench {bench}`")), "{problems:?}");
    }
}
