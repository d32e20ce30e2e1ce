"""One SmolLM2 layer's attention alone (9 query / 3 KV heads of 64, a 300-key cache), the package's kernel against
SDPA at 1, 4, 8, 12 and 16 rows (the rows past the first under an all-seen additive mask), hot cache, interleaved: 30
rounds of 20 calls each way, medians. ``--march haswell``: the kernel built for AVX2 (8-lane vectors, its own fold)
instead of the package's build for this CPU, as a stand-in for a CPU without AVX-512 (SDPA as torch dispatches it
here, or as ATEN_CPU_CAPABILITY=avx2 makes it).

    python reports/measured/2026-11-30-few-rows-attention-cpu/final/layer.py \
        --out reports/measured/2026-11-30-few-rows-attention-cpu/final [--march haswell]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from jakiro_lib.machine import run_metadata
from jakiro_lib.models import fast_paths, kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--march", default="native")
    args = ap.parse_args()
    if args.march == "native":
        assert kernels.stream_gemm_available(), "the package's kernels are not built here"
        attend = fast_paths.attend_rows
    else:  # the same source built for another instruction set (not the package's build: its op would clash)
        from torch.utils.cpp_extension import load
        load(name=f"attention_{args.march}", sources=[str(kernels.STREAM_SOURCE)], is_python_module=False,
             extra_cflags=["-O3", f"-march={args.march}", "-fopenmp"], extra_ldflags=["-fopenmp"])
        op = torch.ops.jakiro_stream_gemm.attend
        attend = lambda q, k, v, mask: op(q, k, v, mask, q.shape[-1] ** -0.5)  # noqa: E731
    heads, kv, D, S = 9, 3, 64, 300
    cache = torch.randn(2, kv, 2048, D, generator=torch.Generator().manual_seed(0))  # [keys and values, kv, cap, D]
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for n in (1, 4, 8, 12, 16):
            q = torch.randn(1, n, heads, D).transpose(1, 2)  # the projections' view
            k, v = cache[0:1, :, :S], cache[1:2, :, :S]
            mask = torch.zeros(1, 1, n, S) if n > 1 else None
            ways = {"kernel": lambda: attend(q, k, v, mask),
                    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                   enable_gqa=True).transpose(1, 2).contiguous()}
            times = {w: [] for w in ways}
            with torch.inference_mode():
                for _ in range(30):
                    for w, f in ways.items():
                        f()
                        t0 = time.perf_counter()
                        for _ in range(20):
                            f()
                        times[w].append((time.perf_counter() - t0) / 20 * 1e6)
            k_us, s_us = (statistics.median(times[w]) for w in ways)
            rows.append({"threads": threads, "rows": n, "kernel_us": k_us, "sdpa_us": s_us, "ratio": k_us / s_us})
    table = pd.DataFrame(rows)
    name = "layer" if args.march == "native" else f"layer_{args.march}"
    table.to_csv(args.out / f"{name}.csv", index=False)
    print(table.round(3).to_string(index=False))
    (args.out / f"{name}_config.json").write_text(json.dumps(
        {"march": args.march, "aten_cpu_capability": os.environ.get("ATEN_CPU_CAPABILITY"), "heads": heads, "kv_heads": kv, "head_dim": D, "keys": S, "rounds": 30, "calls": 20,
         "environment": run_metadata("cpu")}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
