"""ctxfs: KV caches of long prompts on NVMe, attention answered from storage.

``Store`` mounts a context store; ``Store.import_kv`` streams a context's KV cache in, layer by
layer; ``Store.create_session`` reuses the longest stored prefix of a prompt; a ``Session``
answers attention for all q heads of a layer at once. ``ctxfs.hf`` puts a transformers model
on top (docs/python.md).
"""

from __future__ import annotations

import operator
import sys
import threading
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from . import _native, errors
from .errors import *  # noqa: F403 (the exception classes: errors.__all__)
from .errors import InputError

__all__ = ["Store", "Session", "PLANS", *errors.__all__]

try:
    __version__ = version("ctxfs")
except PackageNotFoundError:  # imported from a source tree without the wheel installed
    __version__ = "unknown"

#: Plans a call may force (``Session.attention(..., plan=...)``).
PLANS = ("full", "flat", "diprs", "graph-diprs", "topk", "quest", "infllm", "pq")


def as_f32(x: Any, name: str) -> np.ndarray:
    """A C-contiguous float32 numpy view of ``x`` (numpy f32/f16, or a torch CPU tensor of
    f32, f16 or bf16); a copy only where the dtype or layout needs one."""
    if hasattr(x, "detach") and hasattr(x, "dtype"):  # a torch tensor
        import torch

        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype != torch.float32:
            if t.dtype not in (torch.float16, torch.bfloat16):
                raise InputError(f"{name}: dtype {t.dtype} (expected float32, float16 or bfloat16)")
            t = t.to(torch.float32)
        x = t.contiguous().numpy()
    a = np.asarray(x)
    # Either byte order: `np.ascontiguousarray` below converts to native float32.
    if a.dtype.newbyteorder("=") not in (np.float32, np.float16):
        raise InputError(f"{name}: dtype {a.dtype} (expected float32, float16 or bfloat16)")
    return np.ascontiguousarray(a, dtype=np.float32)


U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


def as_int(x: Any, name: str) -> int:
    """An integer argument (an int, a numpy integer, anything with ``__index__``), else
    InputError: a float or a string is not silently truncated or parsed."""
    try:
        return operator.index(x)
    except TypeError:
        raise InputError(f"{name} is {x!r}: expected an integer") from None


def as_count(x: Any, name: str, most: int = U32_MAX) -> int:
    """A non-negative integer argument of at most ``most`` (the native field's range: u32
    unless said), else InputError."""
    n = as_int(x, name)
    if not 0 <= n <= most:
        raise InputError(f"{name} is {n}: expected 0..={most}")
    return n


def as_window(window: Any) -> tuple[int, int]:
    """A (first, last) token window, else InputError."""
    try:
        first, last = window
    except (TypeError, ValueError):
        raise InputError(f"window is {window!r}: expected (first, last) token counts") from None
    return as_count(first, "window's first tokens"), as_count(last, "window's last tokens")


def as_token_ids(ids: Iterable[int], name: str = "token ids") -> list[int]:
    """Token ids as u32s, else InputError naming the first that is not."""
    out = [as_int(t, name) for t in ids]
    bad = next((t for t in out if not 0 <= t <= U32_MAX), None)
    if bad is not None:
        raise InputError(f"{name}: {bad} is not a token id (0..={U32_MAX})")
    return out


#: The options of an attention call (``Session.attention``'s keywords besides ``return_lse``).
OPTIONS = ("plan", "beta", "budget", "scale", "tail", "target_error", "k")


def call_options(**given: Any) -> dict:
    """An attention call's options as the native session takes them: every key of
    ``OPTIONS``, None for the default, counts checked; an unknown one is an InputError."""
    unknown = sorted(set(given) - set(OPTIONS))
    if unknown:
        raise InputError(f"unknown option {unknown[0]!r}: expected {', '.join(OPTIONS)}")
    options = {name: given.get(name) for name in OPTIONS}
    for name in ("budget", "k"):
        if options[name] is not None:
            options[name] = as_count(options[name], name)
    return options


