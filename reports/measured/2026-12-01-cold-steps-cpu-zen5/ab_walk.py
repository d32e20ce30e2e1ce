"""The eager greedy cycle before and after its walk's host lists became the cycle's result: the engine at 1b58e82
(``decoding/static.py`` and its ``greedy_walk``, which built the path, the count and the bonus as tensors, read back
after the cycle) against the working tree's, interleaved prompt by prompt in one process, the order turning; per
generation the seconds less the prefill, paired; the last repeat with a step clock. Run from the repository root:

    python reports/measured/2026-12-01-cold-steps-cpu-zen5/ab_walk.py --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-01-cold-steps-cpu-zen5/ab_walk.txt
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
from collections import defaultdict
from pathlib import Path

import torch

import jakiro_lib.decoding
from jakiro_lib.decoding import static as after
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.measure.cycles import cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

BEFORE = "1b58e82"
METHODS = ("jakiro_auto", "eagle2_auto", "jakiro")
OLD_WALK = '''

def greedy_walk(tokens, parents, best):
    from .static_tree import _child
    words, up, best = torch.stack([tokens, parents, best]).tolist()
    path = [0]
    while (child := _child(words, up, path[-1], best[path[-1]])) is not None:
        path.append(child)
    dev = tokens.device
    return (torch.tensor(path, device=dev), torch.tensor(len(path) - 1, device=dev),
            torch.tensor(best[path[-1]], device=dev))
'''


def engine_before():
    """The engine module as it was at BEFORE, loaded beside today's (its own greedy_walk)."""
    source = subprocess.run(["git", "show", f"{BEFORE}:jakiro_lib/decoding/static.py"], capture_output=True,
                            text=True, check=True).stdout
    source = source.replace("greedy_path, greedy_walk, root_step", "greedy_path, root_step") + OLD_WALK
    path = Path(jakiro_lib.decoding.__file__).with_name("_static_before.py")
    path.write_text(source)
    try:
        from jakiro_lib.decoding import _static_before
    finally:
        path.unlink()
    return _static_before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="profile overrides, key=value (ints)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    before = engine_before()
    profile = get_profile("default", **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, ["vanilla", *METHODS])
    prompts = cycle_prompts(profile, target, args.prompts)
    drafts = {n: methods[n].load_draft(target) for n in METHODS}
    print(run_metadata(target.device))

    def run(module, name, ids, clock=None):
        return module.static_generate(target.model, drafts[name], methods[name].tree, ids, max_new_tokens=64,
                                      eos_token_ids=target.eos_token_ids, max_context=target.config.max_context,
                                      clock=clock)

    seconds, steps, cycles, equal = defaultdict(list), defaultdict(lambda: defaultdict(float)), defaultdict(int), \
        defaultdict(int)
    for name in METHODS:
        run(after, name, prompts[0])
        run(before, name, prompts[0])
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            for name in METHODS:
                ways = [("before", before), ("after", after)][::1 if (i + rep) % 2 == 0 else -1]
                outs = {}
                for way, module in ways:
                    clock = StepClock(target.device) if rep == args.repeats - 1 else None
                    r = run(module, name, ids, clock)
                    seconds[name, way].append(r.wall_time - r.prefill_time)
                    outs[way] = r.output_ids
                    if clock is not None:
                        for step, s in clock.seconds.items():
                            steps[name, way][step] += s
                        cycles[name, way] += r.cycles
                equal[name] += outs["before"] == outs["after"]
    rng = random.Random(0)
    for name in METHODS:
        ratios = [b / a for b, a in zip(seconds[name, "before"], seconds[name, "after"])]  # > 1: after is faster
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        print(f"{name}: speed after / before {statistics.median(ratios):.3f} [{boot[50]:.3f}, {boot[1949]:.3f}] "
              f"(median and 95% bootstrap interval of {len(ratios)} paired generations), outputs equal "
              f"{equal[name]}/{len(ratios)}")
        for way in ("before", "after"):
            per = {k: 1e3 * v / cycles[name, way] for k, v in sorted(steps[name, way].items()) if k != "prefill"}
            print(f"  {way:6s} ms a cycle: " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()))


if __name__ == "__main__":
    main()
