"""The eager engine's tree drafted in one kernel call (``draft_tree``: the pool's draft steps, the int8 head, the
children, the selection and the ancestor mask) against the Python pool around one-call draft steps, side by side in
one process: the one call switched off by replacing ``static_tree.one_tree`` with a function that declines, each
prompt both ways, the order turning; per generation the seconds less the prefill, paired, from the unclocked repeats;
then one repeat with a step clock (the tree's time a cycle: the engine's "draft" step and the draft forwards inside).

    python reports/measured/2026-12-01-draft-tree-one-call-cpu-zen5/ab.py --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-01-draft-tree-one-call-cpu-zen5/ab.txt
"""
from __future__ import annotations

import argparse
import random
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from jakiro_lib.decoding import static_tree
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

METHODS = ("jakiro_auto", "eagle2_auto", "jakiro", "jakiro_cepd", "eagle2")
ONE_TREE = static_tree.one_tree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="profile overrides, key=value (ints)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    profile = get_profile("default", **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, ["vanilla", *METHODS])
    prompts = cycle_prompts(profile, target, args.prompts)
    drafts = {n: methods[n].load_draft(target) for n in METHODS}
    print(run_metadata(target.device))
    served = defaultdict(int)

    def counted(*a):
        out = ONE_TREE(*a)
        served[out is not None] += 1
        return out

    def run(way: str, name: str, ids: torch.Tensor, clock: StepClock | None = None):
        static_tree.one_tree = counted if way == "one call" else (lambda *a: None)
        try:
            return _generate(target, drafts[name], methods[name], ids, 64, clock)
        finally:
            static_tree.one_tree = ONE_TREE

    seconds, tree_ms, equal = defaultdict(list), defaultdict(list), defaultdict(int)
    for name in METHODS:
        run("one call", name, prompts[0])
        run("python", name, prompts[0])
    for rep in range(args.repeats + 1):
        clocked = rep == args.repeats
        for i, ids in enumerate(prompts):
            for name in METHODS:
                ways = ["python", "one call"][::1 if (i + rep) % 2 == 0 else -1]
                outs = {}
                for way in ways:
                    clock = StepClock(target.device) if clocked else None
                    r = run(way, name, ids, clock)
                    outs[way] = r.output_ids
                    if clock is None:
                        seconds[name, way].append(r.wall_time - r.prefill_time)
                    else:
                        tree_ms[name, way].append(1e3 * (clock.seconds["draft"] + clock.seconds["draft_forward"]
                                                        ) / r.cycles)
                equal[name] += outs["one call"] == outs["python"]
    rng = random.Random(0)
    print(f"trees drafted in one call: {served[True]}, declined: {served[False]}")
    for name in METHODS:
        t = methods[name].tree
        ratios = [b / a for b, a in zip(seconds[name, "python"], seconds[name, "one call"])]  # > 1: one is faster
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        print(f"{name} d{t.depth} k{t.top_k} n{t.total_tokens}: speed one call / python "
              f"{statistics.median(ratios):.3f} [{boot[50]:.3f}, {boot[1949]:.3f}] (median and 95% bootstrap interval "
              f"of {len(ratios)} paired generations); the tree with its draft forwards, ms a cycle (clocked "
              f"repeat): python {statistics.mean(tree_ms[name, 'python']):.3f}, one call "
              f"{statistics.mean(tree_ms[name, 'one call']):.3f}; outputs equal {equal[name]}/{len(prompts) * (args.repeats + 1)}",
              flush=True)


if __name__ == "__main__":
    main()
