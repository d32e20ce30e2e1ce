"""Notebook 02's performance section: the cost model, the tree budgets, the goals and the levers, as the report's
tables (the measuring is :mod:`jakiro_lib.measure.perf`'s)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from ..measure.budgets import fixed_tree
from ..measure.methods import portable
from ..measure.cycles import COLUMNS as CYCLE_COLUMNS, cycle_methods, cycle_prompts, cycle_table
from ..measure.perf import cost_model, lever_table, performance_targets
from .context import StudyContext, get_target
from ..files import relative_path, write_json, write_table
from ..machine import environment
from ..models import kernels
from ..models.draft import resolve_draft_dtype
from .tables import load_study_records, tree_budget_table


def write_performance_report(ctx: StudyContext, main: pd.DataFrame, *, target: Any = None) -> dict[str, pd.DataFrame]:
    """Notebook 02's performance section: cost model, tree-budget tuning and the goals table, written as
    ``cost_model_target.csv``, ``cost_model_draft.csv``, ``cost_model_draft_cycle.csv``, ``tree_budget.csv``,
    ``performance_targets.csv`` and ``levers.csv`` in the report directory. Returns the six tables."""
    target = target or get_target(ctx)
    bench = ctx.profile.bench
    fixed = fixed_tree(ctx.profile.tree, ctx.profile.tree)
    costs = cost_model(target, ctx.layout.drafts, drafts=(bench.eagle2_draft, bench.jakiro_draft),
                       widths=sorted({1, fixed.top_k}), tree=ctx.profile.tree,
                       draft_dtype=resolve_draft_dtype(bench.draft_dtype, ctx.profile.target))
    levers = lever_table(costs["target"], costs["draft"], main, tree_tokens=fixed.total_tokens,
                         draft_cycle=costs["draft_cycle"])
    tables = {"cost_model_target": costs["target"], "cost_model_draft": costs["draft"],
              "cost_model_draft_cycle": costs["draft_cycle"], "tree_budget": tree_budget_table(ctx.run_dir, "main"),
              "performance_targets": performance_targets(main, load_study_records(ctx.run_dir, "main")),
              "levers": levers}
    for name, df in tables.items():
        write_table(Path(ctx.report_dir) / f"{name}.csv", df)
    return tables


def cycle_cost_table(ctx: StudyContext, *, names: Sequence[str] | None = None, limit: int | None = None,
                     max_new_tokens: int | None = None, out_dir: str | Path | None = None,
                     target: Any = None) -> pd.DataFrame:
    """What a cycle costs on this machine, step by step, against a plain step (:mod:`jakiro_lib.measure.cycles`):
    for ``names`` (default the :data:`~jakiro_lib.measure.cycles.CYCLE_METHODS` the main study runs), on the first
    turns of ``limit`` questions a benchmark (default ``bench.limit``), ``max_new_tokens`` each (default the
    profile's); ``cycles.csv`` and ``cycles_config.json`` (settings, environment) in ``out_dir`` (default the
    report directory)."""
    target = target or get_target(ctx)
    methods = cycle_methods(ctx.profile, ctx.run_dir, target, names)
    prompts = cycle_prompts(ctx.profile, target, limit)
    table = pd.DataFrame(cycle_table(target, methods, prompts, max_new_tokens=max_new_tokens
                                     or ctx.profile.bench.max_new_tokens), columns=list(CYCLE_COLUMNS))
    out = Path(out_dir if out_dir is not None else ctx.report_dir)
    write_table(out / "cycles.csv", table)
    write_json(out / "cycles_config.json", {
        "profile": ctx.profile.to_dict(), "run_dir": relative_path(ctx.run_dir, out), "prompts": len(prompts),
        "methods": {k: portable(v) for k, v in methods.items()}, "environment": environment(target.device),
        "packed_gemm": kernels.gemm_choice(target.model)})
    return table
