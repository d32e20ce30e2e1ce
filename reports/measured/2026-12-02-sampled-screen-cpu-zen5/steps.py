"""A sampled step's verify forward (T=1) over 1 and 8 rows with each row's draw through the head's screen against the
same forward drawing from the full head's logits by inverse CDF, and the greedy forward beside them: one row a plain
step, eight an 8-token tree (``bushy_tree``) over a 300-token context, interleaved rounds in a shuffled order, medians.

    python reports/measured/2026-12-02-sampled-screen-cpu-zen5/steps.py > reports/measured/2026-12-02-sampled-screen-cpu-zen5/steps.txt
"""
from __future__ import annotations

import random
import statistics
import time

import torch

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.decoding.verify import SamplingParams
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models import fast_paths
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

CONTEXT, ROUNDS = 300, 60


@torch.inference_mode()
def main() -> None:
    target = load_target(get_profile("default").target)
    print(run_metadata(target.device))
    model = target.model
    g = torch.Generator().manual_seed(0)
    runner = TargetRunner(model, 512)
    runner.prefill(torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=g))
    trees = {n: bushy_tree(n, model.device) for n in (1, 8)}
    params, screened = SamplingParams(temperature=1.0), fast_paths.sampled_argmax
    ways = ("greedy", "screen", "full")
    times = {(n, w): [] for n in trees for w in ways}

    def step(n: int, way: str) -> float:
        tokens, depths, anc = trees[n]
        draw = None if way == "greedy" else (params, torch.rand(n, generator=g, dtype=torch.float64), True)
        fast_paths.sampled_argmax = screened if way == "screen" else (lambda *a: None)
        try:
            t0 = time.perf_counter()
            runner.score(tokens, depths, anc if n > 1 else None, CONTEXT, greedy=True, draw=draw)
            return time.perf_counter() - t0
        finally:
            fast_paths.sampled_argmax = screened

    rng = random.Random(0)
    for r in range(ROUNDS + 1):
        keys = [(n, w) for n in trees for w in ways]
        rng.shuffle(keys)
        for key in keys:
            t = step(*key)
            if r:  # the first round warms up
                times[key].append(t)
    for n in trees:
        med = {w: 1e3 * statistics.median(times[n, w]) for w in ways}
        ratio = statistics.median(f / s for f, s in zip(times[n, "full"], times[n, "screen"]))
        print(f"{n} row(s): greedy {med['greedy']:.2f} ms, sampled through the screen {med['screen']:.2f} ms, sampled "
              f"from the full head {med['full']:.2f} ms; full / screen, the median of {ROUNDS} paired rounds, "
              f"{ratio:.3f}")


if __name__ == "__main__":
    main()
