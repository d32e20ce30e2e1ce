"""The draft head's building blocks: its output, its KV cache, the SwiGLU experts and the MoE block (branches
A and B), self-attention with the target's head layout and RoPE, and the attention mask of unrolled steps.

:class:`~jakiro_lib.models.draft.DraftModel` assembles them (docs/DESIGN.md sections 2-3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..config import DraftConfig


@dataclass
class DraftOutput:
    a: torch.Tensor  # [B, L, H] branch A: gate-weighted mixture, predicts f_{t+1}
    b: torch.Tensor | None  # [B, L, H] branch B: predicts f_{t+2}
    experts: torch.Tensor | None  # [B, L, E, H] each expert's own feature r + e_i(u)
    gates: torch.Tensor | None  # [B, L, E] branch-A routing weights (zero outside the top-k)


class KVCache:
    """The draft's own key/value cache: plain tensors we crop and extend during tree drafting."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def crop(self, length: int) -> None:
        if self.k is not None:
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoEBlock(nn.Module):
    """E SwiGLU experts with a router split into branch A (top-k mixture) and branch B (CEPD)."""

    def __init__(self, hidden: int, cfg: DraftConfig, inter: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.experts = nn.ModuleList(SwiGLU(hidden, inter) for _ in range(cfg.num_experts))
        n_router = cfg.num_experts * (2 if cfg.branch_b else 1)
        self.router = nn.Linear(hidden, n_router, bias=False) if cfg.num_experts > 1 or cfg.branch_b else None
        self.register_buffer("load", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("load_tokens", torch.zeros(()), persistent=False)
        self.count_load = True  # off while DraftModel.unroll runs its later steps (router_load: step 0 only)

    def _topk_weights(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        gates = logits.softmax(-1)
        if k >= gates.shape[-1]:
            return gates
        top = gates.topk(k, dim=-1)
        weights = torch.zeros_like(gates).scatter(-1, top.indices, top.values)
        return weights / weights.sum(-1, keepdim=True)

    def forward(self, u: torch.Tensor, residual: torch.Tensor) -> DraftOutput:
        cfg = self.cfg
        outs = torch.stack([e(u) for e in self.experts], dim=-2)  # [B, L, E, H]
        E = cfg.num_experts
        if self.router is None:
            gates_a = torch.ones(*u.shape[:-1], 1, dtype=u.dtype, device=u.device)
            logits_b = None
        else:
            logits = self.router(u)
            gates_a = self._topk_weights(logits[..., :E], cfg.top_k_experts) if E > 1 else torch.ones_like(logits[..., :1])
            logits_b = logits[..., E:] if cfg.branch_b else None
        a = residual + (gates_a.unsqueeze(-1) * outs).sum(-2)
        b = None
        if logits_b is not None:
            gb = logits_b.softmax(-1)
            if cfg.contrastive:
                top = gb.topk(2, dim=-1)  # the higher- and lower-gated of the two leading experts
                hi = torch.gather(outs, -2, top.indices[..., :1, None].expand(*outs.shape[:-2], 1, outs.shape[-1]))
                lo = torch.gather(outs, -2, top.indices[..., 1:, None].expand(*outs.shape[:-2], 1, outs.shape[-1]))
                b = residual + top.values[..., :1] * hi.squeeze(-2) - top.values[..., 1:] * lo.squeeze(-2)
            else:
                wb = self._topk_weights(logits_b, cfg.top_k_experts) if E > 1 else gb
                b = residual + (wb.unsqueeze(-1) * outs).sum(-2)
        if not self.training and self.count_load:
            with torch.no_grad():
                self.load += (gates_a > 0).float().reshape(-1, E).sum(0)
                self.load_tokens += gates_a.reshape(-1, E).shape[0]
        return DraftOutput(a=a, b=b, experts=residual.unsqueeze(-2) + outs, gates=gates_a)


def mlp_width(cfg: DraftConfig, target_config: Any) -> int:
    """The experts' intermediate size: the target's hidden size (None), the target's own MLP width
    ("target": EAGLE-2's draft layer) or the configured number."""
    if cfg.intermediate_size is None:
        return target_config.hidden_size
    if cfg.intermediate_size == "target":
        return target_config.intermediate_size
    return int(cfg.intermediate_size)


def unroll_mask(L: int, j: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean attention mask [L, (j + 1) L] of unroll step j over the keys of steps 0..j (see
    :meth:`DraftModel.unroll`): step 0's keys at s <= t - j, step i's key at s = t - (j - i)."""
    t = torch.arange(L, device=device)[:, None]
    s = torch.arange(L, device=device)[None]
    return torch.cat([s <= t - j] + [s == t - (j - i) for i in range(1, j + 1)], 1)


class DraftAttention(nn.Module):
    """Self-attention with the target's head layout and RoPE; keys/values kept in a :class:`KVCache`."""

    def __init__(self, tcfg: Any) -> None:
        super().__init__()
        H = tcfg.hidden_size
        self.n_heads = tcfg.num_attention_heads
        self.n_kv = getattr(tcfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(tcfg, "head_dim", None) or H // self.n_heads
        bias = bool(getattr(tcfg, "attention_bias", False)) or tcfg.model_type == "qwen2"
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=False)

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *cos_sin)
        if cache is not None:
            k, v = cache.append(k, v)
        causal = mask is None and (cache is None or len(cache) == L)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and L > 1,
                                             enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))
