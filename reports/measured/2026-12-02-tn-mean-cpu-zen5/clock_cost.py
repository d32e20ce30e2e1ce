"""What the cycle-cost table's clock adds to the cycles it times: greedy generations of the first turns of MT-bench
q1-10 (64 tokens, the main5000 drafts) with no clock, with the clock as it is (`StepClock`: a plain object a step, a
profiler range only under a profiler) and with the clock as it was (a generator-based context with a profiler range
at every step, re-created here as a subclass), the three interleaved prompt by prompt with the order turning; per
method the ms a cycle (generation less prefill, over cycles) and the median over prompts of each clocked way's ratio
to the unclocked generation of the same prompt.

    python reports/measured/2026-12-02-tn-mean-cpu-zen5/clock_cost.py > reports/measured/2026-12-02-tn-mean-cpu-zen5/clock_cost.txt
"""
import contextlib
import statistics
import time
from pathlib import Path

from torch.profiler import record_function

from jakiro_lib.decoding.clock import STEP_RANGES
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.clock import OPAQUE, StepClock
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

REPEATS = 2


class GeneratorClock(StepClock):
    """The clock's step as it was: a generator-based context with a profiler range at every step."""

    @contextlib.contextmanager
    def step(self, name):
        if self._open and self._open[-1][0] in OPAQUE:
            yield
            return
        self._enter(name)
        try:
            with record_function(STEP_RANGES[name]):
                yield
        finally:
            self._exit()


profile = get_profile("default", **{"data.num_conversations": 5000, "train.epochs": 4})
target = load_target(profile.target)
names = ["vanilla", "jakiro"]
methods = cycle_methods(profile, Path("runs/main5000"), target, names)
prompts = cycle_prompts(profile, target, 10)
drafts = {n: s.load_draft(target) for n, s in methods.items()}
for n, s in methods.items():
    _generate(target, drafts[n], s, prompts[0], 8, None)
ways = {"none": lambda: None, "clock": lambda: StepClock(target.device),
        "generator clock": lambda: GeneratorClock(target.device)}
order = list(ways)
per = {(n, w): [] for n in names for w in ways}
print(run_metadata(target.model.device))
t0 = time.time()
for rep in range(REPEATS):
    for i, ids in enumerate(prompts):
        turn = (i + rep) % len(order)
        for n in names:
            for w in order[turn:] + order[:turn]:
                r = _generate(target, drafts[n], methods[n], ids, 64, ways[w]())
                per[n, w].append((r.wall_time - r.prefill_time) / r.cycles)
print(f"{REPEATS} x {len(prompts)} prompts a method and way, {time.time() - t0:.0f} s")
for n in names:
    base = per[n, "none"]
    line = [f"{n} ({methods[n].tree.total_tokens if methods[n].tree else 1} tokens): ms a cycle"]
    for w in ways:
        line.append(f"{w} {1e3 * statistics.mean(per[n, w]):.3f}")
    for w in order[1:]:
        ratio = statistics.median(a / b for a, b in zip(per[n, w], base))
        line.append(f"{w}/none {ratio:.4f}")
    print("; ".join(line))
