"""fp32 drafts against bf16-weights drafts on a CPU with AMX (bf16 copies of the draft's weights through the
streaming GEMM, fp32 arithmetic: what ``bench.draft_dtype=bfloat16`` means on a CPU without AMX), side by side in one
interleaved run. The package casts a bf16 draft whole where it finds AMX; this script hides AMX from that one check
(``jakiro_lib.models.draft.cpu_flags``) so that "bfloat16" takes the streaming path here.

    python reports/measured/2026-11-30-draft-bf16-weights-amx-cpu/precision.py --run-dir runs/default --out reports/measured/2026-11-30-draft-bf16-weights-amx-cpu

MT-bench q1-10, both turns (each run continues from its own answer), 64 new tokens, T=0, the default profile's target
(fp32) and drafts, each precision's tuned budgets (tree_budgets.json). Prompt by prompt: plain decoding, then every
drafted method in both precisions back to back, which precision first alternating by prompt. Writes records.jsonl and
precision.csv: per method, tokens/s in each precision, the ratio bf16 weights / fp32 with its paired 95% bootstrap
interval, each against plain decoding with its interval, tau, greedy identity with plain decoding.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.config import OUR_KINDS
from jakiro_lib.data.chat import answer_message, format_prompt_ids
from jakiro_lib.data.conversations import load_questions
from jakiro_lib.decoding.methods import MethodRunner, MethodSpec
from jakiro_lib.decoding.verify import SamplingParams
from jakiro_lib.layout import RunLayout
from jakiro_lib.machine import environment
from jakiro_lib.measure.budgets import resolve_tree_budgets
from jakiro_lib.measure.methods import study_methods
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models import kernels
from jakiro_lib.models import draft as draft_module
from jakiro_lib.models.draft import resolve_draft_dtype
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

SETTINGS = {"data.num_conversations": "800", "train.epochs": "2"}  # the drafts' scale (runs/default)
NAMES = ("eagle2", "jakiro", "jakiro_cepd", "eagle2_auto", "jakiro_auto", "jakiro_lookup")
PRECISIONS = ("fp32", "bf16w")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, default=Path("runs/default"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    flags = draft_module.cpu_flags()
    draft_module.cpu_flags = lambda: tuple(f for f in flags if not f.startswith("amx"))  # the streaming path here
    profiles = {"fp32": get_profile("default", **SETTINGS, **{"bench.draft_dtype": "target"}),
                "bf16w": get_profile("default", **SETTINGS, **{"bench.draft_dtype": "bfloat16"})}
    target = load_target(profiles["fp32"].target)
    runners: dict[tuple[str, str], MethodRunner] = {("vanilla", "fp32"): MethodRunner(target, MethodSpec("vanilla"))}
    specs = {}
    for precision, profile in profiles.items():
        methods = study_methods(profile.tree, RunLayout(args.run_dir).drafts, compiled=False, drafts=profile.drafts,
                                eagle2_draft=profile.bench.eagle2_draft, jakiro_draft=profile.bench.jakiro_draft,
                                draft_dtype=resolve_draft_dtype(profile.bench.draft_dtype, profile.target))
        ours = {k: m for k, m in methods.items() if m.kind in OUR_KINDS and k in NAMES}
        ours, _ = resolve_tree_budgets(profile, args.run_dir, ours, target)
        for name, spec in ours.items():
            runners[(name, precision)] = MethodRunner(target, spec)
            specs[f"{name}/{precision}"] = {"draft": Path(spec.draft).parent.name if spec.draft else None,
                                            "tree": spec.tree.__dict__, "draft_dtype": spec.draft_dtype,
                                            "gemm": kernels.gemm_choice(runners[(name, precision)].draft)}
    params = SamplingParams()

    def run(key: tuple[str, str], ids: torch.Tensor):
        return runners[key](ids, max_new_tokens=args.max_new_tokens, params=params, seed=0)

    questions = load_questions("mt_bench", limit=args.limit)
    warm = format_prompt_ids(target, [{"role": "user", "content": questions[0].turns[0]}])
    for key in runners:  # first calls load kernels
        run(key, warm)
    records = []
    t0 = time.perf_counter()
    for qi, q in enumerate(questions):
        histories = {k: [] for k in runners}
        for turn, text in enumerate(q.turns):
            order = PRECISIONS if (2 * qi + turn) % 2 == 0 else PRECISIONS[::-1]
            keys = [("vanilla", "fp32")] + [(n, p) for n in NAMES for p in order]
            for key in keys:
                histories[key].append({"role": "user", "content": text})
                res = run(key, format_prompt_ids(target, histories[key]))
                histories[key].append(answer_message(target, res.output_ids))
                records.append({"method": key[0], "precision": key[1], "kind": "vanilla" if key[0] == "vanilla"
                                else "spec", "benchmark": "mt_bench", "question_id": str(q.question_id), "turn": turn,
                                "repeat": 0, "temperature": 0.0, "tokens_per_second": res.tokens_per_second,
                                "new_tokens": res.new_tokens, "cycles": res.cycles, "accepted": res.accepted,
                                "output_ids": res.output_ids, "tree_sizes": res.tree_sizes})
        print(f"question {q.question_id} done, {time.perf_counter() - t0:.0f} s", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "records.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    table = precision_table(records)
    table.to_csv(args.out / "precision.csv", index=False)
    print(table.round(3).to_string(index=False))
    (args.out / "precision_config.json").write_text(json.dumps({
        "profile": profiles["fp32"].to_dict(), "methods": specs, "questions": args.limit,
        "max_new_tokens": args.max_new_tokens, "target_gemm": kernels.gemm_choice(target.model),
        "environment": environment(target.device)}, indent=2, default=str))


def precision_table(records: list[dict]) -> pd.DataFrame:
    by: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        by.setdefault((r["method"], r["precision"]), []).append(r)
    plain = by[("vanilla", "fp32")]
    reference = {(r["question_id"], r["turn"]): r["output_ids"] for r in plain}
    mean = lambda rs: statistics.fmean(r["tokens_per_second"] for r in rs)  # noqa: E731
    rows = []
    for name in NAMES:
        a, b = by[(name, "bf16w")], by[(name, "fp32")]
        lo, hi = ratio_interval(a, b, measure="tokens_per_s")
        row = {"method": name, "fp32_tokens_per_s": mean(b), "bf16w_tokens_per_s": mean(a), "ratio": mean(a) / mean(b),
               "ci_low": lo, "ci_high": hi}
        for p, rs in (("fp32", b), ("bf16w", a)):
            vlo, vhi = ratio_interval(rs, plain, measure="tokens_per_s")
            row |= {f"{p}_vs_plain": mean(rs) / mean(plain), f"{p}_vs_plain_low": vlo, f"{p}_vs_plain_high": vhi,
                    f"{p}_tau": sum(sum(r["accepted"]) for r in rs) / sum(r["cycles"] for r in rs),
                    f"{p}_greedy_same": sum(r["output_ids"] == reference[(r["question_id"], r["turn"])] for r in rs)}
        row["prompts"] = len(a)
        rows.append(row)
    return pd.DataFrame(rows)


if __name__ == "__main__":
    main()
