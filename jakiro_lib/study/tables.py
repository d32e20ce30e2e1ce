"""The study's tables: benchmark records -> summary, compact display and headline DataFrames, and the
CSV/JSON files the report publishes."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from ..measure.summary import load_records, summarize, summarize_by_category, versus
from ..layout import STUDY_TREE_BUDGET, RunLayout, draft_name
from ..decoding.methods import MethodSpec
from ..measure.costmodel import parse_shape_key, shape_key
from ..measure.methods import EAGLE2_BASELINE, SPEC, record_label
from ..files import atomic_path, read_json, write_table

SETTING_COLUMNS = ("draft", "depth", "top_k", "total_tokens", "decoupled", "ar_steps", "scoring", "lookup_tokens")


def method_setting(spec: MethodSpec, key: str) -> Any:
    """One setting of a method as the tables show it (None where it does not apply)."""
    if spec.kind != SPEC:
        return None
    if spec.draft is None:  # the lookup chain alone: no draft, no drafted tree
        return {"draft": "none", "lookup_tokens": spec.tree.lookup_tokens}.get(key)
    if key == "draft":
        return draft_name(spec.draft)
    return getattr(spec.tree, key)


def study_table(records: list[dict[str, Any]], methods: dict[str, Any] | None = None) -> pd.DataFrame:
    """:func:`jakiro_lib.measure.summary.summarize` as a DataFrame in the study's method order, with the method
    settings (draft, decoupled, ar_steps, scoring) as columns."""
    if methods is not None:  # keyed by run label
        records = [r for r in records if record_label(r) in methods]
    return _ordered(pd.DataFrame(summarize(records)), records, methods, ["temperature", "benchmark"])


def category_table(records: list[dict[str, Any]], methods: dict[str, Any] | None = None) -> pd.DataFrame:
    """:func:`jakiro_lib.measure.summary.summarize_by_category` as a DataFrame (a ``category`` column after
    ``benchmark``), ordered like :func:`study_table`: empty unless some benchmark's questions carry
    more than one category (Spec-Bench's 13, MT-bench's 8)."""
    if methods is not None:
        records = [r for r in records if record_label(r) in methods]
    df = pd.DataFrame(summarize_by_category(records))
    if df.empty:
        return df
    df.insert(df.columns.get_loc("benchmark") + 1, "category", df.pop("category"))
    return _ordered(df, records, methods, ["temperature", "benchmark", "category"])


def _ordered(df: pd.DataFrame, records: list[dict[str, Any]], methods: dict[str, Any] | None,
             keys: list[str]) -> pd.DataFrame:
    """Rows sorted by ``keys`` then the study's method order; with ``methods``, their settings as columns."""
    if df.empty:
        return df
    order = list(methods) if methods is not None else list(dict.fromkeys(record_label(r) for r in records))
    df["_o"] = df["method"].map({m: i for i, m in enumerate(order)})
    df = df.sort_values([*keys, "_o"]).drop(columns="_o").reset_index(drop=True)
    if methods is not None:
        for key in SETTING_COLUMNS:
            df.insert(df.columns.get_loc("benchmark"), key, [method_setting(methods[m], key) for m in df["method"]])
    return df


def records_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Per-record table without the output ids (accepted lengths as a JSON list)."""
    rows = []
    for r in records:
        row = {k: v for k, v in r.items() if k != "output_ids"}
        row["accepted"] = json.dumps(r.get("accepted", []))
        rows.append(row)
    return pd.DataFrame(rows)


def write_study_tables(report_dir: str | Path, study: str, table: pd.DataFrame,
                       records: list[dict[str, Any]] | None = None) -> Path:
    """``main_results.csv`` / ``ablations.csv`` (+ JSON) and ``<study>_records.csv`` in the report dir."""
    report_dir = Path(report_dir)
    name = "main_results" if study == "main" else "ablations"
    path = report_dir / f"{name}.csv"
    write_table(path, table)
    if records is not None:
        with atomic_path(report_dir / f"{study}_records.csv") as tmp:
            records_frame(records).to_csv(tmp, index=False)
    return path


def versus_eagle2_table(records: dict[str, list[dict[str, Any]]]) -> pd.DataFrame:
    """Every drafted method of each study (``{"main": records, "ablations": records}``) against that study's
    EAGLE-2 (:data:`~jakiro_lib.measure.methods.EAGLE2_BASELINE`) on the prompts both ran: tokens/s and tau ratios
    with 95% paired bootstrap intervals and a verdict (:func:`jakiro_lib.measure.summary.versus`)."""
    frames = [pd.DataFrame(versus(recs, EAGLE2_BASELINE[study])).assign(study=study)
              for study, recs in records.items() if recs]
    frames = [f for f in frames if not f.empty]
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, ignore_index=True)
    return out[["study", *[c for c in out.columns if c != "study"]]]


def acceptance_by_depth(records: list[dict[str, Any]], depths: int = 4) -> pd.DataFrame:
    """Per drafted method and temperature, from the cycles of its benchmark records: the fraction of cycles
    that accepted at least d drafted tokens (``p_ge_d``) and the chance of reaching depth d once depth d - 1
    was reached (``cond_d``), d = 1..``depths``: where in the tree a draft's tokens stop being accepted."""
    drafted: dict[tuple[str, float], list[int]] = {}
    for r in records:
        if r["kind"] == SPEC:
            # the bonus token excluded
            drafted.setdefault((record_label(r), r["temperature"]), []).extend(a - 1 for a in r["accepted"])
    rows = []
    for (method, temp), xs in drafted.items():
        row: dict[str, Any] = {"method": method, "temperature": temp, "cycles": len(xs)}
        reached = len(xs)
        for d in range(1, depths + 1):
            n = sum(x >= d for x in xs)
            row[f"p_ge_{d}"] = n / len(xs) if xs else math.nan
            row[f"cond_{d}"] = n / reached if reached else math.nan
            reached = n
        rows.append(row)
    return pd.DataFrame(rows)


