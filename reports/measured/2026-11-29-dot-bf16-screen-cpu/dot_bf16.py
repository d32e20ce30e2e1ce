"""The head's bf16 screen at 1-8 rows: the package's (bf16 weights widened in registers, fp32 FMAs) against a
prototype through avx512_bf16's vdpbf16ps (``dot_bf16.cpp``: rows rounded to bf16 too, two products per lane and
instruction). Interleaved calls, medians; needs a CPU with avx512_bf16 and a C++ compiler."""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import pandas as pd
import torch
from torch.utils.cpp_extension import load

from jakiro_lib.models import kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(2)
    flags = Path("/proc/cpuinfo").read_text()
    if "avx512_bf16" not in flags or not kernels.stream_gemm_available():
        raise SystemExit("needs avx512_bf16 and the package's streaming GEMM")
    proto = load("dot_bf16_proto", [str(Path(__file__).with_name("dot_bf16.cpp"))],
                 extra_cflags=["-O3", "-march=native"])
    w = load_target(get_profile("default").target).model.lm_head.weight.detach().contiguous()  # [V, K] fp32
    V, K = w.shape
    ours, pairs = torch.ops.jakiro_stream_gemm.pack(w, True), proto.pack_pairs(w)
    rows = []
    for M in (1, 2, 4, 8):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)) * 3
        exact = x.double() @ w.double().T
        calls = {"fp32_fma": lambda: torch.ops.jakiro_stream_gemm.linear(x, ours, V),
                 "vdpbf16ps": lambda: proto.screen(x, pairs)[:, :V]}
        err = {k: float((f().double() - exact).abs().max()) for k, f in calls.items()}
        times = {k: [] for k in calls}
        for _ in range(args.rounds):
            for k, f in calls.items():
                t = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    f()
                    t.append(time.perf_counter() - t0)
                times[k].append(statistics.median(t))
        ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        rows.append({"rows": M, "fp32_fma_ms": ms["fp32_fma"], "vdpbf16ps_ms": ms["vdpbf16ps"],
                     "ratio": ms["vdpbf16ps"] / ms["fp32_fma"], "fp32_fma_max_err": err["fp32_fma"],
                     "vdpbf16ps_max_err": err["vdpbf16ps"]})
        print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(out / "dot_bf16.csv", index=False)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    env = {"commit": commit, "torch": torch.__version__, "python": platform.python_version(),
           "cpu_model": next(l.split(":")[1].strip() for l in flags.splitlines() if l.startswith("model\t")),
           "amx": "amx_tile" in flags, "threads": torch.get_num_threads(), "head": [V, K],
           "rounds": args.rounds, "calls": args.calls, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (out / "dot_bf16_config.json").write_text(json.dumps(env, indent=2) + "\n")


if __name__ == "__main__":
    main()
