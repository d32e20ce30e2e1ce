"""The draft forwards of real decoding cycles, split into the first after each verify forward (the update's encode of
the accepted path) and the later ones (the tree's), to see what the verify's 538 MB stream costs the draft in a cycle
(floor.py's sweep is a harsher stand-in: it also evicts code and the interpreter's data, which a verify keeps warm).
`jakiro` (8-token decoupled trees) on the default profile's drafts, MT-bench q1-5 first turns, 64 new tokens, T=0,
greedy, as the cycle-cost table decodes them (after one warm-up generation).

    python reports/measured/2026-11-29-cycle-floor-cpu/first.py --run-dir runs/default \
        --out reports/measured/2026-11-29-cycle-floor-cpu

Writes first.csv (which forwards, how many, median and mean us) and first_config.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.decoding import runner, static_tree
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.study.context import resolve_profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--method", default="jakiro")
    ap.add_argument("--limit", type=int, default=5)
    args = ap.parse_args()
    profile = resolve_profile("default", {"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    spec = cycle_methods(profile, args.run_dir, target, [args.method])[args.method]
    draft = spec.load_draft(target)
    prompts = cycle_prompts(profile, target, args.limit)
    after_verify = {"now": False}
    times: dict[str, list[float]] = {"first after a verify": [], "later": []}
    forward, score = static_tree.StaticTreeDrafter._forward, runner.TargetRunner.score

    def timed_forward(self, *a, **k):
        t0 = time.perf_counter()
        out = forward(self, *a, **k)
        times["first after a verify" if after_verify["now"] else "later"].append((time.perf_counter() - t0) * 1e6)
        after_verify["now"] = False
        return out

    def marked_score(self, *a, **k):
        out = score(self, *a, **k)
        after_verify["now"] = True
        return out

    static_tree.StaticTreeDrafter._forward, runner.TargetRunner.score = timed_forward, marked_score
    _generate(target, draft, spec, prompts[0], 8, None)  # warm-up
    for v in times.values():
        v.clear()
    for ids in prompts:
        _generate(target, draft, spec, ids, 64, None)
    rows = [{"forwards": k, "count": len(v), "median_us": round(statistics.median(v), 1),
             "mean_us": round(statistics.fmean(v), 1)} for k, v in times.items()]
    frame = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "first.csv", index=False)
    config = {"method": args.method, "limit": args.limit, "draft": spec.draft, "draft_dtype": spec.draft_dtype,
              "threads": torch.get_num_threads(), **run_metadata()}
    (args.out / "first_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    print(frame.to_string(index=False))


if __name__ == "__main__":
    main()
