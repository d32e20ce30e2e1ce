"""Sampling settings and what sampling draws with: the target's distribution after temperature, top-k and top-p
(:func:`warp_probs`), and one token by inverse CDF from one uniform draw (:func:`sample`). Verification itself, in
tensors: :func:`~jakiro_lib.decoding.static_tree.greedy_path` and :func:`~jakiro_lib.decoding.static_tree.sampling_path`
(docs/DESIGN.md section 6).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off

    def __post_init__(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"bad sampling parameters {self}: need temperature >= 0, 0 < top_p <= 1, top_k >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution after temperature, then top-k, then top-p (the order HF applies them)."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from ``probs`` (non-negative, any positive total) by :func:`inverse_cdf` of one uniform draw, where
    ``torch.multinomial`` draws one per vocabulary entry (docs/DESIGN.md section 11)."""
    if not float(probs.sum()) > 0:
        raise ValueError("cannot sample from a distribution with no positive probability")
    return int(inverse_cdf(probs, uniform(generator)))


def uniform(generator: torch.Generator | None) -> float:
    """One U[0, 1) draw from ``generator`` on whatever device it lives (a CUDA generator draws on CUDA)."""
    device = generator.device if generator is not None else "cpu"
    return float(torch.rand((), generator=generator, dtype=torch.float64, device=device))


def inverse_cdf(probs: torch.Tensor, u: float | torch.Tensor) -> torch.Tensor:
    """The token (0-dim, no host read) whose cumulative-probability interval holds ``u * total`` of ``probs`` [V]:
    zero-probability tokens own an empty interval, so they are never drawn; float64 sums keep 49k small terms exact
    enough; ``u * total`` rounded up to the total gives the last token with any mass."""
    cdf = probs.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (cdf[-1] * u).reshape(1), right=True)[0]
    last = torch.where(probs > 0, torch.arange(probs.shape[-1], device=probs.device), -1).max()
    return torch.where(idx >= probs.shape[-1], last, idx)
