"""The streamed head screen's prefetch distance past four rows (12 KB ahead where it was 2 KB): the kernel file at
``--base`` against the package's, the default target's greedy argmax at eight rows (warm, 12 rounds) and T(8) over a
300-token random context (the attention record's runner, 60 rounds), side by side, outputs checked equal.

    python reports/measured/2026-12-02-draft-cold-cpu-zen5/head_prefetch.py --base eb83cb4
"""
import argparse
import statistics
import time

import torch

from common import side_by_side
from kernel_build import forward_seconds, runner_over_context
from jakiro_lib.measure.paired import paired_rounds, speed_ratio
from jakiro_lib.models import fast_paths

ap = argparse.ArgumentParser()
ap.add_argument("--base", default="eb83cb4")
args = ap.parse_args()
ops = side_by_side(args.base)
target, runner, trees = runner_over_context(300)
screen, W = fast_paths.current_screen(target.model), target.model.lm_head.weight
emb = target.model.get_input_embeddings().weight
x = emb[torch.randint(0, emb.shape[0], (8,), generator=torch.Generator().manual_seed(0))] * 30
assert torch.equal(ops["base"].greedy_head(x, *screen, W), ops["package"].greedy_head(x, *screen, W))


def head(op) -> float:
    t0 = time.perf_counter()
    for _ in range(30):
        op.greedy_head(x, *screen, W)
    return (time.perf_counter() - t0) / 30


for label, r in (("greedy_head, 8 rows", paired_rounds({k: (lambda _, op=op: head(op)) for k, op in ops.items()},
                                                         [None], repeats=12)),
                 ("T(8), 300 keys", forward_seconds(ops, runner, trees, 300, 8, 60))):
    s = speed_ratio(r["base"], r["package"])
    print(f"{label}: base {1e3 * statistics.median(r['base']):.3f} ms, package {1e3 * statistics.median(r['package']):.3f} "
          f"ms, speed {s[0]:.3f} [{s[1]:.3f}, {s[2]:.3f}]", flush=True)
