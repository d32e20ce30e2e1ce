"""The loop engine's drafters (the reference, docs/DESIGN.md section 12): each proposes a :class:`Tree` of Python
nodes every cycle through one small protocol (``begin`` sees the prompt and the target's features of it,
``propose`` returns the tree rooted at the last token, ``accept`` is told what the target kept).

:class:`FeatureDrafter` is EAGLE-2 with Jakiro's two inference ideas (docs/DESIGN.md section 3): decoupled candidates
(each selected expert proposes children from its own distribution, carrying its own feature) and CEPD (after
``ar_steps`` autoregressive layers, each draft forward yields two layers: branch A the next one, branch B the one
after, gathered by each node's real parent). :class:`LookupDrafter` grafts a prompt-lookup chain onto its tree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from jakiro_lib.config import TreeConfig
from jakiro_lib.models.draft import DraftModel, DraftOutput, KVCache
from jakiro_lib.decoding.drafting import PromptLookup, candidate_tensors, draft_schedule
from .tree import CandidatePool, Tree


class Drafter(Protocol):
    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor, root: int) -> None: ...

    def propose(self) -> Tree: ...

    def accept(self, hidden: torch.Tensor, new_tokens: list[int]) -> None: ...


@dataclass
class DraftStats:
    forwards: int = 0  # draft forwards spent inside tree drafting (the update forward excluded)
    cycles: int = 0


@dataclass
class _Node:
    """A pool node that may be expanded: the feature it feeds the draft and where its KV sits."""

    pool_index: int
    feature: torch.Tensor  # [H], the predicted feature of the position before this token
    out: DraftOutput | None = None  # set once forwarded
    slot: int | None = None  # index of its key/value among the tree entries in the draft cache
    ancestors: list[int] = field(default_factory=list)  # slots of forwarded ancestors


class FeatureDrafter:
    """EAGLE-2 dynamic tree over an EAGLE/Jakiro feature draft."""

    def __init__(self, draft: DraftModel, tree: TreeConfig) -> None:
        self.draft = draft
        self.cfg = tree
        self.steps = draft_schedule(draft, tree)
        self.stats = DraftStats()
        self.cache = KVCache()
        self.root_out: DraftOutput | None = None
        self.root = 0
        self.pos = 0  # draft cache length, kept equal to the target cache length

    # -- protocol -----------------------------------------------------------------------------------
    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor, root: int) -> None:
        self.cache = KVCache()
        self.pos = 0
        self._extend(hidden, torch.cat([prompt_ids[1:], prompt_ids.new_tensor([root])]))
        self.root = root

    def accept(self, hidden: torch.Tensor, new_tokens: list[int]) -> None:
        self._extend(hidden, torch.tensor(new_tokens, device=hidden.device))
        self.root = new_tokens[-1]

    def rewind(self, length: int) -> None:
        """Forget accepted positions after ``length`` (the last root output is kept): lets a timing loop
        draft from the same context every cycle."""
        if not 0 < length <= self.pos:
            raise ValueError(f"can rewind to 1..{self.pos} positions, not {length}")
        self.cache.crop(length)
        self.pos = length

    def propose(self) -> Tree:
        cfg = self.cfg
        assert self.root_out is not None, "begin() must run before propose()"
        pool = CandidatePool.with_root(self.root)
        self._pool = pool
        frontier = [_Node(0, self.root_out.a, out=self.root_out)]
        base, n_slots = self.pos, 0
        for k, n_layers in enumerate(self.steps):
            if k > 0:  # one draft forward for the whole frontier layer
                self._forward_layer(frontier, base, n_slots)
                n_slots += len(frontier)
                self.stats.forwards += 1
            parents = {node.pool_index: node for node in frontier}
            frontier = self._top(pool, self._expand_a(pool, frontier), cfg.top_k)
            if n_layers == 2:
                frontier = self._top(pool, self._expand_b(pool, frontier, parents), cfg.top_k)
        self.cache.crop(base)
        self.stats.cycles += 1
        return pool.select(cfg.total_tokens)

    # -- internals --------------------------------------------------------------------------------
    def _extend(self, hidden: torch.Tensor, tokens: torch.Tensor) -> None:
        """Encode accepted positions into the draft cache; keep the last output for the next tree."""
        n = tokens.shape[0]
        pos = torch.arange(self.pos, self.pos + n, device=hidden.device)
        mask = torch.ones(n, self.pos + n, dtype=torch.bool, device=hidden.device).tril(self.pos)
        dtype = next(self.draft.parameters()).dtype
        out = self.draft(hidden[None].to(dtype), tokens[None], pos[None], self.cache, mask[None, None])
        self.pos += n
        self.root_out = out.map(lambda x: x[0, n - 1])

    def _forward_layer(self, frontier: list[_Node], base: int, n_slots: int) -> None:
        n = len(frontier)
        dev = frontier[0].feature.device
        feats = torch.stack([node.feature for node in frontier])[None]
        tokens = torch.tensor([self._pool.tokens[node.pool_index] for node in frontier], device=dev)[None]
        depth = torch.tensor([self._pool.depths[node.pool_index] for node in frontier], device=dev)
        pos = (base - 1 + depth)[None]
        mask = torch.zeros(n, base + n_slots + n, dtype=torch.bool, device=dev)
        mask[:, :base] = True
        for r, node in enumerate(frontier):
            node.slot = n_slots + r
            for s in node.ancestors + [node.slot]:
                mask[r, base + s] = True
        out = self.draft(feats, tokens, pos, self.cache, mask[None, None])
        for r, node in enumerate(frontier):
            node.out = out.map(lambda x: x[0, r])

    def _candidates(self, outs: list[DraftOutput]) -> list[list[tuple[int, float, torch.Tensor]]]:
        """(target token, log-prob, feature it carries) for each node's children via branch A: one
        draft-vocabulary logits call for the whole frontier (:func:`candidate_tensors`)."""
        experts = None if outs[0].experts is None else torch.stack([o.experts for o in outs])
        gates = None if outs[0].gates is None else torch.stack([o.gates for o in outs])
        ids, vals, feats = candidate_tensors(self.draft, self.cfg, torch.stack([o.a for o in outs]), experts, gates)
        ids, vals = ids.tolist(), vals.tolist()
        return [[(t, v, f) for t, v, f in zip(ids[r], vals[r], feats[r].unbind(0)) if v > float("-inf")]
                for r in range(len(outs))]

    def _expand_a(self, pool: CandidatePool, frontier: list[_Node]) -> list[_Node]:
        children = []
        for node, cands in zip(frontier, self._candidates([node.out for node in frontier])):
            ancestors = node.ancestors + ([node.slot] if node.slot is not None else [])
            for token, logp, feat in cands:
                idx = pool.add(token, node.pool_index, pool.scores[node.pool_index] + logp)
                children.append(_Node(idx, feat, ancestors=ancestors))
        return children

    def _expand_b(self, pool: CandidatePool, layer: list[_Node], parents: dict[int, _Node]) -> list[_Node]:
        """Children of each node in ``layer`` from branch B of that node's real parent (two ahead).

        Rows are gathered by parent index (the reference pairs row r with the r-th node: a bug); one
        logits call covers every distinct parent.
        """
        owners = list(dict.fromkeys(pool.parents[node.pool_index] for node in layer))
        b_out = [parents[p].out.b for p in owners]
        logp = self.draft.logits(torch.stack(b_out)).float().log_softmax(-1)
        top = logp.topk(self.cfg.top_k, dim=-1)
        ids, vals = self.draft.to_target_ids(top.indices).tolist(), top.values.tolist()
        row_of = {p: r for r, p in enumerate(owners)}
        grand = []
        for node in layer:
            r = row_of[pool.parents[node.pool_index]]
            for token, lp in zip(ids[r], vals[r]):
                idx = pool.add(token, node.pool_index, pool.scores[node.pool_index] + lp)
                # The skipped token (node) is never forwarded: its child sees only the parent's ancestors.
                grand.append(_Node(idx, b_out[r], ancestors=node.ancestors))
        return grand

    @staticmethod
    def _top(pool: CandidatePool, nodes: list[_Node], k: int) -> list[_Node]:
        return sorted(nodes, key=lambda n: (-pool.scores[n.pool_index], n.pool_index))[:k]


class LookupDrafter:
    """A drafter whose tree also holds a prompt-lookup chain (see :class:`PromptLookup`).

    Without ``inner`` the tree is the chain alone: prompt lookup run by this engine (the control that
    tells what the feature draft adds to the chain).
    """

    def __init__(self, inner: FeatureDrafter | None, lookup: PromptLookup) -> None:
        self.inner = inner
        self.lookup = lookup
        self.grafted = 0  # tokens added by the lookup chain (not already in the draft's tree), all cycles
        self.root = 0  # the last generated token (the tree's root)
        self._stats = DraftStats()

    @property
    def stats(self) -> DraftStats:
        return self.inner.stats if self.inner is not None else self._stats

    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor, root: int) -> None:
        if self.inner is not None:
            self.inner.begin(prompt_ids, hidden, root)
        self.root = root
        self.lookup.reset(prompt_ids.tolist() + [root])

    def propose(self) -> Tree:
        tree = self.inner.propose() if self.inner is not None else Tree.chain([self.root])
        chain = self.lookup.propose()
        merged = tree.graft(chain) if chain else tree
        self.grafted += len(merged) - len(tree)
        return merged

    def accept(self, hidden: torch.Tensor, new_tokens: list[int]) -> None:
        self.lookup.extend(new_tokens)
        self.root = new_tokens[-1]
        if self.inner is not None:
            self.inner.accept(hidden, new_tokens)


def make_drafter(draft: DraftModel | None, tree: TreeConfig) -> FeatureDrafter | LookupDrafter:
    """The drafter ``tree`` asks for: the feature draft's tree, plus a lookup chain if ``lookup_tokens``;
    without a draft, the lookup chain alone."""
    if draft is None and not tree.lookup_tokens:
        raise ValueError("without a draft, only prompt lookup can propose tokens: set tree.lookup_tokens")
    drafter = FeatureDrafter(draft, tree) if draft is not None else None
    if not tree.lookup_tokens:
        return drafter
    return LookupDrafter(drafter, PromptLookup(tree.lookup_tokens, max_ngram=tree.lookup_max_ngram,
                                               min_ngram=tree.lookup_min_ngram))
