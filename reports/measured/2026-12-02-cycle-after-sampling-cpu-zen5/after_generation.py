"""What this record's scripts share: the main5000 drafts' method loaded as the cycle table loads it, and the eager
engine static_generate builds, left as a 64-token generation of a prompt leaves it (the draft's cached positions)."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from jakiro_lib.decoding import static
from jakiro_lib.measure.cycles import cycle_methods
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile


def arguments(prompts: int, rounds: int) -> argparse.Namespace:
    """--run-dir, --set key=value (ints; gathered into ``sets``, a dict for :func:`load`), --prompts, --rounds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="profile overrides, key=value (ints)")
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--rounds", type=int, default=rounds, help="rounds of the ways a prompt")
    args = ap.parse_args()
    args.sets = {key: int(value) for key, value in (s.split("=", 1) for s in args.set)}
    return args


def load(run_dir: Path, sets: dict[str, int], name: str = "jakiro") -> tuple[Any, Any, Any, Any]:
    """The default profile with ``sets``, its target, method ``name`` as the cycle table resolves it, and its draft."""
    profile = get_profile("default", **sets)
    target = load_target(profile.target)
    spec = cycle_methods(profile, run_dir, target, [name])[name]
    return profile, target, spec, spec.load_draft(target)


def engine_after(target: Any, draft: Any, spec: Any, ids: torch.Tensor,
                 new_tokens: int = 64) -> tuple[static.StaticEngine, int]:
    """static_generate's eager greedy engine after generating ``new_tokens`` from ``ids``, and the draft's cached
    positions there (the base of the next tree)."""
    needed = static.text_positions(ids, new_tokens, target.config.max_context) + static.MAX_TREE_ROOM
    engine = static._engine(target.model, draft, spec.tree, static.engine_cache_len(needed), static.SamplingParams(),
                            False, False)
    r = engine.generate(ids, max_new_tokens=new_tokens, eos_token_ids=target.eos_token_ids,
                        max_context=target.config.max_context)
    return engine, r.prompt_len + len(r.output_ids) - 1
