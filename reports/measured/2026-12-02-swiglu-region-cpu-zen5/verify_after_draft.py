"""Where a drafted cycle's verify goes above T(8) timed alone: after one 64-token jakiro generation of an MT-bench first
turn has set the eager engine's root and caches (main5000 drafts), the engine's own 8-token tree (``propose``) verified
at the engine's length (``TargetRunner.score``, greedy, as the cycle calls it), timed four ways in interleaved rounds,
medians: repeated (warm); right after the draft's tree call (as in a cycle); right after the draft's tree call and the
accepted path's draft step (``extend`` of two rows, as a cycle's update does before the next verify); right after a
256 MB read. Then one row (plain decoding's verify) repeated and after the read; and, as the cycle-cost table times
T(n), a ``bushy_tree`` of 8 rows and one row on a cache of random tokens as long as the engine's context, in a runner
of their own.

    python reports/measured/2026-12-02-swiglu-region-cpu-zen5/verify_after_draft.py > reports/measured/2026-12-02-swiglu-region-cpu-zen5/verify_after_draft.txt
"""
import statistics
import time
from pathlib import Path

import torch

from jakiro_lib.decoding import static
from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.profiles import get_profile
from jakiro_lib.models.target import load_target

ROUNDS = 60
profile = get_profile("default", **{"data.num_conversations": 5000, "train.epochs": 4})
target = load_target(profile.target)
spec = cycle_methods(profile, Path("runs/main5000"), target, ["jakiro"])["jakiro"]
prompts = cycle_prompts(profile, target, 2)
draft = spec.load_draft(target)
grab = {}
advance = static.StaticEngine._advance


def grabbing(self, start, length, room):
    grab["engine"], grab["length"] = self, length
    return advance(self, start, length, room)


static.StaticEngine._advance = grabbing
big = torch.ones(64 * 2 ** 20)  # 256 MB
print(run_metadata(target.model.device))
with torch.inference_mode():
    _generate(target, draft, spec, prompts[0], 64, None)
    engine, length = grab["engine"], grab["length"]
    drafter, runner = engine.drafter, engine.target
    engine._set_window(length)
    tokens, parents, depths, ranks, anc = drafter.propose(length)
    root_a = drafter.root
    hidden = torch.randn(2, target.model.config.hidden_size)
    pair = tokens[:2].clone()

    own = TargetRunner(target.model, runner.capacity)
    own.prefill(torch.randint(0, target.model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0)))
    bushy = bushy_tree(8, target.model.device)

    def verify(n: int) -> None:
        if n == -8:
            own.where.window = length + 8
            own.score(*bushy, length, greedy=True)
        elif n == -1:
            own.where.window = length + 1
            own.score(bushy[0][:1], bushy[1][:1], None, length, greedy=True)
        elif n == 1:
            runner.score(tokens[:1], depths[:1], None, length, greedy=True)
        else:
            runner.score(tokens, depths, anc, length, greedy=True)

    def tree() -> None:
        drafter.propose(length)

    def step() -> None:  # the accepted path's draft step: two rows from the cycle's start, the root set again after
        drafter.extend(hidden, pair, length, 1)
        drafter.root = root_a

    ways = {"8 rows repeated": (8, None), "8 rows after the draft's tree": (8, tree),
            "8 rows after the tree and the path's draft step": (8, lambda: (tree(), step())),
            "8 rows after a 256 MB read": (8, big.sum), "1 row repeated": (1, None),
            "1 row after a 256 MB read": (1, big.sum), "cost model's 8 rows (random cache, bushy tree)": (-8, None),
            "cost model's 1 row (random cache)": (-1, None)}
    times = {w: [] for w in ways}
    for r in range(ROUNDS + 1):
        for w, (n, before) in ways.items():
            verify(n)
            if before is not None:
                before()
            t0 = time.perf_counter()
            verify(n)
            if r:
                times[w].append(time.perf_counter() - t0)
print(f"context {length} positions, tree of {tokens.shape[0]} rows; medians of {ROUNDS} interleaved rounds")
for w, ts in times.items():
    print(f"{w}: {1e3 * statistics.median(ts):.3f} ms")
