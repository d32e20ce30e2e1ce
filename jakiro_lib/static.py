"""Static-shape speculative decoding: fixed shapes, tensors on the device, one host read per cycle.

The loop of :mod:`jakiro_lib.decoding` builds each tree in Python (lists, dicts, a ``.tolist()`` per draft
step), which costs little on a CPU but stalls a GPU once per call. Here every step of a cycle is a
function of tensors whose shapes depend only on the tree settings (docs/DESIGN.md section 12):

1. **draft** (:meth:`StaticTreeDrafter.propose`): EAGLE-2's tree, K = ``top_k`` frontier nodes per layer,
   each forwarded into fixed slots of a preallocated draft cache, their K x K children scored
   (:func:`~jakiro_lib.drafting.candidate_tensors`, coupled or decoupled; under CEPD a forward also yields
   the layer after, from branch B), the best K kept by a stable sort, and finally the best
   ``total_tokens - 1`` of the pool: the same tree as :class:`~jakiro_lib.drafting.FeatureDrafter` builds
   (tested); a prompt-lookup chain, found by the host, grafted on it (:func:`graft_chain`);
2. **verify** (:meth:`TargetRunner.score <jakiro_lib.runner.TargetRunner.score>`): the target scores the
   tree over its preallocated KV cache, positions given as device tensors;
3. **evaluate** (:func:`greedy_path`, or :func:`sampling_path` at T > 0): the accepted path and the bonus token,
   as tensors;
4. **update**: the target cache keeps the path's entries (moved inside the static buffers), the draft
   encodes the accepted positions (padded to the deepest possible path) and takes its next root.

The host then reads one small tensor (the accepted count and tokens): the only synchronisation of a cycle.
Lengths and positions live in device tensors, so each step can be captured as CUDA graphs (its eager
kernels, or inductor's: ``target.capture``) without re-recording. At T > 0, step 3 is
:func:`sampling_path`: the loop engine's lossless multi-candidate rule in a fixed number of iterations,
on uniforms drawn before the step. Every drafting option of the loop engine runs here. On a CPU
the same code runs eagerly and must give vanilla's greedy output token for token (tests/test_static.py)
and the target's distribution when sampling (tests/test_verify.py).
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import Any, Callable

import torch
from torch.profiler import record_function
from transformers import PreTrainedModel

from . import kernels
from .compiled import MAX_TREE_ROOM, CapturedStep, call_compiled, capture_of, compiled_cache_len, scratch
from .config import TreeConfig
from .decoding import GenerationResult, _check_prompt, _choose, _finish, _sync, text_positions
from .draft import DraftModel, DraftOutput
from .drafting import PromptLookup, candidate_tensors, schedule
from .runner import TargetRunner, tree_rows
from .verify import SamplingParams, warp_probs


# the ranges a cycle is profiled by (jakiro_lib.gpucheck.cycle_breakdown); inside a compiled cycle the four
# steps vanish (record_function is a no-op there) and the captured cycle shows as "cycle"
STEP_RANGES = {s: f"jakiro::{s}" for s in ("draft", "verify", "evaluate", "update", "cycle", "read")}
CACHE_STEP = 128  # eager engines round their cache lengths up to this (no compiled step binds to a length)


def engine_cache_len(needed: int) -> int:
    """Positions of an eager engine's caches: ``needed`` rounded up to :data:`CACHE_STEP`, because every
    forward attends over the whole cache: on this project's 2-core EPYC an 8-token tree after 200 positions
    took 82 ms over 1024 cached positions and 67-75 over 256-384 (the loop engine's growing cache: 65-69;
    SmolLM2-135M fp32, 2026-11-25). A compiled engine takes one length per context instead (one compilation:
    :func:`~jakiro_lib.compiled.compiled_cache_len`)."""
    return -(-needed // CACHE_STEP) * CACHE_STEP


def _static(t: torch.Tensor) -> torch.Tensor:
    """``t``, marked as a buffer whose address never changes: a captured CUDA graph reads and writes it in place."""
    torch._dynamo.mark_static_address(t)
    return t


class StaticEngineError(ValueError):
    """A setting the static engine does not run (an unresolved 'auto' budget, sliding windows, a tree larger
    than the room kept past the text)."""


class StaticKV:
    """The draft's key/value cache as one preallocated buffer of ``capacity`` positions.

    ``slots`` [L] (a device tensor, set before each forward) says where the forward's L rows are written;
    attention reads the whole buffer under the caller's mask, so shapes never change.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.slots: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.capacity

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is None:
            self.k = _static(k.new_zeros(*k.shape[:2], self.capacity, k.shape[-1]))  # [B, n_kv, capacity, hd]
            self.v = _static(v.new_zeros(*v.shape[:2], self.capacity, v.shape[-1]))
        self.k.index_copy_(2, self.slots, k)
        self.v.index_copy_(2, self.slots, v)
        return self.k, self.v


