"""The operators whose time rises most from a one-row verify forward to an 8-token tree's, as an eager greedy cycle runs
them (a host position, argmaxes asked for, one row unmasked): torch profiler self time per forward, 20 profiled
forwards each after 5 unprofiled.

    python reports/measured/2026-11-29-verify-split-cpu/ops.py --out reports/measured/2026-11-29-verify-split-cpu

Writes ops.csv (operator, calls and ms per forward at 1 and 8 rows, the rise), every operator.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.decoding.static import engine_cache_len
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

CONTEXT = 256


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = load_target(get_profile("default").target).model
    runner = TargetRunner(model, engine_cache_len(CONTEXT + 8))
    runner.prefill(torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0)))
    per: dict[int, dict[str, tuple[float, float]]] = {}
    for n in (1, 8):
        tokens, depths, anc = bushy_tree(n, runner.device)

        def verify() -> None:
            runner.score(tokens, depths, anc if n > 1 else None, CONTEXT, greedy=True)

        for _ in range(5):
            verify()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                verify()
        per[n] = {e.key: (e.count / 20, e.self_cpu_time_total / 20 / 1e3) for e in prof.key_averages()}
    rows = [{"operator": k, "calls_1": per[1].get(k, (0, 0))[0], "ms_1": round(per[1].get(k, (0, 0))[1], 4),
             "calls_8": per[8].get(k, (0, 0))[0], "ms_8": round(per[8].get(k, (0, 0))[1], 4)}
            for k in set(per[1]) | set(per[8])]
    table = pd.DataFrame(rows)
    table["rise_ms"] = (table["ms_8"] - table["ms_1"]).round(4)
    table = table.sort_values("rise_ms", ascending=False)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "ops.csv", index=False)
    print(table.head(20).to_string(index=False))


if __name__ == "__main__":
    main()
