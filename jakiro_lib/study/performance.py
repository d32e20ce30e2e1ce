"""Notebook 02's performance section: the cost model, the tree budgets, the goals and the levers, as the report's
tables (the measuring is :mod:`jakiro_lib.measure.perf`'s)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from ..config import OUR_KINDS
from ..measure.budgets import fixed_tree_tokens
from ..measure.methods import profile_methods
from ..measure.cycles import COLUMNS as CYCLE_COLUMNS, CYCLE_METHODS, cycle_methods, cycle_prompts, cycle_table
from ..measure.perf import cost_model, lever_table, performance_targets
from .context import StudyContext, get_target
from ..files import write_table
from .tables import load_study_records, tree_budget_table


def write_performance_report(ctx: StudyContext, main: pd.DataFrame, *, target: Any = None) -> dict[str, pd.DataFrame]:
    """Notebook 02's performance section: cost model, tree-budget tuning and the goals table, written as
    ``cost_model_target.csv``, ``cost_model_draft.csv``, ``cost_model_draft_cycle.csv``, ``tree_budget.csv``,
    ``performance_targets.csv`` and ``levers.csv`` in the report directory. Returns the six tables."""
    target = target or get_target(ctx)
    bench = ctx.profile.bench
    costs = cost_model(target, ctx.layout.drafts, drafts=(bench.eagle2_draft, bench.jakiro_draft),
                       widths=sorted({1, ctx.profile.tree.top_k}), tree=ctx.profile.tree)
    levers = lever_table(costs["target"], costs["draft"], main, tree_tokens=fixed_tree_tokens(ctx.profile.tree),
                         draft_cycle=costs["draft_cycle"])
    tables = {"cost_model_target": costs["target"], "cost_model_draft": costs["draft"],
              "cost_model_draft_cycle": costs["draft_cycle"], "tree_budget": tree_budget_table(ctx.run_dir, "main"),
              "performance_targets": performance_targets(main, load_study_records(ctx.run_dir, "main")),
              "levers": levers}
    for name, df in tables.items():
        write_table(Path(ctx.report_dir) / f"{name}.csv", df)
    return tables


def cycle_cost_table(ctx: StudyContext, *, target: Any = None, limit: int = 3,
                     max_new_tokens: int = 64) -> pd.DataFrame:
    """What a cycle costs on this machine, step by step, against a plain step (:mod:`jakiro_lib.measure.cycles`),
    for the methods of :data:`~jakiro_lib.measure.cycles.CYCLE_METHODS` the main study runs, on the first turns of
    at most ``limit`` questions a benchmark (a few minutes on a CPU); written as ``cycles.csv`` in the report."""
    target = target or get_target(ctx)
    ours = {n for n, m in profile_methods(ctx.profile, ctx.layout.drafts, "main").items() if m.kind in OUR_KINDS}
    methods = cycle_methods(ctx.profile, ctx.run_dir, target, [n for n in CYCLE_METHODS if n in ours])
    prompts = cycle_prompts(ctx.profile, target, min(limit, ctx.profile.bench.limit or limit))
    rows = cycle_table(target, methods, prompts, max_new_tokens=min(max_new_tokens, ctx.profile.bench.max_new_tokens))
    table = pd.DataFrame(rows, columns=list(CYCLE_COLUMNS))
    write_table(Path(ctx.report_dir) / "cycles.csv", table)
    return table
