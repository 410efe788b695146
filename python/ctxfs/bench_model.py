"""Sparse plans against full attention on a real model: ``python -m ctxfs.bench_model``.

SmolLM2-135M-Instruct serves every decode step's attention from a ctxfs store, once per
plan, and one table compares the plans side by side in one run:

* full attention, the optimizer's plan (auto), the optimizer's plan with each context served
  compact under a resident budget of 1/8 of its KV bytes (compact: only its PQ codes and
  seed tables held, keys and values read on demand), DIPRS at beta = sqrt(d) ln 100, Quest
  at the token budget DIPRS used on average, and the window alone (128 sink + 512 recent
  tokens, StreamingLLM-style: a plan with a budget of 0 beyond the window);
* perplexity of a held-out continuation after each long document (code, prose, structured
  text; ``ctxfs.texts``), teacher-forced one decode step at a time;
* needle-in-a-haystack accuracy: a passphrase hidden at several depths of a prose haystack,
  asked for after it;
* greedy token agreement with full attention over ``--steps`` steps after the prose
  document;
* the share of the prefix beyond the window that the plan attended, and ms per decode step
  (all layers).

``--rows`` picks rows (full always runs: the others are compared with it); ``--extra
NAME=JSON`` adds a row of ``Session.attention`` options, e.g. ``scan={"plan": "flat",
"beta": 73.6, "tail": true}``; a ``resident_budget`` among them serves the row's contexts
under that budget (a read-only mount of the store with ``Store.open(resident_budget=...)``,
each context warmed), and a budget below what even the codes take is reported as refused.
``--json`` prints the table as JSON. The contexts are ``--tokens`` long (8,192 by default:
SmolLM2's trained length).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time

import torch

from . import OverBudgetError, Store, texts
from . import hf
from .cli import HelpWithDefaults, parse_size

PASSPHRASES = ["indigo-falcon-42", "copper-lantern-17", "velvet-harbor-88", "quartz-meadow-23"]


#: The standard rows, in order.
ROWS = ("full", "auto", "compact", "diprs", "quest", "window")

#: The resident budget of the compact row: ctxfs's design budget, an eighth of the KV bytes.
COMPACT_BUDGET = 0.125


def plans(head_dim: int) -> dict[str, dict]:
    beta = math.sqrt(head_dim) * math.log(100)
    return {
        "full": {"plan": "full"},
        "auto": {},
        "compact": {"resident_budget": COMPACT_BUDGET},
        "diprs": {"plan": "diprs", "beta": beta},
        "quest": {"plan": "quest"},  # budget set to DIPRS's mean below
        "window": {"plan": "quest", "budget": 0},
    }


class Tally:
    """What a row's attention calls did: rows, tokens retrieved beyond the window, time."""

    def __init__(self):
        self.rows = self.retrieved = 0
        self.seconds = 0.0
        self.steps = 0
        self.share_den = 0

    def add(self, cache: hf.CtxfsCache, q_heads: int, seconds: float, steps: int) -> None:
        s = cache.session.stats()
        beyond = max(cache.prefix - s["window_tokens"], 1)
        self.rows += s["attention_rows"]
        self.retrieved += s["retrieved_tokens"]
        self.share_den += s["attention_rows"] * q_heads * beyond
        self.seconds += seconds
        self.steps += steps


def continuation_nll(model, cache, cont) -> float:
    """Mean negative log-likelihood of ``cont``'s tokens after the first, teacher-forced one
    decode step at a time through ``cache``."""
    nll, logits = 0.0, None
    with torch.no_grad():
        for i in range(cont.shape[1]):
            if logits is not None:
                nll -= torch.log_softmax(logits[0, -1].float(), -1)[cont[0, i]].item()
            logits = model(cont[:, i : i + 1], cache=cache, use_cache=True).logits
    return nll / (cont.shape[1] - 1)


def perplexity(model, store, doc, cont, options, tally, q_heads) -> float:
    cache = hf.CtxfsCache(store, torch.cat([doc, cont], 1), **options)
    assert cache.prefix == doc.shape[1], "the document is stored"
    started = time.monotonic()
    nll = continuation_nll(model, cache, cont)
    tally.add(cache, q_heads, time.monotonic() - started, cont.shape[1])
    return nll


