"""Operators dispatched inside the package's kernel calls during a greedy generation, per call, with the package's
kernel file and with the file at ``--old`` (built under its own op namespace and swapped in): a torch profiler's
events attributed to the outermost kernel call they run inside. MT-bench q2's first turn, 96 tokens.

    python reports/measured/2026-12-01-draft-raw-rows-cpu-zen5/inside.py --old 1e3db85 --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-01-draft-raw-rows-cpu-zen5/inside.txt
"""
from __future__ import annotations

import argparse
import collections
import subprocess
import tempfile
from pathlib import Path

import torch
from torch.utils import cpp_extension

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

OLD = "jakiro_stream_gemm_before"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True)
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--methods", default="vanilla,jakiro")
    args = ap.parse_args()
    profile = get_profile("default", **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    target = load_target(profile.target)
    names = args.methods.split(",")
    methods = cycle_methods(profile, args.run_dir, target, names)
    ids = cycle_prompts(profile, target, 2)[1]
    source = subprocess.run(["git", "show", f"{args.old}:jakiro_lib/models/stream_gemm.cpp"], capture_output=True,
                            text=True, check=True).stdout.replace("jakiro_stream_gemm", OLD)
    folder = tempfile.mkdtemp()
    (Path(folder) / "before.cpp").write_text(source)
    cpp_extension.load(name=OLD, sources=[str(Path(folder) / "before.cpp")], is_python_module=False,
                       build_directory=folder, extra_cflags=list(kernels.STREAM_FLAGS), extra_ldflags=["-fopenmp"])
    kernels.stream_gemm_available()
    print(run_metadata(target.device))
    ops = {"now": torch.ops.jakiro_stream_gemm, "before": getattr(torch.ops, OLD)}
    for way in ("before", "now"):
        torch.ops.__dict__["jakiro_stream_gemm"] = ops[way]
        fast_paths._kernels.clear()
        for name in names:
            draft = methods[name].load_draft(target) if name != "vanilla" else None
            _generate(target, draft, methods[name], ids, 32, None)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                _generate(target, draft, methods[name], ids, 96, None)
            calls, inside = collections.Counter(), collections.defaultdict(collections.Counter)
            for event in prof.events():
                chain, parent = [], event.cpu_parent
                while parent is not None:
                    chain.append(parent.name)
                    parent = parent.cpu_parent
                kernel_calls = [c for c in chain if "jakiro_stream_gemm" in c]
                if "jakiro_stream_gemm" in event.name and not kernel_calls:
                    calls[event.name.split("::")[-1]] += 1
                if kernel_calls:
                    inside[kernel_calls[-1].split("::")[-1]][event.name] += 1
            print(f"{way}, {name}:")
            for call, count in calls.most_common():
                total = sum(inside[call].values())
                top = ", ".join(f"{k} {v / count:.0f}" for k, v in inside[call].most_common(6))
                print(f"  {call}: {count} calls, {total / count:.0f} operators inside a call ({top})", flush=True)
    torch.ops.__dict__["jakiro_stream_gemm"] = ops["now"]
    fast_paths._kernels.clear()


if __name__ == "__main__":
    main()
