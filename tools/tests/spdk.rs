//! The `ctxfs` binary built with `--features spdk`, on stores named `spdk:CONFIG.json#BDEV`
//! (AIO and io_uring bdevs over files, no hugepages, no PCI): mkfs, import, query, inspect and
//! fsck give the same answers as on the kernel io_uring device; bench io compares SPDK with the
//! raw io_uring loop; SPDK's failures reach the user as clear errors.
#![cfg(feature = "spdk")]

mod common;

use common::*;
use serde_json::Value;
use std::path::Path;
use std::process::Output;

/// A bdev over a new `size`-byte file in `dir`, and its store path relative to `dir` (the
/// commands below run there).
fn bdev(dir: &Path, method: &str, name: &str, size: u64) -> String {
    std::fs::File::create(dir.join(format!("{name}.img"))).unwrap().set_len(size).unwrap();
    let config = format!(
        r#"{{"subsystems": [{{"subsystem": "bdev", "config": [{{"method": "{method}",
            "params": {{"name": "{name}", "filename": "{name}.img", "block_size": 4096}}}}]}}]}}"#
    );
    std::fs::write(dir.join(format!("{name}.json")), config).unwrap();
    format!("spdk:{name}.json#{name}")
}

/// What may differ between two stores holding the same thing: where they are, on what device,
/// their random ids, clocks and timings.
fn normalize(v: &mut Value) {
    const VARYING: &[&str] = &[
        "store",
        "device",
        "device_note",
        "store_id",
        "micros",
        "seconds",
        "mib_per_second",
        "seconds_per_head",
        "build_seconds_per_head",
    ];
    match v {
        Value::Object(m) => {
            m.retain(|k, _| !VARYING.contains(&k.as_str()) && !k.ends_with("_unix_ms"));
            m.values_mut().for_each(normalize);
        }
        Value::Array(a) => a.iter_mut().for_each(normalize),
        _ => {}
    }
}

