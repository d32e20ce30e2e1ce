"""In real generations (10 MT-bench first turns, 64 tokens, after one to warm up): each cycle's tree call as the cycle
makes it (after the verify forward and the accepted path's step: "cold") against the same call repeated at once
("warm"; it writes the same slots with the same rows), and the accepted path's step (``one_call``) likewise.

    python reports/measured/2026-12-02-draft-arena-cpu-zen5/cold_tree.py jakiro > reports/measured/2026-12-02-draft-arena-cpu-zen5/cold_tree.txt
"""
import sys, time, statistics
from pathlib import Path
import torch
from jakiro_lib.decoding import static_tree
from jakiro_lib.models import draft_step
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile
name = sys.argv[1] if len(sys.argv) > 1 else "jakiro"
profile_ = get_profile("default", **{"data.num_conversations": 5000, "train.epochs": 4})
target = load_target(profile_.target)
methods = cycle_methods(profile_, Path("runs/main5000"), target, [name])
prompts = cycle_prompts(profile_, target, 10)
spec = methods[name]; draft = spec.load_draft(target)
T = {"cold": [], "warm": [], "ext_cold": [], "ext_warm": []}
one_tree = static_tree.one_tree
def twice(*a):
    t = time.perf_counter(); out = one_tree(*a); T["cold"].append(time.perf_counter() - t)
    t = time.perf_counter(); out = one_tree(*a); T["warm"].append(time.perf_counter() - t)
    return out
static_tree.one_tree = twice
one_call = draft_step.one_call
def twice_call(draft, features, ids, pos, cache, allowed, *rest):
    if features.shape[0] <= 8 and allowed.shape[0] == features.shape[0] and not getattr(cache, "_in_tree", False):
        t = time.perf_counter(); out = one_call(draft, features, ids, pos, cache, allowed, *rest); T["ext_cold"].append(time.perf_counter() - t)
        t = time.perf_counter(); out = one_call(draft, features, ids, pos, cache, allowed, *rest); T["ext_warm"].append(time.perf_counter() - t)
        return out
    return one_call(draft, features, ids, pos, cache, allowed, *rest)
draft_step.one_call = twice_call
with torch.inference_mode():
    for p in prompts[:1]: _generate(target, draft, spec, p, 64, None)
    for k in T: T[k].clear()
    for p in prompts: _generate(target, draft, spec, p, 64, None)
for k, v in T.items():
    print(f"{name} {k}: n={len(v)} median {1e3*statistics.median(v):.3f} ms mean {1e3*statistics.mean(v):.3f}")
