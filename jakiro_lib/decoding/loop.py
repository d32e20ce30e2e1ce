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
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import CompileConfig, PreTrainedModel

from .compiled import MAX_TREE_ROOM, compiled_cache_len, inductor_settings, static_cache
from .drafting import Drafter, FeatureDrafter
from .runner import TargetRunner
from .tree import Tree
from .verify import SamplingParams, sample, verify, warp_probs


class ContextLengthError(ValueError):
    """The prompt does not fit in the context window."""


@dataclass
class GenerationResult:
    prompt_len: int
    output_ids: list[int]
    accepted: list[int] = field(default_factory=list)  # tokens emitted per cycle (accepted + bonus)
    tree_sizes: list[int] = field(default_factory=list)
    path_ranks: list[list[int]] = field(default_factory=list)  # running max draft rank along each accepted path
    draft_forwards: int = 0
    wall_time: float = 0.0
    prefill_time: float = 0.0
    draft_time: float = 0.0
    verify_time: float = 0.0
    stop_reason: str = "max_new_tokens"

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def cycles(self) -> int:
        """Target forwards after prefill (vanilla: one per token after the first)."""
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Average acceptance length: tokens from cycles / cycles (bonus included; vanilla = 1.0)."""
        return sum(self.accepted) / max(len(self.accepted), 1)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)




def _choose(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    return int(logits.argmax()) if params.greedy else sample(warp_probs(logits, params), gen)


def _finish(result: GenerationResult, new: list[int], eos: set[int], max_new_tokens: int,
            on_tokens: Callable[[list[int]], None] | None = None) -> bool:
    """Append ``new`` tokens, stopping at EOS or the token budget; True when generation is over."""
    start = len(result.output_ids)
    done = False
    for t in new:
        result.output_ids.append(t)
        if t in eos:
            result.stop_reason = "eos"
            done = True
            break
        if len(result.output_ids) >= max_new_tokens:
            result.stop_reason = "max_new_tokens"
            done = True
            break
    if on_tokens is not None:
        on_tokens(result.output_ids[start:])
    return done


def text_positions(prompt_ids: torch.Tensor, max_new_tokens: int, max_context: int) -> int:
    """Positions a generation's text can fill: the prompt and the new tokens, never past the context."""
    return min(prompt_ids.numel() + max_new_tokens, max_context)


def _check_prompt(prompt_ids: torch.Tensor, max_context: int, margin: int) -> None:
    if prompt_ids.ndim != 1 or prompt_ids.numel() == 0:
        raise ValueError("prompt_ids must be a non-empty 1-D tensor of token ids")
    if prompt_ids.numel() + margin > max_context:
        raise ContextLengthError(
            f"prompt of {prompt_ids.numel()} tokens leaves no room to generate in a context of {max_context}"
        )


@torch.inference_mode()
def vanilla_generate(model: PreTrainedModel, prompt_ids: torch.Tensor, *, max_new_tokens: int = 128,
                     params: SamplingParams = SamplingParams(), eos_token_ids: list[int] = (),
                     max_context: int = 2048, generator: torch.Generator | None = None,
                     on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Plain autoregressive decoding with the KV cache: the reference every method must match."""
    _check_prompt(prompt_ids, max_context, 1)
    runner = TargetRunner(model, text_positions(prompt_ids, max_new_tokens, max_context))
    result = GenerationResult(prompt_len=prompt_ids.numel(), output_ids=[])
    _sync(runner.device)
    t0 = time.perf_counter()
    logits, _ = runner.prefill(prompt_ids.to(runner.device))
    token = _choose(logits[-1], params, generator)
    result.prefill_time = time.perf_counter() - t0
    eos = set(eos_token_ids)
    done = _finish(result, [token], eos, max_new_tokens, on_tokens)
    while not done:
        if runner.length + 1 > max_context:
            result.stop_reason = "context"
            break
        token = _choose(runner.step(token), params, generator)
        result.accepted.append(1)
        done = _finish(result, [token], eos, max_new_tokens, on_tokens)
    _sync(runner.device)
    result.wall_time = time.perf_counter() - t0
    return result


@torch.inference_mode()
def speculative_generate(model: PreTrainedModel, drafter: Drafter, prompt_ids: torch.Tensor, *,
                         max_new_tokens: int = 128, params: SamplingParams = SamplingParams(),
                         eos_token_ids: list[int] = (), max_context: int = 2048,
                         generator: torch.Generator | None = None,
                         on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
    """Draft a tree, verify it in one target forward, keep the accepted path; repeat."""
    _check_prompt(prompt_ids, max_context, 1)
    runner = TargetRunner(model, text_positions(prompt_ids, max_new_tokens, max_context) + MAX_TREE_ROOM)
    result = GenerationResult(prompt_len=prompt_ids.numel(), output_ids=[])
    eos = set(eos_token_ids)
    dev = runner.device
    _sync(dev)
    t0 = time.perf_counter()
    prompt_ids = prompt_ids.to(dev)
    logits, hidden = runner.prefill(prompt_ids)
    root = _choose(logits[-1], params, generator)
    drafter.begin(prompt_ids, hidden, root)
    _sync(dev)
    result.prefill_time = time.perf_counter() - t0
    done = _finish(result, [root], eos, max_new_tokens, on_tokens)
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
        _sync(dev)
        t2 = time.perf_counter()
        start = runner.length
        logits, hidden = runner.tree(tree)
        path, bonus = verify(tree, logits, params, generator)
        runner.keep(start, path)
        new = tree.tokens[path[1:]].tolist() + [bonus]
        _sync(dev)
        t3 = time.perf_counter()
        result.tree_sizes.append(len(tree))
        if tree.ranks:
            result.path_ranks.append([max(tree.ranks[n] for n in path[1:j + 1]) for j in range(1, len(path))])
        emitted = len(result.output_ids)
        done = _finish(result, new, eos, max_new_tokens, on_tokens)
        result.accepted.append(len(result.output_ids) - emitted)  # EOS or the budget may cut ``new`` short
        if not done:
            drafter.accept(hidden[path], new)
        _sync(dev)
        t4 = time.perf_counter()
        result.draft_time += (t2 - t1) + (t4 - t3)
        result.verify_time += t3 - t2
    result.draft_forwards = getattr(getattr(drafter, "stats", None), "forwards", 0) - forwards0
    _sync(dev)
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
        cache.reset()
        kwargs.update(past_key_values=cache,
                      compile_config=_compile_config(model.device))
    if seed is not None:
        torch.manual_seed(seed)
    ids = prompt_ids.to(model.device)[None]
    settings = inductor_settings(model.device) if compile else contextlib.nullcontext()
    _sync(model.device)
    t0 = time.perf_counter()
    try:
        with settings:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    except Exception as e:
        if not compile:
            raise
        raise RuntimeError("HF generate with a static cache and torch.compile failed (inductor needs a C++ "
                           "compiler on CPU, triton on CUDA); leave the hf_compiled baseline out with "
                           "--set bench.compiled_baseline=false") from e
    _sync(model.device)
    wall = time.perf_counter() - t0
    new = out[0, ids.shape[1]:].tolist()
    result = GenerationResult(prompt_len=ids.shape[1], output_ids=new, wall_time=wall)
    result.stop_reason = "eos" if new and new[-1] in set(eos_token_ids) else "max_new_tokens"
    return result
