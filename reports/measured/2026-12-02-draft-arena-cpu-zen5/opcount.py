"""The ATen operators dispatched inside one warm draft_tree call (every level; jakiro's d4 k3 n8 tree after a 64-token
generation of an MT-bench first turn, 10 calls under the profiler), the working tree's kernel file and the file at the
commit given; then the warm call's time both ways (40 rounds of 10 calls each way, the order turning; medians and the
median of the rounds' ratios).

    python reports/measured/2026-12-02-draft-arena-cpu-zen5/opcount.py 335e53b > reports/measured/2026-12-02-draft-arena-cpu-zen5/opcount.txt
"""
import sys, importlib.util, collections, statistics, time
from pathlib import Path
import torch
from jakiro_lib.decoding import static
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.models import fast_paths
from jakiro_lib.models.draft_step import one_tree
from jakiro_lib.decoding.static_tree import ATTEND_ROWS, ATTEND_HEAD_SIZES
from jakiro_lib.profiles import get_profile
spec_ = importlib.util.spec_from_file_location("layers_ab", "reports/measured/2026-12-01-layers-raw-rows-cpu-zen5/ab.py")
layers_ab = importlib.util.module_from_spec(spec_); spec_.loader.exec_module(layers_ab)
profile_ = get_profile("default", **{"data.num_conversations": 5000, "train.epochs": 4})
target = load_target(profile_.target)
methods = cycle_methods(profile_, Path("runs/main5000"), target, ["jakiro"])
prompts = cycle_prompts(profile_, target, 2)
spec = methods["jakiro"]; draft = spec.load_draft(target)
layers_ab.build_old(sys.argv[1])
ops = {"now": torch.ops.jakiro_stream_gemm, "before": getattr(torch.ops, layers_ab.OLD)}
grab = {}
orig = static.StaticEngine._advance
def adv(self, start, length, room):
    grab["eng"], grab["len"] = self, length
    return orig(self, start, length, room)
static.StaticEngine._advance = adv
with torch.inference_mode():
    _generate(target, draft, spec, prompts[0], 64, None)
    d = grab["eng"].drafter
    for way in ("before", "now"):
        torch.ops.__dict__["jakiro_stream_gemm"] = ops[way]
        fast_paths._kernels.clear()
        for _ in range(3): one_tree(d, grab["len"], ATTEND_ROWS, ATTEND_HEAD_SIZES)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(10): one_tree(d, grab["len"], ATTEND_ROWS, ATTEND_HEAD_SIZES)
        cnt = collections.Counter()
        for e in prof.events():
            if e.name.endswith("draft_tree"):
                stack = list(e.cpu_children)
                while stack:
                    c = stack.pop(); cnt[c.name] += 1; stack.extend(c.cpu_children)
        print(way, "operators inside a draft_tree call (all levels):", sum(cnt.values()) / 10,
              "top:", [(k, v / 10) for k, v in cnt.most_common(6)])
    times = collections.defaultdict(list)
    for r in range(40):
        for way in ("before", "now") if r % 2 else ("now", "before"):
            torch.ops.__dict__["jakiro_stream_gemm"] = ops[way]
            fast_paths._kernels.clear()
            one_tree(d, grab["len"], ATTEND_ROWS, ATTEND_HEAD_SIZES)
            t = time.perf_counter()
            for _ in range(10): one_tree(d, grab["len"], ATTEND_ROWS, ATTEND_HEAD_SIZES)
            times[way].append((time.perf_counter() - t) / 10)
    ratio = statistics.median(b / a for b, a in zip(times["before"], times["now"]))
    print("warm draft_tree call ms: before %.3f, now %.3f; before / now %.3f" % (
        1e3 * statistics.median(times["before"]), 1e3 * statistics.median(times["now"]), ratio))
