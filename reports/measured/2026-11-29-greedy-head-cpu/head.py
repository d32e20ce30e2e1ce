"""Greedy decoding's head screened through its bf16 copy (fast_paths.greedy_argmax, target.greedy_head) against the
full fp32 head and its argmax, side by side in one process.

First the head alone on the hidden states greedy decoding met (1, 2 and 8 rows, the cache swept before each call, as
a decoding step finds the head after the layers), with how many words the screen left per row; then plain decoding,
jakiro_auto, jakiro (8 tokens) and jakiro_lookup on the default profile, each prompt decoded both ways back to back
(which first alternating); the outputs must be equal token for token.

    python reports/measured/2026-11-29-greedy-head-cpu/head.py --run-dir runs/default \
        --out reports/measured/2026-11-29-greedy-head-cpu
"""
from __future__ import annotations

import argparse
import json
import statistics
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
from jakiro_lib.models import fast_paths
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

SETTINGS = {"data.num_conversations": "800", "train.epochs": "2"}  # the drafts' scale (runs/default)
METHODS = ("vanilla", "jakiro_auto", "jakiro", "jakiro_lookup")


def candidates(model: torch.nn.Module, x: torch.Tensor) -> list[int]:
    """Per row of ``x`` [n, K], the words the screen leaves (its bound as head_screen sets it; the screen's dot
    products here in torch's order, not the kernel's, so a count may differ by a word where one sits at the edge)."""
    screen, bound = model.__dict__[fast_paths.SCREEN]
    w = model.lm_head.weight
    s = x @ w.bfloat16().float().T  # [n, V]
    margin = bound[None] * x.abs().sum(-1, keepdim=True) + 1e-30
    return ((s + margin) >= (s - margin).amax(-1, keepdim=True)).sum(-1).tolist()


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
    screen = model.__dict__[fast_paths.SCREEN]
    assert screen is not None and model.__dict__[fast_paths.LEAN] is True, "the head screen or lean forward is off"
    args.out.mkdir(parents=True, exist_ok=True)

    methods = study_methods(profile.tree, RunLayout(args.run_dir).drafts, compiled=False, drafts=profile.drafts,
                            eagle2_draft=profile.bench.eagle2_draft, jakiro_draft=profile.bench.jakiro_draft)
    ours = {k: m for k, m in methods.items() if m.kind in OUR_KINDS and k in METHODS}
    ours, _ = resolve_tree_budgets(profile, args.run_dir, ours, target)
    drafts = {k: DraftModel.load(m.draft, model) if m.kind == SPEC and m.draft else None for k, m in ours.items()}
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=target.eos_token_ids,
                  max_context=target.config.max_context)
    questions = load_questions("mt_bench", limit=args.limit)
    prompts = [(q.question_id, format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}])) for q in questions]

    # the rows the screened head met in greedy decoding (plain and jakiro's 8-token trees), for the head alone
    seen: list[torch.Tensor] = []
    kept = fast_paths.greedy_argmax

    def listening(m: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.clone())
        return kept(m, hidden)

    fast_paths.greedy_argmax = listening
    try:
        for name in ("vanilla", "jakiro"):
            for _, ids in prompts:
                static_generate(model, drafts[name], ours[name].tree, ids, **common)
    finally:
        fast_paths.greedy_argmax = kept
    counts = [c for x in seen for c in candidates(model, x)]
    singles = torch.cat([x for x in seen if x.shape[0] == 1])
    wide = [x for x in seen if x.shape[0] >= 8]
    sweep = torch.ones(200_000_000 // 4)  # 200 MB, past what this machine's cache holds

    def timed(f) -> float:
        sweep.sum()
        t0 = time.perf_counter()
        f()
        return time.perf_counter() - t0

    rows = []
    for n in (1, 2, 8):
        xs = [singles[i:i + n] for i in range(0, len(singles) - n, n)][:40] if n < 8 else [x[:8] for x in wide[:40]]
        for x in xs:
            assert torch.equal(kept(model, x), fast_paths.argmax_rows(model.lm_head(x)))
        times = {"screened": [], "full": []}
        for x in xs:
            for name, f in (("screened", lambda: kept(model, x)),
                            ("full", lambda: fast_paths.argmax_rows(model.lm_head(x)))):
                times[name].append(timed(f))
        s, f = (1e3 * statistics.median(times[k]) for k in ("screened", "full"))
        rows.append({"rows": n, "calls": len(xs), "screened_ms": s, "full_ms": f, "ratio": s / f})
    alone = pd.DataFrame(rows)
    alone.to_csv(args.out / "head.csv", index=False)
    cands = pd.Series(counts)
    summary = {"rows": len(counts), "median": float(cands.median()), "p90": float(cands.quantile(0.9)),
               "p99": float(cands.quantile(0.99)), "max": int(cands.max()), "mean": float(cands.mean())}
    print(alone.round(3).to_string(index=False), "\ncandidates per row:", summary, flush=True)

    for name in ours:  # warm-up, both ways
        for on in (True, False):
            model.__dict__[fast_paths.SCREEN] = screen if on else None
            static_generate(model, drafts[name], ours[name].tree, prompts[0][1], **common)
    records, t0 = [], time.perf_counter()
    for i, (qid, ids) in enumerate(prompts):
        for name, spec in ours.items():
            outputs = {}
            for on in ((True, False) if i % 2 == 0 else (False, True)):
                model.__dict__[fast_paths.SCREEN] = screen if on else None
                res = static_generate(model, drafts[name], spec.tree, ids, **common)
                outputs[on] = res.output_ids
                records.append({"method": name, "path": "screened" if on else "full",
                                "kind": "vanilla" if name == "vanilla" else SPEC, "benchmark": "mt_bench",
                                "question_id": str(qid), "turn": 0, "repeat": 0,
                                "tokens_per_second": res.tokens_per_second, "new_tokens": res.new_tokens,
                                "cycles": res.cycles, "accepted": res.accepted, "output_ids": res.output_ids})
            assert outputs[True] == outputs[False], f"{name}, question {qid}: the two heads' outputs differ"
        print(f"question {qid} done, {time.perf_counter() - t0:.0f} s", flush=True)
    model.__dict__[fast_paths.SCREEN] = screen
    with open(args.out / "records.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    rows = []
    for name in ours:
        a = [r for r in records if r["method"] == name and r["path"] == "screened"]
        b = [r for r in records if r["method"] == name and r["path"] == "full"]
        mean = lambda rs: sum(r["tokens_per_second"] for r in rs) / len(rs)  # noqa: E731
        low, high = ratio_interval(a, b)
        rows.append({"method": name, "screened_tok_s": mean(a), "full_tok_s": mean(b), "ratio": mean(a) / mean(b),
                     "ci_low": low, "ci_high": high, "same_outputs": f"{len(a)}/{len(b)}"})
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "decoding.csv", index=False)
    print(table.round(3).to_string(index=False))
    (args.out / "head_config.json").write_text(json.dumps({
        "profile": profile.to_dict(), "settings": SETTINGS, "methods": {k: {"tree": m.tree and m.tree.__dict__}
                                                                         for k, m in ours.items()},
        "questions": args.limit, "max_new_tokens": args.max_new_tokens, "candidates": summary,
        "bound_factor": 1.01 * (2.0 ** -8 + 2.02 * model.config.hidden_size * 2.0 ** -24),
        "environment": run_metadata(target.device, threads=torch.get_num_threads())}, indent=2, default=str))


if __name__ == "__main__":
    main()
