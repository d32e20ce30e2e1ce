"""Measured cost model of one speculative cycle, and the tree it implies on this machine (docs/DESIGN.md sections 9
and 11). One greedy run with a generous tree records, per cycle, the selection rank of each accepted node among the
nodes no deeper than each depth; the accepted length a smaller or shallower tree of the same width would have had is
then exact (greedy acceptance at a node depends only on its ancestors, a shallower tree drafts the same first layers,
and the top-n tree is a prefix of the score order), and :func:`choose_tree` weighs it against the measured costs."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import statistics
import time
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch

from ..config import TreeConfig
from .clock import StepClock
from ..decoding.drafting import schedule
from ..decoding.result import GenerationResult
from ..decoding.runner import MAX_TREE_ROOM, TargetRunner
from ..decoding.static import engine_cache_len, static_generate
from ..decoding.static_tree import StaticTreeDrafter, ancestor_mask, pool_size
from ..machine import synchronize
from ..models.draft import DraftModel, KVCache
from ..models.target import capture_of, compiles_cycle


def _time_once(fn, device: torch.device) -> float:
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - t0


def median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    """The median seconds of ``repeats`` calls of ``fn`` (the device drained before and after each)."""
    return statistics.median(_time_once(fn, device) for _ in range(repeats))


# How repeated timings of one thing become one number: "median" for the report's tables, "min" for the
# tree-budget tuner (load only adds time to a round: docs/DESIGN.md section 11).
STATISTICS: dict[str, Callable[[Sequence[float]], float]] = {"median": statistics.median, "min": min}
# the variant name of the model as it is, where T(n) is timed without switching kernels
AS_IS = "as_is"
# Rounds of the tuner's measured check against the fixed tree (measure_budget_speeds): the first pays for new shapes
CHECK_ROUNDS = 3
# The shapes the tuner considers where a tree's depth or width is "auto": every depth up to TUNE_DEPTH (one ranked run
# at that depth tells them all; the paper's trees are 6 deep), and each width of TUNE_TOP_K (a ranked run each;
# EAGLE-2's GPU trees are 10 wide)
TUNE_DEPTH = 6
TUNE_TOP_K = (2, 3, 4, 6, 8, 10)
# Widths are run in turn until one's best tree is estimated this share below the best so far: in the tunings measured
# the best tree per width rose to one peak, and no width past the first one 2% below it came back within 1% of it
# (docs/results.md, measurements that stood in the code)
TUNE_STOP = 0.02


def bushy_tree(n: int, device: torch.device, width: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, depths and the ancestor mask [n, n] of a tree of n nodes, each with up to ``width`` children (the
    shape drafts produce)."""
    parents = [0] + [(i - 1) // width for i in range(1, n)]
    depths = [0]
    for p in parents[1:]:
        depths.append(depths[p] + 1)
    anc = ancestor_mask(torch.tensor(parents, device=device), max(depths))
    return torch.arange(100, 100 + n, device=device), torch.tensor(depths, device=device), anc


def measure_target_costs(model: torch.nn.Module, sizes: Sequence[int] = (1, 2, 4, 8, 12, 16, 24, 32), *,
                         context: int = 256, repeats: int = 7, stat: str = "median",
                         greedy: bool = False) -> dict[int, float]:
    """Seconds for the target to score an n-token tree on top of a ``context``-token cache, as the engine scores it
    eagerly (``greedy``: each row's argmax, as an eager greedy cycle asks, not the logits); ``stat``: how the
    ``repeats`` rounds become one number (:data:`STATISTICS`)."""
    table = measure_target_cost_variants(model, sizes, {AS_IS: nullcontext}, context=context, repeats=repeats,
                                         stat=stat, greedy=greedy)
    return {n: times[AS_IS] for n, times in table.items()}


def measure_target_cost_variants(model: torch.nn.Module, sizes: Sequence[int],
                                 variants: Mapping[str, Callable[[], ContextManager[Any]]], *,
                                 context: int = 256, repeats: int = 7, stat: str = "median",
                                 greedy: bool = False) -> dict[int, dict[str, float]]:
    """``{n: {variant: seconds}}``: T(n) under each variant (a context manager that switches kernels),
    the median (or ``stat``, one of :data:`STATISTICS`) of :func:`target_cost_rounds`' ``repeats`` rounds."""
    if stat not in STATISTICS:
        raise ValueError(f"unknown stat {stat!r}: use {' or '.join(STATISTICS)}")
    rounds = target_cost_rounds(model, sizes, variants, context=context, repeats=repeats, greedy=greedy)
    return {n: {name: STATISTICS[stat](ts) for name, ts in row.items()} for n, row in rounds.items()}


@torch.inference_mode()
def target_cost_rounds(model: torch.nn.Module, sizes: Sequence[int],
                       variants: Mapping[str, Callable[[], ContextManager[Any]]] | None = None, *,
                       context: int = 256, repeats: int = 7, greedy: bool = False) -> dict[int, dict[str, list[float]]]:
    """``{n: {variant: [seconds of each round]}}``: T(n), an n-token tree scored on top of a ``context``-token
    cache as the engine scores it eagerly, under each variant (a context manager that switches kernels; None: the
    model as it is, variant :data:`AS_IS`); ``greedy``: the rows' argmaxes asked for, as an eager greedy cycle asks
    (a compiled one reads the logits).

    One prefill serves every measurement. Each round times every size once, and within a size every variant
    back to back, so machine drift hits all sizes and variants alike. Each timed call follows an untimed one of the
    same size and variant, as a decoding step follows a step like it: where the target's weights stream past the
    caches, a call after a wider one (whose weights pass through the caches) finds the KV cache evicted and runs cold.
    """
    variants = {AS_IS: nullcontext} if variants is None else variants
    runner = TargetRunner(model, engine_cache_len(context + max(sizes)))
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=torch.Generator().manual_seed(0)).to(runner.device)
    runner.prefill(prompt)
    # where decoding runs: a host position in an eager engine, a device one in a compiled step
    eager = not compiles_cycle(capture_of(model))
    start = context if eager else torch.full((), context, device=runner.device)
    trees = {n: bushy_tree(n, runner.device) for n in sizes}

    def verify_once(n: int) -> None:
        tokens, depths, anc = trees[n]
        runner.where.window = context + n
        runner.score(tokens, depths, anc if n > 1 else None, start, greedy and eager)  # one row: no mask

    times: dict[int, dict[str, list[float]]] = {n: {name: [] for name in variants} for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            for name, switch in variants.items():
                with switch():
                    verify_once(n)  # the lead-in (the first also loads this shape's kernels)
                    times[n][name].append(_time_once(lambda: verify_once(n), runner.device))
    return times


@torch.inference_mode()
def measure_draft_costs(draft: DraftModel, widths: Sequence[int] = (1, 4, 8), *, context: int = 256,
                        repeats: int = 7) -> dict[int, float]:
    """Seconds for one draft step (forward of ``width`` frontier nodes + logits + top-k) after ``context``."""
    p = next(draft.parameters())
    H = draft.target_config.hidden_size
    g = torch.Generator().manual_seed(0)
    cache = KVCache()
    feats = torch.randn(1, context, H, generator=g).to(p)
    ids = torch.randint(0, draft.target_config.vocab_size, (1, context), generator=g).to(p.device)
    draft(feats, ids, torch.arange(context, device=p.device)[None], cache)
    out = {}
    for w in widths:
        mask = torch.ones(1, 1, w, context + w, dtype=torch.bool, device=p.device)
        pos = torch.full((1, w), context, device=p.device)

        def step() -> None:
            o = draft(feats[:, :w], ids[:, :w], pos, cache, mask)
            draft.logits(o.a[0]).topk(4, dim=-1)
            cache.crop(context)

        step()
        out[w] = median_seconds(step, repeats, p.device)
    return out


@torch.inference_mode()
def measure_draft_cycle(draft: DraftModel, tree: TreeConfig, *, context: int = 256, accepted: int = 2,
                        repeats: int = 7, cycles: int = 20) -> float:
    """Seconds of drafting per speculative cycle: one tree proposal plus encoding ``accepted`` tokens, everything
    the drafter does (forwards, logits, candidate scoring, tree selection)."""
    p = next(draft.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, draft.target_config.vocab_size, (context,), generator=g).to(p.device)
    hidden = torch.randn(context, draft.target_config.hidden_size, generator=g).to(p)
    drafter = StaticTreeDrafter(draft, tree, engine_cache_len(context + MAX_TREE_ROOM))
    room = max(drafter.m, drafter.max_depth + 1, drafter.n_slots)  # what a cycle writes past the text (the engine's)
    drafter.cache.window = context + room
    path = drafter.max_depth + 1
    drafter.extend(hidden, ids, 0, context - 1)  # host ints, as the eager engine's

    def run() -> None:
        for _ in range(cycles):  # from the same context every cycle (its rows rewritten), so every cycle costs alike
            drafter.propose(context)
            drafter.extend(hidden[:path], ids[:path], context, accepted - 1)

    run()  # warm-up
    return median_seconds(run, repeats, p.device) / cycles


def expected_accepted(path_ranks: Sequence[Sequence[Sequence[int]]], budget: int, depth: int | None = None) -> float:
    """Mean accepted draft tokens per cycle had the tree kept only its best ``budget - 1`` nodes no deeper than
    ``depth`` (None: as deep as the ranked run drafted).

    ``path_ranks[c][j]``: for cycle c's j-th accepted node (depth j + 1), per depth cap 1..D, the running maximum
    along the path of the selection rank among the nodes no deeper than the cap (0 = best-scored node); a path's
    prefix survives a smaller tree iff it is no deeper and its ranks under that depth all fit.
    """
    if not path_ranks:
        return 0.0

    def kept(path: Sequence[Sequence[int]]) -> int:
        return sum(1 for j, caps in enumerate(path)
                   if (depth is None or j < depth) and caps[min(depth or len(caps), len(caps)) - 1] < budget - 1)

    return statistics.fmean(kept(path) for path in path_ranks)


@dataclasses.dataclass
class RankedRun:
    """A greedy run on a generous tree (``tree``: its width, depth and budget), read with its selection ranks: every
    smaller tree of its width, no deeper and within its budget, accepts what :func:`expected_accepted` says."""

    tree: TreeConfig
    path_ranks: list[list[list[int]]]
    tree_s: float  # seconds per cycle drafting the tree (its steps and forwards)
    path_s: float  # seconds per cycle encoding the accepted path (one draft forward, whatever the tree)
    cycles: int


def shape_key(depth: int, top_k: int, total_tokens: int) -> str:
    """A tree shape's name in the tuner's records: "d4 k3 n8", at the depth it has (a tree of n tokens is at most
    n - 1 deep)."""
    return f"d{min(depth, total_tokens - 1)} k{top_k} n{total_tokens}"


def parse_shape_key(key: str) -> dict[str, int] | None:
    """:func:`shape_key`'s depth, top_k and total_tokens back (None: not such a key)."""
    found = re.fullmatch(r"d(\d+) k(\d+) n(\d+)", key)
    return None if found is None else dict(zip(("depth", "top_k", "total_tokens"), map(int, found.groups())))


def draft_steps(depth: int, tree: TreeConfig, has_branch_b: bool) -> int:
    """Draft steps of a tree ``depth`` deep drafted as ``tree``: the root's candidates, then a forward and its
    candidates each (:func:`~jakiro_lib.decoding.drafting.schedule`)."""
    return len(schedule(depth, tree.ar_steps, has_branch_b))


def choose_tree(target_costs: dict[int, float], runs: Sequence[RankedRun], *, has_branch_b: bool = False,
                tune_depth: bool = False, max_budget: int | None = None) -> dict[str, Any]:
    """The tree (width, depth, budget n) maximising (E[accepted] + 1) / (T(n) + draft time per cycle) among those
    :func:`price_trees` prices."""
    table = price_trees(target_costs, runs, has_branch_b=has_branch_b, tune_depth=tune_depth, max_budget=max_budget)
    if not table:
        raise ValueError("no tree of the ranked runs' widths and depths holds any of the candidate budgets")
    best = max(table, key=lambda row: row["tokens_per_s"])
    return {"best": best["total_tokens"], "depth": best["depth"], "top_k": best["top_k"], "table": table,
            "vanilla_tokens_per_s": 1.0 / target_costs[1] if 1 in target_costs else None}


def price_trees(target_costs: dict[int, float], runs: Sequence[RankedRun], *, has_branch_b: bool = False,
                tune_depth: bool = False, max_budget: int | None = None) -> list[dict[str, Any]]:
    """Expected tokens per cycle, verify and draft time and tokens/s of every tree the runs tell: each run its
    width's trees at its own depth, or (``tune_depth``) at every depth up to it; a tree of n tokens is at most n - 1
    deep and at most as big as its candidate pool. Draft time is the run's tree time scaled by the draft steps
    (shallower trees draft fewer layers), and its accepted path's encoding as it was."""
    table, seen = [], set()
    for run in runs:
        K, deepest = run.tree.top_k, run.tree.depth
        for d in range(1, deepest + 1) if tune_depth else (deepest,):
            for n, t in sorted(target_costs.items()):
                e = min(d, n - 1)  # the depth a tree of n tokens has
                if n < 2 or (max_budget and n > max_budget) or (K, e, n) in seen \
                        or n > pool_size(schedule(e, run.tree.ar_steps, has_branch_b), K):
                    continue
                seen.add((K, e, n))
                acc = expected_accepted(run.path_ranks, n, e)
                draft_s = run.path_s + run.tree_s * draft_steps(e, run.tree, has_branch_b) / draft_steps(
                    min(deepest, run.tree.total_tokens - 1), run.tree, has_branch_b)
                table.append({"depth": e, "top_k": K, "total_tokens": n, "expected_tokens_per_cycle": acc + 1,
                              "verify_s": t, "draft_s": draft_s, "tokens_per_s": (acc + 1) / (t + draft_s)})
    return table


@torch.inference_mode()
def measure_tree_speeds(target: Any, draft: DraftModel, trees: Mapping[str, TreeConfig],
                        prompts: Sequence[torch.Tensor], *, max_new_tokens: int = 64, rounds: int = CHECK_ROUNDS,
                        compile: bool = False) -> dict[str, float]:
    """Greedy tokens/s of ``draft`` on each of ``trees`` on ``prompts`` (new tokens over whole generations' wall
    time). Each round runs every prompt on every tree back to back; each (prompt, tree) keeps its fastest of
    ``rounds`` runs (at least 2: the first run of a shape pays its set-up, with ``compile`` a compilation or a
    recording)."""
    if rounds < 2:
        raise ValueError(f"rounds must be >= 2 (the first run of a shape pays its set-up), got {rounds}")
    fastest: dict[tuple[int, str], float] = {}
    tokens: dict[tuple[int, str], int] = {}
    for _ in range(rounds):
        for i, ids in enumerate(prompts):
            for name, tree in trees.items():
                res = _generate(target, draft, tree, ids, max_new_tokens, compile=compile)
                fastest[i, name] = min(fastest.get((i, name), math.inf), res.wall_time)
                tokens[i, name] = res.new_tokens
    return {name: sum(tokens[i, name] for i in range(len(prompts))) / sum(fastest[i, name] for i in range(len(prompts)))
            for name in trees}


def _generate(target: Any, draft: DraftModel, tree: TreeConfig, ids: torch.Tensor, max_new_tokens: int, *,
              compile: bool = False, clock: StepClock | None = None, ranked: bool = False) -> GenerationResult:
    """Greedy decoding of ``ids`` with ``draft`` on ``tree`` (its drafted part: a lookup chain is not what the
    budget sizes); ``clock``, ``ranked``: as :func:`~jakiro_lib.decoding.static.static_generate` takes them."""
    return static_generate(target.model, draft, dataclasses.replace(tree, lookup_tokens=0), ids, compile=compile,
                           max_new_tokens=max_new_tokens, eos_token_ids=target.eos_token_ids,
                           max_context=target.config.max_context, clock=clock, ranked=ranked)


def ranked_run(target: Any, draft: DraftModel, tree: TreeConfig, prompts: Sequence[torch.Tensor],
               max_new_tokens: int) -> RankedRun:
    """Greedy decoding of ``prompts`` on ``tree``, read with its selection ranks and its drafting timed (eager: the
    tree's steps, its forwards and the path's encoding), after one untimed generation (first calls pay for kernel
    loading, library handles and, under capture "draft", the tree's compilation)."""
    _generate(target, draft, tree, prompts[0], min(8, max_new_tokens))
    clock = StepClock(target.device)
    ranks: list[list[list[int]]] = []
    for ids in prompts:
        ranks += _generate(target, draft, tree, ids, max_new_tokens, clock=clock, ranked=True).path_ranks
    cycles = max(clock.entries["cycle"], 1)
    drafting = sum(clock.seconds[s] for s in ("draft", "draft_forward", "update")) / cycles
    # the accepted path's encoding: a mean draft forward (the compiled tree's are not clocked apart) and the update
    path = clock.seconds["draft_forward"] / max(clock.entries["draft_forward"], 1) + clock.seconds["update"] / cycles
    return RankedRun(tree, ranks, tree_s=drafting - path, path_s=path, cycles=clock.entries["cycle"])


def tune_tree(target: Any, draft: DraftModel, tree: TreeConfig, prompts: Sequence[torch.Tensor], *,
              candidates: Sequence[int] = (2, 3, 4, 6, 8, 12, 16, 24, 32), max_new_tokens: int = 64,
              context: int = 256, target_costs: dict[int, float] | None = None,
              reference: TreeConfig | None = None, compile: bool = False,
              check_rounds: int = CHECK_ROUNDS, measure_sizes: Sequence[int] = ()) -> dict[str, Any]:
    """Pick a tree for this machine: its budget among ``candidates``, and its depth and width where ``tree`` has them
    "auto", from measured T(n) and one ranked greedy run per width (:data:`TUNE_TOP_K`) at the largest budget and
    depth (:data:`TUNE_DEPTH`).

    ``target_costs`` (from :func:`measure_target_costs`) skips timing the target at the sizes it has. ``reference``:
    the fixed tree; where the estimate chooses another, both run on ``prompts`` as the method runs (eager, or
    ``compile``: captured), each the fastest of ``check_rounds`` (:func:`measure_tree_speeds`), and the reference is
    kept unless strictly beaten. ``measure_sizes``: budgets of the estimate's shape also run in that
    check, where the estimate's eager timings do not describe the engine (a captured one). Returns the choice
    (``best``, the budget; ``depth``, ``top_k``; with a reference ``estimated``, ``fixed`` and
    ``measured_tokens_per_s``, keyed by :func:`shape_key`), the estimate's table and the ranked runs.
    """
    missing = sorted({1, *candidates} - set(target_costs or {}))
    if missing:  # T(n) of the sizes not given, each its fastest round as the tuner times (docs/DESIGN.md section 11)
        target_costs = {**(target_costs or {}), **measure_target_costs(target.model, sizes=missing, context=context,
                                                                       stat="min")}
    costs = {n: target_costs[n] for n in sorted({1, *candidates})}
    widths = TUNE_TOP_K if tree.top_k == "auto" else (tree.top_k,)
    deepest = TUNE_DEPTH if tree.depth == "auto" else tree.depth
    priced = functools.partial(price_trees, costs, has_branch_b=draft.cfg.branch_b, tune_depth=tree.depth == "auto")
    runs: list[RankedRun] = []
    peak = 0.0  # the best tree's estimated tokens/s so far
    for K in sorted(widths):  # in turn, until a width's best tree falls TUNE_STOP below the peak
        big = dataclasses.replace(tree, depth=deepest, top_k=K, total_tokens=max(candidates))
        runs.append(ranked_run(target, draft, big, prompts, max_new_tokens))
        top = max((row["tokens_per_s"] for row in priced(runs[-1:])), default=0.0)
        if top < peak * (1 - TUNE_STOP):
            break
        peak = max(peak, top)
    choice = choose_tree(costs, runs, has_branch_b=draft.cfg.branch_b, tune_depth=tree.depth == "auto")
    choice["ranked_runs"] = [{"depth": r.tree.depth, "top_k": r.tree.top_k, "total_tokens": r.tree.total_tokens,
                              "cycles": r.cycles, "draft_time_per_cycle_s": r.tree_s + r.path_s, "tree_s": r.tree_s,
                              "path_s": r.path_s} for r in runs]
    choice["cycles_observed"] = sum(r.cycles for r in runs)
    if reference is not None:
        def shaped(depth: int, top_k: int, n: int) -> TreeConfig:
            return dataclasses.replace(tree, depth=depth, top_k=top_k, total_tokens=n)

        def key(t: TreeConfig) -> str:
            return shape_key(t.depth, t.top_k, t.total_tokens)

        best = shaped(choice["depth"], choice["top_k"], choice["best"])
        depth = best.depth if tree.depth == "auto" else tree.depth  # of the other budgets run
        tried = {key(t): t for t in (best, reference, *(shaped(depth, best.top_k, n) for n in measure_sizes
                                                        if n in candidates))}
        fixed = key(reference)
        choice["estimated"], choice["fixed"] = key(best), fixed
        choice["estimated_best"], choice["fixed_tokens"] = best.total_tokens, reference.total_tokens
        if len(tried) > 1:
            speeds = measure_tree_speeds(target, draft, tried, prompts, max_new_tokens=max_new_tokens,
                                         rounds=check_rounds, compile=compile)
            choice["measured_tokens_per_s"] = speeds
            kept = tried[max(tried, key=lambda k: (speeds[k], k == fixed))]  # the reference unless beaten
            choice.update(best=kept.total_tokens, depth=kept.depth, top_k=kept.top_k)
    return choice
