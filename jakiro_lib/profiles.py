"""The named profiles and dotted overrides (``train.epochs=3``), every result validated."""
from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any, Iterable

from .config import (EAGLE2_DRAFT, JAKIRO_DRAFT, BenchConfig, ConfigError, DataConfig, DraftConfig, Profile, TargetConfig,
                     TrainConfig, TreeConfig)
from .validation import check_field as _check_field, post_init as _post_init, validate


def _study_drafts(vocab: int | None) -> dict[str, DraftConfig]:
    """The drafts every study trains: the EAGLE-2 baseline ``dense`` (MLP at the target's width), its equal-parameter
    control ``dense_h`` (an H-wide MLP, as one expert; docs/DESIGN.md section 2), the MoE ablations, contrastive off,
    and ``moe2_xgate`` / ``moe2_xequal``, whose experts' own outputs are trained too (``DraftConfig.expert_loss``)."""
    dense = DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False, contrastive=False,
                        draft_vocab_size=vocab)
    moe2 = DraftConfig(num_experts=2, top_k_experts=2, draft_vocab_size=vocab)
    drafts = {
        "dense": dataclasses.replace(dense, intermediate_size="target"),
        "dense_h": dense,
        "moe2": moe2,
        "moe2_xgate": dataclasses.replace(moe2, expert_loss="gate"),
        "moe2_xequal": dataclasses.replace(moe2, expert_loss="equal"),
        "moe2_nocontrast": dataclasses.replace(moe2, contrastive=False),
        "moe4": dataclasses.replace(moe2, num_experts=4),
    }
    # multi-step training (train.unroll_steps, DESIGN section 4): twins of EAGLE-2, the control, moe2 and moe2_xgate
    twins = ("dense", "dense_h", "moe2", "moe2_xgate")
    return {**drafts, **{f"{k}_u2": dataclasses.replace(drafts[k], unroll_steps=2) for k in twins}}


# The default main job's drafts and its scale floor (conversations, epochs) for data.scale="auto", also used wherever
# nothing was measured: docs/DESIGN.md section 11. FAITHFUL_DRAFTS is opt-in (`--set drafts=...`).
DEFAULT_SCALE = (600, 2)
DEFAULT_DRAFTS = ("dense", "dense_h", "moe2", "moe2_xgate", "dense_u2", "moe2_u2")
FAITHFUL_DRAFTS = ("dense", "dense_h", "moe2", "moe2_xgate", "dense_u2", "dense_h_u2", "moe2_u2", "moe2_xgate_u2")


def _paper(model: str, template: str = "auto") -> Profile:
    """Paper-scale settings (docs/DESIGN.md sections 4-5): GPU, bf16, 60-token trees, 20 epochs."""
    return Profile(
        name="",
        target=TargetConfig(model=model, dtype="float16", device="cuda", template=template, max_context=4096),
        data=DataConfig(num_conversations=68_000, max_length=2048, shard_size=256, feature_dtype="bfloat16"),
        train=TrainConfig(epochs=20, batch_size=4, lr=9e-5, warmup_steps=2000, mixed_precision="bf16"),
        # depth counts drafted layers: EAGLE-2's "depth 5" drafts 6 (10 + 5 x 100 candidates), so 6 here
        tree=TreeConfig(depth=6, top_k=10, total_tokens=60),
        bench=BenchConfig(benchmarks=("mt_bench", "humaneval", "gsm8k", "alpaca", "cnn_dm", "natural_questions"),
                          limit=None, max_new_tokens=1024, repeats=3),
        drafts={k: dataclasses.replace(v, draft_vocab_size=None) for k, v in _study_drafts(None).items()},
    )


SMOKE_BANNER = "smoke profile: a random tiny target, numbers for plumbing only"  # on its reports and notebooks


