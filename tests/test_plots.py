"""Report figures and index.html from small synthetic data (no model, no kernel)."""
from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure

from jakiro_lib.report import plots as P
from jakiro_lib.measure.summary import summarize
from jakiro_lib.study import comparison_table, display_table, headline_table, records_frame, study_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _records(seed: int = 0) -> list[dict]:
    """Benchmark records shaped like jakiro_lib.measure.bench.Record: 2 benchmarks x 2 temperatures x 2 repeats."""
    rng = random.Random(seed)
    methods = [("vanilla", "vanilla"), ("hf_generate", "hf"), ("eagle2", "spec"), ("jakiro", "spec"),
               ("jakiro_cepd", "spec")]
    out = []
    for bench in ("mt_bench", "gsm8k"):
        for temp in (0.0, 1.0):
            for rep in range(2):
                for q in range(3):
                    for method, kind in methods:
                        if kind == "spec":
                            accepted = [rng.randint(1, 4) for _ in range(rng.randint(3, 8))]
                        else:
                            accepted = [1] * rng.randint(8, 16)
                        new = sum(accepted)
                        cycles = len(accepted)
                        wall = new / (100.0 if kind != "spec" else rng.uniform(120, 200))
                        out.append({
                            "method": method, "kind": kind, "benchmark": bench, "question_id": str(q), "turn": 0,
                            "repeat": rep, "temperature": temp, "new_tokens": new, "cycles": cycles,
                            "accepted": accepted, "wall_time": wall, "prefill_time": 0.01,
                            "draft_forwards": (2 if method != "jakiro_cepd" else 1) * cycles if kind == "spec" else 0,
                            "tokens_per_second": new / wall, "tau": new / cycles if kind == "spec" else 1.0,
                            "stop_reason": "max_new_tokens", "output_ids": list(range(new)),
                        })
    return out


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return _records()


@pytest.fixture(scope="module")
def summary(records) -> pd.DataFrame:
    return pd.DataFrame(summarize(records))


def _check_png(fig: Figure, path) -> None:
    assert isinstance(fig, Figure)
    P.save_figure(fig, path)
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 5_000


def test_benchmark_figures(tmp_path, records, summary):
    _check_png(P.plot_speedup(summary), tmp_path / "speedup.png")
    _check_png(P.plot_tau(summary), tmp_path / "tau.png")
    _check_png(P.plot_accept_hist(records), tmp_path / "hist.png")
    abl = summary[summary["temperature"] == 0.0]
    _check_png(P.plot_ablations(abl), tmp_path / "abl.png")
    # the per-record CSV round trip (accepted as JSON text) still plots
    _check_png(P.plot_accept_hist(P.accepted_lengths(records)), tmp_path / "hist2.png")


def test_accepted_lengths_counts_every_spec_cycle(records):
    df = P.accepted_lengths(records)
    spec = [r for r in records if r["kind"] == "spec"]
    assert len(df) == sum(len(r["accepted"]) for r in spec)
    assert set(df["method"]) == {"eagle2", "jakiro", "jakiro_cepd"}
    assert df["accepted"].min() >= 1


def test_training_figures(tmp_path):
    hist = pd.DataFrame([{"draft": d, "step": s, "series": series, "value": 1.0 / (s + 1) + i}
                         for i, d in enumerate(("dense", "moe2")) for s in range(1, 11)
                         for series in ("train loss", "train loss A (t+1)", "held-out acc A")])
    _check_png(P.plot_training_curves(hist, smooth=3), tmp_path / "curves.png")
    training = pd.DataFrame([{"draft": "dense", "acc_a": 0.6, "acc_b": None},
                             {"draft": "moe2", "acc_a": 0.62, "acc_b": 0.3}])
    _check_png(P.plot_heldout_accuracy(training), tmp_path / "acc.png")
    load = pd.DataFrame([{"draft": "moe2", "expert": 0, "load": 1.0}, {"draft": "moe2", "expert": 1, "load": 1.0},
                         {"draft": "moe4", "expert": 0, "load": 0.7}, {"draft": "moe4", "expert": 1, "load": 0.3},
                         {"draft": "moe4", "expert": 2, "load": 0.5}, {"draft": "moe4", "expert": 3, "load": 0.5}])
    _check_png(P.plot_router_load(load), tmp_path / "load.png")


def test_empty_inputs_give_a_message_figure(tmp_path):
    empty = pd.DataFrame(columns=["method", "kind", "benchmark", "temperature", "speedup", "tau"])
    for i, fig in enumerate([P.plot_speedup(empty), P.plot_tau(empty), P.plot_ablations(empty),
                             P.plot_accept_hist([]), P.plot_training_curves([]), P.plot_router_load([]),
                             P.plot_heldout_accuracy([]), P.plot_cycle_costs([]),
                             # imported drafts only (stage 01 loads released heads): no accuracy was measured
                             P.plot_heldout_accuracy([{"draft": "dense", "acc_a": None, "acc_b": None}])]):
        assert isinstance(fig, Figure)
        P.save_figure(fig, tmp_path / f"e{i}.png")


def test_tables(records, summary):
    table = study_table(records)
    spec = table[table["kind"] == "spec"]
    assert (spec["tau"] >= 1).all() and (table["tokens_per_s"] > 0).all()
    assert (table.loc[table["method"] == "vanilla", "speedup"] == 1.0).all()
    shown = display_table(table)
    assert "±" in shown["speedup"].iloc[0]
    head = headline_table(table)
    assert len(head) == 2 * 5 and set(head["benchmarks"]) == {2}
    comp = comparison_table(table, target_model="tiny:llama", environment={"device_name": "cpu", "date": "today"})
    ours = comp[comp["source"] == "ours (this run)"]
    assert set(ours["method"]) == {"eagle2", "jakiro", "jakiro_cepd"}
    assert (comp["source"] != "ours (this run)").sum() >= 10  # the published rows
    assert "output_ids" not in records_frame(records).columns


def test_speedup_error_bars_are_the_bootstrap_interval():
    rows = [{"method": m, "kind": "spec", "benchmark": "mt_bench", "temperature": 0.0, "speedup": 2.0,
             "speedup_std": 0.0, "speedup_ci_low": 1.5, "speedup_ci_high": 2.6} for m in ("eagle2", "jakiro")]
    fig = P.plot_speedup(rows)
    bars = [c for c in fig.axes[0].containers if getattr(c, "errorbar", None) is not None]
    spans = {tuple(np.round(seg[:, 1], 6)) for b in bars for seg in b.errorbar.lines[2][0].get_segments()}
    assert spans == {(1.5, 2.6)}