class Progress:
    """A one-line progress bar on stderr (only when stderr is a terminal)."""

    def __init__(self, label: str, total: int, unit: str = "", enabled: bool = True):
        self.label, self.total, self.unit = label, max(total, 1), unit
        self.enabled = enabled and sys.stderr.isatty()
        self.started = time.monotonic()

    def __call__(self, done: int, total: int | None = None) -> None:
        if total is not None:
            self.total = max(total, 1)
        if not self.enabled:
            return
        width = 30
        filled = int(width * done / self.total)
        elapsed = time.monotonic() - self.started
        eta = elapsed / done * (self.total - done) if done else 0.0
        sys.stderr.write(
            f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total}{self.unit} "
            f"{elapsed:.0f}s (eta {eta:.0f}s)"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()


class Session:
    """A prompt's reused prefix, its window and the tokens it added since.

    Create one with ``Store.create_session``. Attention calls may run from many threads at
    once; ``update`` and ``append_tokens`` take the session alone."""

    def __init__(self, native: Any, store: "Store"):
        self._native = native
        # The native store, not the Python one: a session outlives its Store's close().
        self._store_native = store._native
        self._calls = 0
        self._rows = 0
        self._retrieved = 0
        self._estimated_max: float | None = None
        self._scored = 0
        self._plans: dict[str, int] = {}
        # Attention calls may run from several threads: their counts are summed under it.
        self._counting = threading.Lock()
        self._shape: dict = native.info()["shape"]

    def __repr__(self) -> str:
        info = self._native.info()
        reused, new = info["prefix_tokens"], info["new_tokens"]
        return f"<ctxfs.Session {info['reused_context']!r}: {reused} tokens reused, {new} new>"

    @property
    def shape(self) -> dict:
        """The context's model shape: layers, q_heads, kv_heads, head_dim, dtype."""
        return dict(self._shape)

    @property
    def prefix_tokens(self) -> int:
        """Tokens reused from storage."""
        return self._native.info()["prefix_tokens"]

    def attention(
        self,
        layer: int,
        q: Any,
        *,
        plan: str | None = None,
        beta: float | None = None,
        budget: int | None = None,
        scale: float | None = None,
        tail: bool | None = None,
        target_error: float | None = None,
        k: int | None = None,
        return_lse: bool = False,
    ):
        """Attention of one decode step's queries over ``layer``: ``q`` is ``[q_heads,
        head_dim]`` (one step) or ``[rows, q_heads, head_dim]`` (each row its own step, as in
        decode). Returns the output, shaped like ``q`` (float32), and with ``return_lse`` the
        log-sum-exp per head, ``[q_heads]`` or ``[rows, q_heads]``.

        ``plan`` forces one of ``ctxfs.PLANS``; otherwise the optimizer chooses. ``beta`` is
        DIPRS's range below the best inner product (default: ln(97 / 0.02) / scale, the same
        softmax cut at every head dimension), ``budget`` caps retrieved tokens,
        ``scale`` is the softmax scale (default 1/sqrt(head_dim)). ``tail`` turns on or off
        the estimate of the softmax mass a DIPR plan left out, from the index's seed sample
        (default: on for the optimizer's plans and with a target, off for forced ones).
        ``target_error`` asks for an output error at most this, relative to exact attention's,
        instead of a fixed ``beta``: the range is cut per query where it is estimated to meet
        it (``stats()["estimated_error_max"]`` is the largest estimate seen; a forced
        ``graph-diprs`` meets it less often than the others: docs/python.md). ``k`` is how many
        tokens the ``topk`` plan retrieves beyond the window (default 100; ``ctxfs query --k``)."""
        layer = as_count(layer, "layer")
        options = call_options(
            plan=plan, beta=beta, budget=budget, scale=scale, tail=tail, target_error=target_error, k=k
        )
        a = as_f32(q, "q")
        shape = a.shape
        m = self._shape
        want = (m["q_heads"], m["head_dim"])
        if a.ndim not in (2, 3) or shape[-2:] != want or (a.ndim == 3 and shape[0] == 0):
            raise InputError(
                f"q has shape {shape}: expected [q_heads, head_dim] = {list(want)} or [rows, {want[0]}, {want[1]}] "
                "with rows ≥ 1"
            )
        rows = 1 if a.ndim == 2 else shape[0]
        out, lse, reports = self._native.attention(layer, a.reshape(rows, -1), options)
        with self._counting:
            self._calls += 1
            self._rows += rows
            for label, retrieved, scored, estimated in reports:
                self._plans[label] = self._plans.get(label, 0) + 1
                self._retrieved += retrieved
                self._scored += scored
                if estimated is not None:
                    self._estimated_max = max(self._estimated_max or 0.0, estimated)
        out = out.reshape(shape)
        if a.ndim == 2:
            lse = lse[0]
        return (out, lse) if return_lse else out

    def check_options(self, **options: Any) -> None:
        """Raises ``InputError`` for options ``attention`` would refuse (an unknown option or
        plan, a target on a plan with a fixed budget, a budget on ``full``, a non-finite β,
        ...), before any call runs. ``options`` are ``attention``'s keywords."""
        self._native.check_options(call_options(**options))

    def update(self, layer: int, q: Any, k: Any, v: Any) -> None:
        """Appends tokens to ``layer``: ``k`` and ``v`` ``[kv_heads, t, head_dim]``, ``q``
        ``[q_heads, t, head_dim]`` or None (queries train the index when the session is
        stored). Nothing changes when the input is refused."""
        layer = as_count(layer, "layer")
        m = self._shape
        qa = None if q is None else as_f32(q, "q")
        ka, va = as_f32(k, "k"), as_f32(v, "v")
        for name, a, heads in (("q", qa, m["q_heads"]), ("k", ka, m["kv_heads"]), ("v", va, m["kv_heads"])):
            if a is not None and (a.ndim != 3 or a.shape[0] != heads or a.shape[2] != m["head_dim"]):
                raise InputError(f"{name} has shape {a.shape}: expected [{heads}, t, {m['head_dim']}]")
        self._native.update(layer, qa, ka, va)

    def append_tokens(self, ids: Iterable[int]) -> None:
        """Ids of tokens generated after the prompt, in order (they name the stored context's
        tokens, for prefix reuse)."""
        self._native.append_tokens(as_token_ids(ids))

    def store(self, name: str) -> dict:
        """Persists the session's own tokens as context ``name``, on top of the prefix it
        reused (whose blocks are shared, not copied)."""
        return self._native.store(self._store_native, name)

    def plan(self, layer: int, plan: str | None = None) -> dict:
        """The plan an attention call on ``layer`` runs (``plan`` forces one), and why."""
        return self._native.plan(as_count(layer, "layer"), plan)

    def stats(self) -> dict:
        """The session's state and what its attention calls did so far."""
        info = self._native.info()
        info.update(
            attention_calls=self._calls,
            attention_rows=self._rows,
            retrieved_tokens=self._retrieved,
            estimated_error_max=self._estimated_max,
            keys_scored=self._scored,
            plans=dict(self._plans),
            pool=self._store_native.pool_stats(),
        )
        return info