def _smoke() -> Profile:
    """A tiny random target and every draft of the catalogue: the whole pipeline in two minutes (tests, CI)."""
    return Profile(
        name="smoke",
        target=TargetConfig(model="tiny:llama", max_context=512),
        data=DataConfig(num_conversations=24, max_length=192, shard_size=8, heldout_fraction=0.2),
        train=TrainConfig(epochs=2, batch_size=4, lr=1e-3, warmup_steps=5),
        tree=TreeConfig(depth=3, top_k=3, total_tokens=8),
        bench=BenchConfig(limit=2, max_new_tokens=16, temperatures=(0.0, 1.0)),
        drafts=_study_drafts(None),
    )


def _default() -> Profile:
    """The built-in offline main job on a CPU."""
    # Sized for a 2-core CPU and a <= 90 min main job (docs/DESIGN.md sections 9 and 11; lr 2e-3, the best of
    # 5e-4..5e-3: docs/results.md). Greedy only: `bench --temperature 1` adds sampling. The cycle eager on a CPU
    # (capture "auto"; "draft", the draft's trees compiled, measured no faster: DESIGN section 12).
    conversations, epochs = DEFAULT_SCALE
    return Profile(
        name="default",
        target=TargetConfig(model="builtin:smollm2", max_context=2048, packed_gemm=64),
        data=DataConfig(num_conversations=conversations, max_length=384, shard_size=50, cache_dtype="auto",
                        cache_batch_size=8, scale="auto"),
        train=TrainConfig(epochs=epochs, batch_size=8, lr=2e-3, warmup_steps=20, mixed_precision="auto", compile="auto"),
        tree=TreeConfig(depth=4, top_k=3, total_tokens=8),
        bench=BenchConfig(limit=10, max_new_tokens=64, temperatures=(0.0,)),
        drafts={k: v for k, v in _study_drafts(8192).items() if k in DEFAULT_DRAFTS},
    )


def _gpu() -> Profile:
    """The built-in target at the paper's scale on one GPU and no hub: all the packaged conversations, the paper's
    20 epochs and 60-token trees (docs/DESIGN.md sections 4-5), the reduced draft vocabulary, the packaged
    benchmarks at 20 questions each."""
    return Profile(
        name="gpu",
        target=TargetConfig(model="builtin:smollm2", dtype="bfloat16", device="cuda", max_context=4096),
        data=DataConfig(num_conversations=17_671, max_length=2048, shard_size=256, feature_dtype="bfloat16",
                        cache_batch_size=32),
        train=TrainConfig(epochs=20, batch_size=32, lr=2e-3, warmup_steps=500, mixed_precision="bf16"),
        tree=TreeConfig(depth=5, top_k=10, total_tokens=60),
        bench=BenchConfig(benchmarks=("mt_bench", "humaneval", "gsm8k"), limit=20, max_new_tokens=256),
        drafts=_study_drafts(8192),
    )


def _gpu_quick(gpu: Profile) -> Profile:
    """``gpu``'s slice that runs all four notebooks in one GPU call of about 8 minutes (sized in docs/results.md):
    3000 conversations x 3 epochs, EAGLE-2's and Jakiro's drafts, fp32 decoding on the captured engine, MT-bench
    q1-3 at 48 new tokens, T=0 and T=1."""
    return Profile(
        name="gpu-quick",
        target=dataclasses.replace(gpu.target, dtype="float32"),
        data=dataclasses.replace(gpu.data, num_conversations=3000, max_length=1024),
        train=dataclasses.replace(gpu.train, epochs=3, warmup_steps=100),
        tree=TreeConfig(depth=5, top_k=8, total_tokens=32),
        bench=BenchConfig(benchmarks=("mt_bench",), limit=3, max_new_tokens=48, temperatures=(0.0, 1.0)),
        drafts={k: v for k, v in gpu.drafts.items() if k in (EAGLE2_DRAFT, JAKIRO_DRAFT)},
    )


# The heads the paper compares, as released, imported in stage 01 instead of trained (DraftConfig.import_from): EAGLE's
# head for Vicuna-7B v1.3, which EAGLE-2 decodes with, and the Jakiro authors' Jakiro and Jakiro* heads. Hub ids; a
# downloaded folder works the same (--set drafts.moe2.import_from=DIR).
RELEASED_HEADS = {"dense": "yuhuili/EAGLE-Vicuna-7B-v1.3", "moe2": "Hhaiduo/Jakiro-Vicuna-7B-v1.3",
                  "jakiro_star": "Hhaiduo/Jakiro_star-Vicuna-7B-v1.3"}


