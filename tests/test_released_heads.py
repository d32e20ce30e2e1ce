"""Released and exported heads through the study: stage 01 imports instead of training, the benchmark decodes with
them losslessly, the released-heads profile and its methods, and the `export` command (jakiro_lib.study.heads)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from jakiro_lib.study.context import StudyContext
from jakiro_lib import cli
from jakiro_lib.config import DraftConfig
from jakiro_lib.measure.summary import load_records
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.heads_io import export_head
from jakiro_lib.profiles import RELEASED_HEADS, get_profile
from jakiro_lib.study.s01_train import train_all
from jakiro_lib.study.s02_bench import profile_methods, run_study
from tests.helpers import tiny_target

DENSE = DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False, contrastive=False,
                    intermediate_size="target")


def _random_draft(cfg: DraftConfig, seed: int) -> DraftModel:
    torch.manual_seed(seed)
    draft = DraftModel.build(cfg, tiny_target()).eval()
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return draft


def test_stage_01_imports_exported_heads_and_greedy_decoding_with_them_is_vanillas(tmp_path, caplog):
    """The smoke target; an EAGLE-1 and a Jakiro export, imported again by stage 01 (drafts.<name>.import_from) and
    benchmarked: the imported weights are the exported ones and every greedy text is vanilla's."""
    dense, moe = _random_draft(DENSE, 1), _random_draft(DraftConfig(), 2)
    export_head(dense, tiny_target(), "eagle", tmp_path / "eagle_head")
    export_head(moe, tiny_target(), "jakiro", tmp_path / "jakiro_head")
    profile = get_profile("smoke", drafts="dense,moe2", **{
        "drafts.dense.import_from": str(tmp_path / "eagle_head"), "drafts.moe2.import_from": str(tmp_path / "jakiro_head"),
        "bench.jakiro_draft": "moe2", "bench.limit": "1", "bench.max_new_tokens": "12", "bench.temperatures": "0",
        "bench.tuned": "false", "bench.compiled_baseline": "false"})
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="jakiro_lib"):
        results = train_all(StudyContext.at(profile, run), progress=False)
    assert {r["imported"]["layout"] for r in results.values()} == {"eagle", "jakiro"}
    assert "draft dense: imported from" in caplog.text and not (run / "features").exists()
    for name, original in (("dense", dense), ("moe2", moe)):
        back = DraftModel.load(run / "drafts" / name / "draft", tiny_target()).state_dict()
        assert all(torch.equal(back[k], v) for k, v in original.state_dict().items())
    again = train_all(StudyContext.at(profile, run), progress=False)  # imported already: skipped
    assert all(r["skipped"] for r in again.values())

    methods = "vanilla,eagle2,jakiro,jakiro_cepd,jakiro_coupled_cepd"
    run_study(StudyContext.at(profile, run), "main", only=methods, progress=False)
    records = load_records(run / "bench" / "main" / "records.jsonl")
    by_method = {}
    for r in records:
        by_method.setdefault(r["method"], {})[(r["question_id"], r["turn"])] = r
    assert set(by_method) == set(methods.split(","))
    for name, recs in by_method.items():
        assert {k: r["output_ids"] for k, r in recs.items()} == \
               {k: r["output_ids"] for k, r in by_method["vanilla"].items()}, name
        if name != "vanilla":
            assert all(r["cycles"] > 0 for r in recs.values())


def test_released_profile_imports_the_papers_heads_and_runs_the_authors_configurations():
    p = get_profile("vicuna-7b-released")
    assert {k: d.import_from for k, d in p.drafts.items()} == RELEASED_HEADS
    assert p.drafts["jakiro_star"].expert_mlp == "gelu" and p.data.online and p.bench.temperatures == (0.0, 1.0)
    assert (p.tree.depth, p.tree.top_k, p.tree.total_tokens) == (6, 10, 60)
    main = profile_methods(p, Path("/nowhere"), "main")
    wanted = {"eagle2", "jakiro", "jakiro_coupled_cepd", "jakiro_star"}
    assert set(main) >= wanted | {"vanilla", "hf_generate"}
    star = next(m for k, m in main.items() if k.startswith("jakiro_star"))
    assert star.draft.endswith("jakiro_star/draft") and star.tree.decoupled
    authors = next(m for k, m in main.items() if k.startswith("jakiro_coupled_cepd"))
    assert not authors.tree.decoupled and authors.tree.ar_steps == 4
    # the profiles that train their drafts run neither
    assert not wanted - {"eagle2", "jakiro"} & set(profile_methods(get_profile("default"), Path("/x"), "main"))


