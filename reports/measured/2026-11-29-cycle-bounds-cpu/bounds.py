"""What the default target's verify forward over n tokens cannot cost less than on this machine, beside what it costs:
the machine's read bandwidth and fp32 FMA throughput measured here, the lower bounds they set on the target's linears
(their weights read once: bytes / bandwidth; their multiply-adds: 2 x parameters x n / peak), and T(n) measured on the
GEMM the load-time probe chose, split by the torch profiler into the linears, attention and everything else.

    python reports/measured/2026-11-29-cycle-bounds-cpu/bounds.py --out reports/measured/2026-11-29-cycle-bounds-cpu

Writes bounds.csv (per n: T(n) and its split, the bounds, each as ms and as a multiple of T(1)), machine.json (the
bandwidth and peak measurements) and bounds_config.json (machine, versions, the probe's choice).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from jakiro_lib.decoding.static import TargetRunner, engine_cache_len
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import _time_once, bushy_tree
from jakiro_lib.models import kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

ROWS = (1, 2, 4, 8, 16, 32)
CONTEXT = 256
GEMM_OPS = ("jakiro_stream_gemm::linear", "aten::mm", "aten::addmm", "aten::bmm", "mkl_", "onednn", "mkldnn")
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "_efficient_attention")


def seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def machine_bounds(repeats: int) -> dict[str, float]:
    """Read bandwidth (a 1 GiB fp32 sum over every thread: twice the L3 of the largest CPUs here) and fp32 FMA
    throughput (MKL's sgemm on 2048 x 2048 matrices, near the cores' peak)."""
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB
    read_s = seconds(lambda: big.sum(), repeats)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    mm_s = seconds(lambda: torch.mm(a, b), repeats)
    return {"read_gb_per_s": big.numel() * 4 / read_s / 1e9, "sgemm_gflop_per_s": 2 * 2048 ** 3 / mm_s / 1e9,
            "threads": torch.get_num_threads()}


def linear_weights(model: nn.Module) -> tuple[int, int]:
    """Parameters and bytes the forward's linears read (the tied head counted once, as it is read once)."""
    seen, params = set(), 0
    for m in model.modules():
        if isinstance(m, nn.Linear) and id(m.weight) not in seen:
            seen.add(id(m.weight))
            params += m.weight.numel()
    return params, params * 4


def split(profile: torch.profiler.profile, calls: int) -> dict[str, float]:
    """Self CPU milliseconds per call of the forward: GEMMs, attention, the rest."""
    parts: dict[str, float] = defaultdict(float)
    for e in profile.key_averages():
        kind = "gemm" if any(k in e.key for k in GEMM_OPS) else \
            "attention" if any(k in e.key for k in ATTENTION_OPS) else "other"
        parts[kind] += e.self_cpu_time_total / 1e3 / calls
    return dict(parts)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--profiled", type=int, default=5, help="profiled forwards per row count")
    args = ap.parse_args()
    bounds = machine_bounds(repeats=7)
    print(bounds, flush=True)
    target = load_target(get_profile("default").target)  # packed_gemm=64, gemm_backend="auto": the probe runs
    model = target.model
    gemm = kernels.packed_gemm(model)
    params, nbytes = linear_weights(model)
    runner = TargetRunner(model, engine_cache_len(CONTEXT + max(ROWS)))
    prompt = torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=torch.Generator().manual_seed(0))
    runner.prefill(prompt)
    start = torch.full((), CONTEXT)
    trees = {n: bushy_tree(n, runner.device) for n in ROWS}

    def verify(n: int) -> None:
        tokens, depths, anc = trees[n]
        runner.where.window = CONTEXT + n
        runner.score(tokens, depths, anc if n > 1 else None, start)

    times: dict[int, list[float]] = {n: [] for n in ROWS}
    for round_ in range(args.rounds + 1):  # the first round warms up
        for n in ROWS:
            verify(n)
            s = _time_once(lambda: verify(n), runner.device)
            if round_:
                times[n].append(s)
        print(f"round {round_}/{args.rounds}", flush=True)
    parts = {}
    for n in ROWS:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.profiled):
                verify(n)
        parts[n] = split(prof, args.profiled)
    read_ms = 1e3 * nbytes / (bounds["read_gb_per_s"] * 1e9)
    rows = []
    t1 = 1e3 * statistics.median(times[1])
    for n in ROWS:
        t = 1e3 * statistics.median(times[n])
        p = parts[n]
        profiled = sum(p.values())
        compute_ms = 1e3 * 2 * params * n / (bounds["sgemm_gflop_per_s"] * 1e9)
        rows.append({"n": n, "ms": round(t, 2), "x1": round(t / t1, 3),
                     # the profiler's split, scaled to the unprofiled time (the profiler adds a few us an operator)
                     "gemm_ms": round(t * p.get("gemm", 0) / profiled, 2),
                     "attention_ms": round(t * p.get("attention", 0) / profiled, 2),
                     "other_ms": round(t * p.get("other", 0) / profiled, 2),
                     "profiled_ms": round(profiled, 2),
                     "read_bound_ms": round(read_ms, 2), "compute_bound_ms": round(compute_ms, 2),
                     "linears_bound_ms": round(max(read_ms, compute_ms), 2),
                     "linears_bound_x1": round(max(read_ms, compute_ms) / t1, 3)})
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "bounds.csv", index=False)
    machine = {**bounds, "linear_params": params, "linear_bytes": nbytes}
    (args.out / "machine.json").write_text(json.dumps(machine, indent=2) + "\n")
    config = {"rows": ROWS, "context": CONTEXT, "rounds": args.rounds, "profiled": args.profiled,
              "gemm": None if gemm is None else {"backend": gemm.backend, "min_rows": gemm.min_rows},
              "threads": torch.get_num_threads(), **run_metadata()}
    (args.out / "bounds_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    print(json.dumps(machine, indent=2))
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
