"""The one engine against the loop engine it replaces, every main-study method, one interleaved run (CPU); the script
of ../2026-11-29-engines-cpu-g/, rerun as it was with the runtime's defaults (greedy decoding's screened head on).

    python reports/measured/2026-11-30-engines-cpu/engines.py --run-dir runs/default \
        --out reports/measured/2026-11-30-engines-cpu

MT-bench q1-10, both turns (20 prompts; each run continues from its own answer), 64 new tokens, T=0, fp32, the
default profile's target and drafts. Question by question, turn by turn, every method runs on the engine
(``decoding.static``, eager) and on the loop engine (``tests/reference``, the runtime engine on a CPU before), the
two runs of a method back to back, which goes first alternating prompt by prompt; plain decoding on both and HF's
compiled generate are timed beside them. Writes records.jsonl and engines.csv: per
method, tokens/s on each engine, the ratio engine / loop with its paired 95% bootstrap interval, greedy identity with
the loop's plain decoding, and for jakiro (the fixed tree) and jakiro_auto the ratio against the fastest plain
decoder of the run with its interval. The tuned budgets are the engine's (tree_budgets.json), the same on both.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # the loop engine: the tests' reference

from reference.drafting import make_drafter  # noqa: E402
from reference.loop import speculative_generate, vanilla_generate  # noqa: E402

from jakiro_lib.config import OUR_KINDS, SPEC  # noqa: E402
from jakiro_lib.data.chat import answer_message, format_prompt_ids
from jakiro_lib.data.conversations import load_questions
from jakiro_lib.decoding.hf import hf_generate
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, default=Path("runs/default"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--greedy-head", choices=("on", "off"), default="on")
    args = ap.parse_args()
    profile = get_profile("default", **SETTINGS, **{"target.greedy_head": str(args.greedy_head == "on").lower()})
    target = load_target(profile.target)
    main_methods = study_methods(profile.tree, RunLayout(args.run_dir).drafts, compiled=False, drafts=profile.drafts,
                                 eagle2_draft=profile.bench.eagle2_draft, jakiro_draft=profile.bench.jakiro_draft)
    ours = {k: m for k, m in main_methods.items() if m.kind in OUR_KINDS}
    ours, _ = resolve_tree_budgets(profile, args.run_dir, ours, target)
    drafts = {k: DraftModel.load(m.draft, target.model) if m.kind == SPEC and m.draft else None for k, m in ours.items()}
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=target.eos_token_ids,
                  max_context=target.config.max_context)

    def run(name: str, engine: str, ids: torch.Tensor):
        spec, draft = ours.get(name), drafts.get(name)
        if engine == "hf":
            return hf_generate(target.model, ids, compile=True, max_context=target.config.max_context,
                               **{k: v for k, v in common.items() if k != "max_context"})
        if engine == "static":
            return static_generate(target.model, draft, spec.tree, ids, **common)
        if spec.kind == "vanilla":
            return vanilla_generate(target.model, ids, **common)
        return speculative_generate(target.model, make_drafter(draft, spec.tree), ids, **common)

    runs = [(n, e) for n in ours for e in ("static", "loop")] + [("hf_compiled", "hf")]
    questions = load_questions("mt_bench", limit=args.limit)
    warm = format_prompt_ids(target, [{"role": "user", "content": questions[0].turns[0]}])
    for name, engine in runs:  # first calls load kernels; hf_compiled compiles here
        run(name, engine, warm)
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    t0 = time.perf_counter()
    for qi, q in enumerate(questions):
        histories = {r: [] for r in runs}
        for turn, text in enumerate(q.turns):
            flip = (2 * qi + turn) % 2 == 1  # which engine of a pair goes first alternates prompt by prompt
            for key in _ordered(runs, flip):
                histories[key].append({"role": "user", "content": text})
                res = run(*key, format_prompt_ids(target, histories[key]))
                histories[key].append(answer_message(target, res.output_ids))
                records.append({"method": key[0], "engine": key[1], "kind": "vanilla" if key[0] == "vanilla" else SPEC,
                                "benchmark": "mt_bench", "question_id": str(q.question_id), "turn": turn, "repeat": 0,
                                "temperature": 0.0, "tokens_per_second": res.tokens_per_second,
                                "new_tokens": res.new_tokens, "cycles": res.cycles, "accepted": res.accepted,
                                "output_ids": res.output_ids, "tree_sizes": res.tree_sizes})
        print(f"question {q.question_id} done, {time.perf_counter() - t0:.0f} s", flush=True)
    with open(args.out / "records.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    table = engines_table(records, list(ours))
    table.to_csv(args.out / "engines.csv", index=False)
    print(table.round(3).to_string(index=False))
    (args.out / "engines_config.json").write_text(json.dumps({
        "profile": profile.to_dict(), "methods": {k: {"draft": m.draft and Path(m.draft).parent.name,
                                                      "tree": m.tree and m.tree.__dict__} for k, m in ours.items()},
        "questions": args.limit, "max_new_tokens": args.max_new_tokens, "greedy_head": args.greedy_head,
        "environment": run_metadata(target.device, threads=torch.get_num_threads())}, indent=2, default=str))


def _ordered(runs: list[tuple[str, str]], flip: bool) -> list[tuple[str, str]]:
    """``runs`` with each method's (static, loop) pair swapped where ``flip``: neither engine always runs right after
    the other one's run of the same method (warm caches of its draft), nor always right after another method."""
    if not flip:
        return runs
    out = list(runs)
    for i in range(0, len(out) - 1, 2):
        if out[i][0] == out[i + 1][0]:
            out[i], out[i + 1] = out[i + 1], out[i]
    return out


def engines_table(records: list[dict], names: list[str]) -> pd.DataFrame:
    by = {}
    for r in records:
        by.setdefault((r["method"], r["engine"]), []).append(r)
    reference = {(r["question_id"], r["turn"]): r["output_ids"] for r in by[("vanilla", "loop")]}
    plain = {k: statistics.fmean(r["tokens_per_second"] for r in v) for k, v in by.items()
             if k[0] in ("vanilla", "hf_compiled")}
    fastest = max(plain, key=plain.get)
    rows = []
    for name in names:
        one, loop = by[(name, "static")], by[(name, "loop")]
        lo, hi = ratio_interval(one, loop)
        a, b = (statistics.fmean(r["tokens_per_second"] for r in x) for x in (one, loop))
        row = {"method": name, "engine_tokens_per_s": a, "loop_tokens_per_s": b, "ratio": a / b, "ci_low": lo,
               "ci_high": hi, "tau_engine": sum(sum(r["accepted"]) for r in one) / sum(r["cycles"] for r in one),
               "greedy_same": sum(r["output_ids"] == reference[(r["question_id"], r["turn"])] for r in one),
               "greedy_compared": len(one), "fastest_plain": "/".join(fastest)}
        if name in ("jakiro", "jakiro_auto"):
            flo, fhi = ratio_interval(one, by[fastest])
            row.update(vs_fastest_plain=a / plain[fastest], vs_fastest_ci_low=flo, vs_fastest_ci_high=fhi)
        rows.append(row)
    return pd.DataFrame(rows)


if __name__ == "__main__":
    main()