def test_a_head_that_does_not_fit_stops_stage_01_in_one_line_and_writes_nothing(tmp_path, capsys):
    moe = _random_draft(DraftConfig(), 3)
    export_head(moe, tiny_target(), "jakiro", tmp_path / "head")
    (tmp_path / "head" / "config.json").write_text(json.dumps(
        {**json.loads((tmp_path / "head" / "config.json").read_text()), "hidden_size": 4096}))
    run = tmp_path / "run"
    code = cli.main(["train", "--profile", "smoke", "--run-dir", str(run), "--set", "drafts=moe2",
                     "--set", f"drafts.moe2.import_from={tmp_path / 'head'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: ") and "hidden_size is 4096, but the target has 64" in err[-1]
    assert not (run / "drafts" / "moe2").exists() and not list((run / "drafts").glob(".moe2*"))
    export_head(moe, tiny_target(), "jakiro", tmp_path / "head")  # the head made right: imported, and the table says so
    assert cli.main(["train", "--profile", "smoke", "--run-dir", str(run), "--set", "drafts=moe2",
                     "--set", f"drafts.moe2.import_from={tmp_path / 'head'}"]) == 0
    assert " moe2 imported " in capsys.readouterr().out


def test_export_command_writes_a_head_and_refuses_eagle3_in_one_line(tmp_path, capsys):
    saved = tmp_path / "run" / "drafts" / "dense"
    _random_draft(DENSE, 4).save(saved / "draft")
    assert cli.main(["export", "--profile", "smoke", "--draft", str(saved), "--format", "eagle",
                     "--out", str(tmp_path / "out")]) == 0
    assert "eagle layout: config.json, model.safetensors" in capsys.readouterr().out
    code = cli.main(["export", "--profile", "smoke", "--draft", str(saved), "--format", "eagle3",
                     "--out", str(tmp_path / "out3")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "cannot be written as an EAGLE-3 head" in err[0]
    assert not (tmp_path / "out3").exists()
    with pytest.raises(SystemExit):  # the format is one of three
        cli.main(["export", "--draft", str(saved), "--format", "onnx", "--out", str(tmp_path / "o")])


def test_our_rows_stand_beside_the_published_ones_whatever_engine_ran_them():
    """An old GPU study's drafted runs were labelled ``*_static_compiled``: they are still compared with the published
    numbers, each beside the rows of the method it stands for, same target and temperature."""
    import pandas as pd

    from jakiro_lib.study.published import beside_published, comparison_table

    main = pd.DataFrame([{"method": m, "temperature": t, "benchmark": "mt_bench", "tokens_per_s": 50.0, "speedup": 2.0,
                          "tau": 4.0, "tau_ref": 4.5, "questions": 10}
                         for t in (0.0, 1.0) for m in ("vanilla", "eagle2_static_compiled",
                                                       "jakiro_coupled_cepd_static_compiled", "jakiro_star_static_compiled")])
    table = comparison_table(main, target_model="lmsys/vicuna-7b-v1.3", environment={})
    ours = table[table["source"] == "ours (this run)"]
    assert set(ours["method"]) == {"eagle2_static_compiled", "jakiro_coupled_cepd_static_compiled",
                                   "jakiro_star_static_compiled"}
    beside = beside_published(table)
    pairs = {(r.method, r.temperature, r.published_source) for r in beside.itertuples()}
    assert ("jakiro_star_static_compiled", 1.0, "Jakiro README figure") in pairs
    assert ("jakiro_coupled_cepd_static_compiled", 0.0, "Jakiro authors' A40 logs (recomputed)") in pairs
    assert ("eagle2_static_compiled", 0.0, "EAGLE-2 paper") in pairs
    assert not any(m.startswith("jakiro_star") and t == 0.0 for m, t, _ in pairs)  # no published Jakiro* at T=0
    assert set(beside["published_method"]) == {"eagle2", "jakiro", "jakiro*"}
    assert all(r.speedup_ratio == 2.0 / r.published_speedup for r in beside.itertuples())


def test_the_pipeline_hands_its_kernels_local_head_folders_as_absolute_paths(tmp_path, monkeypatch):
    """The notebooks' kernels run in the repository root: a head folder named relative to where the pipeline was
    started would be looked up there (and, shaped like owner/name, on the hub). Hub ids stay as they are."""
    from jakiro_lib.report.pipeline import _local_paths

    (tmp_path / "exports" / "dense-eagle").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    out = _local_paths({"drafts.dense.import_from": "exports/dense-eagle", "drafts.moe2.import_from": "owner/head",
                        "train.init_from": "exports", "bench.limit": "2"})
    assert out == {"drafts.dense.import_from": str(tmp_path / "exports" / "dense-eagle"),
                   "drafts.moe2.import_from": "owner/head", "train.init_from": str(tmp_path / "exports"),
                   "bench.limit": "2"}
