"""Measured cost model of one speculative cycle, and the tree budget it implies on this machine (docs/DESIGN.md
sections 9 and 11). One greedy run with a generous tree records, per cycle, the selection rank of each accepted node;
the accepted length a smaller top-n tree would have had is then exact (greedy acceptance at a node depends only on its
ancestors, and the top-n tree is a prefix of the score order), and :func:`choose_total_tokens` weighs it against the
measured costs."""
from __future__ import annotations

import dataclasses
import math
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
from ..decoding.static_tree import StaticTreeDrafter, ancestor_mask
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
# Rounds of the tuner's measured check against the fixed tree (measure_budget_speeds): the first pays for new shapes
CHECK_ROUNDS = 3


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
    table = measure_target_cost_variants(model, sizes, {"s": nullcontext}, context=context, repeats=repeats,
                                         stat=stat, greedy=greedy)
    return {n: times["s"] for n, times in table.items()}


@torch.inference_mode()
def measure_target_cost_variants(model: torch.nn.Module, sizes: Sequence[int],
                                 variants: Mapping[str, Callable[[], ContextManager[Any]]], *,
                                 context: int = 256, repeats: int = 7, stat: str = "median",
                                 greedy: bool = False) -> dict[int, dict[str, float]]:
    """``{n: {variant: seconds}}``: T(n) under each variant (a context manager that switches kernels),
    the median (or ``stat``, one of :data:`STATISTICS`) over ``repeats`` rounds; ``greedy``: the rows' argmaxes
    asked for, as an eager greedy cycle asks (a compiled one reads the logits).

    One prefill serves every measurement. Each round times every size once, and within a size every variant
    back to back, so machine drift hits all sizes and variants alike (and T(1) follows other shapes, as in
    decoding).
    """
    if stat not in STATISTICS:
        raise ValueError(f"unknown stat {stat!r}: use {' or '.join(STATISTICS)}")
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

    for n in sizes:
        for switch in variants.values():
            with switch():
                verify_once(n)  # warm-up for this shape and these kernels
    times: dict[int, dict[str, list[float]]] = {n: {name: [] for name in variants} for n in sizes}
    for _ in range(repeats):
        for n in sizes:
            for name, switch in variants.items():
                with switch():
                    times[n][name].append(_time_once(lambda: verify_once(n), runner.device))
    return {n: {name: STATISTICS[stat](ts) for name, ts in row.items()} for n, row in times.items()}


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
    zero, base = (torch.full((), n, device=p.device) for n in (0, context))
    drafter.extend(hidden, ids, zero, base - 1)
    path = drafter.max_depth + 1
    last = torch.full((), accepted - 1, device=p.device)

    def run() -> None:
        for _ in range(cycles):  # from the same context every cycle (its rows rewritten), so every cycle costs alike
            drafter.propose(base)
            drafter.extend(hidden[:path], ids[:path], base, last)

    run()  # warm-up
    return median_seconds(run, repeats, p.device) / cycles


def expected_accepted(path_ranks: Sequence[Sequence[int]], budget: int) -> float:
    """Mean accepted draft tokens per cycle had the tree kept only its best ``budget - 1`` nodes.

    ``path_ranks[c]`` lists, for cycle c, the running maximum of the selection rank along the accepted
    path (0 = best-scored node); a prefix survives a smaller budget iff its ranks all fit.
    """
    if not path_ranks:
        return 0.0
    return statistics.fmean(sum(1 for r in ranks if r < budget - 1) for ranks in path_ranks)


def choose_total_tokens(target_costs: dict[int, float], draft_cycle_time: float | dict[int, float],
                        path_ranks: Sequence[Sequence[int]], *, max_budget: int | None = None) -> dict[str, Any]:
    """The tree budget n maximising (E[accepted(n)] + 1) / (T(n) + draft time per cycle).

    ``draft_cycle_time``: seconds per cycle, the same for every n or per n (small budgets draft fewer
    layers, see :func:`draft_time_per_budget`).
    """
    table = []
    for n, t in sorted(target_costs.items()):
        if n < 2 or (max_budget and n > max_budget):
            continue
        acc = expected_accepted(path_ranks, n)
        d = draft_cycle_time[n] if isinstance(draft_cycle_time, dict) else draft_cycle_time
        table.append({"total_tokens": n, "expected_tokens_per_cycle": acc + 1, "verify_s": t, "draft_s": d,
                      "tokens_per_s": (acc + 1) / (t + d)})
    best = max(table, key=lambda row: row["tokens_per_s"])
    return {"best": best["total_tokens"], "table": table,
            "vanilla_tokens_per_s": 1.0 / target_costs[1] if 1 in target_costs else None}


def draft_time_per_budget(measured: float, tree: TreeConfig, has_branch_b: bool,
                          budgets: Sequence[int]) -> dict[int, float]:
    """Draft seconds per cycle at each budget, estimated from ``measured`` at the largest one by the draft forwards
    per cycle (a budget of n drafts at most n - 1 layers: :func:`~jakiro_lib.decoding.drafting.draft_schedule`)."""
    def forwards(n: int) -> int:
        return len(schedule(min(tree.depth, n - 1), tree.ar_steps, has_branch_b))  # (steps - 1) + 1

    full = forwards(max(budgets))
    return {n: measured * forwards(n) / full for n in budgets}


