"""The verify forward (``TargetRunner.score``, greedy: each row's argmax) of n-token trees (``bushy_tree``: up to four
children a node) after a 300-token prompt, through the working tree's kernel file against the file at ``--old`` (built
under its own op namespace and swapped in, the ops ``fast_paths`` keeps looked up again), each n both ways a round in
a shuffled order, paired within rounds: medians and the median of the rounds' ratios with a 95% bootstrap interval.
Before timing: each n's argmaxes and features compared between the files (bit for bit), and each tree row's against
the same row scored as a plain step over its path.

    python reports/measured/2026-12-02-sixteen-rows-cpu-zen5/rows.py --old 664763a --rounds 30 \\
        > reports/measured/2026-12-02-sixteen-rows-cpu-zen5/rows.txt
"""
from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time
from pathlib import Path

import torch

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

# the layers record's way of building an earlier kernel file under its own namespace
_spec = importlib.util.spec_from_file_location(
    "layers_ab", Path(__file__).resolve().parents[1] / "2026-12-01-layers-raw-rows-cpu-zen5" / "ab.py")
layers_ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(layers_ab)

SIZES = (1, 4, 8, 9, 12, 16)
CONTEXT = 300


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the commit whose kernel file is the 'old' way")
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    t = load_target(get_profile("default").target)
    kernels.stream_gemm_available()
    layers_ab.build_old(args.old)
    ops = {"new": torch.ops.jakiro_stream_gemm, "old": getattr(torch.ops, layers_ab.OLD)}
    print(run_metadata(t.model.device))

    def use(name: str) -> None:
        torch.ops.__dict__["jakiro_stream_gemm"] = ops[name]
        fast_paths._kernels.clear()

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 49152, (CONTEXT,), generator=g)
    trees = {n: bushy_tree(n, t.model.device) for n in SIZES}
    with torch.inference_mode():
        runners = {}
        for name in ("old", "new"):
            use(name)
            r = TargetRunner(t.model, 512)
            r.prefill(prompt)
            runners[name] = r
        for n in SIZES:
            tokens, depths, anc = trees[n]
            got = {}
            for name in ("old", "new"):
                use(name)
                got[name] = runners[name].score(tokens, depths, anc if n > 1 else None, CONTEXT, greedy=True)
            same = all(torch.equal(a, b) for a, b in zip(got["old"], got["new"]))
            print(f"{n} rows: argmaxes and features equal between the files: {same}")
        use("new")
        r = runners["new"]
        tokens, depths, anc = trees[16]
        best, hidden = r.score(tokens, depths, anc, CONTEXT, greedy=True)
        plain = []
        for i in range(16):  # row i scored as the last of a plain block over its path (its ancestors, root first)
            path = anc[i].nonzero().flatten()
            b, h = r.score(tokens[path], torch.arange(len(path)), torch.ones(len(path), len(path), dtype=torch.bool)
                           .tril(), CONTEXT, greedy=True)
            plain.append(torch.equal(h[-1], hidden[i]) and int(b[-1]) == int(best[i]))
        print(f"16-row tree's rows equal their paths' last rows scored alone: {sum(plain)}/16")

        res = {(name, n): [] for name in ops for n in SIZES}
        rng = random.Random(0)
        for _ in range(args.rounds):
            for n in SIZES:
                tokens, depths, anc = trees[n]
                order = ["old", "new"]
                rng.shuffle(order)
                for name in order:
                    use(name)
                    t0 = time.perf_counter()
                    runners[name].score(tokens, depths, anc if n > 1 else None, CONTEXT, greedy=True)
                    res[name, n].append(time.perf_counter() - t0)
        use("new")
    for n in SIZES:
        ratios = [a / b for a, b in zip(res["old", n], res["new", n])]
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        print(f"T({n}) (medians of {args.rounds} rounds): old {statistics.median(res['old', n]) * 1e3:.3f} ms, "
              f"new {statistics.median(res['new', n]) * 1e3:.3f} ms, speed new/old {statistics.median(ratios):.3f} "
              f"[{boot[50]:.3f}, {boot[1949]:.3f}]", flush=True)


if __name__ == "__main__":
    main()
