"""The config dataclasses (checked by :mod:`jakiro_lib.validation`; the named profiles: :mod:`jakiro_lib.profiles`).

A profile bundles everything one study needs (target, data, drafts, training, tree, benchmark); papermill
parameters and the CLI override it with dotted keys (``train.epochs=3``).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar


CAPTURES = ("auto", "none", "graphs", "inductor", "draft")  # TargetConfig.capture's choices (jakiro_lib.models.target.set_capture)
# The drafts the main study's EAGLE-2 and Jakiro rows draft from (BenchConfig's defaults). Jakiro's: the 2-expert draft
# whose selected experts' own outputs are trained too, chosen side by side over moe2 (docs/DESIGN.md section 11)
EAGLE2_DRAFT, JAKIRO_DRAFT = "dense", "moe2_xgate"
# Method kinds (jakiro_lib.measure.methods): "vanilla" (our plain decoding), HF's "hf" generate and "pld" prompt
# lookup, and SPEC, speculative; defined here so that readers of records need not load the decoders
SPEC = "spec"
KINDS = ("vanilla", "hf", "pld", SPEC)
OUR_KINDS = ("vanilla", SPEC)  # the kinds our engine runs; "hf" and "pld" are HF's generate
# what a draft may decode in besides the target's precision; "int8": int8 copies of its weights (fp32 arithmetic)
DRAFT_DTYPES = ("float32", "bfloat16", "float16", "int8")
VANILLA_KINDS = ("vanilla", "hf")  # the baselines a speedup is measured against


class ConfigError(ValueError):
    """A profile name, override key or config value that is not allowed (the message says what is)."""


@dataclass
class TargetConfig:
    """Which frozen target LLM to load and how. ``model``: ``"builtin:smollm2"`` (offline SmolLM2-135M-Instruct),
    ``"tiny:llama"`` / ``"tiny:mistral"`` / ``"tiny:qwen2"`` (random tiny models, for tests), or a Hugging Face
    hub id or local path of a Llama/Mistral/Qwen2-family causal LM."""

    model: str = "builtin:smollm2"
    dtype: str = "float32"
    device: str = "cpu"
    template: str = "auto"  # "auto" (tokenizer's chat template) or "vicuna"
    max_context: int = 2048
    seed: int = 0  # weights seed for tiny random targets
    # CPU fast paths (jakiro_lib.models.kernels), used by every method alike. gqa_attention: SDPA handles grouped
    # KV heads under tree masks. packed_gemm: the largest row count served by one packed copy of the weights
    # (about the weights' memory once more); 0 = off. gemm_backend: that copy's "stream" (models/stream_gemm.cpp), "mkl"
    # or "onednn" (fp32; bf16 is always oneDNN), or "auto": the one that beat the plain kernel when timed at load.
    gqa_attention: bool = True
    packed_gemm: int = 0
    gemm_backend: str = "auto"
    fused_norm: bool = True  # the target's RMSNorms in one call each (fast_paths.use_fused_norm)
    # lean_forward: decoding forwards run the layers without transformers' per-call machinery where that is equal to
    # its forward bit for bit (fast_paths.lean_forward, checked at load)
    lean_forward: bool = True
    # greedy_head: greedy decoding's argmax screened through an int8 copy of the head, then exact on the words left
    # (fast_paths.greedy_argmax; the CPU's fp32 eager cycles)
    greedy_head: bool = True
    # capture: how our methods run the decoding cycle (jakiro_lib.decoding.compiled): "none" (eager), "graphs"
    # (CUDA graphs of the eager kernels; CUDA only), "inductor" (torch.compile), "draft" (eager, the draft's tree
    # compiled by inductor), or "auto": graphs on CUDA, none elsewhere (docs/DESIGN.md section 12)
    capture: str = "auto"
    KERNEL_FIELDS: ClassVar[tuple[str, ...]] = ("gqa_attention", "packed_gemm", "gemm_backend", "fused_norm",
                                                "lean_forward", "greedy_head", "capture")

    def identity(self) -> dict[str, Any]:
        """The fields that decide the target's outputs (not the kernels that compute them): what trained
        drafts and cached features depend on."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in self.KERNEL_FIELDS}


