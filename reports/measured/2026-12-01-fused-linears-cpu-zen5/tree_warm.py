"""The eager engine's tree in one kernel call (``draft_step.one_tree``) for METHOD's draft on the 5000 x 4 drafts,
after one 64-token generation of an MT-bench first turn has set its root and cache: its time repeated (warm) and
right after a 256 MB read (cold), 30 rounds, medians; then the operators torch dispatches inside it (20 calls under
the profiler) and its warm time on one thread and on two. With ``--loop SECONDS``: instead, "ready", then the call
repeated for that long (the process ``perf record -D`` or ``-p`` profiles; ``tree_perf.txt`` came from jakiro's).

    python tree_warm.py METHOD [--loop SECONDS]
"""
import sys, time, statistics
from pathlib import Path
import torch
from jakiro_lib.decoding import static
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.models.draft_step import one_tree
from jakiro_lib.decoding.static_tree import ATTEND_ROWS, ATTEND_HEAD_SIZES
from jakiro_lib.profiles import get_profile

name = sys.argv[1] if len(sys.argv) > 1 else "jakiro"
profile_ = get_profile("default", **{"data.num_conversations": 5000, "train.epochs": 4})
target = load_target(profile_.target)
methods = cycle_methods(profile_, Path("runs/main5000"), target, [name])
prompts = cycle_prompts(profile_, target, 2)
spec = methods[name]
draft = spec.load_draft(target)
grab = {}
orig = static.StaticEngine._advance
def adv(self, start, length, room):
    grab["eng"], grab["len"] = self, length
    return orig(self, start, length, room)
static.StaticEngine._advance = adv
big = torch.ones(64 * 2**20)  # 256 MB
with torch.inference_mode():
    _generate(target, draft, spec, prompts[0], 64, None)
    eng, length = grab["eng"], grab["len"]
    d = eng.drafter
    def tree(): return one_tree(d, length, ATTEND_ROWS, ATTEND_HEAD_SIZES)
    if "--loop" in sys.argv:
        seconds = float(sys.argv[sys.argv.index("--loop") + 1])
        print("ready", flush=True)
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            tree(); n += 1
        print("per call ms", 1e3 * (time.perf_counter() - t0) / n)
        sys.exit()
    for _ in range(5): tree()
    warm, cold = [], []
    for r in range(30):
        t = time.perf_counter(); tree(); warm.append(time.perf_counter() - t)
        big.sum()
        t = time.perf_counter(); tree(); cold.append(time.perf_counter() - t)
    print(name, "draft_tree warm %.3f ms, cold %.3f ms" % (1e3 * statistics.median(warm), 1e3 * statistics.median(cold)))
    from torch.profiler import profile, ProfilerActivity
    import collections
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20): tree()
    tot = collections.Counter(); cnt = collections.Counter(); selfk = 0
    for e in prof.events():
        if e.name.endswith("draft_tree"):
            selfk += e.self_cpu_time_total
            for c in e.cpu_children:
                tot[c.name] += c.cpu_time_total; cnt[c.name] += 1
    print("self %.3f ms, children %.3f ms" % (selfk / 20e3, sum(tot.values()) / 20e3))
    for k, v in tot.most_common(12): print("  ", k, "%.3f" % (v / 20e3), cnt[k] / 20)
    # thread count effect
    for th in (1, 2):
        torch.set_num_threads(th)
        for _ in range(3): tree()
        ts = []
        for _ in range(20):
            t = time.perf_counter(); tree(); ts.append(time.perf_counter() - t)
        print("threads", th, "warm %.3f ms" % (1e3 * statistics.median(ts)))
