"""One drafted tree (the eager engine's propose after a 64-token generation), the kernel file at ``--base`` against
the package's, swapped in by name, warm (20 trees a timing, 30 rounds) and cold (one tree after a 256 MB write, 60
rounds), side by side (measure.paired), the trees checked equal.

    python reports/measured/2026-12-02-draft-cold-cpu-zen5/tree_ab.py --base 71b4a1d jakiro eagle2
"""
import argparse
import statistics

import torch

from common import drafter_after_generation, kernel_at, trees_side_by_side
from jakiro_lib.measure.paired import speed_ratio

ap = argparse.ArgumentParser()
ap.add_argument("--base", default="71b4a1d")
ap.add_argument("methods", nargs="*", default=["jakiro", "eagle2"])
args = ap.parse_args()
base_ops = kernel_at(args.base, "base_gemm")
for name in args.methods:
    with torch.inference_mode():
        target, engine, d, base = drafter_after_generation(name)
        ops = {"base": base_ops, "package": torch.ops.jakiro_stream_gemm}
        for cold in (False, True):
            r = trees_side_by_side(d, base, ops, cold, 60 if cold else 30)
            s = speed_ratio(r["base"], r["package"])
            print(f"{name} {'cold' if cold else 'warm'}: base {1e3 * statistics.median(r['base']):.3f} ms, "
                  f"package {1e3 * statistics.median(r['package']):.3f} ms, speed {s[0]:.3f} [{s[1]:.3f}, "
                  f"{s[2]:.3f}]", flush=True)