def _interval(lo: float, hi: float) -> str:
    return "–" if lo is None or hi is None or math.isnan(lo) or math.isnan(hi) else f"[{lo:.2f}, {hi:.2f}]"


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """Compact view: tau and speedup as ``mean ± std`` (over repeats) strings, the speedup's bootstrap
    interval over prompts, the per-cycle breakdown, and (T=0) how many prompts gave vanilla's output."""
    if table.empty:
        return table

    def pm(m: float, s: float, digits: int = 2) -> str:
        if m is None or (isinstance(m, float) and math.isnan(m)):
            return "–"
        return f"{m:.{digits}f} ± {0.0 if s is None or math.isnan(s) else s:.{digits}f}"

    out = pd.DataFrame({
        "method": table["method"], "benchmark": table["benchmark"],
        **({"category": table["category"]} if "category" in table else {}), "T": table["temperature"],
        "tokens/s": [pm(m, s, 1) for m, s in zip(table["tokens_per_s"], table["tokens_per_s_std"])],
        "speedup": [pm(m, s) for m, s in zip(table["speedup"], table["speedup_std"])],
        "speedup 95% CI": [_interval(lo, hi) for lo, hi in zip(table["speedup_ci_low"], table["speedup_ci_high"])],
        "tau": table["tau"].round(2), "tau (cycles-1)": table["tau_ref"].round(2),
        "draft fwd/cycle": table["draft_forwards_per_cycle"].round(2),
        "questions": table["questions"],
        "greedy = vanilla": [_fraction(a, b) for a, b in zip(table.get("greedy_same", [None] * len(table)),
                                                            table.get("greedy_compared", [None] * len(table)))],
    })
    return out


def _fraction(same: Any, compared: Any) -> str:
    if same is None or compared is None or any(isinstance(v, float) and math.isnan(v) for v in (same, compared)):
        return "–"
    return f"{int(same)}/{int(compared)}"


def load_study_records(run_dir: str | Path, study: str) -> list[dict[str, Any]]:
    path = RunLayout(Path(run_dir)).records(study)
    return load_records(path) if path.is_file() else []


TREE_BUDGET_COLUMNS = ["method", "depth", "top_k", "total_tokens", "expected_tokens_per_cycle", "verify_ms", "draft_ms",
                       "tokens_per_s", "chosen", "estimated_best", "fixed", "measured_tokens_per_s"]


def _tree_key(depth: Any, top_k: Any, n: int) -> str:
    """A tree's key in a tuning record: :func:`~jakiro_lib.measure.costmodel.shape_key`, or the budget alone where
    the record has no shape (an earlier tuner's)."""
    return str(n) if depth is None or top_k is None else shape_key(depth, top_k, n)


def tree_budget_table(run_dir: str | Path, study: str = "main") -> pd.DataFrame:
    """The tuning behind "auto" trees: per tuned method and candidate tree (depth, width, budget), expected tokens
    per cycle, verify and draft time and estimated tokens/s; flagged: the tree the estimate picked
    (``estimated_best``), the fixed tree it was checked against (``fixed``) and the one kept (``chosen``), with the
    tokens/s those measured on the tuning prompts (``measured_tokens_per_s``;
    :func:`jakiro_lib.measure.costmodel.tune_tree`). A fixed tree outside the candidates gets a row of its own."""
    info = read_json(RunLayout(Path(run_dir)).bench(study) / STUDY_TREE_BUDGET) or {}
    rows = []
    nan = float("nan")
    for method, choice in info.get("choices", {}).items():
        measured = choice.get("measured_tokens_per_s", {})
        table = list(choice["table"])
        chosen = _tree_key(choice.get("depth"), choice.get("top_k"), choice["best"])
        estimated = choice.get("estimated", str(choice.get("estimated_best", choice["best"])))
        fixed = choice.get("fixed", None if choice.get("fixed_tokens") is None else str(choice["fixed_tokens"]))
        keys = [_tree_key(row.get("depth"), row.get("top_k"), row["total_tokens"]) for row in table]
        if fixed is not None and fixed not in keys:
            shape = parse_shape_key(fixed)
            table.append({**(shape or {"total_tokens": int(fixed)}), "expected_tokens_per_cycle": nan,
                          "verify_s": nan, "draft_s": nan, "tokens_per_s": nan})
            keys.append(fixed)
        for key, row in zip(keys, table):
            rows.append({"method": method, "depth": row.get("depth", nan), "top_k": row.get("top_k", nan),
                         "total_tokens": row["total_tokens"],
                         "expected_tokens_per_cycle": row["expected_tokens_per_cycle"],
                         "verify_ms": 1000 * row["verify_s"], "draft_ms": 1000 * row["draft_s"],
                         "tokens_per_s": row["tokens_per_s"], "chosen": key == chosen,
                         "estimated_best": key == estimated, "fixed": key == fixed,
                         "measured_tokens_per_s": measured.get(key, nan)})
    return pd.DataFrame(rows, columns=TREE_BUDGET_COLUMNS)
