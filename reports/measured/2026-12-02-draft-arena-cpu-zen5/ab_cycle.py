"""Whole generations with the working tree's kernel file and its eager path move against the file at ``--old`` and
the move before (each layer's path entries gathered and scattered by index tensors), side by side in one process: the
earlier file built under its own op namespace and swapped in (``torch.ops.jakiro_stream_gemm`` pointed at it, the ops
``fast_paths`` keeps looked up again), ``TargetRunner.move_path`` pointed at the tensor move with it (not with
``--keep-move``: both ways the working tree's move, the kernel files alone compared). Each prompt both
ways, the order turning; per generation the seconds less the prefill, paired; outputs and tau compared. Then, per
way, the cycle's steps by the engine's clock (ms a cycle, medians over the generations).

    python reports/measured/2026-12-02-draft-arena-cpu-zen5/ab_cycle.py --old 335e53b --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-02-draft-arena-cpu-zen5/ab_cycle.txt
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models import fast_paths
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

# the layers record's way of building an earlier kernel file under its own namespace
_spec = importlib.util.spec_from_file_location(
    "layers_ab", Path(__file__).resolve().parents[1] / "2026-12-01-layers-raw-rows-cpu-zen5" / "ab.py")
layers_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers_ab)

METHODS = ("vanilla", "jakiro_auto", "eagle2_auto", "jakiro", "jakiro_cepd", "eagle2", "jakiro_lookup")
WAYS = ("before", "now")
STEPS = ("draft", "draft_forward", "verify", "evaluate", "update", "read")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the commit whose kernel file is the 'before' way")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="profile overrides, key=value (ints)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep-move", action="store_true", help="the 'before' way keeps the working tree's path move")
    args = ap.parse_args()
    profile = get_profile("default", **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, list(METHODS))
    prompts = cycle_prompts(profile, target, args.prompts)
    drafts = {n: methods[n].load_draft(target) if n != "vanilla" else None for n in METHODS}
    layers_ab.build_old(args.old)
    ops = {"now": torch.ops.jakiro_stream_gemm, "before": getattr(torch.ops, layers_ab.OLD)}
    move_path = TargetRunner.move_path

    def tensor_move(self: TargetRunner, start: int, path: list[int]) -> None:  # the move before
        self.move(start, torch.tensor(path))
    moves = {"now": move_path, "before": move_path if args.keep_move else tensor_move}
    print(run_metadata(target.device))

    def use(way: str) -> None:
        torch.ops.__dict__["jakiro_stream_gemm"] = ops[way]
        fast_paths._kernels.clear()  # the ops fast_paths looked up, looked up again in the namespace now set
        TargetRunner.move_path = moves[way]

    def run(way: str, name: str, ids: torch.Tensor, clock: StepClock | None = None):
        use(way)
        try:
            return _generate(target, drafts[name], methods[name], ids, 64, clock)
        finally:
            use("now")

    seconds, equal, tau = defaultdict(list), defaultdict(int), defaultdict(lambda: [0, 0])
    steps = defaultdict(list)
    with torch.inference_mode():
        for name in METHODS:
            for way in WAYS:
                run(way, name, prompts[0])
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                for name in METHODS:
                    outs = {}
                    for way in WAYS[::1 if (i + rep) % 2 == 0 else -1]:
                        r = run(way, name, ids)
                        seconds[name, way].append(r.wall_time - r.prefill_time)
                        outs[way] = r.output_ids
                        tau[name, way][0] += sum(r.accepted)
                        tau[name, way][1] += r.cycles
                    equal[name] += outs["now"] == outs["before"]
        for i, ids in enumerate(prompts):  # the steps, clocked
            for name in METHODS:
                for way in WAYS[::1 if i % 2 == 0 else -1]:
                    clock = StepClock(target.device)
                    r = run(way, name, ids, clock)
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
