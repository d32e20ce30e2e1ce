"""8-token trees of other shapes than the profile's (depth 4, 3 children a node) side by side, EAGLE-2's and Jakiro's
drafts of runs/main5000 (5000 x 4), eager trees as `cycles --set target.capture=none` runs them: MT-bench q1-10 first
turns, 64 new tokens, T=0, three rounds interleaved (the order turning by one each generation); tokens/s and tau of
each shape over the profile's, with the package's paired bootstrap over prompts (measure.summary.ratio_interval).

    python reports/measured/2026-12-01-tree-shapes-cpu-zen5/shapes.py --run-dir runs/main5000 > .../shapes.txt
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models.target import load_target, set_capture
from jakiro_lib.profiles import get_profile

SHAPES = ((4, 3), (3, 3), (3, 4), (2, 4), (5, 2))  # (depth, children a node); the profile's first
ROUNDS = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    args = ap.parse_args()
    profile = get_profile("default", **{"data.num_conversations": 5000, "train.epochs": 4})
    target = load_target(profile.target)
    set_capture(target.model, "none")
    print(json.dumps(run_metadata(target.device)))
    methods = cycle_methods(profile, args.run_dir, target, ["eagle2", "jakiro"])
    prompts = cycle_prompts(profile, target, 10)
    runs = {}
    for name in ("eagle2", "jakiro"):
        draft = methods[name].load_draft(target)
        for depth, k in SHAPES:
            tree = dataclasses.replace(methods[name].tree, depth=depth, top_k=k, total_tokens=8)
            runs[f"{name} d{depth} k{k}"] = (draft, dataclasses.replace(methods[name], tree=tree))
    runs["vanilla"] = (None, methods["vanilla"])
    for draft, spec in runs.values():  # first calls load kernels
        _generate(target, draft, spec, prompts[0], 8, None)
    records = {key: [] for key in runs}
    outputs: dict[tuple[int, int], set] = {}
    keys, turn = list(runs), 0
    for rnd in range(ROUNDS):
        for q, ids in enumerate(prompts):
            for key in keys[turn:] + keys[:turn]:
                r = _generate(target, *runs[key], ids, 64, None)
                records[key].append({"benchmark": "mt_bench", "question_id": q, "turn": 0, "repeat": rnd,
                                     "tokens_per_second": len(r.output_ids) / (r.wall_time - r.prefill_time),
                                     "accepted": r.accepted, "cycles": r.cycles})
                outputs.setdefault((rnd, q), set()).add(tuple(r.output_ids))
            turn = (turn + 1) % len(keys)
    print("greedy = vanilla on every generation:", all(len(v) == 1 for v in outputs.values()))
    for name in ("eagle2", "jakiro"):
        base = records[f"{name} d4 k3"]
        for depth, k in SHAPES:
            recs = records[f"{name} d{depth} k{k}"]
            speed, tau = (sum(r["tokens_per_second"] for r in recs) / len(recs),
                          sum(sum(r["accepted"]) for r in recs) / sum(r["cycles"] for r in recs))
            s_lo, s_hi = ratio_interval(recs, base)
            t_lo, t_hi = ratio_interval(recs, base, measure="tau")
            plain = ratio_interval(recs, records["vanilla"])
            print(f"{name} depth {depth} children {k}: {speed:.1f} tokens/s, tau {tau:.3f}; over the profile's shape: "
                  f"speed [{s_lo:.3f}, {s_hi:.3f}], tau [{t_lo:.3f}, {t_hi:.3f}]; over plain [{plain[0]:.3f}, {plain[1]:.3f}]")
    print(f"vanilla: {sum(r['tokens_per_second'] for r in records['vanilla']) / len(records['vanilla']):.1f} tokens/s")


if __name__ == "__main__":
    main()
