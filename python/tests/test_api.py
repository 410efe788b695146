"""The Store and Session API on a real store file: import, sessions, attention against an
exact numpy reference, errors refused before anything is written, threads."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import ctxfs

L, KV, QH, D, N = 2, 2, 4, 64, 3000


def kv_layers(seed=0, n=N):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.standard_normal((KV, n, D), dtype=np.float32),
            rng.standard_normal((KV, n, D), dtype=np.float32),
            rng.standard_normal((QH, 64, D), dtype=np.float32),
        )
        for _ in range(L)
    ]


def exact(q, k, v, scale):
    """Attention of q [QH, D] over k, v [KV, n, D] rounded to f16, as stored."""
    k = np.repeat(k, QH // KV, axis=0).astype(np.float16).astype(np.float32)
    v = np.repeat(v, QH // KV, axis=0).astype(np.float16).astype(np.float32)
    z = np.einsum("hd,hnd->hn", q, k) * scale
    m = z.max(1, keepdims=True)
    w = np.exp(z - m)
    return np.einsum("hn,hnd->hd", w / w.sum(1, keepdims=True), v), (m[:, 0] + np.log(w.sum(1)))


@pytest.fixture
def store(store_path):
    s = ctxfs.Store.create(store_path, size=128 << 20)
    s.import_kv("doc", kv_layers(), range(N), progress=False)
    return s


def test_import_inspect_fsck_delete(store, store_path):
    (ctx,) = store.contexts()
    assert (ctx["name"], ctx["tokens"], ctx["shape"]["kv_heads"], ctx["shape"]["q_heads"]) == ("doc", N, KV, QH)
    assert store.inspect()["superblock"]["block_size"] == 4096
    assert store.fsck()["exit_code"] == 0
    store.delete("doc")
    assert store.contexts() == []
    with pytest.raises(ctxfs.NotFoundError, match="doc"):
        store.delete("doc")


def test_the_store_answers_and_refuses_writes_from_an_import_progress_callback(store):
    # The callback runs on the importing thread, inside its write transaction.
    seen = []

    def progress(done, total):
        seen.append((store.inspect()["space"]["free_blocks"], [c["name"] for c in store.contexts()]))
        with pytest.raises(ctxfs.InputError, match="still open"):
            store.delete("doc")

    store.import_kv("two", kv_layers(1), range(N), progress=progress)
    assert seen and all(names == ["doc"] for _, names in seen), seen
    assert sorted(c["name"] for c in store.contexts()) == ["doc", "two"]


def test_full_attention_is_exact_and_sessions_reuse_prefixes(store):
    layers = kv_layers()
    session, reused = store.create_session(list(range(N)) + [7, 8])
    assert reused == N
    q = np.random.default_rng(5).standard_normal((QH, D), dtype=np.float32)
    out, lse = session.attention(1, q, plan="full", return_lse=True)
    ref, ref_lse = exact(q, layers[1][0], layers[1][1], 1 / np.sqrt(D))
    np.testing.assert_allclose(out, ref, atol=2e-5)
    np.testing.assert_allclose(lse, ref_lse, rtol=1e-5)
    # Several rows at once: each its own step.
    rows = np.stack([q, 2 * q])
    both = session.attention(1, rows, plan="full")
    assert both.shape == (2, QH, D)
    np.testing.assert_allclose(both[0], out, atol=1e-6)
    # top-k retrieves k tokens a q head beyond the window, as ctxfs query --k.
    for k in (5, 40):
        before = session.stats()["retrieved_tokens"]
        session.attention(1, q, plan="topk", k=k)
        assert session.stats()["retrieved_tokens"] - before == QH * k
    # A partial prefix is reused, filtered.
    part, reused = store.create_session(list(range(1000)) + [5])
    assert reused == 1000 and part.stats()["filtered"]
    assert part.plan(1)["plan"] == "full"  # 1000 tokens: a short context


def test_update_store_and_reuse_the_stored_session(store):
    session, _ = store.create_session(list(range(N)) + [11, 12])
    rng = np.random.default_rng(3)
    for layer in range(L):
        k, v = rng.standard_normal((KV, 2, D), dtype=np.float32), rng.standard_normal((KV, 2, D), dtype=np.float32)
        session.update(layer, None, k, v)
    report = session.store("doc+2")
    assert report["tokens"] == 2
    child = next(c for c in store.contexts() if c["name"] == "doc+2")
    assert child["parent"]["prefix_tokens"] == N and child["own_tokens"] == 2
    _, reused = store.create_session(list(range(N)) + [11, 12, 13])
    assert reused == N + 2
    assert store.fsck()["exit_code"] == 0


def test_bad_input_is_refused_and_nothing_is_written(store):
    before = store.inspect()["space"]["used_blocks"]
    good = kv_layers(1)
    big = np.broadcast_to(np.float32(0.5), (KV, 150_000, D))
    cases = {
        "exists": ("doc", good, range(N), ctxfs.ExistsError),
        "nan": ("nan", [good[0], (good[1][0].copy(), good[1][1], None)], range(N), ctxfs.InputError),
        "shape": ("shape", [good[0], (good[1][0][:, :10], good[1][1][:, :10])], range(N), ctxfs.InputError),
        "tokens": ("tokens", good, range(N - 1), ctxfs.InputError),
        "dtype": ("dtype", [(good[0][0].astype(np.int32), good[0][1])], range(N), ctxfs.InputError),
        # More KV than the 128 MiB store holds: refused before the first block is written
        # (the import never asks for the second layer).
        "full": ("full", [(big, big)] * L, range(150_000), ctxfs.StoreFullError),
    }
    cases["nan"][1][1][0][1, 17, 3] = np.nan
    # Finite in f32, infinite in the f16 the store keeps.
    cases["range"] = ("range", [good[0], (good[1][0], good[1][1].copy(), None)], range(N), ctxfs.InputError)
    cases["range"][1][1][1][0, 5, 7] = 1e6
    # bf16 holds 1e35, but attention's f32 sums of it would overflow.
    cases["bf16"] = ("bf16", [good[0], (good[1][0], good[1][1].copy(), None)], range(N), ctxfs.InputError)
    cases["bf16"][1][1][1][0, 5, 7] = 1e35
    # A 2-D q says no q heads.
    cases["q2d"] = ("q2d", [(good[0][0], good[0][1], np.zeros((QH, D), np.float32))], range(N), ctxfs.InputError)
    messages = {"bf16": r"v\[.*\] = 1e35 is beyond 2\^48", "q2d": r"q has shape \(4, 64\), expected \[q_heads"}
    for name, (ctx, layers, tokens, error) in cases.items():
        with pytest.raises(error, match=messages.get(name)):
            store.import_kv(ctx, layers, tokens, progress=False, **({"dtype": "bf16"} if name == "bf16" else {}))
        assert [c["name"] for c in store.contexts()] == ["doc"], name
    assert store.fsck()["exit_code"] == 0
    assert store.inspect()["space"]["used_blocks"] == before
    session, _ = store.create_session(list(range(N)) + [1])
    with pytest.raises(ctxfs.InputError, match="layer 9"):
        session.attention(9, np.zeros((QH, D), np.float32))
    with pytest.raises(ctxfs.InputError, match="not finite"):
        session.attention(1, np.full((QH, D), np.inf, np.float32))
    with pytest.raises(ctxfs.InputError):
        session.attention(1, np.zeros((QH, D + 1), np.float32))
    with pytest.raises(ctxfs.InputError, match="unknown plan"):
        session.attention(1, np.zeros((QH, D), np.float32), plan="magic")
    with pytest.raises(ctxfs.InputError):
        session.update(0, None, np.zeros((KV, 1, D), np.float32), np.zeros((KV, 2, D), np.float32))
    assert session.stats()["updated_rows"] == [0, 0]


def test_shapes_numbers_and_pools_are_checked_before_use(store, store_path):
    session, _ = store.create_session(list(range(N)) + [1])
    q = np.zeros((QH, D), np.float32)
    # The same number of elements in another shape is not another layout of the same query.
    for bad in (np.zeros((2 * QH, D // 2), np.float32), q.T.copy(), np.zeros((1, 2 * QH, D // 2), np.float32)):
        with pytest.raises(ctxfs.InputError, match="expected"):
            session.attention(1, bad)
    with pytest.raises(ctxfs.InputError, match="rows"):
        session.attention(1, np.zeros((0, QH, D), np.float32))
    k = np.zeros((KV, 3, D), np.float32)
    with pytest.raises(ctxfs.InputError, match="expected"):
        session.update(0, None, k.transpose(1, 0, 2).copy(), k)
    for opts, what in (({"scale": np.inf}, "scale"), ({"scale": 0.0}, "scale"), ({"beta": np.nan}, "beta")):
        with pytest.raises(ctxfs.InputError, match=what):
            session.attention(1, q, plan="diprs", **opts)
    for call in (lambda: session.attention(-1, q), lambda: session.plan(-1), lambda: session.append_tokens([-1])):
        with pytest.raises(ctxfs.InputError):
            call()
    # Either byte order of float32.
    assert np.array_equal(session.attention(1, q.astype(">f4"), plan="full"), session.attention(1, q, plan="full"))
    # No tokens; a layer count the layers contradict.
    with pytest.raises(ctxfs.InputError, match="at least one token"):
        store.import_kv("empty", [(k[:, :0], k[:, :0])] * L, [], progress=False)
    with pytest.raises(ctxfs.InputError, match="num_layers"):
        store.import_kv("short", kv_layers(2), range(N), num_layers=1, progress=False)
    # Keys and values alone of a GQA model: q_heads says how many query heads it has.
    layers = [(k_, v_) for k_, v_, _ in kv_layers(3)]
    store.import_kv("gqa", layers, range(N), q_heads=QH, progress=False)
    shape = next(c for c in store.contexts() if c["name"] == "gqa")["shape"]
    assert (shape["q_heads"], shape["kv_heads"]) == (QH, KV)
    # Out-of-range integers are input errors, not the binding's OverflowError.
    for call in (
        lambda: ctxfs.Store.create(store_path + ".new", size=8 << 20, block_size=-1),
        lambda: ctxfs.Store.open(store_path, read_only=True, window=(-1, 0)),
        lambda: store.import_kv("many", kv_layers(4), range(N), num_layers=70000, progress=False),
    ):
        with pytest.raises(ctxfs.InputError):
            call()
    # A pool too small to serve is refused before the file is formatted or overwritten.
    for pool in (0, 64 << 10):
        with pytest.raises(ctxfs.InputError, match="too small"):
            ctxfs.Store.create(store_path + ".new", size=8 << 20, pool=pool)
        assert not os.path.exists(store_path + ".new")
    del session, store
    with pytest.raises(ctxfs.InputError, match="too small"):
        ctxfs.Store.create(store_path, force=True, pool=64 << 10)
    names = [c["name"] for c in ctxfs.Store.open(store_path, read_only=True).contexts()]
    assert sorted(names) == ["doc", "gqa"]


def test_python_conventions_callbacks_and_closing(store, store_path):
    # Each error is also the built-in exception a caller would catch for its kind.
    assert issubclass(ctxfs.InputError, ValueError) and issubclass(ctxfs.NotFoundError, LookupError)
    with pytest.raises(OSError, match="missing"):
        ctxfs.Store.open(store_path + ".missing")
    with pytest.raises(LookupError):
        store.open_session("missing")
    session = store.open_session("doc")
    q = np.zeros((QH, D), np.float32)
    # Full attention attends every token: a budget would cut it, so it is refused; the options
    # a CtxfsCache passes to every call are checked before any runs.
    with pytest.raises(ctxfs.InputError, match="every token"):
        session.attention(1, q, plan="full", budget=10)
    with pytest.raises(ctxfs.InputError, match="fixed budget"):
        session.check_options(plan="quest", target_error=0.01)
    session.check_options(plan="flat", target_error=0.01)
    # A layer is an integer, not a float or a string made into one.
    for layer in (0.9, "1"):
        with pytest.raises(ctxfs.InputError, match="integer"):
            session.attention(layer, q)
    # What a progress callback raises stops the import before its commit and is raised again;
    # an iterator with more layers than num_layers is refused, not cut short.
    def interrupt(done, total):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.import_kv("stopped", kv_layers(1), range(N), progress=interrupt)
    with pytest.raises(ctxfs.InputError, match="more than num_layers"):
        store.import_kv("extra", iter(kv_layers(1)), range(N), num_layers=1, progress=False)
    assert [c["name"] for c in store.contexts()] == ["doc"]
    assert store.fsck()["exit_code"] == 0
    # A closed store refuses calls; its sessions go on, and the writer lock goes with the last.
    store.close()
    with pytest.raises(ctxfs.InputError, match="closed"):
        store.contexts()
    assert session.attention(1, q).shape == (QH, D) and session.stats()["attention_calls"] == 1
    with pytest.raises(ctxfs.LockedError):
        ctxfs.Store.open(store_path)
    del session
    with ctxfs.Store.open(store_path) as reopened:
        assert [c["name"] for c in reopened.contexts()] == ["doc"]
    with pytest.raises(ctxfs.InputError, match="closed"):
        reopened.contexts()


def test_errors_carry_the_rust_message(store, store_path):
    with pytest.raises(ctxfs.LockedError, match="open for writing"):
        ctxfs.Store.open(store_path)
    reader = ctxfs.Store.open(store_path, read_only=True)
    assert [c["name"] for c in reader.contexts()] == ["doc"]
    with pytest.raises(ctxfs.ReadOnlyError):
        reader.delete("doc")
    with pytest.raises(ctxfs.NotAStoreError):
        bad = store_path + ".bad"
        open(bad, "wb").write(b"\0" * (1 << 20))
        ctxfs.Store.open(bad)
    assert issubclass(ctxfs.StoreFullError, ctxfs.Error)


def test_torch_tensors_and_f16_arrays_are_accepted(store):
    torch = pytest.importorskip("torch")
    session, _ = store.create_session(list(range(N)) + [1])
    q = np.random.default_rng(9).standard_normal((QH, D), dtype=np.float32)
    a = session.attention(1, q, plan="full")
    b = session.attention(1, torch.from_numpy(q), plan="full")
    c = session.attention(1, q.astype(np.float16), plan="full")
    d = session.attention(1, torch.from_numpy(q).to(torch.bfloat16), plan="full")
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() < 1e-2 and np.abs(a - d).max() < 5e-2


def test_threads_serve_sessions_in_parallel(store):
    """The GIL is released during attention: sessions on several threads all answer, and
    each answer matches the same call made alone."""
    q = np.random.default_rng(4).standard_normal((QH, D), dtype=np.float32)
    alone = store.create_session(list(range(N)) + [1])[0].attention(1, q, plan="flat")
    results, errors = [], []

    def serve():
        try:
            s, _ = store.create_session(list(range(N)) + [1])
            for _ in range(20):
                results.append(s.attention(1, q, plan="flat"))
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    threads = [threading.Thread(target=serve) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 80
    for r in results:
        np.testing.assert_array_equal(r, alone)


SHARED_SESSION_THREADS = """
import sys, threading
import numpy as np, ctxfs
store = ctxfs.Store.open(sys.argv[1], read_only=True)
session, _ = store.create_session(list(range({N})) + [1])
q = np.random.default_rng(6).standard_normal(({QH}, {D}), dtype=np.float32)
kv = np.ones(({KV}, 1, {D}), np.float32)
stop = threading.Event()

