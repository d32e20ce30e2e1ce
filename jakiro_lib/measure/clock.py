"""A clock of a decoding cycle's named steps (:mod:`jakiro_lib.decoding.clock`): the seconds and aten operators each
step spends, for the cycle-cost table (:mod:`jakiro_lib.measure.cycles`) and the budget tuner's drafting time.
A step nested in another counts in its own name only (exclusive time and operators).
"""
from __future__ import annotations

import time
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..decoding.clock import profiler_range
from ..machine import synchronize

OPAQUE = ("prefill",)  # steps that keep what runs inside them (the prompt's draft forward is the prefill's)


class StepClock:
    """Exclusive seconds, operators and entries of each step while attached to an engine (eager only: a compiled
    step is one opaque call). ``count_ops``: every aten operator counted to the innermost open step (slower:
    keep the timed runs apart from the counted ones). Times wait for the device before each reading."""

    def __init__(self, device: torch.device, *, count_ops: bool = False) -> None:
        self.device, self.count_ops = device, count_ops
        self.seconds: dict[str, float] = defaultdict(float)
        self.ops: dict[str, int] = defaultdict(int)
        self.entries: dict[str, int] = defaultdict(int)
        self._open: list[tuple[str, float]] = []  # (step, start) of the open steps, innermost last
        self._counter = _OpCounter(self) if count_ops else None

    def step(self, name: str) -> _Step:
        """The context of step ``name`` (a profiler range too while a profiler runs)."""
        return _Step(self, name)

    def _enter(self, name: str) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        if self._open:  # the enclosing step's time stops while this one runs
            outer, since = self._open[-1]
            self.seconds[outer] += now - since
        self._open.append((name, now))
        self.entries[name] += 1

    def _exit(self) -> None:
        synchronize(self.device)
        now = time.perf_counter()
        name, since = self._open.pop()
        self.seconds[name] += now - since
        if self._open:
            outer, _ = self._open[-1]
            self._open[-1] = (outer, now)

    def credit(self, name: str, seconds: float, entries: int) -> None:
        """``seconds`` of the open step that ran as ``entries`` runs of step ``name`` inside one native call (the
        draft's forwards inside the tree's): moved from the open step's time to ``name``'s."""
        if self._open:
            self.seconds[self._open[-1][0]] -= seconds
        self.seconds[name] += seconds
        self.entries[name] += entries

    @property
    def current(self) -> str | None:
        return self._open[-1][0] if self._open else None

    def __enter__(self) -> "StepClock":
        if self._counter is not None:
            self._counter.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._counter is not None:
            self._counter.__exit__(*exc)


class _Step:
    """A step of a :class:`StepClock`: a plain object rather than a generator-based context, and a profiler range only
    while a profiler runs, so that the clock adds as little as it can to the cycles it times (each step boundary runs
    right after a verify forward, with the core's caches cold). Inside an opaque step it does nothing."""

    __slots__ = ("clock", "name", "counted", "range")

    def __init__(self, clock: StepClock, name: str) -> None:
        self.clock, self.name = clock, name
        self.counted = not (clock._open and clock._open[-1][0] in OPAQUE)
        self.range = profiler_range(name) if self.counted else None

    def __enter__(self) -> None:
        if self.counted:
            self.clock._enter(self.name)
            if self.range is not None:
                self.range.__enter__()

    def __exit__(self, *exc: object) -> None:
        if self.counted:
            if self.range is not None:
                self.range.__exit__(*exc)
            self.clock._exit()


class _OpCounter(TorchDispatchMode):
    """Counts each aten operator to the clock's innermost open step ("outside" when none is)."""

    def __init__(self, clock: StepClock) -> None:
        super().__init__()
        self.clock = clock

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 (torch's signature)
        self.clock.ops[self.clock.current or "outside"] += 1
        return func(*args, **(kwargs or {}))
