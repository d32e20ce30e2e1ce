"""Study runs resume: records survive a run directory copied or moved elsewhere, not a changed draft."""
import json
import shutil

import pandas as pd
import pytest

import jakiro_lib.decoding.methods as methods
from jakiro_lib.profiles import get_profile
from jakiro_lib.models.draft import DraftModel
from jakiro_lib import study as S
from jakiro_lib.layout import RunLayout, draft_path, has_weights
from jakiro_lib.study import load_study_records, run_study
from jakiro_lib.study.context import StudyContext
from jakiro_lib.models.target import load_target

from helpers import single_thread


def test_benchmark_records_survive_a_copied_run_dir_but_not_a_changed_draft(tmp_path, monkeypatch):
    profile = get_profile("smoke", **{"bench.limit": 1, "bench.max_new_tokens": 4, "bench.warmup": 0,
                                      "bench.temperatures": "0", "bench.tuned": False})
    target = load_target(profile.target)
    first = tmp_path / "first"
    DraftModel.build(profile.drafts["dense"], target.model).eval().save(first / "drafts" / "dense" / "draft")
    with single_thread():
        run_study(StudyContext.at(profile, first), only=["vanilla", "eagle2"], target=target, progress=False)
    records = load_study_records(first, "main")
    assert len(records) == 4  # 2 methods x 1 question x 2 turns

    moved = tmp_path / "elsewhere" / "moved"
    shutil.copytree(first, moved, copy_function=shutil.copy)  # new paths, new timestamps, same weights

    def no_generation(*args, **kwargs):
        raise AssertionError("regenerated although the records were there")

    monkeypatch.setattr(methods.MethodRunner, "__call__", no_generation)
    with single_thread():
        run_study(StudyContext.at(profile, moved), only=["vanilla", "eagle2"], target=target, progress=False)
    assert load_study_records(moved, "main") == records

    weights = moved / "drafts" / "dense" / "draft" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # "retrained": the old records no longer describe this draft
    weights.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="regenerated"), single_thread():
        run_study(StudyContext.at(profile, moved), only=["vanilla", "eagle2"], target=target, progress=False)
    assert (moved / "bench" / "main" / "records.stale.jsonl").is_file()


def test_features_can_be_cached_with_the_target_in_another_dtype(tmp_path):
    from safetensors.torch import load_file

    from jakiro_lib.data.feature_store import MANIFEST, CacheError
    from jakiro_lib.study import prepare_features

    small = {"data.num_conversations": 6, "data.shard_size": 6, "data.max_length": 96}
    fp32, bf16 = get_profile("smoke", **small), get_profile("smoke", **small, **{"data.cache_dtype": "bfloat16"})
    with single_thread():
        prepare_features(StudyContext.at(fp32, tmp_path / "fp32"), progress=False)
        prepare_features(StudyContext.at(bf16, tmp_path / "bf16"), progress=False)
    manifest = json.loads((tmp_path / "bf16" / "features" / MANIFEST).read_text())
    assert manifest["settings"]["target_dtype"] == "bfloat16"
    assert "target_dtype" not in json.loads((tmp_path / "fp32" / "features" / MANIFEST).read_text())["settings"]
    a = load_file(str(next((tmp_path / "fp32" / "features").glob("shard_*.safetensors"))))
    b = load_file(str(next((tmp_path / "bf16" / "features").glob("shard_*.safetensors"))))
    assert (a["input_ids"] == b["input_ids"]).all() and not (a["hidden"] == b["hidden"]).all()
    with pytest.raises(CacheError, match="target_dtype"), single_thread():  # no silent mix of the two
        prepare_features(StudyContext.at(fp32, tmp_path / "bf16"), progress=False)


