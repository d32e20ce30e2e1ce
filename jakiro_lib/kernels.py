"""CPU fast paths for the frozen target, used by every method alike (vanilla, HF, PLD, speculative).

Tree verification runs the target on a handful of rows (the tree's tokens). On a 2-core CPU two library
defaults make that needlessly expensive (measured in ``reports/<profile>/cost_model_target.csv``):

* MKL's plain sgemm switches to a slower kernel from 4 rows on, so T(4) jumps well above T(3). A weight
  pre-packed by MKL (``cblas_sgemm_pack``, the format inductor's CPU freezing uses) for exactly that row
  count streams much better. :class:`PackedGemm` keeps such copies for a few row counts (the tree sizes in
  use) and routes a Linear call to them only when its row count matches; everything else (one-token
  decoding, prefill) stays on the plain kernel.
* transformers' SDPA path copies the KV cache once per layer (``repeat_kv``) whenever a custom mask is
  given, which every tree forward does. ``sdpa_gqa`` passes ``enable_gqa=True`` to torch's SDPA instead.

Neither changes the math: results agree with the plain path up to fp32 rounding (the plain sgemm itself
rounds differently for different row counts), so greedy identity holds as before and is tested.
"""
from __future__ import annotations

import types
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

GQA_ATTENTION = "sdpa_gqa"
_ATTR = "_jakiro_packed_gemm"


def packed_gemm_available(model: nn.Module) -> bool:
    """MKL packing needs an MKL build of torch, a CPU model and fp32 weights."""
    p = next(model.parameters())
    return bool(torch._C.has_mkl) and p.device.type == "cpu" and p.dtype == torch.float32


def _packed_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    packed = self._jakiro_packed.get(rows)
    if packed is None or (x.requires_grad and torch.is_grad_enabled()):  # the MKL op has no backward
        return F.linear(x, self.weight, self.bias)
    y = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), packed, self.weight, self.bias, rows)
    return y.reshape(*x.shape[:-1], y.shape[-1])


class PackedGemm:
    """MKL-packed copies of every ``nn.Linear`` weight of a model, one set per row count.

    ``ensure(rows)`` packs for that row count if it is worth it (``rows >= min_rows``, measured: below
    4 rows the plain kernel is as fast) and a slot is free (each set costs about twice the weights'
    memory; ``capacity`` bounds it). Sizes are never evicted behind the caller's back, so a timed run
    never pays for packing; ``release`` frees a set explicitly, and ``frozen`` stops new packing (runs
    whose tree sizes are not the ones that will be timed, such as the budget tuning's big trees).
    """

    def __init__(self, model: nn.Module, *, capacity: int = 4, min_rows: int = 4) -> None:
        if capacity < 1:
            raise ValueError(f"PackedGemm needs capacity >= 1, got {capacity}")
        if not packed_gemm_available(model):
            raise ValueError("MKL-packed GEMM needs an fp32 model on the CPU and a torch build with MKL")
        self.capacity = capacity
        self.min_rows = min_rows
        self.frozen = False
        self.linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        for lin in self.linears:
            lin._jakiro_packed = {}
            lin.forward = types.MethodType(_packed_linear_forward, lin)

    @property
    def sizes(self) -> list[int]:
        return sorted(self.linears[0]._jakiro_packed) if self.linears else []

    def ensure(self, rows: int) -> bool:
        """Pack for ``rows`` if useful and room is left; True when ``rows`` is served packed."""
        held = self.linears[0]._jakiro_packed if self.linears else {}
        if rows in held:
            return True
        if self.frozen or rows < self.min_rows or len(held) >= self.capacity:
            return False
        with torch.no_grad():
            for lin in self.linears:
                lin._jakiro_packed[rows] = torch.ops.mkl._mkl_reorder_linear_weight(lin.weight.detach(), rows)
        return True

    def release(self, rows: int) -> None:
        for lin in self.linears:
            lin._jakiro_packed.pop(rows, None)

    def remove(self) -> None:
        """Restore the plain ``nn.Linear.forward`` and free every packed copy."""
        for lin in self.linears:
            del lin._jakiro_packed
            del lin.forward
        self.linears = []