def _released(paper: Profile) -> Profile:
    """``vicuna-7b`` on the released heads (docs/DESIGN.md section 13): nothing cached or trained (online data, read only
    for the notebooks' estimates), the paper's tree and benchmarks at T=0 and T=1, 10 questions each, one repeat."""
    star = DraftConfig(num_experts=2, top_k_experts=2, intermediate_size="target", branch_b=False, contrastive=False,
                       expert_mlp="gelu")
    drafts = {"dense": paper.drafts["dense"], "moe2": paper.drafts["moe2"], "jakiro_star": star}
    return dataclasses.replace(
        paper, name="vicuna-7b-released", data=dataclasses.replace(paper.data, online=True, num_conversations=64),
        bench=dataclasses.replace(paper.bench, limit=10, repeats=1, tuned=False, eagle2_draft="dense",
                                  jakiro_draft="moe2"),
        drafts={k: dataclasses.replace(v, import_from=RELEASED_HEADS[k]) for k, v in drafts.items()})


def _profiles() -> dict[str, Profile]:
    gpu = _gpu()
    profiles = {"smoke": _smoke(), "default": _default(), "gpu": gpu, "gpu-quick": _gpu_quick(gpu)}
    for name, model, template in [
        ("vicuna-7b", "lmsys/vicuna-7b-v1.3", "vicuna"),
        ("vicuna-13b", "lmsys/vicuna-13b-v1.3", "vicuna"),
        ("llama2-chat-7b", "meta-llama/Llama-2-7b-chat-hf", "auto"),
        ("llama3-8b-instruct", "meta-llama/Meta-Llama-3-8B-Instruct", "auto"),
    ]:
        p = _paper(model, template)
        p.name = name
        profiles[name] = p
    profiles["vicuna-7b-released"] = _released(profiles["vicuna-7b"])
    return profiles


PROFILE_NAMES: tuple[str, ...] = tuple(_profiles())


def get_profile(name: str, **overrides: Any) -> Profile:
    """A fresh copy of a named profile with dotted-key overrides applied, validated."""
    profiles = _profiles()
    if name not in profiles:
        raise ConfigError(f"unknown profile {name!r}; choose one of {', '.join(profiles)}")
    return override(profiles[name], **overrides)


def _coerce(value: Any, current: Any) -> Any:
    """Parse CLI strings into the type of the field they replace."""
    sequence = isinstance(current, (tuple, list))
    if not isinstance(value, str) or isinstance(current, str):
        return type(current)(value) if sequence and isinstance(value, (list, tuple)) else value
    text = value.strip()
    if text.lower() in ("none", "null"):
        return None
    def parse(item: str) -> Any:
        try:
            return json.loads(item)
        except json.JSONDecodeError:
            return item

    parsed = parse(text)
    if isinstance(parsed, str) and sequence or sequence and "," in text and not text.startswith("["):
        parsed = [parse(p.strip()) for p in text.split(",") if p.strip()]
    if sequence and not isinstance(parsed, (list, tuple)):
        parsed = [parsed]
    return type(current)(parsed) if sequence else parsed


def parse_overrides(pairs: Iterable[str]) -> dict[str, str]:
    """``["train.epochs=2", ...]`` (the CLI's ``--set``) -> ``{"train.epochs": "2"}``."""
    out = {}
    for pair in pairs:
        if "=" not in pair:
            raise ConfigError(f"--set expects key=value, got {pair!r}")
        key, value = pair.split("=", 1)
        out[key.strip()] = value
    return out


def draft_names(profile: Profile, names: Iterable[str]) -> list[str]:
    """``names``, each a draft of ``profile``; an unknown one is a ConfigError."""
    names = list(names)
    unknown = [n for n in names if n not in profile.drafts]
    if unknown:
        raise ConfigError(f"unknown draft(s) {unknown}; the profile has {', '.join(profile.drafts)}")
    return names


