"""Hugging Face's own decoders, timed like ours: ``generate`` eager, with prompt lookup, or over a static KV cache
compiled by ``torch.compile`` (``hf_compiled``: transformers' fast path, a baseline every method is measured
against where it is the fastest plain decoder)."""
from __future__ import annotations

import contextlib
import time

import torch
from transformers import CompileConfig, PreTrainedModel

from ..compiling import run_compiling
from ..machine import synchronize
from ..models.target import cache_keyword
from .compiled import compiled_cache_len, inductor_settings, static_cache
from .result import GenerationResult
from .verify import SamplingParams


@torch.inference_mode()
def hf_generate(model: PreTrainedModel, prompt_ids: torch.Tensor, *, max_new_tokens: int = 128,
                params: SamplingParams = SamplingParams(), eos_token_ids: list[int] = (),
                prompt_lookup_num_tokens: int | None = None, seed: int | None = None,
                compile: bool = False, max_context: int | None = None) -> GenerationResult:
    """Hugging Face ``generate`` (optionally with prompt-lookup decoding) timed like our loops. ``compile``: a static KV
    cache and ``torch.compile`` of the step (the first calls compile: warm up before timing); ``max_context``: that
    cache then holds the whole context (:func:`~jakiro_lib.decoding.compiled.compiled_cache_len`)."""
    kwargs: dict = {"max_new_tokens": max_new_tokens, "do_sample": not params.greedy,
                    "eos_token_id": list(eos_token_ids) or None, "pad_token_id": (list(eos_token_ids) or [0])[0]}
    if not params.greedy:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    if compile:
        cache_len = compiled_cache_len(max_context or prompt_ids.numel() + max_new_tokens)
        cache = static_cache(model, cache_len)
        config = CompileConfig() if model.device.type == "cuda" else CompileConfig(mode="default")  # no CUDA graphs
        config._compile_all_devices = True  # generate compiles only on accelerators unless told so
        kwargs.update({cache_keyword(model): cache, "compile_config": config})  # the name this transformers takes
    ids = prompt_ids.to(model.device)[None]

    def run() -> tuple[torch.Tensor, float]:
        if compile:
            cache.reset()
        if seed is not None:
            torch.manual_seed(seed)
        synchronize(model.device)
        t0 = time.perf_counter()
        with inductor_settings(model.device) if compile else contextlib.nullcontext():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        synchronize(model.device)
        return out, time.perf_counter() - t0

    out, wall = run_compiling(run, compiling=compile, what="HF generate with a static cache and torch.compile",
                              remedy="leave the hf_compiled baseline out with --set bench.compiled_baseline=false")
    new = out[0, ids.shape[1]:].tolist()
    result = GenerationResult(prompt_len=ids.shape[1], output_ids=new, wall_time=wall)
    result.stop_reason = "eos" if new and new[-1] in set(eos_token_ids) else "max_new_tokens"
    return result