/// Every JSON document of an output (one per line, or one pretty-printed), normalized.
fn documents(out: &str) -> String {
    let docs: Vec<Value> = serde_json::Deserializer::from_str(out).into_iter::<Value>().map(Result::unwrap).collect();
    assert!(!docs.is_empty(), "no JSON in {out:?}");
    docs.into_iter()
        .map(|mut v| {
            normalize(&mut v);
            serde_json::to_string(&v).unwrap()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn mkfs_import_query_inspect_and_fsck_answer_as_on_the_uring_device() {
    let dir = tmp();
    let d = dir.path();
    let ctx = d.join("c.safetensors");
    let queries = d.join("c.queries.safetensors");
    gen(
        &ctx,
        "--tokens 3000 --layers 2 --q-heads 4 --kv-heads 2 --head-dim 64 --queries 300 --decode-queries 3 --seed 5",
    );
    const SIZE: u64 = 64 << 20;
    let kernel = d.join("kernel.ctxfs").display().to_string();
    let stores = [
        ("uring (kernel)", kernel),
        ("SPDK AIO bdev", bdev(d, "bdev_aio_create", "aio0", SIZE)),
        ("SPDK uring bdev", bdev(d, "bdev_uring_create", "uring0", SIZE)),
    ];
    let mut answers: Vec<(&str, Vec<String>)> = Vec::new();
    for (what, store) in &stores {
        let s = store.as_str();
        let mut outs = vec![
            ok_in(d, &["mkfs", s, "--size", "64M", "--json"]),
            ok_in(d, &["import", s, p(&ctx), "--name", "book", "--json"]),
        ];
        for layer in ["0", "1"] {
            outs.push(ok_in(
                d,
                &["query", s, "--context", "book", "--queries", p(&queries), "--layer", layer, "--json"],
            ));
        }
        let q = ["query", s, "--context", "book", "--queries", p(&queries), "--layer", "1", "--mode", "full", "--json"];
        outs.push(ok_in(d, &q));
        outs.push(ok_in(d, &["inspect", s, "--json"]));
        outs.push(ok_in(d, &["inspect", s, "book", "--layer", "1", "--head", "1", "--json"]));
        outs.push(ok_in(d, &["inspect", s, "--blocks", "--json"]));
        outs.push(ok_in(d, &["fsck", s, "--json"]));
        let device = serde_json::from_str::<Value>(&outs[5]).unwrap()["device"]["kind"].clone();
        assert_eq!(device, if what.starts_with("SPDK") { "spdk" } else { "uring" }, "{what}");
        answers.push((what, outs.iter().map(|o| documents(o)).collect()));
    }
    let (base, want) = &answers[0];
    for (what, got) in &answers[1..] {
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(g == w, "{what} answers differently from {base} (command {i}):\n{g}\nvs\n{w}");
        }
    }
    // The query answers are real: every (layer, q head, query) has an output.
    assert_eq!(answers[1].1[2].lines().count(), 4 * 3);
}

#[test]
fn bench_io_on_spdk_reports_its_ratio_to_raw_io_uring() {
    for (method, name) in [("bdev_aio_create", "aio1"), ("bdev_uring_create", "uring1")] {
        let dir = tmp();
        let d = dir.path();
        let store = bdev(d, method, name, 64 << 20);
        ok_in(d, &["mkfs", &store, "--size", "64M"]);
        let out = ok_in(d, &["bench", "io", &store, "--mib", "8", "--random-reads", "2048", "--rounds", "1", "--json"]);
        let v: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["device"], "spdk");
        for k in ["seq_write_vs_raw", "seq_read_vs_raw", "random_read_vs_raw"] {
            let r = v["ratios"][k].as_f64().unwrap();
            // A ratio, not a speed goal: CI machines are shared, so only its presence is checked.
            assert!(r.is_finite() && r > 0.0, "{name}: {k} = {r}");
        }
        // The human-readable form names the device and prints the ratios.
        let text = ok_in(d, &["bench", "io", &store, "--mib", "4", "--random-reads", "1024", "--rounds", "1"]);
        assert!(text.contains("device spdk") && text.contains("ratio"), "{text}");
        // The scratch context is gone and the store is clean.
        let v: Value = serde_json::from_str(&ok_in(d, &["inspect", &store, "--json"])).unwrap();
        assert_eq!(v["contexts"].as_array().unwrap().len(), 0);
        assert_eq!(ctxfs_in(d, &["fsck", &store], &[]).status.code(), Some(0));
    }
}

#[test]
fn spdk_failures_are_clear_errors() {
    let dir = tmp();
    let d = dir.path();
    let store = bdev(d, "bdev_aio_create", "aio2", 16 << 20);
    ok_in(d, &["mkfs", &store, "--size", "16M"]);
    assert!(!d.join(&store).exists(), "mkfs created a file named like the SPDK path");
    let again = ctxfs_in(d, &["mkfs", &store], &[]);
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds a ctxfs store"));
    let wrong = ctxfs_in(d, &["mkfs", &store, "--size", "8M", "--force"], &[]);
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("does not match"));
    ok_in(d, &["mkfs", &store, "--force"]);
    let stderr = |o: &Output| String::from_utf8_lossy(&o.stderr).into_owned();
    // No such bdev: named, with those that exist.
    let out = ctxfs_in(d, &["inspect", "spdk:aio2.json#nope"], &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("no SPDK bdev named \"nope\"") && stderr(&out).contains("aio2"), "{}", stderr(&out));
    // fsck: an operational error, exit 8.
    assert_eq!(ctxfs_in(d, &["fsck", "spdk:aio2.json#nope"], &[]).status.code(), Some(8));
    // No such config; a malformed path.
    let out = ctxfs_in(d, &["inspect", "spdk:missing.json#aio2"], &[]);
    assert!(stderr(&out).contains("missing.json") && stderr(&out).contains("not found"), "{}", stderr(&out));
    let out = ctxfs_in(d, &["inspect", "spdk:aio2.json"], &[]);
    assert!(stderr(&out).contains("spdk:CONFIG.json#BDEV"), "{}", stderr(&out));
    // The SPDK environment cannot initialise (here: an EAL argument DPDK rejects).
    let out = ctxfs_in(d, &["inspect", &store], &[("CTXFS_SPDK_LOG_LEVEL", "disabled")]);
    assert!(out.status.success(), "{}", stderr(&out));
    std::fs::write(
        d.join("bad-env.json"),
        r#"{"ctxfs": {"eal_args": "--no-such-eal-option"}, "subsystems": [{"subsystem": "bdev", "config": [
            {"method": "bdev_aio_create", "params": {"name": "aio3", "filename": "aio2.img"}}]}]}"#,
    )
    .unwrap();
    let out = ctxfs_in(d, &["inspect", "spdk:bad-env.json#aio3"], &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("SPDK environment initialisation failed"), "{}", stderr(&out));
    // Hugepages asked for where there are none.
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    if meminfo.lines().any(|l| l.split_whitespace().collect::<Vec<_>>() == ["HugePages_Free:", "0"]) {
        let out = ctxfs_in(d, &["inspect", &store], &[("CTXFS_SPDK_HUGEPAGES", "1")]);
        assert!(!out.status.success());
        assert!(stderr(&out).contains("SPDK environment initialisation failed"), "{}", stderr(&out));
    }
    // A block size the bdev cannot hold.
    let out = ctxfs_in(d, &["fsck", &store], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    std::fs::write(
        d.join("big.json"),
        r#"{"subsystems": [{"subsystem": "bdev", "config": [
            {"method": "bdev_uring_create", "params": {"name": "big0", "filename": "aio2.img", "block_size": 8192}}]}]}"#,
    )
    .unwrap();
    let out = ctxfs_in(d, &["inspect", "spdk:big.json#big0"], &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("block size mismatch"), "{}", stderr(&out));
}

#[test]
fn the_demo_runs_on_an_spdk_bdev() {
    let dir = tmp();
    let d = dir.path();
    let store = bdev(d, "bdev_aio_create", "Demo0", 256 << 20);
    let out = ok_in(d, &["demo", "--dir", "files", "--store", &store, "--tokens", "4096", "--steps", "2", "--json"]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["store"], store.as_str());
    assert!(v["dipr_recall"].as_f64().unwrap() > 0.5);
    assert!(!d.join("files/store.ctxfs").exists(), "the bdev was used, not a file");
    let fsck: serde_json::Value = serde_json::from_str(&ok_in(d, &["fsck", &store, "--json"])).unwrap();
    assert_eq!(fsck["clean"], true);
}
