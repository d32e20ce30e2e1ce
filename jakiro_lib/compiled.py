"""The target behind a static KV cache with its decoding and verification forwards compiled.

:class:`CompiledTargetRunner` is a drop-in for :class:`~jakiro_lib.decoding.TargetRunner` (same methods,
same results up to rounding): one static cache per model and length, and one ``torch.compile``-d forward
(inductor; weights frozen on CPU) per padded row count. A tree of m tokens runs at the smallest of
:data:`COMPILED_SIZES` that holds it; the padding rows see the prefix and themselves only, write their
keys and values past the tree, and are never kept. Larger trees and the prefill run eagerly over the same
cache.

Measured on this project's 2-core CPU (SmolLM2-135M fp32, 2026-11-23): alone, the compiled forward scores
1 token in 32 ms against 37 eager and 8 in 46.5 against 50; inside our loops, with the drafter's eager work
between calls, it bought 1.04x for vanilla decoding and 1.01x for Jakiro (docs/results.md, "What each speed
lever bought"). Each compiled size costs about 25 s of compilation, once per process and cache length.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from transformers import PreTrainedModel, StaticCache
from transformers.cache_utils import StaticLayer

from . import kernels
from .target import additive_mask
from .tree import Tree

COMPILED_SIZES = (1, 2, 4, 8, 12, 16, 24, 32)  # row counts compiled; larger trees run eagerly
MAX_TREE_ROOM = 128  # static-cache room kept past the generated tokens for a tree forward
_SCRATCH = "_jakiro_scratch"
RECOMPILE_LIMIT = 64  # dynamo's default (8) is below the sizes x cache lengths one process may compile


class CompileError(RuntimeError):
    """torch.compile failed for the target (no C++ compiler for inductor on CPU, no triton on CUDA)."""


def static_cache_len(needed: int) -> int:
    """Length of a static KV cache holding ``needed`` positions: a power of two, at least 1024, so a
    compiled forward sees few distinct cache shapes (each new one costs a recompilation)."""
    return max(1024, 1 << max(needed - 1, 1).bit_length())


def padded_size(m: int) -> int | None:
    """The compiled row count that holds ``m`` tokens; None when ``m`` is above every compiled size."""
    return next((n for n in COMPILED_SIZES if n >= m), None)


def inductor_settings(device: torch.device) -> contextlib.AbstractContextManager:
    """Inductor settings while the target compiles. On CPU, ``freezing``: weights become constants, so
    inductor pre-packs them for its GEMMs and folds what it can. On this project's 2-core CPU it made HF's
    compiled decoding step about 10% faster than inductor's default (SmolLM2-135M fp32, 28.7 against 26.3
    tokens/s, 2026-11-23). It must be set while the graph compiles (passed to HF as ``CompileConfig``
    options it did not pay). Frozen, a graph also binds to the KV buffers it was compiled with, hence
    :func:`static_cache`."""
    if device.type == "cuda":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config  # heavy (loads inductor): only when compiling

    return inductor_config.patch(freezing=True)


def static_cache(model: PreTrainedModel, cache_len: int) -> StaticCache:
    """The model's one static KV cache of ``cache_len`` positions, shared by every compiled call.

    A compiled step is specialised to its cache's buffers: a new cache object costs a recompilation, and
    under inductor freezing the step would go on reading the first cache's buffers (wrong tokens from the
    second prompt on; caught by a test). Reusing the cache is also what transformers advises.
    """
    caches: dict[int, StaticCache] = scratch(model).setdefault("static_caches", {})
    if cache_len not in caches:
        caches[cache_len] = StaticCache(config=model.config, max_cache_len=cache_len)
    return caches[cache_len]


class _ModelState:
    """Per model: its compiled forward, and which shapes it has compiled."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.compiled_shapes: set[tuple[int, int]] = set()

        def forward(ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                    cache: StaticCache) -> tuple[torch.Tensor, torch.Tensor]:
            hidden = model.model(input_ids=ids, position_ids=pos, attention_mask=mask, past_key_values=cache,
                                 use_cache=True).last_hidden_state
            return model.lm_head(hidden), hidden

        self.eager: Callable[..., tuple[torch.Tensor, torch.Tensor]] = forward
        self.compiled = torch.compile(forward, fullgraph=True, dynamic=False)


def scratch(model: PreTrainedModel) -> dict[str, Any]:
    """What the compiled paths keep per model (its forward closure, static caches, static engines), stored on
    the model and left behind by a copy of it: ``copy.deepcopy`` copies closures and compiled steps as they
    are, so a copy's would still run the original model (a copy of the tiny target with a sharpened head
    sampled from the original's distribution: tests/test_compiled.py)."""
    owner, state = model.__dict__.get(_SCRATCH, (None, None))
    if owner != id(model):
        state = {}
        model.__dict__[_SCRATCH] = (id(model), state)
    return state