@torch.inference_mode()
def measure_budget_speeds(target: Any, draft: DraftModel, tree: TreeConfig, prompts: Sequence[torch.Tensor],
                          budgets: Sequence[int], *, max_new_tokens: int = 64, rounds: int = CHECK_ROUNDS,
                          compile: bool = False) -> dict[int, float]:
    """Greedy tokens/s of ``draft`` on ``tree`` at each of ``budgets`` on ``prompts`` (new tokens over whole
    generations' wall time). Each round runs every prompt at every budget back to back; each (prompt, budget) keeps
    its fastest of ``rounds`` runs (at least 2: the first run of a shape pays its set-up, with ``compile`` a
    compilation or a recording)."""
    if rounds < 2:
        raise ValueError(f"rounds must be >= 2 (the first run of a shape pays its set-up), got {rounds}")
    fastest: dict[tuple[int, int], float] = {}
    tokens: dict[tuple[int, int], int] = {}
    for _ in range(rounds):
        for i, ids in enumerate(prompts):
            for n in budgets:
                res = _generate(target, draft, dataclasses.replace(tree, total_tokens=n), ids, max_new_tokens,
                                compile=compile)
                fastest[i, n] = min(fastest.get((i, n), math.inf), res.wall_time)
                tokens[i, n] = res.new_tokens
    return {n: sum(tokens[i, n] for i in range(len(prompts))) / sum(fastest[i, n] for i in range(len(prompts)))
            for n in budgets}


def _generate(target: Any, draft: DraftModel, tree: TreeConfig, ids: torch.Tensor, max_new_tokens: int, *,
              compile: bool = False, clock: StepClock | None = None, ranked: bool = False) -> GenerationResult:
    """Greedy decoding of ``ids`` with ``draft`` on ``tree`` (its drafted part: a lookup chain is not what the
    budget sizes); ``clock``, ``ranked``: as :func:`~jakiro_lib.decoding.static.static_generate` takes them."""
    return static_generate(target.model, draft, dataclasses.replace(tree, lookup_tokens=0), ids, compile=compile,
                           max_new_tokens=max_new_tokens, eos_token_ids=target.eos_token_ids,
                           max_context=target.config.max_context, clock=clock, ranked=ranked)


def tune_total_tokens(target: Any, draft: DraftModel, tree: TreeConfig, prompts: Sequence[torch.Tensor], *,
                      candidates: Sequence[int] = (2, 3, 4, 6, 8, 12, 16, 24, 32), max_new_tokens: int = 64,
                      context: int = 256, target_costs: dict[int, float] | None = None,
                      reference: int | None = None, compile: bool = False,
                      check_rounds: int = CHECK_ROUNDS, measure_sizes: Sequence[int] = ()) -> dict[str, Any]:
    """Pick ``tree.total_tokens`` for this machine: measured T(n) + one greedy run at the largest budget.

    ``target_costs`` (from :func:`measure_target_costs`, covering ``candidates`` and n = 1) skips timing the
    target. ``reference``: the fixed tree's budget; where the estimate chooses another, both run on ``prompts`` as
    the method runs (eager, or ``compile``: captured), each the fastest of ``check_rounds``
    (:func:`measure_budget_speeds`), and the reference is kept unless strictly beaten. ``measure_sizes``: budgets
    also run in that check, where the estimate's eager timings do not describe the engine (a captured one).
    Returns the choice (``best``; with a reference ``estimated_best``, ``fixed_tokens``,
    ``measured_tokens_per_s``) and the estimate's table.
    """
    big = dataclasses.replace(tree, total_tokens=max(candidates))
    # Not counted: first calls pay for kernel loading and library handles
    _generate(target, draft, big, prompts[0], min(8, max_new_tokens))
    ranks: list[list[int]] = []
    clock = StepClock(target.device)  # eager: drafting is the tree's steps, its forwards and the path's encoding
    cycles = 0
    for ids in prompts:
        res = _generate(target, draft, big, ids, max_new_tokens, clock=clock, ranked=True)
        ranks += res.path_ranks
        cycles += res.cycles
    draft_time = sum(clock.seconds[s] for s in ("draft", "draft_forward", "update"))
    if target_costs is None:
        target_costs = measure_target_costs(target.model, sizes=sorted({1, *candidates}), context=context)
    missing = sorted({1, *candidates} - set(target_costs))
    if missing:
        raise ValueError(f"target_costs lack the tree sizes {missing}")
    costs = {n: target_costs[n] for n in sorted({1, *candidates})}
    per_cycle = draft_time / max(cycles, 1)
    budgets = [n for n in costs if n >= 2]
    choice = choose_total_tokens(costs, draft_time_per_budget(per_cycle, big, draft.cfg.branch_b, budgets), ranks)
    choice["draft_time_per_cycle_s"] = per_cycle
    choice["cycles_observed"] = int(cycles)
    if reference is not None:
        choice["estimated_best"], choice["fixed_tokens"] = choice["best"], reference
        tried = sorted({choice["best"], reference, *(n for n in measure_sizes if n in candidates)})
        if len(tried) > 1:
            speeds = measure_budget_speeds(target, draft, tree, prompts, tried, max_new_tokens=max_new_tokens,
                                           rounds=check_rounds, compile=compile)
            choice["measured_tokens_per_s"] = {str(n): v for n, v in speeds.items()}
            choice["best"] = max(tried, key=lambda n: (speeds[n], n == reference))  # the reference unless beaten
    return choice
