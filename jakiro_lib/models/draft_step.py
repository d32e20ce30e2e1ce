"""A draft's decoding step in two calls of the package's kernels (``stream_gemm.cpp``'s ``draft_qkv`` and
``draft_mix``), the cache written between them, or, over the engine's own cache, in one (``draft_step``: the embedding
and RoPE's rows too): the operators of :meth:`~jakiro_lib.models.draft.DraftModel._step` in the same order, the
attention by the few-row kernel instead of SDPA, without the interpreter and dispatch that took most of a step of a
few rows (docs/DESIGN.md section 12)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


STEP_PANELS = "_jakiro_step_panels"  # the packed GEMM the panels were read from, and the panels (or None)


def step_panels(draft: nn.Module, head_sizes: tuple[int, ...]) -> dict[str, Any] | None:
    """What the two calls run ``draft``'s step with: the packed copies of its linears, their widths and the block's
    settings; None where a linear is not on the streaming GEMM (fp32 or bf16 panels), a projection other than ``fc``
    has a bias, the experts are not SwiGLU, the head size is not among the attention kernel's ``head_sizes`` or the
    norm is not fp32. Cached with the packed GEMM it is read from (kernels.PackedGemm, which marks every linear of the
    draft with itself)."""
    gemm = getattr(draft.fc, "_jakiro_gemm", None)
    cached = draft.__dict__.get(STEP_PANELS)
    if cached is not None and cached[0] is gemm:
        return cached[1]
    attn, mlp, norm = draft.attn, draft.mlp, draft.post_attention_layernorm
    experts = [x for e in mlp.experts for x in (getattr(e, "gate_proj", None), getattr(e, "up_proj", None),
                                                getattr(e, "down_proj", None))]
    linears = [draft.fc, attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, *experts]
    router = mlp.router
    packed = linears + ([router] if router is not None else [])
    fits = (gemm is not None and gemm.streams and draft.cfg.expert_mlp == "swiglu"
            and all(x is not None and getattr(x, "_jakiro_gemm", None) is gemm for x in packed)
            and all(x.bias is None for x in packed[1:])
            and attn.head_dim in head_sizes and norm.weight.dtype == torch.float32)
    panels = None
    if fits:
        panels = {
            "qkv": (draft.fc._jakiro_packed, draft.fc.bias, attn.q_proj._jakiro_packed, attn.k_proj._jakiro_packed,
                    attn.v_proj._jakiro_packed),
            "qkv_outs": [draft.fc.out_features, attn.q_proj.out_features, attn.k_proj.out_features,
                         attn.v_proj.out_features],
            "o": attn.o_proj._jakiro_packed, "router": None if router is None else router._jakiro_packed,
            "experts": [x._jakiro_packed for x in experts],
            "mix_outs": [attn.o_proj.out_features, experts[0].out_features, experts[1].out_features,
                         experts[2].out_features, 0 if router is None else router.out_features],
            "branch": 0 if not draft.cfg.branch_b else 2 if draft.cfg.contrastive else 1,
        }
    draft.__dict__[STEP_PANELS] = (gemm, panels)
    return panels


def _serving(draft: nn.Module, x: torch.Tensor, n: int, masked: bool, kernel_rows: int,
             head_sizes: tuple[int, ...]) -> dict[str, Any] | None:
    """The panels the kernel calls run ``draft``'s step of ``n`` rows of ``x`` (its input, for dtype and device) with,
    or None where they do not serve: more rows than the attention kernel takes, several rows without a mask (causal),
    autograd, another device or dtype, a training-time forward, a draft whose step does not fit (:func:`step_panels`)
    or rows outside its packed GEMM's range."""
    if (n > kernel_rows or (not masked and n > 1) or x.dtype != torch.float32 or x.device.type != "cpu"
            or draft.training or draft.mlp.count_load or (torch.is_grad_enabled() and draft.fc.weight.requires_grad)):
        return None
    panels = step_panels(draft, head_sizes)
    gemm = draft.fc._jakiro_gemm if panels is not None else None  # the packed GEMM step_panels read the panels from
    return panels if gemm is not None and gemm.active and gemm.min_rows <= n <= gemm.max_rows else None