def ancestor_mask(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[m, m] bool: node i sees node j iff j is i or an ancestor of i (``parents`` [m], root's parent 0,
    every node at most ``depth`` deep); ``depth`` rounds of ``mask[i] = eye[i] | mask[parent[i]]``."""
    eye = torch.eye(parents.shape[0], dtype=torch.bool, device=parents.device)
    mask = eye
    for _ in range(depth):
        mask = eye | mask[parents]
    return mask


def greedy_path(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor,
                logits: torch.Tensor, max_depth: int,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verification in tensors: (path [max_depth + 1] node indices by depth, accepted count, bonus).

    A node is accepted when it and every ancestor equal the target's argmax at their parent. Siblings
    hold distinct tokens, so the accepted nodes form one root path; its deepest node gives the bonus
    token. Path entries past the accepted count point at the root (padding the caller never emits).
    ``valid`` [m] bool: nodes that may be accepted (None: all; :func:`graft_chain`'s unused rows may not).
    """
    pred = logits.argmax(-1)  # [m]
    match = (tokens == pred[parents]) | (depths == 0)  # [m]; the root (depth 0) always matches
    if valid is not None:
        match = match & valid
    accepted = ~(anc & ~match[None, :]).any(-1)  # [m]
    best = torch.where(accepted, depths, -1).argmax().reshape(1)
    on_path = anc.index_select(0, best)[0]  # [m]: the best node and its ancestors
    levels = torch.arange(max_depth + 1, device=tokens.device)
    hit = on_path[None, :] & (depths[None, :] == levels[:, None])  # [D + 1, m]
    path = hit.long().argmax(-1)  # [D + 1]; rows past the path find nothing: index 0
    return path, depths.index_select(0, best)[0], pred.index_select(0, best)[0]


def sampling_path(tokens: torch.Tensor, parents: torch.Tensor, logits: torch.Tensor, params: SamplingParams,
                  uniforms: torch.Tensor, max_depth: int,
                  valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sampling verification in tensors, the rule of :func:`jakiro_lib.verify.verify_sampling`: at each node
    the children are tried in index order, child j accepted with probability p(x_j) / R_j, where R_j is the
    node's mass left after zeroing the tokens of the children tried before it; when all are rejected, or at
    a leaf, the bonus token is drawn from what is left. Returns (path [max_depth + 1], accepted count, bonus)
    as :func:`greedy_path` does.

    ``uniforms`` [max_depth * m + 1] float64: one draw per (depth, node), the walk taking the first child
    whose draw falls under its acceptance probability (the same law as drawing child by child), and one for
    the bonus (inverse CDF, as :func:`~jakiro_lib.verify.inverse_cdf`). R_j is the exact sum of the
    residual (children's tokens zeroed) plus the untried children's mass, so the last child with any mass
    left is accepted with probability exactly 1, as in the loop engine. A child repeating an earlier
    sibling's token has no mass (its token was zeroed by that sibling's rejection). ``valid``: as in
    :func:`greedy_path`; an invalid node is nobody's child.
    """
    m = tokens.shape[0]
    idx = torch.arange(m, device=tokens.device)
    children = (parents[None, :] == idx[:, None]) & (idx[None, :] > 0)  # [m, m]: j is a child of i
    if valid is not None:
        children = children & valid[None, :]
    earlier_same = (tokens[:, None] == tokens[None, :]) & (idx[None, :] < idx[:, None])  # [m, m]: k < j, same token
    repeated = (children.float() @ earlier_same.float().T) > 0  # [m, m]: an earlier sibling of j holds its token
    probs = warp_probs(logits, params)  # [m, V]
    cand = torch.where(children, tokens[None, :], 0)  # [m, m]: children's tokens (0 elsewhere: the root may be any id)
    pc = probs.gather(1, cand).double() * (children & ~repeated)  # [m, m]: p_i(x_j) of i's children
    zeroed = torch.zeros_like(probs).scatter_add_(1, cand, children.to(probs.dtype)) > 0
    residual = probs.masked_fill(zeroed, 0.0)  # [m, V]: each node's children's tokens zeroed
    left = residual.double().sum(-1, keepdim=True) + pc.flip(1).cumsum(1).flip(1)  # [m, m]: R_j
    accept_p = torch.where(pc > 0, pc / left.clamp_min(torch.finfo(torch.float64).tiny), 0.0)  # [m, m]
    u = uniforms[:max_depth * m].view(max_depth, m)
    node = accepted = torch.zeros((), dtype=torch.long, device=tokens.device)
    live = torch.ones((), dtype=torch.bool, device=tokens.device)
    path = [node]
    for d in range(max_depth):
        hits = u[d] < accept_p.index_select(0, node[None])[0]  # [m]
        live = live & hits.any()
        node = torch.where(live, hits.long().argmax(), node)  # the first accepted child, if any
        accepted = accepted + live
        path.append(torch.where(live, node, 0))
    row = residual.index_select(0, node[None])[0].double()  # [V]
    cdf = row.cumsum(0)
    bonus = torch.searchsorted(cdf, (uniforms[-1] * cdf[-1])[None], right=True)[0]
    last = torch.where(row > 0, torch.arange(row.shape[0], device=row.device), -1).max()  # u * total rounded up
    bonus = torch.where(bonus >= row.shape[0], last, bonus)
    return torch.stack(path), accepted, bonus


def evaluate(params: SamplingParams, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
             anc: torch.Tensor, logits: torch.Tensor, uniforms: torch.Tensor, max_depth: int,
             valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 3 of a cycle: :func:`greedy_path` at T=0, else :func:`sampling_path` (path, accepted count, bonus)."""
    if params.greedy:
        return greedy_path(tokens, parents, depths, anc, logits, max_depth, valid)
    return sampling_path(tokens, parents, logits, params, uniforms, max_depth, valid)


def graft_chain(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                chain: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A tree of m nodes with a prompt-lookup chain merged in, in fixed shapes: :meth:`Tree.graft
    <jakiro_lib.tree.Tree.graft>`'s rule (the chain follows existing nodes while their tokens agree, then
    continues as new nodes, last among their siblings) on device tensors.

    ``chain`` [L + 1] long: the number of chain tokens c, then the tokens (padded). Returns tokens,
    parents, depths and ``valid`` [m + L]: rows m.. hold the new nodes; a row the chain did not need
    (followed an existing node, or past c) is invalid: parent the root, never accepted (verified by the
    target all the same, as padding)."""
    m, L, dev = tokens.shape[0], chain.shape[0] - 1, tokens.device
    idx = torch.arange(m, device=dev)
    zero = torch.zeros((), dtype=torch.long, device=dev)
    node, depth, following = zero, zero, torch.ones((), dtype=torch.bool, device=dev)
    new: list[tuple[torch.Tensor, ...]] = []
    for i in range(L):
        token, live = chain[i + 1], chain[0] > i
        hit = (parents == node) & (tokens == token) & (idx > 0)  # [m]: node's child holding the token
        found = following & live & hit.any()
        real = live & ~found  # a new node, child of `node`
        new.append((torch.where(real, token, 0), torch.where(real, node, 0), torch.where(real, depth + 1, 1), real))
        at = hit.long().argmax()
        depth = torch.where(found, depths.index_select(0, at[None])[0], torch.where(real, depth + 1, depth))
        node = torch.where(found, at, torch.where(real, m + i, node))
        following = following & found
    if not new:
        return tokens, parents, depths, torch.ones(m, dtype=torch.bool, device=dev)
    t, p, d, v = (torch.stack(x) for x in zip(*new))
    return (torch.cat([tokens, t]), torch.cat([parents, p]), torch.cat([depths, d]),
            torch.cat([torch.ones(m, dtype=torch.bool, device=dev), v]))


def root_step(target: TargetRunner, token: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor,
              start: torch.Tensor) -> torch.Tensor:
    """The last token (``token``, 0-dim, at position ``start``) alone, verified as a one-node tree: the next
    token (0-dim, greedy or sampled), written into ``token``; the target's cache then holds start + 1."""
    zero = torch.zeros(1, dtype=torch.long, device=start.device)  # the node's index, parent and depth
    tokens, anc = token.reshape(1), torch.ones(1, 1, dtype=torch.bool, device=start.device)
    logits, _ = target.score(tokens, zero, anc, start)  # [1, V]
    bonus = evaluate(params, tokens, zero, zero, anc, logits, uniforms, 0)[2]
    token.copy_(bonus)
    return bonus


class StaticTreeDrafter:
    """EAGLE-2's dynamic tree (coupled or decoupled candidates) in fixed shapes over a :class:`StaticKV`."""

    def __init__(self, draft: DraftModel, tree: TreeConfig, capacity: int) -> None:
        if tree.total_tokens == "auto":
            raise StaticEngineError("tree.total_tokens='auto' must be resolved to a number first")
        if tree.decoupled and draft.cfg.num_experts < 2:
            raise StaticEngineError("decoupled candidates need a draft with at least 2 experts")
        if tree.ar_steps is not None and not draft.cfg.branch_b:
            raise StaticEngineError("CEPD (ar_steps) needs a draft trained with branch B")
        # layers per draft step, as the loop drafter: 1 (branch A), or 2 under CEPD (A, then B's grandchildren)
        self.steps = schedule(min(tree.depth, tree.total_tokens - 1), tree.ar_steps, draft.cfg.branch_b)
        self.draft = draft
        self.cfg = tree
        self.K = K = tree.top_k
        self.n_steps = len(self.steps)
        self.n_slots = (self.n_steps - 1) * K  # tree rows forwarded per cycle
        # candidates per cycle: the root's K children, K x K per later step, K x K grandchildren per CEPD step
        self.pool_size = 1 + K + (self.n_steps - 1) * K * K + sum(n == 2 for n in self.steps) * K * K
        self.m = min(tree.total_tokens, self.pool_size)
        self.max_depth = min(sum(self.steps), self.m - 1)
        if max(self.n_slots, self.m) > MAX_TREE_ROOM:
            raise StaticEngineError(f"a tree of {self.m} tokens and {self.n_slots} drafted rows does not fit the "
                                    f"{MAX_TREE_ROOM} positions kept past the text")
        self.cache = StaticKV(capacity)
        self.dtype = next(draft.parameters()).dtype
        self.forwards = 0  # draft forwards inside trees, counted by the engine (no Python state inside a compiled step)
        # The last position's outputs (a [H], experts [E, H], gates [E]) and token: buffers allocated by the
        # first extend and then written in place, so a captured cycle reads and writes the same memory
        self.root: DraftOutput | None = None
        self.root_token: torch.Tensor | None = None  # 0-dim

    def _forward(self, feats: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                 allowed: torch.Tensor) -> DraftOutput:
        """Rows [L] written at ``slots``, attending where ``allowed`` [L, capacity]; outputs without batch."""
        self.cache.slots = slots
        out = self.draft(feats[None].to(self.dtype), tokens[None], pos[None], self.cache, allowed[None, None])
        return DraftOutput(out.a[0], None if out.b is None else out.b[0],
                           None if out.experts is None else out.experts[0],
                           None if out.gates is None else out.gates[0])

    def extend(self, hidden: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor, last: torch.Tensor) -> None:
        """Encode positions start.. (features ``hidden`` [n, H], next tokens [n]); row ``last`` (0-dim)
        is the newest real one: its output and token root the next tree. Rows after it are padding,
        written past the text and overwritten later."""
        n = tokens.shape[0]
        pos = start + torch.arange(n, device=tokens.device)  # [n]
        cols = torch.arange(self.cache.capacity, device=tokens.device)
        out = self._forward(hidden, tokens, pos, pos, cols[None, :] <= pos[:, None])
        at = last.reshape(1)  # index_select, not tensor[last]: a 0-dim index would be read on the host
        new = [None if x is None else x.index_select(0, at)[0] for x in (out.a, out.b, out.experts, out.gates, tokens)]
        if self.root is None:
            a, b, experts, gates, token = (None if x is None else _static(x.clone()) for x in new)
            self.root, self.root_token = DraftOutput(a, b, experts, gates), token
            return
        for buf, x in zip((self.root.a, self.root.b, self.root.experts, self.root.gates, self.root_token), new):
            if buf is not None:
                buf.copy_(x)

    def _children(self, out: DraftOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return candidate_tensors(self.draft, self.cfg, out.a, out.experts, out.gates)

    def propose(self, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The tree rooted at the last token, drafted after ``base`` (0-dim) cached positions:
        tokens, parents (root's: 0) and depths [m], all on the device (the engine builds the ancestor mask
        once, after any lookup chain is grafted: :func:`ancestor_mask`).

        Each step expands the frontier (the root, then the K rows forwarded in one draft call) by branch A;
        a CEPD step (``steps`` entry 2) keeps the best K of those children and gives each the top K of its
        real parent's branch-B distribution as children (the grandparent's prediction two ahead: the
        skipped node is never forwarded), from which the next frontier is chosen; docs/DESIGN.md section 3.
        """
        K, dev = self.K, base.device
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        tokens, parents, depths = [self.root_token.reshape(1)], [zero], [zero]
        scores = [torch.zeros(1, dtype=torch.float64, device=dev)]
        out = _batch_of_one(self.root)  # the frontier's outputs: the root's, then each forward's
        front_idx, front_score, front_feat = zero, scores[0], None
        front_anc = torch.zeros(1, self.n_slots, dtype=torch.bool, device=dev)  # forwarded ancestors' slots
        prefix = torch.arange(self.cache.capacity, device=dev)[None, :] < base
        eye = torch.eye(K, dtype=torch.bool, device=dev)
        size, depth = 1, 0  # pool nodes so far; the frontier's depth

        def add(ids: torch.Tensor, owner: torch.Tensor, owner_score: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
            """K children per owner ([N] pool indices): pooled; returns their scores [N * K] (a child never
            outscores its parent, as in CandidatePool.add)."""
            nonlocal size
            child = torch.minimum(owner_score[:, None] + vals.double(), owner_score[:, None]).flatten()  # [N*K]
            tokens.append(ids.flatten())
            parents.append(owner.repeat_interleave(K))
            scores.append(child)
            depths.append(zero.expand(child.shape[0]) + depth + 1)
            size += child.shape[0]
            return child

        for k, n_layers in enumerate(self.steps):
            own = front_anc
            if k > 0:  # one draft forward for the whole frontier, into slots s0.. of the draft cache
                s0 = (k - 1) * K
                own = front_anc.clone()
                own[:, s0:s0 + K] = eye  # each row also sees itself
                slots = base + s0 + torch.arange(K, device=dev)
                out = self._forward(front_feat, torch.cat(tokens)[front_idx], (base - 1 + depth).expand(K), slots,
                                    tree_rows(prefix, base, own))
            ids, vals, feats = self._children(out)  # [N, K], [N, K], [N, K, H]
            first = size
            child = add(ids, front_idx, front_score, vals)
            order = child.sort(descending=True, stable=True).indices[:K]  # the best K, best first
            front_idx, front_score = first + order, child[order]
            front_feat, front_anc = feats.flatten(0, 1)[order], own.repeat_interleave(K, 0)[order]
            depth += 1
            if n_layers == 2:  # CEPD: the survivors' children from their parents' branch B
                rows = order // K  # [K]: each survivor's parent, a row of `out`
                top = self.draft.logits(out.b).float().log_softmax(-1).topk(K, dim=-1)  # [N, K]
                first = size
                grand = add(self.draft.to_target_ids(top.indices)[rows], front_idx, front_score, top.values[rows])
                order = grand.sort(descending=True, stable=True).indices[:K]
                front_idx, front_score = first + order, grand[order]
                front_feat, front_anc = out.b[rows][order // K], front_anc[order // K]
                depth += 1
        tokens, parents, scores, depths = (torch.cat(x) for x in (tokens, parents, scores, depths))
        # EAGLE-2's selection: the best m - 1 candidates (ties: shallower, then earlier; pool index order
        # is depth order), kept in index order so that every parent precedes its children
        keep = scores[1:].sort(descending=True, stable=True).indices[:self.m - 1].sort().values + 1  # [m - 1]
        nodes = torch.cat([zero, keep])
        new_index = torch.zeros(self.pool_size, dtype=torch.long, device=dev)
        new_index[nodes] = torch.arange(self.m, device=dev)
        tree_parents = new_index[parents[nodes]]  # the root's parent maps to 0
        return tokens[nodes], tree_parents, depths[nodes]


def _batch_of_one(out: DraftOutput) -> DraftOutput:
    """A position's outputs as a batch of one row."""
    return DraftOutput(out.a[None], None if out.b is None else out.b[None],
                       None if out.experts is None else out.experts[None],
                       None if out.gates is None else out.gates[None])


def _runner(model: PreTrainedModel, cache_len: int, *, shared: bool) -> TargetRunner:
    """A runner of ``cache_len`` positions given on the device; ``shared``: over the model's one cache of that
    length (what compiled steps bind to: a new cache would compile again, and a 7B target's is large)."""
    if not shared:
        return TargetRunner(model, cache_len, positions_on_device=True)
    runners: dict[int, TargetRunner] = scratch(model).setdefault("static_runners", {})
    if cache_len not in runners:
        runners[cache_len] = TargetRunner(model, cache_len, positions_on_device=True)
    return TargetRunner(model, cache_len, positions_on_device=True, share=runners[cache_len])


def _next_cycle(result: GenerationResult, start: torch.Tensor, length: int, max_context: int,
                uniforms: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> bool:
    """Before a cycle from ``length`` tokens: ``start`` set and (sampling) this cycle's draws drawn into
    ``uniforms``; False, with the stop reason, where the context has no room left."""
    if length + 1 > max_context:
        result.stop_reason = "context"
        return False
    start.fill_(length)
    if not params.greedy:
        torch.rand(uniforms.shape, generator=generator, dtype=torch.float64, device=uniforms.device, out=uniforms)
    return True


def _compiled_step(model: PreTrainedModel, step: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``step`` compiled for ``model``'s device: on CUDA captured as CUDA graphs, by inductor or by
    :class:`~jakiro_lib.compiled.CapturedStep` (:func:`~jakiro_lib.compiled.capture_of`); elsewhere inductor."""
    if model.device.type != "cuda":
        return torch.compile(step, mode="default", fullgraph=True, dynamic=False)
    if capture_of(model) == "graphs":
        return CapturedStep(step)
    return torch.compile(step, mode="reduce-overhead", fullgraph=True, dynamic=False)


class _StaticLoop:
    """What both static engines share: a :class:`~jakiro_lib.runner.TargetRunner` of ``cache_len`` positions,
    given as device tensors, the step (compiled
    on request, :func:`_compiled_step`: on CUDA captured as CUDA graphs; elsewhere inductor, with the
    packed CPU GEMMs off inside it), and :meth:`generate`: the prefill,
    then one step per cycle with one host read. ``uniforms``: a cycle's ``draws`` (sampling), drawn before
    each cycle from the caller's generator, outside any compiled step, and passed to the step as an argument
    rather than marked as a static address: CPU inductor's freezing turns the static tensors a graph only
    reads into constants (the compiled cycle reused the first draws for ever: tests/test_static.py)."""

    def __init__(self, model: PreTrainedModel, cache_len: int, step: Callable[..., torch.Tensor], *,
                 params: SamplingParams, compile: bool, draws: int) -> None:
        self.model, self.params, self.compile = model, params, compile
        self.target = _runner(model, cache_len, shared=compile)
        self.uniforms = torch.zeros(draws, dtype=torch.float64, device=model.device)
        self.compiled_cycles = 0  # cycles run through the compiled step (tests check that it was used)
        self.inputs: tuple[torch.Tensor, ...] = ()  # the step's inputs after the uniforms, set by the host per cycle
        self._step = _compiled_step(model, step) if compile else step

    def _run_step(self, start: torch.Tensor) -> torch.Tensor:
        if not self.compile:
            return self._step(start, self.uniforms, *self.inputs)
        read = _call_compiled(self.model, self._step, start, self.uniforms, *self.inputs,
                              first=self.compiled_cycles == 0)
        self.compiled_cycles += 1
        return read

    def _begin(self, ids: torch.Tensor, hidden: torch.Tensor, first: int) -> None:
        """After the prefill of ``ids`` [n], whose last position chose ``first``."""
        raise NotImplementedError

    def _advance(self, start: torch.Tensor, room: int) -> tuple[list[int], int | None]:
        """One cycle from ``start`` with ``room`` positions left: (the tokens it emits, its tree size or None)."""
        raise NotImplementedError

    def _forwards(self) -> int:
        return 0  # draft forwards so far (none without a draft)

    def generate(self, prompt_ids: torch.Tensor, *, max_new_tokens: int, eos_token_ids: list[int] = (),
                 max_context: int, generator: torch.Generator | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        dev = self.model.device
        result = GenerationResult(prompt_len=prompt_ids.numel(), output_ids=[])
        eos = set(eos_token_ids)
        forwards0 = self._forwards()
        _sync(dev)
        t0 = time.perf_counter()
        ids = prompt_ids.to(dev)
        logits, hidden = self.target.prefill(ids)
        first = _choose(logits[-1], self.params, generator)
        self._begin(ids, hidden, first)
        length = ids.shape[0]
        start = torch.full((), length, device=dev)  # torch.full, not torch.tensor: a CPU value copied to a GPU syncs
        done = _finish(result, [first], eos, max_new_tokens, on_tokens)
        result.prefill_time = time.perf_counter() - t0
        while not done and _next_cycle(result, start, length, max_context, self.uniforms, self.params, generator):
            emitted, tree_size = self._advance(start, max_context - length)
            length += len(emitted)
            if tree_size is not None:
                result.tree_sizes.append(tree_size)
            before = len(result.output_ids)
            done = _finish(result, emitted, eos, max_new_tokens, on_tokens)
            result.accepted.append(len(result.output_ids) - before)
        result.draft_forwards = self._forwards() - forwards0
        _sync(dev)
        result.wall_time = time.perf_counter() - t0
        return result


class StaticEngine(_StaticLoop):
    """A target, a draft and tree settings bound to static buffers of ``cache_len`` positions.

    :meth:`cycle` is one draft-verify-evaluate-update step from ``start`` cached positions, a function of
    device tensors with fixed shapes; it returns what the host reads. ``params``: greedy (T=0) verification
    or :func:`sampling_path` on the cycle's uniforms. ``compile``: the cycle goes through ``torch.compile``
    (:class:`_StaticLoop`), the draft head's packed GEMM off inside it too. With ``tree.lookup_tokens`` the
    host looks the context's last n-gram up (:class:`~jakiro_lib.drafting.PromptLookup`, over the tokens it
    reads anyway) and hands the chain to the cycle, which grafts it on the tree (:func:`graft_chain`);
    ``draft`` None: the tree is the root and the chain alone.
    """

    def __init__(self, model: PreTrainedModel, draft: DraftModel | None, tree: TreeConfig, cache_len: int, *,
                 params: SamplingParams = SamplingParams(), compile: bool = False) -> None:
        if draft is None and not tree.lookup_tokens:
            raise StaticEngineError("without a draft, only a prompt-lookup chain proposes tokens: set "
                                    "tree.lookup_tokens")
        self.draft = draft
        self.drafter = None if draft is None else StaticTreeDrafter(draft, tree, cache_len)
        L = tree.lookup_tokens
        self.lookup = PromptLookup(L, max_ngram=tree.lookup_max_ngram, min_ngram=tree.lookup_min_ngram) if L else None
        drafted_m, drafted_depth = (1, 0) if self.drafter is None else (self.drafter.m, self.drafter.max_depth)
        self.m, self.max_depth = drafted_m + L, max(drafted_depth, L)  # the verified tree: drafted rows, then chain
        if self.m > MAX_TREE_ROOM:
            raise StaticEngineError(f"a tree of {self.m} tokens does not fit the {MAX_TREE_ROOM} positions kept past "
                                    "the text")
        # the root when there is no draft (the last token, written in place); the chain's count and tokens
        self.token = _static(torch.zeros((), dtype=torch.long, device=model.device))
        self.chain = torch.zeros(L + 1, dtype=torch.long, device=model.device)
        super().__init__(model, cache_len, self.cycle, params=params, compile=compile,
                         draws=self.max_depth * self.m + 1)
        if L:
            self.inputs = (self.chain,)  # an input, not a static address (see _StaticLoop on CPU freezing)

    def cycle(self, start: torch.Tensor, uniforms: torch.Tensor, chain: torch.Tensor | None = None) -> torch.Tensor:
        """[D + 2]: the accepted count, then the accepted tokens with the bonus token after them (padded).
        ``uniforms``: this cycle's draws (sampling; see :class:`_StaticLoop`); ``chain``: the lookup chain
        (:func:`graft_chain`)."""
        drafter, target = self.drafter, self.target
        with record_function(STEP_RANGES["draft"]):
            if drafter is not None:
                tokens, parents, depths = drafter.propose(start)
            else:
                tokens = self.token.reshape(1)
                parents = depths = torch.zeros(1, dtype=torch.long, device=start.device)
            valid = None
            if chain is not None:
                tokens, parents, depths, valid = graft_chain(tokens, parents, depths, chain)
            anc = ancestor_mask(parents, self.max_depth)  # [m, m], the chain's rows included
        with record_function(STEP_RANGES["verify"]):
            logits, hidden = target.score(tokens, depths, anc, start)
        with record_function(STEP_RANGES["evaluate"]):
            path, accepted, bonus = evaluate(self.params, tokens, parents, depths, anc, logits, uniforms,
                                             self.max_depth, valid)
        with record_function(STEP_RANGES["update"]):
            target.move(start, path)  # the path's entries to start..; the next cycle writes after the accepted ones
            new = torch.cat([tokens[path[1:]], bonus[None]])  # [D + 1]: accepted tokens, bonus at `accepted`
            new = new.scatter(0, accepted[None], bonus[None])
            if drafter is not None:
                drafter.extend(hidden[path], new, start, accepted)
            else:
                self.token.copy_(bonus)
        return torch.cat([accepted[None], new])

    def _root(self) -> torch.Tensor:
        return self.token if self.drafter is None else self.drafter.root_token

    def _root_only(self, start: torch.Tensor) -> torch.Tensor:
        """Near the end of the context, where a whole tree no longer fits: the root alone, verified."""
        bonus = root_step(self.target, self._root(), self.params, self.uniforms, start)
        return torch.stack([torch.zeros_like(bonus), bonus])

    def _run_step(self, start: torch.Tensor) -> torch.Tensor:
        if self.draft is None:
            return super()._run_step(start)
        head = self.draft.packed_head
        if self.compile:
            self.draft.packed_head = False  # inside the compiled step the plain GEMMs run (inductor packs them)
            self.draft.head_weight()  # the draft vocabulary's rows, gathered outside the graph
        try:
            return super()._run_step(start)
        finally:
            self.draft.packed_head = head

    def _begin(self, ids: torch.Tensor, hidden: torch.Tensor, first: int) -> None:
        dev, n = ids.device, ids.shape[0]
        if self.drafter is not None:
            self.drafter.extend(hidden, torch.cat([ids[1:], torch.full((1,), first, device=dev)]),
                                torch.zeros((), dtype=torch.long, device=dev), torch.full((), n - 1, device=dev))
        else:
            self.token.fill_(first)
        if self.lookup is not None:
            self.lookup.reset(ids.tolist() + [first])  # once per prompt (a host read of the prompt)

    def _advance(self, start: torch.Tensor, room: int) -> tuple[list[int], int | None]:
        whole = self.max_depth + 1 <= room
        if whole and self.lookup is not None:
            chain = self.lookup.propose()
            L = self.lookup.num_tokens
            self.chain.copy_(torch.tensor([len(chain), *chain, *[0] * (L - len(chain))]))
        with record_function(STEP_RANGES["cycle"]):
            step = self._run_step(start) if whole else self._root_only(start)
        with record_function(STEP_RANGES["read"]):
            read = step.tolist()  # the one host read
        emitted = read[1:read[0] + 2]
        if self.lookup is not None:
            self.lookup.extend(emitted)
        if self.drafter is not None and whole:
            self.drafter.forwards += self.drafter.n_steps - 1
        return emitted, self.m if whole else 1

    def _forwards(self) -> int:
        return 0 if self.drafter is None else self.drafter.forwards


def _call_compiled(model: PreTrainedModel, step: Callable[..., torch.Tensor], *args: torch.Tensor,
                   first: bool) -> torch.Tensor:
    """A compiled step, with the compile settings and the target's plain GEMMs (inductor packs its own); a
    failure of the ``first`` call (the compilation) is one :class:`~jakiro_lib.compiled.CompileError`."""
    with kernels.plain_kernels(model, gqa=False):
        return call_compiled(step, *args, device=model.device, first=first)


class StaticDecoder(_StaticLoop):
    """Plain decoding on the static target: each step scores the last token at ``start`` and chooses the next
    (argmax, or :func:`sampling_path`'s inverse-CDF draw from the warped distribution at T > 0) in device
    tensors; the host reads one token per step. ``compile``: the step captured as a CUDA graph on CUDA (as
    :class:`StaticEngine`'s cycle), which HF's compiled ``generate`` does too: our loop's plain baseline on
    a GPU, where the loop engine's eager step was 0.72x HF's (the H200 run of 2026-11-26)."""

    def __init__(self, model: PreTrainedModel, cache_len: int, *, params: SamplingParams = SamplingParams(),
                 compile: bool = False) -> None:
        self.token = _static(torch.zeros((), dtype=torch.long, device=model.device))  # the last token, in place
        super().__init__(model, cache_len, self.step, params=params, compile=compile, draws=1)

    def step(self, start: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """[1]: the token after the one at position ``start`` (0-dim), which becomes the last token."""
        return root_step(self.target, self.token, self.params, uniforms, start).reshape(1)

    def _begin(self, ids: torch.Tensor, hidden: torch.Tensor, first: int) -> None:
        self.token.fill_(first)

    def _advance(self, start: torch.Tensor, room: int) -> tuple[list[int], int | None]:
        with record_function(STEP_RANGES["cycle"]):
            step = self._run_step(start)
        with record_function(STEP_RANGES["read"]):
            return step.tolist(), None  # the one host read


def _engine(model: PreTrainedModel, draft: DraftModel | None, tree: TreeConfig | None, cache_len: int,
            params: SamplingParams, compile: bool) -> StaticEngine | StaticDecoder:
    """The engine for ``draft`` (None: plain decoding). A compiled one is kept on the model, one per draft,
    tree, sampling settings and length: its step is specialised to its buffers (as
    :func:`_runner` explains), so a new one would compile again."""
    def build() -> StaticEngine | StaticDecoder:
        if draft is None and (tree is None or not tree.lookup_tokens):
            return StaticDecoder(model, cache_len, params=params, compile=compile)
        return StaticEngine(model, draft, tree, cache_len, params=params, compile=compile)

    if not compile:
        return build()
    engines: dict = scratch(model).setdefault("static_engines", {})
    tree_key = None if tree is None else json.dumps(dataclasses.asdict(tree), sort_keys=True)
    key = (id(draft), tree_key, params, cache_len, capture_of(model))
    if key not in engines:  # the engine holds the draft, so its id is not reused while the entry lives
        engines[key] = build()
    return engines[key]


@torch.inference_mode()
def static_generate(model: PreTrainedModel, draft: DraftModel | None, tree: TreeConfig | None,
                    prompt_ids: torch.Tensor, *,
                    max_new_tokens: int = 128, params: SamplingParams = SamplingParams(),
                    eos_token_ids: list[int] = (), max_context: int = 2048, generator: torch.Generator | None = None,
                    on_tokens: Callable[[list[int]], None] | None = None, compile: bool = False) -> GenerationResult:
    """Speculative decoding on the static engine: draft, verify, evaluate, update; one host read per cycle
    (``draft`` None: plain decoding, :class:`StaticDecoder`). ``params``/``generator`` as in
    :func:`~jakiro_lib.decoding.speculative_generate` (the generator on the model's device). ``compile``: the
    cycle compiled (CUDA graphs on CUDA; the first prompts of each length compile)."""
    _check_prompt(prompt_ids, max_context, 1)
    needed = text_positions(prompt_ids, max_new_tokens, max_context) + MAX_TREE_ROOM  # room for a tree past the text
    cache_len = compiled_cache_len(max_context) if compile else engine_cache_len(needed)
    engine = _engine(model, draft, tree, cache_len, params, compile)
    return engine.generate(prompt_ids, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids,
                           max_context=max_context, generator=generator, on_tokens=on_tokens)


def static_vanilla_generate(model: PreTrainedModel, prompt_ids: torch.Tensor, **kwargs: Any) -> GenerationResult:
    """Plain decoding on the static engine (:class:`StaticDecoder`); the keywords of :func:`static_generate`."""
    return static_generate(model, None, None, prompt_ids, **kwargs)
