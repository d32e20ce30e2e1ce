"""Paper scale by simulation (jakiro_lib.measure.papercost), on this CPU with the tiny shape: the files and their columns,
the random target's shape and dtype, the modelled speedup's arithmetic, the CLI's one-line errors. No timing
relation is asserted (the numbers mean something on a GPU)."""
from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch
from transformers import AutoConfig

from jakiro_lib.cli import main
from jakiro_lib.measure.papercost import (CYCLE_COLUMNS, METHOD_NAMES, PAPER, TN_COLUMNS, modelled_speedup,
                                          paper_methods, run_papercost)
from jakiro_lib.measure.random_models import SHAPES, random_target, shape_config
from jakiro_lib.models.target import builtin_smollm2_path

from helpers import single_thread


def test_tiny_shape_runs_end_to_end_and_writes_the_three_files(tmp_path):
    lines: list[str] = []
    with single_thread():
        result = run_papercost("tiny", device="cpu", dtype="float32", context=32, new_tokens=6, out_dir=tmp_path,
                               sizes=(1, 4, 8), repeats=2, runs=1, log=lines.append)
    assert result["errors"] == [] and result["status"] == "done" and result["compile"] is False
    tn = pd.read_csv(tmp_path / "tn.csv")
    assert list(tn.columns) == list(TN_COLUMNS) and list(tn["n"]) == [1, 4, 8]
    assert (tn["eager_ms"] > 0).all() and (tn["captured_ms"] > 0).all()
    cycles = pd.read_csv(tmp_path / "cycles.csv")
    assert list(cycles.columns) == list(CYCLE_COLUMNS)
    assert list(cycles["method"]) == ["vanilla", *METHOD_NAMES]
    assert (cycles["ms_per_cycle"] > 0).all() and (cycles["ms_per_token_plain"] > 0).all()
    assert (cycles["cycles"] > 0).all() and (cycles["modelled_speedup"] > 0).all()
    spec = cycles[cycles["method"] != "vanilla"]
    assert spec["speedup_basis"].str.startswith("model:").all()  # labelled a model, not a measurement
    for row in spec.itertuples():
        assert row.modelled_speedup == pytest.approx(row.tau_paper * row.ms_per_token_plain / row.ms_per_cycle)
    by_name = cycles.set_index("method")
    assert by_name.loc["eagle2", "tau_paper"] == PAPER["eagle2"]["tau"]
    assert by_name.loc["jakiro_cepd", "paper_speedup"] == PAPER["jakiro"]["speedup"]
    assert "ar_steps=4" in by_name.loc["jakiro_cepd", "tree"] and "decoupled" in by_name.loc["jakiro_cepd", "tree"]
    saved = json.loads((tmp_path / "papercost.json").read_text())
    assert saved["status"] == "done" and saved["shape"] == "tiny" and "environment" in saved
    assert len(saved["tn"]) == 3 and len(saved["cycles"]) == 1 + len(METHOD_NAMES)
    assert set(saved["methods"]) == set(METHOD_NAMES)
    assert sum(line.startswith("[papercost] T(") for line in lines) == 3  # one progress line per measurement
    assert sum("ms/cycle" in line for line in lines) == len(METHOD_NAMES)


def test_random_target_has_the_requested_shape_and_dtype():
    model = random_target("tiny", "bfloat16", "cpu", max_context=2000)
    cfg = model.config
    for key, value in SHAPES["tiny"].items():
        if key != "max_position_embeddings":
            assert getattr(cfg, key) == value, key
    assert cfg.max_position_embeddings == 2000  # raised to the context asked for
    assert all(p.dtype == torch.bfloat16 and p.device.type == "cpu" and not p.requires_grad
               for p in model.parameters())
    assert not model.training and torch.get_default_dtype() == torch.float32  # the default dtype restored
    assert model.lm_head.weight.shape == (260, 64)


def test_the_vicuna_shape_is_llama_7b():
    cfg = shape_config("vicuna-7b")
    with torch.device("meta"):
        from transformers import LlamaForCausalLM
        params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    assert params == 6_738_415_616  # Llama-1 7B / Vicuna-7B v1.3
    assert cfg.rms_norm_eps == 1e-6 and cfg.num_key_value_heads == 32 and not cfg.tie_word_embeddings


def test_the_smollm2_shape_is_the_built_in_target_s():
    """Its shape, not its weights: the tied embedding and rope base differ, which cost the same."""
    real, cfg = AutoConfig.from_pretrained(builtin_smollm2_path()), shape_config("smollm2-135m")
    for key in SHAPES["smollm2-135m"]:
        assert getattr(cfg, key) == pytest.approx(getattr(real, key)), key


def test_paper_methods_use_the_registry_drafts_and_tree():
    methods = {m.name: (tree, draft) for m, tree, draft in paper_methods()}
    assert list(methods) == list(METHOD_NAMES)
    tree, draft = methods["eagle2"]
    assert (tree.depth, tree.top_k, tree.total_tokens, tree.decoupled, tree.ar_steps) == (6, 10, 60, False, None)
    assert draft.mlp == "dense" and draft.intermediate_size == "target" and draft.draft_vocab_size is None
    tree, draft = methods["jakiro_cepd"]
    assert tree.decoupled and tree.ar_steps == 4 and draft.num_experts == 2 and draft.branch_b
    assert methods["jakiro"][0].decoupled and methods["jakiro"][0].ar_steps is None


def test_modelled_speedup_arithmetic():
    # the paper's tau at 20 ms per plain token and 30 ms per cycle: 4.69 x 20 / 30
    assert modelled_speedup(4.69, 20.0, 30.0) == pytest.approx(3.1266666, rel=1e-6)
    assert modelled_speedup(1.0, 7.0, 7.0) == 1.0
    assert math.isnan(modelled_speedup(4.68, float("nan"), 30.0)) and math.isnan(modelled_speedup(4.68, 20.0, 0.0))


@pytest.mark.parametrize("argv, message", [
    (["--device", "nodevice"], "not a device"),
    (["--device", "cpu", "--dtype", "float64"], "dtype must be"),
    pytest.param(["--device", "cuda"], "CUDA is not available",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
])
def test_cli_bad_input_is_one_line(tmp_path, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(["papercost", "--shape", "tiny", "--out", str(tmp_path / "out"), *argv])
    text = str(exc.value)
    assert text.startswith("error: ") and "\n" not in text and message in text


def test_cli_runs_the_tiny_shape(tmp_path, capsys):
    with single_thread():
        assert main(["papercost", "--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--context", "16",
                     "--new-tokens", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "[papercost] eagle2" in out and (tmp_path / "cycles.csv").is_file() and (tmp_path / "tn.csv").is_file()
    assert (tmp_path / "papercost.png").read_bytes().startswith(b"\x89PNG")  # T(n) and the modelled speedups
