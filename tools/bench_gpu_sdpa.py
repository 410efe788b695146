#!/usr/bin/env python3
"""The baseline of `ctxfs bench gpu`: torch.nn.functional.scaled_dot_product_attention on the
shapes ctxfs's GPU window attention serves (one decode query per q head over a window of
`--window` tokens, GQA, f16), timed with CUDA events over `--layers` distinct layers (so the
window is not served from L2 more than ctxfs's is) repeated `--iters` times.

Two timings, as for ctxfs: replaying a CUDA graph of one pass over the layers (device time, no
Python or launch overhead) and launching call by call. Prints one JSON object with --json.
"""

import argparse
import json
import sys


def median(xs):
    """The upper middle value, as ctxfs's benchmarks take it."""
    return sorted(xs)[len(xs) // 2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--window", type=int, default=640)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        print(f"bench_gpu_sdpa: PyTorch is not installed: {e}", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("bench_gpu_sdpa: torch sees no CUDA device", file=sys.stderr)
        return 1
    if a.q_heads % a.kv_heads:
        print("bench_gpu_sdpa: --q-heads must be a multiple of --kv-heads", file=sys.stderr)
        return 1

    dev = torch.device("cuda")
    torch.manual_seed(0)
    shape_kv = (1, a.kv_heads, a.window, a.head_dim)
    ks = [torch.randn(shape_kv, dtype=torch.float16, device=dev) for _ in range(a.layers)]
    vs = [torch.randn(shape_kv, dtype=torch.float16, device=dev) for _ in range(a.layers)]
    qs = [torch.randn((1, a.q_heads, 1, a.head_dim), dtype=torch.float16, device=dev) for _ in range(a.layers)]
    outs = [None] * a.layers

    # GQA natively where this torch has it; otherwise the kv heads repeated once, outside the
    # timing (which then reads group-times more bytes: noted in the output).
    try:
        F.scaled_dot_product_attention(qs[0], ks[0], vs[0], enable_gqa=True)
        gqa = "enable_gqa"

        def attend(i):
            outs[i] = F.scaled_dot_product_attention(qs[i], ks[i], vs[i], enable_gqa=True)

    except TypeError:
        group = a.q_heads // a.kv_heads
        ks = [k.repeat_interleave(group, dim=1) for k in ks]
        vs = [v.repeat_interleave(group, dim=1) for v in vs]
        gqa = "repeat_interleave (kv heads repeated before timing)"

        def attend(i):
            outs[i] = F.scaled_dot_product_attention(qs[i], ks[i], vs[i])

    def one_pass():
        for i in range(a.layers):
            attend(i)

    # Warm up on a side stream (as graph capture requires), then capture one pass.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            one_pass()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        one_pass()
    graph.replay()
    torch.cuda.synchronize()

    def timed(run):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(a.iters):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / (a.iters * a.layers)

    graphed, eager = [], []
    for _ in range(a.rounds):
        graphed.append(timed(graph.replay))
        eager.append(timed(one_pass))
    result = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev),
        "gqa": gqa,
        "sdpa_layer_seconds": median(graphed),
        "sdpa_layer_seconds_eager": median(eager),
    }
    if a.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