def generate(model, store, prompt, options, new_tokens, tally, q_heads):
    cache = hf.CtxfsCache(store, prompt, **options)
    started = time.monotonic()
    out = model.generate(prompt, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    tally.add(cache, q_heads, time.monotonic() - started, new_tokens)
    return out[0, prompt.shape[1] :]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ctxfs.bench_model", description=__doc__, formatter_class=HelpWithDefaults)
    ap.add_argument("--tokens", type=int, default=8192, help="context length (tokens)")
    ap.add_argument("--continuation", type=int, default=64, help="held-out tokens scored per document")
    ap.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths, as shares of the haystack ('' for none)")
    ap.add_argument("--steps", type=int, default=128, help="greedy steps compared with full attention")
    ap.add_argument("--pool", type=parse_size, default="256M", help="buffer pool bytes: 268435456, 256M, 1G")
    ap.add_argument("--dir", help="where the store goes, kept afterwards (default: a scratch directory in the "
                    "current one, removed; O_DIRECT needs a disk file system, not tmpfs)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"rows to run, of {', '.join(ROWS)} (full is always run)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=JSON",
                    help='an extra row: Session.attention options as JSON, e.g. scan=\'{"plan": "flat", "tail": true}\'')
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        ap.error(f"--rows: unknown rows {sorted(unknown)}")
    for e in args.extra:
        name, _, spec = e.partition("=")
        try:
            if not name or not isinstance(json.loads(spec), dict):
                raise ValueError
        except ValueError:
            ap.error(f"--extra {e!r}: expected NAME=JSON object")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    tok, model = hf.load_smollm2()
    folder = args.dir or tempfile.mkdtemp(prefix="ctxfs-bench-model-", dir=os.getcwd())
    try:
        return run(args, tok, model, folder)
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)


