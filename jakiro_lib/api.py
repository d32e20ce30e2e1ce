"""The user-facing generation call: one function for every decoding method."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .data.chat import format_prompt_ids
from .data.conversations import not_text
from .config import KINDS, SPEC, TreeConfig
from .decoding.methods import MethodRunner, MethodSpec
from .decoding.result import ContextLengthError, GenerationResult
from .models.draft import resolve_draft_dtype
from .models.target import Target
from .decoding.verify import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Generation:
    text: str
    result: GenerationResult


def generate(target: Target, prompt: str | list[dict[str, str]], *, method: str = SPEC,
             draft: str | Path | None = None, tree: TreeConfig | None = None, max_new_tokens: int = 128,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             on_text: Callable[[str], None] | None = None, draft_dtype: str = "auto") -> Generation:
    """Chat-format ``prompt`` (a user message or a list of messages) and decode it with ``method``.

    ``method``: ``vanilla``, ``hf`` (HF generate), ``pld`` (HF prompt lookup) or ``spec`` (the saved ``draft``
    with ``tree``, its layers in ``draft_dtype``, a ``bench.draft_dtype`` value). ``on_text`` receives the decoded text
    as tokens are accepted. A ``max_new_tokens`` past what the target's context leaves after the prompt is lowered to
    that, with one warning."""
    if method not in KINDS:  # a method kind (jakiro_lib.decoding.methods)
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(KINDS)}")
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    problem = next((p for m in messages if (p := not_text(m["content"]))), None)
    if problem:
        raise ValueError(f"the prompt {problem}")
    ids = format_prompt_ids(target, messages)
    max_new_tokens = _within_context(target, ids.numel(), max_new_tokens)
    spec = MethodSpec(method, draft=None if draft is None else str(draft),
                      tree=(tree or TreeConfig()) if method == SPEC else None,
                      draft_dtype=resolve_draft_dtype(draft_dtype, target.config) if method == SPEC and draft else None)
    runner = MethodRunner(target, spec)
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    stream = None
    if on_text is not None:
        emitted: list[int] = []

        def stream(new: list[int]) -> None:
            before = target.tokenizer.decode(emitted, skip_special_tokens=True)
            emitted.extend(new)
            on_text(target.tokenizer.decode(emitted, skip_special_tokens=True)[len(before):])

    result = runner(ids, max_new_tokens=max_new_tokens, params=params, seed=seed, on_tokens=stream)
    return Generation(text=target.tokenizer.decode(result.output_ids, skip_special_tokens=True), result=result)


def _within_context(target: Target, prompt_len: int, max_new_tokens: int) -> int:
    """``max_new_tokens``, or the room the context leaves after the prompt when that is less (said once): one
    rule for every method (HF's generate would otherwise run past the model's positions, ours stop there)."""
    limit = target.config.max_context
    room = limit - prompt_len
    if room < 1:
        raise ContextLengthError(f"prompt of {prompt_len} tokens leaves no room to generate in a context of {limit} "
                                 "(target.max_context)")
    if max_new_tokens > room:
        log.warning("max new tokens %d is more than the context leaves: room for %d new tokens after the "
                    "%d-token prompt in target.max_context=%d; generating at most %d", max_new_tokens, room,
                    prompt_len, limit, room)
        return room
    return max_new_tokens
