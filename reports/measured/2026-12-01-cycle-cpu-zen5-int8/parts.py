"""Where an eager cycle's drafting goes, by timers around the engine's functions (a few microseconds of their own):
the default main job's jakiro method (8 tokens) and plain decoding, `target.capture="none"`, MT-bench q2-6 first turns
after a warm-up on q1, 64 new tokens, T=0. Per cycle: the draft forwards (`StaticTreeDrafter._forward`, the accepted
path's in `extend` and the tree's), the candidate steps (`candidate_tensors`: the head, `draft_children`), the head
alone (`DraftModel.logits`), the pool's bookkeeping (`_pool_children`), the selection, the masks, `propose` whole.

    python reports/measured/2026-12-01-cycle-cpu-zen5-int8/parts.py --run-dir runs/default > .../parts.txt
"""
from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import jakiro_lib.decoding.static as static
import jakiro_lib.decoding.static_tree as static_tree
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target, set_capture
from jakiro_lib.profiles import get_profile

SECONDS: dict[str, float] = collections.defaultdict(float)


def timed(name: str, f):
    def call(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            SECONDS[name] += time.perf_counter() - t0
    return call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    args = ap.parse_args()
    profile = get_profile("default", **{"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    set_capture(target.model, "none")
    print(run_metadata(target.device))
    drafter = static_tree.StaticTreeDrafter
    drafter._forward = timed("draft forwards (all)", drafter._forward)
    drafter.extend = timed("extend (the accepted path's forward and its rows)", drafter.extend)
    drafter.propose = timed("propose (the tree whole)", drafter.propose)
    static_tree.candidate_tensors = timed("candidate steps", static_tree.candidate_tensors)
    static_tree._pool_children = timed("pool bookkeeping (_pool_children)", static_tree._pool_children)
    static_tree.select_tree = timed("selection", static_tree.select_tree)
    static_tree.tree_rows = timed("tree rows' masks", static_tree.tree_rows)
    static.ancestor_mask = timed("ancestor mask", static.ancestor_mask)
    DraftModel.logits = timed("head (in the candidate steps)", DraftModel.logits)
    methods = cycle_methods(profile, args.run_dir, target, ["jakiro"])
    prompts = cycle_prompts(profile, target, 6)
    for name, spec in methods.items():
        draft = spec.load_draft(target)
        _generate(target, draft, spec, prompts[0], 16, None)
        SECONDS.clear()
        cycles, t0 = 0, time.perf_counter()
        for ids in prompts[1:]:
            cycles += _generate(target, draft, spec, ids, 64, None).cycles
        print(f"{name}: {cycles} cycles, {1e3 * (time.perf_counter() - t0) / cycles:.3f} ms a cycle (prefills included)")
        for part, s in sorted(SECONDS.items()):
            print(f"  {part}: {1e3 * s / cycles:.3f} ms a cycle")


if __name__ == "__main__":
    main()
