"""The target's 8-row verify forward timed back to back with the last (as the cycle table's T(n) is timed), after the
draft's tree (as a drafted cycle runs it), and after a buffer of the draft's weight bytes was written: the time the
draft's working set costs the verify through the shared cache. Each MT-bench first turn generated with Jakiro's
8-token tree first (64 tokens), then the three ways side by side (jakiro_lib.measure.paired).

    python reports/measured/2026-12-02-cycle-after-sampling-cpu-zen5/evict.py --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-02-cycle-after-sampling-cpu-zen5/evict.txt
"""
from __future__ import annotations

import statistics
import time

import torch

from after_generation import arguments, engine_after, load
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.measure.cycles import cycle_prompts
from jakiro_lib.measure.paired import paired_rounds, speed_ratio


def main() -> None:
    args = arguments(prompts=5, rounds=12)
    torch.set_grad_enabled(False)
    profile, target, spec, draft = load(args.run_dir, args.sets)
    weight_bytes = sum(t.numel() * t.element_size() for t in draft.state_dict().values())
    print(run_metadata(target.device))
    print(f"jakiro tree {spec.tree.depth=} {spec.tree.top_k=} {spec.tree.total_tokens=}; the draft's tensors "
          f"{weight_bytes / 1e6:.1f} MB as stored")
    tokens, depths, anc = bushy_tree(8, target.model.device)
    seconds: dict[str, list[float]] = {}
    for ids in cycle_prompts(profile, target, args.prompts):
        engine, base = engine_after(target, draft, spec, ids)
        drafter, runner = engine.drafter, engine.target
        touch = torch.empty(max(weight_bytes // 4, 1))

        def verify(_: int) -> float:
            engine._set_window(base + 1)
            t0 = time.perf_counter()
            runner.score(tokens, depths, anc, base + 1, greedy=True)
            return time.perf_counter() - t0

        def after_tree(i: int) -> float:
            engine._set_window(base)
            drafter.propose(base)
            return verify(i)

        def after_touch(i: int) -> float:
            touch.add_(1.0)
            return verify(i)

        got = paired_rounds({"alone": verify, "after_tree": after_tree, "after_touch": after_touch},
                            range(args.rounds), warmup=2)
        for way, xs in got.items():
            seconds.setdefault(way, []).extend(xs)
    alone = seconds["alone"]
    print(f"T(8) back to back {1e3 * statistics.fmean(alone):.3f} ms (mean of {len(alone)})")
    for way in ("after_tree", "after_touch"):
        ratio, low, high = speed_ratio(seconds[way], alone)  # > 1: the verify after `way` slower
        extra = 1e3 * (statistics.fmean(seconds[way]) - statistics.fmean(alone))
        print(f"{way}: {1e3 * statistics.fmean(seconds[way]):.3f} ms, {ratio:.3f}x the back-to-back time "
              f"[{low:.3f}, {high:.3f}], {extra:+.3f} ms")


if __name__ == "__main__":
    main()
