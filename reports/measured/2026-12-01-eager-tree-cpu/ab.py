"""The draft's tree eager (`target.capture` "none": its forwards in two kernel calls, its candidate steps in one) against
the tree compiled by inductor ("draft", the default profile's setting), side by side in one process: the default main
job's drafts decode MT-bench prompts greedily on the engine, each prompt once each way, the order turning prompt by
prompt, every step timed by the engine's clock; plain decoding timed beside them as the unit. Greedy outputs equal both
ways (asserted).

    python reports/measured/2026-12-01-eager-tree-cpu/ab.py --run-dir runs/default \\
        --out reports/measured/2026-12-01-eager-tree-cpu
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
from jakiro_lib.models.target import load_target, set_capture
from jakiro_lib.profiles import get_profile

METHODS = ("eagle2_auto", "jakiro_auto", "eagle2", "jakiro", "jakiro_cepd", "jakiro_lookup")
WAYS = {"eager": "none", "compiled tree": "draft"}


def bootstrap(ratios: list[float], rounds: int = 2000) -> tuple[float, float]:
    """95% interval of the median ratio, prompts resampled."""
    g = torch.Generator().manual_seed(0)
    x = torch.tensor(ratios)
    meds = sorted(float(x[torch.randint(len(x), (len(x),), generator=g)].median()) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    profile = get_profile("default", **{"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, ["vanilla", *METHODS])
    prompts = cycle_prompts(profile, target, args.prompts)
    drafts = {name: spec.load_draft(target) for name, spec in methods.items()}
    for name in methods:  # warm-up: kernels loaded, the trees compiled
        for capture in WAYS.values():
            set_capture(target.model, capture)
            _generate(target, drafts[name], methods[name], prompts[0], 16, None)
    runs: dict[tuple[str, str], list[dict]] = {}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            for name in methods:
                order = list(WAYS) if (i + rep) % 2 == 0 else list(WAYS)[::-1]
                outputs = []
                for way in order:
                    set_capture(target.model, WAYS[way])
                    clock = StepClock(target.device)
                    r = _generate(target, drafts[name], methods[name], ids, 64, clock)
                    outputs.append(r.output_ids)
                    runs.setdefault((name, way), []).append(
                        {"prompt": i, "cycles": r.cycles, "seconds": r.wall_time - r.prefill_time,
                         "steps": {k: v for k, v in clock.seconds.items() if k != "prefill"}})
                assert outputs[0] == outputs[1], (name, i)
    set_capture(target.model, profile.target.capture)
    plain = statistics.mean(r["seconds"] / r["cycles"] for way in WAYS for r in runs[("vanilla", way)])
    rows = []
    for name in METHODS:
        row: dict = {"method": name}
        for way in WAYS:
            rs = runs[(name, way)]
            cycles = sum(r["cycles"] for r in rs)
            row[f"{way} ms/cycle"] = 1e3 * sum(r["seconds"] for r in rs) / cycles
            row[f"{way} cycle/plain"] = row[f"{way} ms/cycle"] / (1e3 * plain)
            for step in ("draft_forward", "draft", "verify"):
                row[f"{way} {step} ms"] = 1e3 * sum(r["steps"].get(step, 0.0) for r in rs) / cycles
        per = lambda way: [r["seconds"] / r["cycles"] for r in runs[(name, way)]]  # noqa: E731
        ratios = [c / e for e, c in zip(per("eager"), per("compiled tree"))]
        row["compiled/eager (median)"] = statistics.median(ratios)
        row["95% interval"] = bootstrap(ratios)
        row["eager faster in"] = f"{sum(x > 1 for x in ratios)}/{len(ratios)}"
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab.json").write_text(json.dumps({"plain_ms": 1e3 * plain, "rows": rows,
                                                  "runs": {f"{k[0]}|{k[1]}": v for k, v in runs.items()}},
                                                 indent=2) + "\n")
    config = {"methods": ["vanilla", *METHODS], "ways": WAYS, "prompts": args.prompts, "repeats": args.repeats,
              "max_new_tokens": 64, "trees": {n: str(methods[n].tree) for n in METHODS},
              "run_dir": str(args.run_dir), "environment": run_metadata(target.model.device)}
    (args.out / "ab_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    print(f"plain step {1e3 * plain:.2f} ms")
    for row in rows:
        lo, hi = row["95% interval"]
        print(f"{row['method']:13s} eager {row['eager ms/cycle']:.2f} ms ({row['eager cycle/plain']:.3f} plain; tree "
              f"{row['eager draft ms']:.2f}, path forward {row['eager draft_forward ms']:.2f}), compiled tree "
              f"{row['compiled tree ms/cycle']:.2f} ms ({row['compiled tree cycle/plain']:.3f}; tree "
              f"{row['compiled tree draft ms']:.2f}, path {row['compiled tree draft_forward ms']:.2f}); compiled/eager "
              f"{row['compiled/eager (median)']:.3f} [{lo:.3f}, {hi:.3f}], eager faster in {row['eager faster in']}")


if __name__ == "__main__":
    main()
