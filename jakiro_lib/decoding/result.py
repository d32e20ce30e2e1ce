"""What every decoder of ours returns and the steps they share: :class:`GenerationResult`, the prompt check, the
token choice at a sampling setting, appending a cycle's tokens up to EOS or the budget."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .verify import SamplingParams, sample, warp_probs


class ContextLengthError(ValueError):
    """The prompt does not fit in the context window."""


@dataclass
class GenerationResult:
    prompt_len: int
    output_ids: list[int]
    accepted: list[int] = field(default_factory=list)  # tokens emitted per cycle (accepted + bonus)
    tree_sizes: list[int] = field(default_factory=list)
    path_ranks: list[list[list[int]]] = field(default_factory=list)  # per cycle, accepted node, depth cap: see static
    draft_forwards: int = 0
    wall_time: float = 0.0
    prefill_time: float = 0.0
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


def choose_token(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator | None) -> int:
    return int(logits.argmax()) if params.greedy else sample(warp_probs(logits, params, sync=True), gen)


def append_tokens(result: GenerationResult, new: list[int], eos: set[int], max_new_tokens: int,
            on_tokens: Callable[[list[int]], None] | None = None) -> bool:
    """Append ``new`` tokens, stopping at EOS or the token budget; True when generation is over."""
    start = len(result.output_ids)
    done = False
    for t in new:
        result.output_ids.append(t)
        if t in eos or len(result.output_ids) >= max_new_tokens:
            result.stop_reason, done = ("eos" if t in eos else "max_new_tokens"), True
            break
    if on_tokens is not None:
        on_tokens(result.output_ids[start:])
    return done


def text_positions(prompt_ids: torch.Tensor, max_new_tokens: int, max_context: int) -> int:
    """Positions a generation's text can fill: the prompt and the new tokens, never past the context."""
    return min(prompt_ids.numel() + max_new_tokens, max_context)


def check_prompt(prompt_ids: torch.Tensor, max_context: int, margin: int) -> None:
    if prompt_ids.ndim != 1 or prompt_ids.numel() == 0:
        raise ValueError("prompt_ids must be a non-empty 1-D tensor of token ids")
    if prompt_ids.numel() + margin > max_context:
        raise ContextLengthError(f"prompt of {prompt_ids.numel()} tokens leaves no room to generate in a context of "
                                 f"{max_context}")
