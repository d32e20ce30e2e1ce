"""Greedy decoding's argmax through the package's C++ kernel (fast_paths.argmax_rows) against torch.argmax, side by
side in one process.

The argmax alone over the target's vocabulary at 1, 2 and 8 rows, then plain decoding, jakiro_auto and jakiro (8
tokens) on the default profile, each prompt decoded both ways back to back (which first alternating); the outputs
must be equal token for token.

    python reports/measured/2026-11-29-argmax-kernel-cpu/argmax.py --run-dir runs/default \
        --out reports/measured/2026-11-29-argmax-kernel-cpu
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
from jakiro_lib.measure.methods import study_methods
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.decoding import static_tree
from jakiro_lib.models import fast_paths
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

SETTINGS = {"data.num_conversations": "800", "train.epochs": "2"}  # the drafts' scale (runs/default)
METHODS = ("vanilla", "jakiro_auto", "jakiro")


KERNEL = static_tree.argmax_rows


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


@contextlib.contextmanager
def argmax_kernel(model: torch.nn.Module, on: bool):
    """The kernel (on) or torch.argmax (off), where the engine reads the argmax (static_tree's name for it)."""
    static_tree.argmax_rows = KERNEL if on else torch_argmax
    try:
        yield
    finally:
        static_tree.argmax_rows = KERNEL


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

    rows = []
    for m in (1, 2, 8):
        logits = torch.randn(m, model.config.vocab_size, generator=torch.Generator().manual_seed(m))
        assert torch.equal(KERNEL(logits), torch_argmax(logits))
        times = {"kernel": [], "torch": []}
        for _ in range(9):
            for name, f in (("kernel", KERNEL), ("torch", torch_argmax)):
                t0 = time.perf_counter()
                for _ in range(200):
                    f(logits)
                times[name].append((time.perf_counter() - t0) / 200)
        k, t = (1e6 * sorted(times[n])[4] for n in ("kernel", "torch"))
        rows.append({"rows": m, "kernel_us": k, "torch_us": t, "ratio": k / t})
    alone = pd.DataFrame(rows)
    alone.to_csv(args.out / "argmax.csv", index=False)
    print(alone.round(3).to_string(index=False), flush=True)

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
            with argmax_kernel(model, on):
                static_generate(model, drafts[name], ours[name].tree, prompts[0][1], **common)
    records, t0 = [], time.perf_counter()
    for i, (qid, ids) in enumerate(prompts):
        for name, spec in ours.items():
            outputs = {}
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                with argmax_kernel(model, on):
                    res = static_generate(model, drafts[name], spec.tree, ids, **common)
                outputs[on] = res.output_ids
                records.append({"method": name, "path": "kernel" if on else "torch",
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
        b = [r for r in records if r["method"] == name and r["path"] == "torch"]
        mean = lambda rs: sum(r["tokens_per_second"] for r in rs) / len(rs)  # noqa: E731
        low, high = ratio_interval(a, b)
        rows.append({"method": name, "kernel_tok_s": mean(a), "torch_tok_s": mean(b), "ratio": mean(a) / mean(b),
                     "ci_low": low, "ci_high": high, "same_outputs": f"{len(a)}/{len(b)}"})
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "decoding.csv", index=False)
    print(table.round(3).to_string(index=False))
    (args.out / "argmax_config.json").write_text(json.dumps({
        "profile": profile.to_dict(), "settings": SETTINGS, "methods": {k: {"tree": m.tree and m.tree.__dict__}
                                                                         for k, m in ours.items()},
        "questions": args.limit, "max_new_tokens": args.max_new_tokens,
        "environment": run_metadata(target.device, threads=torch.get_num_threads())}, indent=2, default=str))


if __name__ == "__main__":
    main()
