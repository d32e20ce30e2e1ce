"""Sampled cycles with the warping and the sampling walk as they are now (top-p from the top k on a CPU, one read of
[m, V] for the nodes' masses) against both as they were (a sort of the vocabulary, six passes over [m, V]; written
out here), side by side in one process: each prompt decoded both ways back to back with the same seed (which first
alternating). Also each function alone on the target's real rows.

Default target and the default main job's drafts (``--run-dir``), MT-bench q1-10 first turns, 64 new tokens, T=1
and T=0.7 with top_p 0.9.

    python reports/measured/2026-11-29-sampling-walk-cpu/sampling.py --run-dir runs/default \
        --out reports/measured/2026-11-29-sampling-walk-cpu
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.data.chat import format_prompt_ids
from jakiro_lib.data.conversations import load_questions
from jakiro_lib.decoding import result, static, static_tree, verify
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.decoding.verify import SamplingParams
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import cycle_methods
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

NEW = {"warp": verify.warp_probs, "path": static_tree.sampling_path}


def old_warp_probs(logits, params):
    """warp_probs as it was: the vocabulary sorted for top-p, the smallest prefix reaching top_p kept."""
    logits = logits.float() / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits.softmax(-1)


def old_sampling_path(tokens, parents, logits, params, uniforms, max_depth, valid=None):
    """sampling_path as it was: every node's residual [m, V] built, summed in float64."""
    m = tokens.shape[0]
    idx = torch.arange(m, device=tokens.device)
    children = (parents[None, :] == idx[:, None]) & (idx[None, :] > 0)
    if valid is not None:
        children = children & valid[None, :]
    repeated = static_tree.repeated_siblings(tokens, children)
    probs = old_warp_probs(logits, params)
    cand = torch.where(children, tokens[None, :], 0)
    pc = probs.gather(1, cand).double() * (children & ~repeated)
    zeroed = torch.zeros_like(probs).scatter_add_(1, cand, children.to(probs.dtype)) > 0
    residual = probs.masked_fill(zeroed, 0.0)
    left = residual.double().sum(-1, keepdim=True) + pc.flip(1).cumsum(1).flip(1)
    accept_p = torch.where(pc > 0, pc / left.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    u = uniforms[:max_depth * m].view(max_depth, m)
    node = accepted = torch.zeros((), dtype=torch.long, device=tokens.device)
    live = torch.ones((), dtype=torch.bool, device=tokens.device)
    path = [node]
    for d in range(max_depth):
        hits = u[d] < accept_p.index_select(0, node[None])[0]
        live = live & hits.any()
        node = torch.where(live, hits.long().argmax(), node)
        accepted = accepted + live
        path.append(torch.where(live, node, 0))
    bonus = verify.inverse_cdf(residual.index_select(0, node[None])[0], uniforms[-1])
    return torch.stack(path), accepted, bonus


@contextlib.contextmanager
def version(new: bool):
    warp, path = (NEW["warp"], NEW["path"]) if new else (old_warp_probs, old_sampling_path)
    static_tree.warp_probs = result.warp_probs = warp
    static.sampling_path = path
    try:
        yield
    finally:
        static_tree.warp_probs = result.warp_probs = NEW["warp"]
        static.sampling_path = NEW["path"]


def median_ms(f, calls: int = 30, rounds: int = 5) -> list[float]:
    return [1e3 * statistics.median(_time(f) for _ in range(calls)) for _ in range(rounds)]


def _time(f) -> float:
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def alone(target, prompts, settings) -> pd.DataFrame:
    """Each function on the target's own rows: the last 8 positions of a prompt's forward; a tree whose children are
    their parent row's most probable tokens (so that the walk goes deep)."""
    with torch.inference_mode():
        logits = target.model(prompts[0][-8:][None]).logits[0].float()  # [8, V]
    parents = torch.tensor([0, 0, 0, 0, 1, 1, 2, 4])
    tokens = torch.zeros(8, dtype=torch.long)
    for j in range(1, 8):  # the j-th child of a parent holds its (rank)-th most probable token
        rank = int((parents[1:j] == parents[j]).sum())
        tokens[j] = logits[parents[j]].topk(rank + 1).indices[rank]
    uniforms = torch.rand(4 * 8 + 1, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    rows = []
    for name, params in settings.items():
        for m in (1, 2, 8):
            for what, new, old in (("warp_probs", lambda: NEW["warp"](logits[:m], params),
                                    lambda: old_warp_probs(logits[:m], params)),
                                   ("sampling_path", lambda: NEW["path"](tokens[:m], parents[:m], logits[:m], params,
                                                                         uniforms, 3),
                                    lambda: old_sampling_path(tokens[:m], parents[:m], logits[:m], params, uniforms, 3))):
                if what == "sampling_path" and m == 1:
                    continue
                a, b = [], []
                for _ in range(3):  # interleaved
                    a += median_ms(new, rounds=1)
                    b += median_ms(old, rounds=1)
                rows.append({"setting": name, "function": what, "rows": m, "now_ms": statistics.median(a),
                             "before_ms": statistics.median(b)})
                print(rows[-1], flush=True)
    return pd.DataFrame(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--methods", default="vanilla,jakiro_auto,jakiro")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    profile = get_profile("default", **{"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    names = args.methods.split(",")
    specs = cycle_methods(profile, args.run_dir, target, [n for n in names if n != "vanilla"])
    drafts = {n: (s.load_draft(target), s.tree) for n, s in specs.items()}
    if "vanilla" in names:
        drafts = {"vanilla": (None, None), **drafts}
    settings = {"T1": SamplingParams(1.0), "T0.7-p0.9": SamplingParams(0.7, top_p=0.9)}
    questions = load_questions("mt_bench", limit=args.limit)
    prompts = [(q.question_id, format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}])) for q in questions]
    alone(target, [p for _, p in prompts], settings).to_csv(args.out / "alone.csv", index=False)
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=target.eos_token_ids,
                  max_context=target.config.max_context)
    records, t0 = [], time.perf_counter()
    for sname, params in settings.items():
        for name, (draft, tree) in drafts.items():
            for new in (True, False):  # warm-up (the compiled pool compiles here)
                with version(new):
                    static_generate(target.model, draft, tree, prompts[0][1], params=params,
                                    generator=torch.Generator().manual_seed(0), **common)
            for i, (qid, ids) in enumerate(prompts):
                for new in ((True, False) if i % 2 == 0 else (False, True)):
                    with version(new):
                        res = static_generate(target.model, draft, tree, ids, params=params,
                                              generator=torch.Generator().manual_seed(i), **common)
                    records.append({"method": name, "setting": sname, "version": "now" if new else "before",
                                    "kind": "vanilla" if draft is None and tree is None else "spec",
                                    "benchmark": "mt_bench", "question_id": str(qid), "turn": 0, "repeat": 0,
                                    "tokens_per_second": res.tokens_per_second, "new_tokens": res.new_tokens,
                                    "cycles": res.cycles, "accepted": res.accepted, "output_ids": res.output_ids})
            print(f"{sname} {name} done, {time.perf_counter() - t0:.0f} s", flush=True)
    with open(args.out / "records.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    rows = []
    for sname in settings:
        base_now = [r for r in records if r["setting"] == sname and r["method"] == "vanilla" and r["version"] == "now"]
        for name in drafts:
            pick = lambda v: [r for r in records if r["setting"] == sname and r["method"] == name and r["version"] == v]  # noqa: E731
            now, before = pick("now"), pick("before")
            mean = lambda rs: sum(r["tokens_per_second"] for r in rs) / len(rs)  # noqa: E731
            low, high = ratio_interval(now, before)
            row = {"setting": sname, "method": name, "now_tok_s": mean(now), "before_tok_s": mean(before),
                   "now_over_before": mean(now) / mean(before), "ci_low": low, "ci_high": high,
                   "same_text": f"{sum(a['output_ids'] == b['output_ids'] for a, b in zip(now, before))}/{len(now)}"}
            if base_now and name != "vanilla":
                row["now_over_vanilla_now"] = mean(now) / mean(base_now)
                row["vs_vanilla_low"], row["vs_vanilla_high"] = ratio_interval(now, base_now)
            rows.append(row)
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "sampling.csv", index=False)
    print(table.round(4).to_string(index=False))
    (args.out / "sampling_config.json").write_text(json.dumps({
        "profile": profile.to_dict(), "settings": {k: v.__dict__ for k, v in settings.items()},
        "questions": args.limit, "max_new_tokens": args.max_new_tokens, "methods": names,
        "run_dir": str(args.run_dir),
        "environment": run_metadata(target.device, threads=torch.get_num_threads())}, indent=2, default=str))


if __name__ == "__main__":
    main()
