"""The draft's part of a cycle, timed by the engine's own step clock (its steps draft, draft_forward and update: the
tree with its steps, the target cache's move and the accepted path's draft step), per cycle, with the package's draft step on raw rows in one scratch buffer (draft_step, draft_qkv and draft_mix sharing their
raw-row forms) against the kernel file before it, side by side in one process: the earlier file built under its own op
namespace and swapped in for whole generations (``torch.ops.jakiro_stream_gemm`` pointed at it, the ops
``fast_paths`` keeps looked up again), each prompt both
ways, the order turning; per generation the seconds less the prefill, paired; outputs compared.

    python reports/measured/2026-12-01-draft-raw-rows-cpu-zen5/parts.py --old 1e3db85 --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-01-draft-raw-rows-cpu-zen5/parts.txt
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils import cpp_extension

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

METHODS = ("jakiro_auto", "jakiro", "jakiro_cepd", "eagle2")
OLD = "jakiro_stream_gemm_before"


def build_old(commit: str) -> None:
    """The package's kernel file at ``commit`` under the op namespace :data:`OLD`, with the package's flags."""
    source = subprocess.run(["git", "show", f"{commit}:jakiro_lib/models/stream_gemm.cpp"], capture_output=True,
                            text=True, check=True).stdout.replace("jakiro_stream_gemm", OLD)
    folder = tempfile.mkdtemp()
    (Path(folder) / "before.cpp").write_text(source)
    cpp_extension.load(name=OLD, sources=[str(Path(folder) / "before.cpp")], is_python_module=False,
                       build_directory=folder, extra_cflags=list(kernels.STREAM_FLAGS), extra_ldflags=["-fopenmp"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="the commit whose kernel file is the 'before' way")
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="profile overrides, key=value (ints)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    profile = get_profile("default", **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, list(METHODS))
    prompts = cycle_prompts(profile, target, args.prompts)
    drafts = {n: methods[n].load_draft(target) if n != "vanilla" else None for n in METHODS}
    build_old(args.old)
    new_ops, old_ops = torch.ops.jakiro_stream_gemm, getattr(torch.ops, OLD)
    print(run_metadata(target.device))

    def run(way: str, name: str, ids: torch.Tensor):
        torch.ops.__dict__["jakiro_stream_gemm"] = new_ops if way == "raw rows" else old_ops
        fast_paths._kernels.clear()  # the ops fast_paths looked up, looked up again in the namespace now set
        try:
            clock = StepClock(target.device)
            result = _generate(target, drafts[name], methods[name], ids, 64, clock)
            return result, clock
        finally:
            torch.ops.__dict__["jakiro_stream_gemm"] = new_ops
            fast_paths._kernels.clear()

    seconds, equal = defaultdict(list), defaultdict(int)
    for name in METHODS:
        run("raw rows", name, prompts[0])
        run("before", name, prompts[0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # the swap reaches them
        run("before", "jakiro", prompts[0])
    ran = {e.key for e in prof.key_averages() if "decoder_layers" in e.key or "draft_tree" in e.key}
    assert ran == {f"{OLD}::decoder_layers", f"{OLD}::draft_tree"}, ran
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            for name in METHODS:
                outs = {}
                for way in ["before", "raw rows"][::1 if (i + rep) % 2 == 0 else -1]:
                    r, clock = run(way, name, ids)
                    drafting = clock.seconds["draft"] + clock.seconds["draft_forward"] + clock.seconds["update"]
                    seconds[name, way].append(drafting / r.cycles)
                    outs[way] = r.output_ids
                equal[name] += outs["raw rows"] == outs["before"]
    rng = random.Random(0)
    for name in METHODS:
        t = methods[name].tree
        tree = "" if t is None or name == "vanilla" else f" d{t.depth} k{t.top_k} n{t.total_tokens}"
        ratios = [b / a for b, a in zip(seconds[name, "before"], seconds[name, "raw rows"])]  # > 1: faster now
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        ms = {way: 1e3 * statistics.median(seconds[name, way]) for way in ("before", "raw rows")}
        print(f"{name}{tree}: draft + draft_forward + update, ms a cycle: before {ms['before']:.3f}, "
              f"raw rows {ms['raw rows']:.3f}; speed raw rows / before {statistics.median(ratios):.3f} "
              f"[{boot[50]:.3f}, {boot[1949]:.3f}] (median and 95% bootstrap interval of {len(ratios)} paired "
              f"generations); outputs equal {equal[name]}/{len(ratios)}", flush=True)


if __name__ == "__main__":
    main()
