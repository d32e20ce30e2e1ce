"""What a decoding cycle costs, taken apart, on the machine it runs on: per method the table of docs/DESIGN.md
section 12, "What a cycle costs", with each part's operators (:data:`PARTS`) and the host's time between steps.
Times are means over the timed generations' cycles; operators are counted on a separate generation of the first
prompt (counting slows them down)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..config import OUR_KINDS, SPEC, Profile
from ..data.chat import format_prompt_ids
from ..data.conversations import load_questions
from ..decoding.methods import MethodSpec
from ..decoding.result import GenerationResult
from ..decoding.static import static_generate
from ..layout import RunLayout
from ..models.draft import DraftModel
from ..models.target import Target, capture_of, set_capture
from .budgets import resolve_tree_budgets
from .clock import StepClock
from .costmodel import AS_IS, shape_key, target_cost_rounds
from .methods import profile_methods

# the methods the table shows by default: plain decoding, EAGLE-2 and Jakiro at the fixed and tuned trees, CEPD, a chain
CYCLE_METHODS = ("vanilla", "eagle2_auto", "jakiro_auto", "eagle2", "jakiro", "jakiro_cepd", "jakiro_lookup")

# rounds of T(n) after each prompt; T(n) is their mean over the prompts, as a cycle's time is a mean over its cycles
# (a median and a mean of skewed times differ, and the overhead would count the difference as the cycle's)
TN_REPEATS = 5

# a cycle's parts as the table names them, each the clock steps it sums
PARTS = {"verify": ("verify",), "draft_forward": ("draft_forward",), "tree": ("draft", "cycle"),
         "evaluate": ("evaluate",), "update": ("update",), "read": ("read",)}
COLUMNS = ("method", "tree", "rows", "cycles", "tau", "draft_forwards", "plain_ms", "cycle_ms", "cycle_per_plain",
           "tn_ms", "tn_median_ms", *(f"{p}_ms" for p in PARTS), "host_ms", "overhead", "overhead_per_forward",
           *(f"{p}_ops" for p in PARTS), "cycle_ops")


@dataclass
class _Timed:
    """One method's timed generations: their clock, cycles, emitted tokens and verified rows."""

    clock: StepClock
    wall: float = 0.0  # seconds of cycles (generation less prefill)
    cycles: int = 0
    emitted: int = 0
    rows: int = 0
    context: int = 0  # positions summed over cycles (the mean context T(n) is timed at)
    unclocked: int = 0  # draft forwards inside compiled tree pools (target.capture "draft"): the clock sees the call

    def add(self, r: GenerationResult, pooled: bool = False) -> None:
        self.wall += r.wall_time - r.prefill_time
        self.unclocked += r.draft_forwards if pooled else 0
        self.cycles += r.cycles
        self.emitted += sum(r.accepted)
        self.rows += sum(r.tree_sizes) if r.tree_sizes else r.cycles
        length = r.prompt_len + 1
        for a in r.accepted:
            self.context += length
            length += a


def _generate(target: Target, draft: DraftModel | None, spec: MethodSpec, ids: torch.Tensor, max_new_tokens: int,
              clock: StepClock | None) -> GenerationResult:
    tree = spec.tree if spec.kind == SPEC else None
    return static_generate(target.model, draft, tree, ids, max_new_tokens=max_new_tokens,
                           eos_token_ids=target.eos_token_ids, max_context=target.config.max_context, clock=clock)


def count_operators(target: Target, draft: DraftModel | None, spec: MethodSpec, ids: torch.Tensor, *,
                    max_new_tokens: int) -> StepClock:
    """The method's greedy generation of ``ids`` with its operators counted per step (a compiled tree pool counted
    eager: its kernels are not aten operators, and torch.compile runs under no dispatch mode)."""
    counted = StepClock(target.device, count_ops=True)
    capture = capture_of(target.model)
    set_capture(target.model, "none" if capture == "draft" else capture)
    try:
        with counted:
            _generate(target, draft, spec, ids, max_new_tokens, counted)
    finally:
        set_capture(target.model, capture)
    return counted


def tree_label(spec: MethodSpec) -> str:
    """A method's tree as the table names it: "d2 k6 n8" (depth, width, budget), "+10" for a lookup chain of up to 10
    tokens; "" for plain decoding."""
    tree = spec.tree
    if spec.kind != SPEC or tree is None:
        return ""
    drafted = shape_key(tree.depth, tree.top_k, tree.total_tokens) if spec.draft else ""
    return drafted + (f"+{tree.lookup_tokens}" if tree.lookup_tokens else "")


