//! Crash safety with real processes. `ctxfs import`, and a session that stores new tokens,
//! run as child processes and are killed with SIGKILL at points spread over their lives. After
//! every kill the store opens for writing (the dead writer's lock is gone), fsck is clean,
//! every context committed before is byte-identical, and the killed write is there whole or
//! not at all. Also: writes that meet a full store, or a full file system under the store
//! file, fail before their commit and leave the store as it was.

mod common;

use common::*;
use ctxfs_attention::{Db, DbConfig};
use ctxfs_vfs::{DeviceChoice, SplitMix64, Store};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// Kill points per workload: two workloads make 60.
const POINTS: usize = 30;
const _: () = assert!(2 * POINTS >= 50, "no fewer than 50 kill points in all");
/// The context every store holds before the killed write.
const BASE: &str = "base";
/// The context the killed write adds.
const ADDED: &str = "added";
/// Tokens the session workload stores on top of the base context.
const SESSION_TOKENS: usize = 1024;
/// Set in the child process of the session workload: "STORE".
const CHILD_ENV: &str = "CTXFS_CRASH_TEST_STORE";

fn db_config() -> DbConfig {
    DbConfig { pool_bytes: 16 << 20, ..Default::default() }
}

/// The session workload, as a child process runs it: the test binary runs itself with only
/// this test selected and [`CHILD_ENV`] naming the store. Run any other way, it does nothing.
#[test]
#[ignore = "the child process of a_session_killed_while_storing_is_all_or_nothing"]
fn child_stores_a_session() {
    let Ok(store) = std::env::var(CHILD_ENV) else { return };
    let db = Db::open(Path::new(&store), DeviceChoice::Auto, db_config()).unwrap();
    let mut session = db.open_session(BASE, None).unwrap();
    let shape = session.shape();
    let (d, n) = (shape.head_dim as usize, SESSION_TOKENS);
    let mut rng = SplitMix64::new(5);
    for layer in 0..shape.layers as usize {
        let mut rows =
            |heads: u16| (0..heads as usize * n * d).map(|_| rng.next_f64() as f32 - 0.5).collect::<Vec<_>>();
        let (q, k, v) = (rows(shape.q_heads), rows(shape.kv_heads), rows(shape.kv_heads));
        session.update(layer, &q, &k, &v).unwrap();
    }
    session.append_tokens(&(0..n as u32).map(|i| 4_000_000 + i).collect::<Vec<_>>());
    db.store_session(&session, ADDED).unwrap();
}

/// Where kill `k` (1..=POINTS) lands, as a share of an uninterrupted run: two thirds spread
/// evenly over the whole run, the rest over its last 15%, where the commit writes.
fn kill_point(k: usize) -> f64 {
    let even = POINTS * 2 / 3;
    if k <= even {
        k as f64 / (even + 1) as f64
    } else {
        0.85 + 0.15 * (k - even) as f64 / (POINTS - even + 1) as f64
    }
}

/// One workload: what it runs, on a store holding [`BASE`].
struct Workload {
    name: &'static str,
    command: Box<dyn Fn(&Path) -> Command>,
}

fn import_workload(input: PathBuf) -> Workload {
    Workload {
        name: "ctxfs import",
        command: Box::new(move |store| {
            let mut c = Command::new(env!("CARGO_BIN_EXE_ctxfs"));
            c.args(["import", p(store), p(&input), "--name", ADDED]).env_remove("CTXFS_DEVICE");
            c
        }),
    }
}

fn session_workload() -> Workload {
    Workload {
        name: "session store",
        command: Box::new(|store| {
            let mut c = Command::new(std::env::current_exe().unwrap());
            c.args(["--exact", "child_stores_a_session", "--ignored", "--test-threads=1"]).env(CHILD_ENV, store);
            c
        }),
    }
}

/// What a store holds, as each context's digest, by name.
fn digests(path: &Path) -> Vec<(String, Vec<u64>)> {
    let store = Store::open_path_read_only(path, DeviceChoice::Auto).unwrap();
    let snap = store.snapshot();
    let names: Vec<String> = snap.contexts().map(|c| c.name.clone()).collect();
    names.into_iter().map(|n| (n.clone(), context_digest(&snap, &n))).collect()
}