def test_cache_dtype_auto_follows_the_hardware_and_resumes_a_begun_cache(tmp_path, monkeypatch):
    """data.cache_dtype="auto": bf16 where the device has bf16 matrix units, the target's dtype elsewhere; a cache
    already begun keeps the dtype it was begun in (a run moved from an AMX machine is neither refused nor
    rebuilt), unless it is to be rebuilt anyway (force)."""
    from jakiro_lib.data.features import MANIFEST
    from jakiro_lib.study import s00_data

    auto = get_profile("smoke", **{"data.cache_dtype": "auto"})
    assert get_profile("default").data.cache_dtype == "auto" and get_profile("default").train.mixed_precision == "auto"
    monkeypatch.setattr(s00_data, "favoured_dtype", lambda device: "bfloat16")
    assert s00_data.cache_dtype(auto, tmp_path) == "bfloat16"
    (tmp_path / MANIFEST).write_text(json.dumps({"settings": {}}))  # begun in fp32 (the default is not recorded)
    assert s00_data.cache_dtype(auto, tmp_path) == "float32"
    assert s00_data.cache_dtype(auto, tmp_path, force=True) == "bfloat16"
    monkeypatch.setattr(s00_data, "favoured_dtype", lambda device: None)
    (tmp_path / MANIFEST).write_text(json.dumps({"target_dtype": "bfloat16"}))
    assert s00_data.cache_dtype(auto, tmp_path) == "bfloat16"
    assert s00_data.cache_dtype(auto, tmp_path / "none") == "float32"
    assert s00_data.cache_dtype(get_profile("smoke"), tmp_path) == "float32"  # None: the target's dtype


def test_notebook_setup_logs_to_stdout_and_flags_the_smoke_profile(tmp_path, monkeypatch, capsys):
    import logging

    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", shown.append)
    monkeypatch.setattr(logging.root, "handlers", list(logging.root.handlers))  # restored after the test
    monkeypatch.setattr(logging.getLogger("jakiro_lib"), "handlers", [])  # a CLI test's stderr handler (same process)
    ctx = S.notebook_setup("smoke", {"bench.limit": 1}, run_dir=tmp_path / "run", report_dir=tmp_path / "report")
    assert ctx.profile.name == "smoke" and ctx.profile.bench.limit == 1 and ctx.run_dir == (tmp_path / "run").resolve()
    assert (tmp_path / "report" / "run_config.json").is_file()
    texts = [getattr(obj, "data", "") for obj in shown]
    assert any(S.SMOKE_BANNER in t for t in texts) and any("Profile `smoke`" in t for t in texts)
    logging.getLogger("jakiro_lib.test").info("a log line")
    captured = capsys.readouterr()
    assert "a log line" in captured.out and "a log line" not in captured.err  # not styled as an error
    shown.clear()
    S.notebook_setup("default", run_dir=tmp_path / "run2", report_dir=tmp_path / "report2", describe=True)
    assert not any(S.SMOKE_BANNER in getattr(obj, "data", "") for obj in shown)
    assert any(hasattr(obj, "columns") for obj in shown)  # describe=True: the profile's settings table


def test_run_layout_spells_every_path_once(tmp_path):
    layout = RunLayout(tmp_path)
    assert layout.draft("moe2") == draft_path(layout.drafts, "moe2") == tmp_path / "drafts" / "moe2" / "draft"
    assert layout.records("main") == tmp_path / "bench" / "main" / "records.jsonl"
    assert layout.tree_budgets == tmp_path / "bench" / "tree_budgets.json"
    assert layout.draft_results("dense").parent == layout.train_stamp("dense").parent == layout.draft_dir("dense")
    ctx = S.StudyContext(profile=get_profile("smoke"), run_dir=tmp_path)
    assert ctx.layout.drafts == layout.drafts and ctx.layout.bench("main") == layout.bench("main")
    assert not has_weights(layout.draft("dense")) and not has_weights(None)


