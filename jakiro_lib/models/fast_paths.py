"""The target's attention and RMSNorm fast paths (docs/DESIGN.md section 9); neither changes the math beyond rounding
(tested): ``sdpa_gqa`` (SDPA's own grouped KV heads, where transformers copies the cache per layer under a custom
mask) and :func:`use_fused_norm` (one ``rms_norm`` call where transformers' RMSNorm makes six: one kernel on CUDA)."""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

GQA_ATTENTION = "sdpa_gqa"
# transformers' RMSNorm of each supported family: weight * (x / rms(x)), the norm in fp32, eps variance_epsilon
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


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


def _fused_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm forward through torch's ``rms_norm``: the norm in fp32, then the weight in the
    input's dtype, as transformers rounds (fp32: one call, the weight inside). Equal to it bit for bit on the
    CPU (tested); on CUDA up to the fused reduction's rounding."""
    weight = self._parameters["weight"]  # not through nn.Module.__getattr__: 61 calls a SmolLM2 forward
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, self.variance_epsilon)
    return weight * F.rms_norm(x.float(), weight.shape, None, self.variance_epsilon).to(x.dtype)


def use_fused_norm(model: nn.Module) -> int:
    """Every transformers RMSNorm of ``model`` (:data:`RMS_NORMS`) run by :func:`_fused_norm_forward`; how many."""
    norms = [m for m in model.modules() if type(m).__name__ in RMS_NORMS and hasattr(m, "variance_epsilon")]
    for norm in norms:
        norm.forward = types.MethodType(_fused_norm_forward, norm)
    return len(norms)