fn run_quietly(mut c: Command) -> std::process::Child {
    c.stdout(std::process::Stdio::null()).stderr(std::process::Stdio::null()).spawn().unwrap()
}

/// Kills `w` at [`POINTS`] points spread over an uninterrupted run's duration and checks the
/// store after each. Returns (absent, present) outcomes.
fn kill_at_many_points(dir: &Path, template: &Path, w: &Workload) -> (usize, usize) {
    // The reference: the same write, uninterrupted, on a copy of the same store.
    let reference = dir.join("reference.ctxfs");
    std::fs::copy(template, &reference).unwrap();
    let started = Instant::now();
    let status = run_quietly((w.command)(&reference)).wait().unwrap();
    let life = started.elapsed();
    assert!(status.success(), "{} runs to completion", w.name);
    let want = digests(&reference);
    let added = want.iter().find(|(n, _)| n == ADDED).expect("the write added its context").1.clone();
    let before = digests(template);
    let (mut absent, mut present) = (0, 0);
    for k in 1..=POINTS {
        let work = dir.join("work.ctxfs");
        std::fs::copy(template, &work).unwrap();
        let mut child = run_quietly((w.command)(&work));
        std::thread::sleep(life.mul_f64(kill_point(k)));
        // SAFETY: kill(2) on the pid of a child this test spawned and has not yet reaped.
        unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
        child.wait().unwrap();
        let at = format!("{} killed at {:.3} of {life:?}", w.name, kill_point(k));
        let store = Store::open_path(&work, DeviceChoice::Auto).unwrap_or_else(|e| panic!("{at}: reopen: {e}"));
        let report = ctxfs_vfs::fsck::check(store.device().as_ref()).unwrap();
        assert!(report.is_clean(), "{at}: {:?}", report.problems);
        drop(store);
        let now = digests(&work);
        for (name, digest) in &before {
            assert_eq!(now.iter().find(|(n, _)| n == name).map(|c| &c.1), Some(digest), "{at}: {name} changed");
        }
        match now.iter().find(|(n, _)| n == ADDED) {
            None => absent += 1,
            Some((_, d)) => {
                assert_eq!(d, &added, "{at}: the added context is not the one an uninterrupted run writes");
                present += 1;
            }
        }
        assert_eq!(now.len(), before.len() + usize::from(now.iter().any(|(n, _)| n == ADDED)), "{at}");
    }
    (absent, present)
}

/// A store holding [`BASE`], and the generated context files.
fn template(dir: &Path) -> (PathBuf, PathBuf) {
    let ctx = small_context(dir);
    let store = dir.join("template.ctxfs");
    ok(&["mkfs", p(&store), "--size", "32M"]);
    ok(&["import", p(&store), p(&ctx), "--name", BASE]);
    (store, ctx)
}

#[test]
fn an_import_killed_anywhere_is_all_or_nothing() {
    let dir = tmp();
    let (store, ctx) = template(dir.path());
    let (absent, present) = kill_at_many_points(dir.path(), &store, &import_workload(ctx));
    println!("ctxfs import: {} kill points survived ({absent} left nothing, {present} the whole context)", POINTS);
    assert!(absent > 0, "some kills must land before the commit");
}

#[test]
fn a_session_killed_while_storing_is_all_or_nothing() {
    let dir = tmp();
    let (store, _) = template(dir.path());
    let (absent, present) = kill_at_many_points(dir.path(), &store, &session_workload());
    println!("session store: {} kill points survived ({absent} left nothing, {present} the whole context)", POINTS);
    assert!(absent > 0, "some kills must land before the commit");
}