def test_a_method_added_to_a_study_reuses_the_records_already_there(tmp_path, monkeypatch):
    profile = get_profile("smoke", **{"bench.limit": 1, "bench.max_new_tokens": 4, "bench.warmup": 0,
                                      "bench.temperatures": "0", "bench.tuned": False})
    target = load_target(profile.target)
    with single_thread():
        run_study(StudyContext.at(profile, tmp_path), only=["vanilla"], target=target, progress=False)
    first = load_study_records(tmp_path, "main")
    calls = []
    real = methods.MethodRunner.__call__

    def counted(self, *args, **kwargs):
        calls.append(self.spec.kind)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(methods.MethodRunner, "__call__", counted)
    with single_thread():
        run_study(StudyContext.at(profile, tmp_path), only=["vanilla", "hf_generate"], target=target, progress=False)
    assert set(calls) == {"hf"}  # only the added method ran
    assert load_study_records(tmp_path, "main")[:len(first)] == first
    assert not (tmp_path / "bench" / "main" / "records.stale.jsonl").exists()
    calls.clear()
    with single_thread():  # a subset afterwards: its records are there, the others kept
        table = run_study(StudyContext.at(profile, tmp_path), only=["vanilla"], target=target, progress=False)
    assert calls == [] and not (tmp_path / "bench" / "main" / "records.stale.jsonl").exists()
    assert list(table["method"]) == ["vanilla"] and len(load_study_records(tmp_path, "main")) == 4
    with single_thread():  # forced: moved aside and run again
        run_study(StudyContext.at(profile, tmp_path), only=["vanilla"], target=target, progress=False, force=True)
    assert set(calls) == {"vanilla"} and (tmp_path / "bench" / "main" / "records.stale.jsonl").is_file()
    with single_thread():  # forced again: the first stale records stay, the second set goes beside them
        run_study(StudyContext.at(profile, tmp_path), only=["vanilla"], target=target, progress=False, force=True)
    stale = sorted(p.name for p in (tmp_path / "bench" / "main").glob("records.stale*.jsonl"))
    assert stale == ["records.stale.1.jsonl", "records.stale.jsonl"]
    assert (tmp_path / "bench" / "main" / "records.stale.1.stamp.json").is_file()


def test_training_table_shows_size_options_and_accuracy_per_depth_and_expert(tmp_path):
    """Per draft: n_params, the MLP width, expert_loss, unroll_steps, held-out acc_a / acc_b, acc_depth
    as d = 1..4 columns (None past the depths evaluated) and each expert's own accuracy; the same in
    training.csv."""
    results = {
        "dense": {"draft_config": {"mlp": "dense", "num_experts": 1, "intermediate_size": "target",
                                   "expert_loss": "off"},
                  "n_params": 1234, "intermediate_size": 1536, "unroll_steps": 1, "acc_a": 0.5, "acc_b": None,
                  "acc_depth": [0.5, 0.4, 0.3], "acc_experts": None},
        "moe2_xgate": {"draft_config": {"mlp": "moe", "num_experts": 2, "intermediate_size": None,
                                        "expert_loss": "gate"},
                       "n_params": 5678, "intermediate_size": 64, "unroll_steps": 3, "acc_a": 0.6, "acc_b": 0.25,
                       "acc_depth": [0.6, 0.5, 0.45, 0.4, 0.35], "acc_experts": [0.5, 0.45]},
    }
    table = S.write_training_tables(tmp_path, results)
    depth_cols = [f"acc_depth_{d}" for d in range(1, 5)]
    for df in (table, pd.read_csv(tmp_path / "training.csv")):
        rows = df.set_index("draft")
        assert rows.loc["dense", "n_params"] == 1234 and rows.loc["moe2_xgate", "n_params"] == 5678
        assert rows.loc["dense", "intermediate_size"] == 1536 and rows.loc["moe2_xgate", "intermediate_size"] == 64
        assert rows.loc["dense", "expert_loss"] == "off" and rows.loc["moe2_xgate", "expert_loss"] == "gate"
        assert rows.loc["dense", "unroll_steps"] == 1 and rows.loc["moe2_xgate", "unroll_steps"] == 3
        assert rows.loc["moe2_xgate", "acc_a"] == 0.6 and rows.loc["moe2_xgate", "acc_b"] == 0.25
        assert rows.loc["moe2_xgate", depth_cols].tolist() == [0.6, 0.5, 0.45, 0.4]
        assert rows.loc["dense", depth_cols[:3]].tolist() == [0.5, 0.4, 0.3]
        assert pd.isna(rows.loc["dense", "acc_depth_4"]) and pd.isna(rows.loc["dense", "acc_experts"])
        assert rows.loc["moe2_xgate", "acc_experts"] == "0.50 / 0.45"
        assert "acc_depth_5" not in df.columns


