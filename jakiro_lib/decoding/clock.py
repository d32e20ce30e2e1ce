"""Named steps of a decoding cycle (docs/DESIGN.md section 12): each a profiler range while a profiler runs, and
what a listening clock (:class:`Clock`; the one that measures, :class:`jakiro_lib.measure.clock.StepClock`) is told."""
from __future__ import annotations

import contextlib
from typing import ContextManager, Protocol

import torch
from torch.profiler import record_function

# the steps of a cycle, each a profiler range "jakiro::<step>" (jakiro_lib.study.gpucheck reads them)
STEPS = ("prefill", "draft", "draft_forward", "verify", "evaluate", "update", "cycle", "read")
STEP_RANGES = {s: f"jakiro::{s}" for s in STEPS}


class Clock(Protocol):
    def step(self, name: str) -> ContextManager[None]: ...

    def credit(self, name: str, seconds: float, entries: int) -> None: ...


def profiler_range(name: str) -> record_function | None:
    """Step ``name``'s profiler range while a profiler runs outside a compiled step, else None (a range costs two
    operators even with no profiler)."""
    off = torch.compiler.is_compiling() or not torch._C._autograd._profiler_enabled()
    return None if off else record_function(STEP_RANGES[name])


def step(clock: Clock | None, name: str) -> contextlib.AbstractContextManager:
    """The context of step ``name``: the clock's where one listens, else its :func:`profiler_range`, else nothing."""
    return clock.step(name) if clock is not None else profiler_range(name) or contextlib.nullcontext()
