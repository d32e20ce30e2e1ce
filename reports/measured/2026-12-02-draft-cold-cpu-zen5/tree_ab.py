"""One drafted tree (the eager engine's propose after a 64-token generation), the kernel file at ``--base`` against
the package's, swapped in by name, warm (20 trees a timing, 30 rounds) and cold (one tree after a 256 MB write, 60
rounds), side by side (measure.paired), the trees checked equal.

    python reports/measured/2026-12-02-draft-cold-cpu-zen5/tree_ab.py --base 71b4a1d jakiro eagle2
"""
import argparse
import statistics
import time

import torch

from common import drafter_after_generation, kernel_at
from jakiro_lib.measure.paired import paired_rounds, speed_ratio
from jakiro_lib.models import fast_paths

ap = argparse.ArgumentParser()
ap.add_argument("--base", default="71b4a1d")
ap.add_argument("methods", nargs="*", default=["jakiro", "eagle2"])
args = ap.parse_args()
base_ops = kernel_at(args.base, "base_gemm")
for name in args.methods:
    with torch.inference_mode():
        target, engine, d, base = drafter_after_generation(name)
        package = torch.ops.jakiro_stream_gemm
        ops = {"base": base_ops, "package": package}
        big = torch.empty(64 * 2**20)
        first: list = []

        def tree(way: str, cold: bool) -> float:
            torch.ops.__dict__["jakiro_stream_gemm"] = ops[way]
            fast_paths._kernels.clear()
            n = 1 if cold else 20
            if cold:
                big.add_(1.0)
            t0 = time.perf_counter()
            for _ in range(n):
                out = d.propose(base)
            seconds = (time.perf_counter() - t0) / n
            flat = [x.clone() for x in out if isinstance(x, torch.Tensor)]
            if not first:
                first.append(flat)
            assert all(torch.equal(a, b) for a, b in zip(flat, first[0])), way
            return seconds
        try:
            for cold in (False, True):
                r = paired_rounds({w: (lambda _, w=w: tree(w, cold)) for w in ops}, [None], repeats=60 if cold else 30)
                s = speed_ratio(r["base"], r["package"])
                print(f"{name} {'cold' if cold else 'warm'}: base {1e3 * statistics.median(r['base']):.3f} ms, "
                      f"package {1e3 * statistics.median(r['package']):.3f} ms, speed {s[0]:.3f} [{s[1]:.3f}, "
                      f"{s[2]:.3f}]", flush=True)
        finally:
            torch.ops.__dict__["jakiro_stream_gemm"] = package
            fast_paths._kernels.clear()
