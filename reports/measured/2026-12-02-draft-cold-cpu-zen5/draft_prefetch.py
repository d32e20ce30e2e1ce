"""The draft's tree with its weights prefetched further ahead where they are not streamed (the int8 linears' panels
and the draft head's screen: ``dist`` bytes ahead where the package prefetches 2 KB), built beside the package's
kernel, cold (one tree after a 256 MB write, 80 rounds, twice) and warm (20 trees a timing, 30 rounds), side by side,
the trees checked equal.

    python reports/measured/2026-12-02-draft-cold-cpu-zen5/draft_prefetch.py jakiro 8192
"""
import statistics
import sys

import torch

from common import build, drafter_after_generation, trees_side_by_side
from jakiro_lib.measure.paired import speed_ratio

LINEARS = "  constexpr int64_t ahead = 2048 / (L * sizeof(W));  // k steps: 2 KB ahead on each panel's stream"
SCREEN = "  constexpr int64_t ahead = Stream && M > 4 ? 192 : 32;"
name = sys.argv[1] if len(sys.argv) > 1 else "jakiro"
dist = int(sys.argv[2]) if len(sys.argv) > 2 else 8192
variant = build(f"coldpf{dist}", [
    (LINEARS, f"  constexpr int64_t ahead = (Stream ? 2048 : {dist}) / (L * sizeof(W));"),
    (SCREEN, f"  constexpr int64_t ahead = Stream && M > 4 ? 192 : Stream ? 32 : {dist // 64};")])
with torch.inference_mode():
    target, engine, d, base = drafter_after_generation(name)
    ops = {"package": torch.ops.jakiro_stream_gemm, "variant": variant}
    for cold in (True, False, True):
        r = trees_side_by_side(d, base, ops, cold, 80 if cold else 30)
        s = speed_ratio(r["package"], r["variant"])
        print(f"{name} {dist} B {'cold' if cold else 'warm'}: package {1e3 * statistics.median(r['package']):.3f} ms, "
              f"variant {1e3 * statistics.median(r['variant']):.3f} ms, speed {s[0]:.3f} [{s[1]:.3f}, {s[2]:.3f}]",
              flush=True)