def run(args, tok, model, folder: str) -> int:
    layers, q_heads, kv_heads, head_dim = hf._shape_of(model)
    path = os.path.join(folder, "bench.ctxfs")
    kv_bytes = args.tokens * layers * kv_heads * head_dim * 2 * 2
    # Six contexts (three documents, three haystacks); an index takes about as much as the KV.
    store = Store.create(path, size=kv_bytes * 4 * 7, force=True, pool=args.pool)
    log = (lambda *a: print(*a, file=sys.stderr)) if not args.json else (lambda *a: None)

    # The documents: the first --tokens tokens of each text, then the held-out continuation.
    docs = {}
    for kind in texts.KINDS:
        ids = tok(texts.text(kind), return_tensors="pt").input_ids
        docs[kind] = (ids[:, : args.tokens], ids[:, args.tokens : args.tokens + args.continuation])
        log(f"importing {kind} ({args.tokens} tokens)")
        hf.import_prefix(model, docs[kind][0], store, kind, progress=not args.json)
    # The haystacks: prose with a passphrase at each depth, ending before the question.
    question = tok("\n\nQuestion: What is the secret passphrase? Answer: The secret passphrase is", return_tensors="pt").input_ids
    hay = tok(texts.text("prose"), return_tensors="pt").input_ids[0]
    needles = []
    for i, depth in enumerate(float(d) for d in args.depths.split(",") if d):
        word = PASSPHRASES[i % len(PASSPHRASES)]
        needle = tok(f"\nThe secret passphrase is {word}. Remember it.\n", return_tensors="pt").input_ids[0]
        room = args.tokens - question.shape[1] - needle.shape[0]
        at = int(room * depth)
        ctx = torch.cat([hay[:at], needle, hay[at:room]]).unsqueeze(0)
        name = f"needle-{depth}"
        log(f"importing {name}")
        hf.import_prefix(model, ctx, store, name, progress=not args.json)
        needles.append((depth, word, ctx))

    hf.use_ctxfs(model)
    table, reference, diprs_budget = {}, None, None
    wanted = {"full", *args.rows.split(",")}
    rows = {k: v for k, v in plans(head_dim).items() if k in wanted}
    rows.update((e.partition("=")[0], json.loads(e.partition("=")[2])) for e in args.extra)
    names = [*docs, *(f"needle-{depth}" for depth, _, _ in needles)]
    for label, options in rows.items():
        budget = options.get("resident_budget")
        options = {k: v for k, v in options.items() if k != "resident_budget"}
        row_store, held = store, None
        if budget is not None:
            try:
                row_store, held = compact_mount(path, args.pool, budget, names)
            except OverBudgetError as e:
                log(f"row {label}: refused: {e}")
                table[label] = {"options": {**options, "resident_budget": budget}, "refused": str(e)}
                continue
        if label == "quest":
            if diprs_budget is None:  # DIPRS was not run: measure its budget alone
                probe = Tally()
                for d, c in docs.values():
                    perplexity(model, store, d, c, plans(head_dim)["diprs"], probe, q_heads)
                diprs_budget = max(1, round(probe.retrieved / max(probe.share_den, 1) * (args.tokens - 640)))
            options = {**options, "budget": diprs_budget}
        log(f"row {label} {options}")
        tally = Tally()
        ppl = {kind: math.exp(perplexity(model, row_store, d, c, options, tally, q_heads)) for kind, (d, c) in docs.items()}
        found, answers = [], []
        for depth, word, ctx in needles:
            answer = tok.decode(generate(model, row_store, torch.cat([ctx, question], 1), options, 12, tally, q_heads))
            answers.append(answer)
            found.append(word in answer.replace(" ", ""))
        prose, _ = docs["prose"]
        greedy = generate(model, row_store, torch.cat([prose, question[:, :3]], 1), options, args.steps, tally, q_heads)
        del row_store  # a compact mount is released before the next row's
        if label == "full":
            reference = greedy
        agreement = (greedy == reference).float().mean().item()
        share = tally.retrieved / max(tally.share_den, 1)
        if label == "diprs":
            diprs_budget = max(1, round(share * (args.tokens - 640)))
        table[label] = {
            "options": {k: v for k, v in {**options, "resident_budget": budget}.items() if v is not None},
            "held": held,
            "perplexity": ppl,
            "needle_accuracy": sum(found) / len(found) if found else None,
            "needle_found": found,
            "needle_answers": answers,
            "agreement": agreement,
            "share_attended": share,
            "ms_per_step": 1000 * tally.seconds / max(tally.steps, 1),
        }
    if args.json:
        print(json.dumps({"tokens": args.tokens, "model": "SmolLM2-135M-Instruct", "rows": table}, indent=2))
        return 0
    kinds = list(docs)
    head = f"{'plan':<14}" + "".join(f"{'ppl ' + k:>16}" for k in kinds) + f"{'needle':>8}{'agree':>8}{'share':>8}{'ms/step':>9}"
    print(f"SmolLM2-135M-Instruct, {args.tokens}-token contexts, window 128 + 512")
    print(head)
    full = table["full"]["perplexity"]
    for label, row in table.items():
        if "refused" in row:
            print(f"{label:<14}refused: {row['refused']}")
            continue
        cells = "".join(f"{row['perplexity'][k]:>9.3f} ({row['perplexity'][k] / full[k] - 1:+.1%})" for k in kinds)
        needle = "-" if row["needle_accuracy"] is None else f"{row['needle_accuracy']:.2f}"
        print(f"{label:<14}{cells}{needle:>8}{row['agreement']:>8.3f}"
              f"{row['share_attended']:>8.3f}{row['ms_per_step']:>9.1f}")
    for label, row in table.items():
        if row.get("held"):
            h = row["held"]
            how = "served compact" if h["compact"] else "whole index held"
            print(f"{label}: resident budget {row['options']['resident_budget']}: {how}, "
                  f"resident_bytes / kv_bytes {h['resident_over_kv']:.3f} (the most of any context)")
    return 0


def compact_mount(path: str, pool: int, budget: float, names: list[str]):
    """A read-only mount of the store under a resident budget, every context warmed (served
    compact where its whole index exceeds the budget); and the most any context holds."""
    mount = Store.open(path, pool=pool, read_only=True, resident_budget=budget)
    reports = [mount.warm(name) for name in names]
    worst = max(reports, key=lambda r: r["resident_over_kv"])
    held = {"resident_over_kv": worst["resident_over_kv"], "compact": all(r["compact"] for r in reports)}
    return mount, held


if __name__ == "__main__":
    sys.exit(main())
