"""Operators per cycle of the eager static engine, by named step, on the CPU: a proxy for the kernels a captured
GPU cycle replays (a CUDA graph records the eager kernels one for one). Plain decoding against Jakiro's cycle at
4- and 8-token trees, SmolLM2 in fp32, one MT-bench-like prompt, 24 new tokens. Views, no-op casts and
allocations are left out (no kernel on a GPU). Two counts:

* outer: each working operator the Python code calls, counted once however it is implemented (a linear, a mean,
  SDPA: one each). The closer proxy for a GPU, where these are mostly one kernel each;
* inner: the deepest working operators, what the CPU ran (a mean is a sum, a fill, a div and a scalar's copy here;
  a linear an mm). This version's first count took only operators without any child, which dropped every one
  that allocates its output through a child (mm, index_select, index_copy_): 825 a plain token, too few.

    python reports/measured/2026-11-27-h100-windows/opcount.py [DRAFT_DIR]   # default runs/default/drafts/moe2_xgate/draft
"""
import collections
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from jakiro_lib.config import TreeConfig
from jakiro_lib.data.chat import format_prompt_ids
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

NO_KERNEL = {"view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "expand", "t", "transpose", "reshape",
             "permute", "_unsafe_view", "alias", "detach", "lift_fresh", "empty", "empty_strided", "resolve_conj",
             "resolve_neg", "_reshape_alias", "squeeze_", "unsqueeze_", "as_strided_", "result_type", "is_nonzero",
             "item", "_local_scalar_dense", "split", "chunk", "unbind", "narrow", "contiguous", "diagonal", "to",
             "resize_", "empty_like", "new_empty", "flatten", "real"}



def is_kernel(e) -> bool:
    """An operator that does work (not a view, cast or allocation)."""
    return e.name.startswith("aten::") and e.name[6:] not in NO_KERNEL


def descendants(e):
    for c in e.cpu_children:
        yield c
        yield from descendants(c)


def ancestors(e):
    while e.cpu_parent is not None:
        e = e.cpu_parent
        yield e


torch.set_num_threads(2)
target = load_target(get_profile("default", **{"target.dtype": "float32", "target.packed_gemm": "0"}).target)
draft = DraftModel.load(sys.argv[1] if len(sys.argv) > 1 else "runs/default/drafts/moe2_xgate/draft", target.model)
prompt = format_prompt_ids(target, [{"role": "user", "content": "Write a short story about a robot learning to paint."}])
runs = [("plain", None, None)] + [(f"jakiro, {n}-token tree", draft, TreeConfig(depth=4, top_k=3, total_tokens=n,
                                                                                 decoupled=True)) for n in (4, 8)]
for name, d, tree in runs:
    static_generate(target.model, d, tree, prompt, max_new_tokens=24)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        r = static_generate(target.model, d, tree, prompt, max_new_tokens=24)
    events = prof.events()
    steps = [e for e in events if e.name.startswith("jakiro::") and e.name != "jakiro::cycle"]
    counts = {"outer": [e for e in events if is_kernel(e) and not any(is_kernel(a) for a in ancestors(e))],
              "inner": [e for e in events if is_kernel(e) and not any(is_kernel(d) for d in descendants(e))]}
    c = max(r.cycles, 1)
    print(f"{name}: cycles {r.cycles}, tau {(len(r.output_ids) - 1) / c:.2f}, operators a cycle "
          + ", ".join(f"{how} {len(work) / c:.0f}" for how, work in counts.items()))
    for how, work in counts.items():
        by_step, names = collections.Counter(), collections.defaultdict(collections.Counter)
        for e in work:
            for s in steps:
                if s.time_range.start <= e.time_range.start and e.time_range.end <= s.time_range.end:
                    by_step[s.name] += 1
                    names[s.name][e.name] += 1
        for s, n in by_step.items():
            print(f"   {how} {s}: {n / c:.0f}, most: {[(k, round(m / c, 1)) for k, m in names[s].most_common(6)]}")
