"""The engine's tree in fixed-shape tensors (docs/DESIGN.md section 12): the draft cache, EAGLE-2's tree drafted into
preallocated slots (coupled, decoupled or CEPD), a lookup chain grafted on, and the accepted path."""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from ..compiling import RECOMPILE_LIMIT, CompileError, run_compiling
from ..config import TreeConfig
from ..models.draft import DraftModel, DraftOutput
from ..models.draft_blocks import StaticKV, fixed_address
from ..models.draft_step import engine_step, one_tree
from ..models.fast_paths import ATTEND_HEAD_SIZES, ATTEND_ROWS
from .clock import Clock, step
from .drafting import candidate_tensors, draft_schedule
from .runner import MAX_TREE_ROOM, TargetRunner, tree_rows
from .verify import SamplingParams


class StaticEngineError(ValueError):
    """A setting the engine does not run (an unresolved 'auto' budget, a tree larger than the room past the text)."""


def ancestor_mask(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[m, m] bool: node i sees node j iff j is i or an ancestor of i (``parents`` [m], root's parent 0,
    every node at most ``depth`` deep); ``depth`` rounds of ``mask[i] = eye[i] | mask[parent[i]]``."""
    eye = torch.eye(parents.shape[0], dtype=torch.bool, device=parents.device)
    mask = eye
    for _ in range(depth):
        mask = eye | mask[parents]
    return mask


def greedy_path(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor,
                chosen: torch.Tensor, max_depth: int,
                valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verification in tensors (docs/DESIGN.md sections 6 and 12, evaluate) of each row's chosen token ``chosen`` [m]
    (its argmax, or its draw): the path [max_depth + 1] of node indices by depth (the root past the accepted count),
    the accepted count and the bonus token. ``valid`` [m] bool: nodes that may be accepted (None: all;
    :func:`graft_chain`'s unused rows may not; sampling, :func:`first_siblings`)."""
    match = (tokens == chosen[parents]) | (depths == 0)  # [m]; the root (depth 0) always matches
    if valid is not None:
        match = match & valid
    accepted = (anc <= match[None, :]).all(-1)  # [m]: the node and every ancestor match
    best = torch.where(accepted, depths, -1).argmax().reshape(1)
    on_path = anc.index_select(0, best)[0]  # [m]: the best node and its ancestors
    levels = torch.arange(max_depth + 1, device=tokens.device)
    hit = on_path[None, :] & (depths[None, :] == levels[:, None])  # [D + 1, m]
    path = hit.long().argmax(-1)  # [D + 1]; rows past the path find nothing: index 0
    return path, depths.index_select(0, best)[0], chosen.index_select(0, best)[0]


def first_siblings(tokens: torch.Tensor, parents: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """[m] bool: the nodes of ``valid`` (None: all) that no earlier sibling's token repeats. A row's draw that a node's
    children hold twice goes to the first of them, as :func:`greedy_walk` goes: choosing the one whose subtree accepts
    more would pick among independent draws by their outcome (sampled verification is exact only without that)."""
    idx = torch.arange(tokens.shape[0], device=tokens.device)
    same = (parents[:, None] == parents[None, :]) & (tokens[:, None] == tokens[None, :])  # [m, m]
    earlier = same & (idx[None, :] < idx[:, None])
    first = ~(earlier & (idx[None, :] > 0)).any(1)  # [m]; the root's row is nobody's sibling
    return first if valid is None else first & valid


def _child(words: list[int], up: list[int], node: int, token: int) -> int | None:
    """The child of ``node`` holding ``token`` in a host-read tree (siblings hold distinct tokens), or None."""
    return next((j for j in range(node + 1, len(words)) if up[j] == node and words[j] == token), None)


def greedy_walk(tokens: torch.Tensor, parents: torch.Tensor, best: torch.Tensor) -> tuple[list[int], list[int]]:
    """Eager greedy verification walked on the host as the loop engine walks it, from one read of the tree's tokens,
    parents and rows' argmaxes ``best``: host lists of the path's nodes (root first) and of the tokens it emits."""
    words, up, best = torch.stack([tokens, parents, best]).tolist()
    path = [0]
    while (child := _child(words, up, path[-1], best[path[-1]])) is not None:
        path.append(child)
    return path, [words[j] for j in path[1:]] + [best[path[-1]]]


def graft_chain(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor,
                chain: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A tree of m nodes (``anc`` [m, m] its :func:`ancestor_mask`) with a prompt-lookup chain merged in, in fixed
    shapes: the chain follows existing nodes while their tokens agree, then continues as new nodes (the reference's
    ``Tree.graft``). ``chain`` [L + 1]: the number of chain tokens c, then the tokens (padded). Returns tokens,
    parents, depths, the ancestor mask and ``valid`` [m + L]: rows m.. hold the new nodes; a row the chain did not
    need is invalid (parent the root, never accepted)."""
    m, L, dev = tokens.shape[0], chain.shape[0] - 1, tokens.device  # L >= 1
    steps = torch.arange(L, device=dev)  # [L]: chain index i, a new node at depth i + 1
    c, words = chain[0], chain[1:]  # 0-dim, [L]
    spelled = words.index_select(0, (depths - 1).clamp(0, L - 1))  # [m]: the chain's token at each node's depth
    ok = ((tokens == spelled) & (depths <= c)) | (depths == 0)  # [m]
    on = (anc <= ok[None, :]).all(-1)  # [m]: the node's root path spells the chain's first tokens
    best = torch.where(on, depths, -1).argmax().reshape(1)  # [1]: the deepest such node
    d = depths.index_select(0, best)  # [1]: chain tokens followed
    valid = (steps >= d) & (steps < c)  # [L]
    new_parents = torch.where(valid, torch.where(steps == d, best, m + steps - 1), 0)
    sees = (anc.index_select(0, best) & valid[:, None]) | (torch.arange(m, device=dev) == 0)  # [L, m]: best's path
    own = ((steps[None, :] <= steps[:, None]) & (steps[None, :] >= d) & valid[:, None]) | torch.eye(
        L, dtype=torch.bool, device=dev)  # [L, L]: the new rows from d to the row itself
    full = torch.cat([torch.cat([anc, torch.zeros(m, L, dtype=torch.bool, device=dev)], 1), torch.cat([sees, own], 1)])
    return (torch.cat([tokens, torch.where(valid, words, 0)]), torch.cat([parents, new_parents]),
            torch.cat([depths, torch.where(valid, steps + 1, 1)]), full,
            torch.cat([torch.ones(m, dtype=torch.bool, device=dev), valid]))


def graft_chain_eager(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor,
                      chain: list[int], uniforms: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Eager: :func:`graft_chain` with the chain on the host and only the rows it needs, the nodes it follows found
    from one read of the tree's tokens and parents. Returns tokens, parents, depths, the ancestor mask and ``uniforms``
    (None at T=0) with each kept row's draw as :func:`graft_chain`'s layout gives it (the drafted rows, then chain
    step i at row m + i), so a sampled cycle decides as a compiled one."""
    m, dev = tokens.shape[0], tokens.device
    node = followed = 0
    if m > 1:
        words, up = torch.stack([tokens, parents]).tolist()
        while followed < len(chain) and (child := _child(words, up, node, chain[followed])) is not None:
            node, followed = child, followed + 1
    k = len(chain) - followed  # new nodes, at depths followed + 1 ..
    new = torch.tensor([chain[followed:], [node, *range(m, m + k - 1)][:k], range(followed + 1, followed + k + 1)],
                       dtype=torch.long, device=dev)  # [3, k]: tokens, parents, depths
    if m == 1:  # the root and the chain: one path
        full = torch.ones(k + 1, k + 1, dtype=torch.bool, device=dev).tril_()
    else:
        full = anc.new_zeros(m + k, m + k)  # [m + k, m + k]
        full[:m, :m] = anc
        full[m:, :m] = anc[node]  # the followed node's path
        full[m:, m:] = torch.ones(k, k, dtype=torch.bool, device=dev).tril_()
    if uniforms is not None:
        uniforms = torch.cat([uniforms[:m], uniforms[m + followed:m + followed + k]])
    return (torch.cat([tokens, new[0]]), torch.cat([parents, new[1]]), torch.cat([depths, new[2]]), full, uniforms)


def root_step(target: TargetRunner, token: torch.Tensor, params: SamplingParams, uniforms: torch.Tensor,
              start: int | torch.Tensor, *, masked: bool = True, sync: bool = False) -> torch.Tensor:
    """The last token (``token``, 0-dim, at ``start``) verified as a one-node tree: the next token (its argmax, or its
    draw with the first of ``uniforms``), written into ``token``. ``masked`` False: the window is the text and this
    token, attended whole (no mask to build)."""
    zero = torch.zeros(1, dtype=torch.long, device=token.device)  # the node's depth
    anc = torch.ones(1, 1, dtype=torch.bool, device=token.device) if masked else None
    draw = None if params.greedy else (params, uniforms[:1], sync)
    bonus = target.score(token.reshape(1), zero, anc, start, greedy=True, draw=draw)[0][0]
    token.copy_(bonus)
    return bonus


def pool_size(steps: Sequence[int], K: int) -> int:
    """Candidates a tree drafted in ``steps`` at width K holds: the root, K, K x K per later step and per CEPD step."""
    return 1 + K + (len(steps) - 1) * K * K + sum(n == 2 for n in steps) * K * K


@functools.cache
def _compiled_pool() -> Callable[..., tuple[torch.Tensor, ...]]:
    """:meth:`StaticTreeDrafter._pool_candidates` through ``torch.compile`` (inductor): one graph per draft and tree
    shape, for every drafter and context; shapes free where marked only (DESIGN section 12)."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(StaticTreeDrafter._pool_candidates, fullgraph=True, dynamic=False)


class StaticTreeDrafter:
    """EAGLE-2's dynamic tree (coupled or decoupled candidates) in fixed shapes over a :class:`StaticKV`.
    ``compiled``: a tree of more than two tokens drafted through one compiled call (``target.capture`` "draft"; the
    draft's head prepared first, as :class:`~jakiro_lib.decoding.static.StaticEngine` does)."""

    def __init__(self, draft: DraftModel, tree: TreeConfig, capacity: int, *, compiled: bool = False) -> None:
        # layers per draft step, as the loop drafter: 1 (branch A), or 2 under CEPD (A, then B's grandchildren)
        self.steps = draft_schedule(draft, tree, StaticEngineError)
        self.draft = draft
        self.cfg = tree
        self.K = K = tree.top_k
        self.n_steps = len(self.steps)
        self.n_slots = (self.n_steps - 1) * K  # tree rows forwarded per cycle
        self.pool_size = pool_size(self.steps, K)
        self.m = min(tree.total_tokens, self.pool_size)
        self.max_depth = min(sum(self.steps), self.m - 1)
        if max(self.n_slots, self.m) > MAX_TREE_ROOM:
            raise StaticEngineError(f"a tree of {self.m} tokens and {self.n_slots} drafted rows does not fit the "
                                    f"{MAX_TREE_ROOM} positions kept past the text")
        self.cache = StaticKV(capacity)
        self.dtype = next(draft.parameters()).dtype
        self.forwards = 0  # draft forwards inside trees, counted by the engine (no Python state inside a compiled step)
        self.clock: Clock | None = None  # the engine's (eager)
        self.compiled = compiled
        # The last position's outputs (a [H], experts [E, H], gates [E]) and token: buffers allocated by the
        # first extend and then written in place, so a captured cycle reads and writes the same memory
        self.root: DraftOutput | None = None
        self.root_token: torch.Tensor | None = None  # 0-dim
        dev = next(draft.parameters()).device  # a two-token tree's parents, depths and ranks (_best_child)
        # forward k's rows see their own slots k*K.. [n_steps - 1, K, n_slots], OR-ed in (inductor fails a slice-set)
        self._own_slots = torch.eye(self.n_slots, dtype=torch.bool, device=dev).view(self.n_steps - 1, K, self.n_slots)
        self._pair = (torch.zeros(2, dtype=torch.long, device=dev), torch.arange(2, device=dev),
                      torch.tensor([-1, 0], device=dev), torch.ones(2, 2, dtype=torch.bool, device=dev).tril())

    def _forward(self, feats: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                 allowed: torch.Tensor) -> DraftOutput:
        """Rows [L] written at ``slots``, attending where ``allowed`` [L, window]; outputs without batch."""
        self.cache.slots = slots
        with step(None if torch.compiler.is_compiling() else self.clock, "draft_forward"):
            return DraftOutput(*engine_step(self.draft, feats.to(self.dtype), tokens, pos, self.cache, allowed,
                                            ATTEND_ROWS, ATTEND_HEAD_SIZES))

    def extend(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int | torch.Tensor,
               last: int | torch.Tensor) -> None:
        """Encode positions start.. (features ``hidden`` [n, H], next tokens [n]); row ``last`` (0-dim, or a host
        int eagerly) roots the next tree; rows after it are padding, overwritten later."""
        n = tokens.shape[0]
        pos = start + torch.arange(n, device=tokens.device)  # [n]
        cols = torch.arange(self.cache.window, device=tokens.device)  # [W]
        out = self._forward(hidden, tokens, pos, pos, cols[None, :] <= pos[:, None])
        if isinstance(last, int):  # eager: the row's outputs as they are (no buffer a captured step must find)
            self.root = DraftOutput(*(None if x is None else x[last] for x in (out.a, out.b, out.experts, out.gates)))
            self.root_token = tokens[last]
            return
        at = last.reshape(1)  # index_select, not tensor[last]: a 0-dim index would be read on the host
        new = [None if x is None else x.index_select(0, at)[0] for x in (out.a, out.b, out.experts, out.gates, tokens)]
        if self.root is None:
            a, b, experts, gates, token = (None if x is None else fixed_address(x.clone()) for x in new)
            self.root, self.root_token = DraftOutput(a, b, experts, gates), token
            return
        for buf, x in zip((self.root.a, self.root.b, self.root.experts, self.root.gates, self.root_token), new):
            if buf is not None:
                buf.copy_(x)

    def propose(self, base: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The tree rooted at the last token, drafted after ``base`` cached positions: tokens, parents (root's: 0),
        depths and selection ranks [m] (:func:`select_tree`), and its :func:`ancestor_mask` [m, m]; a CEPD step also
        drafts from branch B (DESIGN 3, 12)."""
        return self._best_child() if self.m == 2 else self._pool(base)

    def _best_child(self) -> tuple[torch.Tensor, ...]:
        """A two-token tree: the root and its best child, as :meth:`_pool` selects it (no deeper node outscores its
        parent; ties go to the first), without building the pool."""
        root = self.root.map(lambda x: x[None])
        ids, vals, _ = candidate_tensors(self.draft, self.cfg, root.a, root.experts, root.gates)  # [1, K]
        best = vals.double().clamp(max=0).flatten().argmax()[None]  # as the pool: no child outscores the root (0)
        # index_select, not ids[best]: a tensor index would be read on the host (no capture, no compile)
        return (torch.cat([self.root_token.reshape(1), ids.flatten().index_select(0, best)]), *self._pair)

    def _pool(self, base: int | torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The general tree: the candidate pool drafted step by step, then :func:`select_tree`; eagerly in one kernel
        call where it serves (:func:`~jakiro_lib.models.draft_step.one_tree`: a clock is told its steps' time), or
        :attr:`compiled` in one compiled call (which a clock times whole as the engine's "draft")."""
        native = None if self.compiled or not isinstance(base, int) else one_tree(self, base, ATTEND_ROWS,
                                                                                  ATTEND_HEAD_SIZES)
        if native is not None:
            return native
        cols = torch.arange(self.cache.window, device=self.root_token.device)  # [W]
        if not self.compiled:
            pool = self._pool_candidates(base, cols)
        else:
            for free in ((cols, 0), (self.cache.k, 2), (self.cache.v, 2)):  # the window and the cache's length
                torch._dynamo.mark_dynamic(*free)
            fresh = _compiled_pool.cache_info().currsize == 0  # the process's first sweeps inductor's cache
            pool = run_compiling(lambda: _compiled_pool()(self, torch.as_tensor(base), cols), compiling=fresh,
                                 what="the compiled draft", remedy='set target.capture to "none"', error=CompileError)
        tree = select_tree(*pool, self.m)
        return *tree, ancestor_mask(tree[1], self.max_depth)

    def _pool_candidates(self, base: int | torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The candidate pool drafted step by step: tokens, parents, scores, depths [P], the root first. ``cols``
        [W]: the window's positions (the window is its length, a shape a compiled graph keeps free)."""
        self.cache.window = cols.shape[0]
        K, dev = self.K, self.root_token.device
        zero = torch.zeros(1, dtype=torch.long, device=dev)
        root_score = torch.zeros(1, dtype=torch.float64, device=dev)
        pool = ([self.root_token.reshape(1)], [zero], [root_score], [zero])  # tokens, parents, scores, depths
        out = self.root.map(lambda x: x[None])  # the frontier's outputs: the root's, then each forward's
        front_idx, front_score, front_feat = zero, root_score, None
        front_anc = torch.zeros(1, self.n_slots, dtype=torch.bool, device=dev)  # forwarded ancestors' slots
        prefix = cols[None, :] < base  # [1, W]
        depth = 0  # the frontier's
        front_tok = self.root_token.reshape(1)
        for k, n_layers in enumerate(self.steps):
            own, last = front_anc, k == self.n_steps - 1
            if k > 0:  # one draft forward for the whole frontier, into slots s0.. of the draft cache
                s0 = (k - 1) * K
                own = front_anc | self._own_slots[k - 1]  # each row also sees itself (its slots are still unset)
                slots = base + s0 + torch.arange(K, device=dev)
                pos = torch.full((K,), depth - 1, device=dev) + base  # [K]
                out = self._forward(front_feat, front_tok, pos, slots, tree_rows(prefix, base, own))
            ids, vals, feats = candidate_tensors(self.draft, self.cfg, out.a, out.experts, out.gates)  # feats [N, K, H]
            first, child = _pool_children(pool, ids, front_idx, front_score, vals, depth + 1)
            if last and n_layers == 1:
                break  # the last layer's children are candidates, never forwarded: no frontier to choose
            order = child.sort(descending=True, stable=True).indices[:K]  # the best K, best first
            front_idx, front_score, front_tok = first + order, child[order], ids.flatten()[order]
            front_feat, front_anc = feats.flatten(0, 1)[order], own.repeat_interleave(K, 0)[order]
            depth += 1
            if n_layers == 2:  # CEPD: the survivors' children from their parents' branch B
                rows = order // K  # [K]: each survivor's parent, a row of `out`
                top = self.draft.logits(out.b).float().log_softmax(-1).topk(K, dim=-1)  # [N, K]
                grand_ids = self.draft.to_target_ids(top.indices)[rows]  # [K, K]
                first, grand = _pool_children(pool, grand_ids, front_idx, front_score, top.values[rows], depth + 1)
                if last:
                    break
                order = grand.sort(descending=True, stable=True).indices[:K]
                front_idx, front_score, front_tok = first + order, grand[order], grand_ids.flatten()[order]
                front_feat, front_anc = out.b[rows][order // K], front_anc[order // K]
                depth += 1
        return tuple(torch.cat(x) for x in pool)


def _pool_children(pool: tuple[list[torch.Tensor], ...], ids: torch.Tensor, owner: torch.Tensor,
                   owner_score: torch.Tensor, vals: torch.Tensor, depth: int) -> tuple[int, torch.Tensor]:
    """K children per owner (``ids``, ``vals`` [N, K]; ``owner`` [N] pool indices) added to the pool's tokens,
    parents, scores and depths at ``depth``; returns the first one's pool index and their scores [N * K] (a child
    never outscores its parent, as in CandidatePool.add)."""
    tokens, parents, scores, depths = pool
    first = sum(t.shape[0] for t in tokens)
    child = torch.minimum(owner_score[:, None] + vals.double(), owner_score[:, None]).flatten()  # [N * K]
    tokens.append(ids.flatten())
    parents.append(owner.repeat_interleave(ids.shape[-1]))
    scores.append(child)
    depths.append(torch.full_like(parents[-1], depth))
    return first, child


def select_tree(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, depths: torch.Tensor,
                m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """EAGLE-2's selection from a candidate pool (tokens, parents, scores, depths [P], the root first): the root
    and the best ``m - 1`` candidates (ties: shallower, then earlier; pool index order is depth order), kept in
    index order so that every parent precedes its children; returns their tokens, parents re-indexed into the
    tree (the root's: 0), depths and ranks [m] (a node's place in the score order, the root's -1: the nodes a
    smaller budget keeps are those of rank below it)."""
    dev = tokens.device
    best = scores[1:].sort(descending=True, stable=True).indices[:m - 1]  # [m - 1], best first
    kept = best.sort()  # pool order; .indices: each kept node's place among the best, its rank
    nodes = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), kept.values + 1])
    new_index = torch.zeros(tokens.shape[0], dtype=torch.long, device=dev)
    new_index[nodes] = torch.arange(m, device=dev)
    ranks = torch.cat([torch.full((1,), -1, dtype=torch.long, device=dev), kept.indices])
    return tokens[nodes], new_index[parents[nodes]], depths[nodes], ranks
