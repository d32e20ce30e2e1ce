"""The draft's weights (its layer's int8 panels and its head's int8 copy, about 8 MB) read into the caches right after
each verify forward (warm.diff's ``warm`` op, not kept) against not, paired generations of 10 MT-bench first turns x 3
(the third round clocked by step), jakiro and eagle2 at the profile's trees.

    git apply reports/measured/2026-12-02-draft-arena-cpu-zen5/warm.diff
    python reports/measured/2026-12-02-draft-arena-cpu-zen5/warm_ab.py
    git checkout jakiro_lib/models/stream_gemm.cpp
"""
import sys, time, statistics, random
from collections import defaultdict
from pathlib import Path
import torch
from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.models import draft_step, kernels
from jakiro_lib.decoding.static_tree import ATTEND_HEAD_SIZES
from jakiro_lib.profiles import get_profile
profile_ = get_profile("default", **{"data.num_conversations": 5000, "train.epochs": 4})
target = load_target(profile_.target)
kernels.stream_gemm_available()
names = ["jakiro", "eagle2"]
methods = cycle_methods(profile_, Path("runs/main5000"), target, names)
prompts = cycle_prompts(profile_, target, 10)
drafts = {n: methods[n].load_draft(target) for n in names}
score = TargetRunner.score
state = {"on": False, "tensors": []}
def scored(self, *a, **k):
    out = score(self, *a, **k)
    if state["on"] and a[2] is not None:
        torch.ops.jakiro_stream_gemm.warm(state["tensors"])
    return out
TargetRunner.score = scored
def tensors_of(d):
    p = draft_step.step_panels(d, ATTEND_HEAD_SIZES)
    ts = [*p["qkv"], p["o"], *p["experts"]] + ([p["router"]] if p["router"] is not None else [])
    h = d.int8_head()
    return [t for t in ts if t is not None and t.numel()] + [h[0], h[1]]
secs = defaultdict(list); steps = defaultdict(list)
with torch.inference_mode():
    for n in names:
        _generate(target, drafts[n], methods[n], prompts[0], 64, None)
        print(n, "warm MB", sum(t.nbytes for t in tensors_of(drafts[n])) / 2**20)
    for rep in range(3):
        for i, ids in enumerate(prompts):
            for n in names:
                state["tensors"] = tensors_of(drafts[n])
                for on in ([False, True] if (i + rep) % 2 == 0 else [True, False]):
                    state["on"] = on
                    clock = StepClock(target.device) if rep == 2 else None
                    r = _generate(target, drafts[n], methods[n], ids, 64, clock)
                    secs[n, on].append((r.wall_time - r.prefill_time) / r.cycles)
                    if clock is not None:
                        for s in ("draft", "draft_forward", "verify", "evaluate", "update"):
                            steps[n, on, s].append(1e3 * clock.seconds.get(s, 0) / r.cycles)
rng = random.Random(0)
for n in names:
    ratios = [a / b for a, b in zip(secs[n, False], secs[n, True])]
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    print(n, "speed warm/off %.3f [%.3f, %.3f]" % (statistics.median(ratios), boot[50], boot[1949]),
          "ms a cycle off %.3f on %.3f" % (1e3 * statistics.median(secs[n, False]), 1e3 * statistics.median(secs[n, True])))
    for on in (False, True):
        print("   ", "on" if on else "off", ", ".join(f"{s} {statistics.median(steps[n, on, s]):.3f}" for s in ("draft", "draft_forward", "verify", "evaluate", "update")))
