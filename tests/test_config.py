import re
import tomllib
from pathlib import Path

import pytest

from jakiro_lib.config import ConfigError

from jakiro_lib.config import DraftConfig, TreeConfig
from jakiro_lib.profiles import DEFAULT_SCALE, PROFILE_NAMES, get_profile, profile_from_dict

ROOT = Path(__file__).resolve().parent.parent


def test_profiles_exist_with_paper_settings():
    assert {"smoke", "default", "vicuna-7b", "vicuna-13b", "llama2-chat-7b", "llama3-8b-instruct"} <= set(PROFILE_NAMES)
    p = get_profile("vicuna-7b")
    assert p.target.model == "lmsys/vicuna-7b-v1.3" and p.target.template == "vicuna"
    assert (p.tree.depth, p.tree.top_k, p.tree.total_tokens) == (6, 10, 60)  # EAGLE-2 "depth 5" = 6 drafted layers
    assert p.train.lr == 9e-5 and p.train.epochs == 20 and p.train.batch_size == 4
    assert p.drafts["moe2"].num_experts == 2 and p.drafts["dense"].num_experts == 1


@pytest.mark.parametrize("flags", [{"avx2"}, {"avx512_bf16"}, {"amx_bf16", "avx512_bf16"}])
def test_default_scale_is_measured_not_read_from_a_cpu_flag(monkeypatch, flags):
    """The default sizes its data and epochs by measurement (data.scale="auto", jakiro_lib.training.scale), from the floor
    DEFAULT_SCALE on every CPU: a flag said nothing about the avx512_bf16 EPYC's speed (issue 43, section 4)."""
    from jakiro_lib import precision

    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))
    p = get_profile("default")
    assert (p.data.num_conversations, p.train.epochs) == DEFAULT_SCALE == (600, 2) and p.data.scale == "auto"
    assert get_profile("default", **{"train.epochs": "5"}).train.epochs == 5  # an override still wins
    assert get_profile("smoke").data.num_conversations == 24  # other profiles do not scale


def test_overrides_parse_strings_like_the_cli():
    p = get_profile("smoke", **{"train.epochs": "7", "tree.ar_steps": "none", "bench.temperatures": "0,1",
                                "bench.benchmarks": "mt_bench,gsm8k", "train.lr": "1e-4"})
    assert p.train.epochs == 7 and p.tree.ar_steps is None and p.train.lr == 1e-4
    assert p.bench.temperatures == (0, 1) and p.bench.benchmarks == ("mt_bench", "gsm8k")
    assert get_profile("smoke").train.epochs != 7  # profiles are fresh copies
    # a number where the field now holds a string but takes integers too ("target" -> 3072), not for str fields
    wide = get_profile("default", **{"drafts.dense.intermediate_size": "3072", "target.model": "123"})
    assert wide.drafts["dense"].intermediate_size == 3072 and wide.target.model == "123"


@pytest.mark.parametrize("key", ["train.nope", "nope.epochs", "tree"])
def test_unknown_override_is_a_clear_error(key):
    with pytest.raises(ValueError, match="unknown config key"):
        get_profile("smoke", **{key: "1"})


def test_bad_values_are_rejected():
    with pytest.raises(ValueError, match="unknown profile"):
        get_profile("gpt-5")
    with pytest.raises(ValueError, match="top_k_experts"):
        DraftConfig(num_experts=2, top_k_experts=3)
    with pytest.raises(ValueError, match="contrastive"):
        DraftConfig(num_experts=1, top_k_experts=1, mlp="moe", branch_b=True, contrastive=True)
    with pytest.raises(ValueError, match="scoring"):
        TreeConfig(scoring="max")
    with pytest.raises(ValueError):
        get_profile("smoke", **{"tree.scoring": "max"})


def test_environment_yml_matches_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    env = (ROOT / "environment.yml").read_text()
    for dep in deps:
        name = re.split(r"[<>=!~ ]", dep, maxsplit=1)[0]
        conda_name = "pytorch" if name == "torch" else name
        assert re.search(rf"\b{re.escape(conda_name)}\b", env), f"{name} missing from environment.yml"


def test_tree_budget_auto_and_numeric_strings():
    assert TreeConfig(total_tokens="auto").total_tokens == "auto"
    assert get_profile("smoke", **{"tree.total_tokens": "auto"}).tree.total_tokens == "auto"
    p = get_profile("default", **{"tree.total_tokens": "12"})  # the CLI's --set gives a string
    assert p.tree.total_tokens == 12
    for bad in (1, "many", 2.5):
        with pytest.raises(ValueError, match="total_tokens"):
            TreeConfig(total_tokens=bad)


def test_a_tuned_tree_shape_is_tuned_with_its_budget():
    auto = get_profile("smoke", **{"tree.depth": "auto", "tree.top_k": "auto", "tree.total_tokens": "auto"}).tree
    assert (auto.depth, auto.top_k, auto.total_tokens) == ("auto", "auto", "auto")
    assert TreeConfig(depth="5", top_k="auto", total_tokens="auto").depth == 5  # --set over an "auto"
    assert TreeConfig(depth="auto", total_tokens=8).tuned and not TreeConfig(total_tokens=8).tuned
    with pytest.raises(ValueError, match="ar_steps"):  # CEPD's layers are counted from a fixed depth
        TreeConfig(depth="auto", total_tokens="auto", ar_steps=1)
    for bad in (0, "deep", True):
        with pytest.raises(ValueError, match="top_k"):
            TreeConfig(top_k=bad)


def test_every_named_profile_validates():
    from jakiro_lib.validation import validate

    for name in PROFILE_NAMES:
        validate(get_profile(name))


