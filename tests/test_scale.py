"""The main job sized by measurement (issue 43, section 4): jakiro_lib.training.scale on mocked throughput tables, and the
pipeline's use of it with papermill replaced (no notebook runs, no real main job)."""
from __future__ import annotations

import html
import json
import logging
import sys
import types
from pathlib import Path

import pandas as pd
import pytest

from jakiro_lib.report import stages
from jakiro_lib.training import scale as S
from jakiro_lib.training import scale_plan as SP
from jakiro_lib.config import ConfigError
from jakiro_lib.profiles import DEFAULT_SCALE, get_profile
from jakiro_lib.report.pipeline import run_pipeline
from jakiro_lib.report.page import scale_note

FLOOR_N, FLOOR_E = DEFAULT_SCALE


def _rates(**kw) -> SP.Rates:
    """Rates where one conversation of 300 tokens costs 0.15 s to cache and 0.15 s per epoch to train (x1.25 planned),
    50 minutes left for both: 4000 x 3 fits (3000 s), 3200 x 4 would too but with fewer than 1000 per epoch."""
    base = dict(cache_s_per_token=0.0005, train_s_per_token=0.0005, tokens_per_conversation=300.0, available=17_324,
                bench_s=30 * 60.0, measure_s=60.0)
    return SP.Rates(**{**base, **kw})


def test_choice_fits_the_budget_and_buys_conversations_before_epochs():
    rates = _rates()
    budget = SP.caching_training_budget(rates)
    assert budget == pytest.approx(SP.MAIN_JOB_MINUTES * 60 * (1 - SP.MARGIN) - 30 * 60 - 60)
    c = SP.choose_scale(rates)
    assert c.seconds == pytest.approx(SP.planned_seconds(rates, c.num_conversations, c.epochs)) and c.seconds <= budget
    assert (c.num_conversations, c.epochs) == (4000, 3) and c.num_conversations % SP.STEP == 0
    assert c.num_conversations >= SP.CONVERSATIONS_PER_EPOCH * c.epochs
    # one more epoch would leave fewer conversations per epoch than the rule asks, or not fit
    more = SP.most_conversations(rates, c.epochs + 1, budget)
    assert more < SP.CONVERSATIONS_PER_EPOCH * (c.epochs + 1)
    # and the step above the chosen conversations does not fit
    assert SP.planned_seconds(rates, c.num_conversations + SP.STEP, c.epochs) > budget


def test_a_slow_machine_gets_the_floor_and_says_so():
    slow = SP.choose_scale(_rates(train_s_per_token=0.002))  # 1777 x 2: not 2000 conversations, but above the floor
    assert (slow.num_conversations, slow.epochs) == (1700, 2) and "floor" in slow.reason
    c = SP.choose_scale(_rates(cache_s_per_token=0.05))
    assert (c.num_conversations, c.epochs) == (FLOOR_N, FLOOR_E)
    assert "floor" in c.reason and c.seconds > SP.caching_training_budget(_rates(cache_s_per_token=0.05))


def test_all_the_data_fits_then_epochs_grow_up_to_the_cap():
    fast = _rates(cache_s_per_token=1e-6, train_s_per_token=1e-6)
    c = SP.choose_scale(fast)
    assert (c.num_conversations, c.epochs) == (17_324, SP.MAX_EPOCHS) and "all" in c.reason
    small = SP.choose_scale(_rates(available=250))  # a short data file: all of it
    assert small.num_conversations == 250 and small.epochs >= FLOOR_E


def test_a_fixed_key_wins_and_auto_sizes_the_other():
    rates = _rates()
    c = SP.choose_scale(rates, epochs=6)
    assert c.epochs == 6 and c.num_conversations == max(FLOOR_N, SP.most_conversations(rates, 6, SP.caching_training_budget(rates)))
    c = SP.choose_scale(rates, conversations=1000)
    assert c.num_conversations == 1000
    assert SP.planned_seconds(rates, 1000, c.epochs) <= SP.caching_training_budget(rates)
    assert c.epochs == SP.MAX_EPOCHS or SP.planned_seconds(rates, 1000, c.epochs + 1) > SP.caching_training_budget(rates)


