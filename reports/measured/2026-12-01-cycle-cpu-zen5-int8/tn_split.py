"""T(n) of the default target taken apart at 1 and 8 rows: the decoder layers (`stream_gemm.decoder_layers`, one call)
and the greedy head (`greedy_head`: the int8 screen, then the exact logits of the candidates), by the profiler, each
T(n) timed as the cost model times it (`measure_target_costs`, context 300, 5 repeats), the row counts alternated,
three rounds; then the head's int8 screen alone (`int8_linear` over the head's copy, the screened logits) at 1-16 rows
after a 64 MB stream, 40 calls a count.

    python reports/measured/2026-12-01-cycle-cpu-zen5-int8/tn_split.py > reports/measured/2026-12-01-cycle-cpu-zen5-int8/tn_split.txt
"""
from __future__ import annotations

import statistics
import time

import torch

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import measure_target_costs
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile


def main() -> None:
    target = load_target(get_profile("default").target)
    print(run_metadata(target.device))
    measure_target_costs(target.model, [1, 8], context=300, repeats=2, greedy=True)  # warm-up
    parts: dict[int, list[tuple[float, float, float]]] = {1: [], 8: []}
    for _ in range(3):
        for n in (1, 8, 1, 8):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                t = measure_target_costs(target.model, [n], context=300, repeats=5, greedy=True)
            per_call = {e.key: e.self_cpu_time_total / e.count / 1e3 for e in prof.key_averages()}
            parts[n].append((1e3 * t[n], per_call.get("jakiro_stream_gemm::decoder_layers", 0.0),
                             per_call.get("jakiro_stream_gemm::greedy_head", 0.0)))
    for n, rows in parts.items():
        t, layers, head = (statistics.median(r[i] for r in rows) for i in range(3))
        print(f"T({n}) {t:.3f} ms: decoder layers {layers:.3f} ms, greedy head {head:.3f} ms, the rest {t - layers - head:.3f}")
    ops = torch.ops.jakiro_stream_gemm
    w = target.model.lm_head.weight.detach()
    screen, scales = ops.pack_int8(w, False)
    flush = torch.empty(16 * 2**20)
    for rows in (1, 3, 8, 16):
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)) * 0.5
        times = []
        for _ in range(40):
            flush.add_(1.0)
            t0 = time.perf_counter()
            ops.int8_linear(x, screen, scales, w.shape[0])
            times.append(time.perf_counter() - t0)
        print(f"head screen alone, {rows} rows, cold: {1e3 * statistics.median(times):.3f} ms")


if __name__ == "__main__":
    main()