def _select_drafts(profile: Profile, value: Any) -> dict[str, DraftConfig]:
    """``drafts=NAME,NAME,...``: those drafts of :func:`_study_drafts`, at the profile's draft vocabulary size."""
    names = [n.strip() for n in (value.split(",") if isinstance(value, str) else value) if n.strip()]
    sizes = {d.draft_vocab_size for d in profile.drafts.values()}
    catalogue = _study_drafts(sizes.pop() if len(sizes) == 1 else None)
    unknown = [n for n in names if n not in catalogue]
    if not names or unknown or len(set(names)) < len(names):
        raise ConfigError(f"drafts={value!r}: give distinct names out of {', '.join(catalogue)}")
    return {n: catalogue[n] for n in names}


def override(profile: Profile, **overrides: Any) -> Profile:
    """Return a validated copy of ``profile`` with ``section.field=value`` overrides (``train__lr`` also works)."""
    out = copy.deepcopy(profile)
    for key, value in overrides.items():
        path = key.replace("__", ".")
        if path == "drafts":  # a selection from the study's catalogue of drafts, e.g. "dense,moe2,moe4"
            out.drafts = _select_drafts(out, value)
            continue
        parts = path.split(".")
        obj: Any = out
        for depth, part in enumerate(parts[:-1]):
            obj = obj.get(part) if isinstance(obj, dict) else getattr(obj, part, None)
            if not dataclasses.is_dataclass(obj) and not isinstance(obj, dict):
                raise ConfigError(f"unknown config key {key!r}: {'.'.join(parts[:depth + 1])!r} is not a section")
        leaf = parts[-1]
        names = list(obj) if isinstance(obj, dict) else [f.name for f in dataclasses.fields(obj)]
        if leaf not in names or isinstance(obj, dict):
            hint = "; set one of their fields" if leaf in names else ""
            raise ConfigError(f"unknown config key {key!r}: {'.'.join(parts[:-1]) or 'a profile'} has "
                              f"{', '.join(names)}{hint}")
        current = getattr(obj, leaf)
        if dataclasses.is_dataclass(current) or isinstance(current, dict):
            raise ConfigError(f"unknown config key {key!r}: {leaf!r} is a section; set one of its fields")
        new = _coerce(value, current)  # a str field that takes numbers too: intermediate_size "target" -> 3072
        numeric = isinstance(new, str) and new.strip().isdigit() and "int" in str(obj.__dataclass_fields__[leaf].type)
        setattr(obj, leaf, int(new) if numeric else new)
        _check_field(obj, leaf, path, given=repr(value))
        _post_init(obj, path, value)
    validate(out)
    _check_bench_drafts(out)
    return out


def _check_bench_drafts(profile: Profile) -> None:
    """bench.eagle2_draft and bench.jakiro_draft name drafts of the catalogue (one the profile does not train
    leaves its rows out; a name no draft has is a typo)."""
    known = {*_study_drafts(None), *profile.drafts}
    for key in ("eagle2_draft", "jakiro_draft"):
        name = getattr(profile.bench, key)
        if name not in known:
            raise ConfigError(f"bench.{key} = {name!r} is not allowed: expected a draft's name, one of "
                              f"{', '.join(sorted(known))}")


def profile_from_dict(data: Any) -> Profile:
    """The profile :meth:`Profile.to_dict` wrote (a run's resolved ``profile.json``), validated as a named one is;
    a :class:`ConfigError` names what does not fit."""
    try:
        sections: dict[str, Any] = {}
        for f in dataclasses.fields(Profile):
            if f.name == "drafts":
                sections[f.name] = {k: DraftConfig(**v) for k, v in data[f.name].items()}
            elif f.name != "name":
                sections[f.name] = type(f.default_factory())(**data[f.name])  # lists become tuples in validate
        profile = Profile(name=data["name"], **sections)
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ConfigError(f"not a resolved profile ({type(exc).__name__}: {exc})") from None
    validate(profile)
    _check_bench_drafts(profile)
    return profile

