"""T(n), the default target's verify forward over an n-token tree on a 256-token cache, on each GEMM kernel the
package can route the target's linears through: plain (F.linear, MKL's sgemm), MKL's packed sgemm, oneDNN's
reordered weight, and the streaming kernel (jakiro_lib/models/stream_gemm.cpp); each packed copy serving every row
count from 1 to 64, and "auto", what the load-time probe chose.

    python reports/measured/2026-11-29-stream-gemm-cpu/target_costs.py --out reports/measured/2026-11-29-stream-gemm-cpu/target_costs

Rounds interleave the kernels (repacked at the start of each) and the row counts, so drift hits all alike; each
cell is the median over the rounds. Writes target_costs.csv (n, one column of ms per kernel, and each kernel's
T(n) / T(1)) and target_costs_config.json (machine, versions, the probe's choice).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.decoding.static import TargetRunner, engine_cache_len
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import _time_once, bushy_tree
from jakiro_lib.models import kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

ROWS = (1, 2, 4, 8, 16, 32)
CONTEXT = 256


def switch(model: torch.nn.Module, kernel: str, probed: tuple[str, int] | None) -> None:
    kernels.disable_packed_gemm(model)
    if kernel == "auto" and probed is not None:
        kernels.enable_packed_gemm(model, max_rows=64, backend=probed[0], min_rows=probed[1])
    elif kernel not in ("plain", "auto"):
        kernels.enable_packed_gemm(model, max_rows=64, backend=kernel, min_rows=1)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    target = load_target(get_profile("default").target)  # packed_gemm=64, gemm_backend="auto": the probe runs
    model = target.model
    gemm = kernels.packed_gemm(model)
    probed = (gemm.backend, gemm.min_rows) if gemm is not None else None
    probe = kernels.gemm_probe(model)
    names = ["plain"] + [b for b in kernels.BACKENDS if kernels.packed_gemm_available(model, b)] + ["auto"]
    runner = TargetRunner(model, engine_cache_len(CONTEXT + max(ROWS)))
    prompt = torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0))
    runner.prefill(prompt)
    start = torch.full((), CONTEXT)
    trees = {n: bushy_tree(n, runner.device) for n in ROWS}

    def verify(n: int) -> None:
        tokens, depths, anc = trees[n]
        runner.where.window = CONTEXT + n
        runner.score(tokens, depths, anc if n > 1 else None, start)

    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in ROWS} for k in names}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for kernel in names:
            switch(model, kernel, probed)
            for n in ROWS:
                verify(n)
                seconds = _time_once(lambda: verify(n), runner.device)
                if round_:
                    times[kernel][n].append(seconds)
        print(f"round {round_}/{args.rounds}", flush=True)
    table = pd.DataFrame({"n": ROWS})
    for kernel in names:
        ms = [1e3 * statistics.median(times[kernel][n]) for n in ROWS]
        table[f"{kernel}_ms"] = [round(x, 2) for x in ms]
        table[f"{kernel}_x1"] = [round(x / ms[0], 3) for x in ms]
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "target_costs.csv", index=False)
    config = {"rows": ROWS, "context": CONTEXT, "rounds": args.rounds, "kernels": names,
              "probe": {"choice": probed, "ratios": probe.ratios if probe else None},
              "threads": torch.get_num_threads(), **run_metadata()}
    (args.out / "target_costs_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
