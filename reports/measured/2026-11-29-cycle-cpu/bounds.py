"""What the CPU allows a verify forward of n rows: the memory and compute bounds measured here, and the target's
own linear layers timed alone at n rows on each GEMM kernel the package can use (plain MKL sgemm, MKL's packed
sgemm, oneDNN's reordered weight).

    python reports/measured/2026-11-29-cycle-cpu/bounds.py --out reports/measured/2026-11-29-cycle-cpu/bounds

Writes bounds.csv (one row per row count: the weights' bytes over the measured read bandwidth, the forward's
GEMM flops over the measured peak, the sum of the linears' best times and each kernel's sum) and
bounds_config.json (machine, versions). Medians of 15 timed calls after 3 warm-ups, one linear at a time on the
default profile's fp32 target (its weights, every layer).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from jakiro_lib.machine import run_metadata
from jakiro_lib.models.kernels import pack_weight, packed_gemm_available
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

ROWS = (1, 2, 4, 8, 16, 32)


def median_ms(fn, repeats: int = 15, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def kernels_for(weight: torch.Tensor, rows: int) -> dict[str, callable]:
    """Each GEMM the package can route ``rows`` rows through, as a call on a fixed input."""
    x = torch.randn(rows, weight.shape[1])
    out = {"plain": lambda: F.linear(x, weight)}
    if packed_gemm_available(weight, "mkl"):
        mkl = pack_weight(weight, max(ROWS), "mkl")
        out["mkl_packed"] = lambda: torch.ops.mkl._mkl_linear(x, mkl, weight, None, rows)
    if packed_gemm_available(weight, "onednn"):
        dnn = pack_weight(weight, max(ROWS), "onednn")
        out["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, dnn, None, "none", [], "")
    return out


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    target = load_target(get_profile("default").target)
    model = target.model
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gemm_params = sum(w.numel() for w in linears)  # the lm_head ties the embedding: counted once as a linear
    big = torch.randn(weight_bytes // 4)
    read_gbs = weight_bytes / 1e9 / (median_ms(lambda: big.sum(), repeats=9) / 1e3)
    a = torch.randn(2048, 2048)
    peak_gflops = 2 * 2048 ** 3 / 1e9 / (median_ms(lambda: a @ a, repeats=9) / 1e3)
    del big, a
    rows_out = []
    for n in ROWS:
        sums: dict[str, float] = {}
        best = 0.0
        for w in linears:
            times = {k: median_ms(fn) for k, fn in kernels_for(w, n).items()}
            for k, t in times.items():
                sums[k] = sums.get(k, 0.0) + t
            best += min(times.values())
        rows_out.append({"rows": n, "memory_bound_ms": weight_bytes / 1e6 / read_gbs,
                         "compute_bound_ms": 2 * n * gemm_params / 1e6 / peak_gflops, "linears_best_ms": best,
                         **{f"linears_{k}_ms": v for k, v in sums.items()}})
        print(rows_out[-1], flush=True)
    table = pd.DataFrame(rows_out)
    for col in [c for c in table.columns if c.startswith("linears_")]:
        table[col.replace("_ms", "_per_1row")] = table[col] / table[col].iloc[0]
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "bounds.csv", index=False)
    (args.out / "bounds_config.json").write_text(json.dumps({
        "weight_bytes": weight_bytes, "linear_params": gemm_params, "read_gb_per_s": read_gbs,
        "fp32_gemm_peak_gflops": peak_gflops, "rows": ROWS,
        "environment": run_metadata(target.device, threads=torch.get_num_threads())}, indent=2, default=str))
    print(table.round(3).to_string(index=False))
    print(f"read {read_gbs:.1f} GB/s, fp32 GEMM {peak_gflops:.0f} GFLOP/s, weights {weight_bytes / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
