"""The report's front page: banner (smoke), verdict, headline figure, then tables that fit the page."""
from __future__ import annotations

import json
import math
import re

import pandas as pd
import pytest

from jakiro_lib.report.pipeline import write_report_index
from jakiro_lib.report.page import SMOKE_BANNER, goal_verdicts

GOALS = [  # goal, T, method, baseline, ratio, ci_low, ci_high, target, met, resolved
    ("Jakiro >= 1.5x HF generate (greedy)", 0.0, "jakiro_auto", "hf_compiled", 0.446, 0.39, 0.50, ">= 1.5", False, True),
    ("Jakiro >= EAGLE-2 (tokens/s)", 0.0, "jakiro_auto", "eagle2_auto", 0.857, 0.66, 1.03, ">= 1", False, False),
    ("Jakiro >= EAGLE-2 (tau)", 0.0, "jakiro", "eagle2", 1.04, math.nan, math.nan, ">= 1", True, None),
    ("Jakiro + lookup branch (extension) >= 1.5x HF generate (greedy)", 0.0, "jakiro_lookup", "hf_compiled",
     1.73, 1.42, 2.12, ">= 1.5", True, False),
    ("Jakiro >= 1.3x HF sampling (T=1)", 1.0, "jakiro_auto", "hf_compiled", 0.42, 0.32, 0.69, ">= 1.3", False, True),
]
COLUMNS = ["goal", "temperature", "method", "baseline", "ratio", "ratio_ci_low", "ratio_ci_high", "target",
           "met", "resolved"]


def _report(tmp_path, profile: str, model: str, goals: bool = True):
    report = tmp_path / profile
    report.mkdir()
    (report / "run_config.json").write_text(json.dumps(
        {"profile": profile, "overrides": {}, "config": {"target": {"model": model, "dtype": "float32"}},
         "run_metadata": {"date": "2026-11-23", "git_commit": "abc1234", "device": "cpu"}}))
    main = pd.DataFrame([{"method": m, "benchmark": "mt_bench", "temperature": t, "tokens_per_s": tps,
                          "speedup": sp, "tau": tau, "tau_ref": tau}
                         for m, t, tps, sp, tau in [("vanilla", 0.0, 27.1, 0.96, 1.0), ("jakiro_auto", 0.0, 31.0, 1.1, 1.31)]])
    main.to_csv(report / "main_results.csv", index=False)
    if goals:
        pd.DataFrame(GOALS, columns=COLUMNS).to_csv(report / "performance_targets.csv", index=False)
    pd.DataFrame([{"lever": "all kernel fast paths", "measured": "target T(8) ms", "without": 2.3, "with": 2.7,
                   "speedup": 0.82}]).to_csv(report / "levers.csv", index=False)
    (report / "speedup.png").write_bytes(b"\x89PNG\r\n\x1a\n")
    (report / "02_hybrid_decoding_ablations.html").write_text("<html></html>")
    return report


def test_smoke_index_opens_with_banner_verdict_and_figure_then_tables(tmp_path):
    report = _report(tmp_path, "smoke", "tiny:llama")
    page = write_report_index(report, profile_name="smoke").read_text()
    body = page[page.index("<body>"):]
    order = [body.index(SMOKE_BANNER), body.index("id='verdict'"), body.index("src='speedup.png'"),
             body.index("<table")]
    assert order == sorted(order), order
    assert body.index("id='verdict'") < body.index("<h2>Summary</h2>") < body.index("<h2>Performance goals</h2>")
    # the headline claim with its numbers, then tallies per family
    assert "0.45x at T=0 (goal &gt;= 1.5: <span class='notmet'>not met</span>)" in page
    assert "0.42x at T=1 (goal &gt;= 1.3: <span class='notmet'>not met</span>)" in page
    assert "1 of 4 met (1 not settled by their intervals)" in page  # the paper's goals
    assert "(a prompt-lookup branch, not in the paper): 1 of 1 met (1 not settled" in page
    # every table scrolls inside its box instead of widening the page
    assert page.count("<table") == page.count("<div class='tablebox'><table") >= 4
    assert re.search(r"\.tablebox\{[^}]*overflow-x:auto", page) and "max-width:100%" in page
    assert "href='02_hybrid_decoding_ablations.html'" in page and "href='performance_targets.csv'" in page


def test_no_banner_on_a_real_target_and_an_honest_placeholder_without_goals(tmp_path):
    report = _report(tmp_path, "default", "builtin:smollm2", goals=False)
    page = write_report_index(report, profile_name="default").read_text()
    assert SMOKE_BANNER not in page
    assert "no speed goals in this report yet" in page
    assert page.index("id='verdict'") < page.index("src='speedup.png'") < page.index("<table")


@pytest.mark.parametrize("met, resolved, status", [
    (True, True, "met"), (False, True, "not met"), (True, None, "met"),
    (False, False, "not met on the point estimate, not settled by the interval"),
    (None, None, "not measured"),
])
def test_goal_status_words(met, resolved, status):
    row = dict(zip(COLUMNS, GOALS[0]), met=met, resolved=resolved)
    (verdict,) = goal_verdicts(pd.DataFrame([row]))
    assert verdict.status == status
