"""Side-by-side timing of variants in one process, e.g. a kernel change against the package's kernel, both ways on the
same items: :func:`paired_rounds` runs every way on every item, the order of the ways turning from item to item so that
a place in the order (the first to touch an item's memory, the one after a slow way) favours none, and
:func:`speed_ratio` says how much faster one way ran, with a percentile bootstrap interval over the pairs
(docs/DESIGN.md section 11). The bootstrap's core is shared with
:func:`~jakiro_lib.measure.summary.ratio_interval`, the same statistic over benchmark records.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Iterable, Mapping, Sequence, TypeVar

import numpy as np

T = TypeVar("T")


def paired_rounds(ways: Mapping[str, Callable[[T], float]], items: Sequence[T], *, repeats: int = 1,
                  warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of every way on every item: ``{name: [seconds per (repeat, item)]}``, index i of every list one round.

    ``ways[name](item)`` runs one way on one item and returns the seconds it measured (what is timed is the caller's:
    generation less prefill, say). First each way runs ``warmup`` times on ``items[0]``, unrecorded; then each repeat
    runs each item every way once, a round, the order of the ways rotated by one from round to round (two ways: A, B
    then B, A), so each way holds each place equally often when repeats x items is a multiple of the number of ways
    (within one otherwise). A ValueError names bad arguments, or a way that returned no finite seconds >= 0.
    """
    names = list(ways)
    if not names:
        raise ValueError("paired_rounds got no ways: give a mapping of at least two names to callables")
    if len(names) < 2:
        raise ValueError(f"paired_rounds needs at least two ways to compare, got only {names[0]!r}")
    if len(items) == 0:
        raise ValueError("paired_rounds got no items to run the ways on")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"paired_rounds needs repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    for _ in range(warmup):
        for name in names:
            _run(ways, name, items, 0)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for rnd in range(repeats * len(items)):
        shift = rnd % len(names)
        for name in names[shift:] + names[:shift]:
            seconds[name].append(_run(ways, name, items, rnd % len(items)))
    return seconds


def _run(ways: Mapping[str, Callable[[T], float]], name: str, items: Sequence[T], index: int) -> float:
    """One way on one item: its seconds, checked to be a finite number >= 0."""
    seconds = ways[name](items[index])
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or not 0 <= float(seconds) < math.inf:
        raise ValueError(f"way {name!r} returned {seconds!r} on item {index}: a way must return its seconds, "
                         "a finite number >= 0")
    return float(seconds)


def speed_ratio(baseline: Sequence[float], variant: Sequence[float], *, level: float = 0.95, resamples: int = 2000,
                seed: int = 0) -> tuple[float, float, float]:
    """(ratio, low, high): mean baseline seconds / mean variant seconds (above 1: the variant faster) and its ``level``
    percentile bootstrap interval, ``resamples`` resamplings of the pairs (index i of both lists together) drawn by
    ``numpy.random.default_rng(seed)``: the lists :func:`paired_rounds` returns for two ways."""
    if len(baseline) != len(variant):
        raise ValueError(f"speed_ratio pairs seconds by index: baseline has {len(baseline)}, variant {len(variant)}")
    if len(baseline) < 2:
        raise ValueError(f"speed_ratio needs at least 2 pairs of seconds, got {len(baseline)}")
    x, y = np.asarray(baseline, dtype=float), np.asarray(variant, dtype=float)
    if not (np.all(np.isfinite(x) & (x > 0)) and np.all(np.isfinite(y) & (y > 0))):
        raise ValueError("speed_ratio needs seconds that are finite and > 0: a time <= 0 or NaN is not a measurement")
    if not 0 < level < 1:
        raise ValueError(f"speed_ratio's level is a probability in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"speed_ratio needs resamples >= 1, got {resamples}")
    ones = np.ones(len(x))
    low, high = bootstrap_interval([(np.stack([x, ones], 1), np.stack([y, ones], 1))], level=level,
                                    resamples=resamples, seed=seed)
    return float(x.mean() / y.mean()), low, high


def bootstrap_interval(strata: Iterable[tuple[np.ndarray, np.ndarray]], *, level: float, resamples: int,
                        seed: int) -> tuple[float, float]:
    """Percentile bootstrap interval of a ratio over paired samples in strata: ``(x, y)`` per stratum, [P, 2] arrays of
    (numerator, denominator) per pair, the statistic (sum over strata of sum x[:, 0] / sum x[:, 1]) / (the same of y),
    the pairs resampled together within each stratum, the strata in the order given, by
    ``numpy.random.default_rng(seed)``. With denominators 1 and one stratum, a ratio of means."""
    rng = np.random.default_rng(seed)
    num, den = np.zeros(resamples), np.zeros(resamples)
    for x, y in strata:
        idx = rng.integers(0, len(x), size=(resamples, len(x)))  # [R, P]
        num += x[idx, 0].sum(1) / x[idx, 1].sum(1)
        den += y[idx, 0].sum(1) / y[idx, 1].sum(1)
    lo, hi = np.quantile(num / den, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)
