"""How the draft's tree runs on a CPU, three ways side by side in one process: eager (`target.capture="none"`), the
tree compiled with inductor tracing the draft's Python step (`"draft"` as it was: `fused_step` declined inside a
compiled graph), and the tree compiled with the draft step's two kernel calls as extern calls in the graph (`"draft"`
now). The default main job's drafts decode MT-bench first turns greedily, each prompt every way, the order turning
prompt by prompt, two repeats: tokens/s of each compiled way over eager with 95% paired bootstrap intervals
(`jakiro_lib.measure.summary.ratio_interval`), tau the same, outputs against vanilla's.

    python reports/measured/2026-12-01-capture-cpu-zen5/ab.py --run-dir runs/default \\
        --out reports/measured/2026-12-01-capture-cpu-zen5
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.files import write_table
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models import draft_step
from jakiro_lib.models.target import load_target, set_capture
from jakiro_lib.profiles import get_profile

METHODS = ("eagle2_auto", "jakiro_auto", "eagle2", "jakiro", "jakiro_cepd", "jakiro_lookup")
WAYS = ("eager", "compiled, inductor's step", "compiled, kernel calls")
KERNEL_STEP = draft_step.fused_step


def declined_when_compiling(*args):
    """fused_step as it was: None inside a compiled graph (inductor then traces the Python step)."""
    return None if torch.compiler.is_compiling() else KERNEL_STEP(*args)


@contextlib.contextmanager
def way(target, name: str):
    set_capture(target.model, "none" if name == "eager" else "draft")
    draft_step.fused_step = declined_when_compiling if name == WAYS[1] else KERNEL_STEP
    try:
        yield
    finally:
        draft_step.fused_step = KERNEL_STEP


def record(prompt: int, rep: int, r, vanilla: list[int]) -> dict:
    """What ratio_interval reads of a generation, and whether it equals vanilla's."""
    return {"benchmark": "mt_bench", "question_id": prompt, "turn": 1, "repeat": rep, "cycles": r.cycles,
            "accepted": list(r.accepted), "tokens_per_second": len(r.output_ids) / (r.wall_time - r.prefill_time),
            "equal": r.output_ids == vanilla}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # two ways of one graph
    profile = get_profile("default", **{"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, ["vanilla", *METHODS])
    drafts = {name: spec.load_draft(target) for name, spec in methods.items()}
    prompts = cycle_prompts(profile, target, args.prompts)
    for name in METHODS:  # warm-up: kernels loaded, every way's graphs compiled
        for w in WAYS:
            with way(target, w):
                for _ in range(2):
                    _generate(target, drafts[name], methods[name], prompts[0], 16, None)
    runs = {(n, w): [] for n in METHODS for w in WAYS}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            with way(target, "eager"):
                vanilla = _generate(target, None, methods["vanilla"], ids, 64, None).output_ids
            for name in METHODS:
                turn = (i + rep) % len(WAYS)
                for w in WAYS[turn:] + WAYS[:turn]:
                    with way(target, w):
                        r = _generate(target, drafts[name], methods[name], ids, 64, None)
                    runs[(name, w)].append(record(i, rep, r, vanilla))
    rows = []
    for name in METHODS:
        eager = runs[(name, "eager")]
        for w in WAYS[1:]:
            rs = runs[(name, w)]
            lo, hi = ratio_interval(rs, eager)
            tlo, thi = ratio_interval(rs, eager, measure="tau")
            rows.append({"method": name, "way": w,
                         "speed_over_eager": statistics.fmean(r["tokens_per_second"] for r in rs)
                         / statistics.fmean(r["tokens_per_second"] for r in eager),
                         "speed_lo": lo, "speed_hi": hi, "tau_lo": tlo, "tau_hi": thi,
                         "tau": sum(sum(r["accepted"]) for r in rs) / sum(r["cycles"] for r in rs),
                         "equal_vanilla": f"{sum(r['equal'] for r in rs)}/{len(rs)}",
                         "eager_equal_vanilla": f"{sum(r['equal'] for r in eager)}/{len(eager)}"})
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_table(args.out / "ab.csv", pd.DataFrame(rows))
    (args.out / "ab_config.json").write_text(json.dumps({
        "run_dir": str(args.run_dir), "prompts": len(prompts), "repeats": args.repeats,
        "budgets": {n: methods[n].tree.total_tokens for n in METHODS},
        "environment": run_metadata(target.device)}, indent=2, default=str))


if __name__ == "__main__":
    main()
