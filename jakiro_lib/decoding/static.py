"""The engine: every method of ours, plain or speculative, as one cycle of tensors (draft, verify, evaluate, update:
docs/DESIGN.md section 12). Captured, its shapes depend only on the tree settings; eager, they follow the text, the
tree and the chain."""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Callable

import torch
from transformers import PreTrainedModel

from .compiled import Capture, call_compiled, compiled_cache_len, compiled_step, cuda_graph
from ..models.target import capture_of, kept, plain_kernels
from ..config import TreeConfig
from .result import GenerationResult, append_tokens, check_prompt, choose_token, text_positions
from ..machine import synchronize
from ..models.draft import DraftModel
from ..models.draft_blocks import fixed_address
from .clock import Clock, step
from .drafting import PromptLookup
from .runner import MAX_TREE_ROOM, TargetRunner
from .verify import SamplingParams
from .static_tree import (StaticEngineError, StaticTreeDrafter, first_siblings, graft_chain, graft_chain_eager,
                          greedy_path, greedy_walk, root_step)


CACHE_STEP = 128  # eager engines round their cache lengths up to this (no compiled step binds to a length)
WINDOW_STEP = 256  # a static forward attends over the text in steps of this


def engine_cache_len(needed: int) -> int:
    """Positions of an eager engine's caches: ``needed`` rounded up to :data:`CACHE_STEP` (a compiled one takes
    one length per context: :func:`~jakiro_lib.decoding.compiled.compiled_cache_len`)."""
    return -(-needed // CACHE_STEP) * CACHE_STEP


def _runner(model: PreTrainedModel, cache_len: int, *, shared: bool) -> TargetRunner:
    """A runner of ``cache_len`` positions; ``shared``: over the model's one cache of that length (compiled steps
    bind to it, and a 7B target's is large)."""
    if not shared:
        return TargetRunner(model, cache_len)
    return TargetRunner(model, cache_len, share=kept(model, "static_runners", cache_len,
                                                     lambda: TargetRunner(model, cache_len)))


def graph_capture(model: PreTrainedModel) -> Capture | None:
    """How a compiled step of ``model`` is recorded as CUDA graphs of its eager kernels (a CUDA target with
    ``target.capture`` "graphs": :func:`~jakiro_lib.models.target.capture_of`); None where inductor compiles it."""
    return cuda_graph if model.device.type == "cuda" and capture_of(model) == "graphs" else None


def attention_window(length: int, capacity: int) -> int:
    """Positions a static forward reads after ``length`` written ones: the text and a tree's room past it, in
    whole :data:`WINDOW_STEP` s, at most ``capacity`` (docs/DESIGN.md section 12)."""
    return min(capacity, -(-(length + MAX_TREE_ROOM) // WINDOW_STEP) * WINDOW_STEP)


class StaticEngine:
    """A target, an optional draft and tree settings bound to buffers of ``cache_len`` positions; :meth:`cycle` is one
    draft-verify-evaluate-update step and returns what the host reads. ``draft`` None and no lookup chain: plain
    decoding. ``compile``: the cycle compiled or captured (:func:`~jakiro_lib.decoding.compiled.compiled_step`), its
    positions and a sampled cycle's draws passed as device tensors."""

    def __init__(self, model: PreTrainedModel, draft: DraftModel | None, tree: TreeConfig | None, cache_len: int, *,
                 params: SamplingParams = SamplingParams(), compile: bool = False, ranked: bool = False) -> None:
        self.model, self.draft, self.params, self.compile, self.ranked = model, draft, params, compile, ranked
        pooled = not compile and capture_of(model) == "draft"  # the draft's tree compiled inside an eager cycle
        self.drafter = None if draft is None else StaticTreeDrafter(draft, tree, cache_len, compiled=pooled)
        if draft is not None and (compile or pooled):  # the draft's head gathered and packed before a graph reads it
            draft.logits(torch.zeros(1, draft.target_config.hidden_size, dtype=self.drafter.dtype, device=model.device))
        L = tree.lookup_tokens if tree is not None else 0
        self.lookup = PromptLookup(L, max_ngram=tree.lookup_max_ngram, min_ngram=tree.lookup_min_ngram) if L else None
        drafted_m, drafted_depth = (1, 0) if self.drafter is None else (self.drafter.m, self.drafter.max_depth)
        self.m, self.max_depth = drafted_m + L, max(drafted_depth, L)  # the verified tree: drafted rows, then chain
        self.drafted_depth = drafted_depth
        self.caps = torch.arange(1, drafted_depth + 1, device=model.device)  # the depth caps of ranks read (ranked)
        # eager on a CPU: the path walked on the host (a GPU would wait on the walk); else padded to the deepest
        self.walked = not compile and model.device.type == "cpu"
        self.plain = draft is None and not L  # plain decoding: each cycle the last token alone
        if ranked and (draft is None or L):
            raise StaticEngineError("selection ranks are a drafted tree's: rank without a lookup chain")
        if self.m > MAX_TREE_ROOM:
            raise StaticEngineError(f"a tree of {self.m} tokens does not fit the {MAX_TREE_ROOM} positions kept past "
                                    "the text")
        # the root when there is no draft (the last token, written in place); the chain's count and tokens
        self.token = fixed_address(torch.zeros((), dtype=torch.long, device=model.device))
        self.one_row = fixed_address(torch.tensor([0, 1], device=model.device))  # a root-only read: 0 kept, 1 row
        self.chain = torch.zeros(L + 1, dtype=torch.long, device=model.device)
        self.target = _runner(model, cache_len, shared=compile)
        self.uniforms = torch.zeros(self.m, dtype=torch.float64, device=model.device)  # sampling: a draw a row
        self.inputs = (self.chain,) if L else ()  # the step's inputs after the uniforms, set by the host per cycle
        self.compiled_cycles = 0  # cycles run through the compiled step (tests check that it was used)
        # windows where a step costs nothing per window (eager, or recorded as CUDA graphs); inductor compiles one
        # step for the whole cache (a compilation per window would cost more than it saves)
        self.windowed = not compile or graph_capture(model) is not None
        # positions a cycle writes past the text: the verified tree, the draft's tree rows, the accepted path encoded
        self.room = max(self.m, self.max_depth + 1, 0 if self.drafter is None else self.drafter.n_slots)
        self.clock: Clock | None = None  # listens to an eager engine's steps (the cycle-cost table)
        self._accepted_path: tuple[torch.Tensor, torch.Tensor] | None = None  # eager: to encode after the read
        self._compiled: dict[int, Callable[..., torch.Tensor]] = {}  # window -> its compiled step

    def listen(self, clock: Clock | None) -> None:
        """``clock`` times and counts this engine's steps from now on (None: nobody). Eager engines only: a
        compiled step runs as one call."""
        if clock is not None and self.compile:
            raise ValueError("a compiled engine's cycle is one call: time it whole")
        self.clock = clock
        if self.drafter is not None:
            self.drafter.clock = clock

    def cycle(self, start: int | torch.Tensor, uniforms: torch.Tensor,
              chain: torch.Tensor | list[int] | None = None) -> torch.Tensor | list[int]:
        """The accepted count, the rows verified, with :attr:`ranked` the path's running maximum selection ranks per
        depth cap, then the accepted tokens and the bonus token: padded to the deepest path where the cycle is compiled
        or on a GPU ([D + 3], [D(D + 1) + 3] ranked), else the accepted path alone, a host list (the walk read the
        tree). Each row's token is chosen, its argmax or (sampling) its draw with its own of ``uniforms``, and the
        tree's path is verified against those (docs/DESIGN.md section 6); ``chain``: the lookup chain (compiled, a
        fixed buffer: :func:`~.static_tree.graft_chain`; eager, the host's list of its tokens)."""
        drafter, target, clock = self.drafter, self.target, self.clock
        if self.plain:
            return self._root_only(start, uniforms)
        with step(clock, "draft"):
            ranks = valid = None
            if drafter is not None:
                tokens, parents, depths, ranks, anc = drafter.propose(start)  # anc [m, m]
            else:  # the root alone, the chain grafted on it below
                tokens = self.token.reshape(1)
                parents = depths = torch.zeros(1, dtype=torch.long, device=tokens.device)
                anc = torch.ones(1, 1, dtype=torch.bool, device=tokens.device)
            if chain is not None and self.compile:  # the chain's rows all verified, those it did not need invalid
                tokens, parents, depths, anc, valid = graft_chain(tokens, parents, depths, anc, chain)
            elif chain is not None:  # eager: only the rows the chain needs
                draws = None if self.params.greedy else uniforms
                tokens, parents, depths, anc, uniforms = graft_chain_eager(tokens, parents, depths, anc, chain, draws)
        with step(clock, "verify"):  # [m] each row's token: its argmax, or its draw
            draw = None if self.params.greedy else (self.params, uniforms, not self.compile)
            chosen, hidden = target.score(tokens, depths, anc, start, greedy=True, draw=draw)
        with step(clock, "evaluate"):
            if self.walked:
                host_path, emitted = greedy_walk(tokens, parents, chosen)
                path, accepted = torch.tensor(host_path, device=tokens.device), len(host_path) - 1
            else:
                valid = valid if self.params.greedy else first_siblings(tokens, parents, valid)
                path, accepted, bonus = greedy_path(tokens, parents, depths, anc, chosen, self.max_depth, valid)
        with step(clock, "update"):  # the path's entries to start..; the next cycle writes after the accepted ones
            target.move_path(start, host_path) if self.walked else target.move(start, path)
            new = torch.tensor(emitted, device=tokens.device) if self.walked else torch.cat(  # [accepted + 1] or
                [tokens[path[1:]], bonus[None]]).scatter(0, accepted[None], bonus[None])  # [D + 1], bonus at `accepted`
            if drafter is not None and self.compile:
                drafter.extend(hidden[path], new, start, accepted)
            elif drafter is not None:  # eager: once the host has read how many were accepted (_advance)
                self._accepted_path = (hidden[path], new)
            else:
                self.token.copy_(new[-1] if self.walked else bonus)
        path_ranks = []
        if self.ranked:  # per path node and depth cap 1..D its rank among the drafted nodes no deeper, running max
            ahead = (ranks[None, :] < ranks[path[1:], None]) & (depths > 0)  # [P, m]: nodes scored above it
            path_ranks = [(ahead[:, None] & (depths <= self.caps[:, None])).sum(-1).cummax(0).values.flatten()]
        if self.walked:
            return [accepted, tokens.shape[0], *(path_ranks[0].tolist() if path_ranks else []), *emitted]
        return torch.cat([accepted[None], torch.full((1,), tokens.shape[0], dtype=torch.long, device=tokens.device),
                          *path_ranks, new])  # path_ranks: [P * D]

    def _root_only(self, start: int | torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """Plain decoding's cycle (and the last cycles, where no tree fits): [0, 1 row verified, the next token]."""
        root = self.token if self.drafter is None else self.drafter.root_token
        with step(self.clock, "verify"):  # eager plain decoding reads exactly the text and the root: no mask
            bonus = root_step(self.target, root, self.params, uniforms, start, masked=self.compile or not self.plain,
                              sync=not self.compile)
        return torch.cat([self.one_row, bonus.reshape(1)])

    def _set_window(self, length: int) -> int:
        """Positions the cycle's forwards (target and draft) read after ``length`` written ones: eager, the text and
        :attr:`room`; compiled, whole :func:`attention_window` s where windowed, else the whole cache."""
        capacity = self.target.capacity
        if not self.compile:
            window = min(capacity, length + self.room)
        else:
            window = attention_window(length, capacity) if self.windowed else capacity
        self.target.where.window = window
        if self.drafter is not None:
            self.drafter.cache.window = window
        return window

    def prepare(self, length: int) -> None:
        """Every attention window up to ``length`` positions recorded now (a compiled, windowed engine that has
        generated once), so that no timed generation records one; the next prefill rewrites what they wrote."""
        if not (self.compile and self.windowed) or (self.drafter is not None and self.drafter.root is None):
            return
        length = min(length, self.target.capacity - MAX_TREE_ROOM)
        start = torch.zeros((), dtype=torch.long, device=self.model.device)
        for text in (*range(0, length, WINDOW_STEP), length):  # a length in every window up to `length`'s
            start.fill_(text)
            window = self._set_window(text)
            while getattr(self._compiled.get(window), "replay", None) is None:  # its warm-up, then its recording
                self._run_step(start, text)

    def _run_step(self, start: torch.Tensor, length: int) -> torch.Tensor | list[int]:
        """The cycle from ``length`` written positions: eagerly with the host int, compiled with ``start`` (0-dim)."""
        if not self.compile:
            return self.cycle(length, self.uniforms, *self.inputs)
        window = self.target.window
        first = window not in self._compiled
        if first:
            self._compiled[window] = compiled_step(self.model, self.cycle, graph_capture(self.model))
        with plain_kernels(self.model, gqa=False):  # the target's plain GEMMs (inductor packs them)
            read = call_compiled(self._compiled[window], start, self.uniforms, *self.inputs,
                                 device=self.model.device, first=first)
        self.compiled_cycles += 1
        return read

    def _begin(self, ids: torch.Tensor, hidden: torch.Tensor, first: int) -> None:
        """After the prefill of ``ids`` [n], whose last position chose ``first``."""
        dev, n = ids.device, ids.shape[0]
        if self.drafter is not None:  # from position 0, its last row the root (host ints eagerly)
            at = (torch.zeros((), dtype=torch.long, device=dev), torch.full((), n - 1, device=dev)) if self.compile \
                else (0, n - 1)
            self.drafter.extend(hidden, torch.cat([ids[1:], torch.full((1,), first, device=dev)]), *at)
        else:
            self.token.fill_(first)
        if self.lookup is not None:
            self.lookup.reset(ids.tolist() + [first])  # once per prompt (a host read of the prompt)

    def _advance(self, start: torch.Tensor, length: int, room: int) -> tuple[list[int], int | None, list[int] | None]:
        """One cycle from ``length`` written positions with ``room`` left: the tokens it emits, the rows it verified
        (None: plain decoding) and, :attr:`ranked`, the path's running maximum ranks per depth cap (else None)."""
        whole = self.max_depth + 1 <= room
        if whole and self.lookup is not None:  # the chain: compiled, the count then the tokens padded; eager, a list
            chain = self.lookup.propose()
            if self.compile:
                self.chain.copy_(torch.tensor([len(chain), *chain, *[0] * (self.lookup.num_tokens - len(chain))]))
            else:
                self.inputs = (chain,)
        with step(self.clock, "cycle"):
            out = self._run_step(start, length) if whole else self._root_only(start if self.compile else length,
                                                                              self.uniforms)
        with step(self.clock, "read"):
            # the one host read (eager greedy: the walk's, done): [accepted, rows, ranks (ranked), the tokens]
            read = out if isinstance(out, list) else out.tolist()
        accepted = read[0]
        ranked = self.ranked and whole
        D = self.drafted_depth  # the depth caps of each path node's ranks
        n_ranks = (accepted if self.walked else self.max_depth) * D if ranked else 0
        emitted = read[2 + n_ranks:3 + n_ranks + accepted]
        if self._accepted_path is not None:  # eager: the draft encodes the accepted path and the bonus (no padding)
            (hidden, new), self._accepted_path = self._accepted_path, None
            with step(self.clock, "update"):
                self.drafter.extend(hidden[:accepted + 1], new[:accepted + 1], length, accepted)
        if self.lookup is not None:
            self.lookup.extend(emitted)
        if self.drafter is not None and whole:
            self.drafter.forwards += self.drafter.n_steps - 1
        ranks = [read[i:i + D] for i in range(2, 2 + D * accepted, D)] if ranked else None
        return emitted, None if self.plain else read[1], ranks

    def generate(self, prompt_ids: torch.Tensor, *, max_new_tokens: int, eos_token_ids: list[int] = (),
                 max_context: int, generator: torch.Generator | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """The prefill, then one cycle per :meth:`cycle` with one host read each."""
        dev = self.model.device
        result = GenerationResult(prompt_len=prompt_ids.numel(), output_ids=[])
        eos = set(eos_token_ids)
        forwards0 = 0 if self.drafter is None else self.drafter.forwards
        synchronize(dev)
        t0 = time.perf_counter()
        ids = prompt_ids.to(dev)
        with step(self.clock, "prefill"):
            logits, hidden = self.target.prefill(ids, last=True)  # [1, V]: the next token's
            first = choose_token(logits[-1], self.params, generator)
            length = ids.shape[0]
            self._set_window(length)
            self._begin(ids, hidden, first)
        start = torch.full((), length, device=dev)  # torch.full, not torch.tensor: a CPU value copied to a GPU syncs
        done = append_tokens(result, [first], eos, max_new_tokens, on_tokens)
        result.prefill_time = time.perf_counter() - t0
        while not done:
            if length + 1 > max_context:
                result.stop_reason = "context"
                break
            if not self.params.greedy:  # the cycle's draws
                torch.rand(self.uniforms.shape, generator=generator, dtype=torch.float64, device=dev, out=self.uniforms)
            if self.compile:  # a compiled cycle reads its position from the device (eager ones get the host int)
                start.fill_(length)
            self._set_window(length)
            emitted, tree_size, ranks = self._advance(start, length, max_context - length)
            length += len(emitted)
            if tree_size is not None:
                result.tree_sizes.append(tree_size)
            if ranks is not None:
                result.path_ranks.append(ranks)
            before = len(result.output_ids)
            done = append_tokens(result, emitted, eos, max_new_tokens, on_tokens)
            result.accepted.append(len(result.output_ids) - before)
        result.draft_forwards = 0 if self.drafter is None else self.drafter.forwards - forwards0
        synchronize(dev)
        result.wall_time = time.perf_counter() - t0
        return result


def _engine(model: PreTrainedModel, draft: DraftModel | None, tree: TreeConfig | None, cache_len: int,
            params: SamplingParams, compile: bool, ranked: bool) -> StaticEngine:
    """The engine for ``draft`` and ``tree``; a compiled one kept on the model (its step binds to its buffers)."""
    if not compile:
        return StaticEngine(model, draft, tree, cache_len, params=params, compile=False, ranked=ranked)
    tree_key = None if tree is None else json.dumps(dataclasses.asdict(tree), sort_keys=True)
    key = (id(draft), tree_key, params, cache_len, capture_of(model), ranked)  # the engine holds the draft: its id
    return kept(model, "engines", key,  # is not reused while the entry lives
                lambda: StaticEngine(model, draft, tree, cache_len, params=params, compile=True, ranked=ranked))


@torch.inference_mode()
def static_generate(model: PreTrainedModel, draft: DraftModel | None, tree: TreeConfig | None, prompt_ids: torch.Tensor,
                    *, max_new_tokens: int = 128, params: SamplingParams = SamplingParams(),
                    eos_token_ids: list[int] = (), max_context: int = 2048, generator: torch.Generator | None = None,
                    on_tokens: Callable[[list[int]], None] | None = None, compile: bool = False,
                    clock: Clock | None = None, ranked: bool = False) -> GenerationResult:
    """Speculative decoding on the static engine, one host read per cycle (``draft`` None and no lookup chain: plain
    decoding). ``generator``: on the model's device. ``compile``: the cycle compiled or captured (the first prompts
    of each length compile). ``clock``: times and counts the cycles' steps (eager only). ``ranked``: each cycle's
    path ranks in ``path_ranks`` (the tree-budget tuner's; no lookup chain)."""
    check_prompt(prompt_ids, max_context, 1)
    needed = text_positions(prompt_ids, max_new_tokens, max_context) + MAX_TREE_ROOM  # room for a tree past the text
    cache_len = compiled_cache_len(max_context) if compile else engine_cache_len(needed)
    engine = _engine(model, draft, tree, cache_len, params, compile, ranked)
    engine.listen(clock)
    try:
        return engine.generate(prompt_ids, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                               max_context=max_context, generator=generator, on_tokens=on_tokens)
    finally:
        engine.listen(None)
