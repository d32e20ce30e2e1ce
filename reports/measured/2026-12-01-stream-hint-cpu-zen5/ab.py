"""The streaming GEMM's prefetch hint for a target's weights, side by side in one process: the panels prefetched into
the caches as before ("kept", prefetcht0) or non-temporally ("streamed", prefetchnta; the draft's bf16 and int8 copies
kept either way), switched between generations by the kernel's temporary ``set_stream_hint`` (at the commit this
record names). The default main job's drafts decode MT-bench first turns greedily, each prompt both ways, the order
turning prompt by prompt and the methods' order with it, two repeats: tokens/s streamed over kept with 95% paired
bootstrap intervals (`jakiro_lib.measure.summary.ratio_interval`), tau, outputs against vanilla's; and after each
prompt T(1) and T(8) both ways at a 300-token context.

    python reports/measured/2026-12-01-stream-hint-cpu-zen5/ab.py --run-dir runs/default \\
        --out reports/measured/2026-12-01-stream-hint-cpu-zen5
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.files import write_table
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import measure_target_costs
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

METHODS = ("vanilla", "eagle2_auto", "jakiro_auto", "eagle2", "jakiro", "jakiro_cepd")
HINTS = ("kept", "streamed")


def hint(name: str) -> None:
    torch.ops.jakiro_stream_gemm.set_stream_hint(int(name == "streamed"))


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
    profile = get_profile("default", **{"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, list(METHODS))
    drafts = {name: spec.load_draft(target) for name, spec in methods.items()}
    prompts = cycle_prompts(profile, target, args.prompts)
    for name in METHODS:  # warm-up: kernels loaded, the trees compiled
        for h in HINTS:
            hint(h)
            _generate(target, drafts[name], methods[name], prompts[0], 16, None)
    runs = {(n, h): [] for n in METHODS for h in HINTS}
    tn = {(n, h): [] for n in (1, 8) for h in HINTS}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            hint("kept")
            vanilla = _generate(target, None, methods["vanilla"], ids, 64, None).output_ids
            turn = (i + rep) % 2
            for h in HINTS[turn:] + HINTS[:turn]:
                hint(h)
                order = METHODS if turn == 0 else METHODS[::-1]
                for name in order:
                    r = _generate(target, drafts[name], methods[name], ids, 64, None)
                    runs[(name, h)].append(record(i, rep, r, vanilla))
                for n, seconds in measure_target_costs(target.model, [1, 8], context=300, repeats=1,
                                                       greedy=True).items():
                    tn[(n, h)].append(seconds)
    hint("streamed")
    rows = []
    for name in METHODS:
        kept, streamed = runs[(name, "kept")], runs[(name, "streamed")]
        lo, hi = ratio_interval(streamed, kept)
        base = runs[("vanilla", "streamed")]
        plo, phi = ratio_interval(streamed, base)
        rows.append({"method": name,
                     "kept_tokens_per_second": statistics.fmean(r["tokens_per_second"] for r in kept),
                     "streamed_tokens_per_second": statistics.fmean(r["tokens_per_second"] for r in streamed),
                     "streamed_over_kept": statistics.fmean(r["tokens_per_second"] for r in streamed)
                     / statistics.fmean(r["tokens_per_second"] for r in kept), "lo": lo, "hi": hi,
                     "over_plain_streamed": statistics.fmean(r["tokens_per_second"] for r in streamed)
                     / statistics.fmean(r["tokens_per_second"] for r in base), "plain_lo": plo, "plain_hi": phi,
                     "tau_kept": sum(sum(r["accepted"]) for r in kept) / sum(r["cycles"] for r in kept),
                     "tau_streamed": sum(sum(r["accepted"]) for r in streamed) / sum(r["cycles"] for r in streamed),
                     "equal_vanilla": f"{sum(r['equal'] for r in kept + streamed)}/{len(kept + streamed)}"})
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    target_costs = [{"rows": n, "hint": h, "median_ms": 1e3 * statistics.median(tn[(n, h)]),
                     "rounds": len(tn[(n, h)])} for n in (1, 8) for h in HINTS]
    for row in target_costs:
        print(row, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_table(args.out / "ab.csv", pd.DataFrame(rows))
    write_table(args.out / "target_costs.csv", pd.DataFrame(target_costs))
    write_table(args.out / "runs.csv", pd.DataFrame([{"method": n, "hint": h, **r} for (n, h), rs in runs.items()
                                                      for r in rs]))
    (args.out / "ab_config.json").write_text(json.dumps({
        "run_dir": str(args.run_dir), "prompts": len(prompts), "repeats": args.repeats, "max_new_tokens": 64,
        "trees": {n: str(methods[n].tree) for n in METHODS[1:]},
        "environment": run_metadata(target.device)}, indent=2, default=str))


if __name__ == "__main__":
    main()