def test_versus_eagle2_judges_each_study_against_its_own_eagle2():
    """Main and ablation records each against their study's EAGLE-2 row (methods.EAGLE2_BASELINE), never across
    studies: the ablations' eagle2_u2 is compared with the ablations' EAGLE-2, not the main study's."""
    from test_bench import _recs, _with_accepts

    base = [10.0, 12.0, 14.0, 16.0]
    main = (_with_accepts(_recs("eagle2", base), [[2, 1]] * 4)
            + _with_accepts(_recs("jakiro", [2 * v for v in base]), [[3, 1], [2, 2], [3, 1], [1, 1]]))
    abl = (_with_accepts(_recs("experts=1 (eagle2)", [v / 2 for v in base]), [[1, 1]] * 4)
           + _with_accepts(_recs("eagle2_u2", base), [[3, 1]] * 4))
    vs = S.versus_eagle2_table({"main": main, "ablations": abl, "empty": []}).set_index("method")
    assert list(vs.index) == ["jakiro", "eagle2_u2"] and list(vs["study"]) == ["main", "ablations"]
    assert vs.loc["jakiro", "tokens_per_s_ratio"] == pytest.approx(2.0) and vs.loc["jakiro", "tau_ratio"] == pytest.approx(7 / 6)
    assert vs.loc["eagle2_u2", "tokens_per_s_ratio"] == pytest.approx(2.0) and vs.loc["eagle2_u2", "tau_ratio"] == pytest.approx(2.0)
    assert vs.loc["eagle2_u2", "tau_verdict"] == "better" and vs.loc["jakiro", "tau_verdict"] == "unresolved"
    assert S.versus_eagle2_table({"main": []}).empty


def test_acceptance_by_depth_counts_drafted_tokens_without_the_bonus():
    from test_bench import _recs, _with_accepts

    recs = _with_accepts(_recs("eagle2", [10.0, 10.0]), [[1, 2, 3], [1, 4]]) + _recs("vanilla", [10.0], kind="vanilla")
    t = S.acceptance_by_depth(recs, depths=3).set_index("method")
    assert list(t.index) == ["eagle2"] and t.loc["eagle2", "cycles"] == 5  # drafted: 0, 1, 2, 0, 3
    assert [t.loc["eagle2", f"p_ge_{d}"] for d in (1, 2, 3)] == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    assert [t.loc["eagle2", f"cond_{d}"] for d in (1, 2, 3)] == pytest.approx([3 / 5, 2 / 3, 1 / 2])


def test_a_draft_is_not_retrained_for_a_kernel_setting_but_is_for_another_target():
    """The training stamp holds the target's identity (TargetConfig.identity): kernel fields change timings,
    not outputs, and stamps written while they were in it still match."""
    from jakiro_lib.config import TargetConfig
    from jakiro_lib.profiles import get_profile
    from jakiro_lib.study.s01_train import _same_training

    prof = get_profile("smoke")
    new = {"draft": {}, "train": {}, "target": prof.target.identity(), "features": {}}
    old = {**new, "target": {**new["target"], "gqa_attention": True, "packed_gemm": 64}}  # a stamp of before
    kernel = set(TargetConfig.KERNEL_FIELDS)
    assert kernel & set(old["target"]) and not kernel & set(new["target"])
    assert _same_training(old, new) and _same_training(new, new)
    assert not _same_training({**old, "target": {**old["target"], "model": "tiny:qwen2"}}, new)
    assert not _same_training(None, new)
    faster = get_profile("smoke", **{"target.packed_gemm": 8, "target.gemm_backend": "mkl"})
    assert faster.target.identity() == prof.target.identity()