class Store:
    """A mounted context store: its buffer pool and prefix trie.

    ``Store.create`` formats one; ``Store.open`` mounts one (for writing, or with
    ``read_only=True`` beside a writer in another process). A read-only mount sees the
    contexts committed when it opened: open it again to see later ones. ``close()`` (or
    leaving a ``with`` block) lets go of it; the store stays open, its writer lock held,
    while a session opened from it lives."""

    def __init__(self, native: Any):
        self._handle = native

    @property
    def _native(self) -> Any:
        if self._handle is None:
            raise InputError("the store is closed")
        return self._handle

    def close(self) -> None:
        """Lets go of the store: later calls on this object raise ``InputError``. Its pool
        and writer lock are released once no session opened from it is left."""
        self._handle = None

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<ctxfs.Store closed>" if self._handle is None else f"<ctxfs.Store {self.path!r}>"

    @classmethod
    def create(
        cls,
        path: str,
        size: int | None = None,
        block_size: int = 4096,
        *,
        force: bool = False,
        pool: int = 256 << 20,
        device: str = "auto",
        window: tuple[int, int] = (128, 512),
        resident_budget: float | None = None,
    ) -> "Store":
        """Formats ``path`` and opens it for writing: a file is sized to ``size`` bytes
        (needed when it is new or empty; an existing file without ``size`` keeps its size),
        a block device is taken whole. An existing store, or a file or device holding any nonzero
        byte in its first MiB, is overwritten only with ``force``."""
        size = None if size is None else as_count(size, "size", U64_MAX)
        block_size = as_count(block_size, "block_size")
        pool, window = as_count(pool, "pool", U64_MAX), as_window(window)
        return cls(_native.Store.create(str(path), size, block_size, force, pool, device, window, resident_budget))

    @classmethod
    def open(
        cls,
        path: str,
        pool: int = 256 << 20,
        device: str = "auto",
        *,
        read_only: bool = False,
        window: tuple[int, int] = (128, 512),
        resident_budget: float | None = None,
    ) -> "Store":
        """Mounts a store. ``pool`` is the buffer pool's byte budget; ``device`` is ``auto``,
        ``uring`` or ``file``; ``window`` is the (first, last) tokens every plan attends
        exactly; ``resident_budget`` is the most a served context may hold resident per byte
        of its KV cache (``warm``: over it, a context is served compact from its PQ codes,
        or refused with ``OverBudgetError`` when even those exceed it)."""
        pool, window = as_count(pool, "pool", U64_MAX), as_window(window)
        return cls(_native.Store.open(str(path), pool, device, read_only, window, resident_budget))

    @property
    def path(self) -> str:
        """The store's path, as it was opened."""
        return str(self._native.path)

    def contexts(self) -> list[dict]:
        """The committed contexts: name, tokens, shape, parent and blocks of each."""
        return self._native.inspect()["contexts"]

    def inspect(self) -> dict:
        """``ctxfs inspect --json``'s summary of the store."""
        return self._native.inspect()

    def fsck(self) -> dict:
        """Checks every block of the committed state. ``exit_code`` has ``ctxfs fsck``'s
        meaning: 0 clean, 4 problems found (each names its block)."""
        return self._native.fsck()

    def delete(self, name: str) -> None:
        """Deletes a context by name; contexts stored on top of it keep its blocks alive."""
        self._native.delete(name)

    def warm(self, name: str) -> dict:
        """Reads a context's index into the pool and holds it resident: blocks, read, held,
        resident_bytes, kv_bytes, resident_over_kv, compact, residual_streamed (a compact
        context's residual codes read on demand, not held, to keep within the budget). Over the store's
        ``resident_budget`` only its PQ codes and seed tables are held (``compact``); raises
        ``OverBudgetError`` (holding nothing) when even those exceed it."""
        return self._native.warm(name)

    def footprint(self, name: str) -> dict:
        """What serving a context holds resident against its KV cache: tokens, kv_bytes,
        resident_bytes, resident_over_kv, compact_bytes and compact_over_kv (what it holds
        served compact), compact_and_window_over_kv (with a session's window), and parts
        (meta, graph, keys, seeds, quest, infllm, pq, maps: the block maps; window: a
        session's window, not in the resident bytes; all in bytes)."""
        return self._native.footprint(name)

    def pool_stats(self) -> dict:
        """The buffer pool's budget and, per block class (index, data): hits, misses,
        first_reads (misses of blocks never read before: no cache would save them),
        hit_ratio, bytes_read, evictions, resident_frames, capacity_frames, resident_pins."""
        return self._native.pool_stats()

    def gpu_status(self) -> str:
        """The GPU that attention and the codes' scans run on (its name), or why none is
        used (e.g. "libcuda not found: no NVIDIA driver on this machine")."""
        return self._native.gpu_status()

    def gpu_codes_bytes(self) -> tuple[int, int] | None:
        """Bytes of compact contexts' PQ codes the GPU holds (their scans run there), and
        the most it may hold (half its memory free when the store opened); None without a
        GPU."""
        return self._native.gpu_codes_bytes()

    def import_kv(
        self,
        name: str,
        layers: Iterable[Sequence[Any]],
        tokens: Sequence[int],
        *,
        num_layers: int | None = None,
        q_heads: int | None = None,
        dtype: str = "f16",
        progress: bool | Callable[[int, int], None] = True,
    ) -> dict:
        """Imports a context: ``layers`` yields, per layer, ``(k, v)`` or ``(k, v, q)`` with
        ``k`` and ``v`` ``[kv_heads, tokens, head_dim]`` and ``q`` (prefill queries that train
        the index) ``[q_heads, rows, head_dim]``. It is consumed one layer at a time, so only
        one layer need exist at once. ``num_layers`` is needed when ``layers`` has no length.
        ``q_heads`` (the model's query heads) is needed when layer 0 has no ``q`` and the
        model groups its queries (GQA): without either, a head per kv head is recorded.

        ``progress`` is True for a progress bar on stderr (when it is a terminal), False for
        none, or a callable told ``(files done, files in all)`` after each vector file; what it
        raises (a KeyboardInterrupt too) stops the import and is raised again.

        Shapes, dtypes, non-finite values, an existing name, a full store and more layers than
        ``num_layers`` are refused; an import that fails leaves nothing behind."""
        tokens = as_token_ids(tokens)
        if not tokens:
            raise InputError("a context needs at least one token")
        if hasattr(layers, "__len__"):
            if num_layers is not None and num_layers != len(layers):  # type: ignore[arg-type]
                raise InputError(f"num_layers is {num_layers} but layers holds {len(layers)}")  # type: ignore[arg-type]
            num_layers = len(layers)  # type: ignore[arg-type]
        elif num_layers is None:
            raise InputError("layers has no length: pass num_layers")
        num_layers = as_int(num_layers, "num_layers")
        q_heads = None if q_heads is None else as_int(q_heads, "q_heads")
        if num_layers == 0:
            raise InputError("layers is empty")
        if not 1 <= num_layers <= 0xFFFF or (q_heads is not None and not 1 <= q_heads <= 0xFFFF):
            raise InputError(f"num_layers {num_layers} and q_heads {q_heads} must be 1..=65535")
        it = iter(layers)

        def unpack(index: int, item) -> tuple:
            if item is None:
                raise InputError(f"layers ended after {index} layers, expected {num_layers}")
            if len(item) not in (2, 3):
                raise InputError(f"layer {index}: expected (k, v) or (k, v, q), got {len(item)} items")
            q = as_f32(item[2], "q") if len(item) == 3 and item[2] is not None else None
            return as_f32(item[0], "k"), as_f32(item[1], "v"), q

        try:
            first = next(it)
        except StopIteration:
            raise InputError("layers is empty") from None
        # Layer 0, converted once: peeked at for the shape, then handed to the import.
        pending = {0: unpack(0, first)}
        k0, _, q0 = pending[0]
        if k0.ndim != 3:
            raise InputError(f"layer 0: k has shape {k0.shape}, expected [kv_heads, tokens, head_dim]")
        kv_heads, n, head_dim = k0.shape
        if n != len(tokens):
            raise InputError(f"layer 0: k holds {n} tokens but {len(tokens)} token ids were given")
        if q0 is not None and q0.ndim != 3:
            raise InputError(f"layer 0: q has shape {q0.shape}, expected [q_heads, rows, head_dim]")
        given = q0.shape[0] if q0 is not None else None
        if q_heads is not None and given is not None and q_heads != given:
            raise InputError(f"q_heads is {q_heads} but layer 0's q has {given} heads")
        q_heads = q_heads or given or kv_heads

        def next_layer(index: int):
            k, v, q = pending.pop(index) if index in pending else unpack(index, next(it, None))
            # The last layer: an iterator with more would lose them silently.
            if index == num_layers - 1 and next(it, None) is not None:
                raise InputError(f"layers yields more than num_layers ({num_layers}) layers")
            if k.shape != (kv_heads, n, head_dim) or v.shape != k.shape:
                raise InputError(
                    f"layer {index}: k {k.shape} and v {v.shape}, expected {(kv_heads, n, head_dim)} as layer 0"
                )
            return k, v, q

        bar = progress if callable(progress) else Progress(f"import {name}", num_layers * kv_heads, " files", progress)
        try:
            return self._native.import_kv(
                name, tokens, num_layers, q_heads, kv_heads, head_dim, next_layer, dtype, bar
            )
        finally:
            if isinstance(bar, Progress):
                bar.close()

    def create_session(self, tokens: Sequence[int], *, max_reuse: int | None = None) -> tuple[Session, int]:
        """A session on ``tokens``, reusing the longest prefix a stored context shares with
        them (at most ``max_reuse`` tokens). Returns the session and the reused prefix length;
        the caller prefills the rest and passes its KV to ``Session.update``."""
        cap = None if max_reuse is None else as_count(max_reuse, "max_reuse")
        native, reused = self._native.create_session(as_token_ids(tokens), cap)
        return Session(native, self), reused

    def open_session(self, name: str, prefix: int | None = None) -> Session:
        """A session on the first ``prefix`` tokens (all by default) of a named context."""
        cap = None if prefix is None else as_count(prefix, "prefix")
        return Session(self._native.open_session(name, cap), self)
