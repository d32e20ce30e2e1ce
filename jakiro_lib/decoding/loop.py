"""Decoding loops: vanilla (our cached loop, HF ``generate`` eager or compiled, HF prompt lookup) and
speculative.

The speculative cycle, in one function (:func:`speculative_generate`): the drafter proposes a tree
rooted at the last token; the target scores the whole tree in one forward (ancestor mask, position =
prefix length + depth); verification keeps the longest consistent path plus one bonus token; the target
cache keeps only the accepted path's entries (gathered, not recomputed) and the drafter is told what was
kept. Greedy output equals vanilla greedy token for token; sampling output is distributed as the target.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch
from transformers import CompileConfig, PreTrainedModel

from .compiled import compiled_cache_len, inductor_settings, static_cache
from .drafting import Drafter
from .runner import TargetRunner
from .tree import MAX_TREE_ROOM, Tree
from .result import GenerationResult, append_tokens, check_prompt, choose_token, text_positions
from .verify import SamplingParams, verify
from ..machine import run_compiling, synchronize


@torch.inference_mode()
def vanilla_generate(model: PreTrainedModel, prompt_ids: torch.Tensor, *, max_new_tokens: int = 128,
                     params: SamplingParams = SamplingParams(), eos_token_ids: list[int] = (),
                     max_context: int = 2048, generator: torch.Generator | None = None,
                     on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Plain autoregressive decoding with the KV cache: the reference every method must match."""
    check_prompt(prompt_ids, max_context, 1)
    runner = TargetRunner(model, text_positions(prompt_ids, max_new_tokens, max_context))
    result = GenerationResult(prompt_len=prompt_ids.numel(), output_ids=[])
    synchronize(runner.device)
    t0 = time.perf_counter()
    logits, _ = runner.prefill(prompt_ids.to(runner.device))
    token = choose_token(logits[-1], params, generator)
    result.prefill_time = time.perf_counter() - t0
    eos = set(eos_token_ids)
    done = append_tokens(result, [token], eos, max_new_tokens, on_tokens)
    while not done:
        if runner.length + 1 > max_context:
            result.stop_reason = "context"
            break
        token = choose_token(runner.step(token), params, generator)
        result.accepted.append(1)
        done = append_tokens(result, [token], eos, max_new_tokens, on_tokens)
    synchronize(runner.device)
    result.wall_time = time.perf_counter() - t0
    return result


@torch.inference_mode()
def speculative_generate(model: PreTrainedModel, drafter: Drafter, prompt_ids: torch.Tensor, *,
                         max_new_tokens: int = 128, params: SamplingParams = SamplingParams(),
                         eos_token_ids: list[int] = (), max_context: int = 2048,
                         generator: torch.Generator | None = None,
                         on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Draft a tree, verify it in one target forward, keep the accepted path; repeat."""
    check_prompt(prompt_ids, max_context, 1)
    runner = TargetRunner(model, text_positions(prompt_ids, max_new_tokens, max_context) + MAX_TREE_ROOM)
    result = GenerationResult(prompt_len=prompt_ids.numel(), output_ids=[])
    eos = set(eos_token_ids)
    dev = runner.device
    synchronize(dev)
    t0 = time.perf_counter()
    prompt_ids = prompt_ids.to(dev)
    logits, hidden = runner.prefill(prompt_ids)
    root = choose_token(logits[-1], params, generator)
    drafter.begin(prompt_ids, hidden, root)
    synchronize(dev)
    result.prefill_time = time.perf_counter() - t0
    done = append_tokens(result, [root], eos, max_new_tokens, on_tokens)
    forwards0 = getattr(getattr(drafter, "stats", None), "forwards", 0)
    while not done:
        t1 = time.perf_counter()
        tree = drafter.propose()
        room = max_context - runner.length
        if room < 1:
            result.stop_reason = "context"
            break
        if int(tree.depths.max()) + 1 > room:  # near the end of the context: keep the best path that fits
            best = [0]
            while tree.children[best[-1]] and len(best) < room:
                best.append(tree.children[best[-1]][0])
            tree = Tree.chain(tree.tokens[best].tolist())
        synchronize(dev)
        t2 = time.perf_counter()
        start = runner.length
        logits, hidden = runner.tree(tree)
        path, bonus = verify(tree, logits, params, generator)
        runner.keep(start, path)
        new = tree.tokens[path[1:]].tolist() + [bonus]
        synchronize(dev)
        t3 = time.perf_counter()
        result.tree_sizes.append(len(tree))
        if tree.ranks:
            result.path_ranks.append([max(tree.ranks[n] for n in path[1:j + 1]) for j in range(1, len(path))])
        emitted = len(result.output_ids)
        done = append_tokens(result, new, eos, max_new_tokens, on_tokens)
        result.accepted.append(len(result.output_ids) - emitted)  # EOS or the budget may cut ``new`` short
        if not done:
            drafter.accept(hidden[path], new)
        synchronize(dev)
        t4 = time.perf_counter()
        result.draft_time += (t2 - t1) + (t4 - t3)
        result.verify_time += t3 - t2
    result.draft_forwards = getattr(getattr(drafter, "stats", None), "forwards", 0) - forwards0
    synchronize(dev)
    result.wall_time = time.perf_counter() - t0
    return result


def _compile_config(device: torch.device) -> CompileConfig:
    """transformers' compile settings for ``generate`` on ``device``: off CUDA, inductor's default mode
    (``reduce-overhead`` means CUDA graphs), and ``_compile_all_devices`` because ``generate`` compiles only
    on accelerators unless told otherwise."""
    config = CompileConfig() if device.type == "cuda" else CompileConfig(mode="default")
    config._compile_all_devices = True
    return config


@torch.inference_mode()
def hf_generate(model: PreTrainedModel, prompt_ids: torch.Tensor, *, max_new_tokens: int = 128,
                params: SamplingParams = SamplingParams(), eos_token_ids: list[int] = (),
                prompt_lookup_num_tokens: int | None = None, seed: int | None = None,
                compile: bool = False, max_context: int | None = None) -> GenerationResult:
    """Hugging Face ``generate`` (optionally with prompt-lookup decoding) timed like our loops.

    ``compile``: a static KV cache and ``torch.compile`` of the decoding step (transformers' own
    fast path; the first calls compile, so warm up before timing). It is plain decoding too, and on some
    machines the fastest one, so benchmarks carry it as a baseline. ``max_context``: the cache then holds the
    whole context, one length for every prompt (:func:`~jakiro_lib.decoding.compiled.compiled_cache_len`), so a warm-up
    on a short prompt compiles what every timed one runs.
    """
    kwargs: dict = {"max_new_tokens": max_new_tokens, "do_sample": not params.greedy,
                    "eos_token_id": list(eos_token_ids) or None, "pad_token_id": (list(eos_token_ids) or [0])[0]}
    if not params.greedy:
        kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
    if prompt_lookup_num_tokens:
        kwargs["prompt_lookup_num_tokens"] = prompt_lookup_num_tokens
    if compile:
        cache_len = compiled_cache_len(max_context or prompt_ids.numel() + max_new_tokens)
        cache = static_cache(model, cache_len)
        kwargs.update(past_key_values=cache,
                      compile_config=_compile_config(model.device))
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
