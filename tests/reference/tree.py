"""The loop engine's token trees (the reference): a :class:`Tree` of Python nodes, the candidate pool and EAGLE-2's
top-N selection over it (:class:`CandidatePool`).

Node 0 is the root (the last generated token, not yet in the target's cache); every other node has a
parent with a smaller index, so a tree is valid by construction and masks are built in one pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

GRAFTED_RANK = 1 << 30  # selection rank of grafted (not drafted) nodes: no draft budget would keep them


@dataclass
class Tree:
    tokens: torch.Tensor  # [m] long, tokens[0] = root
    parents: list[int]  # parents[0] = -1, parents[i] < i
    depths: torch.Tensor  # [m] long, root depth 0
    children: list[list[int]] = field(default_factory=list)  # per node, in proposal order (best first)
    ranks: list[int] = field(default_factory=list)  # per node, place in the draft's score order (root -1)

    def __post_init__(self) -> None:
        if not self.children:
            self.children = [[] for _ in self.parents]
            for i, p in enumerate(self.parents[1:], start=1):
                if not 0 <= p < i:
                    raise ValueError(f"node {i} has parent {p}: parents must precede children")
                self.children[p].append(i)

    def __len__(self) -> int:
        return len(self.parents)

    def ancestor_mask(self) -> torch.Tensor:
        """[m, m] bool: node i may attend to node j iff j is i or an ancestor of i."""
        m = len(self)
        mask = torch.zeros(m, m, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def path_to(self, node: int) -> list[int]:
        """Root-to-node indices (the retrieval index of a leaf)."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def leaves(self) -> list[int]:
        return [i for i, c in enumerate(self.children) if not c]

    def graft(self, chain: list[int]) -> "Tree":
        """This tree with ``chain`` (tokens following the root) merged in as one more root-to-leaf path.

        The chain follows existing nodes while their tokens agree and continues as new nodes (last among
        their siblings, ranked after every drafted node: the draft did not choose them); siblings stay
        distinct, so greedy and sampling verification treat the chain like any other candidate.
        """
        tokens, parents, depths = self.tokens.tolist(), list(self.parents), self.depths.tolist()
        node, i = 0, 0
        while i < len(chain):
            nxt = next((c for c in self.children[node] if tokens[c] == chain[i]), None)
            if nxt is None:
                break
            node, i = nxt, i + 1
        if i == len(chain):
            return self
        for t in chain[i:]:
            tokens.append(t)
            parents.append(node)
            depths.append(depths[node] + 1)
            node = len(tokens) - 1
        children = [list(c) for c in self.children] + [[] for _ in range(len(chain) - i)]
        for j in range(len(self), len(tokens)):
            children[parents[j]].append(j)
        ranks = self.ranks + [GRAFTED_RANK] * (len(chain) - i) if self.ranks else []
        return Tree(torch.tensor(tokens, dtype=torch.long), parents, torch.tensor(depths), children, ranks)

    @classmethod
    def chain(cls, tokens: list[int]) -> "Tree":
        """A single path (prompt lookup, oracle drafts): root followed by ``tokens[1:]``."""
        return cls(torch.tensor(tokens, dtype=torch.long), list(range(-1, len(tokens) - 1)),
                   torch.arange(len(tokens)))


@dataclass
class CandidatePool:
    """Every drafted candidate with its cumulative log-probability; index 0 is the root (score 0)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    @classmethod
    def with_root(cls, root_token: int) -> "CandidatePool":
        return cls([root_token], [-1], [0.0], [0])

    def add(self, token: int, parent: int, score: float) -> int:
        # A child never outscores its parent (log-probs <= 0), so the top-N below is always a tree.
        if not 0 <= parent < len(self.tokens):  # -1 would silently index the last node
            raise ValueError(f"parent {parent} is not a node of the pool (0..{len(self.tokens) - 1})")
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(min(score, self.scores[parent]))
        self.depths.append(self.depths[parent] + 1)
        return len(self.tokens) - 1

    def select(self, total_tokens: int) -> Tree:
        """EAGLE-2's final step: keep the best ``total_tokens - 1`` candidates plus the root.

        Ties go to the shallower, earlier node, so a kept node's parent is always kept too.
        """
        order = sorted(range(1, len(self.tokens)), key=lambda i: (-self.scores[i], self.depths[i], i))
        keep = sorted(order[: total_tokens - 1], key=lambda i: (self.depths[i], i))
        new_index = {0: 0}
        for i in keep:
            new_index[i] = len(new_index)
        parents = [-1]
        for i in keep:
            if self.parents[i] not in new_index:
                raise AssertionError("top-N selection dropped a parent; scores must be monotone")
            parents.append(new_index[self.parents[i]])
        nodes = [0] + keep
        rank = {i: r for r, i in enumerate(order)}
        tree = Tree(torch.tensor([self.tokens[i] for i in nodes], dtype=torch.long), parents,
                    torch.tensor([self.depths[i] for i in nodes], dtype=torch.long),
                    ranks=[-1] + [rank[i] for i in keep])
        # Children in best-first order: sampling verification tries the likeliest candidate first.
        for c in tree.children:
            c.sort(key=lambda j: (-self.scores[nodes[j]], j))
        return tree
