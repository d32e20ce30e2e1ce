"""Where the time goes and whether speculation pays on this machine (the performance report).

Two tables, both from measurements of the same run:

* :func:`cost_model` times what one speculative cycle is made of on the profile's target: the target
  scoring an n-token tree, T(n), and one draft step of every trained draft, with its reduced draft
  vocabulary and with the full one (the reduced-vocabulary lever, timed directly).
* :func:`performance_targets` reads the main study's summary and checks the speed goals we hold
  ourselves to (Jakiro against HF ``generate``, EAGLE-2 and prompt lookup; our vanilla loop against HF
  ``generate``), each as a ratio of tokens/s measured side by side in one run.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

JAKIRO_METHODS = ("jakiro", "jakiro_cepd", "jakiro_auto")
EAGLE_METHODS = ("eagle2", "eagle2_auto")


def cost_model(target: Any, drafts_dir: str | Path, *, drafts: Sequence[str] = ("dense", "moe2"),
               sizes: Sequence[int] = (1, 2, 4, 6, 8, 12, 16, 24, 32), widths: Sequence[int] = (1, 3),
               context: int = 256, repeats: int = 7,
               target_costs: dict[int, float] | None = None) -> dict[str, pd.DataFrame]:
    """Measured T(n) of the target and draft-step times (trained vocabulary vs the full one).

    ``target_costs``: T(n) in seconds already measured on this machine (the tree-budget tuning's); used
    when it covers ``sizes`` and n = 1, instead of timing the target again.
    Returns ``{"target": [n, ms, x_one_step], "draft": [draft, vocab, width, ms, x_target_step]}``. The
    full-vocabulary rows time an untrained copy of the same architecture (timing only).
    """
    from .costmodel import measure_draft_costs, measure_target_costs
    from .draft import DraftModel

    wanted = sorted({1, *sizes})
    if target_costs is not None and set(wanted) <= set(target_costs):
        t = {n: target_costs[n] for n in wanted}
    else:
        t = measure_target_costs(target.model, sizes=wanted, context=context, repeats=repeats)
    one = t[min(t)]
    target_rows = [{"n": n, "ms": 1000 * s, "x_one_step": s / one} for n, s in sorted(t.items())]
    vocab = target.model.config.vocab_size
    draft_rows = []
    for name in drafts:
        path = Path(drafts_dir) / name / "draft"
        if not (path / "model.safetensors").is_file():
            continue
        trained = DraftModel.load(path, target.model)
        variants = [(trained.cfg.draft_vocab_size or vocab, trained)]
        if trained.cfg.draft_vocab_size is not None:
            full_cfg = dataclasses.replace(trained.cfg, draft_vocab_size=None)
            variants.append((vocab, DraftModel.build(full_cfg, target.model).eval()))
        for v, model in variants:
            for w, s in measure_draft_costs(model, widths=widths, context=context, repeats=repeats).items():
                draft_rows.append({"draft": name, "vocab": v, "width": w, "ms": 1000 * s, "x_target_step": s / one})
    return {"target": pd.DataFrame(target_rows), "draft": pd.DataFrame(draft_rows)}


def performance_targets(main: pd.DataFrame) -> pd.DataFrame:
    """The speed goals as measured ratios (mean over benchmarks) with pass/fail.

    "Jakiro (best)" is the fastest of ``jakiro``, ``jakiro_cepd`` and ``jakiro_auto`` at each temperature,
    compared in tokens/s with the fastest EAGLE-2 row (``eagle2`` or ``eagle2_auto``); tau compares
    ``jakiro`` with ``eagle2`` on the same tree. Ratios of means of tokens/s, as in the main table.
    """
    from .study import headline_table

    h = headline_table(main)  # mean over benchmarks per (temperature, method)
    rows: list[dict[str, Any]] = []

    def value(temp: float, method: str, col: str = "tokens_per_s") -> float:
        sel = h[(h["temperature"] == temp) & (h["method"] == method)]
        return float(sel[col].iloc[0]) if len(sel) else math.nan

    def add(goal: str, temp: float, ours: str, base: str, threshold: float, strict: bool = False,
            col: str = "tokens_per_s") -> None:
        a, b = value(temp, ours, col), value(temp, base, col)
        ratio = a / b if b and not math.isnan(b) else math.nan
        met = None if math.isnan(ratio) else bool(ratio > threshold if strict else ratio >= threshold)
        rows.append({"goal": goal, "temperature": temp, "method": ours, "baseline": base,
                     "metric": "tokens/s" if col == "tokens_per_s" else col, "method_value": a,
                     "baseline_value": b, "ratio": ratio, "target": f"{'>' if strict else '>='} {threshold:g}",
                     "met": met})

    for temp in sorted(h["temperature"].unique()):
        present = [m for m in JAKIRO_METHODS if not math.isnan(value(temp, m))]
        if not present:
            continue
        best = max(present, key=lambda m: value(temp, m))
        eagles = [m for m in EAGLE_METHODS if not math.isnan(value(temp, m))] or ["eagle2"]
        best_eagle = max(eagles, key=lambda m: value(temp, m))
        if temp == 0:
            add("Jakiro >= 1.5x HF generate (greedy)", temp, best, "hf_generate", 1.5)
            add("Jakiro > HF prompt lookup", temp, best, "hf_prompt_lookup", 1.0, strict=True)
            add("our vanilla loop within 5% of HF generate", temp, "vanilla", "hf_generate", 0.95)
        else:
            add(f"Jakiro >= 1.3x HF sampling (T={temp:g})", temp, best, "hf_generate", 1.3)
        add("Jakiro >= EAGLE-2 (tokens/s)", temp, best, best_eagle, 1.0)
        add("Jakiro >= EAGLE-2 (tau)", temp, "jakiro", "eagle2", 1.0, col="tau")
    return pd.DataFrame(rows)


def write_performance_report(ctx: Any, main: pd.DataFrame, *, target: Any = None) -> dict[str, pd.DataFrame]:
    """Notebook 02's performance section: cost model, tree-budget tuning and the goals table, written as
    ``cost_model_target.csv``, ``cost_model_draft.csv``, ``tree_budget.csv`` and ``performance_targets.csv``
    in the report directory. T(n) is the one the tree-budget tuning measured (cached in
    ``run_dir/bench/tree_budgets.json``) when there is one. Returns the four tables."""
    from .study import cached_target_costs, get_target, tree_budget_table, write_table

    target = target or get_target(ctx)
    tables = cost_model(target, ctx.drafts_dir, widths=sorted({1, ctx.profile.tree.top_k}),
                        target_costs=cached_target_costs(ctx.run_dir))
    tables = {"cost_model_target": tables["target"], "cost_model_draft": tables["draft"],
              "tree_budget": tree_budget_table(ctx.run_dir, "main"), "performance_targets": performance_targets(main)}
    for name, df in tables.items():
        write_table(Path(ctx.report_dir) / f"{name}.csv", df)
    return tables
