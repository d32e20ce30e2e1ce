"""The draft head's config-free building blocks (assembled by :mod:`jakiro_lib.models.draft`): its output
record, the soft cross-entropy, its KV caches (the reference loop's and the engine's preallocated one), the experts
(SwiGLU, or GELU as in Jakiro*'s heads), self-attention with the target's head layout and RoPE, and the attention mask
of unrolled steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DraftOutput:
    a: torch.Tensor  # [B, L, H] branch A: gate-weighted mixture, predicts f_{t+1}
    b: torch.Tensor | None  # [B, L, H] branch B: predicts f_{t+2}
    experts: torch.Tensor | None  # [B, L, E, H] each expert's own feature r + e_i(u)
    gates: torch.Tensor | None  # [B, L, E] branch-A routing weights (zero outside the top-k)

    def map(self, f: Callable[[torch.Tensor], torch.Tensor]) -> "DraftOutput":
        """``f`` applied to every output present (a row taken, a batch dimension added)."""
        return DraftOutput(*(None if x is None else f(x) for x in (self.a, self.b, self.experts, self.gates)))


class _SoftCrossEntropy(torch.autograd.Function):
    """Per-row -sum_v p_v log softmax(z)_v, with the gradient softmax(z) - p computed directly (valid because
    each row of ``p`` sums to 1): no [rows, vocabulary] product and negation to run backward through
    (docs/DESIGN.md section 4)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        log_q = logits.log_softmax(-1, dtype=torch.promote_types(logits.dtype, torch.float32))  # [..., V]
        p = p.to(log_q.dtype)
        ctx.save_for_backward(log_q, p)
        ctx.logits_dtype = logits.dtype
        return -torch.linalg.vecdot(p, log_q)  # [...]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        log_q, p = ctx.saved_tensors
        g = log_q.exp().sub_(p).mul_(grad.unsqueeze(-1))  # [..., V]
        return g.to(ctx.logits_dtype), None


def soft_cross_entropy(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """-sum_v p_v log softmax(logits)_v over the last dimension, in at least fp32; ``p`` (rows summing to 1) is a
    constant target: no gradient flows to it."""
    return _SoftCrossEntropy.apply(logits, p.detach())


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


def fixed_address(t: torch.Tensor) -> torch.Tensor:
    """``t``, marked as a buffer whose address never changes (a captured CUDA graph reads and writes it in place)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
    return t


class StaticKV:
    """The draft's key/value cache, one preallocated buffer of ``capacity`` positions: ``slots`` [L] (a device
    tensor, set before each forward) says where the forward's L rows are written; attention reads the first
    ``window`` positions (the engine's choice per cycle, as the target's) under the caller's mask."""

    def __init__(self, capacity: int) -> None:
        self.capacity = self.window = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.window

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            self.k = fixed_address(k.new_zeros(*k.shape[:2], self.capacity, k.shape[-1]))  # [B, n_kv, capacity, hd]
            self.v = fixed_address(v.new_zeros(*v.shape[:2], self.capacity, v.shape[-1]))
        self.k.index_copy_(2, self.slots, k)
        self.v.index_copy_(2, self.slots, v)
        return self.k[:, :, :self.window], self.v[:, :, :self.window]


class SwiGLU(nn.Module):
    """One expert (and the dense draft's MLP): down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.width = intermediate
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GeluMLP(nn.Module):
    """One expert of the Jakiro* heads (``DraftConfig.expert_mlp="gelu"``): proj(gelu(fc(x))), erf GELU."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.width = intermediate
        self.fc = nn.Linear(hidden, intermediate, bias=False)
        self.proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


EXPERT_MLPS: dict[str, type[nn.Module]] = {"swiglu": SwiGLU, "gelu": GeluMLP}  # DraftConfig.expert_mlp -> module


def unroll_mask(L: int, j: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean attention mask [L, (j + 1) L] of unroll step j over the keys of steps 0..j (see
    :meth:`DraftModel.unroll`): step 0's keys at s <= t - j, step i's key at s = t - (j - i)."""
    t = torch.arange(L, device=device)[:, None]
    s = torch.arange(L, device=device)[None]
    return torch.cat([s <= t - j] + [s == t - (j - i) for i in range(1, j + 1)], 1)


class DraftAttention(nn.Module):
    """Self-attention with the target's head layout and RoPE; keys/values kept in a :class:`KVCache`. ``rotate``:
    (q, k, cos, sin [B, L, D]) -> q and k rotated, as transformers' ``apply_rotary_pos_emb``."""

    def __init__(self, tcfg: Any, rotate: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> None:
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
        self.rotate = rotate

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = self.rotate(q, k, *cos_sin)
        if cache is not None:
            k, v = cache.append(k, v)
        causal = mask is None and (cache is None or len(cache) == L)
        grouped = self.n_kv != self.n_heads
        if grouped and mask is not None and q.device.type == "cuda":  # CUDA's fused kernels take a mask or grouped
            k, v = (x.repeat_interleave(self.n_heads // self.n_kv, 1) for x in (k, v))  # heads, not both (math's does)
            grouped = False
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and L > 1, enable_gqa=grouped)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))
