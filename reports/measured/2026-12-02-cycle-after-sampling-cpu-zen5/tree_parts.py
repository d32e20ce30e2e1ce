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

from after_generation import engine_after, load
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.measure.cycles import cycle_prompts

name = sys.argv[1] if len(sys.argv) > 1 else "jakiro"
profile, target, spec, draft = load(Path("runs/main5000"), {"data.num_conversations": 5000, "train.epochs": 4}, name)
ids = cycle_prompts(profile, target, 1)[0]
with torch.inference_mode():
    engine, base = engine_after(target, draft, spec, ids)
    d = engine.drafter
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
