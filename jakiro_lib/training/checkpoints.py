"""Training checkpoints: where they live, which are complete, reading one back (passing over a damaged
newest one for the one before it), and the random-number state saved with them."""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..models.draft import WEIGHTS_FILE

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"  # under a training's output directory: one folder per checkpoint
STATE_FILE = "training_state.pt"  # optimizer, scheduler, sampler and RNG state beside the draft's weights
KEEP_CHECKPOINTS = 2  # the newest checkpoints a training keeps; older ones are removed


class CheckpointError(RuntimeError):
    """A training checkpoint that cannot be read back (a file cut short by a crash or a full disk)."""


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """(global step, directory) of every complete checkpoint, oldest first."""
    root = Path(out_dir) / CHECKPOINTS
    found = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and not d.name.startswith(".") and (d / STATE_FILE).is_file() \
                    and (d / "draft" / WEIGHTS_FILE).is_file():
                meta = d / "step.json"
                try:
                    step = json.loads(meta.read_text())["step"]
                except (OSError, json.JSONDecodeError, KeyError):
                    continue
                found.append((int(step), d))
    return sorted(found)


def read_checkpoint_file(path: Path) -> Any:
    """One checkpoint file's contents; a damaged file is a :class:`CheckpointError` naming it."""
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        return torch.load(path, map_location="cpu", weights_only=False)
    except (SafetensorError, OSError, RuntimeError, EOFError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path} cannot be read ({reason})") from exc


def readable_checkpoint(checkpoints: list[tuple[int, Path]]) -> tuple[Path, dict[str, torch.Tensor], dict[str, Any]]:
    """The newest checkpoint whose weights and state read back: (directory, weights, state); a damaged one is
    passed over with a warning, and none readable is a :class:`CheckpointError` naming the newest one's file."""
    first = None
    for _, ckpt in reversed(checkpoints):
        try:
            return (ckpt, read_checkpoint_file(ckpt / "draft" / WEIGHTS_FILE),
                    read_checkpoint_file(ckpt / STATE_FILE))
        except CheckpointError as exc:
            first = first or exc
            log.warning("%s; resuming from the checkpoint before it, if any", exc)
    raise CheckpointError(f"{first}: no readable training checkpoint left; delete {checkpoints[-1][1].parent} "
                     "to train from the start") from first


def same_vocab(weights: dict[str, torch.Tensor], d2t: torch.Tensor) -> bool:
    """Whether saved draft ``weights`` hold the draft vocabulary ``d2t``."""
    return "d2t" in weights and torch.equal(weights["d2t"].cpu(), d2t.cpu())


def warm_start(core: torch.nn.Module, saved_draft: Path) -> None:
    """Start a training from a saved draft's weights (``train.init_from``): every key and shape must fit
    (strict), and a draft vocabulary must be the one this training built; else a :class:`CheckpointError`."""
    weights = read_checkpoint_file(saved_draft / WEIGHTS_FILE)
    own = core.state_dict().get("d2t")
    if own is not None and not same_vocab(weights, own):
        raise CheckpointError(f"{saved_draft} was trained with another draft vocabulary (d2t): it cannot start this one")
    try:
        core.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise CheckpointError(f"{saved_draft} holds another architecture than this draft's: "
                              f"{str(exc).strip().splitlines()[0]}") from exc


def saved_vocab(saved_draft: Path) -> torch.Tensor | None:
    """A saved draft's vocabulary (``d2t``: draft index -> target token id), or None (the full vocabulary)."""
    return read_checkpoint_file(saved_draft / WEIGHTS_FILE).get("d2t")
