"""A draft head's logits (int8_linear, 8192 x 576) with its rows' activations rounded to bytes (``bytes.diff`` applied
to the kernel file at ``--base``) against the kernel at ``--base`` (14-bit activations): the largest error against the
fp32 product, how often the top three words agree with the fp32 product's, and the op's time side by side (10 rounds).

    git apply reports/measured/2026-12-02-draft-cold-cpu-zen5/bytes.diff   # on 71b4a1d
    python reports/measured/2026-12-02-draft-cold-cpu-zen5/bytes_op.py --base 71b4a1d
    git checkout jakiro_lib/models/stream_gemm.cpp
"""
import argparse
import time

import torch

from common import side_by_side
from jakiro_lib.measure.paired import paired_rounds, speed_ratio

ap = argparse.ArgumentParser()
ap.add_argument("--base", default="71b4a1d")
args = ap.parse_args()
ops = side_by_side(args.base, "bytes")
g = torch.Generator().manual_seed(0)
W = torch.randn(8192, 576, generator=g) * 0.05
screen, scales = ops["bytes"].pack_int8(W, True)
for rows in (1, 2, 3, 6, 8, 12):
    x = torch.randn(rows, 576, generator=g) * 3
    x[:, 7] = 25.0  # an outlier feature, as hidden states have
    ref = x @ W.T
    out = {name: op.int8_linear(x, screen, scales, 8192) for name, op in ops.items()}
    err = {name: float((o - ref).abs().max()) for name, o in out.items()}
    top3 = {name: float((o.topk(3).indices == ref.topk(3).indices).float().mean()) for name, o in out.items()}

    def seconds(op) -> float:
        t0 = time.perf_counter()
        for _ in range(200):
            op.int8_linear(x, screen, scales, 8192)
        return (time.perf_counter() - t0) / 200
    r = paired_rounds({name: (lambda _, op=op: seconds(op)) for name, op in ops.items()}, [None], repeats=10)
    s = speed_ratio(r["base"], r["bytes"])
    print(f"{rows} rows: largest error base {err['base']:.3f}, bytes {err['bytes']:.3f} (logits' std "
          f"{float(ref.std()):.2f}); top three as fp32's base {top3['base']:.2f}, bytes {top3['bytes']:.2f}; base "
          f"{1e6 * min(r['base']):.1f} us, bytes {1e6 * min(r['bytes']):.1f} us, speed {s[0]:.3f} [{s[1]:.3f}, "
          f"{s[2]:.3f}]", flush=True)
