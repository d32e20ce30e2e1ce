"""The draft's tree with its weights prefetched further ahead where they are not streamed (the int8 linears' panels
and the draft head's screen: ``dist`` bytes ahead where the package prefetches 2 KB), built beside the package's
kernel, cold (one tree after a 256 MB write, 80 rounds, twice) and warm (20 trees a timing, 30 rounds), side by side,
the trees checked equal.

    python reports/measured/2026-12-02-draft-cold-cpu-zen5/draft_prefetch.py jakiro 8192
"""
import statistics
import sys
import time

import torch

from common import build, drafter_after_generation
from jakiro_lib.measure.paired import paired_rounds, speed_ratio
from jakiro_lib.models import fast_paths
lin_old = "  constexpr int64_t ahead = 2048 / (L * sizeof(W));  // k steps: 2 KB ahead on each panel's stream"
scr_old = "  constexpr int64_t ahead = Stream && M > 4 ? 192 : 32;"
dist = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
variant = build(f"coldpf{dist}", [(lin_old, f"  constexpr int64_t ahead = (Stream ? 2048 : {dist}) / (L * sizeof(W));"),
                                  (scr_old, f"  constexpr int64_t ahead = Stream && M > 4 ? 192 : Stream ? 32 : {dist // 64};")])
name = sys.argv[1] if len(sys.argv) > 1 else "jakiro"
with torch.inference_mode():
    target, engine, d, base = drafter_after_generation(name)
    package = torch.ops.jakiro_stream_gemm
    ops = {"package": package, "variant": variant}
    big = torch.empty(64 * 2**20)
    first = []
    def tree(way, cold):
        torch.ops.__dict__["jakiro_stream_gemm"] = ops[way]
        fast_paths._kernels.clear()
        n = 1 if cold else 20
        if cold:
            big.add_(1.0)
        t0 = time.perf_counter()
        for _ in range(n):
            out = d.propose(base)
        s = (time.perf_counter() - t0) / n
        flat = [x.clone() for x in out if isinstance(x, torch.Tensor)]
        if not first:
            first.append(flat)
        assert all(torch.equal(a, b) for a, b in zip(flat, first[0])), way
        return s
    try:
        for cold in (True, False, True):
            r = paired_rounds({w: (lambda _, w=w: tree(w, cold)) for w in ops}, [None], repeats=80 if cold else 30)
            s = speed_ratio(r["package"], r["variant"])
            print(f"{name} {dist} B {'cold' if cold else 'warm'}: package {1e3*statistics.median(r['package']):.3f} ms, variant {1e3*statistics.median(r['variant']):.3f} ms, speed {s[0]:.3f} [{s[1]:.3f}, {s[2]:.3f}]", flush=True)
    finally:
        torch.ops.__dict__["jakiro_stream_gemm"] = package
        fast_paths._kernels.clear()