/// A session's tokens that do not fit the store are refused before its commit.
#[test]
fn a_session_store_into_a_full_store_changes_nothing() {
    let dir = tmp();
    // Room for the base context and little more.
    let (_, store) = small_store(dir.path(), "2M", BASE);
    let before = (json(&["inspect", p(&store), "--json"]), digests(&store));
    let db = Db::open(&store, DeviceChoice::Auto, db_config()).unwrap();
    let mut session = db.open_session(BASE, None).unwrap();
    let shape = session.shape();
    let (d, n) = (shape.head_dim as usize, 8192);
    for layer in 0..shape.layers as usize {
        let rows = |heads: u16| vec![0.25f32; heads as usize * n * d];
        session.update(layer, &rows(shape.q_heads), &rows(shape.kv_heads), &rows(shape.kv_heads)).unwrap();
    }
    session.append_tokens(&(0..n as u32).collect::<Vec<_>>());
    let err = db.store_session(&session, ADDED).expect_err("the store has no room").to_string();
    assert!(err.contains("store full") && err.contains("blocks"), "{err}");
    drop((session, db));
    let after = json(&["inspect", p(&store), "--json"]);
    assert_eq!(after["superblock"]["generation"], before.0["superblock"]["generation"], "nothing was committed");
    assert_eq!(after["space"], before.0["space"]);
    assert_eq!(digests(&store), before.1);
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
}

/// A small ext4 file system on a loop device, unmounted on drop.
struct LoopMount {
    dir: tempfile::TempDir,
}

impl LoopMount {
    /// `None` where this machine cannot mount one (not root, no loop devices).
    fn new(mib: u64) -> Option<LoopMount> {
        let dir = tmp();
        let image = dir.path().join("fs.img");
        std::fs::File::create(&image).ok()?.set_len(mib << 20).ok()?;
        let mkfs = Command::new("mkfs.ext4").args(["-q", "-F", p(&image)]).output().ok()?;
        let mnt = dir.path().join("mnt");
        std::fs::create_dir(&mnt).ok()?;
        let mounted = mkfs.status.success()
            && Command::new("mount").args(["-o", "loop", p(&image), p(&mnt)]).output().ok()?.status.success();
        mounted.then_some(LoopMount { dir })
    }
    fn path(&self) -> PathBuf {
        self.dir.path().join("mnt")
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        // The kernel lets go of files an io_uring instance used a little after the ring is
        // closed, so the file system can be busy for a moment; detach it lazily as a last
        // resort rather than leave it mounted.
        for _ in 0..50 {
            if Command::new("umount").arg(self.path()).output().is_ok_and(|o| o.status.success()) {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let _ = Command::new("umount").arg("-l").arg(self.path()).output();
    }
}

/// The store file is sparse: when the file system under it fills, the write fails and the
/// store stays as it was.
#[test]
fn an_import_onto_a_full_file_system_fails_cleanly() {
    let Some(fs) = LoopMount::new(24) else {
        println!("skipped: this machine cannot loop-mount a file system (needs root and loop devices)");
        return;
    };
    let dir = tmp();
    let big = dir.path().join("big.safetensors");
    gen(&big, "--tokens 8192 --layers 8 --q-heads 2 --kv-heads 2 --head-dim 64 --queries 64 --decode-queries 1");
    let small = small_context(dir.path());
    let store = fs.path().join("s.ctxfs");
    ok(&["mkfs", p(&store), "--size", "256M"]);
    ok(&["import", p(&store), p(&small), "--name", BASE]);
    let before = (json(&["inspect", p(&store), "--json"]), digests(&store));
    let out = ctxfs(&["import", p(&store), p(&big), "--name", ADDED]);
    assert!(!out.status.success(), "the file system has no room for it");
    let err = stderr_of(&out);
    assert!(err.contains("No space left on device") || err.contains("os error 28"), "{err}");
    let after = json(&["inspect", p(&store), "--json"]);
    assert_eq!(after["superblock"]["generation"], before.0["superblock"]["generation"], "nothing was committed");
    assert_eq!(after["contexts"], before.0["contexts"]);
    assert_eq!(digests(&store), before.1);
    assert_eq!(ctxfs(&["fsck", p(&store)]).status.code(), Some(0));
}
