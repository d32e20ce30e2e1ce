"""RoPE through the package's C++ kernel (fast_paths.rope_pair) against torch's operators, side by side in one process.

The lean forward's queries and keys (and the draft's) rotated by one kernel call a layer, or by torch's seven
operators per tensor: T(n) of the verify forward at 1-8 rows (both back to back in each round), then plain decoding,
jakiro_auto and jakiro (8 tokens) on the default profile, each prompt decoded both ways back to back (which first
alternating); the outputs must be equal token for token.

    python reports/measured/2026-11-29-rope-kernel-cpu/rope.py --run-dir runs/default \
        --out reports/measured/2026-11-29-rope-kernel-cpu
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.config import OUR_KINDS, SPEC
from jakiro_lib.data.chat import format_prompt_ids
from jakiro_lib.data.conversations import load_questions
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.layout import RunLayout
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.budgets import resolve_tree_budgets
from jakiro_lib.measure.costmodel import measure_target_cost_variants
from jakiro_lib.measure.methods import study_methods
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models import fast_paths
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

SETTINGS = {"data.num_conversations": "800", "train.epochs": "2"}  # the drafts' scale (runs/default)
METHODS = ("vanilla", "jakiro_auto", "jakiro")


KERNEL = fast_paths.rope_pair


def torch_rope(q, k, cos, sin):
    return fast_paths._rope(q, cos, sin), fast_paths._rope(k, cos, sin)


@contextlib.contextmanager
def rope_kernel(model: torch.nn.Module, on: bool):
    """The kernel (on) or torch's operators (off), for the target's lean forward and the draft alike."""
    fast_paths.rope_pair = KERNEL if on else torch_rope  # the draft's attention calls it (draft._rotate)
    try:
        yield
    finally:
        fast_paths.rope_pair = KERNEL


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, default=Path("runs/default"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    profile = get_profile("default", **SETTINGS)
    target = load_target(profile.target)
    model = target.model
    assert model.__dict__[fast_paths.LEAN] is True, "lean_forward did not pass its check at load"
    args.out.mkdir(parents=True, exist_ok=True)

    variants = {"kernel": lambda: rope_kernel(model, True), "torch_ops": lambda: rope_kernel(model, False)}
    tn = measure_target_cost_variants(model, [1, 2, 4, 8], variants, repeats=9)
    tn_table = pd.DataFrame([{"n": n, **{f"{k}_ms": 1e3 * v for k, v in row.items()}} for n, row in tn.items()])
    tn_table["ratio"] = tn_table["kernel_ms"] / tn_table["torch_ops_ms"]
    for col in ("kernel", "torch_ops"):
        tn_table[f"{col}_x_t1"] = tn_table[f"{col}_ms"] / tn_table[f"{col}_ms"].iloc[0]
    tn_table.to_csv(args.out / "tn.csv", index=False)
    print(tn_table.round(3).to_string(index=False), flush=True)

    methods = study_methods(profile.tree, RunLayout(args.run_dir).drafts, compiled=False, drafts=profile.drafts,
                            eagle2_draft=profile.bench.eagle2_draft, jakiro_draft=profile.bench.jakiro_draft)
    ours = {k: m for k, m in methods.items() if m.kind in OUR_KINDS and k in METHODS}
    ours, _ = resolve_tree_budgets(profile, args.run_dir, ours, target)
    drafts = {k: DraftModel.load(m.draft, model) if m.kind == SPEC and m.draft else None for k, m in ours.items()}
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=target.eos_token_ids,
                  max_context=target.config.max_context)
    questions = load_questions("mt_bench", limit=args.limit)
    prompts = [(q.question_id, format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}])) for q in questions]
    for name in ours:  # first calls load kernels
        for on in (True, False):
            with rope_kernel(model, on):
                static_generate(model, drafts[name], ours[name].tree, prompts[0][1], **common)
    records, t0 = [], time.perf_counter()
    for i, (qid, ids) in enumerate(prompts):
        for name, spec in ours.items():
            outputs = {}
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                with rope_kernel(model, on):
                    res = static_generate(model, drafts[name], spec.tree, ids, **common)
                outputs[on] = res.output_ids
                records.append({"method": name, "path": "kernel" if on else "torch_ops",
                                "kind": "vanilla" if name == "vanilla" else SPEC, "benchmark": "mt_bench",
                                "question_id": str(qid), "turn": 0, "repeat": 0,
                                "tokens_per_second": res.tokens_per_second, "new_tokens": res.new_tokens,
                                "cycles": res.cycles, "accepted": res.accepted, "output_ids": res.output_ids})
            assert outputs[True] == outputs[False], f"{name}, question {qid}: the two paths' outputs differ"
        print(f"question {qid} done, {time.perf_counter() - t0:.0f} s", flush=True)
    with open(args.out / "records.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    rows = []
    for name in ours:
        a = [r for r in records if r["method"] == name and r["path"] == "kernel"]
        b = [r for r in records if r["method"] == name and r["path"] == "torch_ops"]
        mean = lambda rs: sum(r["tokens_per_second"] for r in rs) / len(rs)  # noqa: E731
        low, high = ratio_interval(a, b)
        rows.append({"method": name, "kernel_tok_s": mean(a), "torch_ops_tok_s": mean(b), "ratio": mean(a) / mean(b),
                     "ci_low": low, "ci_high": high, "same_outputs": f"{len(a)}/{len(b)}"})
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "decoding.csv", index=False)
    print(table.round(3).to_string(index=False))
    (args.out / "rope_config.json").write_text(json.dumps({
        "profile": profile.to_dict(), "settings": SETTINGS, "methods": {k: {"tree": m.tree and m.tree.__dict__}
                                                                         for k, m in ours.items()},
        "questions": args.limit, "max_new_tokens": args.max_new_tokens,
        "environment": run_metadata(target.device, threads=torch.get_num_threads())}, indent=2, default=str))


if __name__ == "__main__":
    main()