def _state(model: PreTrainedModel) -> _ModelState:
    store = scratch(model)
    if "runner" not in store:
        store["runner"] = _ModelState(model)
    return store["runner"]


def _compile_settings(device: torch.device) -> contextlib.AbstractContextManager:
    """Settings while a new shape compiles: room for every shape, and :func:`inductor_settings`."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT))
    stack.enter_context(inductor_settings(device))
    return stack


class CompiledTargetRunner:
    """:class:`~jakiro_lib.decoding.TargetRunner`'s interface over a static cache and compiled forwards."""

    def __init__(self, model: PreTrainedModel, cache_len: int) -> None:
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self.cache_len = cache_len
        self._state = _state(model)
        self.cache = static_cache(model, cache_len)
        if any(type(layer) is not StaticLayer for layer in self.cache.layers):
            raise ValueError("the compiled target runner needs full attention in every layer; this target has "
                             "sliding-window layers (run it without static_compile)")
        self.length = 0

    def reset(self) -> None:
        self.length = 0
        self._rewind(0)

    def _rewind(self, length: int) -> None:
        """Point every layer's write position at ``length`` (entries after it are stale and masked)."""
        for layer in self.cache.layers:
            layer.cumulative_length.fill_(length)

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward of ``ids`` after the cache's ``length`` entries; ``block`` [n, n]: which new rows each sees."""
        n = ids.shape[0]
        if self.length + n > self.cache_len:
            raise ValueError(f"static cache of {self.cache_len} positions cannot take {n} more after {self.length}")
        allowed = torch.zeros(n, self.cache_len, dtype=torch.bool, device=self.device)
        allowed[:, :self.length] = True
        allowed[:, self.length:self.length + n] = block
        mask = additive_mask(allowed, self.dtype)  # [n, cache_len]
        state = self._state
        shape = (n, self.cache_len)
        args = (ids[None], pos[None], mask[None, None], self.cache)
        if padded_size(n) != n:
            return tuple(x[0] for x in state.eager(*args))  # beyond the compiled sizes
        settings = _compile_settings(self.device) if shape not in state.compiled_shapes else contextlib.nullcontext()
        # inside the compiled graph the plain F.linear runs (inductor packs the weights itself)
        with settings, kernels.plain_kernels(self.model, gqa=False):
            try:
                logits, hidden = state.compiled(*args)
            except Exception as e:
                if shape in state.compiled_shapes:
                    raise
                raise CompileError("torch.compile of the target failed (inductor needs a C++ compiler on CPU, "
                                   "triton on CUDA); run our loops without static_compile") from e
        state.compiled_shapes.add(shape)
        return logits[0], hidden[0]

    def prefill(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and last hidden states of the prompt (eager: prompts come in every length)."""
        self.reset()
        n = ids.shape[0]
        if n > self.cache_len:
            raise ValueError(f"prompt of {n} tokens is longer than the static cache ({self.cache_len})")
        logits, hidden = self._state.eager(ids[None], torch.arange(n, device=self.device)[None], None, self.cache)
        self.length = n
        return logits[0], hidden[0]

    def step(self, token: int) -> torch.Tensor:
        ids = torch.tensor([token], device=self.device)
        logits, _ = self._run(ids, torch.tensor([self.length], device=self.device),
                              torch.ones(1, 1, dtype=torch.bool, device=self.device))
        self.length += 1
        return logits[0]

    def tree(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """Score every node of ``tree`` in one forward, padded to a compiled size; returns its m rows."""
        m = len(tree)
        n = padded_size(m) or m
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        ids[:m] = tree.tokens.to(self.device)
        pos = torch.full((n,), self.length, dtype=torch.long, device=self.device)
        pos[:m] += tree.depths.to(self.device)
        block = torch.eye(n, dtype=torch.bool, device=self.device)
        block[:m, :m] = tree.ancestor_mask().to(self.device)
        logits, hidden = self._run(ids, pos, block)
        self.length += m
        if n != m:  # the padding rows moved the write position past the tree
            self._rewind(self.length)
        return logits[:m], hidden[:m]

    def keep(self, start: int, nodes: list[int]) -> None:
        """After a tree forward from ``start``: keep only ``nodes``' cache entries, moved to ``start..``."""
        idx = torch.tensor(nodes, dtype=torch.long, device=self.device) + start
        end = start + len(nodes)
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.keys[:, :, start:end] = layer.keys[:, :, idx]
                layer.values[:, :, start:end] = layer.values[:, :, idx]
        self.length = end
        self._rewind(end)
