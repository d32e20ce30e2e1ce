"""The compiled tree (`target.capture` "draft", the default profile's) choosing each step's children through
`stream_gemm.cpp`'s `draft_children` (one extern call in inductor's graph) against the same choice in torch's
operators (inductor's fused log-softmax, top-k, sort and gathers: `drafting.children` swapped for its torch path, each
way compiled once), side by side in one process: the default main job's drafts decode MT-bench prompts greedily, each
prompt both ways, the order turning prompt by prompt (10 first turns x 2, 64 new tokens, T=0); outputs equal
(asserted).

    python reports/measured/2026-12-01-compiled-children-cpu/ab.py --run-dir runs/default \\
        --out reports/measured/2026-12-01-compiled-children-cpu
"""
import argparse
import json
import statistics

import torch
from pathlib import Path
from jakiro_lib.decoding import drafting
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile
fused = drafting.children
def torch_children(logits, weights, k, per_expert):
    logp = logits.float().log_softmax(-1)
    union, _ = logp.topk(per_expert, dim=-1).indices.flatten(1).sort(-1)
    C = union.shape[1]
    if C < k:
        union = torch.cat([union, union[:, :1].expand(-1, k - C)], 1)
    weighted = logp.gather(2, union[:, None, :].expand(-1, logp.shape[1], -1))
    if weights is not None:
        weighted = weighted + (weights / weights.sum(-1, keepdim=True)).log()[..., None]
        scores = weighted.logsumexp(1)
    else:
        scores = weighted.max(1).values
    repeat = torch.zeros_like(union, dtype=torch.bool)
    repeat[:, 1:] = union[:, 1:] == union[:, :-1]
    repeat[:, C:] = True
    best = scores.masked_fill(repeat, float("-inf")).topk(k, dim=-1)
    return union.gather(1, best.indices), best.values, weighted.argmax(1).gather(1, best.indices)
WAYS = {"op": fused, "torch": torch_children}
METHODS = ("eagle2", "jakiro", "jakiro_cepd")
ap = argparse.ArgumentParser()
ap.add_argument("--run-dir", type=Path, required=True)
ap.add_argument("--out", type=Path, required=True)
args = ap.parse_args()
profile = get_profile("default", **{"data.num_conversations": 800, "train.epochs": 2})
target = load_target(profile.target)
methods = cycle_methods(profile, args.run_dir, target, list(METHODS))
prompts = cycle_prompts(profile, target, 10)
drafts = {n: s.load_draft(target) for n, s in methods.items()}
for n in METHODS:
    for w in WAYS.values():
        drafting.children = w
        _generate(target, drafts[n], methods[n], prompts[0], 16, None)
runs = {}
for rep in range(2):
    for i, ids in enumerate(prompts):
        for n in METHODS:
            outs = []
            for w in (list(WAYS) if (i + rep) % 2 == 0 else list(WAYS)[::-1]):
                drafting.children = WAYS[w]
                clock = StepClock(target.device)
                r = _generate(target, drafts[n], methods[n], ids, 64, clock)
                outs.append(r.output_ids)
                runs.setdefault((n, w), []).append((r.wall_time - r.prefill_time, r.cycles, clock.seconds.get("draft", 0.0)))
            assert outs[0] == outs[1]
for n in METHODS:
    a, b = runs[(n, "op")], runs[(n, "torch")]
    ratio = statistics.median(y[0] / y[1] / (x[0] / x[1]) for x, y in zip(a, b))
    tree = lambda rs: 1e3 * sum(r[2] for r in rs) / sum(r[1] for r in rs)
    cyc = lambda rs: 1e3 * sum(r[0] for r in rs) / sum(r[1] for r in rs)
    print(f"{n}: cycle op {cyc(a):.2f} torch {cyc(b):.2f} ms; tree op {tree(a):.2f} torch {tree(b):.2f} ms; torch/op cycle median {ratio:.3f}; op faster in {sum(y[0]/y[1] > x[0]/x[1] for x, y in zip(a, b))}/{len(a)}")
rows = []
for n in METHODS:
    a, b = runs[(n, "op")], runs[(n, "torch")]
    ratios = [y[0] / y[1] / (x[0] / x[1]) for x, y in zip(a, b)]
    rows.append({"method": n, "op ms/cycle": cyc(a), "torch ms/cycle": cyc(b), "op tree ms": tree(a),
                 "torch tree ms": tree(b), "torch/op cycle (median)": statistics.median(ratios),
                 "op faster in": f"{sum(r > 1 for r in ratios)}/{len(ratios)}"})
args.out.mkdir(parents=True, exist_ok=True)
(args.out / "ab.json").write_text(json.dumps({"rows": rows, "runs": {f"{k[0]}|{k[1]}": v for k, v in runs.items()}},
                                             indent=2) + "\n")
(args.out / "ab_config.json").write_text(json.dumps({"methods": METHODS, "capture": profile.target.capture,
                                                    "run_dir": str(args.run_dir),
                                                    "environment": run_metadata(target.model.device)},
                                                   indent=2, default=str) + "\n")
