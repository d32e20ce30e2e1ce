"""The study notebooks and the papermill pipeline.

* The committed notebooks are clean (no outputs) and take the papermill parameters.
* Pipeline machinery on trivial stand-in notebooks: stamps, skipping, re-execution of a changed stage
  and the ones after it, failure reporting.
* The whole pipeline for real with the ``smoke`` profile (tiny random target, 24 conversations) into a
  temporary directory, then a second run that skips every stage.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from jakiro_lib.config import EAGLE2_DRAFT, JAKIRO_DRAFT
from jakiro_lib.profiles import get_profile
from jakiro_lib.report.pipeline import NOTEBOOK_DIR, run_pipeline
from jakiro_lib.report.stages import STAGES, PipelineError, select_stages

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PARAMETER_NAMES = {"profile", "overrides", "run_dir", "report_dir", "force"}


# --------------------------------------------------------------------------------------------------
# The committed notebooks
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
def test_committed_notebook_is_clean_and_parameterised(stage):
    nb = nbformat.read(str(NOTEBOOK_DIR / f"{stage}.ipynb"), as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and params[0].cell_type == "code"
    names: dict = {}
    exec(params[0].source, {}, names)  # noqa: S102 - our own notebook's literal assignments
    assert set(names) == PARAMETER_NAMES
    assert names == {"profile": "default", "overrides": {}, "run_dir": None, "report_dir": None, "force": False}
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{stage}: commit without outputs"
    assert nb.cells[0].cell_type == "markdown"


def test_select_stages():
    assert select_stages(None) == list(STAGES)
    assert select_stages("00,01") == list(STAGES[:2])
    assert select_stages(["3", "02_hybrid_decoding_ablations"]) == list(STAGES[2:])
    assert select_stages(["train_moe_head"]) == [STAGES[1]]
    with pytest.raises(ValueError, match="unknown stage"):
        select_stages("07")


def test_unknown_override_fails_before_any_kernel(tmp_path):
    with pytest.raises(ValueError, match="unknown config key"):
        run_pipeline("smoke", overrides={"bench.nope": 1}, report_dir=tmp_path / "r", run_dir=tmp_path / "w")


# --------------------------------------------------------------------------------------------------
# Machinery on stand-in notebooks
# --------------------------------------------------------------------------------------------------

STANDIN = """
import json, os, pathlib, time
out = pathlib.Path(report_dir) / "{stage}.txt"
resolved = json.loads(pathlib.Path(profile).read_text())  # the pipeline hands over the resolved profile's file
out.write_text(f"{{time.time()}} {{resolved['overrides']}} {{resolved['profile']['bench']['limit']}} {{force}}")
if os.environ.get("JAKIRO_TEST_FAIL") == "{stage}":
    raise RuntimeError("boom in {stage}")
