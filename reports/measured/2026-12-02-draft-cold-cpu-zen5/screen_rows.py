"""The integer screen's sums at each row count, the kernel file at ``--base`` (built beside the package's, an op
namespace of its own) against the package's: a draft head's logits (``int8_linear``, 8192 x 576, kept in cache) and
the default target's greedy argmax through its head's screen (``greedy_head``, 49152 x 576, streamed), each checked
equal bit for bit, then warm side by side (measure.paired, 10 rounds).

    python reports/measured/2026-12-02-draft-cold-cpu-zen5/screen_rows.py --base 71b4a1d
"""
import argparse
import time

import torch

from common import side_by_side
from jakiro_lib.measure.paired import paired_rounds, speed_ratio
from jakiro_lib.models import fast_paths
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

ap = argparse.ArgumentParser()
ap.add_argument("--base", default="71b4a1d")
args = ap.parse_args()
ops = side_by_side(args.base)


def compare(label: str, call, calls: int) -> None:
    outs = [call(op) for op in ops.values()]
    assert torch.equal(outs[0], outs[1]), label

    def seconds(op) -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            call(op)
        return (time.perf_counter() - t0) / calls
    r = paired_rounds({name: (lambda _, op=op: seconds(op)) for name, op in ops.items()}, [None], repeats=10)
    s = speed_ratio(r["base"], r["package"])
    print(f"{label}: equal; base {1e6 * min(r['base']):.1f} us, package {1e6 * min(r['package']):.1f} us (fastest "
          f"rounds), speed {s[0]:.3f} [{s[1]:.3f}, {s[2]:.3f}]", flush=True)


g = torch.Generator().manual_seed(0)
screen, scales = ops["package"].pack_int8(torch.randn(8192, 576, generator=g) * 0.05, True)
for rows in (1, 2, 3, 4, 6, 8, 12):
    x = torch.randn(rows, 576, generator=g) * 3
    compare(f"draft head int8_linear, {rows} rows", lambda op: op.int8_linear(x, screen, scales, 8192), 200)
target = load_target(get_profile("default").target)
head, W = fast_paths.current_screen(target.model), target.model.lm_head.weight
emb = target.model.get_input_embeddings().weight
for rows in (1, 2, 4, 6, 8):
    x = emb[torch.randint(0, emb.shape[0], (rows,), generator=g)] * 30
    compare(f"target greedy_head, {rows} rows", lambda op: op.greedy_head(x, *head, W), 30)
