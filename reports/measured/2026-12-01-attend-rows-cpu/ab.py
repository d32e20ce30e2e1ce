"""The few-row attention kernel up to 64 query rows (`fast_paths.ATTEND_ROWS`, the packed GEMM's most) against up to
16 (SDPA past them), side by side in one process on the default target: T(n) for n = 1-64 at a 300-token context
(the cost model's `measure_target_costs`, greedy, 2 repeats a round, 6 rounds, the order turning), then the default
main job's jakiro draft decoding MT-bench q1-5 first turns greedily with a 32-token tree, both ways: outputs against
vanilla's and the time.

    python reports/measured/2026-12-01-attend-rows-cpu/ab.py --run-dir runs/default > reports/measured/2026-12-01-attend-rows-cpu/ab.txt
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
from pathlib import Path

import torch

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import measure_target_costs
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models import fast_paths
from jakiro_lib.models.target import load_target, set_capture
from jakiro_lib.profiles import get_profile

SIZES = [1, 8, 16, 24, 32, 48, 64]
WAYS = (16, 64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    args = ap.parse_args()
    profile = get_profile("default", **{"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    set_capture(target.model, "none")
    print(run_metadata(target.device))
    for rows in WAYS:  # warm-up
        fast_paths.ATTEND_ROWS = rows
        measure_target_costs(target.model, SIZES, context=300, repeats=1, greedy=True)
    times: dict[int, dict[int, list[float]]] = {w: {n: [] for n in SIZES} for w in WAYS}
    for rnd in range(6):
        for rows in (WAYS if rnd % 2 == 0 else WAYS[::-1]):
            fast_paths.ATTEND_ROWS = rows
            for n, s in measure_target_costs(target.model, SIZES, context=300, repeats=2, greedy=True).items():
                times[rows][n].append(1e3 * s)
    med = {w: {n: statistics.median(v) for n, v in times[w].items()} for w in WAYS}
    print("| n | T(n) ms, kernel to 16 rows | T(n)/T(1) | T(n) ms, kernel to 64 rows | T(n)/T(1) | 64 / 16 |")
    print("|---|---|---|---|---|---|")
    for n in SIZES:
        a, b = med[16][n], med[64][n]
        print(f"| {n} | {a:.2f} | {a / med[16][1]:.3f} | {b:.2f} | {b / med[64][1]:.3f} | {b / a:.3f} |")
    spec = cycle_methods(profile, args.run_dir, target, ["jakiro"])["jakiro"]
    spec = dataclasses.replace(spec, tree=dataclasses.replace(spec.tree, total_tokens=32))
    draft = spec.load_draft(target)
    vanilla_spec = cycle_methods(profile, args.run_dir, target, ["vanilla"])["vanilla"]
    prompts = cycle_prompts(profile, target, 5)
    for rows in WAYS:
        fast_paths.ATTEND_ROWS = rows
        _generate(target, draft, spec, prompts[0], 16, None)
    result = {w: {"equal": 0, "seconds": 0.0, "tokens": 0, "cycles": 0} for w in WAYS}
    for i, ids in enumerate(prompts):
        fast_paths.ATTEND_ROWS = 64
        vanilla = _generate(target, None, vanilla_spec, ids, 64, None).output_ids
        for rows in (WAYS if i % 2 == 0 else WAYS[::-1]):
            fast_paths.ATTEND_ROWS = rows
            r = _generate(target, draft, spec, ids, 64, None)
            result[rows]["equal"] += r.output_ids == vanilla
            result[rows]["seconds"] += r.wall_time - r.prefill_time
            result[rows]["tokens"] += len(r.output_ids)
            result[rows]["cycles"] += r.cycles
    for rows, r in result.items():
        print(f"jakiro, 32-token tree, kernel to {rows} rows: = vanilla {r['equal']}/{len(prompts)}, "
              f"{r['tokens'] / r['seconds']:.1f} tokens/s, tau {r['tokens'] / r['cycles']:.3f}")


if __name__ == "__main__":
    main()
