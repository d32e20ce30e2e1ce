"""The head's tile screen (activations rounded to int16, split into bytes, AMX's int8 tiles: `stream_gemm.cpp`'s
greedy_head over the tile layout) against its fp32 screen (the same int8 panels laid out [P, K, L], converted to fp32
for FMAs), side by side in one process: both screens built from the same head, swapped in the target between runs.

First T(n), the target scoring an n-token tree on a 300-token cache (n = 1, 2, 4, 8, 16, 32), both ways back to back
in each of ``--rounds`` rounds (per-round ratios, their median and a 95% bootstrap interval); then plain decoding,
jakiro_auto, jakiro (8 tokens) and jakiro_lookup on the default profile, each prompt decoded both ways back to back
(which first alternating), with how many outputs equal vanilla's on the same path and the other path's.

    python reports/measured/2026-11-30-tile-screen-cpu/screen_ab.py --run-dir runs/default \
        --out reports/measured/2026-11-30-tile-screen-cpu
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
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
from jakiro_lib.measure.costmodel import measure_target_cost_variants
from jakiro_lib.measure.methods import study_methods
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

SETTINGS = {"data.num_conversations": "800", "train.epochs": "2"}  # the drafts' scale (runs/default)
METHODS = ("vanilla", "jakiro_auto", "jakiro", "jakiro_lookup")
SIZES = (1, 2, 4, 8, 16, 32)
PATHS = ("kernel", "torch")  # "kernel": the tile screen; "torch": the fp32 screen of the same panels
SCREENS: dict[str, tuple] = {}


@contextlib.contextmanager
def path(name: str):
    model = SCREENS["model"]
    kept = model.__dict__[fast_paths.SCREEN]
    model.__dict__[fast_paths.SCREEN] = SCREENS[name]
    try:
        yield
    finally:
        model.__dict__[fast_paths.SCREEN] = kept


def bootstrap(xs: list[float], reps: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(reps))
    return meds[int(0.025 * reps)], meds[int(0.975 * reps)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, default=Path("runs/default"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    profile = get_profile("default", **SETTINGS)
    target = load_target(profile.target)
    model = target.model
    assert model.__dict__[fast_paths.LEAN] is True and kernels.stream_gemm_available(), "the lean forward or kernels are off"
    screen = model.__dict__[fast_paths.SCREEN]
    assert screen is not None and screen[0].dim() == 4, "the tile screen is not built here"
    panels, scales = torch.ops.jakiro_stream_gemm.pack_int8(model.lm_head.weight.detach(), False)
    assert torch.equal(scales, screen[1])
    SCREENS.update(model=model, kernel=screen, torch=(panels, *screen[1:]))
    args.out.mkdir(parents=True, exist_ok=True)

    rounds = [measure_target_cost_variants(model, SIZES, {k: (lambda k=k: path(k)) for k in PATHS}, context=300,
                                           repeats=1, greedy=True) for _ in range(args.rounds)]
    rows = []
    for n in SIZES:
        ratios = [r[n]["kernel"] / r[n]["torch"] for r in rounds]
        low, high = bootstrap(ratios)
        rows.append({"n": n, **{f"{k}_ms": 1e3 * statistics.median(r[n][k] for r in rounds) for k in PATHS},
                     **{f"{k}_tn_t1": statistics.median(r[n][k] / r[1][k] for r in rounds) for k in PATHS},
                     "kernel_over_torch": statistics.median(ratios), "ci_low": low, "ci_high": high})
    costs = pd.DataFrame(rows)
    costs.to_csv(args.out / "costs.csv", index=False)
    print(costs.round(3).to_string(index=False), flush=True)

    methods = study_methods(profile.tree, RunLayout(args.run_dir).drafts, compiled=False, drafts=profile.drafts,
                            eagle2_draft=profile.bench.eagle2_draft, jakiro_draft=profile.bench.jakiro_draft)
    ours = {k: m for k, m in methods.items() if m.kind in OUR_KINDS and k in METHODS}
    ours, _ = resolve_tree_budgets(profile, args.run_dir, ours, target)
    drafts = {k: DraftModel.load(m.draft, model) if m.kind == SPEC and m.draft else None for k, m in ours.items()}
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=target.eos_token_ids,
                  max_context=target.config.max_context)
    questions = load_questions("mt_bench", limit=args.limit)
    prompts = [(q.question_id, format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}])) for q in questions]
    for name in ours:  # warm-up, both ways
        for way in PATHS:
            with path(way):
                static_generate(model, drafts[name], ours[name].tree, prompts[0][1], **common)
    records, t0 = [], time.perf_counter()
    for i, (qid, ids) in enumerate(prompts):
        for name, spec in ours.items():
            for way in (tuple(PATHS) if i % 2 == 0 else tuple(reversed(PATHS))):
                with path(way):
                    res = static_generate(model, drafts[name], spec.tree, ids, **common)
                records.append({"method": name, "path": way, "kind": "vanilla" if name == "vanilla" else SPEC,
                                "benchmark": "mt_bench", "question_id": str(qid), "turn": 0, "repeat": 0,
                                "tokens_per_second": res.tokens_per_second, "new_tokens": res.new_tokens,
                                "cycles": res.cycles, "accepted": res.accepted, "output_ids": res.output_ids})
        print(f"question {qid} done, {time.perf_counter() - t0:.0f} s", flush=True)
    with open(args.out / "records.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    out = {(r["method"], r["path"], r["question_id"]): r["output_ids"] for r in records}
    rows = []
    for name in ours:
        a = [r for r in records if r["method"] == name and r["path"] == "kernel"]
        b = [r for r in records if r["method"] == name and r["path"] == "torch"]
        mean = lambda rs: sum(r["tokens_per_second"] for r in rs) / len(rs)  # noqa: E731
        low, high = ratio_interval(a, b)
        qids = [r["question_id"] for r in a]
        rows.append({"method": name, "kernel_tok_s": mean(a), "torch_tok_s": mean(b), "ratio": mean(a) / mean(b),
                     "ci_low": low, "ci_high": high,
                     **{f"{way}_equals_vanilla": f"{sum(out[(name, way, q)] == out[('vanilla', way, q)] for q in qids)}"
                                                 f"/{len(qids)}" for way in PATHS},
                     "kernel_equals_torch": f"{sum(out[(name, 'kernel', q)] == out[(name, 'torch', q)] for q in qids)}"
                                           f"/{len(qids)}"})
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "decoding.csv", index=False)
    print(table.round(3).to_string(index=False), flush=True)
    meta = run_metadata(model.device)
    meta.update(script="screen_ab.py", profile="default", settings=SETTINGS, run_dir=str(args.run_dir),
                rounds=args.rounds, limit=args.limit, max_new_tokens=args.max_new_tokens, sizes=list(SIZES),
                context=300, gemm=kernels.gemm_choice(model),
                budgets={k: m.tree.total_tokens for k, m in ours.items() if m.tree is not None})
    (args.out / "screen_config.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
