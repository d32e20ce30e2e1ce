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
PUBLISHED: list[dict[str, Any]] = [
    {"source": "Jakiro authors' A40 logs (recomputed)", "method": "jakiro", "target": "Vicuna-7B",
     "benchmarks": "mean of MT-bench, HumanEval, GSM8K, Alpaca, CNN/DM, NQ", "temperature": 0.0, "hardware": "A40",
     "speedup": 2.85, "tau": None, "tau_cycles_minus_1": 4.69, "note": "tau in the reference's cycles-1 convention"},
    {"source": "Jakiro authors' A40 logs (recomputed)", "method": "eagle2", "target": "Vicuna-7B",
     "benchmarks": "mean of MT-bench, HumanEval, GSM8K, Alpaca, CNN/DM, NQ", "temperature": 0.0, "hardware": "A40",
     "speedup": 2.73, "tau": None, "tau_cycles_minus_1": 4.68, "note": "tau in the reference's cycles-1 convention"},
    {"source": "Jakiro authors' A40 logs (recomputed)", "method": "jakiro", "target": "Vicuna-7B",
     "benchmarks": "mean of MT-bench, HumanEval, GSM8K, Alpaca, CNN/DM, NQ", "temperature": 1.0, "hardware": "A40",
     "speedup": 2.44, "tau": None, "tau_cycles_minus_1": 4.20, "note": "tau in the reference's cycles-1 convention"},
    {"source": "Jakiro authors' A40 logs (recomputed)", "method": "eagle2", "target": "Vicuna-7B",
     "benchmarks": "mean of MT-bench, HumanEval, GSM8K, Alpaca, CNN/DM, NQ", "temperature": 1.0, "hardware": "A40",
     "speedup": 2.36, "tau": None, "tau_cycles_minus_1": 4.20, "note": "tau in the reference's cycles-1 convention"},
    {"source": "Jakiro authors' A40 logs (recomputed)", "method": "jakiro", "target": "Vicuna-7B",
     "benchmarks": "MT-bench", "temperature": 0.0, "hardware": "A40", "speedup": 3.02, "tau": None,
     "tau_cycles_minus_1": 4.98, "note": "tau in the reference's cycles-1 convention"},
    {"source": "Jakiro README figure", "method": "jakiro*", "target": "Vicuna-7B", "benchmarks": "MT-bench",
     "temperature": 1.0, "hardware": "A100", "speedup": 3.86, "tau": None, "tau_cycles_minus_1": 5.68,
     "note": "matches the non-lossless Jakiro* sampler logs: not a target"},
    {"source": "Jakiro README figure", "method": "eagle2", "target": "Vicuna-7B", "benchmarks": "MT-bench",
     "temperature": 1.0, "hardware": "A100", "speedup": 2.69, "tau": None, "tau_cycles_minus_1": 4.27,
     "note": "README figure"},
    {"source": "EAGLE-2 paper", "method": "eagle2", "target": "Vicuna-7B", "benchmarks": "MT-bench",
     "temperature": 0.0, "hardware": "as published", "speedup": 3.62, "tau": None, "tau_cycles_minus_1": None,
     "note": ""},
    {"source": "EAGLE-2 paper", "method": "eagle2", "target": "Vicuna-13B", "benchmarks": "MT-bench",
     "temperature": 0.0, "hardware": "as published", "speedup": 4.26, "tau": None, "tau_cycles_minus_1": None,
     "note": ""},
    {"source": "EAGLE-2 paper", "method": "eagle2", "target": "LLaMA3-8B", "benchmarks": "MT-bench",
     "temperature": 0.0, "hardware": "as published", "speedup": 3.46, "tau": None, "tau_cycles_minus_1": None,
     "note": ""},
    {"source": "Spec-Bench (third party)", "method": "eagle2", "target": "Vicuna-7B", "benchmarks": "MT-bench",
     "temperature": 0.0, "hardware": "A100", "speedup": 2.84, "tau": 4.34, "tau_cycles_minus_1": None,
     "note": "tau convention as published by Spec-Bench"},
    {"source": "Spec-Bench (third party)", "method": "eagle3", "target": "Vicuna-13B", "benchmarks": "MT-bench",
     "temperature": 0.0, "hardware": "A100", "speedup": 3.48, "tau": 5.71, "tau_cycles_minus_1": None,
     "note": "tau convention as published by Spec-Bench"},
]


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
