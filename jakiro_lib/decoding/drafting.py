"""What a drafted tree and a lookup chain are made of: the draft steps a tree needs (:func:`draft_schedule`), a
frontier's children (:func:`candidate_tensors`, coupled or decoupled) and prompt lookup (:class:`PromptLookup`)."""
from __future__ import annotations

import torch

from ..config import TreeConfig
from ..models import kernels
from ..models.draft import DraftModel


def draft_schedule(draft: DraftModel, tree: TreeConfig, error: type[ValueError] = ValueError) -> list[int]:
    """Layers each draft step yields for ``tree`` (:func:`schedule`), after checking that ``draft`` can draft it
    (``error``: what a refusal raises). A tree of n tokens is at most n - 1 deep, so no deeper layer is drafted."""
    if tree.tuned:
        raise error("a tree with 'auto' settings must be resolved to numbers first (jakiro_lib.measure.budgets."
                    "resolve_tree_budgets or `python -m jakiro_lib costs --draft ...`)")
    if tree.decoupled and draft.cfg.num_experts < 2:
        raise error("decoupled candidates need a draft with at least 2 experts")
    if tree.ar_steps is not None and not draft.cfg.branch_b:
        raise error("CEPD (ar_steps) needs a draft trained with branch B")
    return schedule(min(tree.depth, tree.total_tokens - 1), tree.ar_steps, draft.cfg.branch_b)


def schedule(depth: int, ar_steps: int | None, has_branch_b: bool) -> list[int]:
    """Layers produced by each draft step (1: branch A only; 2: A and B). Step 0 uses the root's output."""
    steps, done = [], 0
    s = depth if ar_steps is None or not has_branch_b else ar_steps
    while done < depth:
        steps.append(2 if done >= s and depth - done >= 2 else 1)
        done += steps[-1]
    return steps


class PromptLookup:
    """Prompt-lookup proposals over the growing token history (Saxena 2023; HF ``prompt_lookup_num_tokens``): the tokens
    that followed the latest earlier occurrence of the last ``max_ngram`` .. ``min_ngram`` tokens, longest first
    (docs/DESIGN.md section 11), repeated with the match's period where they run into the present. An n-gram index
    updated as tokens arrive makes each lookup O(max_ngram)."""

    def __init__(self, num_tokens: int, *, max_ngram: int = 3, min_ngram: int = 2) -> None:
        if num_tokens < 1 or not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs num_tokens >= 1 and 1 <= min_ngram <= max_ngram, got "
                             f"{num_tokens}, {min_ngram}..{max_ngram}")
        self.num_tokens, self.max_ngram, self.min_ngram = num_tokens, max_ngram, min_ngram
        self.history: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> position right after its latest occurrence

    def reset(self, tokens: list[int]) -> None:
        self.history, self._after = [], {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        h = self.history
        for t in tokens:
            # the n-grams ending at the current last token get a continuation now: index them
            for n in range(self.min_ngram, min(self.max_ngram, len(h)) + 1):
                self._after[tuple(h[len(h) - n:])] = len(h)
            h.append(t)

    def propose(self) -> list[int]:
        """Up to ``num_tokens`` tokens expected after the history; empty when no n-gram recurs."""
        h = self.history
        for n in range(min(self.max_ngram, len(h)), self.min_ngram - 1, -1):
            start = self._after.get(tuple(h[len(h) - n:]))
            if start is not None:
                period = len(h) - start
                return [h[start + i % period] for i in range(self.num_tokens)]
        return []


def candidate_tensors(draft: DraftModel, cfg: TreeConfig, a: torch.Tensor, experts: torch.Tensor | None,
                      gates: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Children of N frontier nodes from their branch-A outputs, in fixed shapes (no host sync): target ids and
    log-probs [N, K] (-inf: no such child), the feature each carries [N, K, H]. Coupled: the mixture's top K, carrying
    the node's feature; decoupled (``cfg.decoupled``, DESIGN section 3): the union of each selected expert's top
    children scored by ``cfg.scoring``, duplicates masked out, each carrying its strongest expert's feature."""
    K = cfg.top_k
    if not cfg.decoupled or experts is None:  # one row a node: the mixture's
        feats, weights, per_expert = a[:, None], None, K  # [N, 1, H]
    else:
        sel = gates.float().topk(min(draft.cfg.top_k_experts, draft.cfg.num_experts), dim=-1)  # [N, S]; 0: unselected
        feats = experts.gather(1, sel.indices[..., None].expand(-1, -1, experts.shape[-1]))  # [N, S, H]
        weights, per_expert = sel.values if cfg.scoring == "mixture" else None, cfg.children_per_expert or K
    ids, vals, rows = children(draft.logits(feats), weights, K, per_expert)  # [N, K] each
    return draft.to_target_ids(ids), vals, feats.gather(1, rows[..., None].expand(-1, -1, feats.shape[-1]))


def children(logits: torch.Tensor, weights: torch.Tensor | None, k: int,
             per_expert: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The k children of each of N nodes from their S rows of draft-vocabulary ``logits`` [N, S, V] (S = 1: coupled):
    the union of each row's top ``per_expert`` words by log-softmax, scored by logsumexp_s(logp_s + log(w_s / sum w))
    (``weights`` [N, S]) or else the best row's; a repeated word -inf; the k best: draft ids, scores, backing rows
    [N, k]. On a CPU one call of stream_gemm.cpp's ``draft_children`` (compiled too, once loaded), else torch's."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad and (
            kernels.STREAM_LOADED if torch.compiler.is_compiling() else kernels.stream_gemm_available()):
        return torch.ops.jakiro_stream_gemm.draft_children(logits, weights, k, per_expert)
    logp = logits.float().log_softmax(-1)  # [N, S, V]
    if logp.shape[1] == 1 and weights is None and per_expert >= k:  # coupled: the row's top k
        top = logp[:, 0].topk(k, dim=-1)
        return top.indices, top.values, torch.zeros_like(top.indices)
    union, _ = logp.topk(per_expert, dim=-1).indices.flatten(1).sort(-1)  # [N, C = S * per_expert], sorted
    C = union.shape[1]
    if C < k:  # fewer candidates than children asked for: the first word again, scored -inf below
        union = torch.cat([union, union[:, :1].expand(-1, k - C)], 1)
    weighted = logp.gather(2, union[:, None, :].expand(-1, logp.shape[1], -1))  # [N, S, C]: each row's log-prob
    if weights is not None:
        weighted = weighted + (weights / weights.sum(-1, keepdim=True)).log()[..., None]
        scores = weighted.logsumexp(1)
    else:
        scores = weighted.max(1).values
    repeat = torch.zeros_like(union, dtype=torch.bool)
    repeat[:, 1:] = union[:, 1:] == union[:, :-1]
    repeat[:, C:] = True
    best = scores.masked_fill(repeat, float("-inf")).topk(k, dim=-1)  # [N, k]; -inf: fewer distinct words than k
    return union.gather(1, best.indices), best.values, weighted.argmax(1).gather(1, best.indices)