def _table(favoured: bool = True) -> pd.DataFrame:
    """A throughput table as scale.measure writes it: caching in one dtype at the profile's batch, eager training rows."""
    dtype, precision = ("bfloat16", "bf16 autocast") if favoured else ("float32", "float32")
    rows = [dict(part="cache", variant="batch 8, freed memory kept", dtype=dtype, allocator="kept", batch_size=8,
                 compiled=False, tokens=1000, seconds=1.0)]
    rows += [dict(part="train", draft=n, variant=f"{n}", dtype=precision, allocator="kept", bucketed=False,
                  compiled=False, batch_size=8, tokens=r, seconds=1.0)
             for n, r in (("dense", 4000), ("dense_h", 5000), ("moe2", 2000), ("moe2_xgate", 1000))]
    df = pd.DataFrame(rows)
    df["tokens_per_s"] = df["tokens"] / df["seconds"]
    return df


def test_rates_come_from_the_stage_plan_with_the_compile_gain(monkeypatch):
    """Caching at its measured rate; training the sum over the profile's drafts (unmeasured multi-step twins at their
    MLP kind's rate over their unroll steps), divided by the compile gain where the profile compiles its step."""
    p = get_profile("default")
    m = SP.Measurement(table=_table(), t1_ms=40.0, tokens_per_conversation=300.0, available=17_324, seconds=70.0)
    r = SP.rates(p, m)
    assert r.cache_s_per_token == pytest.approx(1 / 1000)
    per_token = (1 / 4000 + 1 / 5000 + 1 / 2000 + 1 / 1000 + 2 / 4000 + 2 / 2000) * (1 - p.data.heldout_fraction)
    assert r.train_s_per_token == pytest.approx(per_token / SP.COMPILE_GAIN)
    assert r.bench_s == pytest.approx(SP.BENCH_SECONDS_PER_T1_MS * 40.0 + SP.TREE_TUNING_SECONDS) and r.measure_s == 70.0
    eager = SP.rates(get_profile("default", **{"train.compile": "no"}), m)
    assert eager.train_s_per_token == pytest.approx(per_token)
    fp32 = SP.rates(p, SP.Measurement(table=_table(False), t1_ms=40.0, tokens_per_conversation=300.0, available=10,
                                    seconds=1.0))
    assert fp32.train_s_per_token == pytest.approx(per_token)  # fp32 training is not compiled under "auto"


def test_default_profile_is_auto_and_other_profiles_are_fixed():
    p = get_profile("default")
    assert p.data.scale == "auto" and (p.data.num_conversations, p.train.epochs) == DEFAULT_SCALE
    assert get_profile("smoke").data.scale == "fixed" and get_profile("gpu").data.scale == "fixed"
    assert get_profile("default", **{"data.scale": "fixed"}).data.scale == "fixed"
    with pytest.raises(ConfigError, match="data.scale"):
        get_profile("default", **{"data.scale": "big"})


def _fake_measure(calls: list):
    def measure(profile):
        calls.append(profile)
        return SP.Measurement(table=_table(), t1_ms=40.0, tokens_per_conversation=300.0, available=17_324,
                             seconds=65.0, environment={"cpu": "test"})
    return measure


