"""Sampling settings and what sampling draws with: the target's distribution after temperature, top-k and top-p
(:func:`warp_probs`), and one token by inverse CDF from one uniform draw (:func:`sample`, :func:`draw_rows`).
Verification itself, in tensors or walked on the host, is greedy verification of each row's chosen token, its argmax
or its draw: :func:`~jakiro_lib.decoding.static_tree.greedy_path`, :func:`~jakiro_lib.decoding.static_tree.greedy_walk`
(docs/DESIGN.md section 6)."""
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


def warp_probs(logits: torch.Tensor, params: SamplingParams, *, sync: bool = False) -> torch.Tensor:
    """Target distribution after temperature, then top-k, then top-p (the order HF applies them). Top-p keeps the
    smallest set of most probable tokens that reaches ``top_p``, and every token as probable as its least one (ties
    kept together, so the set does not depend on how a sort orders them). ``sync``: the caller may read the host."""
    logits = logits.float() if params.temperature == 1.0 else logits.float() / params.temperature  # x / 1 is x
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if params.top_p < 1.0:
        top = _most_probable(probs, params.top_p, sync)  # [..., k] descending, the set's tokens among them
        kept = (top.cumsum(-1) - top < params.top_p).sum(-1, keepdim=True)  # [..., 1]: mass before them < top_p
        probs = logits.masked_fill(probs < top.gather(-1, kept - 1), float("-inf")).softmax(-1)
    return probs


def _most_probable(probs: torch.Tensor, top_p: float, sync: bool) -> torch.Tensor:
    """Each row's largest probabilities, descending, at least those top-p keeps: with ``sync`` on a CPU the top k, k
    growing until each row's k-th is past the set (sorting 49k words costs ms there); else all, sorted."""
    if not sync or probs.device.type != "cpu":
        return probs.sort(dim=-1, descending=True).values
    k = 64
    while True:
        top = probs.topk(min(k, probs.shape[-1]), dim=-1).values
        if top.shape[-1] == probs.shape[-1] or bool(((top.cumsum(-1) - top)[..., -1] >= top_p).all()):
            return top
        k *= 8


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


def draw_rows(logits: torch.Tensor, params: SamplingParams, draws: torch.Tensor, *,
              sync: bool = False) -> torch.Tensor:
    """Each row's token [m] drawn from its target distribution (:func:`warp_probs` of ``logits`` [m, V]) by
    :func:`inverse_cdf` of its own uniform in ``draws`` [m]."""
    return inverse_cdf(warp_probs(logits, params, sync=sync), draws)


def inverse_cdf(probs: torch.Tensor, u: float | torch.Tensor) -> torch.Tensor:
    """The token (no host read) whose cumulative-probability interval holds ``u * total`` of ``probs`` [..., V], one
    per row (``u`` a float or [...]): zero-probability tokens own an empty interval, so they are never drawn; float64
    sums keep 49k small terms exact enough; ``u * total`` rounded up to the total gives the token at which the sum
    reaches its total (one with mass: the sum rises there), found by a second search rather than a pass over the
    vocabulary."""
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1:].contiguous()  # [..., 1]
    idx = torch.searchsorted(cdf, total * (u[..., None] if isinstance(u, torch.Tensor) else u), right=True)[..., 0]
    return torch.minimum(idx, torch.searchsorted(cdf, total)[..., 0])
