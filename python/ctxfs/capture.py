"""Real attention data for ``ctxfs bench search --data``: ``python -m ctxfs.capture OUT``.

Runs SmolLM2-135M-Instruct's prefill over ``--tokens`` tokens of one kind of text
(``ctxfs.texts``: code, prose or structured), then ``--decode`` decode steps over the text's
next tokens, and writes one safetensors file per run:

* ``layers.{i}.k``, ``layers.{i}.v``: post-RoPE keys and values of the prefix,
  ``[kv_heads, tokens, head_dim]`` (f16, as a store keeps them);
* ``layers.{i}.q``: ``--train-queries`` prefill queries evenly spaced over the prefix,
  ``[q_heads, rows, head_dim]``, which train the index;
* ``layers.{i}.decode_q``: the decode steps' queries, ``[q_heads, steps, head_dim]``;
* ``tokens``: the prefix's token ids;
* metadata: the model, the text kind, the captured layers (``i`` indexes them) and the RoPE
  scaling.

The file is a context file too (``ctxfs import`` reads it; it ignores ``decode_q``).
Contexts beyond the model's 8,192 trained positions use linear RoPE scaling (position
interpolation) by ``--rope-scale`` (default: the smallest integer factor that covers them).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import torch

from . import texts
from . import hf
from .cli import HelpWithDefaults


def scale_rope(model, factor: float) -> None:
    """Linear RoPE scaling (position interpolation) by ``factor``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    c = model.config
    theta = c.rope_parameters["rope_theta"]
    c.rope_parameters = {"rope_type": "linear", "factor": float(factor), "rope_theta": theta}
    c.max_position_embeddings = int(c.max_position_embeddings * factor)
    model.model.rotary_emb = LlamaRotaryEmbedding(c)


def capture(model, ids: torch.Tensor, tokens: int, decode: int, layers: list[int], train_queries: int, progress: bool):
    """Keys, values and prefill queries of the first ``tokens`` ids, then the queries of
    ``decode`` decode steps over the ids after them, for the given layers."""
    prefix = ids[:, :tokens]
    cache, train = hf.capture_prefix(model, prefix, train_queries=train_queries, progress=progress)
    steps = hf.feed_capturing(model, ids[:, : tokens + decode], cache, np.arange(tokens, tokens + decode), tokens, 1)
    def half(t: torch.Tensor) -> np.ndarray:
        return t.to(torch.float16).contiguous().numpy()

    out = {}
    for i, layer in enumerate(layers):
        out[f"layers.{i}.k"] = half(cache.layers[layer].keys[0, :, :tokens])
        out[f"layers.{i}.v"] = half(cache.layers[layer].values[0, :, :tokens])
        out[f"layers.{i}.q"] = half(train[layer])
        out[f"layers.{i}.decode_q"] = half(steps[layer])
    out["tokens"] = prefix[0].to(torch.int32).numpy()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ctxfs.capture", description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("out", help="the safetensors file to write")
    ap.add_argument("--kind", choices=texts.KINDS, default="prose", help="the kind of text")
    ap.add_argument("--tokens", type=int, default=8192, help="prefix length")
    ap.add_argument("--decode", type=int, default=32, help="decode steps captured after the prefix")
    ap.add_argument("--layers", default="1,8,15,22,29", help="layers to keep, comma-separated")
    ap.add_argument("--train-queries", type=int, default=2048, help="prefill queries kept per layer")
    ap.add_argument("--rope-scale", type=float, help="linear RoPE scaling factor (default: as needed)")
    ap.add_argument(
        "--period",
        type=int,
        help="repeat the text's first PERIOD tokens throughout (text that repeats every so many tokens, as "
        "fixed-width tables and templates do)",
    )
    args = ap.parse_args(argv)
    if args.period is not None and args.period < 1:
        ap.error("--period must be at least 1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors.numpy import save_file

    tok, model = hf.load_smollm2()
    layers = [int(x) for x in args.layers.split(",")]
    if any(not 0 <= x < model.config.num_hidden_layers for x in layers):
        ap.error(f"--layers: the model has {model.config.num_hidden_layers} layers")
    needed = args.tokens + args.decode
    trained = model.config.max_position_embeddings
    # Scaled when the prefix exceeds the trained positions; the few decode steps after a
    # prefix that fits are within RoPE's reach.
    factor = args.rope_scale or (math.ceil(needed / trained) if args.tokens > trained else 1)
    if factor != 1:
        scale_rope(model, factor)
    ids = tok(texts.text(args.kind), return_tensors="pt").input_ids
    if args.period is not None:
        ids = ids[:, : args.period]
    while ids.shape[1] < needed:  # a text shorter than asked for repeats
        ids = torch.cat([ids, ids], 1)
    tensors = capture(model, ids, args.tokens, args.decode, layers, args.train_queries, sys.stderr.isatty())
    meta = {
        "model": "SmolLM2-135M-Instruct",
        "kind": args.kind,
        "layers": ",".join(map(str, layers)),
        "rope_scaling": f"linear {factor:g}" if factor != 1 else "none",
        "decode_steps": str(args.decode),
        "period": str(args.period or 0),
    }
    tmp = args.out + ".tmp"
    save_file(tensors, tmp, metadata=meta)
    os.replace(tmp, args.out)
    size = os.path.getsize(args.out)
    print(f"wrote {args.out}: {args.kind}, {args.tokens} tokens, layers {meta['layers']}, "
          f"{args.decode} decode steps, RoPE scaling {meta['rope_scaling']} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
