"""The prefill's head on the last position alone (TargetRunner.prefill(..., last=True), as the engine asks) against the
head on every prompt position, side by side in one process.

Plain decoding and jakiro_auto on the default profile, MT-bench q1-10 both turns (each run continues from its own
answer), 64 new tokens, T=0; each prompt decoded both ways back to back, which first alternating; the outputs must be
equal token for token. Tokens per second count the prefill, as every benchmark of the package does.

    python reports/measured/2026-11-29-prefill-head-cpu/prefill.py --run-dir runs/default \
        --out reports/measured/2026-11-29-prefill-head-cpu
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

from jakiro_lib.config import OUR_KINDS, SPEC
from jakiro_lib.data.chat import answer_message, format_prompt_ids
from jakiro_lib.data.conversations import load_questions
from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.layout import RunLayout
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.budgets import resolve_tree_budgets
from jakiro_lib.measure.methods import study_methods
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

SETTINGS = {"data.num_conversations": "800", "train.epochs": "2"}  # the drafts' scale (runs/default)
METHODS = ("vanilla", "jakiro_auto")
LAST_ONLY = TargetRunner.prefill


def every_position(self: TargetRunner, ids: torch.Tensor, *, last: bool = False):
    """The prefill as before: the head on every prompt position, whatever the caller asks."""
    return LAST_ONLY(self, ids)


@contextlib.contextmanager
def prefill_head(last: bool):
    TargetRunner.prefill = LAST_ONLY if last else every_position
    try:
        yield
    finally:
        TargetRunner.prefill = LAST_ONLY


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
    methods = study_methods(profile.tree, RunLayout(args.run_dir).drafts, compiled=False, drafts=profile.drafts,
                            eagle2_draft=profile.bench.eagle2_draft, jakiro_draft=profile.bench.jakiro_draft)
    ours = {k: m for k, m in methods.items() if m.kind in OUR_KINDS and k in METHODS}
    ours, _ = resolve_tree_budgets(profile, args.run_dir, ours, target)
    drafts = {k: DraftModel.load(m.draft, model) if m.kind == SPEC and m.draft else None for k, m in ours.items()}
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=target.eos_token_ids,
                  max_context=target.config.max_context)
    questions = load_questions("mt_bench", limit=args.limit)
    warm = format_prompt_ids(target, [{"role": "user", "content": questions[0].turns[0]}])
    for name in ours:
        for last in (True, False):
            with prefill_head(last):
                static_generate(model, drafts[name], ours[name].tree, warm, **common)
    args.out.mkdir(parents=True, exist_ok=True)
    records, t0 = [], time.perf_counter()
    for qi, q in enumerate(questions):
        histories = {(name, last): [] for name in ours for last in (True, False)}
        for turn, text in enumerate(q.turns):
            for name, spec in ours.items():
                outputs = {}
                for last in ((True, False) if (2 * qi + turn) % 2 == 0 else (False, True)):
                    history = histories[(name, last)]
                    history.append({"role": "user", "content": text})
                    ids = format_prompt_ids(target, history)
                    with prefill_head(last):
                        res = static_generate(model, drafts[name], spec.tree, ids, **common)
                    history.append(answer_message(target, res.output_ids))
                    outputs[last] = res.output_ids
                    records.append({"method": name, "path": "last" if last else "every", "benchmark": "mt_bench",
                                    "kind": "vanilla" if name == "vanilla" else SPEC, "question_id": str(q.question_id),
                                    "turn": turn, "repeat": 0, "prompt_tokens": int(ids.numel()),
                                    "prefill_s": res.prefill_time, "wall_s": res.wall_time,
                                    "tokens_per_second": res.tokens_per_second, "new_tokens": res.new_tokens,
                                    "output_ids": res.output_ids})
                assert outputs[True] == outputs[False], f"{name}, question {q.question_id}: the outputs differ"
        print(f"question {q.question_id} done, {time.perf_counter() - t0:.0f} s", flush=True)
    with open(args.out / "records.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    rows = []
    for name in ours:
        a = [r for r in records if r["method"] == name and r["path"] == "last"]
        b = [r for r in records if r["method"] == name and r["path"] == "every"]
        mean = lambda rs, k: statistics.fmean(r[k] for r in rs)  # noqa: E731
        low, high = ratio_interval(a, b)
        rows.append({"method": name, "prompt_tokens": mean(a, "prompt_tokens"),
                     "prefill_ms_last": 1e3 * mean(a, "prefill_s"), "prefill_ms_every": 1e3 * mean(b, "prefill_s"),
                     "last_tok_s": mean(a, "tokens_per_second"), "every_tok_s": mean(b, "tokens_per_second"),
                     "ratio": mean(a, "tokens_per_second") / mean(b, "tokens_per_second"), "ci_low": low,
                     "ci_high": high, "same_outputs": f"{len(a)}/{len(b)}"})
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "prefill.csv", index=False)
    print(table.round(3).to_string(index=False))
    (args.out / "prefill_config.json").write_text(json.dumps({
        "profile": profile.to_dict(), "settings": SETTINGS, "methods": {k: {"tree": m.tree and m.tree.__dict__}
                                                                         for k, m in ours.items()},
        "questions": args.limit, "max_new_tokens": args.max_new_tokens,
        "environment": run_metadata(target.device, threads=torch.get_num_threads())}, indent=2, default=str))


if __name__ == "__main__":
    main()
