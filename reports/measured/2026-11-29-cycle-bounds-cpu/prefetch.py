"""The streaming GEMM alone over the default target's linear shapes (30 layers of q, k, v, o, gate, up, down and the
tied head, random fp32 weights, 538 MB), at 1 and 8 rows, built with other software-prefetch distances: 1, 2 (the
package's) or 4 KB ahead on each panel's stream, or 6, 12 or 24 KB ahead in all, split over the panels a block streams.
Each variant is the package's jakiro_lib/models/stream_gemm.cpp with that one line changed, compiled as its own op.

    python reports/measured/2026-11-29-cycle-bounds-cpu/prefetch.py --out reports/measured/2026-11-29-cycle-bounds-cpu

Writes prefetch.csv: per variant the median ms of all the linears at 1 and 8 rows, their ratio and the 1-row rate.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from torch.utils.cpp_extension import load

from jakiro_lib.models.kernels import STREAM_FLAGS, STREAM_SOURCE

LINE = "  constexpr int64_t ahead = 2048 / (L * sizeof(W));  // k steps: 2 KB ahead on each panel's stream"
VARIANTS = {"1KB_each": "1024 / (L * sizeof(W))", "2KB_each": "2048 / (L * sizeof(W))",
            "4KB_each": "4096 / (L * sizeof(W))", "6KB_all": "6144 / NB / (L * sizeof(W))",
            "12KB_all": "12288 / NB / (L * sizeof(W))", "24KB_all": "24576 / NB / (L * sizeof(W))"}
SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]


def build(name: str, expr: str, folder: Path):
    source = STREAM_SOURCE.read_text()
    assert LINE in source, "the prefetch line changed: update this script"
    source = source.replace(LINE, f"  constexpr int64_t ahead = {expr};").replace(
        "jakiro_stream_gemm", f"prefetch_{name}")
    path = folder / f"prefetch_{name}.cpp"
    path.write_text(source)
    load(name=f"prefetch_{name}", sources=[str(path)], extra_cflags=list(STREAM_FLAGS), is_python_module=False,
         build_directory=str(folder))
    return getattr(torch.ops, f"prefetch_{name}")


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.manual_seed(0)
    folder = Path(tempfile.mkdtemp(prefix="prefetch_"))
    ops = {name: build(name, expr, folder) for name, expr in VARIANTS.items()}
    weights = [torch.randn(s) * 0.02 for s in SHAPES]
    nbytes = sum(w.numel() * 4 for w in weights)
    packed = {n: [op.pack(w, False) for w in weights] for n, op in ops.items()}
    xs = {m: {k: torch.randn(m, k) for k in (576, 1536)} for m in (1, 8)}

    def run(name: str, m: int) -> None:
        for w, p in zip(weights, packed[name]):
            ops[name].linear(xs[m][w.shape[1]], p, w.shape[0])

    times = {(n, m): [] for n in ops for m in (1, 8)}
    for _ in range(args.rounds):  # rounds interleave the variants and row counts
        for n in ops:
            for m in (1, 8):
                run(n, m)
                t0 = time.perf_counter()
                run(n, m)
                times[(n, m)].append(time.perf_counter() - t0)
    rows = []
    for n in ops:
        one, eight = (1e3 * statistics.median(times[(n, m)]) for m in (1, 8))
        rows.append({"variant": n, "ms_1": round(one, 2), "ms_8": round(eight, 2), "x1_8": round(eight / one, 3),
                     "gb_per_s_1": round(nbytes / one / 1e6, 1)})
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "prefetch.csv", index=False)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
