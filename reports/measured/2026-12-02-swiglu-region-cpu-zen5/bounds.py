"""What the default target's verify forward over n rows cannot cost less than on this machine, beside T(n): the
machine's read rate and fp32 multiply-add rate as the cycle-bounds record measures them (a 1 GiB sum over both
threads; MKL's sgemm on 2048 x 2048 matrices), the streaming GEMM's own multiply-add rate where no weight is read
from memory (32 rows through a 576 x 1536 weight kept in cache, repeated), and T(n) for the trees the cycle-cost table
verifies (``bushy_tree``, a 300-token prompt, greedy, interleaved rounds, medians). The bounds a forward's linears
cannot beat: reading their weights once (bytes / read rate) and their multiply-adds (2 x parameters x n / rate).

    python reports/measured/2026-12-02-swiglu-region-cpu-zen5/bounds.py > reports/measured/2026-12-02-swiglu-region-cpu-zen5/bounds.txt
"""
from __future__ import annotations

import importlib.util
import json
import statistics
import time
from pathlib import Path

import torch

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models import kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

_spec = importlib.util.spec_from_file_location(
    "cycle_bounds", Path(__file__).resolve().parents[1] / "2026-11-29-cycle-bounds-cpu" / "bounds.py")
cycle_bounds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cycle_bounds)

ROWS = (1, 8, 16, 32)
CONTEXT = 300


def kernel_fma_rate(rows: int = 32, repeats: int = 400) -> float:
    """GFLOP/s of the streaming GEMM on ``rows`` rows through a [1536, 576] weight that stays in cache."""
    ops = torch.ops.jakiro_stream_gemm
    w, x = torch.randn(1536, 576), torch.randn(rows, 576)
    packed = ops.pack(w)
    for _ in range(20):
        ops.linear(x, packed, 1536)
    t0 = time.perf_counter()
    for _ in range(repeats):
        ops.linear(x, packed, 1536)
    return 2 * rows * 576 * 1536 * repeats / (time.perf_counter() - t0) / 1e9


@torch.inference_mode()
def main(rounds: int = 30) -> None:
    print(run_metadata())
    target = load_target(get_profile("default").target)
    assert kernels.stream_gemm_available()
    machine = cycle_bounds.machine_bounds(repeats=7)
    machine["stream_gemm_gflop_per_s_32_rows_in_cache"] = kernel_fma_rate()
    params, nbytes = cycle_bounds.linear_weights(target.model)
    machine.update(linear_params=params, linear_bytes=nbytes)
    print(json.dumps(machine))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, target.model.config.vocab_size, (CONTEXT,), generator=g)
    trees = {n: bushy_tree(n, target.model.device) for n in ROWS}
    runner = TargetRunner(target.model, 512)
    runner.prefill(prompt)
    times: dict[int, list[float]] = {n: [] for n in ROWS}
    for round_ in range(rounds + 1):  # the first round warms up
        for n in ROWS:
            tokens, depths, anc = trees[n]
            t0 = time.perf_counter()
            runner.score(tokens, depths, anc if n > 1 else None, CONTEXT, greedy=True)
            if round_:
                times[n].append(time.perf_counter() - t0)
    t1 = statistics.median(times[1])
    read_ms = 1e3 * nbytes / (machine["read_gb_per_s"] * 1e9)
    print("| n | T(n) ms | T(n)/T(1) | weights' read ms | multiply-adds at sgemm's rate ms | at the kernel's ms |"
          " bound / T(1) |")
    print("|---|---|---|---|---|---|---|")
    for n in ROWS:
        t = statistics.median(times[n])
        sgemm_ms = 1e3 * 2 * params * n / (machine["sgemm_gflop_per_s"] * 1e9)
        kernel_ms = 1e3 * 2 * params * n / (machine["stream_gemm_gflop_per_s_32_rows_in_cache"] * 1e9)
        print(f"| {n} | {1e3 * t:.2f} | {t / t1:.3f} | {read_ms:.2f} | {sgemm_ms:.2f} | {kernel_ms:.2f} | "
              f"{max(read_ms, sgemm_ms) / (1e3 * t1):.3f} |")


if __name__ == "__main__":
    main()
