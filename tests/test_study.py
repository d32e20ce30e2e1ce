"""Study runs resume: records survive a run directory copied or moved elsewhere, not a changed draft."""
import json
import shutil

import pytest

import jakiro_lib.bench as bench
from jakiro_lib.config import get_profile
from jakiro_lib.draft import DraftModel
from jakiro_lib.study import load_study_records, run_study
from jakiro_lib.target import load_target

from helpers import single_thread


def test_benchmark_records_survive_a_copied_run_dir_but_not_a_changed_draft(tmp_path, monkeypatch):
    profile = get_profile("smoke", **{"bench.limit": 1, "bench.max_new_tokens": 4, "bench.warmup": 0,
                                      "bench.temperatures": "0", "bench.tuned": False})
    target = load_target(profile.target)
    first = tmp_path / "first"
    DraftModel.build(profile.drafts["dense"], target.model).eval().save(first / "drafts" / "dense" / "draft")
    with single_thread():
        run_study(profile, run_dir=first, only=["vanilla", "eagle2"], target=target, progress=False)
    records = load_study_records(first, "main")
    assert len(records) == 4  # 2 methods x 1 question x 2 turns

    moved = tmp_path / "elsewhere" / "moved"
    shutil.copytree(first, moved, copy_function=shutil.copy)  # new paths, new timestamps, same weights

    def no_generation(*args, **kwargs):
        raise AssertionError("regenerated although the records were there")

    monkeypatch.setattr(bench.MethodRunner, "__call__", no_generation)
    with single_thread():
        run_study(profile, run_dir=moved, only=["vanilla", "eagle2"], target=target, progress=False)
    assert load_study_records(moved, "main") == records

    weights = moved / "drafts" / "dense" / "draft" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # "retrained": the old records no longer describe this draft
    weights.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="regenerated"), single_thread():
        run_study(profile, run_dir=moved, only=["vanilla", "eagle2"], target=target, progress=False)
    assert (moved / "bench" / "main" / "records.stale.jsonl").is_file()


def test_features_can_be_cached_with_the_target_in_another_dtype(tmp_path):
    from safetensors.torch import load_file

    from jakiro_lib.features import MANIFEST, CacheError
    from jakiro_lib.study import prepare_features

    small = {"data.num_conversations": 6, "data.shard_size": 6, "data.max_length": 96}
    fp32, bf16 = get_profile("smoke", **small), get_profile("smoke", **small, **{"data.cache_dtype": "bfloat16"})
    with single_thread():
        prepare_features(fp32, tmp_path / "fp32", progress=False)
        prepare_features(bf16, tmp_path / "bf16", progress=False)
    manifest = json.loads((tmp_path / "bf16" / "features" / MANIFEST).read_text())
    assert manifest["settings"]["target_dtype"] == "bfloat16"
    assert "target_dtype" not in json.loads((tmp_path / "fp32" / "features" / MANIFEST).read_text())["settings"]
    a = load_file(str(next((tmp_path / "fp32" / "features").glob("shard_*.safetensors"))))
    b = load_file(str(next((tmp_path / "bf16" / "features").glob("shard_*.safetensors"))))
    assert (a["input_ids"] == b["input_ids"]).all() and not (a["hidden"] == b["hidden"]).all()
    with pytest.raises(CacheError, match="target_dtype"), single_thread():  # no silent mix of the two
        prepare_features(fp32, tmp_path / "bf16", progress=False)
