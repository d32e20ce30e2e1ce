"""fp32 GEMM throughput on this CPU at a draft training step's shapes: torch's F.linear (MKL) and oneDNN.

    python reports/measured/2026-11-23-amd-epyc-2core/gemm_peak.py
"""
import statistics
import time

import torch
import torch.nn.functional as F

for m, k, n in [(3000, 576, 1536), (3000, 1536, 576), (3000, 576, 8192), (3000, 1152, 576), (576, 3000, 1536)]:
    x, w = torch.randn(m, k), torch.randn(n, k)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    fns = {"F.linear (MKL)": lambda: F.linear(x, w),
           "oneDNN": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}
    rates = {}
    for name, fn in fns.items():
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        rates[name] = round(2 * m * k * n / statistics.median(times) / 1e9, 1)
    print((m, k, n), rates, "GFLOP/s")
