"""The distributed launch: how many processes, which is the main one, and their group."""
from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

import torch


def world_size() -> int:
    """Processes of this run: ``WORLD_SIZE`` as ``accelerate launch`` / torchrun set it, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def main_rank() -> bool:
    """Whether this is the main process (``RANK`` 0, or no launcher): the one that speaks and takes locks."""
    return int(os.environ.get("RANK", "0") or 0) == 0


class LaunchError(RuntimeError):
    """The processes of a multi-process launch did not join one group (each would redo, and rewrite, all the work)."""


def distributed_state() -> Any:
    """accelerate's ``PartialState`` of a run launched in several processes, joined into one group: NCCL where CUDA is,
    else gloo (``cpu=True``: without CUDA ``PartialState()`` alone joins none). Raises :class:`LaunchError` when the
    group does not hold ``WORLD_SIZE`` processes."""
    from accelerate import PartialState  # only under a multi-process launch: optional, heavy

    state = PartialState(cpu=not torch.cuda.is_available())
    if state.num_processes != world_size():
        raise LaunchError(f"launched as {world_size()} processes (WORLD_SIZE), but accelerate sees "
                          f"{state.num_processes} ({state.distributed_type}); launch with `accelerate launch "
                          "--multi_gpu --num_processes N -m jakiro_lib ...` (docs/usage.md)")
    return state


class World(NamedTuple):
    """Which of ``size`` processes this one is, a barrier, and its device (None: leave the model where it is)."""

    index: int = 0
    size: int = 1
    wait: Callable[[], None] = lambda: None
    device: torch.device | None = None


def launched_world() -> World:
    """One process, unless launched by ``accelerate launch`` with several (then accelerate's state)."""
    if world_size() <= 1:
        return World()  # never initialise a distributed state when not launched by accelerate
    state = distributed_state()
    return World(state.process_index, state.num_processes, state.wait_for_everyone, state.device)