def cycle_row(name: str, tree: str, timed: _Timed, counted: StepClock, plain_s: float,
              tn: dict[int, list[float]]) -> dict[str, Any]:
    """One method's row of the table (:data:`COLUMNS`; ``tree``: :func:`tree_label`; ``tn``: every timed round of
    T(n), their mean the table's T(n)), times in ms per cycle."""
    cycles = max(timed.cycles, 1)
    per_cycle = {p: 1e3 * sum(timed.clock.seconds.get(s, 0.0) for s in steps) / cycles for p, steps in PARTS.items()}
    cycle_ms = 1e3 * timed.wall / cycles
    rows = timed.rows / cycles
    tn_rounds = tn[max(1, round(rows))]
    tn_ms = 1e3 * statistics.fmean(tn_rounds)
    forwards = (timed.clock.entries.get("draft_forward", 0) + timed.unclocked) / cycles  # tree's, accepted path's
    overhead = (cycle_ms - tn_ms) / (1e3 * plain_s)
    n_counted = max(counted.entries["cycle"], 1)
    row: dict[str, Any] = {
        "method": name, "tree": tree, "rows": rows, "cycles": timed.cycles, "tau": timed.emitted / cycles,
        "draft_forwards": forwards, "plain_ms": 1e3 * plain_s, "cycle_ms": cycle_ms,
        "cycle_per_plain": cycle_ms / (1e3 * plain_s), "tn_ms": tn_ms,
        "tn_median_ms": 1e3 * statistics.median(tn_rounds),
        **{f"{p}_ms": v for p, v in per_cycle.items()}, "host_ms": cycle_ms - sum(per_cycle.values()),
        "overhead": overhead, "overhead_per_forward": overhead / forwards if forwards else float("nan"),
        **{f"{p}_ops": sum(counted.ops.get(s, 0) for s in steps) / n_counted for p, steps in PARTS.items()}}
    row["cycle_ops"] = sum(row[f"{p}_ops"] for p in PARTS)
    return row


def cycle_table(target: Target, methods: dict[str, MethodSpec], prompts: Sequence[torch.Tensor], *,
                max_new_tokens: int = 64, plain: str = "vanilla") -> list[dict[str, Any]]:
    """The rows of the cycle-cost table for ``methods`` (our kinds; ``plain``, plain decoding, among them: its
    cycle is the plain step) on ``prompts``, greedy, in the order given. The methods' generations are timed step by
    step (after one warm-up each) interleaved prompt by prompt, the order turning by one each prompt, and after each
    prompt :data:`TN_REPEATS` rounds of T(n) for every n a method may verify, at plain decoding's mean context so far
    (T(n): the mean of every round, as the cycles' times are means; ``tn_median_ms`` their median), so that the
    machine's drift reaches every method and T(n) alike; then operators counted on the first prompt."""
    if plain not in methods:
        raise ValueError(f"the cycle-cost table needs plain decoding ({plain!r}) among the methods")
    drafts = {name: spec.load_draft(target) for name, spec in methods.items()}
    for name, spec in methods.items():  # first calls load kernels
        _generate(target, drafts[name], spec, prompts[0], min(8, max_new_tokens), None)
    timed = {name: _Timed(StepClock(target.device)) for name in methods}
    most = max(s.tree.total_tokens + s.tree.lookup_tokens if s.kind == SPEC else 1 for s in methods.values())
    tn_rounds: dict[int, list[float]] = {n: [] for n in range(1, most + 1)}
    pooled, names, base = capture_of(target.model) == "draft", list(methods), timed[plain]
    for i, ids in enumerate(prompts):
        turn = i % len(names)
        for name in names[turn:] + names[:turn]:
            result = _generate(target, drafts[name], methods[name], ids, max_new_tokens, timed[name].clock)
            timed[name].add(result, pooled=pooled)
        context = round(base.context / max(base.cycles, 1))
        for n, rounds in target_cost_rounds(target.model, list(tn_rounds), context=context, repeats=TN_REPEATS,
                                            greedy=True).items():
            tn_rounds[n].extend(rounds[AS_IS])
    counted = {name: count_operators(target, drafts[name], spec, prompts[0], max_new_tokens=max_new_tokens)
               for name, spec in methods.items()}
    plain_s = base.wall / max(base.cycles, 1)
    return [cycle_row(name, tree_label(spec), timed[name], counted[name], plain_s, tn_rounds)
            for name, spec in methods.items()]


def cycle_methods(profile: Profile, run_dir: Path, target: Target,
                  names: Sequence[str] | None = None) -> dict[str, MethodSpec]:
    """The main study's methods ``names`` (of our kinds; None: the :data:`CYCLE_METHODS` the study runs; plain
    decoding, the table's unit, added first where missing) on ``profile``'s drafts in ``run_dir``, tuned budgets
    resolved as the benchmark resolves them (the run's ``tree_budgets.json``, tuned where missing)."""
    main = profile_methods(profile, RunLayout(run_dir).drafts, "main")
    ours = [n for n, m in main.items() if m.kind in OUR_KINDS]
    if names is None:
        names = [n for n in CYCLE_METHODS if n in ours]
    elif "vanilla" not in names:
        names = ["vanilla", *names]
    unknown = [n for n in names if n not in ours]
    if unknown:
        raise ValueError(f"no cycle to time for {', '.join(unknown)}: choose from {', '.join(ours)}")
    methods, _ = resolve_tree_budgets(profile, run_dir, {n: main[n] for n in names}, target)
    return methods


def cycle_prompts(profile: Profile, target: Target, limit: int | None) -> list[torch.Tensor]:
    """The first turns of the profile's benchmarks' first ``limit`` questions (default ``bench.limit``), as ids."""
    limit = profile.bench.limit if limit is None else limit
    questions = [q for b in profile.bench.benchmarks for q in load_questions(b, limit=limit)]
    return [format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}]) for q in questions]