def fused_step(draft: nn.Module, x: torch.Tensor, position_ids: torch.Tensor, cache: Any, mask: torch.Tensor | None,
               kernel_rows: int, head_sizes: tuple[int, ...]) -> tuple[torch.Tensor | None, ...] | None:
    """The step of ``x`` [1, n, 2H] (the embedding and the features) at ``position_ids`` [1, n] through the two
    kernel calls, ``cache`` appended between them: a DraftOutput's a, b (None without branch B), experts and gates.
    ``kernel_rows`` and ``head_sizes``: what the attention kernel serves (models/fast_paths.py's). None where the
    calls do not serve (:func:`_serving`; a batch too). A compiled tree calls them too, two extern calls in inductor's
    graph."""
    panels = None if x.shape[0] != 1 else _serving(draft, x, x.shape[1], mask is not None, kernel_rows, head_sizes)
    if panels is None:
        return None
    ops, attn, norm = torch.ops.jakiro_stream_gemm, draft.attn, draft.post_attention_layernorm
    cos, sin = draft.rotary(x, position_ids)  # [1, n, D]
    z, q, k, v = ops.draft_qkv(x, *panels["qkv"], panels["qkv_outs"], attn.head_dim, cos[:, None], sin[:, None])
    if cache is not None:
        k, v = cache.append(k, v)
    a, b, experts, gates = ops.draft_mix(z, q, k, v, mask, attn.head_dim ** -0.5, panels["o"], norm.weight,
                                         norm.variance_epsilon, panels["router"], panels["experts"],
                                         panels["mix_outs"], draft.cfg.top_k_experts, panels["branch"])
    return a, b if panels["branch"] else None, experts, gates


ROPE_TABLES = "_jakiro_rope_tables"  # the draft attribute caching rope_tables' cos and sin


