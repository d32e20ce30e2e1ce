"""A drafted tree's call in a decoding cycle against the same call run again at once: every cycle's
``StaticTreeDrafter.propose`` (the tree) and ``TargetRunner.score`` (the verify forward) timed as the engine runs them,
then run again with the same inputs (the repeat rewrites what the first wrote) and timed. Medians over the cycles of
greedy generations of MT-bench first turns, per method and capture ("none": eager; "draft": the tree compiled).

    python reports/measured/2026-12-01-eager-main5000-cpu-zen5/insitu.py --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-01-eager-main5000-cpu-zen5/insitu.txt
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from jakiro_lib.decoding import runner, static_tree
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target, set_capture
from jakiro_lib.profiles import get_profile

METHODS = ("jakiro_auto", "eagle2_auto", "jakiro")
log: dict[str, list[tuple[float, float]]] = {}


def twice(key: str, call):
    """``call`` run twice in place of once, each timed; the second's result returned."""
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        call(*args, **kwargs)
        t1 = time.perf_counter()
        out = call(*args, **kwargs)
        log.setdefault(key, []).append((t1 - t0, time.perf_counter() - t1))
        return out
    return wrapped


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="profile overrides, key=value (ints)")
    ap.add_argument("--prompts", type=int, default=10)
    args = ap.parse_args()
    profile = get_profile("default", **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, ["vanilla", *METHODS])
    prompts = cycle_prompts(profile, target, args.prompts)
    static_tree.StaticTreeDrafter.propose = twice("tree", static_tree.StaticTreeDrafter.propose)
    runner.TargetRunner.score = twice("verify", runner.TargetRunner.score)
    print(run_metadata(target.device))
    with torch.inference_mode():
        for capture in ("none", "draft", "none", "draft"):
            set_capture(target.model, capture)
            for name in METHODS:
                spec, draft = methods[name], methods[name].load_draft(target)
                _generate(target, draft, spec, prompts[0], 16, None)
                log.clear()
                for ids in prompts:
                    _generate(target, draft, spec, ids, 64, None)
                t = spec.tree
                parts = []
                for key, pairs in log.items():
                    first, again = (1e3 * statistics.median(x) for x in zip(*pairs))
                    parts.append(f"{key} in the cycle {first:.3f} ms, again {again:.3f} ms (+{first - again:.3f})")
                print(f"capture {capture:5s} {name:12s} d{t.depth} k{t.top_k} n{t.total_tokens}: " + "; ".join(parts),
                      flush=True)


if __name__ == "__main__":
    main()