@dataclass
class DraftConfig:
    """Architecture of one draft head (docs/DESIGN.md sections 2-3); ``mlp="dense"`` with
    ``intermediate_size="target"`` is the EAGLE-2 baseline. ``branch_b`` adds the CEPD branch two positions ahead,
    ``contrastive`` picks its rule. ``expert_loss`` also trains each selected expert's own output: "gate" weights it by
    its branch-A gate, "equal" averages them; ``expert_loss_weight`` scales it."""

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
    # A released or exported head to load instead of training: a folder or a hub id (jakiro_lib.models.heads_io)
    import_from: str | None = None
    # fields left out of a stamp at these defaults, so that drafts stamped before the fields existed still match
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
    """EAGLE-2 dynamic tree and Jakiro decoding options (docs/DESIGN.md sections 3 and 5). ``top_k``: frontier width and
    children per node; ``total_tokens``: verified tokens with the root. Each of the three may be ``"auto"``: tuned on
    this machine (:attr:`tuned`, :func:`jakiro_lib.measure.budgets.resolve_tree_budgets`). ``ar_steps``: None drafts
    every layer with branch A, s drafts layers 1..s so, then two a forward (CEPD); ``decoupled``: children from each
    expert's own distribution."""

    depth: int | str = 4
    top_k: int | str = 4
    total_tokens: int | str = 16
    ar_steps: int | None = None
    decoupled: bool = False
    children_per_expert: int | None = None  # None: top_k
    scoring: str = "mixture"
    # This repo's extension (not in the paper): graft a prompt-lookup chain of up to lookup_tokens tokens
    # (0: off) onto every draft tree, found by the context's last lookup_max_ngram..lookup_min_ngram tokens.
    lookup_tokens: int = 0
    lookup_max_ngram: int = 3
    lookup_min_ngram: int = 2  # 1-gram matches cost more verify time than they save

    def __post_init__(self) -> None:
        if self.lookup_tokens < 0 or not 1 <= self.lookup_min_ngram <= self.lookup_max_ngram:
            raise ValueError("tree.lookup_tokens must be >= 0 and 1 <= lookup_min_ngram <= lookup_max_ngram")
        for name, least in (("depth", 1), ("top_k", 1), ("total_tokens", 2)):
            value = getattr(self, name)
            if isinstance(value, str) and value.strip().isdigit():  # "--set tree.depth=5" over an "auto"
                setattr(self, name, value := int(value))
            if value != "auto" and (not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"tree.{name} must be an integer >= {least} or 'auto', got {value!r}")
        if self.depth == "auto" and self.ar_steps is not None:
            raise ValueError("CEPD's layers (ar_steps) are counted from a fixed depth: set tree.depth to a number")
        if self.ar_steps is not None and self.ar_steps < 0:
            raise ValueError("ar_steps must be >= 0 or None")
        if self.scoring not in ("mixture", "best"):
            raise ValueError(f"scoring must be 'mixture' or 'best', got {self.scoring!r}")

    @property
    def tuned(self) -> bool:
        """Whether the tree's budget, depth or width is "auto" (to be tuned before it drafts)."""
        return "auto" in (self.total_tokens, self.depth, self.top_k)


@dataclass
class DataConfig:
    source: str = "sharegpt"
    path: str | None = None
    num_conversations: int = 600
    max_length: int = 512
    heldout_fraction: float = 0.05
    shard_size: int = 64  # conversations per cache shard
    # Conversations per target forward while caching, sorted by length and right-padded (features.batch_features;
    # the cached tensors are the same)
    cache_batch_size: int = 1
    # Processes tokenizing the next cache shards while the target runs (data.cache_pipeline): 0 = auto, the CPUs less
    # one, at most 16 (none with 1-2 CPUs). The cache is the same bytes.
    tokenize_workers: int = 0
    feature_dtype: str = "float16"
    # The target's dtype while caching (and self-distilling); None: target.dtype; "auto": bfloat16 on bf16 matrix units
    cache_dtype: str | None = None
    online: bool = False  # compute features on the fly instead of caching them
    # "fixed": num_conversations and train.epochs as set. "auto": the pipeline sizes both to fit the main job's
    # time on this machine (jakiro_lib.training.scale; recorded in <run_dir>/scale.json); a --set of either key wins.
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
    noise_amplitude: float = 0.2  # the reference's 0.2 (scaled by 512/L, docs/DESIGN.md section 4)
    p_weight: float = 0.1
    branch_b_weight: float = 0.5
    mixed_precision: str = "no"  # "bf16" on GPU; "auto": bf16 where the device has bf16 matrix units (AMX, GPUs)
    seed: int = 0
    max_steps: int | None = None
    bucket_by_length: bool = False  # batches of conversations of similar length (jakiro_lib.data.batching): less padding
    # Multi-step training (docs/DESIGN.md section 4): the draft also runs unroll_steps - 1 more steps on its own
    # predicted features (step j's losses weighted 0.8**j); 1: single-step (EAGLE-2). DraftConfig.unroll_steps wins.
    unroll_steps: int = 1
    # The training step's forward and loss through torch.compile (models.loss.step_loss): "no", "yes", or "auto":
    # where it trains in bf16 (docs/DESIGN.md section 11)
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
    # The main study also runs EAGLE-2 and Jakiro with tree.total_tokens="auto" next to the fixed comparison tree
    tuned: bool = True
    # The main study also times HF generate with a static KV cache and torch.compile (hf_compiled)
    compiled_baseline: bool = True
    # The trained drafts (names under drafts/) the main study's EAGLE-2 and Jakiro rows draft from
    eagle2_draft: str = EAGLE2_DRAFT
    jakiro_draft: str = JAKIRO_DRAFT
    # The precision the drafts decode in: "target" (the target's), a dtype, "int8", or "auto": int8 copies of the
    # weights beside an fp32 target on a CPU with the streaming GEMM (fp32 arithmetic, a quarter of the bytes read),
    # else the target's.
    # Verification keeps the output exact whatever the draft computes in: a speed setting (docs/DESIGN.md section 12).
    draft_dtype: str = "auto"

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
