"""How a decoding method runs: a :class:`MethodSpec` (kind, draft, tree) and the :class:`MethodRunner` that generates
with it. Our kinds (``vanilla``, ``spec``) run on the one engine (:func:`~jakiro_lib.decoding.static.static_generate`),
eager or captured as ``target.capture`` says; HF's kinds (``hf``, ``pld``) through HF's ``generate``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..config import DRAFT_DTYPES, KINDS, OUR_KINDS, SPEC, TreeConfig
from ..models.draft import DraftModel
from ..models.target import Target, capture_of, compiles_cycle
from .hf import hf_generate
from .result import GenerationResult
from .static import static_generate
from .verify import SamplingParams


@dataclass
class MethodSpec:
    kind: str  # one of KINDS
    draft: str | None = None  # path of a saved draft (kind "spec"; None: the lookup chain alone)
    tree: TreeConfig | None = None  # kind "spec"
    prompt_lookup_tokens: int = 10  # kind "pld" (HF's default)
    # kind "hf": HF generate over a static KV cache, compiled (decoding.hf.hf_generate); our kinds run as the
    # target's capture says (target.capture), never per method
    compile: bool = False
    draft_dtype: str | None = None  # the draft's own layers in this precision (None: the target's)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown method kind {self.kind!r}: use {', '.join(KINDS[:-1])} or {KINDS[-1]}")
        if self.compile and self.kind != "hf":
            raise ValueError("compile applies to kind 'hf' only (HF generate over a static cache); our methods run "
                             "as target.capture says")
        if self.kind == SPEC and (self.tree is None or self.draft is None and not self.tree.lookup_tokens):
            raise ValueError("a 'spec' method needs a tree config and a draft path (or tree.lookup_tokens)")
        if self.draft_dtype is not None and self.draft_dtype not in DRAFT_DTYPES:
            raise ValueError(f"unknown draft dtype {self.draft_dtype!r}: use {', '.join(DRAFT_DTYPES)} (or None)")

    def load_draft(self, target: Target) -> DraftModel | None:
        """The method's draft for ``target`` in its precision, or None (plain decoding, a lookup chain alone)."""
        if self.kind != SPEC or not self.draft:
            return None
        return DraftModel.load(self.draft, target.model, dtype=self.draft_dtype)

    @property
    def runs_on(self) -> str:
        """The engine a record names: "static" (ours, the one engine) or "hf"."""
        return "static" if self.kind in OUR_KINDS else "hf"

    def capture(self, target: Target) -> str:
        """How its decoding step runs on ``target``: ours as the target's capture says (none, graphs, inductor, draft),
        HF's compiled by inductor (``hf_compiled``) or not."""
        if self.kind in OUR_KINDS:
            return capture_of(target.model)
        return "inductor" if self.compile else "none"


class MethodRunner:
    """Loads what a method needs once (the draft), then generates for any prompt."""

    def __init__(self, target: Target, spec: MethodSpec) -> None:
        self.target = target
        self.spec = spec
        self.draft = spec.load_draft(target)

    def __call__(self, prompt_ids: torch.Tensor, *, max_new_tokens: int, params: SamplingParams,
                 seed: int, on_tokens: Callable[[list[int]], None] | None = None) -> GenerationResult:
        """Generate for one prompt; ``on_tokens`` streams accepted tokens (HF methods call it once, at the end). Ours
        on the engine, captured where the target says; HF's through ``generate`` (prompt lookup for kind "pld")."""
        t, spec = self.target, self.spec
        common = dict(max_new_tokens=max_new_tokens, params=params, eos_token_ids=t.eos_token_ids,
                      max_context=t.config.max_context)
        if spec.kind in OUR_KINDS:
            generator = torch.Generator(device=t.device).manual_seed(seed)
            return static_generate(t.model, self.draft, spec.tree, prompt_ids, compile=compiles_cycle(spec.capture(t)),
                                   generator=generator, on_tokens=on_tokens, **common)
        lookup = spec.prompt_lookup_tokens if spec.kind == "pld" else None
        result = hf_generate(t.model, prompt_ids, prompt_lookup_num_tokens=lookup, seed=seed, compile=spec.compile,
                             **common)
        if on_tokens is not None:
            on_tokens(result.output_ids)
        return result
