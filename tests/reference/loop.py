"""The loop engine: speculative decoding written plainly, node by node, with host positions (docs/DESIGN.md
section 12). The reference the engine is tested against (greedy identity, the sampling law), not on the runtime path.

The speculative cycle, in one function (:func:`speculative_generate`): the drafter proposes a tree rooted at the last
token; the target scores the whole tree in one forward (ancestor mask, position = prefix length + depth); verification
keeps the longest consistent path plus one bonus token; the target cache keeps only the accepted path's entries
(gathered, not recomputed) and the drafter is told what was kept.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from transformers import PreTrainedModel

from jakiro_lib.machine import synchronize
from jakiro_lib.models.target import additive_mask
from jakiro_lib.decoding.result import GenerationResult, append_tokens, check_prompt, choose_token, text_positions
from jakiro_lib.decoding.runner import MAX_TREE_ROOM, TargetRunner
from jakiro_lib.decoding.verify import SamplingParams
from .drafting import Drafter
from .tree import Tree
from .verify import verify


class LoopRunner(TargetRunner):
    """The target runner with its write position on the host: a token, a tree after the written positions, and
    keeping an accepted path (attention reads the positions written so far)."""

    @property
    def length(self) -> int:
        """Positions that hold the text."""
        return self.where.length

    @length.setter
    def length(self, value: int) -> None:
        self.where.length = value

    def step(self, token: int) -> torch.Tensor:
        """Logits after one more token."""
        ids = torch.tensor([token], device=self.device)
        logits, _ = self._forward(ids, torch.tensor([self.length], device=self.device), None, self.length)
        self.length += 1
        return logits[0]

    def tree(self, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """Score every node of ``tree`` after the ``length`` written positions; each node sees the prefix and
        its ancestors (position = prefix length + depth)."""
        anc = tree.ancestor_mask().to(self.device)
        allowed = torch.cat([torch.ones(len(tree), self.length, dtype=torch.bool, device=self.device), anc], 1)
        start = self.length
        self.length += len(tree)
        return self._forward(tree.tokens.to(self.device), start + tree.depths.to(self.device),
                             additive_mask(allowed, self.dtype)[None, None], start)

    def keep(self, start: int, nodes: list[int]) -> None:
        """After a tree forward from ``start``: keep only ``nodes``' cache entries, moved to ``start..``."""
        idx = torch.tensor(nodes, dtype=torch.long, device=self.device)
        end = start + len(nodes)
        self.where.move(start + idx, torch.arange(start, end, device=self.device))
        self.length = end


def capped_path_ranks(tree: Tree, path: list[int], caps: int) -> list[list[int]]:
    """Per accepted node and depth cap c = 1..``caps``: the most drafted nodes of depth <= c scored above it or above
    one of its ancestors on the path (its running maximum rank in the tree cut at depth c)."""
    depths = tree.depths.tolist()
    rank = [[sum(1 for i in range(1, len(tree)) if depths[i] <= c and tree.ranks[i] < tree.ranks[n])
             for c in range(1, caps + 1)] for n in path[1:]]
    return [[max(r[c] for r in rank[:j + 1]) for c in range(caps)] for j in range(len(rank))]


@torch.inference_mode()
def vanilla_generate(model: PreTrainedModel, prompt_ids: torch.Tensor, *, max_new_tokens: int = 128,
                     params: SamplingParams = SamplingParams(), eos_token_ids: list[int] = (),
                     max_context: int = 2048, generator: torch.Generator | None = None,
                     on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Plain autoregressive decoding with the KV cache: the reference every method must match."""
    check_prompt(prompt_ids, max_context, 1)
    runner = LoopRunner(model, text_positions(prompt_ids, max_new_tokens, max_context))
    result = GenerationResult(prompt_len=prompt_ids.numel(), output_ids=[])
    synchronize(runner.device)
    t0 = time.perf_counter()
    logits, _ = runner.prefill(prompt_ids.to(runner.device), last=True)  # the next token's logits, as the engine's
    token = choose_token(logits[-1], params, generator)
    result.prefill_time = time.perf_counter() - t0
    eos = set(eos_token_ids)
    done = append_tokens(result, [token], eos, max_new_tokens, on_tokens)
    while not done:
        if runner.length + 1 > max_context:
            result.stop_reason = "context"
            break
        token = choose_token(runner.step(token), params, generator)
        result.accepted.append(1)
        done = append_tokens(result, [token], eos, max_new_tokens, on_tokens)
    synchronize(runner.device)
    result.wall_time = time.perf_counter() - t0
    return result


@torch.inference_mode()
def speculative_generate(model: PreTrainedModel, drafter: Drafter, prompt_ids: torch.Tensor, *,
                         max_new_tokens: int = 128, params: SamplingParams = SamplingParams(),
                         eos_token_ids: list[int] = (), max_context: int = 2048,
                         generator: torch.Generator | None = None,
                         on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Draft a tree, verify it in one target forward, keep the accepted path; repeat."""
    check_prompt(prompt_ids, max_context, 1)
    runner = LoopRunner(model, text_positions(prompt_ids, max_new_tokens, max_context) + MAX_TREE_ROOM)
    result = GenerationResult(prompt_len=prompt_ids.numel(), output_ids=[])
    eos = set(eos_token_ids)
    dev = runner.device
    synchronize(dev)
    t0 = time.perf_counter()
    prompt_ids = prompt_ids.to(dev)
    logits, hidden = runner.prefill(prompt_ids, last=True)
    root = choose_token(logits[-1], params, generator)
    drafter.begin(prompt_ids, hidden, root)
    synchronize(dev)
    result.prefill_time = time.perf_counter() - t0
    done = append_tokens(result, [root], eos, max_new_tokens, on_tokens)
    forwards0 = getattr(getattr(drafter, "stats", None), "forwards", 0)
    while not done:
        tree = drafter.propose()
        room = max_context - runner.length
        if room < 1:
            result.stop_reason = "context"
            break
        if int(tree.depths.max()) + 1 > room:  # near the end of the context: keep the best path that fits
            best = [0]
            while tree.children[best[-1]] and len(best) < room:
                best.append(tree.children[best[-1]][0])
            tree = Tree.chain(tree.tokens[best].tolist())
        start = runner.length
        logits, hidden = runner.tree(tree)
        path, bonus = verify(tree, logits, params, generator)
        runner.keep(start, path)
        new = tree.tokens[path[1:]].tolist() + [bonus]
        result.tree_sizes.append(len(tree))
        if tree.ranks:  # the drafter's depth caps, as the static engine reads them
            caps = min(sum(drafter.steps), len(tree) - 1) if hasattr(drafter, "steps") else int(tree.depths.max())
            result.path_ranks.append(capped_path_ranks(tree, path, caps))
        emitted = len(result.output_ids)
        done = append_tokens(result, new, eos, max_new_tokens, on_tokens)
        result.accepted.append(len(result.output_ids) - emitted)  # EOS or the budget may cut ``new`` short
        if not done:
            drafter.accept(hidden[path], new)
    result.draft_forwards = getattr(getattr(drafter, "stats", None), "forwards", 0) - forwards0
    synchronize(dev)
    result.wall_time = time.perf_counter() - t0
    return result