def test_resolve_records_the_choice_and_a_rerun_reuses_it(tmp_path, caplog):
    calls: list = []
    p = get_profile("default")
    caplog.set_level(logging.INFO, logger="jakiro_lib.training.scale")
    overrides, record = S.resolve_scale(p, {"bench.limit": 2}, tmp_path, measure=_fake_measure(calls))
    assert len(calls) == 1 and overrides["bench.limit"] == 2
    n, e = overrides["data.num_conversations"], overrides["train.epochs"]
    saved = json.loads((tmp_path / S.SCALE_JSON).read_text())
    assert saved == json.loads(json.dumps(record))
    assert (saved["chosen"]["num_conversations"], saved["chosen"]["epochs"]) == (n, e)
    assert saved["measured"]["t1_ms"] == 40.0 and saved["measured"]["train"]["dense"]["tokens_per_s"] == 4000
    assert saved["budget"]["main_job_minutes"] == SP.MAIN_JOB_MINUTES and saved["plan"][-1]["stage"] == "total"
    assert "measuring" in caplog.text and f"{n} conversations x {e} epochs" in caplog.text
    # an interrupted main job continues at the same scale: no new measurement
    caplog.clear()
    again, _ = S.resolve_scale(p, {"bench.limit": 3}, tmp_path, measure=_fake_measure(calls))
    assert len(calls) == 1 and (again["data.num_conversations"], again["train.epochs"]) == (n, e)
    assert "reusing" in caplog.text and str(tmp_path / S.SCALE_JSON) in caplog.text
    # a setting the choice depends on changed (other drafts): measured again
    p2 = get_profile("default", drafts="dense,moe2")
    S.resolve_scale(p2, {"drafts": "dense,moe2"}, tmp_path, measure=_fake_measure(calls))
    assert len(calls) == 2 and "measuring again" in caplog.text


def test_overrides_win_over_auto_and_the_log_says_so(tmp_path, caplog):
    calls: list = []
    caplog.set_level(logging.INFO, logger="jakiro_lib.training.scale")
    both = {"data.num_conversations": "900", "train.epochs": "3"}
    out, record = S.resolve_scale(get_profile("default", **both), both, tmp_path, measure=_fake_measure(calls))
    assert out == both and record is None and not calls and not (tmp_path / S.SCALE_JSON).exists()
    assert "data.num_conversations=900 and train.epochs=3 set" in caplog.text
    one = {"train__epochs": "5"}  # the papermill spelling
    out, record = S.resolve_scale(get_profile("default", **one), one, tmp_path, measure=_fake_measure(calls))
    assert out["train__epochs"] == "5" and "train.epochs" not in out and record["chosen"]["epochs"] == 5
    assert out["data.num_conversations"] == record["chosen"]["num_conversations"] and len(calls) == 1
    assert "train.epochs=5 set" in caplog.text
    fixed = get_profile("default", **{"data.scale": "fixed"})
    assert S.resolve_scale(fixed, {"data.scale": "fixed"}, tmp_path / "x", measure=_fake_measure(calls)) == (
        {"data.scale": "fixed"}, None) and len(calls) == 1


def test_a_damaged_record_is_measured_again(tmp_path):
    calls: list = []
    (tmp_path / S.SCALE_JSON).write_text('{"chosen": ')
    S.resolve_scale(get_profile("default"), {}, tmp_path, measure=_fake_measure(calls))
    assert len(calls) == 1 and json.loads((tmp_path / S.SCALE_JSON).read_text())["version"] == S.VERSION


def test_measure_on_a_tiny_target_is_quick_and_complete(tmp_path):
    """The real measurement, on the smoke profile's tiny target: a cache row at the profile's batch, one eager training
    row per single-step draft, T(1), tokens per conversation and the conversations the source has."""
    p = get_profile("smoke", **{"data.scale": "auto", "drafts": "dense,moe2,moe2_u2"})
    m = S.measure(p, conversations=4, steps=1, warmup=0, token_sample=8)
    cache = m.table[m.table["part"] == "cache"]
    assert len(cache) == 1 and cache["batch_size"].iloc[0] == p.data.cache_batch_size
    assert set(m.table.loc[m.table["part"] == "train", "draft"]) == {"dense", "moe2"}
    assert m.t1_ms > 0 and m.tokens_per_conversation > 0 and m.available > 4 and m.seconds > 0
    r = SP.rates(p, m)
    assert r.cache_s_per_token > 0 and r.train_s_per_token > 0
    with pytest.raises(SP.ScaleError, match="no trained token"):  # not a loader that never yields a step
        S.measure(get_profile("smoke", **{"data.max_length": "4"}), conversations=2, steps=1, warmup=0, token_sample=2)


