"""Per-token decode time of the one engine against the loop reference (tests/reference), alternating prompt by prompt,
prefill left out: plain decoding (and the loop at the engine's cache capacity) and jakiro_auto's 2-token decoupled
trees, the rows the side-by-side engine tables put below 1.0.

    python reports/measured/2026-11-29-engines-ab-cpu/ab.py --run-dir runs/default --out reports/measured/2026-11-29-engines-ab-cpu

Writes ab.csv (per variant: mean and median ms a token, the paired ratio loop / variant with its 95% bootstrap
interval) and ab_config.json (settings, environment).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # the loop engine: the tests' reference
import reference.loop as loop  # noqa: E402
from reference.drafting import FeatureDrafter  # noqa: E402

from jakiro_lib.data.chat import format_prompt_ids  # noqa: E402
from jakiro_lib.data.conversations import load_questions  # noqa: E402
from jakiro_lib.decoding.runner import MAX_TREE_ROOM  # noqa: E402
from jakiro_lib.decoding.static import engine_cache_len, static_generate  # noqa: E402
from jakiro_lib.layout import RunLayout, draft_path  # noqa: E402
from jakiro_lib.machine import run_metadata  # noqa: E402
from jakiro_lib.measure.summary import ratio_interval  # noqa: E402
from jakiro_lib.models.draft import DraftModel  # noqa: E402
from jakiro_lib.models.target import load_target  # noqa: E402
from jakiro_lib.profiles import get_profile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, default=Path("runs/default"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    profile = get_profile("default")
    target = load_target(profile.target)
    model = target.model
    draft = DraftModel.load(draft_path(RunLayout(args.run_dir).drafts, profile.bench.jakiro_draft), model)
    tree = dataclasses.replace(profile.tree, total_tokens=2, decoupled=True)  # jakiro_auto as tuned here
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=[], max_context=target.config.max_context)
    exact = loop.text_positions

    def loop_at_engine_capacity(ids: torch.Tensor):
        loop.text_positions = lambda p, n, c: engine_cache_len(exact(p, n, c) + MAX_TREE_ROOM)
        try:
            return loop.vanilla_generate(model, ids, **common)
        finally:
            loop.text_positions = exact

    groups = {
        "vanilla": {"loop": lambda ids: loop.vanilla_generate(model, ids, **common),
                    "engine": lambda ids: static_generate(model, None, None, ids, **common),
                    "loop_at_engine_capacity": loop_at_engine_capacity},
        "jakiro_auto": {"loop": lambda ids: loop.speculative_generate(model, FeatureDrafter(draft, tree), ids, **common),
                        "engine": lambda ids: static_generate(model, draft, tree, ids, **common)},
    }
    questions = load_questions("mt_bench", limit=args.limit)
    prompts = [format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}]) for q in questions]
    rows = []
    for method, variants in groups.items():
        names = list(variants)
        for fn in variants.values():  # first calls load kernels
            fn(prompts[0])
        ms: dict[str, list[dict]] = {k: [] for k in names}
        for r in range(args.rounds):
            for i, ids in enumerate(prompts):
                shift = (i + r) % len(names)  # which variant goes first rotates prompt by prompt
                outputs = {}
                for k in names[shift:] + names[:shift]:
                    res = variants[k](ids)
                    outputs[k] = res.output_ids
                    # as summary.ratio_interval reads a record: speed of one prompt, paired by prompt and round
                    ms[k].append({"benchmark": "mt_bench", "question_id": str(i), "turn": r, "repeat": 0,
                                  "tokens_per_second": (res.new_tokens - 1) / (res.wall_time - res.prefill_time)})
                assert len({tuple(o) for o in outputs.values()}) == 1, "the engines disagree"
            print(method, "round", r, flush=True)
        for k in names:
            lo, hi = ratio_interval(ms[k], ms["loop"])
            per_token = [1e3 / x["tokens_per_second"] for x in ms[k]]
            rows.append({"method": method, "variant": k, "ms_per_token_mean": statistics.mean(per_token),
                         "ms_per_token_median": statistics.median(per_token),
                         "speed_vs_loop": statistics.fmean(x["tokens_per_second"] for x in ms[k])
                         / statistics.fmean(x["tokens_per_second"] for x in ms["loop"]),
                         "ci_low": lo, "ci_high": hi, "prompts": len(per_token)})
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "ab.csv", index=False)
    (args.out / "ab_config.json").write_text(json.dumps({
        "questions": args.limit, "rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
        "draft": profile.bench.jakiro_draft, "tree": dataclasses.asdict(tree),
        "environment": run_metadata(target.device, threads=torch.get_num_threads())}, indent=2, default=str) + "\n")
    print(table.round(4).to_string(index=False))


if __name__ == "__main__":
    main()
