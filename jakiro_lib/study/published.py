"""Published speedups (Jakiro, EAGLE-2, Spec-Bench) and our run's numbers beside them (notebook 03)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from ..config import SPEC
from ..measure.methods import DRAFTED_METHODS, record_method
from ..measure.summary import headline_table

OURS = "ours (this run)"
# The published method each of our drafted rows stands for (the profile vicuna-7b-released runs EAGLE's head and the
# authors' Jakiro and Jakiro* heads)
PAPER_METHOD = {"eagle2": "eagle2", "jakiro": "jakiro", "jakiro_cepd": "jakiro", "jakiro_coupled_cepd": "jakiro",
                "jakiro_star": "jakiro*"}


# docs/DESIGN.md section 8, verbatim numbers (speedup over vanilla, tau where published).
PUBLISHED_COLUMNS = ("source", "method", "target", "benchmarks", "temperature", "hardware", "speedup", "tau",
                     "tau_cycles_minus_1", "note")
_LOGS = "Jakiro authors' A40 logs (recomputed)"
_README = "Jakiro README figure"
_EAGLE2 = "EAGLE-2 paper"
_SPEC_BENCH = "Spec-Bench (third party)"
_SIX = "mean of MT-bench, HumanEval, GSM8K, Alpaca, CNN/DM, NQ"
_CYCLES_1 = "tau in the reference's cycles-1 convention"
_SPEC_TAU = "tau convention as published by Spec-Bench"
PUBLISHED: list[dict[str, Any]] = [dict(zip(PUBLISHED_COLUMNS, row)) for row in (
    (_LOGS, "jakiro", "Vicuna-7B", _SIX, 0.0, "A40", 2.85, None, 4.69, _CYCLES_1),
    (_LOGS, "eagle2", "Vicuna-7B", _SIX, 0.0, "A40", 2.73, None, 4.68, _CYCLES_1),
    (_LOGS, "jakiro", "Vicuna-7B", _SIX, 1.0, "A40", 2.44, None, 4.20, _CYCLES_1),
    (_LOGS, "eagle2", "Vicuna-7B", _SIX, 1.0, "A40", 2.36, None, 4.20, _CYCLES_1),
    (_LOGS, "jakiro", "Vicuna-7B", "MT-bench", 0.0, "A40", 3.02, None, 4.98, _CYCLES_1),
    (_README, "jakiro*", "Vicuna-7B", "MT-bench", 1.0, "A100", 3.86, None, 5.68,
     "matches the non-lossless Jakiro* sampler logs: not a target"),
    (_README, "eagle2", "Vicuna-7B", "MT-bench", 1.0, "A100", 2.69, None, 4.27, "README figure"),
    (_EAGLE2, "eagle2", "Vicuna-7B", "MT-bench", 0.0, "as published", 3.62, None, None, ""),
    (_EAGLE2, "eagle2", "Vicuna-13B", "MT-bench", 0.0, "as published", 4.26, None, None, ""),
    (_EAGLE2, "eagle2", "LLaMA3-8B", "MT-bench", 0.0, "as published", 3.46, None, None, ""),
    (_SPEC_BENCH, "eagle2", "Vicuna-7B", "MT-bench", 0.0, "A100", 2.84, 4.34, None, _SPEC_TAU),
    (_SPEC_BENCH, "eagle3", "Vicuna-13B", "MT-bench", 0.0, "A100", 3.48, 5.71, None, _SPEC_TAU),
)]


def comparison_table(main: pd.DataFrame, *, target_model: str, environment: dict[str, Any],
                     methods: Sequence[str] = DRAFTED_METHODS) -> pd.DataFrame:
    """Our speculative methods (mean over our benchmarks) next to the published numbers, ours labelled with the run's
    target, machine and date, theirs with paper and hardware; an old study's static-engine run keeps its label
    (:func:`~jakiro_lib.measure.methods.record_label`). Ours has both tau conventions (docs/DESIGN.md section 7)."""
    rows = []
    if not main.empty:
        head = headline_table(main)
        benches = ", ".join(sorted(main["benchmark"].unique()))
        n_q = int(main.groupby("benchmark")["questions"].max().sum()) if "questions" in main else None
        for r in head.itertuples(index=False):
            if run_method(r.method) not in methods:
                continue
            rows.append({
                "source": OURS, "method": r.method, "target": target_model,
                "benchmarks": f"mean of {benches} ({n_q} prompts)" if r.benchmarks > 1 else f"{benches} ({n_q} prompts)",
                "temperature": r.temperature,
                "hardware": f"{environment.get('device_name', '?')} [{environment.get('device', '?')}]",
                "speedup": r.speedup, "tau": r.tau, "tau_cycles_minus_1": r.tau_ref,
                "note": f"measured {environment.get('date', '?')}, torch {environment.get('torch', '?')}",
            })
    rows += [dict(p) for p in PUBLISHED]
    return pd.DataFrame(rows)


def run_method(label: str) -> str:
    """The registry method a run's label names (an old study's engine label -> its method)."""
    return record_method({"method": label, "kind": SPEC})


def _same_target(ours: str, published: str) -> bool:
    """Whether our target (a hub id or path) is the published one: ``lmsys/vicuna-7b-v1.3`` is ``Vicuna-7B``."""
    return Path(ours).name.lower().startswith(published.lower())


def beside_published(comparison: pd.DataFrame) -> pd.DataFrame:
    """Each of our rows of :func:`comparison_table` beside every published row of the method it stands for
    (:data:`PAPER_METHOD`) at its temperature on the same target model, with the ratio of the speedups (other
    machines and prompt sets: a check of the shape, not a ranking). Empty where no row pairs."""
    ours = comparison[comparison["source"] == OURS]
    theirs = comparison[comparison["source"] != OURS]
    rows = []
    for o in ours.itertuples(index=False):
        paper = PAPER_METHOD.get(run_method(o.method))
        for t in theirs.itertuples(index=False):
            if t.method == paper and t.temperature == o.temperature and _same_target(o.target, t.target):
                rows.append({"method": o.method, "temperature": o.temperature, "speedup": o.speedup, "tau": o.tau,
                             "tau_cycles_minus_1": o.tau_cycles_minus_1, "published_method": t.method,
                             "published_source": t.source, "published_benchmarks": t.benchmarks,
                             "published_hardware": t.hardware, "published_speedup": t.speedup,
                             "published_tau_cycles_minus_1": t.tau_cycles_minus_1,
                             "speedup_ratio": o.speedup / t.speedup if t.speedup else None, "published_note": t.note})
    return pd.DataFrame(rows)