def rope_tables(draft: nn.Module, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's RoPE cos and sin [T >= length, D] at positions 0..T-1: its rotary's, row for row the values it gives
    a step of a few rows (elementwise operators; tested), computed once per draft and longest length asked."""
    tables = draft.__dict__.get(ROPE_TABLES)
    if tables is None or tables[0].shape[0] < length:
        fc = draft.fc.weight
        pos = torch.arange(length, device=fc.device)[None]
        cos, sin = draft.rotary(torch.empty(0, dtype=torch.float32, device=fc.device), pos)  # [1, T, D]
        tables = draft.__dict__[ROPE_TABLES] = (cos[0], sin[0])
    return tables


def one_call(draft: nn.Module, features: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, cache: Any,
             allowed: torch.Tensor, kernel_rows: int,
             head_sizes: tuple[int, ...]) -> tuple[torch.Tensor | None, ...] | None:
    """The step of ``features`` [n, H] and ``ids`` [n] at ``pos`` [n] over the engine's draft cache (its ``k``, ``v``
    [1, KV heads, capacity, D], written at its ``slots``, read over its ``window``) under ``allowed`` [n, window], in
    one kernel call (``draft_step``): what :func:`fused_step` and the Python around it compute, the embedding and the
    rotary included, without the interpreter between them. A, b (None without branch B), experts and gates without the
    batch dimension; None where the kernel calls do not serve (:func:`_serving`) or the cache has no buffers yet."""
    shared = _engine_step_args(draft, features, features.shape[0], cache, kernel_rows, head_sizes)
    if shared is None:
        return None
    a, b, experts, gates = torch.ops.jakiro_stream_gemm.draft_step(ids, features, pos, cache.slots,
                                                                   allowed[None, None], *shared)
    return a, b if shared[-1] else None, experts, gates


def _engine_step_args(draft: nn.Module, x: torch.Tensor, n: int, cache: Any, kernel_rows: int,
                      head_sizes: tuple[int, ...]) -> tuple[Any, ...] | None:
    """``draft_step``'s arguments after the rows' own (ids, features, positions, slots, mask) for ``draft``'s step of
    ``n`` rows like ``x`` over the engine's cache (``draft_tree`` takes them too); None where the kernel calls do not
    serve (:func:`_serving`), the cache has no buffers yet, a graph is being compiled, or the embedding or the rotary is
    not a table of fixed values."""
    if (cache.k is None or torch.compiler.is_compiling() or type(draft.embed) is not nn.Embedding
            or "dynamic" in draft.rotary.rope_type or draft.rotary.rope_type == "longrope"):
        return None
    panels = _serving(draft, x, n, True, kernel_rows, head_sizes)
    if panels is None:
        return None
    attn, norm = draft.attn, draft.post_attention_layernorm
    return (draft.embed.weight, *rope_tables(draft, cache.capacity), *panels["qkv"], panels["qkv_outs"],
            attn.head_dim, cache.k, cache.v, cache.window, attn.head_dim ** -0.5, panels["o"], norm.weight,
            norm.variance_epsilon, panels["router"], panels["experts"], panels["mix_outs"], draft.cfg.top_k_experts,
            panels["branch"])


def engine_step(draft: nn.Module, features: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, cache: Any,
                allowed: torch.Tensor, kernel_rows: int,
                head_sizes: tuple[int, ...]) -> tuple[torch.Tensor | None, ...]:
    """The engine's draft step of ``features`` [n, H] and ``ids`` [n] at ``pos`` [n] over its cache under ``allowed``
    [n, window]: in one call where it serves (:func:`one_call`), else the draft's forward. A, b (None without branch
    B), experts and gates without the batch dimension."""
    one = one_call(draft, features, ids, pos, cache, allowed, kernel_rows, head_sizes)
    if one is not None:
        return one
    out = draft(features[None], ids[None], pos[None], cache, allowed[None, None])
    return tuple(None if x is None else x[0] for x in (out.a, out.b, out.experts, out.gates))


def one_tree(drafter: Any, base: int, kernel_rows: int,
             head_sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...] | None:
    """The eager engine's tree (``drafter``: decoding/static_tree.py's StaticTreeDrafter, its draft, tree settings,
    root and cache) drafted after ``base`` cached positions in one kernel call (``draft_tree``): the pool of its
    ``_pool_candidates``, the draft steps as :func:`one_call`'s, the head's int8 copy, the children of
    ``draft_children``, then ``select_tree``'s choice, without the interpreter between them. Returns tokens, parents,
    depths, ranks [m] and the ancestor mask [m, m], the drafter's clock told the time of the draft steps inside; None
    where a step of the tree's width is not served in one call or the head has no int8 copy."""
    draft, tree, root = drafter.draft, drafter.cfg, drafter.root
    head = draft.int8_head() if root.experts is not None else None
    shared = None if head is None else _engine_step_args(draft, root.a, tree.top_k, drafter.cache, kernel_rows,
                                                         head_sizes)
    if shared is None:
        return None
    cfg, empty = draft.cfg, root.a.new_empty(0)
    *out, ns = torch.ops.jakiro_stream_gemm.draft_tree(
        root.a, empty if root.b is None else root.b, root.experts, root.gates, drafter.root_token, *head,
        empty.long() if draft.d2t is None else draft.d2t, drafter.steps, tree.top_k, drafter.m, tree.decoupled,
        min(cfg.top_k_experts, cfg.num_experts), tree.scoring == "mixture", tree.children_per_expert or tree.top_k,
        base, *shared)
    if drafter.clock is not None:
        drafter.clock.credit("draft_forward", ns * 1e-9, drafter.n_steps - 1)
    return tuple(out)
