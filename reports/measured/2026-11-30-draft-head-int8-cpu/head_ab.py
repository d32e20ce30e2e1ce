"""A bf16-weights draft's reduced head through an int8 copy on AMX's tiles (`DraftModel.logits`, `int8_linear`)
against the same draft's bf16 head (the streaming GEMM's bf16 panels), side by side in one process: the int8 copy
set aside (``_head_int8`` None) for the "bf16" runs.

First the head alone (each draft's, 1-8 rows, 50 calls each way interleaved, medians); then eagle2_auto, jakiro_auto,
eagle2, jakiro, jakiro_cepd and jakiro_lookup on the default profile with tuned budgets, each prompt decoded both ways
back to back (which first alternating): tokens/s ratio with a 95% bootstrap interval, tau each way, and how many
outputs equal vanilla's.

    python reports/measured/2026-11-30-draft-head-int8-cpu/head_ab.py --run-dir runs/default \\
        --out reports/measured/2026-11-30-draft-head-int8-cpu
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
from jakiro_lib.data.chat import format_prompt_ids
from jakiro_lib.data.conversations import load_questions
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.layout import RunLayout
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.budgets import resolve_tree_budgets
from jakiro_lib.measure.methods import study_methods
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models import kernels
from jakiro_lib.models.draft import DraftModel, resolve_draft_dtype
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

SETTINGS = {"data.num_conversations": "800", "train.epochs": "2"}  # the drafts' scale (runs/default)
METHODS = ("vanilla", "eagle2_auto", "jakiro_auto", "eagle2", "jakiro", "jakiro_cepd", "jakiro_lookup")
WAYS = ("int8", "bf16")


@contextlib.contextmanager
def way(drafts: list[DraftModel], name: str):
    kept = [d._head_int8 for d in drafts]
    if name == "bf16":
        for d in drafts:
            d._head_int8 = None
    try:
        yield
    finally:
        for d, k in zip(drafts, kept):
            d._head_int8 = k


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, default=Path("runs/default"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--summarize", action="store_true", help="decoding.csv from --out's records.jsonl only")
    args = ap.parse_args()
    if args.summarize:
        records = [json.loads(line) for line in open(args.out / "records.jsonl")]
        for r in records:  # the first run's records lack the summary's keys
            r.update(benchmark="mt_bench", turn=0, repeat=0)
        summarize(records, list(dict.fromkeys(r["method"] for r in records)), args.out)
        meta = run_metadata(torch.device("cpu"))
        meta.update(script="head_ab.py --summarize", profile="default", settings=SETTINGS, run_dir=str(args.run_dir),
                    limit=args.limit, max_new_tokens=args.max_new_tokens)
        (args.out / "head_config.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
        return
    assert kernels.stream_gemm_available() and torch.ops.jakiro_stream_gemm.tile_screen(), "no AMX tiles here"
    profile = get_profile("default", **SETTINGS)
    target = load_target(profile.target)
    model = target.model
    methods = study_methods(profile.tree, RunLayout(args.run_dir).drafts, compiled=False, drafts=profile.drafts,
                            eagle2_draft=profile.bench.eagle2_draft, jakiro_draft=profile.bench.jakiro_draft)
    ours = {k: m for k, m in methods.items() if m.kind in OUR_KINDS and k in METHODS}
    ours, _ = resolve_tree_budgets(profile, args.run_dir, ours, target)
    dtype = resolve_draft_dtype(profile.bench.draft_dtype, profile.target)  # as the benchmark loads them
    drafts = {k: DraftModel.load(m.draft, model, dtype) if m.kind == SPEC and m.draft else None
              for k, m in ours.items()}
    loaded = [d for d in drafts.values() if d is not None]
    args.out.mkdir(parents=True, exist_ok=True)

    rows, g = [], torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for d in loaded[:1]:
            for n in (1, 2, 4, 6, 8):
                x = torch.randn(n, model.config.hidden_size, generator=g)
                d.logits(x)  # packs
                times = {w: [] for w in WAYS}
                for _ in range(50):
                    for w in WAYS:
                        with way([d], w):
                            t0 = time.perf_counter()
                            d.logits(x)
                            times[w].append(time.perf_counter() - t0)
                rows.append({"rows": n, **{f"{w}_us": 1e6 * statistics.median(times[w]) for w in WAYS}})
    head = pd.DataFrame(rows)
    head.to_csv(args.out / "head.csv", index=False)
    print(head.round(1).to_string(index=False), flush=True)

    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=target.eos_token_ids,
                  max_context=target.config.max_context)
    questions = load_questions("mt_bench", limit=args.limit)
    prompts = [(q.question_id, format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}])) for q in questions]
    for name in ours:  # warm-up, both ways
        for w in WAYS:
            with way(loaded, w):
                static_generate(model, drafts[name], ours[name].tree, prompts[0][1], **common)
    records, t0 = [], time.perf_counter()
    for i, (qid, ids) in enumerate(prompts):
        for name, spec in ours.items():
            for w in (WAYS if i % 2 == 0 else tuple(reversed(WAYS))):
                with way(loaded, w):
                    res = static_generate(model, drafts[name], spec.tree, ids, **common)
                records.append({"method": name, "way": w, "benchmark": "mt_bench", "question_id": str(qid),
                                "turn": 0, "repeat": 0,
                                "tokens_per_second": res.tokens_per_second, "new_tokens": res.new_tokens,
                                "cycles": res.cycles, "accepted": res.accepted, "output_ids": res.output_ids})
        print(f"question {qid} done, {time.perf_counter() - t0:.0f} s", flush=True)
    with open(args.out / "records.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    summarize(records, list(ours), args.out)
    meta = run_metadata(model.device)
    meta.update(script="head_ab.py", profile="default", settings=SETTINGS, run_dir=str(args.run_dir),
                limit=args.limit, max_new_tokens=args.max_new_tokens, gemm=kernels.gemm_choice(model),
                budgets={k: m.tree.total_tokens for k, m in ours.items() if m.tree is not None})
    (args.out / "head_config.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


def summarize(records: list[dict], names: list[str], out_dir: Path) -> None:
    """decoding.csv from the records: each method's int8 / bf16 tokens/s, interval, tau each way, outputs equal."""
    out = {(r["method"], r["way"], r["question_id"]): r["output_ids"] for r in records}
    rows = []
    for name in names:
        a = [r for r in records if r["method"] == name and r["way"] == "int8"]
        b = [r for r in records if r["method"] == name and r["way"] == "bf16"]
        mean = lambda rs: sum(r["tokens_per_second"] for r in rs) / len(rs)  # noqa: E731
        tau = lambda rs: sum(r["new_tokens"] for r in rs) / max(1, sum(r["cycles"] for r in rs))  # noqa: E731
        low, high = ratio_interval(a, b)
        qids = [r["question_id"] for r in a]
        rows.append({"method": name, "int8_tok_s": mean(a), "bf16_tok_s": mean(b), "ratio": mean(a) / mean(b),
                     "ci_low": low, "ci_high": high, "int8_tau": tau(a), "bf16_tau": tau(b),
                     **{f"{w}_equals_vanilla": f"{sum(out[(name, w, q)] == out[('vanilla', w, q)] for q in qids)}"
                                               f"/{len(qids)}" for w in WAYS}})
    table = pd.DataFrame(rows)
    table.to_csv(out_dir / "decoding.csv", index=False)
    print(table.round(3).to_string(index=False), flush=True)


if __name__ == "__main__":
    main()
