"""How much of a decoding cycle is the package's kernels and how much the host's work around them, with the eager
engine's draft steps and tree in single calls: every call of the kernels a cycle makes (the target's layers in one
call, greedy decoding's screened head, the draft's tree in one call with its steps inside, the accepted path's draft
step in one call, the norms, and any of the older calls a fallback would make) timed where the engine makes it, summed over the cycles of each method's
generations, against the cycles' own time (``StaticEngine._advance``, the prefill left out). What is not a kernel is
the interpreter, torch's dispatch and the small tensor operators between the kernels. Greedy, the cycle eager (the
default), 10 MT-bench first turns, 64 tokens; the methods one after another.

    python reports/measured/2026-12-01-host-share-one-call-cpu-zen5/host.py --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-01-host-share-one-call-cpu-zen5/run1.txt
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

from jakiro_lib.decoding import static
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models import fast_paths
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

METHODS = ("vanilla", "eagle2_auto", "jakiro_auto", "eagle2", "jakiro", "jakiro_cepd")
KERNELS = ("decoder_layers", "draft_step", "draft_tree", "draft_qkv", "draft_mix", "int8_linear", "draft_children", "rms_norm", "linear", "rope",
           "attend", "kv_write", "argmax")
spent: dict[str, float] = defaultdict(float)
cycle = {"on": False, "seconds": 0.0}


def timed(name: str, call):
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        out = call(*args, **kwargs)
        if cycle["on"]:
            spent[name] += time.perf_counter() - t0
        return out
    return wrapped


def instrument() -> None:
    ops = torch.ops.jakiro_stream_gemm
    for name in KERNELS:
        setattr(ops, name, timed(name, getattr(ops, name)))
    fast_paths.greedy_argmax = timed("greedy_head", fast_paths.greedy_argmax)  # the op is looked up once and kept
    advance = static.StaticEngine._advance

    def advanced(self, *args, **kwargs):
        cycle["on"], t0 = True, time.perf_counter()
        try:
            return advance(self, *args, **kwargs)
        finally:
            cycle["seconds"] += time.perf_counter() - t0
            cycle["on"] = False
    static.StaticEngine._advance = advanced


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="profile overrides, key=value (ints)")
    ap.add_argument("--prompts", type=int, default=10)
    args = ap.parse_args()
    profile = get_profile("default", **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, list(METHODS))
    prompts = cycle_prompts(profile, target, args.prompts)
    print(run_metadata(target.device))
    instrument()
    plain = None
    with torch.inference_mode():
        for name in METHODS:
            spec = methods[name]
            draft = spec.load_draft(target) if name != "vanilla" else None
            _generate(target, draft, spec, prompts[0], 16, None)
            spent.clear()
            cycle["seconds"], cycles = 0.0, 0
            for ids in prompts:
                cycles += _generate(target, draft, spec, ids, 64, None).cycles
            per = {k: 1e3 * v / cycles for k, v in sorted(spent.items(), key=lambda kv: -kv[1])}
            wall, kernels = 1e3 * cycle["seconds"] / cycles, sum(per.values())
            plain = plain or wall
            tree = "" if spec.tree is None or name == "vanilla" else \
                f" d{spec.tree.depth} k{spec.tree.top_k} n{spec.tree.total_tokens}"
            print(f"{name}{tree}: {cycles} cycles, {wall:.2f} ms a cycle ({wall / plain:.3f} plain cycles); kernels "
                  f"{kernels:.2f} ms, the rest {wall - kernels:.2f} ms ({(wall - kernels) / plain:.3f} of a plain "
                  "cycle); " + ", ".join(f"{k} {v:.3f}" for k, v in per.items()), flush=True)


if __name__ == "__main__":
    main()
