"""Operators a captured cycle replays, by named step, counted on the CPU as a GPU would run them: the step run over
device positions (the CUDA-graph path; a stand-in runs it eagerly, where a graph would replay its kernels one for
one), the package's C++ kernels off and transformers' SDPA attention (a GPU's), SmolLM2-135M in fp32. Views,
no-op casts and allocations are left out (no kernel on a GPU); each operator the Python code calls counts once
("outer": a linear is one, not its mm), the package's streaming GEMM as one (a linear on a GPU). Plain decoding, and Jakiro's draft (decoupled trees, depth 4, top-k 3) at 4
and 8 tokens, on one chat prompt, 24 new tokens.

    python reports/measured/2026-11-30-captured-kernels-cpu/opcount.py --run-dir runs/default --out DIR

Writes opcount.csv (method, cycles, tau, step, operators a cycle, the most frequent ones).
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile

from jakiro_lib.config import TreeConfig
from jakiro_lib.data.chat import format_prompt_ids
from jakiro_lib.decoding import static
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.models import fast_paths
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

NO_KERNEL = {"view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "expand", "t", "transpose", "reshape",
             "permute", "_unsafe_view", "alias", "detach", "lift_fresh", "empty", "empty_strided", "resolve_conj",
             "resolve_neg", "_reshape_alias", "squeeze_", "unsqueeze_", "as_strided_", "result_type", "is_nonzero",
             "item", "_local_scalar_dense", "split", "chunk", "unbind", "narrow", "contiguous", "diagonal", "to",
             "resize_", "empty_like", "new_empty", "flatten", "real"}


def is_kernel(e) -> bool:
    """A working aten operator, or a call of the package's streaming GEMM (a draft's linear where the load-time probe
    chose it for that many rows; aten's linear on a GPU)."""
    return e.name.startswith("aten::") and e.name[6:] not in NO_KERNEL or e.name == "jakiro_stream_gemm::linear"


def ancestors(e):
    while e.cpu_parent is not None:
        e = e.cpu_parent
        yield e


def inside(e, r) -> bool:
    return r.time_range.start <= e.time_range.start and e.time_range.end <= r.time_range.end


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, default=Path("runs/default"))
    ap.add_argument("--draft", default="moe2_xgate")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)
    static.graph_capture = lambda model: (lambda step, inputs: (lambda: step(*inputs)))  # replays run eagerly
    fast_paths._kernel = lambda name, x: None  # no package kernels, as on a GPU
    target = load_target(get_profile("default", **{"target.dtype": "float32", "target.gqa_attention": "false"}).target)
    draft = DraftModel.load(args.run_dir / "drafts" / args.draft / "draft", target.model)
    prompt = format_prompt_ids(target, [{"role": "user", "content": "Write a short story about a robot learning to paint."}])
    runs = [("plain", None, None)] + [(f"jakiro {n}-token", draft, TreeConfig(depth=4, top_k=3, total_tokens=n,
                                                                              decoupled=True)) for n in (4, 8)]
    rows = []
    for name, d, tree in runs:
        static_generate(target.model, d, tree, prompt, max_new_tokens=24, compile=True)  # warm-up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            r = static_generate(target.model, d, tree, prompt, max_new_tokens=24, compile=True)
        events = prof.events()
        cycles = [e for e in events if e.name == "jakiro::cycle"]
        steps = [e for e in events if e.name.startswith("jakiro::") and e.name != "jakiro::cycle"]
        work = [e for e in events if is_kernel(e) and not any(is_kernel(a) for a in ancestors(e))
                and any(inside(e, c) for c in cycles)]
        c = max(r.cycles, 1)
        tau = (len(r.output_ids) - 1) / c
        rows.append({"method": name, "cycles": r.cycles, "tau": round(tau, 2), "step": "cycle",
                     "ops": round(len(work) / c, 1), "most": ""})
        for s in ("draft", "draft_forward", "verify", "evaluate", "update"):
            mine = [e for e in work if any(inside(e, x) for x in steps if x.name == f"jakiro::{s}")]
            if mine:
                most = collections.Counter(e.name.split("::")[1] for e in mine).most_common(10)
                rows.append({"method": name, "cycles": r.cycles, "tau": round(tau, 2), "step": s,
                             "ops": round(len(mine) / c, 1), "most": " ".join(f"{k}:{v / c:.0f}" for k, v in most)})
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "opcount.csv", index=False)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
