"""Study runs resume: records survive a run directory copied or moved elsewhere, not a changed draft."""
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