"""


def _standins(folder: Path, body: str = STANDIN) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for stage in STAGES:
        params = new_code_cell('profile = "default"\noverrides = {}\nrun_dir = None\nreport_dir = None\nforce = False')
        params.metadata["tags"] = ["parameters"]
        nb = new_notebook(cells=[params, new_code_cell(body.format(stage=stage))])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, str(folder / f"{stage}.ipynb"))
    return folder


def _statuses(report: Path) -> dict[str, str]:
    return {r["stage"]: r["status"] for r in json.loads((report / "pipeline.json").read_text())["results"]}


@pytest.mark.notebooks
def test_pipeline_stamps_skip_and_rerun(tmp_path):
    nbs = _standins(tmp_path / "nbs")
    report, runs = tmp_path / "report", tmp_path / "runs"
    kw = dict(report_dir=report, run_dir=runs, notebook_dir=nbs)
    run_pipeline("smoke", overrides={"bench.limit": 1}, **kw)
    assert _statuses(report) == {s: "executed" for s in STAGES}
    for stage in STAGES:
        assert (report / f"{stage}.ipynb").is_file() and (report / f"{stage}.html").is_file()
        assert (report / ".stamps" / f"{stage}.json").is_file()
        assert "{'bench.limit': 1} 1 False" in (report / f"{stage}.txt").read_text()
    index = (report / "index.html").read_text()
    assert all(f"href='{s}.html'" in index and f"href='{s}.ipynb'" in index for s in STAGES)

    # same parameters (given as a CLI string): everything is up to date
    run_pipeline("smoke", overrides={"bench.limit": "1"}, **kw)
    assert set(_statuses(report).values()) == {"skipped"}

    # a newer notebook source re-executes that stage and the stages after it, not the ones before
    time.sleep(0.05)
    src = nbs / f"{STAGES[2]}.ipynb"
    os.utime(src, (time.time() + 5, time.time() + 5))
    run_pipeline("smoke", overrides={"bench.limit": 1}, **kw)
    assert _statuses(report) == {STAGES[0]: "skipped", STAGES[1]: "skipped", STAGES[2]: "executed",
                                 STAGES[3]: "executed"}

    # a subset: only the selected stage runs (forced)
    run_pipeline("smoke", overrides={"bench.limit": 1}, stages="01", force=True, **kw)
    assert _statuses(report) == {STAGES[1]: "executed"}


@pytest.mark.notebooks
def test_pipeline_failure_names_notebook_and_partial_copy(tmp_path, monkeypatch):
    nbs = _standins(tmp_path / "nbs")
    report = tmp_path / "report"
    monkeypatch.setenv("JAKIRO_TEST_FAIL", STAGES[0])
    with pytest.raises(PipelineError) as info:
        run_pipeline("smoke", report_dir=report, run_dir=tmp_path / "runs", notebook_dir=nbs, stages="00")
    msg = str(info.value)
    failed = report / f"{STAGES[0]}.failed.ipynb"
    assert STAGES[0] in msg and "boom in" in msg and str(failed) in msg
    assert failed.is_file() and not (report / ".stamps" / f"{STAGES[0]}.json").exists()
    nb = nbformat.read(str(failed), as_version=4)
    assert any(o.get("output_type") == "error" for c in nb.cells for o in c.get("outputs", []))


# The setup cell of a notebook under the pipeline: it takes the run lock as the pipeline's kernel, then says who
# holds the lock file, or (BEATS) writes a heartbeat into the run directory until the kernel ends.
SETUP = """
import json, os, pathlib, time
from jakiro_lib import study as S
ctx = S.notebook_setup(profile, overrides, run_dir=run_dir, report_dir=report_dir)
holder = json.loads((ctx.run_dir / ".lock").read_text())["pid"]
pathlib.Path(report_dir, "{stage}.lock.json").write_text(json.dumps({{"kernel": os.getpid(), "holder": holder}}))
"""
BEATS = SETUP + """
beats = ctx.run_dir / "beats.txt"
beats.write_text(f"{{os.getpid()}}\\n")
for _ in range(6000):
    with beats.open("a") as f:
        f.write(f"{{time.time()}}\\n")
    time.sleep(0.02)
"""


@pytest.mark.notebooks
def test_the_pipelines_kernels_work_under_its_run_lock(tmp_path):
    """Each notebook's setup takes the run lock; under the pipeline, which holds it, the kernel works under the
    pipeline's lock (the lock file still names the pipeline) instead of refusing or waiting."""
    report = tmp_path / "report"
    run_pipeline("smoke", report_dir=report, run_dir=tmp_path / "runs", notebook_dir=_standins(tmp_path / "nbs", SETUP),
                 stages="00,01")
    assert _statuses(report) == {STAGES[0]: "executed", STAGES[1]: "executed"}
    for stage in STAGES[:2]:
        said = json.loads((report / f"{stage}.lock.json").read_text())
        assert said["holder"] == os.getpid() != said["kernel"]


@pytest.mark.notebooks
def test_a_killed_pipeline_takes_its_notebook_kernel_with_it(tmp_path):
    """SIGKILL of the pipeline while a notebook writes into the run directory: the kernel ends at once, not a
    heartbeat later (ipykernel's own parent poller looks once a second), so nothing writes there unguarded."""
    runs, nbs = tmp_path / "runs", _standins(tmp_path / "nbs", BEATS)
    code = (f"from jakiro_lib.report.pipeline import run_pipeline; run_pipeline('smoke', run_dir={str(runs)!r}, "
            f"report_dir={str(tmp_path / 'report')!r}, notebook_dir={str(nbs)!r}, stages='00')")
    pipeline = subprocess.Popen([sys.executable, "-c", code], cwd=NOTEBOOK_DIR.parent, stderr=subprocess.DEVNULL)
    beats = runs / "beats.txt"
    try:
        deadline = time.monotonic() + 180
        while not (beats.is_file() and len(beats.read_text().splitlines()) > 3):
            assert pipeline.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        kernel = int(beats.read_text().splitlines()[0])
        killed = time.time()
    finally:
        pipeline.kill()
        pipeline.wait()
    time.sleep(1.5)
    last = float(beats.read_text().splitlines()[-1])
    status = Path(f"/proc/{kernel}/status")
    alive = status.exists() and "zombie" not in status.read_text()
    if alive:
        os.kill(kernel, signal.SIGKILL)
    assert not alive and last < killed + 0.25, (alive, last - killed)


