"""The verify forward timed call by call inside the cycles of plain decoding, jakiro and jakiro_auto (greedy, 64 tokens,
MT-bench first turns, the main5000 drafts; the three interleaved prompt by prompt with the order turning, each
verify timed by a clock that also keeps every call), and T(1) and T(8) timed alone after each prompt at plain
decoding's mean context so far (three rounds of one call after a lead-in, as the cycle-cost table times them): the
mean, median, 10th and 90th percentiles and maximum of each.

    python reports/measured/2026-12-02-tn-mean-cpu-zen5/spread.py 10 > reports/measured/2026-12-02-tn-mean-cpu-zen5/spread.txt
"""
import contextlib
import statistics
import sys
import time
from pathlib import Path

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.measure.costmodel import measure_target_costs
from jakiro_lib.measure.cycles import _generate, _Timed, cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile


class Rec(StepClock):
    """The table's clock, also keeping each call's inclusive seconds per step."""

    def __init__(self, dev):
        super().__init__(dev)
        self.calls = {}

    @contextlib.contextmanager
    def step(self, name):
        t0 = time.perf_counter()
        with super().step(name):
            yield
        self.calls.setdefault(name, []).append(time.perf_counter() - t0)


def summary(ts):
    ts = sorted(ts)
    q = lambda p: ts[min(len(ts) - 1, int(p * len(ts)))]  # noqa: E731
    return (f"n={len(ts):4d} mean {1e3 * statistics.mean(ts):7.3f} median {1e3 * statistics.median(ts):7.3f} "
            f"p10 {1e3 * q(.1):7.3f} p90 {1e3 * q(.9):7.3f} max {1e3 * ts[-1]:7.3f}")


profile = get_profile("default", **{"data.num_conversations": 5000, "train.epochs": 4})
target = load_target(profile.target)
names = ["vanilla", "jakiro", "jakiro_auto"]
methods = cycle_methods(profile, Path("runs/main5000"), target, names)
prompts = cycle_prompts(profile, target, int(sys.argv[1]) if len(sys.argv) > 1 else 10)
drafts = {n: s.load_draft(target) for n, s in methods.items()}
print(run_metadata(target.model.device))
for n, s in methods.items():
    _generate(target, drafts[n], s, prompts[0], 8, None)
clocks = {n: Rec(target.device) for n in names}
timed = {n: _Timed(clocks[n]) for n in names}
alone = {1: [], 8: []}
for i, ids in enumerate(prompts):
    for n in names[i % 3:] + names[:i % 3]:
        timed[n].add(_generate(target, drafts[n], methods[n], ids, 64, clocks[n]))
    ctx = round(timed["vanilla"].context / timed["vanilla"].cycles)
    for _ in range(3):
        for k, v in measure_target_costs(target.model, [1, 8], context=ctx, repeats=1, greedy=True).items():
            alone[k].append(v)
print("plain decoding's mean context", ctx, "positions; ms")
for n in names:
    tree = methods[n].tree
    print(f"{n} ({tree.total_tokens if tree else 1} rows) verify in its cycles: {summary(clocks[n].calls['verify'])}")
for k, ts in alone.items():
    print(f"T({k}) alone: {summary(ts)}")
