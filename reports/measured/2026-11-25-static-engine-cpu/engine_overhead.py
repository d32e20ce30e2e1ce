"""The static-shape engine against the loop engine on one CPU: the same drafts, trees and prompts, side by side.

Drafts are freshly initialised (seed 0) at the default profile's shapes (dense at the target's width, moe2;
draft vocabulary 8192): both engines then build the same trees and accept the same tokens (tests/test_static.py
checks it on trained tiny drafts; here the outputs are compared with vanilla's), so the time per cycle is the
engine's cost. Random drafts accept little, so tokens/s here is not what trained drafts give.

    python reports/measured/2026-11-25-static-engine-cpu/engine_overhead.py --out <dir> [--questions 10]

Engines: ``loop`` (decoding.speculative_generate), ``static`` (jakiro_lib.decoding.static, eager) and, for the
8-token EAGLE-2 tree only, ``static_compiled`` (the whole cycle through torch.compile: inductor here; about
3 minutes of compilation, in the warm-up). Writes cycles.csv (one row per prompt, method and engine) and
summary.csv.
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
from jakiro_lib.decoding.loop import speculative_generate, vanilla_generate
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.decoding.drafting import FeatureDrafter
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.models.target import load_target
from jakiro_lib.files import write_json
from jakiro_lib.machine import run_metadata


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--questions", type=int, default=10)
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
    trees = {"eagle2 (8 tokens)": ("dense", prof.tree), "jakiro (8 tokens)": ("moe2", dataclasses.replace(
        prof.tree, decoupled=True)), "eagle2 (2 tokens)": ("dense", dataclasses.replace(prof.tree, total_tokens=2)),
        "jakiro (2 tokens)": ("moe2", dataclasses.replace(prof.tree, total_tokens=2, decoupled=True))}
    questions = load_questions("mt_bench", limit=args.questions)
    prompts = [format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    n = args.max_new_tokens

    def run(engine: str, method: str, ids: torch.Tensor):
        name, tree = trees[method]
        if engine == "loop":
            return speculative_generate(target.model, FeatureDrafter(drafts[name], tree), ids, max_new_tokens=n,
                                        max_context=prof.target.max_context)
        return static_generate(target.model, drafts[name], tree, ids, max_new_tokens=n,
                               max_context=prof.target.max_context, compile=engine == "static_compiled")

    def engines(method: str) -> tuple[str, ...]:
        return ("loop", "static", "static_compiled") if method == "eagle2 (8 tokens)" else ("loop", "static")

    for method in trees:  # warm-up: allocator, kernels, packed head copies, the compilation
        for engine in engines(method):
            run(engine, method, prompts[0][:32])
    rows = []
    for i, ids in enumerate(prompts):
        ref = vanilla_generate(target.model, ids, max_new_tokens=n, max_context=prof.target.max_context)
        rows.append(dict(question=i + 1, method="vanilla", engine="loop", cycles=ref.cycles, tau=1.0,
                         wall_s=ref.wall_time, ms_per_cycle=1e3 * (ref.wall_time - ref.prefill_time) / ref.cycles,
                         tokens_per_s=ref.tokens_per_second, same_as_vanilla=True))
        for method in trees:
            order = engines(method) if i % 2 == 0 else engines(method)[::-1]  # alternate: drift cancels
            for engine in order:
                r = run(engine, method, ids)
                rows.append(dict(question=i + 1, method=method, engine=engine, cycles=r.cycles, tau=round(r.tau, 3),
                                 wall_s=r.wall_time, ms_per_cycle=1e3 * (r.wall_time - r.prefill_time) / r.cycles,
                                 tokens_per_s=r.tokens_per_second, same_as_vanilla=r.output_ids == ref.output_ids))
        print(f"question {i + 1}/{len(prompts)} done", flush=True)
    with (out / "cycles.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    summary = []
    for method in ["vanilla", *trees]:
        for engine in ("loop", "static", "static_compiled"):
            rs = [r for r in rows if r["method"] == method and r["engine"] == engine]
            if not rs:
                continue
            loop = [r for r in rows if r["method"] == method and r["engine"] == "loop"]
            ratio = [a["ms_per_cycle"] / b["ms_per_cycle"] for a, b in zip(loop, rs)]
            summary.append(dict(method=method, engine=engine, prompts=len(rs),
                                ms_per_cycle=round(statistics.median(r["ms_per_cycle"] for r in rs), 2),
                                loop_over_static_cycle_time=round(statistics.median(ratio), 3),
                                tau=round(sum(r["tau"] * r["cycles"] for r in rs) / sum(r["cycles"] for r in rs), 3),
                                tokens_per_s=round(sum(n for _ in rs) / sum(r["wall_s"] for r in rs), 2),
                                same_as_vanilla=f"{sum(r['same_as_vanilla'] for r in rs)}/{len(rs)}"))
    with (out / "summary.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(summary[0]))
        w.writeheader()
        w.writerows(summary)
    write_json(out / "environment.json", {**run_metadata(), "finished": time.strftime("%Y-%m-%d %H:%M:%S UTC",
                                                                                      time.gmtime())})
    for s in summary:
        print(s)


if __name__ == "__main__":
    main()