def loop(call):
    while not stop.is_set():
        call()

askers = [threading.Thread(target=loop, args=(c,)) for c in
          (lambda: session.plan(0), lambda: session.stats(), lambda: session.append_tokens([7]))]
writer = threading.Thread(target=lambda: [session.update(0, None, kv, kv) for _ in range(200)])
for t in askers + [writer]:
    t.start()
for _ in range(200):
    session.attention(1, q, plan="quest")
writer.join()
stop.set()
for t in askers:
    t.join()
print(session.stats()["updated_rows"][0])
"""


def test_one_session_shared_by_threads_that_read_write_and_ask_never_deadlocks(store):
    """Threads asking a session its plan and stats, appending tokens and updating it, beside
    attention on the main thread: every call returns (no thread waits for the session's lock
    while holding the GIL, and none runs Python while holding the lock). A deadlock would hold
    the GIL, so the threads run in a process of their own, which a timeout can end."""
    script = SHARED_SESSION_THREADS.format(N=N, QH=QH, D=D, KV=KV)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, str(store.path)], capture_output=True, text=True, timeout=180
        )
    except subprocess.TimeoutExpired:
        pytest.fail("threads sharing one session deadlocked")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["200"]


def test_an_error_target_is_met_and_reported(store):
    layers = kv_layers()
    session, _ = store.create_session(list(range(N)) + [3])
    rng = np.random.default_rng(11)
    errors = []
    for _ in range(4):
        q = rng.standard_normal((QH, D), dtype=np.float32) * 2
        out = session.attention(1, q, plan="flat", target_error=0.02)
        ref, _ = exact(q, layers[1][0], layers[1][1], 1 / np.sqrt(D))
        errors += list(np.linalg.norm(out - ref, axis=1) / np.linalg.norm(ref, axis=1))
    assert np.mean(errors) <= 0.02, errors
    estimated = session.stats()["estimated_error_max"]
    assert estimated is not None and 0 <= estimated
    with pytest.raises(ctxfs.InputError, match="error target"):
        session.attention(1, q, target_error=-1.0)


def test_a_resident_budget_is_reported_and_enforced(store, store_path):
    f = store.footprint("doc")
    assert f["kv_bytes"] == N * L * KV * D * 2 * 2
    parts = f["parts"]
    # A session's window is reported beside the resident bytes, not in them.
    assert f["resident_bytes"] == sum(parts.values()) - parts["window"] > 0
    assert f["compact_bytes"] == parts["meta"] + parts["seeds"] + parts["pq"] + parts["maps"]
    assert 0 < parts["maps"] < parts["meta"] + parts["graph"]
    warm = store.warm("doc")
    assert warm["resident_bytes"] == f["resident_bytes"] == warm["held"] * 4096 + parts["maps"]
    assert warm["resident_over_kv"] == pytest.approx(f["resident_over_kv"]) and not warm["compact"]
    # Below the whole index, the context is served compact from its PQ codes.
    reader = ctxfs.Store.open(store_path, read_only=True, resident_budget=f["resident_over_kv"] / 2)
    compact = reader.warm("doc")
    assert compact["compact"] and compact["resident_bytes"] == f["compact_bytes"]
    # Below 32,768 tokens the codes carry no residual codes: nothing left to stream.
    assert not compact["residual_streamed"]
    session, _ = reader.create_session(list(range(N)))
    q = np.random.default_rng(7).standard_normal((QH, D), dtype=np.float32)
    # (This context is short enough to be attended in full unless a plan is forced.)
    out = session.attention(1, q, plan="pq", target_error=0.01)
    ref, _ = exact(q, kv_layers()[1][0], kv_layers()[1][1], 1 / np.sqrt(D))
    assert np.linalg.norm(out - ref) <= 0.05 * np.linalg.norm(ref)
    # DIPRS, served compact from the codes: a range wide enough for every token is exact,
    # and a target is met as by the pq plan.
    out = session.attention(1, q, plan="diprs", beta=1e9)
    assert np.linalg.norm(out - ref) <= 1e-3 * np.linalg.norm(ref)
    out = session.attention(1, q, plan="diprs", target_error=0.01)
    assert np.linalg.norm(out - ref) <= 0.05 * np.linalg.norm(ref)
    # The candidates' blocks were read on demand: first reads are the misses of blocks
    # never read before, so they are some of the misses and no more.
    for area in ("index", "data"):
        stats = reader.pool_stats()[area]
        assert 0 < stats["first_reads"] <= stats["misses"], (area, stats)
    # On a GPU machine the codes' scans ran there, from a copy of layer 1's codes.
    held = reader.gpu_codes_bytes()
    assert held is None or 0 < held[0] <= held[1], held
    # Below even the codes, it is refused, holding nothing.
    tiny = ctxfs.Store.open(store_path, read_only=True, resident_budget=f["compact_over_kv"] / 2)
    with pytest.raises(ctxfs.OverBudgetError, match='"doc"'):
        tiny.warm("doc")
    # Never warmed, a session over it is refused too.
    with pytest.raises(ctxfs.OverBudgetError, match='"doc"'):
        tiny.open_session("doc")
    assert tiny.pool_stats()["index"]["resident_pins"] == 0
    with pytest.raises(ctxfs.InputError, match="resident budget"):
        ctxfs.Store.open(store_path, read_only=True, resident_budget=0.0)


def layer_blocks(path, kind, layer):
    """Device blocks of a store file whose block header (docs/format.md §3) has `kind` and
    names layer `layer` as owner."""
    found = []
    with open(path, "rb") as f:
        for block in range(2, 4096):
            head = f.read(4096)[:20]
            if len(head) < 20:
                break
            if head[:4] == b"CXFB" and head[8] == kind and int.from_bytes(head[16:18], "little") == layer:
                found.append(block)
            f.seek((block + 1) * 4096)
    return found


def test_a_damaged_block_raises_corrupt_error_naming_it(store, store_path):
    session, _ = store.create_session(list(range(N)))
    q = np.random.default_rng(11).standard_normal((QH, D), dtype=np.float32)
    healthy = session.attention(0, q, plan="full")
    damaged = layer_blocks(store_path, 6, 1)[0]  # a data block (kind 6) of layer 1
    with open(store_path, "r+b") as f:
        f.seek(damaged * 4096 + 100)
        byte = f.read(1)
        f.seek(damaged * 4096 + 100)
        f.write(bytes([byte[0] ^ 0x5A]))
    reader = ctxfs.Store.open(store_path, read_only=True)
    session, _ = reader.create_session(list(range(N)))
    for _ in range(2):  # a failed read is not cached: the second call reads it again
        with pytest.raises(ctxfs.CorruptError, match=f"damaged data block {damaged} "):
            session.attention(1, q, plan="full")
    np.testing.assert_array_equal(session.attention(0, q, plan="full"), healthy)
    report = reader.fsck()
    assert report["exit_code"] == 4
    assert [p["block"] for p in report["problems"]] == [damaged]
