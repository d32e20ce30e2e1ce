"""Random-weight targets and drafts of named shapes (:data:`SHAPES`): the models :mod:`jakiro_lib.measure.papercost`
times, which cost what trained ones of the same shapes would (the static engine's shapes are fixed)."""
from __future__ import annotations

from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from ..config import DraftConfig
from ..models import fast_paths
from ..models.draft import DraftModel
from ..models.target import _dtype

# LlamaConfig keywords of each named shape. vicuna-7b: lmsys/vicuna-7b-v1.3's config.json (Llama-1 7B);
# tiny: the tests' CPU shape (hidden 64, 2 layers, the byte vocabulary of jakiro_lib.models.target.tiny_model).
SHAPES: dict[str, dict[str, Any]] = {
    "vicuna-7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-6),
    # the built-in target's shape: its T(n) on a GPU's captured engine, without its weights in the kit
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=260, max_position_embeddings=1024, rms_norm_eps=1e-6),
}


def shape_config(shape: str, max_context: int = 0) -> LlamaConfig:
    """The LlamaConfig of a named shape (:data:`SHAPES`), its positions raised to ``max_context`` if needed."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use {' or '.join(SHAPES)}")
    kw = dict(SHAPES[shape])
    kw["max_position_embeddings"] = max(kw["max_position_embeddings"], max_context)
    return LlamaConfig(**kw, tie_word_embeddings=False)


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device; a ValueError where it is no device or CUDA is not here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"not a device: {device!r} ({str(exc).splitlines()[0] if str(exc) else ''})") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {str(device)!r}")
    return dev


def random_target(shape: str, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
                  max_context: int = 0, *, seed: int = 0) -> PreTrainedModel:
    """A random-weight ``LlamaForCausalLM`` of a named shape, built directly on ``device`` in ``dtype`` (a 7B
    target is never materialised in fp32 on the host), frozen, with the kernels
    :func:`~jakiro_lib.models.target.load_target` sets up."""
    config = shape_config(shape, max_context)
    dt = _dtype(dtype) if isinstance(dtype, str) else dtype
    dev = check_device(device)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dt)
        with torch.device(dev):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model = model.to(device=dev, dtype=dt).eval()  # fp32 buffers too, as load_target
    model.requires_grad_(False)
    fast_paths.use_gqa_attention(model)
    fast_paths.use_fused_norm(model)
    return model


def random_draft(cfg: DraftConfig, model: PreTrainedModel, *, seed: int = 0) -> DraftModel:
    """A random draft head of ``cfg`` for ``model``, built on the target's device in its dtype, frozen."""
    torch.manual_seed(seed)
    with torch.device(model.device):
        draft = DraftModel.build(cfg, model)
    draft.eval().requires_grad_(False)
    return draft
