"""A draft's decoding step in two kernel calls (`models/draft_step.py`: `draft_qkv`, the cache written, `draft_mix`)
against the Python step it replaces, side by side in one process: the default main job's drafts decode MT-bench
prompts greedily on the engine (`target.capture` "draft": the tree compiled, where the two calls are not used; the
accepted path's forward eager, where they are), each prompt once with the two calls and once without
(`draft_step.fused_step` swapped for a function that declines), the order turning prompt by prompt, every step timed
by the engine's clock. Greedy outputs equal both ways (asserted).

    python reports/measured/2026-12-01-draft-step-cpu/ab.py --run-dir runs/default \\
        --out reports/measured/2026-12-01-draft-step-cpu
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models import draft_step
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

METHODS = ("eagle2_auto", "jakiro_auto", "eagle2", "jakiro", "jakiro_cepd")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    profile = get_profile("default", **{"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, list(METHODS))
    prompts = cycle_prompts(profile, target, args.prompts)
    drafts = {name: spec.load_draft(target) for name, spec in methods.items()}
    ways = {"two calls": draft_step.fused_step, "python": lambda *a: None}
    for name in METHODS:  # warm-up: kernels loaded, the trees compiled
        for way in ways.values():
            draft_step.fused_step = way
            _generate(target, drafts[name], methods[name], prompts[0], 16, None)
    runs: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            for name in METHODS:
                order = list(ways) if (i + rep) % 2 == 0 else list(ways)[::-1]
                outputs = []
                for way in order:
                    draft_step.fused_step = ways[way]
                    clock = StepClock(target.device)
                    r = _generate(target, drafts[name], methods[name], ids, 64, clock)
                    outputs.append(r.output_ids)
                    runs.setdefault((name, way), []).append(
                        {"prompt": i, "cycles": r.cycles, "seconds": r.wall_time - r.prefill_time,
                         "steps": {k: v for k, v in clock.seconds.items() if k != "prefill"}})
                assert outputs[0] == outputs[1], (name, i)
    draft_step.fused_step = ways["two calls"]
    rows = []
    for name in METHODS:
        row: dict = {"method": name}
        for way in ways:
            rs = runs[(name, way)]
            cycles = sum(r["cycles"] for r in rs)
            row[f"{way} ms/cycle"] = 1e3 * sum(r["seconds"] for r in rs) / cycles
            for step in ("draft_forward", "draft", "verify"):
                row[f"{way} {step} ms"] = 1e3 * sum(r["steps"].get(step, 0.0) for r in rs) / cycles
        per = lambda way: [r["seconds"] / r["cycles"] for r in runs[(name, way)]]  # noqa: E731
        row["paired cycle ratio"] = statistics.median(b / a for a, b in zip(per("python"), per("two calls")))
        row["faster runs"] = sum(b < a for a, b in zip(per("python"), per("two calls")))
        row["runs"] = len(per("python"))
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab.json").write_text(json.dumps({"rows": rows, "runs": {f"{k[0]}|{k[1]}": v for k, v in runs.items()}},
                                                 indent=2) + "\n")
    config = {"methods": METHODS, "prompts": args.prompts, "repeats": args.repeats, "max_new_tokens": 64,
              "run_dir": str(args.run_dir), "environment": run_metadata(target.model.device)}
    (args.out / "ab_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    for row in rows:
        print(f"{row['method']:12s} path forward {row['python draft_forward ms']:.3f} -> "
              f"{row['two calls draft_forward ms']:.3f} ms, tree {row['python draft ms']:.3f} -> "
              f"{row['two calls draft ms']:.3f}, verify {row['python verify ms']:.2f} -> {row['two calls verify ms']:.2f}, "
              f"cycle {row['python ms/cycle']:.2f} -> {row['two calls ms/cycle']:.2f} ms, paired "
              f"{row['paired cycle ratio']:.4f}, faster in {row['faster runs']}/{row['runs']}")


if __name__ == "__main__":
    main()
