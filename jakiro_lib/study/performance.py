"""Notebook 02's performance section: the cost model, the tree budgets, the goals and the levers, as the report's
tables (the measuring is :mod:`jakiro_lib.measure.perf`'s)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from ..measure.budgets import fixed_tree_tokens
from ..measure.perf import cost_model, lever_table, performance_targets
from .context import get_target
from ..files import write_table
from .tables import load_study_records, tree_budget_table


def write_performance_report(ctx: Any, main: pd.DataFrame, *, target: Any = None) -> dict[str, pd.DataFrame]:
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
