#!/usr/bin/env python3
"""A peer, side by side: ctxfs's query-guided graph (graph DIPRS) against a standard HNSW (faiss,
inner product) on the same generated attention, reporting DIPR recall against keys scored.

Both get the same window (the first 128 and last 512 tokens), and recall is measured on the
exact DIPR set (all keys within beta of the best inner product). Decode queries lie out of
the key distribution, which is what HNSW's key-built graph stalls on.

    pip install faiss-cpu numpy safetensors
    python3 tools/hnsw_peer.py --tokens 131072 [--ctxfs target/release/ctxfs] [--json]
"""
import argparse, json, os, subprocess, sys, tempfile, time

import numpy as np
import faiss
from safetensors.numpy import load_file


def run(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--decode-queries", type=int, default=8)
    ap.add_argument("--beta-scale", type=float, default=5.0, help="beta = scale * sqrt(head_dim)")
    ap.add_argument("--efs", default="16,32,64,128,256,512,1024")
    ap.add_argument("--ctxfs", default="target/release/ctxfs")
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    work = a.dir or tempfile.mkdtemp(prefix="ctxfs-peer-")
    os.makedirs(work, exist_ok=True)
    ctx, queries, store = (os.path.join(work, f) for f in ("ctx.safetensors", "ctx.queries.safetensors", "store.ctxfs"))
    d, n, layer = a.head_dim, a.tokens, 1
    beta = a.beta_scale * d ** 0.5
    q_heads = 4 * a.kv_heads
    run([a.ctxfs, "gen", ctx, "--tokens", str(n), "--layers", "2", "--q-heads", str(q_heads),
         "--kv-heads", str(a.kv_heads), "--head-dim", str(d), "--decode-queries", str(a.decode_queries), "--seed", "1", "--force"])
    # KV bytes (2 layers, keys and values, 2 bytes each) plus the graph, seed table and coarse
    # indexes: a 128K context needs 1.61x its KV bytes.
    size = max(64 << 20, int(n * a.kv_heads * 2 * d * 2 * 2 * 2.0))
    run([a.ctxfs, "mkfs", store, "--size", str(size), "--force"])
    t = time.time()
    run([a.ctxfs, "import", store, ctx, "--name", "peer"])
    import_s = time.time() - t
    ours = [json.loads(l) for l in run([a.ctxfs, "query", store, "--context", "peer", "--queries", queries,
                                        "--layer", str(layer), "--mode", "graph-diprs", "--beta", str(beta), "--json"]).splitlines()]

    keys_all = load_file(ctx)[f"layers.{layer}.k"].astype(np.float32)  # [kv, n, d]
    q_all = load_file(queries)[f"layers.{layer}.q"].astype(np.float32)  # [q_heads, m, d]
    window = np.concatenate([np.arange(128), np.arange(n - 512, n)])
    group = q_heads // a.kv_heads
    efs = [int(e) for e in a.efs.split(",")]
    hnsw = {ef: {"recall": [], "scored": []} for ef in efs}
    mine = {"recall": [], "scored": []}
    build_s = 0.0
    for kv in range(a.kv_heads):
        keys = np.ascontiguousarray(keys_all[kv])
        t = time.time()
        index = faiss.IndexHNSWFlat(d, 32, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = 80
        index.add(keys)
        build_s += time.time() - t
        for qh in range(kv * group, (kv + 1) * group):
            for qi in range(q_all.shape[1]):
                q = q_all[qh, qi]
                scores = keys @ q
                best = max(scores.max(), scores[window].max())
                dipr = set(np.nonzero(scores >= best - beta)[0].tolist())
                win = set(window.tolist())
                r = next(x for x in ours if x["head"] == qh and x["query"] == qi)
                got = set(r["selected"])
                mine["recall"].append(len(dipr & got) / len(dipr))
                mine["scored"].append(r["keys_scored"] / n)
                for ef in efs:
                    k = max(len(dipr), 1)
                    index.hnsw.efSearch = max(ef, k)
                    faiss.cvar.hnsw_stats.reset()
                    _, ids = index.search(q[None, :], k)
                    found = set(ids[0][ids[0] >= 0].tolist()) | win
                    hnsw[ef]["recall"].append(len(dipr & found) / len(dipr))
                    hnsw[ef]["scored"].append(faiss.cvar.hnsw_stats.ndis / n)
    rows = [{"method": "ctxfs graph DIPRS (query-guided graph)", "dipr_recall": float(np.mean(mine["recall"])),
             "keys_scored_fraction": float(np.mean(mine["scored"]))}]
    rows += [{"method": f"HNSW ef={ef}", "dipr_recall": float(np.mean(v["recall"])),
              "keys_scored_fraction": float(np.mean(v["scored"]))} for ef, v in hnsw.items()]
    result = {"tokens": n, "head_dim": d, "beta": beta, "queries": len(mine["recall"]),
              "ctxfs_import_seconds": import_s, "hnsw_build_seconds": build_s, "rows": rows}
    if a.json:
        print(json.dumps(result))
        return
    print(f"{n} tokens, d={d}, beta={beta:.1f} ({a.beta_scale}·√d), {len(mine['recall'])} decode queries; "
          f"ctxfs import {import_s:.1f} s, HNSW build {build_s:.1f} s")
    print(f"{'method':<36} {'DIPR recall':>12} {'keys scored':>12}")
    for r in rows:
        print(f"{r['method']:<36} {r['dipr_recall']:>12.3f} {r['keys_scored_fraction'] * 100:>11.2f}%")


if __name__ == "__main__":
    sys.exit(main())