# --------------------------------------------------------------------------------------------------
# The real thing: smoke profile end to end
# --------------------------------------------------------------------------------------------------

SMOKE_OVERRIDES = {
    "bench.limit": 1,
    "bench.max_new_tokens": 8,
    # exercise the reduced draft vocabulary (shared by the main study's two drafts, which ask for 128 tokens)
    f"drafts.{EAGLE2_DRAFT}.draft_vocab_size": 128,
    f"drafts.{JAKIRO_DRAFT}.draft_vocab_size": 128,
}


@pytest.mark.notebooks
def test_smoke_pipeline_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("JAKIRO_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("JAKIRO_THREADS", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report = tmp_path / "reports" / "smoke"
    t0 = time.perf_counter()
    out = run_pipeline("smoke", overrides=SMOKE_OVERRIDES, report_dir=report)
    first = time.perf_counter() - t0
    assert out == report.resolve()
    run_dir = tmp_path / "runs" / "smoke"

    # notebooks and their HTML, code visible, no error outputs
    calls = dict(zip(STAGES, ("prepare_features", "train_all", "run_study", "plot_speedup")))
    for stage in STAGES:
        nb = nbformat.read(str(report / f"{stage}.ipynb"), as_version=4)
        assert not [o for c in nb.cells for o in c.get("outputs", []) if o.get("output_type") == "error"]
        # nothing on stderr (red in the report): library bars and warnings quieted, our log lines on stdout
        stderr = [o.get("text", "")[:160] for c in nb.cells for o in c.get("outputs", []) if o.get("name") == "stderr"]
        assert not stderr, (stage, stderr)
        html = (report / f"{stage}.html").read_text()
        assert "jp-InputArea" in html and f">{calls[stage]}<" in html  # code cells kept
    # notebook 01 lists the profile's own drafts (generated from it, not a hand-written copy)
    nb01 = nbformat.read(str(report / "01_train_moe_head.ipynb"), as_version=4)
    listed = next(c for c in nb01.cells if c.get("id") == "drafts-table")["outputs"][0]["data"]["text/plain"]
    assert all(name in listed for name in get_profile("smoke").drafts), listed
    # heavy artifacts under $JAKIRO_RUNS/<profile>
    assert (run_dir / "features" / "manifest.json").is_file()
    for name in ("dense", "moe2", "moe2_nocontrast", "moe4"):
        assert (run_dir / "drafts" / name / "results.json").is_file()
    for study in ("main", "ablations"):
        assert (run_dir / "bench" / study / "records.jsonl").stat().st_size > 0

    # tables hold numbers
    main = pd.read_csv(report / "main_results.csv")
    assert {"vanilla", "eagle2", "jakiro", "jakiro_cepd"} <= set(main["method"])
    assert set(main["temperature"]) == {0.0, 1.0}
    assert (main["tokens_per_s"] > 0).all()
    assert (main.loc[main["kind"] == "spec", "tau"] >= 1.0).all()
    assert (main.loc[main["method"] == "vanilla", "tau"] == 1.0).all()
    assert main["speedup"].notna().all() and (main["speedup"] > 0).all()
    greedy = main[main["temperature"] == 0]  # fp32 on the CPU: every method reproduces vanilla's output
    assert (greedy["greedy_compared"] > 0).all() and (greedy["greedy_same"] == greedy["greedy_compared"]).all()
    abl = pd.read_csv(report / "ablations.csv")
    assert set(abl["temperature"]) == {0.0} and len(abl["method"].unique()) >= 6
    assert (abl.loc[abl["kind"] == "spec", "tau"] >= 1.0).all() and (abl["tokens_per_s"] > 0).all()
    vs = pd.read_csv(report / "versus_eagle2.csv")  # every drafted method against its study's EAGLE-2
    assert {("main", "jakiro"), ("ablations", "eagle2_h"), ("ablations", "jakiro_u2")} <= set(zip(vs["study"], vs["method"]))
    assert not {"eagle2", "experts=1 (eagle2)", "vanilla"} & set(vs["method"])
    assert (vs["tau_ci_low"] <= vs["tau_ci_high"]).all() and (vs["tokens_per_s_ratio"] > 0).all()
    assert ((vs["tau_verdict"] == "better") == (vs["tau_ci_low"] > 1)).all()
    by_depth = pd.read_csv(report / "acceptance_by_depth.csv")
    assert "jakiro_u2" in set(by_depth["method"]) and by_depth["p_ge_1"].between(0, 1).all()
    training = pd.read_csv(report / "training.csv")
    assert list(training["draft"]) == ["dense", "dense_h", "moe2", "moe2_xgate", "moe2_xequal", "moe2_nocontrast", "moe4",
                                       "dense_u2", "dense_h_u2", "moe2_u2", "moe2_xgate_u2"]
    assert training["acc_a"].between(0, 1).all() and (training["steps"] > 0).all()
    assert training.set_index("draft").loc["dense", "draft_vocab_size"] == 128
    assert pd.isna(training.set_index("draft").loc["moe4", "draft_vocab_size"])
    assert training["acc_b"].isna().tolist() == [True, True, False, False, False, False, False, True, True, False, False]
    assert training.set_index("draft")["unroll_steps"].to_dict() == {**dict.fromkeys(training["draft"], 1),
                                                                     "dense_u2": 2, "dense_h_u2": 2, "moe2_u2": 2,
                                                                     "moe2_xgate_u2": 2}
    # performance section: cost model, the tuned tree budget of the "_auto" methods, goals
    drafted = main[(main["kind"] == "spec") & (main["draft"] != "none")]
    assert drafted["total_tokens"].between(2, 32).all()
    alone = main[main["method"] == "lookup_only"]  # the lookup chain without a draft: no drafted tree
    assert len(alone) == 2 and (alone["draft"] == "none").all() and alone["total_tokens"].isna().all()
    budget = pd.read_csv(report / "tree_budget.csv")
    assert set(budget["method"]) == {"eagle2_auto", "jakiro_auto", "eagle2_lookup", "jakiro_lookup"}
    assert budget["chosen"].sum() == 4
    tokens = main[main["temperature"] == 0].set_index("method")["total_tokens"]
    assert tokens["eagle2_lookup"] == tokens["eagle2_auto"] and tokens["jakiro_lookup"] == tokens["jakiro_auto"]
    assert (main.loc[main["method"].isin(["eagle2", "jakiro", "jakiro_cepd"]), "total_tokens"] == 8).all()
    assert (pd.read_csv(report / "cost_model_target.csv")["ms"] > 0).all()
    assert len(pd.read_csv(report / "cost_model_draft.csv")) >= 4
    levers = pd.read_csv(report / "levers.csv")  # gqa attention is on for the tiny target: a kernel row
    assert "all kernel fast paths" in set(levers["lever"]) and (levers["speedup"] > 0).all()
    assert "prompt-lookup chain grafted on the tuned tree (extension)" in set(levers["lever"])
    goals = pd.read_csv(report / "performance_targets.csv")
    assert len(goals) >= 7 and goals["ratio"].notna().all() and (goals["ratio"] > 0).all()
    comparison = pd.read_csv(report / "comparison_published.csv")
    assert "ours (this run)" in set(comparison["source"]) and len(comparison) > 10

    # figures
    pngs = sorted(report.glob("*.png"))
    names = {p.name for p in pngs}
    assert {"speedup.png", "tau.png", "ablations.png", "accept_hist_main.png", "training_curves.png",
            "router_load.png", "cost_model.png", "cycle_costs.png"} <= names
    for p in pngs:
        assert p.read_bytes().startswith(PNG_MAGIC) and p.stat().st_size > 5_000, p

    # config and index
    cfg = json.loads((report / "run_config.json").read_text())
    assert cfg["profile"] == "smoke" and cfg["overrides"]["bench.limit"] == 1
    assert cfg["config"]["bench"]["max_new_tokens"] == 8 and "date" in cfg["run_metadata"]
    index = (report / "index.html").read_text()
    for name in [f"{s}.html" for s in STAGES] + [f"{s}.ipynb" for s in STAGES] + \
            ["main_results.csv", "ablations.csv", "training.csv", "run_config.json"] + sorted(names):
        assert f"href='{name}'" in index, name
    assert "jakiro_cepd" in index and "Performance goals" in index  # the summary and goals tables
    assert "What each speed lever bought" in index

    # a second run skips every stage
    t1 = time.perf_counter()
    run_pipeline("smoke", overrides=SMOKE_OVERRIDES, report_dir=report)
    second = time.perf_counter() - t1
    assert set(_statuses(report).values()) == {"skipped"}
    assert second < max(20.0, first / 3), (first, second)
