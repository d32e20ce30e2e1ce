"""The eager Jakiro tree's parts: one tree drafted again and again from the state a generation left (the draft's
``propose``), warm and after a 256 MB write (cold), its draft forwards' share (the clock's credit), on two threads and
on one; ``loop`` then drafts it for 14 s warm, for perf to sample:

    python reports/measured/2026-12-02-cycle-after-sampling-cpu-zen5/tree_parts.py jakiro threads
    perf record -F 4999 -D 24000 -o /tmp/perf.data python reports/measured/2026-12-02-cycle-after-sampling-cpu-zen5/tree_parts.py jakiro loop
    perf report -i /tmp/perf.data --no-children --sort symbol | head -60
"""
import statistics
import sys
import time
from pathlib import Path

import torch

from jakiro_lib.decoding import static
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.measure.cycles import cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

name = sys.argv[1] if len(sys.argv) > 1 else "jakiro"
profile = get_profile("default", **{"data.num_conversations": 5000, "train.epochs": 4})
target = load_target(profile.target)
spec = cycle_methods(profile, Path("runs/main5000"), target, [name])[name]
draft = spec.load_draft(target)
ids = cycle_prompts(profile, target, 1)[0]
needed = static.text_positions(ids, 64, target.config.max_context) + static.MAX_TREE_ROOM
engine = static._engine(target.model, draft, spec.tree, static.engine_cache_len(needed), static.SamplingParams(),
                        False, False)
with torch.inference_mode():
    r = engine.generate(ids, max_new_tokens=64, eos_token_ids=target.eos_token_ids,
                        max_context=target.config.max_context)
    d = engine.drafter
    base = r.prompt_len + len(r.output_ids) - 1
    engine._set_window(base)
    big = torch.empty(64 * 2**20)
    for threads in ((2, 1, 2) if "threads" in sys.argv else (2,)):
        torch.set_num_threads(threads)
        for cold in (False, True):
            total, forwards = [], []
            for _ in range(150):
                if cold:
                    big.add_(1.0)
                clock = StepClock(torch.device("cpu"))
                d.clock = clock
                t0 = time.perf_counter()
                d.propose(base)
                total.append(time.perf_counter() - t0)
                forwards.append(clock.seconds.get("draft_forward", 0.0))
            d.clock = None
            print(f"{name} threads {threads} {'cold' if cold else 'warm'}: propose "
                  f"{1e3 * statistics.median(total):.3f} ms, its draft forwards {1e3 * statistics.median(forwards):.3f} ms",
                  flush=True)
    if "loop" in sys.argv:
        torch.set_num_threads(2)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 14:
            d.propose(base)
