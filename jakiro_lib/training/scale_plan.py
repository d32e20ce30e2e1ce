"""The choice of the main job's scale (pure: tested on mocked rates): its constants, the rates a measurement gives,
:func:`choose_scale` and the stage plan at the chosen scale.

How the machine is measured and how the choice is recorded and reused is :mod:`jakiro_lib.training.scale`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from ..config import Profile
from ..profiles import DEFAULT_SCALE, override
from .throughput_plan import measured_favoured, stage_plan
from ..precision import compiles_step, resolve_precision

MAIN_JOB_MINUTES = 90
MARGIN = 0.10  # of the main job, kept free: timings on a shared machine move by several percent
# A main job's caching and training stages over their plan (docs/results.md, the throughput model against a main
# job): compilation, held-out evaluation, disk writes and loads are not in the plan
PLAN_OVERRUN = 1.25
# Stages 02 and 03 in seconds per ms of the fp32 target's T(1), the largest recorded: the benchmark is the stage
# a misjudged budget cannot shrink (measured: docs/results.md, Measurements that stood in the code: data, models,
# training)
BENCH_SECONDS_PER_T1_MS = 56.0
# And the trees' tuning, whose compilations do not follow T(1): the default main study's four tuned methods with
# inductor's cache empty took 216-262 s (the shapes of two searched to depth 6) against about 90 with the budget alone
# (docs/results.md, measurements that stood in the code); counted besides the seconds per ms above
TREE_TUNING_SECONDS = 270.0
# Compiled over eager bf16 training steps: the smallest gain of any draft measured
# (docs/results.md, measurements that stood in the code), for every draft
COMPILE_GAIN = 1.2
CONVERSATIONS_PER_EPOCH = 1000  # measured: docs/results.md, CPU with AMX: the main job at 8000 x 6 and the two before
MAX_EPOCHS = 10  # measured: docs/results.md, CPU with AMX: all the packaged conversations, dense draft, 10 epochs
STEP = 100  # conversations are chosen in steps of 100


@dataclass
class Measurement:
    """What :func:`measure` read on this machine: a throughput table (rows as :mod:`jakiro_lib.training.throughput` writes
    them), T(1) in ms, mean tokens per conversation, the conversations the source has and the seconds it took."""

    table: pd.DataFrame
    t1_ms: float
    tokens_per_conversation: float
    available: int
    seconds: float
    environment: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Rates:
    """The job's costs per unit: seconds per token cached; seconds per token of the data per epoch to train every
    draft (held-out share and compile gain included); tokens per conversation; conversations available; the
    benchmark's estimated seconds; the measurement's seconds."""

    cache_s_per_token: float
    train_s_per_token: float
    tokens_per_conversation: float
    available: int
    bench_s: float
    measure_s: float


@dataclass(frozen=True)
class Choice:
    num_conversations: int
    epochs: int
    seconds: float  # caching + training expected, PLAN_OVERRUN included
    budget_s: float  # what caching + training may take
    reason: str


class ScaleError(ValueError):
    """A measurement that cannot size the job (no caching or training rate came out of it)."""


def caching_training_budget(rates: Rates) -> float:
    """Seconds caching and training may take: the main job less the margin, the benchmark and the measurement."""
    return MAIN_JOB_MINUTES * 60.0 * (1.0 - MARGIN) - rates.bench_s - rates.measure_s


def planned_seconds(rates: Rates, conversations: int, epochs: int) -> float:
    """Expected seconds of caching ``conversations`` and training every draft on them for ``epochs``."""
    tokens = conversations * rates.tokens_per_conversation
    return PLAN_OVERRUN * tokens * (rates.cache_s_per_token + epochs * rates.train_s_per_token)


def most_conversations(rates: Rates, epochs: int, budget_s: float) -> int:
    """The most conversations (a multiple of :data:`STEP`, at most those available) that fit ``budget_s``."""
    per_conversation = planned_seconds(rates, 1, epochs)
    n = math.floor(max(budget_s, 0.0) / per_conversation / STEP) * STEP if per_conversation > 0 else rates.available
    return min(rates.available, n)


def choose_scale(rates: Rates, *, conversations: int | None = None, epochs: int | None = None) -> Choice:
    """Conversations and epochs for the main job: the most epochs that leave :data:`CONVERSATIONS_PER_EPOCH` per
    epoch within the budget, then the most conversations, at least ``DEFAULT_SCALE``; ``conversations`` or
    ``epochs``: set by the user, kept, and the other sized around it."""
    budget = caching_training_budget(rates)
    floor_n, floor_e = min(DEFAULT_SCALE[0], rates.available), DEFAULT_SCALE[1]

    def done(n: int, e: int, reason: str) -> Choice:
        return Choice(n, e, planned_seconds(rates, n, e), budget, reason)

    if epochs is not None:
        n = max(floor_n, most_conversations(rates, epochs, budget))
        return done(n, epochs, f"train.epochs={epochs} set; the most conversations that fit at it")
    if conversations is not None:
        fit = [e for e in range(floor_e, MAX_EPOCHS + 1) if planned_seconds(rates, conversations, e) <= budget]
        return done(conversations, max(fit, default=floor_e), f"data.num_conversations={conversations} set; the "
                    "most epochs that fit with it" + ("" if fit else f" (none does: {floor_e}, the floor)"))
    best = None
    for e in range(floor_e, MAX_EPOCHS + 1):
        n = most_conversations(rates, e, budget)
        if n >= floor_n and (e == floor_e or n >= rates.available or n >= CONVERSATIONS_PER_EPOCH * e):
            best = (n, e)
    if best is None:
        return done(floor_n, floor_e, f"the floor {floor_n} x {floor_e}: even it is expected to take longer than "
                    f"the {budget / 60:.1f} minutes left for caching and training")
    n, e = best
    if n >= rates.available:
        return done(n, e, f"all {n:,} conversations fit; the most epochs that fit with them (at most {MAX_EPOCHS})")
    if e == floor_e:
        return done(n, e, f"the most conversations that fit at {e} epochs (the floor)")
    return done(n, e, f"the most epochs that leave at least {CONVERSATIONS_PER_EPOCH:,} conversations per epoch, "
                f"then the most conversations that fit")


def rates(profile: Profile, m: Measurement) -> Rates:
    """:class:`Rates` of ``profile`` from a measurement: the stage plan of one epoch over the measured rows (caching
    at its dtype and batch, each draft at its own or its MLP kind's rate), training over :data:`COMPILE_GAIN` where
    the profile compiles its step."""
    unit = 1_000_000  # tokens: stage_plan is linear in them
    plan = stage_plan(override(profile, **{"train.epochs": 1}), m.table, tokens=unit)
    cache, train = plan[plan["stage"] == "cache"], plan[plan["stage"] == "train"]
    if cache.empty or train.empty or len(train) < len(profile.drafts):
        raise ScaleError(f"the measurement has no caching or training rate for every draft of {profile.name} "
                         f"(rows: {', '.join(map(str, m.table['variant']))})")
    return Rates(cache_s_per_token=float(cache["seconds"].sum()) / unit,
                 train_s_per_token=float(train["seconds"].sum()) / unit / compile_gain(profile, m.table),
                 tokens_per_conversation=m.tokens_per_conversation, available=m.available,
                 bench_s=BENCH_SECONDS_PER_T1_MS * m.t1_ms + TREE_TUNING_SECONDS, measure_s=m.seconds)


def compile_gain(profile: Profile, table: pd.DataFrame) -> float:
    """What a compiled training step is assumed to gain over the measured eager one: COMPILE_GAIN where the profile
    compiles its step, else 1."""
    precision = resolve_precision(profile.train.mixed_precision, measured_favoured(table))
    return COMPILE_GAIN if compiles_step(profile.train.compile, precision) else 1.0


def plan_at(profile: Profile, m: Measurement, conversations: int, epochs: int) -> pd.DataFrame:
    """The stage plan at the chosen scale as it was budgeted: compiled steps at eager x COMPILE_GAIN."""
    chosen = override(profile, **{"data.num_conversations": conversations, "train.epochs": epochs})
    plan = stage_plan(chosen, m.table, tokens=round(conversations * m.tokens_per_conversation))
    gain = compile_gain(profile, m.table)
    train = plan["stage"] == "train"
    plan.loc[train, "tokens_per_s"] *= gain
    plan.loc[train, "basis"] = plan.loc[train, "basis"] + (f", compiled: x {gain} assumed" if gain != 1.0 else "")
    plan.loc[train, "seconds"] = plan.loc[train, "tokens"] / plan.loc[train, "tokens_per_s"]
    plan.loc[plan["stage"] == "total", "seconds"] = plan.loc[plan["stage"] != "total", "seconds"].sum()
    plan["minutes"] = plan["seconds"] / 60.0
    return plan
