"""What leaves the draft cold between trees: one drafted tree (propose, after a 64-token generation) timed right after
each kind of work, 40 trees a way and round, three rounds (medians): nothing, the target's verify of an 8-token tree
(T(8)), the streaming GEMM over 512 MB of fp32 panels at eight rows (non-temporal prefetches), the head's screen at
eight rows, a 14 MB read, a 256 MB write; then the tree after the 256 MB write with the draft's tensors read first
(untimed) in a few ways, and after one untimed tree.

    python reports/measured/2026-12-02-draft-cold-cpu-zen5/evictors.py jakiro
"""
import statistics
import sys
import time

import torch

from common import drafter_after_generation
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models import draft_step, fast_paths

name = sys.argv[1] if len(sys.argv) > 1 else "jakiro"
ops = torch.ops.jakiro_stream_gemm
with torch.inference_mode():
    target, engine, d, base = drafter_after_generation(name)
    tokens, depths, anc = bushy_tree(8, torch.device("cpu"))
    packed = ops.pack(torch.randn(128 * 1024, 1024) * 0.01, False)  # 512 MB of panels
    x8, rows8 = torch.randn(8, 1024), torch.randn(8, target.model.config.hidden_size)
    read, big = torch.randn(14 * 2**20 // 4), torch.empty(64 * 2**20)
    panels = draft_step.step_panels(d.draft, (d.draft.attn.head_dim,))
    layer = [t for t in (*panels["qkv"], panels["o"], panels["router"], *panels["experts"])
             if isinstance(t, torch.Tensor)]
    head = list(d.draft.int8_head()[:2])

    def words(tensors: list) -> list:  # each tensor's bytes as fp32 words, for a parallel read (amax)
        flat = [t.reshape(-1).view(torch.uint8) for t in tensors]
        return [f[: f.numel() // 4 * 4].view(torch.float32) for f in flat]
    groups = {"layer": words(layer), "head": words(head), "cache": words([d.cache.k, d.cache.v])}
    print(f"{name}: the draft's layer {sum(w.numel() for w in groups['layer']) * 4 / 2**20:.2f} MB (int8 panels), "
          f"its head's int8 copy {sum(w.numel() for w in groups['head']) * 4 / 2**20:.2f} MB, its cache "
          f"{sum(w.numel() for w in groups['cache']) * 4 / 2**20:.2f} MB")

    def after_write(*names: str):
        def work() -> None:
            big.add_(1.0)
            for n in names:
                for w in groups[n]:
                    w.amax()
        return work
    ways = {
        "nothing": lambda: None,
        "verify T(8)": lambda: engine.target.score(tokens, depths, anc, base + 1, greedy=True),
        "stream 512 MB, 8 rows": lambda: ops.linear(x8, packed, 128 * 1024),
        "head screen, 8 rows": lambda: fast_paths.greedy_argmax(target.model, rows8),
        "read 14 MB": lambda: read.sum(),
        "write 256 MB": after_write(),
        "write, then layer+head+cache read": after_write("layer", "head", "cache"),
        "write, then layer read": after_write("layer"),
        "write, then head read": after_write("head"),
        "write, then one tree": lambda: (big.add_(1.0), d.propose(base)),
    }
    res: dict[str, list] = {k: [] for k in ways}
    for _ in range(3):
        for k, work in ways.items():
            trees, works = [], []
            for _ in range(40):
                t0 = time.perf_counter()
                work()
                t1 = time.perf_counter()
                d.propose(base)
                trees.append(time.perf_counter() - t1)
                works.append(t1 - t0)
            res[k].append((statistics.median(trees), statistics.median(works)))
    for k, v in res.items():
        print(f"{name} tree after {k:34s}: {' '.join(f'{1e3 * a:.3f}' for a, _ in v)} ms (the work "
              f"{1e3 * statistics.median(b for _, b in v):.2f} ms)", flush=True)
