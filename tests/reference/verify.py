"""The loop engine's verification (the reference), node by node (docs/DESIGN.md section 6).

Greedy: follow children equal to the target's argmax. Sampling: candidates are deterministic, so at each node try the
children in order, accepting child x with probability p(x) under the current residual distribution; on rejection zero
p(x) and renormalise; if every child is rejected, sample the bonus token from the residual; at a leaf sample it from
the (warped) target distribution. The emitted sequence is distributed exactly as sampling from the target.
"""
from __future__ import annotations

import torch

from jakiro_lib.decoding.verify import SamplingParams, sample, uniform, warp_probs
from .tree import Tree


def verify_greedy(tree: Tree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest path whose tokens match the target argmax; returns (node path from root, bonus token)."""
    pred = logits.argmax(-1).tolist()
    tokens = tree.tokens.tolist()
    node = 0
    path = [0]
    while True:
        nxt = next((c for c in tree.children[node] if tokens[c] == pred[node]), None)
        if nxt is None:
            return path, pred[node]
        node = nxt
        path.append(node)


def verify_sampling(tree: Tree, logits: torch.Tensor, params: SamplingParams,
                    generator: torch.Generator | None) -> tuple[list[int], int]:
    """Lossless multi-candidate speculative sampling for deterministic drafts."""
    tokens = tree.tokens.tolist()
    node = 0
    path = [0]
    while True:
        probs = warp_probs(logits[node], params)
        accepted = None
        for c in tree.children[node]:
            x = tokens[c]
            px = float(probs[x])
            if px > 0 and uniform(generator) < px:
                accepted = c
                break
            probs[x] = 0.0
            total = float(probs.sum())
            if total <= 0:  # numerically exhausted: nothing left to sample from but what remains
                break
            probs /= total
        if accepted is None:
            return path, sample(probs, generator)
        node = accepted
        path.append(node)


def verify(tree: Tree, logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> tuple[list[int], int]:
    if params.greedy:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, params, generator)
