"""A method is one entry and runs one way: a record names the registry's method, how it ran is two fields of its own
(engine, capture), and tables and ``--methods`` name it by its name. Records written when a method could run on two
engines in one study keep the labels they were tabled under (``methods.record_label``, the one adapter)."""
import json

from jakiro_lib.measure.methods import record_label, record_method
from jakiro_lib.measure.summary import load_records, summarize, versus
from jakiro_lib.profiles import get_profile
from jakiro_lib.study import profile_methods
from jakiro_lib.study.s02_bench import _select


def _recs(method, tps, *, kind="spec", questions=4, **fields):
    return [{"method": method, "kind": kind, "benchmark": "mt_bench", "temperature": 0.0, "question_id": str(q),
             "turn": 0, "repeat": 0, "tokens_per_second": tps, "new_tokens": 10, "cycles": 5 if kind == "spec" else 10,
             "accepted": [2] * 5 if kind == "spec" else [1] * 10, "draft_forwards": 0, "draft_time": 0.0,
             "wall_time": 1.0, "output_ids": [q], **fields} for q in range(questions)]


def test_a_record_of_today_is_its_method_and_old_ones_keep_their_labels():
    new = {"method": "jakiro_auto", "kind": "spec", "engine": "static", "capture": "graphs"}
    assert record_label(new) == record_method(new) == "jakiro_auto"
    oldest = {"method": "jakiro_auto_static_compiled", "kind": "spec"}  # the label as the method, no fields
    fielded = {"method": "jakiro_auto", "kind": "spec", "engine": "static", "compiled": True}
    loop = {"method": "jakiro_auto", "kind": "spec", "engine": "loop", "compiled": False}
    assert record_label(oldest) == record_label(fielded) == "jakiro_auto_static_compiled"
    assert record_method(oldest) == record_method(fielded) == record_method(loop) == record_label(loop) == "jakiro_auto"
    assert record_label({"method": "jakiro_auto", "kind": "spec", "engine": "static"}) == "jakiro_auto_static"
    assert record_label({"method": "hf_compiled", "kind": "hf", "compiled": True}) == "hf_compiled"


def test_an_old_study_keeps_a_row_per_engine_and_meets_eagle2_on_each(tmp_path):
    """An old records file with a method on the loop engine and captured (the oldest form naming the run by its
    label): one summary row per run, and ``versus`` meets each run with EAGLE-2's run on the same engine."""
    old = (_recs("vanilla", 10.0, kind="vanilla", engine="loop", compiled=False)
           + _recs("jakiro_auto", 20.0, engine="loop", compiled=False)
           + _recs("jakiro_auto_static_compiled", 30.0, questions=2)
           + _recs("jakiro_auto", 30.0, engine="static", compiled=True)[2:]
           + _recs("eagle2", 10.0, engine="loop", compiled=False)
           + _recs("eagle2_static_compiled", 15.0, engine="static", compiled=True))
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in old))
    records = load_records(path)
    rows = {r["method"]: r for r in summarize(records)}
    assert {m for m in rows if m.startswith("jakiro")} == {"jakiro_auto", "jakiro_auto_static_compiled"}
    assert rows["jakiro_auto_static_compiled"]["questions"] == 4
    assert (rows["jakiro_auto"]["tokens_per_s"], rows["jakiro_auto_static_compiled"]["tokens_per_s"]) == (20.0, 30.0)
    assert rows["jakiro_auto_static_compiled"]["capture"] == "compiled" and rows["jakiro_auto"]["capture"] == "none"
    vs = {r["method"]: r for r in versus(records, "eagle2")}
    assert vs["jakiro_auto_static_compiled"]["baseline"] == "eagle2_static_compiled"
    assert vs["jakiro_auto_static_compiled"]["tokens_per_s_ratio"] == 2.0
    assert vs["jakiro_auto"]["baseline"] == "eagle2" and vs["jakiro_auto"]["tokens_per_s_ratio"] == 2.0


def test_a_study_of_today_has_one_row_a_method():
    records = (_recs("vanilla", 10.0, kind="vanilla", engine="static", capture="none")
               + _recs("jakiro_auto", 20.0, engine="static", capture="none"))
    rows = {r["method"]: r for r in summarize(records)}
    assert set(rows) == {"vanilla", "jakiro_auto"} and rows["jakiro_auto"]["greedy_compared"] == 4


def test_methods_option_takes_the_methods_names(tmp_path):
    """``bench --methods`` / ``gpucheck --methods``: names of the study's methods, whatever the device; a name the
    study does not have is one error naming it."""
    for device in ("cpu", "cuda"):
        methods = profile_methods(get_profile("smoke", **{"target.device": device}), tmp_path, "main")
        got = _select(methods, "vanilla,hf_compiled,jakiro_auto", "main")
        assert list(got) == ["vanilla", "hf_compiled", "jakiro_auto"]
    try:
        _select(methods, "jakiro_auto_static_compiled", "main")
    except ValueError as exc:
        assert "jakiro_auto_static_compiled" in str(exc)
    else:
        raise AssertionError("an unknown method was selected")
