"""ctxfs under a tiny seeded Llama: generate() through CtxfsCache matches transformers' own
cache, whole and partial prefixes are reused, and a generation is stored and reused."""

import pytest

torch = pytest.importorskip("torch")

import ctxfs  # noqa: E402
import ctxfs.hf as hf  # noqa: E402
from hf_reference import generate, max_relative_logit_error, through_ctxfs  # noqa: E402


@pytest.fixture
def doc_store(store_path, tiny_model):
    g = torch.Generator().manual_seed(1)
    doc = torch.randint(0, 256, (1, 1500), generator=g)
    store = ctxfs.Store.create(store_path, size=64 << 20)
    cache, queries = hf.capture_prefix(tiny_model, doc, chunk=256, progress=False)
    hf.import_cache(store, "doc", cache, queries, doc[0].tolist(), progress=False)
    return store, doc, cache, g


def test_generate_matches_transformers_with_the_full_plan(doc_store, tiny_model):
    store, doc, cache, g = doc_store
    prompt = torch.cat([doc, torch.randint(0, 256, (1, 12), generator=g)], 1)
    ref = generate(tiny_model, prompt, cache, 40, f16=True)
    c = hf.CtxfsCache(store, prompt, plan="full")
    assert c.prefix == doc.shape[1]
    out = through_ctxfs(tiny_model, prompt, c, 40)
    assert torch.equal(out.sequences, ref.sequences)
    assert max_relative_logit_error(out, ref) < 1e-4
    # One attention row per layer for each prompt token after the prefix and each step after.
    assert c.session.stats()["plans"] == {"full": (12 + 39) * 2}


def test_partial_prefix_and_a_stored_generation_are_reused(doc_store, tiny_model):
    store, doc, cache, g = doc_store
    # Diverges from the stored document at token 1000: 1000 tokens are reused, filtered.
    prompt = torch.cat([doc[:, :1000], torch.randint(0, 256, (1, 30), generator=g)], 1)
    c = hf.CtxfsCache(store, prompt, plan="full")
    assert c.prefix == 1000 and c.session.stats()["filtered"]
    out = through_ctxfs(tiny_model, prompt, c, 16)
    report = c.store("branch", out.sequences)
    assert report["tokens"] == 30 + 15  # the last generated token was never fed to the model
    again = hf.CtxfsCache(store, out.sequences)
    assert again.prefix == 1000 + 45
    assert store.fsck()["exit_code"] == 0


def test_a_prompt_with_no_stored_prefix_is_refused(doc_store):
    store, doc, _, _ = doc_store
    other = (doc[0, 0].item() + 1) % 256
    with pytest.raises(ctxfs.InputError, match="no stored context shares a prefix"):
        hf.CtxfsCache(store, torch.tensor([[other, 1, 4, 1, 5]]))


def test_capture_writes_what_bench_search_reads(tiny_model):
    """ctxfs.capture's tensors: the prefix's keys and values, evenly spaced prefill queries
    and one query per decode step, per kept layer; the keys are the model's own cache."""
    from ctxfs import capture

    ids = torch.randint(0, 256, (1, 700), generator=torch.Generator().manual_seed(3))
    out = capture.capture(tiny_model, ids, 600, 5, [1], 64, progress=False)
    assert out["layers.0.k"].shape == (2, 600, 16) and out["layers.0.v"].shape == (2, 600, 16)
    assert out["layers.0.q"].shape == (4, 64, 16)
    assert out["layers.0.decode_q"].shape == (4, 5, 16)
    assert out["tokens"].tolist() == ids[0, :600].tolist()
    cache, _ = hf.capture_prefix(tiny_model, ids[:, :600], progress=False)
    assert torch.allclose(torch.from_numpy(out["layers.0.k"]).float(), cache.layers[1].keys[0].half().float())


def test_generating_without_a_ctxfs_cache_after_one_says_what_is_missing(doc_store, tiny_model):
    """The attention takes the cache its layer's update handed it: a later generate() with
    transformers' own cache finds none, and says what it needs."""
    store, doc, _, g = doc_store
    prompt = torch.cat([doc, torch.randint(0, 256, (1, 4), generator=g)], 1)
    through_ctxfs(tiny_model, prompt, hf.CtxfsCache(store, prompt), 2)
    with pytest.raises(ctxfs.InputError, match=r"needs cache=CtxfsCache"):
        tiny_model.generate(prompt[:, -8:], max_new_tokens=2, do_sample=False)


def _tiny(config_class, **extra):
    """A tiny seeded model of another family, shaped as the Llama fixture is."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
    return AutoModelForCausalLM.from_config(config_class(**shape, **heads, **extra)).eval()


def test_attention_that_is_not_plain_softmax_over_every_token_is_refused(store_path):
    """Soft-capped logits and a sliding window shorter than the prompt would be served as
    plain attention over every token: another model's answers. Import and generation say so."""
    from transformers import Gemma2Config, MistralConfig

    store = ctxfs.Store.create(store_path, size=64 << 20)
    doc = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(2))
    gemma2 = _tiny(Gemma2Config, attn_logit_softcapping=50.0, sliding_window=4096)
    with pytest.raises(ctxfs.InputError, match=r"caps its attention logits \(softcap 50.0\)"):
        hf.import_prefix(gemma2, doc, store, "capped", progress=False)
    mistral = _tiny(MistralConfig, sliding_window=100)
    with pytest.raises(ctxfs.InputError, match="sliding window of 100 tokens, shorter than the 300"):
        hf.import_prefix(mistral, doc, store, "windowed", progress=False)
    # A window longer than the prompt attends every token: served; shorter at generation: refused.
    mistral.config.sliding_window = 4096
    hf.import_prefix(mistral, doc, store, "doc", progress=False)
    mistral.config.sliding_window = 200
    prompt = torch.cat([doc, torch.tensor([[1, 2, 3]])], 1)
    with pytest.raises(ctxfs.InputError, match="sliding window of 200 tokens, shorter than the 303"):
        through_ctxfs(mistral, prompt, hf.CtxfsCache(store, prompt), 2)
    assert [c["name"] for c in store.contexts()] == ["doc"]


def test_a_cache_refuses_calls_it_would_answer_wrongly(doc_store, tiny_model):
    """A CtxfsCache serves the prompt it was made for, one sequence of it, with options any
    attention call takes: anything else is refused, never answered as if it were."""
    store, doc, _, g = doc_store
    prompt = torch.cat([doc, torch.randint(0, 256, (1, 6), generator=g)], 1)
    with pytest.raises(ctxfs.InputError, match="fixed budget"):
        hf.CtxfsCache(store, prompt, plan="quest", target_error=0.01)
    with pytest.raises(ctxfs.InputError, match="unknown plan"):
        hf.CtxfsCache(store, prompt, plan="nope")
    other = torch.cat([doc, torch.randint(0, 256, (1, 9), generator=g)], 1)
    with pytest.raises(ctxfs.InputError, match="made for a prompt of"):
        through_ctxfs(tiny_model, other, hf.CtxfsCache(store, prompt), 2)
    with pytest.raises(ctxfs.InputError, match="serves one"):
        tiny_model.generate(prompt, cache=hf.CtxfsCache(store, prompt), max_new_tokens=2, num_beams=2, do_sample=False)
    with pytest.raises(ctxfs.InputError, match="chunk"):
        hf.capture_prefix(tiny_model, doc, chunk=0, progress=False)
