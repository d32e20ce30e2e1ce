"""Where the verify forward's extra rows go, as an eager greedy cycle runs it today: T(n) of the default target over an
n-token bushy tree at a host position (the lean forward, the screened greedy head), split by the torch profiler into
the layers' linears (the streaming GEMM), the greedy head (its screen and exact words), attention and the rest, each
part's rise over one row beside the machine's bounds for the linears' multiply-adds.

    python reports/measured/2026-11-29-verify-split-cpu/split.py --out reports/measured/2026-11-29-verify-split-cpu

Writes split.csv (per n: T(n), its parts in ms and each part's rise over n = 1) and split_config.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.decoding.static import engine_cache_len
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import _time_once, bushy_tree
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

ROWS = (1, 2, 4, 8)
CONTEXT = 256
PARTS = {"linears": ("jakiro_stream_gemm::linear", "aten::mm", "aten::addmm"),
         "head": ("jakiro_stream_gemm::greedy_head", "jakiro_stream_gemm::argmax"),
         "attention": ("scaled_dot_product", "flash_attention")}


def part_of(key: str) -> str:
    return next((p for p, names in PARTS.items() if any(n in key for n in names)), "rest")


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--profiled", type=int, default=10, help="profiled forwards per row count")
    args = ap.parse_args()
    target = load_target(get_profile("default").target)
    model = target.model
    runner = TargetRunner(model, engine_cache_len(CONTEXT + max(ROWS)))
    runner.prefill(torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0)))
    trees = {n: bushy_tree(n, runner.device) for n in ROWS}

    def verify(n: int) -> None:  # as an eager greedy cycle: a host position, argmaxes asked for, one row unmasked
        tokens, depths, anc = trees[n]
        runner.score(tokens, depths, anc if n > 1 else None, CONTEXT, greedy=True)

    times: dict[int, list[float]] = {n: [] for n in ROWS}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for n in ROWS:
            s = _time_once(lambda: verify(n), runner.device)
            if round_:
                times[n].append(s)
    parts: dict[int, dict[str, float]] = {}
    for n in ROWS:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.profiled):
                verify(n)
        p: dict[str, float] = defaultdict(float)
        for e in prof.key_averages():
            p[part_of(e.key)] += e.self_cpu_time_total / 1e3 / args.profiled
        parts[n] = dict(p)
    rows = []
    for n in ROWS:
        t = 1e3 * statistics.median(times[n])
        profiled = sum(parts[n].values())
        row = {"n": n, "ms": round(t, 3), "x1": round(t / (1e3 * statistics.median(times[1])), 3),
               "profiled_ms": round(profiled, 3)}
        for part in (*PARTS, "rest"):  # the profiler's split, scaled to the unprofiled time
            row[f"{part}_ms"] = round(t * parts[n].get(part, 0.0) / profiled, 3)
        rows.append(row)
    for row in rows:
        for part in (*PARTS, "rest"):
            row[f"{part}_rise_ms"] = round(row[f"{part}_ms"] - rows[0][f"{part}_ms"], 3)
        row["rise_ms"] = round(row["ms"] - rows[0]["ms"], 3)
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "split.csv", index=False)
    print(table.to_string(index=False))
    config = {"rows": ROWS, "context": CONTEXT, "rounds": args.rounds, "profiled": args.profiled,
              "profile": get_profile("default").to_dict()["target"], "threads": torch.get_num_threads(),
              **run_metadata()}
    (args.out / "split_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