def enable_packed_gemm(model: nn.Module, *, capacity: int = 4, min_rows: int = 4) -> PackedGemm | None:
    """Attach a :class:`PackedGemm` to ``model`` (idempotent); None where packing is unavailable."""
    existing = getattr(model, _ATTR, None)
    if existing is not None:
        existing.capacity, existing.min_rows = capacity, min_rows
        return existing
    if not packed_gemm_available(model):
        return None
    gemm = PackedGemm(model, capacity=capacity, min_rows=min_rows)
    setattr(model, _ATTR, gemm)
    return gemm


def disable_packed_gemm(model: nn.Module) -> None:
    gemm = getattr(model, _ATTR, None)
    if gemm is not None:
        gemm.remove()
        delattr(model, _ATTR)


def packed_gemm(model: nn.Module) -> PackedGemm | None:
    return getattr(model, _ATTR, None)


def prepare_rows(model: nn.Module, rows: int) -> bool:
    """Called before a forward of ``rows`` tokens whose size recurs (a tree, a lookup chain)."""
    gemm = packed_gemm(model)
    return gemm.ensure(rows) if gemm is not None else False


@contextmanager
def packed_for(model: nn.Module, rows: int) -> Iterator[bool]:
    """Pack for ``rows`` for the duration of the block (timing T(n) as decoding would see it)."""
    gemm = packed_gemm(model)
    fresh = gemm is not None and rows not in gemm.sizes
    served = prepare_rows(model, rows)
    try:
        yield served
    finally:
        if fresh and served:
            gemm.release(rows)


@contextmanager
def packing_frozen(model: nn.Module) -> Iterator[None]:
    """No new packed sizes inside the block (sizes packed already keep serving)."""
    gemm = packed_gemm(model)
    before = gemm.frozen if gemm is not None else False
    if gemm is not None:
        gemm.frozen = True
    try:
        yield
    finally:
        if gemm is not None:
            gemm.frozen = before


@contextmanager
def plain_kernels(model: nn.Module, *, gqa: bool = True, packed: bool = True) -> Iterator[None]:
    """Run the block on the library defaults (to measure what each fast path buys)."""
    gemm = packed_gemm(model) if packed else None
    linears = gemm.linears if gemm is not None else []
    saved = [lin._jakiro_packed for lin in linears]
    switch = gqa and model.config._attn_implementation == GQA_ATTENTION
    try:
        for lin in linears:
            lin._jakiro_packed = {}
        if switch:
            model.set_attn_implementation("sdpa")
        with packing_frozen(model):
            yield
    finally:
        if switch:
            model.set_attn_implementation(GQA_ATTENTION)
        for lin, packs in zip(linears, saved):
            lin._jakiro_packed = packs


def _sdpa_gqa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with grouped KV heads handled by SDPA itself under any mask."""
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_len > 1 and attention_mask is None and causal
    if causal and key.shape[2] > q_len:  # empty static cache at prefill: SDPA's causal mask is top-left
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _register_gqa_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_ATTENTION, _sdpa_gqa)
    AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)


def use_gqa_attention(model: nn.Module) -> bool:
    """Switch an SDPA model on the CPU to :func:`_sdpa_gqa`; True when switched (or already)."""
    cfg = model.config
    if cfg._attn_implementation == GQA_ATTENTION:
        return True
    if cfg._attn_implementation != "sdpa" or next(model.parameters()).device.type != "cpu":
        return False  # on CUDA a masked GQA call would leave the flash kernels
    _register_gqa_attention()
    model.set_attn_implementation(GQA_ATTENTION)
    return cfg._attn_implementation == GQA_ATTENTION
