"""Sampled generations (T=1) of the eager engine with the path walked on the host (``sampling_walk``, now) against
the same engine verifying in tensors (``sampling_path``, before: the engine's ``walked`` set for greedy decoding
alone, as it was), side by side in one process: each prompt both ways with the same seed, the order turning; per
generation the seconds less the prefill, paired; outputs compared (the same draws must give the same tokens). Then,
per way, the cycle's steps by the engine's clock (ms a cycle, medians over the generations).

    python reports/measured/2026-12-02-sampled-walk-cpu-zen5/ab_walk.py --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-02-sampled-walk-cpu-zen5/ab_walk.txt
"""
from __future__ import annotations

import argparse
import random
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from jakiro_lib.config import SPEC
from jakiro_lib.decoding import static
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.decoding.verify import SamplingParams
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.measure.cycles import cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

METHODS = ("vanilla", "jakiro_auto", "eagle2_auto", "jakiro", "jakiro_cepd", "eagle2", "jakiro_lookup")
WAYS = ("before", "now")
STEPS = ("draft", "draft_forward", "verify", "evaluate", "update", "read")
PARAMS = SamplingParams(temperature=1.0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="profile overrides, key=value (ints)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    profile = get_profile("default", **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, list(METHODS))
    prompts = cycle_prompts(profile, target, args.prompts)
    drafts = {n: methods[n].load_draft(target) if n != "vanilla" else None for n in METHODS}
    init = static.StaticEngine.__init__

    def tensor_verified(self, *a, **kw) -> None:  # the engine before: a sampled cycle verified in tensors
        init(self, *a, **kw)
        self.walked = self.walked and self.params.greedy
    inits = {"now": init, "before": tensor_verified}
    print(run_metadata(target.device))

    def run(way: str, name: str, ids: torch.Tensor, seed: int, clock: StepClock | None = None):
        static.StaticEngine.__init__ = inits[way]
        try:
            spec = methods[name]
            return static_generate(target.model, drafts[name], spec.tree if spec.kind == SPEC else None, ids,
                                   max_new_tokens=64, eos_token_ids=target.eos_token_ids,
                                   max_context=target.config.max_context, params=PARAMS,
                                   generator=torch.Generator().manual_seed(seed), clock=clock)
        finally:
            static.StaticEngine.__init__ = init

    seconds, equal, tau = defaultdict(list), defaultdict(int), defaultdict(lambda: [0, 0])
    steps = defaultdict(list)
    with torch.inference_mode():
        for name in METHODS:
            for way in WAYS:
                run(way, name, prompts[0], 0)
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                for name in METHODS:
                    outs = {}
                    for way in WAYS[::1 if (i + rep) % 2 == 0 else -1]:
                        r = run(way, name, ids, 1000 * rep + i)
                        seconds[name, way].append(r.wall_time - r.prefill_time)
                        outs[way] = r.output_ids
                        tau[name, way][0] += sum(r.accepted)
                        tau[name, way][1] += r.cycles
                    equal[name] += outs["now"] == outs["before"]
        for i, ids in enumerate(prompts):  # the steps, clocked
            for name in METHODS:
                for way in WAYS[::1 if i % 2 == 0 else -1]:
                    clock = StepClock(target.device)
                    r = run(way, name, ids, i, clock)
                    for s in STEPS:
                        steps[name, way, s].append(1e3 * clock.seconds.get(s, 0.0) / max(r.cycles, 1))
    rng = random.Random(0)
    for name in METHODS:
        t = methods[name].tree
        tree = "" if t is None or name == "vanilla" else f" d{t.depth} k{t.top_k} n{t.total_tokens}"
        ratios = [b / a for b, a in zip(seconds[name, "before"], seconds[name, "now"])]  # > 1: faster now
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        taus = " / ".join(f"{tau[name, w][0] / max(tau[name, w][1], 1):.3f}" for w in WAYS)
        print(f"{name}{tree}: speed now / before {statistics.median(ratios):.3f} [{boot[50]:.3f}, {boot[1949]:.3f}] "
              f"(median and 95% bootstrap interval of {len(ratios)} paired generations); tokens a cycle before / now "
              f"{taus}; outputs equal {equal[name]}/{len(ratios)}", flush=True)
        for way in WAYS:
            parts = ", ".join(f"{s} {statistics.median(steps[name, way, s]):.3f}" for s in STEPS)
            print(f"    {way}: ms a cycle by step: {parts}", flush=True)


if __name__ == "__main__":
    main()