@pytest.mark.parametrize("key, value, fragments", [
    ("train.lr", "fast", ("train.lr = 'fast'", "a number > 0")),
    ("train.lr", "0", ("a number > 0",)),
    ("train.epochs", "2.5", ("train.epochs = '2.5'", "an integer >= 1")),
    ("train.max_steps", "0", ("an integer >= 1 or none",)),
    ("bench.temperatures", "0,-1", ("each a number >= 0",)),
    ("bench.benchmarks", "1", ("each a string",)),
    ("bench.tuned", "maybe", ("true or false",)),
    ("data.feature_dtype", "fp8", ("'float32', 'float16', 'bfloat16'",)),
    ("tree.depth", "abc", ("tree.depth = 'abc'", "an integer")),
    ("tree.depth", "0", ("tree.depth = '0'", "an integer >= 1 or 'auto'")),  # the ranges TreeConfig.__post_init__ checks
    ("tree.ar_steps", "-1", ("tree.ar_steps = '-1'", ">= 0")),
    ("tree.lookup_min_ngram", "0", ("tree.lookup_min_ngram = '0'", "1 <= lookup_min_ngram <= lookup_max_ngram")),
    ("drafts.moe4.expert_mlp", "relu", ("drafts.moe4.expert_mlp = 'relu'", "'swiglu' or 'gelu'")),
    ("bench.skip", "-1", ("bench.skip = '-1'", "must be >= 0")),
    ("drafts.moe4.top_k_experts", "9", ("drafts.moe4.top_k_experts", "top_k_experts <= num_experts")),
])
def test_every_value_is_checked_by_type_and_range(key, value, fragments):
    from jakiro_lib.config import ConfigError

    with pytest.raises(ConfigError) as info:
        get_profile("smoke", **{key: value})
    assert all(f in str(info.value) for f in fragments), str(info.value)
    assert "\n" not in str(info.value)


def test_good_values_are_normalised_to_the_annotated_types():
    p = get_profile("smoke", **{"train.lr": "1", "train.betas": "0.8,0.9", "bench.tuned": "false",
                                "train.max_steps": "none", "data.cache_dtype": "bfloat16"})
    assert p.train.lr == 1.0 and isinstance(p.train.lr, float) and p.train.betas == (0.8, 0.9)
    assert p.bench.tuned is False and p.train.max_steps is None and p.data.cache_dtype == "bfloat16"


def test_validation_is_generic_for_fields_added_later():
    """A config another module adds is checked from its annotations and field names alone."""
    from dataclasses import dataclass

    from jakiro_lib.config import ConfigError
    from jakiro_lib.validation import validate

    @dataclass
    class Extra:
        sample_fraction: float = 0.5
        num_workers: int = 1
        flag: bool = True
        names: tuple[str, ...] = ("a",)
        note: str | None = None

    validate(Extra())
    for bad, fragment in [(dict(sample_fraction=1.0), "in [0, 1)"), (dict(num_workers=0), ">= 1"),
                          (dict(flag="yes"), "true or false"), (dict(names=("a", 2)), "each a string"),
                          (dict(note=3), "a string or none")]:
        with pytest.raises(ConfigError, match=re.escape(fragment)):
            validate(Extra(**bad))


def test_drafts_override_selects_from_the_catalogue_at_the_profiles_vocabulary():
    """--set drafts=...: the default job's six drafts plus the paper's ablation drafts, or any subset, in the
    order given, each at the profile's reduced draft vocabulary; unknown or repeated names are one clear error."""
    from jakiro_lib.config import ConfigError

    p = get_profile("default", drafts="dense,moe4,moe2_nocontrast")
    assert list(p.drafts) == ["dense", "moe4", "moe2_nocontrast"]
    assert {d.draft_vocab_size for d in p.drafts.values()} == {8192}
    assert p.drafts["dense"] == get_profile("default").drafts["dense"]
    assert (p.drafts["moe4"].num_experts, p.drafts["moe2_nocontrast"].contrastive) == (4, False)
    assert get_profile("vicuna-7b", drafts="moe2").drafts["moe2"].draft_vocab_size is None
    for bad in ("dense,nope", "dense,dense", ""):
        with pytest.raises(ConfigError, match="give distinct names out of dense, dense_h, moe2"):
            get_profile("default", drafts=bad)


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_a_resolved_profile_reads_back_equal_and_checked(name, tmp_path):
    """A run's profile.json (the pipeline resolves once; its notebooks read it): every profile, overridden, reads back
    equal (tuples stay tuples), and one with a bad value or a missing section is a ConfigError, not a traceback."""
    import json

    from jakiro_lib.study.context import read_resolved, setup, write_resolved

    prof = get_profile(name, **{"bench.temperatures": "0,1", "train.epochs": 2})
    assert profile_from_dict(json.loads(prof.to_json())) == prof
    path = tmp_path / "profile.json"
    write_resolved(path, prof, {"train.epochs": 2})
    ctx = setup(str(path), run_dir=tmp_path / "run", report_dir=tmp_path / "report")
    assert ctx.profile == prof and ctx.overrides == {"train.epochs": 2}
    with pytest.raises(ConfigError, match="resolved already"):
        read_resolved(path, {"bench.limit": 1})
    bad = json.loads(prof.to_json())
    bad["train"]["epochs"] = -1
    with pytest.raises(ConfigError, match="epochs"):
        profile_from_dict(bad)
    del bad["tree"]
    with pytest.raises(ConfigError, match="not a resolved profile"):
        profile_from_dict(bad)
