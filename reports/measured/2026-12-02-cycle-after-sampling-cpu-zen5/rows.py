"""What the cycle table's T(8) times against what a cycle's verify scores, side by side (jakiro_lib.measure.paired):
after a 64-token Jakiro generation of each MT-bench first turn, the 8-row verify on the engine's runner over the text,
of the tree the draft drafts there ("drafted") and of the table's fixed bushy tree ("bushy"), and on a runner of its own
over random tokens of the same length with the bushy tree, as the table's T(n) is timed ("table"). Each timed call
follows an untimed one of the same way.

    python reports/measured/2026-12-02-cycle-after-sampling-cpu-zen5/rows.py --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-02-cycle-after-sampling-cpu-zen5/rows.txt
"""
from __future__ import annotations

import statistics
import time

import torch

from after_generation import arguments, engine_after, load
from jakiro_lib.decoding import static
from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.measure.cycles import cycle_prompts
from jakiro_lib.measure.paired import paired_rounds, speed_ratio


def main() -> None:
    args = arguments(prompts=10, rounds=15)
    torch.set_grad_enabled(False)
    profile, target, spec, draft = load(args.run_dir, args.sets)
    print(run_metadata(target.device))
    bushy = bushy_tree(8, target.model.device)
    seconds: dict[str, list[float]] = {}
    for ids in cycle_prompts(profile, target, args.prompts):
        engine, base = engine_after(target, draft, spec, ids)
        engine._set_window(base)
        tokens, _, depths, _, anc = engine.drafter.propose(base)  # the tree drafted there
        drafted = (tokens, depths, anc)
        fresh = TargetRunner(target.model, static.engine_cache_len(base + 1 + 8))
        fresh.prefill(torch.randint(0, target.model.config.vocab_size, (base + 1,),
                                    generator=torch.Generator().manual_seed(0)).to(target.model.device))

        def timed(runner: TargetRunner, tree: tuple[torch.Tensor, ...]) -> float:
            runner.where.window = base + 1 + 8
            runner.score(tree[0], tree[1], tree[2], base + 1, greedy=True)  # the lead-in
            t0 = time.perf_counter()
            runner.score(tree[0], tree[1], tree[2], base + 1, greedy=True)
            return time.perf_counter() - t0

        ways = {"drafted": lambda _: timed(engine.target, drafted), "bushy": lambda _: timed(engine.target, bushy),
                "table": lambda _: timed(fresh, bushy)}
        for way, xs in paired_rounds(ways, range(args.rounds), warmup=1).items():
            seconds.setdefault(way, []).extend(xs)
    base_way = seconds["drafted"]
    print(f"drafted tree on the engine's runner: {1e3 * statistics.fmean(base_way):.3f} ms (mean of {len(base_way)})")
    for way in ("bushy", "table"):
        ratio, low, high = speed_ratio(seconds[way], base_way)  # > 1: `way` slower than the drafted tree's verify
        print(f"{way}: {1e3 * statistics.fmean(seconds[way]):.3f} ms, {ratio:.3f}x the drafted tree's time "
              f"[{low:.3f}, {high:.3f}]")


if __name__ == "__main__":
    main()
