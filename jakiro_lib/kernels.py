"""CPU fast paths for the frozen target, used by every method alike (vanilla, HF, PLD, speculative).

Tree verification runs the target on a handful of rows (the tree's tokens). On a 2-core CPU two library
defaults make that needlessly expensive (measured in ``reports/<profile>/cost_model_target.csv``):

* MKL's plain sgemm switches to a slower kernel from 4 rows on, so T(4) jumps well above T(3). A weight
  pre-packed by MKL (``cblas_sgemm_pack``, the format inductor's CPU freezing uses) streams much better.
  :class:`PackedGemm` keeps one packed copy per ``nn.Linear`` and routes calls of ``min_rows..max_rows``
  rows to it (tree verification, prompt-lookup chains); one-token decoding and prefill stay on the plain
  kernel. One copy serves every row count in that range: measured on SmolLM2's shapes, a copy packed for
  ``max_rows`` is as fast at fewer rows as one packed for exactly that count (the large ``lm_head`` is
  slower above the count it was packed for, hence the pack is made for ``max_rows``).
* A bf16 target on a CPU with AMX (Sapphire Rapids and later) gets the same treatment through oneDNN: one
  copy reordered to oneDNN's blocked layout (the format inductor's bf16 CPU freezing uses) serves
  ``1..max_rows`` rows. Plain bf16 ``F.linear`` is slower than fp32 at one row; the reordered copy is
  faster than fp32 at 1-64 rows and nearly flat in them (SmolLM2, measured
  2026-11-22: T(1) 28 ms, T(16) 33 ms, against 34 and 56 ms in fp32). Its results equal plain bf16
  ``F.linear`` bit for bit (measured; tested up to rounding).
* transformers' SDPA path copies the KV cache once per layer (``repeat_kv``) whenever a custom mask is
  given, which every tree forward does. ``sdpa_gqa`` passes ``enable_gqa=True`` to torch's SDPA instead.

None changes the math: results agree with the plain path up to rounding (the plain sgemm itself rounds
differently for different row counts), so greedy identity holds as before and is tested (fp32).
"""
from __future__ import annotations

import types
from contextlib import contextmanager
from functools import lru_cache
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

GQA_ATTENTION = "sdpa_gqa"
_ATTR = "_jakiro_packed_gemm"


# Fewest rows worth the packed copy, per weight dtype (measured on SmolLM2's shapes): MKL's packed sgemm
# gains nothing below 4 rows; oneDNN's reordered bf16 weight already wins at one row.
MIN_ROWS = {torch.float32: 4, torch.bfloat16: 1}


def packed_gemm_available(model: nn.Module | torch.Tensor) -> bool:
    """Packing needs CPU weights: fp32 with an MKL build of torch, or bf16 with oneDNN."""
    p = model if isinstance(model, torch.Tensor) else next(model.parameters())
    if p.device.type != "cpu":
        return False
    if p.dtype == torch.float32:
        return bool(torch._C.has_mkl)
    if p.dtype == torch.bfloat16:
        return _onednn_bf16_packs()
    return False


@lru_cache(maxsize=1)
def _onednn_bf16_packs() -> bool:
    """Whether oneDNN can reorder a bf16 weight on THIS CPU: it needs AVX-512 (bw, vl, dq) or AVX-NE-CONVERT,
    so a build with oneDNN is not enough (on a 2-core AMD EPYC with AVX2 only, 2026-11-23, the reorder
    raised). Probed once on a tiny weight instead of guessed from flags."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor, max_rows: int) -> torch.Tensor:
    """A packed copy of a ``[out, in]`` weight for inputs of up to ``max_rows`` rows (MKL for fp32, oneDNN's
    blocked layout for bf16, which serves any row count)."""
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), max_rows)


def linear_maybe_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        packed: torch.Tensor | None, min_rows: int, max_rows: int) -> torch.Tensor:
    """``F.linear``, through the packed copy when there is one, the row count is in range and no gradient
    is needed (the MKL op has no backward)."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if packed is None or not min_rows <= rows <= max_rows or (x.requires_grad and torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    y = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), packed, weight, bias, rows)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _packed_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    gemm = self._jakiro_gemm
    packed = self._jakiro_packed if gemm.active else None
    return linear_maybe_packed(x, self.weight, self.bias, packed, gemm.min_rows, gemm.max_rows)


def _min_rows(model: nn.Module, min_rows: int | None) -> int:
    """``min_rows``, or :data:`MIN_ROWS` of the model's weight dtype when None."""
    return MIN_ROWS[next(model.parameters()).dtype] if min_rows is None else min_rows


class PackedGemm:
    """One packed copy of every ``nn.Linear`` weight of a model, used for ``min_rows..max_rows`` rows.

    ``min_rows`` defaults to :data:`MIN_ROWS` of the weights' dtype. The copies cost about the weights'
    memory once more; ``active = False`` routes everything to the plain kernel.
    """

    def __init__(self, model: nn.Module, *, max_rows: int = 64, min_rows: int | None = None) -> None:
        if not packed_gemm_available(model):
            raise ValueError("packed GEMM needs CPU weights: fp32 with an MKL build of torch, or bf16 with oneDNN")
        min_rows = _min_rows(model, min_rows)
        if not 1 <= min_rows <= max_rows:
            raise ValueError(f"PackedGemm needs 1 <= min_rows <= max_rows, got {min_rows}..{max_rows}")
        self.max_rows, self.min_rows = max_rows, min_rows
        self.active = True
        self.linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        with torch.no_grad():
            for lin in self.linears:
                lin._jakiro_packed = pack_weight(lin.weight, max_rows)
                lin._jakiro_gemm = self
                lin.forward = types.MethodType(_packed_linear_forward, lin)

    def remove(self) -> None:
        """Restore the plain ``nn.Linear.forward`` and free the packed copies."""
        for lin in self.linears:
            del lin._jakiro_packed, lin._jakiro_gemm, lin.forward
        self.linears = []


def enable_packed_gemm(model: nn.Module, *, max_rows: int = 64, min_rows: int | None = None) -> PackedGemm | None:
    """Attach a :class:`PackedGemm` to ``model`` (repacked if the row range changed); None where unavailable."""
    if not packed_gemm_available(model):
        return None
    existing = getattr(model, _ATTR, None)
    if existing is not None:
        if (existing.max_rows, existing.min_rows) == (max_rows, _min_rows(model, min_rows)):
            return existing
        disable_packed_gemm(model)
    gemm = PackedGemm(model, max_rows=max_rows, min_rows=min_rows)
    setattr(model, _ATTR, gemm)
    return gemm


def disable_packed_gemm(model: nn.Module) -> None:
    gemm = getattr(model, _ATTR, None)
    if gemm is not None:
        gemm.remove()
        delattr(model, _ATTR)


def packed_gemm(model: nn.Module) -> PackedGemm | None:
    return getattr(model, _ATTR, None)


@contextmanager
def plain_kernels(model: nn.Module, *, gqa: bool = True, packed: bool = True) -> Iterator[None]:
    """Run the block on the library defaults (to measure what each fast path buys)."""
    gemm = packed_gemm(model) if packed else None
    before = gemm.active if gemm is not None else False
    switch = gqa and model.config._attn_implementation == GQA_ATTENTION
    try:
        if gemm is not None:
            gemm.active = False
        if switch:
            model.set_attn_implementation("sdpa")
        yield
    finally:
        if switch:
            model.set_attn_implementation(GQA_ATTENTION)
        if gemm is not None:
            gemm.active = before


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
