"""What the work after a verify forward costs because the forward ran before it: each eager step of a decoding cycle
timed as the engine runs it and again at once with the same inputs (the repeat rewrites what the first wrote), a
pure-Python loop and a one-operator torch call run right after the verify forward the same way, the draft's forward
over the accepted path with the draft's packed weights read just before it or not; then the same Python loop and torch
call after six other things a core can do for 10-20 ms (nothing, reading 4 MB 100 times, 24 MB 10 times, 425 MB once
from 4 KB pages or from 2 MB pages, sleeping 12 ms). Medians.

    python reports/measured/2026-12-01-cold-steps-cpu-zen5/cold.py --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-01-cold-steps-cpu-zen5/cold.txt
"""
from __future__ import annotations

import argparse
import ctypes
import mmap
import statistics
import time
from pathlib import Path

import torch

from jakiro_lib.decoding import runner, static, static_tree
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models import draft_step
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

METHODS = ("jakiro_auto", "jakiro")
log: dict[str, list[tuple[float, float]]] = {}
state = {"warm": False}


def twice(key: str, call):
    """``call`` run twice in place of once, each timed; the second's result returned."""
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        call(*args, **kwargs)
        t1 = time.perf_counter()
        out = call(*args, **kwargs)
        log.setdefault(key, []).append((t1 - t0, time.perf_counter() - t1))
        return out
    return wrapped


def python_loop() -> int:
    """Interpreter work alone: a dict of 200 entries built."""
    d = {}
    for i in range(200):
        d[i] = (i, str(i))
    return len(d)


SMALL = torch.zeros(8)


def one_op() -> torch.Tensor:
    return SMALL + 1


def tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from tensors(y)


def instrument() -> None:
    walk, extend = static.greedy_walk, static_tree.StaticTreeDrafter.extend

    def walked(*args):  # the first thing after the verify forward: the loop, the operator, then the walk
        twice("python loop after verify", python_loop)()
        twice("one operator after verify", one_op)()
        return twice("evaluate (greedy_walk)", walk)(*args)

    def extended(self, *args, **kwargs):
        if state["warm"]:  # the draft's packed weights read just before
            for t in tensors(self.draft.__dict__.get(draft_step.STEP_PANELS, (None, None))[1]):
                t.sum() if t.dtype == torch.int8 else t.float().sum()
        return twice("draft forward, accepted path" + (" (weights read first)" if state["warm"] else ""),
                     extend)(self, *args, **kwargs)

    static.greedy_walk = walked
    static_tree.StaticTreeDrafter.extend = extended
    runner.TargetRunner.move = twice("update (move)", runner.TargetRunner.move)
    static_tree.StaticTreeDrafter.propose = twice("tree", static_tree.StaticTreeDrafter.propose)
    runner.TargetRunner.score = twice("verify forward", runner.TargetRunner.score)


def report(title: str) -> None:
    print(title)
    for key, pairs in log.items():
        first, again = (1e6 * statistics.median(x) for x in zip(*pairs))
        print(f"  {key:46s} in the cycle {first:8.1f} us, again {again:8.1f} us, +{first - again:7.1f} "
              f"(x{first / again:.2f}; {len(pairs)} calls)", flush=True)
    log.clear()


def controls(rounds: int = 30) -> None:
    """The loop and the operator after other things a core can do."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    n = 425 << 20
    big, mid, small = torch.ones(n // 4), torch.ones(24 << 18), torch.ones(1 << 20)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    huge = libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(n), 14) == 0  # MADV_HUGEPAGE
    big2m = torch.frombuffer(buf, dtype=torch.float32)
    big2m.fill_(1.0)
    anon = next((line.split()[1] for line in open("/proc/self/smaps_rollup") if line.startswith("AnonHuge")), "?")
    print(f"controls (2 MB pages granted: madvise {huge}, AnonHugePages {anon} kB in the process)")
    before = {"nothing": lambda: None, "4 MB read 100 times": lambda: [small.sum() for _ in range(100)],
              "24 MB read 10 times": lambda: [mid.sum() for _ in range(10)],
              "425 MB read once, 4 KB pages": big.sum, "425 MB read once, 2 MB pages": big2m.sum,
              "sleep 12 ms": lambda: time.sleep(0.012)}
    for name, pollute in before.items():
        times = {"loop": [], "op": []}
        for _ in range(rounds):
            for key, call in (("loop", python_loop), ("op", one_op)):
                pollute()
                t0 = time.perf_counter()
                call()
                times[key].append(time.perf_counter() - t0)
        print(f"  after {name:30s} python loop {1e6 * statistics.median(times['loop']):6.1f} us, one operator "
              f"{1e6 * statistics.median(times['op']):6.1f} us", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="profile overrides, key=value (ints)")
    ap.add_argument("--prompts", type=int, default=10)
    args = ap.parse_args()
    profile = get_profile("default", **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, ["vanilla", *METHODS])
    prompts = cycle_prompts(profile, target, args.prompts)
    print(run_metadata(target.device))
    with torch.inference_mode():
        controls()
        instrument()
        for name in METHODS:
            spec, draft = methods[name], methods[name].load_draft(target)
            _generate(target, draft, spec, prompts[0], 16, None)
            for warm in (False, True, False, True):
                state["warm"] = warm
                for ids in prompts:
                    _generate(target, draft, spec, ids, 64, None)
            t = spec.tree
            report(f"{name} d{t.depth} k{t.top_k} n{t.total_tokens}, {len(prompts)} MT-bench first turns x 4, 64 "
                   "tokens, T=0, the cycle eager")


if __name__ == "__main__":
    main()