class _FakePapermill(types.ModuleType):
    """papermill's execute_notebook replaced: copies the notebook and records the parameters it was given."""

    class PapermillExecutionError(Exception):
        pass

    def __init__(self) -> None:
        super().__init__("papermill")
        self.calls: list[dict] = []

    def execute_notebook(self, source, out, parameters=None, **kw):
        self.calls.append(dict(parameters))
        Path(out).write_text(Path(source).read_text())


def test_pipeline_sizes_the_job_before_stage_00_and_reports_it(tmp_path, monkeypatch):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    for stage in stages.STAGES:
        (nbs / f"{stage}.ipynb").write_text("{}")
    fake = _FakePapermill()
    monkeypatch.setitem(sys.modules, "papermill", fake)
    monkeypatch.setattr(stages, "notebook_to_html", lambda nb, html=None: Path(html or Path(nb).with_suffix(".html")))
    calls: list = []
    monkeypatch.setattr(S, "measure", _fake_measure(calls))
    kw = dict(report_dir=tmp_path / "report", run_dir=tmp_path / "run", notebook_dir=nbs, stages="00")
    run_pipeline("default", overrides={"bench.limit": 1}, **kw)
    record = json.loads((tmp_path / "run" / S.SCALE_JSON).read_text())
    chosen = record["chosen"]
    resolved = json.loads(Path(fake.calls[0]["profile"]).read_text())  # the notebooks get the resolved profile
    assert resolved["overrides"] == {"bench.limit": 1, "data.num_conversations": chosen["num_conversations"],
                                     "train.epochs": chosen["epochs"]} and "overrides" not in fake.calls[0]
    assert (resolved["profile"]["data"]["num_conversations"], resolved["profile"]["train"]["epochs"]) == (
        chosen["num_conversations"], chosen["epochs"])
    assert json.loads((tmp_path / "report" / S.SCALE_JSON).read_text())["chosen"] == chosen
    page = (tmp_path / "report" / "index.html").read_text()
    assert html.escape(scale_note(record)) in page and f"{chosen['num_conversations']:,} conversations" in scale_note(record)
    run_pipeline("default", overrides={"bench.limit": 1}, **kw)  # up to date: same scale, same fingerprint, skipped
    assert len(calls) == 1 and len(fake.calls) == 1
    # both keys set: no auto, and the report's copy of an earlier choice goes
    run_pipeline("default", overrides={"data.num_conversations": 700, "train.epochs": 2}, **kw)
    resolved = json.loads(Path(fake.calls[-1]["profile"]).read_text())
    assert resolved["overrides"] == {"data.num_conversations": 700, "train.epochs": 2}
    assert resolved["profile"]["data"]["num_conversations"] == 700
    assert not (tmp_path / "report" / S.SCALE_JSON).exists() and len(calls) == 1


def test_a_stage_run_alone_takes_the_scale_the_pipeline_recorded(tmp_path, capsys):
    """``python -m jakiro_lib cache|train|bench --profile default`` after a pipeline: the recorded scale, not the
    floor (a train at 600 x 2 on a cache of thousands would retrain the drafts at another scale); never a measurement."""
    from argparse import Namespace

    from jakiro_lib import commands

    args = Namespace(profile="default", set=[], run_dir=tmp_path)
    assert (commands.resolved_profile(args).data.num_conversations, commands.resolved_profile(args).train.epochs) == DEFAULT_SCALE
    assert "no scale recorded" in capsys.readouterr().err
    calls: list = []
    overrides, record = S.resolve_scale(get_profile("default"), {}, tmp_path, measure=_fake_measure(calls))
    p = commands.resolved_profile(args)
    assert (p.data.num_conversations, p.train.epochs) == (overrides["data.num_conversations"], overrides["train.epochs"])
    assert f"{p.data.num_conversations} conversations x {p.train.epochs} epochs" in capsys.readouterr().err
    epochs = commands.resolved_profile(Namespace(profile="default", set=["train.epochs=7"], run_dir=tmp_path))
    assert epochs.train.epochs == 7 and epochs.data.num_conversations == DEFAULT_SCALE[0]  # another basis: not it
    assert S.recorded_scale(get_profile("smoke"), {}, tmp_path) == ({}, None) and len(calls) == 1
