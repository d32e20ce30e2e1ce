"""The draft's tree eager (`target.capture="none"`) against compiled (`"draft"`, the default profile's before it) on
the main study's drafts and tuned trees, side by side in one process: each prompt every way, the order turning prompt
by prompt, ``--repeats`` repeats; tokens/s of the eager tree over the compiled one with 95% paired bootstrap intervals
(`jakiro_lib.measure.summary.ratio_interval`), tau, outputs against vanilla's, and each tree's first (compiling) call.

    python reports/measured/2026-12-01-eager-main5000-cpu-zen5/ab.py --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 --out reports/measured/2026-12-01-eager-main5000-cpu-zen5
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.files import write_table
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models.target import load_target, set_capture
from jakiro_lib.profiles import get_profile

METHODS = ("eagle2_auto", "jakiro_auto", "eagle2", "jakiro", "jakiro_cepd", "jakiro_lookup")
WAYS = ("compiled", "eager")
CAPTURE = {"compiled": "draft", "eager": "none"}


def record(prompt: int, rep: int, r, vanilla: list[int]) -> dict:
    """What ratio_interval reads of a generation, and whether it equals vanilla's."""
    return {"benchmark": "mt_bench", "question_id": prompt, "turn": 1, "repeat": rep, "cycles": r.cycles,
            "accepted": list(r.accepted), "tokens_per_second": len(r.output_ids) / (r.wall_time - r.prefill_time),
            "equal": r.output_ids == vanilla}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="profile overrides, key=value (ints)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    overrides = {k: int(v) for k, v in (s.split("=", 1) for s in args.set)}
    profile = get_profile("default", **overrides)
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, ["vanilla", *METHODS])
    drafts = {name: spec.load_draft(target) for name, spec in methods.items()}
    prompts = cycle_prompts(profile, target, args.prompts)
    first_call = {}
    for name in METHODS:  # warm-up: kernels loaded, each tree's graph compiled (its first call timed)
        for w in WAYS:
            set_capture(target.model, CAPTURE[w])
            t0 = time.perf_counter()
            _generate(target, drafts[name], methods[name], prompts[0], 16, None)
            first_call[f"{name} {w}"] = time.perf_counter() - t0
            _generate(target, drafts[name], methods[name], prompts[0], 16, None)
    print({k: round(v, 2) for k, v in first_call.items()}, flush=True)
    runs = {(n, w): [] for n in METHODS for w in WAYS}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            set_capture(target.model, "none")
            vanilla = _generate(target, None, methods["vanilla"], ids, 64, None).output_ids
            for name in METHODS:
                turn = (i + rep) % len(WAYS)
                for w in WAYS[turn:] + WAYS[:turn]:
                    set_capture(target.model, CAPTURE[w])
                    r = _generate(target, drafts[name], methods[name], ids, 64, None)
                    runs[(name, w)].append(record(i, rep, r, vanilla))
    rows = []
    for name in METHODS:
        eager, compiled = runs[(name, "eager")], runs[(name, "compiled")]
        lo, hi = ratio_interval(eager, compiled)
        tlo, thi = ratio_interval(eager, compiled, measure="tau")
        rows.append({"method": name, "tree": methods[name].tree.total_tokens,
                     "eager_over_compiled": statistics.fmean(r["tokens_per_second"] for r in eager)
                     / statistics.fmean(r["tokens_per_second"] for r in compiled),
                     "lo": lo, "hi": hi, "tau_lo": tlo, "tau_hi": thi,
                     "eager_tokens_per_s": statistics.fmean(r["tokens_per_second"] for r in eager),
                     "compiled_tokens_per_s": statistics.fmean(r["tokens_per_second"] for r in compiled),
                     "eager_equal_vanilla": f"{sum(r['equal'] for r in eager)}/{len(eager)}",
                     "compiled_equal_vanilla": f"{sum(r['equal'] for r in compiled)}/{len(compiled)}",
                     "first_call_s_compiled": first_call[f"{name} compiled"],
                     "first_call_s_eager": first_call[f"{name} eager"]})
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_table(args.out / "ab.csv", pd.DataFrame(rows))
    trees = {n: {k: getattr(methods[n].tree, k) for k in ("depth", "top_k", "total_tokens", "lookup_tokens")}
             for n in METHODS}
    (args.out / "ab_config.json").write_text(json.dumps({
        "run_dir": str(args.run_dir), "overrides": overrides, "prompts": len(prompts), "repeats": args.repeats,
        "trees": trees, "environment": run_metadata(target.device)}, indent=2, default=str))


if __name__ == "__main__":
    main()
