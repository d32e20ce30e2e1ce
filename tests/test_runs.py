"""A method is one entry (issue 45): a record names the registry's method, how it ran is two fields of its own
(engine, compiled), tables and ``--methods`` name a run by its derived label, and records written before, whose
method was that label, read as the same run."""
import json

from jakiro_lib.config import TargetConfig
from jakiro_lib.data.conversations import Question
from jakiro_lib.measure.bench import run_benchmark
from jakiro_lib.measure.methods import MethodSpec, record_run, run_label
from jakiro_lib.measure.summary import load_records, summarize, versus
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile
from jakiro_lib.study import profile_methods
from jakiro_lib.study.s02_bench import _select


def _recs(method, tps, *, kind="spec", engine=None, compiled=None, questions=4):
    extra = {k: v for k, v in (("engine", engine), ("compiled", compiled)) if v is not None}
    return [{"method": method, "kind": kind, "benchmark": "mt_bench", "temperature": 0.0, "question_id": str(q),
             "turn": 0, "repeat": 0, "tokens_per_second": tps, "new_tokens": 10, "cycles": 5 if kind == "spec" else 10,
             "accepted": [2] * 5 if kind == "spec" else [1] * 10, "draft_forwards": 0, "draft_time": 0.0,
             "wall_time": 1.0, "output_ids": [q], **extra} for q in range(questions)]


def test_the_label_is_derived_from_the_run_and_old_names_read_back():
    assert [run_label("jakiro_auto", *run) for run in (("loop", False), ("static", False), ("static", True))] == [
        "jakiro_auto", "jakiro_auto_static", "jakiro_auto_static_compiled"]
    assert run_label("hf_compiled", "hf", True) == "hf_compiled"  # HF's methods: the name says it all
    old = {"method": "jakiro_auto_static_compiled", "kind": "spec"}  # before issue 45, the oldest without fields
    assert record_run(old) == record_run({**old, "engine": "static", "compiled": True}) == (
        "jakiro_auto", "static", True)
    assert record_run({"method": "jakiro_auto", "kind": "spec", "engine": "static", "compiled": True}) == (
        "jakiro_auto", "static", True)
    assert record_run({"method": "hf_compiled", "kind": "hf"}) == ("hf_compiled", "hf", False)


def test_a_summary_gives_each_engine_of_a_method_its_own_row():
    records = (_recs("vanilla", 10.0, kind="vanilla", engine="loop", compiled=False)
               + _recs("jakiro_auto", 20.0, engine="loop", compiled=False)
               + _recs("jakiro_auto", 30.0, engine="static", compiled=True))
    rows = {r["method"]: r for r in summarize(records)}
    assert set(rows) == {"vanilla", "jakiro_auto", "jakiro_auto_static_compiled"}
    assert (rows["jakiro_auto"]["tokens_per_s"], rows["jakiro_auto_static_compiled"]["tokens_per_s"]) == (20.0, 30.0)
    assert (rows["jakiro_auto_static_compiled"]["engine"], rows["jakiro_auto_static_compiled"]["compiled"]) == (
        "static", True)
    assert rows["jakiro_auto_static_compiled"]["greedy_compared"] == 4  # against vanilla on the loop engine


def test_old_suffixed_records_are_the_same_run(tmp_path):
    """A records file written before issue 45 names a static run by its label: read back, its runs are the
    new records' runs (one summary row of both), and ``versus`` meets each run with EAGLE-2 on its engine."""
    old = _recs("jakiro_auto_static_compiled", 30.0, questions=2)  # no engine, no compiled: the oldest form
    new = _recs("jakiro_auto", 30.0, engine="static", compiled=True)[2:]
    eagle = (_recs("eagle2", 10.0, engine="loop", compiled=False)
             + _recs("eagle2_static_compiled", 15.0, engine="static", compiled=True))
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in old + new + eagle))
    records = load_records(path)
    assert {(r["method"], r["engine"], r["compiled"]) for r in records[:4]} == {("jakiro_auto", "static", True)}
    rows = [r for r in summarize(records) if r["method"].startswith("jakiro")]
    assert [(r["method"], r["questions"]) for r in rows] == [("jakiro_auto_static_compiled", 4)]
    vs = {r["method"]: r for r in versus(records, "eagle2")}
    assert vs["jakiro_auto_static_compiled"]["baseline"] == "eagle2_static_compiled"
    assert vs["jakiro_auto_static_compiled"]["tokens_per_s_ratio"] == 2.0


def test_a_resumed_benchmark_knows_the_runs_of_old_records(tmp_path):
    """Records of ``vanilla_static`` written as before issue 45 (the label as the method, no engine fields) are
    done: the benchmark resumed over them adds nothing; a record of today names the method and how it ran."""
    target = load_target(TargetConfig(model="tiny:llama"))
    methods = {"vanilla_static_compiled": MethodSpec("vanilla", engine="static", compile=True)}
    questions = [Question("q1", "writing", ["Say something."], "mt_bench")]
    path = run_benchmark(target, methods, questions, max_new_tokens=4, warmup=0, out_dir=tmp_path, progress=False)
    (rec,) = [json.loads(line) for line in path.read_text().splitlines()]  # as written, not as read back
    assert (rec["method"], rec["engine"], rec["compiled"]) == ("vanilla", "static", True)
    old = {k: v for k, v in rec.items() if k not in ("engine", "compiled")}
    path.write_text(json.dumps({**old, "method": "vanilla_static_compiled"}) + "\n")
    before = path.read_text()
    run_benchmark(target, methods, questions, max_new_tokens=4, warmup=0, out_dir=tmp_path, progress=False)
    assert path.read_text() == before


def test_methods_option_takes_labels_and_bare_names(tmp_path):
    """``bench --methods`` / ``gpucheck --methods`` as .device/run.sh types them: a label selects its run, a
    method's bare name that labels no run selects every run of the method."""
    cuda = profile_methods(get_profile("smoke", **{"target.device": "cuda", "bench.static_engine": "true"}),
                           tmp_path, "main")
    got = _select(cuda, "vanilla,hf_compiled,vanilla_static_compiled,jakiro_auto_static_compiled", "main")
    assert list(got) == ["vanilla", "hf_compiled", "jakiro_auto_static_compiled", "vanilla_static_compiled"]
    assert got["jakiro_auto_static_compiled"].engine == "static" and got["jakiro_auto_static_compiled"].compile
    assert set(_select(cuda, "jakiro_auto", "main")) == {"jakiro_auto_static_compiled", "jakiro_auto_static"}
