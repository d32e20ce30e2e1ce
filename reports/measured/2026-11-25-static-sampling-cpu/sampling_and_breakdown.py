"""The static engine sampling (T=1) beside the loop engine, and its cycle taken apart by the profiler, on one CPU.

Drafts freshly initialised (seed 0) at the default profile's shapes, as in ../2026-11-25-static-engine-cpu/: they
accept almost nothing, so the time per cycle is the engines' cost (drafting, verification, the sampling walk).

    python reports/measured/2026-11-25-static-sampling-cpu/sampling_and_breakdown.py --out <dir> [--questions 10]

1. ``engines.csv``: per prompt, method (EAGLE-2 and Jakiro decoupled, 8-token trees) and engine (loop, static),
   T=1 top-p 1, one seed per prompt, engines alternated per prompt: milliseconds per cycle; ``summary.csv``: the
   medians and the per-prompt median ratio loop / static.
2. ``breakdown.csv``: :func:`jakiro_lib.measure.gpucheck.cycle_breakdown` on Jakiro's tree, the first ``--profiled``
   questions: eager at T=0 and T=1, compiled (inductor; minutes of compilation) at T=1.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import statistics
import time
from pathlib import Path

import torch

from jakiro_lib.data.chat import format_prompt_ids
from jakiro_lib.profiles import get_profile
from jakiro_lib.data.conversations import load_questions
from jakiro_lib.decoding.loop import speculative_generate
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.decoding.drafting import FeatureDrafter
from jakiro_lib.measure.gpucheck import cycle_breakdown
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.models.target import load_target
from jakiro_lib.files import write_json
from jakiro_lib.machine import run_metadata
from jakiro_lib.decoding.verify import SamplingParams


def write_csv(path: Path, rows: list[dict]) -> None:
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--questions", type=int, default=10)
    ap.add_argument("--profiled", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prof = get_profile("default")
    target = load_target(prof.target)
    drafts = {}
    for name in ("dense", "moe2"):
        torch.manual_seed(0)
        drafts[name] = DraftModel.build(prof.drafts[name], target.model).eval()
    trees = {"eagle2 (8 tokens)": ("dense", prof.tree),
             "jakiro (8 tokens)": ("moe2", dataclasses.replace(prof.tree, decoupled=True))}
    questions = load_questions("mt_bench", limit=args.questions)
    prompts = [format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    n, ctx = args.max_new_tokens, prof.target.max_context
    t1 = SamplingParams(temperature=1.0)

    def run(engine: str, method: str, ids: torch.Tensor, seed: int):
        name, tree = trees[method]
        gen = torch.Generator().manual_seed(seed)
        if engine == "loop":
            return speculative_generate(target.model, FeatureDrafter(drafts[name], tree), ids, max_new_tokens=n,
                                        max_context=ctx, params=t1, generator=gen)
        return static_generate(target.model, drafts[name], tree, ids, max_new_tokens=n, max_context=ctx, params=t1,
                               generator=gen)

    for method in trees:  # warm-up: allocator, kernels, packed head copies
        for engine in ("loop", "static"):
            run(engine, method, prompts[0][:32], 0)
    rows = []
    for i, ids in enumerate(prompts):
        for method in trees:
            for engine in (("loop", "static") if i % 2 == 0 else ("static", "loop")):  # drift cancels
                r = run(engine, method, ids, i)
                rows.append(dict(question=i + 1, method=method, engine=engine, cycles=r.cycles, tau=round(r.tau, 3),
                                 ms_per_cycle=round(1e3 * (r.wall_time - r.prefill_time) / r.cycles, 3),
                                 tokens=len(r.output_ids)))
        print(f"question {i + 1}/{len(prompts)} done", flush=True)
    write_csv(out / "engines.csv", rows)
    summary = []
    for method in trees:
        loop = [r for r in rows if r["method"] == method and r["engine"] == "loop"]
        static = [r for r in rows if r["method"] == method and r["engine"] == "static"]
        summary.append(dict(method=method, temperature=1.0, prompts=len(loop),
                            loop_ms_per_cycle=round(statistics.median(r["ms_per_cycle"] for r in loop), 2),
                            static_ms_per_cycle=round(statistics.median(r["ms_per_cycle"] for r in static), 2),
                            loop_over_static_cycle_time=round(statistics.median(
                                a["ms_per_cycle"] / b["ms_per_cycle"] for a, b in zip(loop, static)), 3),
                            tau_loop=round(statistics.fmean(r["tau"] for r in loop), 3),
                            tau_static=round(statistics.fmean(r["tau"] for r in static), 3)))
    write_csv(out / "summary.csv", summary)
    for s in summary:
        print(s, flush=True)
    name, tree = trees["jakiro (8 tokens)"]
    profiled = prompts[:args.profiled]
    breakdown = []
    for params, compile in ((SamplingParams(), False), (t1, False), (t1, True)):
        row = cycle_breakdown(target.model, drafts[name], tree, profiled, compile=compile, params=params,
                              max_new_tokens=n)
        breakdown.append({"temperature": params.temperature, **row})
        print(breakdown[-1], flush=True)
    write_csv(out / "breakdown.csv", breakdown)
    write_json(out / "environment.json", {**run_metadata(), "threads": torch.get_num_threads(),
                                          "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})


if __name__ == "__main__":
    main()
