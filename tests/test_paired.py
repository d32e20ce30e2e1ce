"""Side-by-side timing (jakiro_lib.measure.paired): the order of the ways turns so that a place in the order favours
none, warm-up runs are left out, index i of every list is one round, and the paired bootstrap of the speed ratio
brackets a known ratio, with a narrower interval than unpaired resampling on correlated pairs."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from jakiro_lib.measure.paired import paired_rounds, speed_ratio


class FakeMachine:
    """Ways that take the same true seconds per item, on a machine where the first way to touch an item in a row of
    calls pays ``penalty`` more (a cold cache): a place effect, no sleeping. ``calls`` logs (way, item)."""

    def __init__(self, true: dict[int, float], penalty: float) -> None:
        self.true, self.penalty, self.last, self.calls = true, penalty, None, []

    def way(self, name: str):
        def run(item: int) -> float:
            cold = item != self.last
            self.last = item
            self.calls.append((name, item))
            return self.true[item] + (self.penalty if cold else 0.0)
        return run


def _fixed_order(machine: FakeMachine, names: list[str], items: list[int], repeats: int) -> dict[str, list[float]]:
    """What running the ways in one fixed order would measure (the place effect left in)."""
    out: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(repeats):
        for item in items:
            for n in names:
                out[n].append(machine.way(n)(item))
    return out


def test_turning_the_order_cancels_a_place_effect_that_a_fixed_order_keeps():
    true = {i: 1.0 + 0.1 * i for i in range(10)}
    items = list(true)
    m = FakeMachine(true, penalty=0.3)
    s = paired_rounds({"a": m.way("a"), "b": m.way("b")}, items, repeats=2, warmup=0)
    ratio, lo, hi = speed_ratio(s["a"], s["b"])
    assert ratio == pytest.approx(1.0) and lo < 1.0 < hi
    fixed = _fixed_order(FakeMachine(true, penalty=0.3), ["a", "b"], items, repeats=2)
    ratio, lo, hi = speed_ratio(fixed["a"], fixed["b"])
    assert ratio > 1.2 and lo > 1.0  # whoever always goes first looks slower


@pytest.mark.parametrize("names, items, repeats", [("ab", [0, 1, 2], 2), ("abc", [0, 1], 3), ("abc", [0, 1, 2], 1)])
def test_every_way_takes_every_place_equally_often(names, items, repeats):
    m = FakeMachine({i: 1.0 for i in items}, penalty=0.0)
    paired_rounds({n: m.way(n) for n in names}, items, repeats=repeats, warmup=0)
    k = len(names)
    rounds = [tuple(n for n, _ in m.calls[j:j + k]) for j in range(0, len(m.calls), k)]
    assert len(rounds) == repeats * len(items) and all(sorted(r) == sorted(names) for r in rounds)
    places = Counter((n, r.index(n)) for r in rounds for n in names)
    assert set(places.values()) == {len(rounds) // k} and len(places) == k * k
    assert rounds[0] == tuple(names) and rounds[1] == tuple(names[1:] + names[:1])  # rotated by one


def test_warmup_runs_every_way_on_the_first_item_and_is_not_recorded():
    m = FakeMachine({0: 1.0, 1: 2.0, 2: 3.0}, penalty=0.0)
    s = paired_rounds({"a": m.way("a"), "b": m.way("b")}, [0, 1, 2], repeats=1, warmup=2)
    assert m.calls[:4] == [("a", 0), ("b", 0), ("a", 0), ("b", 0)] and len(m.calls) == 4 + 6
    assert s == {"a": [1.0, 2.0, 3.0], "b": [1.0, 2.0, 3.0]}


def test_index_i_of_every_list_is_one_round_of_one_item_and_repeat():
    log: list[tuple[str, str, int]] = []

    def way(name: str):
        def run(item: str) -> float:
            log.append((name, item, len(log)))
            return float(len(log) - 1)  # the call's number: which call measured each value
        return run

    items = ["p", "q", "r"]
    s = paired_rounds({n: way(n) for n in "abc"}, items, repeats=2, warmup=1)
    for name, values in s.items():
        assert [log[int(v)][0] for v in values] == [name] * 6  # each way's own seconds
        assert [log[int(v)][1] for v in values] == items * 2  # in (repeat, item) order
        assert [(int(v) - 3) // 3 for v in values] == list(range(6))  # all of index i from round i (after 3 warm-ups)


def test_speed_ratio_brackets_a_known_ratio_and_pairing_narrows_the_interval():
    rng = np.random.default_rng(7)
    item = rng.uniform(0.5, 2.0, 40)  # items differ far more than the two ways do
    base = item * np.exp(rng.normal(0, 0.05, 40))
    faster = item / 1.2 * np.exp(rng.normal(0, 0.05, 40))
    ratio, lo, hi = speed_ratio(base.tolist(), faster.tolist())
    assert lo < 1.2 < hi and lo > 1.0 and lo < ratio < hi
    assert speed_ratio(base.tolist(), faster.tolist()) == (ratio, lo, hi)  # seeded
    same = item * np.exp(rng.normal(0, 0.05, 40))
    _, lo_same, hi_same = speed_ratio(base.tolist(), same.tolist())
    assert lo_same < 1.0 < hi_same
    # resampling the two lists apart forgets that item i is slow both ways: a far wider interval
    draw = np.random.default_rng(0)
    i, j = draw.integers(0, 40, size=(2000, 40)), draw.integers(0, 40, size=(2000, 40))
    unpaired = np.quantile(base[i].mean(1) / faster[j].mean(1), [0.025, 0.975])
    assert hi - lo < 0.5 * (unpaired[1] - unpaired[0])


def test_a_constant_ratio_has_a_point_interval():
    ratio, lo, hi = speed_ratio([2.0, 4.0, 3.0], [1.0, 2.0, 1.5])
    assert (ratio, lo, hi) == pytest.approx((2.0, 2.0, 2.0))


def _way(seconds):
    return lambda item: seconds


@pytest.mark.parametrize("ways, items, kwargs, message", [
    ({}, [0], {}, "no ways"),
    ({"a": _way(1.0)}, [0], {}, "at least two ways"),
    ({"a": _way(1.0), "b": _way(1.0)}, [], {}, "no items"),
    ({"a": _way(1.0), "b": _way(1.0)}, [0], {"repeats": 0}, "repeats >= 1"),
    ({"a": _way(1.0), "b": _way(1.0)}, [0], {"warmup": -1}, "warmup >= 0"),
    ({"a": _way(1.0), "b": _way(float("nan"))}, [0], {}, "way 'b' returned nan"),
    ({"a": _way(-1.0), "b": _way(1.0)}, [0], {"warmup": 0}, "way 'a' returned -1.0"),
    ({"a": _way(None), "b": _way(1.0)}, [0], {}, "way 'a' returned None"),
])
def test_paired_rounds_names_bad_arguments(ways, items, kwargs, message):
    with pytest.raises(ValueError, match=message):
        paired_rounds(ways, items, **kwargs)


@pytest.mark.parametrize("base, variant, kwargs, message", [
    ([1.0, 2.0], [1.0], {}, "baseline has 2, variant 1"),
    ([1.0], [1.0], {}, "at least 2 pairs"),
    ([1.0, 0.0], [1.0, 1.0], {}, "finite and > 0"),
    ([1.0, 1.0], [1.0, float("inf")], {}, "finite and > 0"),
    ([1.0, 1.0], [1.0, 1.0], {"level": 1.0}, "level"),
    ([1.0, 1.0], [1.0, 1.0], {"resamples": 0}, "resamples >= 1"),
])
def test_speed_ratio_names_bad_arguments(base, variant, kwargs, message):
    with pytest.raises(ValueError, match=message):
        speed_ratio(base, variant, **kwargs)
