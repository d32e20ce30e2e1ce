"""The GPU check (jakiro_lib.study.gpucheck), run on this CPU with the smoke profile and untrained drafts: its files,
both temperatures, greedy identity counted, and the cycle's breakdown by named step."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest

from jakiro_lib.cli import main
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.measure import costmodel
from jakiro_lib.study.gpucheck import BREAKDOWN_TOKENS, CHECK_SETTINGS, check_profile, gpu_check
from jakiro_lib.models.target import load_target
from jakiro_lib.config import EAGLE2_DRAFT, JAKIRO_DRAFT

from helpers import single_thread

SMALL = {"bench.limit": "1", "bench.max_new_tokens": "8", "bench.warmup": "0", "bench.benchmarks": "mt_bench"}


def test_check_profile_is_the_exact_setting_on_the_device():
    prof = check_profile("smoke", "cpu", **{"bench.limit": "2"})
    assert prof.target.dtype == "float32" and prof.target.device == "cpu" and prof.target.packed_gemm == 0
    assert prof.bench.compiled_baseline and prof.bench.temperatures == (0.0, 1.0)
    assert prof.bench.limit == 2 and CHECK_SETTINGS["bench.limit"] == "10"  # MT-bench q1-10, both turns: 20 prompts


def test_gpu_check_writes_records_goals_and_the_cycle_breakdown(tmp_path, monkeypatch):
    # the tuner's check of trees (tests/test_budgets.py) would compile each tree's cycle with inductor here:
    # every tree measured equal, so the fixed tree is kept and the only compilation is the breakdown's
    monkeypatch.setattr(costmodel, "measure_tree_speeds", lambda *a, **kw: dict.fromkeys(a[2], 1.0))
    prof = check_profile("smoke", "cpu", **SMALL)
    target = load_target(prof.target)
    for name in (EAGLE2_DRAFT, JAKIRO_DRAFT):  # the main study's drafts
        DraftModel.build(prof.drafts[name], target.model).eval().save(tmp_path / "drafts" / name / "draft")
    methods = ("vanilla", "hf_generate", "jakiro_auto", "jakiro_lookup")  # the profiled method need not be one
    with single_thread():
        result = gpu_check("smoke", run_dir=tmp_path, device="cpu", overrides=SMALL, methods=methods,
                           profiled_prompts=1, progress=False)
    out = tmp_path / "gpucheck-cpu"
    for name in ("records.jsonl", "summary.csv", "performance_targets.csv", "cycles.csv", "gpu_check.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "gpu_check.json").read_text())["methods"] == list(methods)
    summary = pd.DataFrame(result["summary"])
    assert set(zip(summary["method"], summary["temperature"])) == {(m, t) for m in methods for t in (0.0, 1.0)}
    for name in ("jakiro_auto", "jakiro_lookup"):
        row = summary[(summary["method"] == name) & (summary["temperature"] == 0.0)].iloc[0]
        assert row["greedy_compared"] == 2 and row["greedy_same"] == 2, name
    goals = pd.DataFrame(result["goals"])
    assert {"Jakiro >= 1.5x HF generate (greedy)", "Jakiro >= 1.3x HF sampling (T=1)"} <= set(goals["goal"])
    eager, compiled, plain = result["cycles"]  # Jakiro's cycle eager and compiled; plain decoding eager (CPU)
    assert not eager["compiled"] and compiled["compiled"] and eager["cycles"] > 0 and compiled["cycles"] > 0
    assert (plain["decoder"], plain["tau"], eager["decoder"]) == ("plain", 1.0, "speculative")
    assert pd.read_csv(out / "cycles.csv")["new_tokens"].tolist() == [min(8, BREAKDOWN_TOKENS)] * 3
    assert plain["cycle_cpu_ms"] > 0 and math.isnan(plain["draft_cpu_ms"]) and math.isnan(plain["device_ops"])
    for step in ("draft", "verify", "evaluate", "update", "cycle", "read"):
        assert eager[f"{step}_cpu_ms"] > 0, step
        assert math.isnan(eager[f"{step}_device_ms"])  # no device here
    assert eager["cycle_cpu_ms"] >= eager["draft_cpu_ms"] + eager["verify_cpu_ms"]
    assert math.isnan(compiled["draft_cpu_ms"]) and compiled["cycle_cpu_ms"] > 0  # inside the graph: no step ranges


def test_gpucheck_without_drafts_says_so_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["gpucheck", "--profile", "smoke", "--device", "cpu", "--run-dir", str(tmp_path)])
    assert "needs trained drafts" in str(exc.value) and "\n" not in str(exc.value)
