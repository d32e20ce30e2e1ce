"""The draft's tree pool compiled (target.capture "draft": one inductor call per tree, the cycle otherwise eager)
against the eager pool (capture "none"), side by side in one process, with plain decoding beside them.

The default main job's drafts (runs/default: 800 conversations x 2 epochs) and the main study's methods with their
trees as the benchmark resolves them, MT-bench q1-10 first turns, 64 new tokens, T=0; each prompt decoded both ways
back to back (which first alternating), after one warm-up generation per method and capture (the compilations); the
outputs must equal each other and plain decoding's, token for token.

    python reports/measured/2026-11-29-compiled-draft-cpu/draft.py --run-dir runs/default \
        --out reports/measured/2026-11-29-compiled-draft-cpu
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.decoding.compiled import graphs_compiled
from jakiro_lib.decoding.methods import MethodRunner, MethodSpec
from jakiro_lib.decoding.verify import SamplingParams
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import cycle_methods, cycle_prompts
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models.target import load_target, set_capture
from jakiro_lib.study.context import resolve_profile

METHODS = ("eagle2_auto", "jakiro_auto", "eagle2", "jakiro", "jakiro_cepd", "jakiro_lookup")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    profile = resolve_profile("default", {"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    specs = {"vanilla": MethodSpec("vanilla"), **cycle_methods(profile, args.run_dir, target, list(METHODS))}
    runners = {name: MethodRunner(target, spec) for name, spec in specs.items()}
    prompts = cycle_prompts(profile, target, args.limit)
    common = dict(max_new_tokens=args.max_new_tokens, params=SamplingParams(), seed=0)
    ways = {name: ("none",) if name == "vanilla" else ("none", "draft") for name in specs}
    t0 = time.perf_counter()
    for name, runner in runners.items():  # warm-up: kernels loaded, each tree's pool compiled
        for capture in ways[name]:
            set_capture(target.model, capture)
            runner(prompts[0], **{**common, "max_new_tokens": 16})
    compiled = graphs_compiled()
    print(f"warm-up {time.perf_counter() - t0:.0f} s, {compiled} graphs compiled", flush=True)
    records = []
    for i, ids in enumerate(prompts):
        plain = None
        for name, runner in runners.items():
            outputs = {}
            for capture in ways[name] if i % 2 == 0 else ways[name][::-1]:
                set_capture(target.model, capture)
                res = runner(ids, **common)
                outputs[capture] = res.output_ids
                records.append({"method": name, "capture": capture, "kind": specs[name].kind, "benchmark": "mt_bench",
                                "question_id": str(i + 1), "turn": 0, "repeat": 0,
                                "tokens_per_second": res.tokens_per_second, "new_tokens": res.new_tokens,
                                "accepted": res.accepted, "cycles": res.cycles, "output_ids": res.output_ids})
            plain = outputs["none"] if plain is None else plain
            assert all(o == plain for o in outputs.values()), f"prompt {i + 1}, {name}: outputs differ"
        print(f"prompt {i + 1} done, {time.perf_counter() - t0:.0f} s", flush=True)
    assert graphs_compiled() == compiled, "a timed generation compiled"
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "records.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)

    def runs(name: str, capture: str) -> list[dict]:
        return [r for r in records if r["method"] == name and r["capture"] == capture]

    def mean(rs: list[dict]) -> float:
        return sum(r["tokens_per_second"] for r in rs) / len(rs)

    plain = runs("vanilla", "none")
    rows = []
    for name in METHODS:
        a, b = runs(name, "draft"), runs(name, "none")
        low, high = ratio_interval(a, b)
        vs = {c: ratio_interval(runs(name, c), plain) for c in ("draft", "none")}
        rows.append({"method": name, "total_tokens": specs[name].tree.total_tokens,
                     "tau": sum(sum(r["accepted"]) for r in a) / sum(r["cycles"] for r in a),
                     "tau_none": sum(sum(r["accepted"]) for r in b) / sum(r["cycles"] for r in b),
                     "same_accepted": f"{sum(x['accepted'] == y['accepted'] for x, y in zip(a, b))}/{len(a)}",
                     "draft_tok_s": mean(a), "none_tok_s": mean(b), "ratio": mean(a) / mean(b), "ci_low": low,
                     "ci_high": high, "draft_vs_plain": mean(a) / mean(plain), "draft_vs_plain_low": vs["draft"][0],
                     "draft_vs_plain_high": vs["draft"][1], "none_vs_plain": mean(b) / mean(plain),
                     "none_vs_plain_low": vs["none"][0], "none_vs_plain_high": vs["none"][1],
                     "same_outputs": f"{sum(x['output_ids'] == y['output_ids'] for x, y in zip(a, b))}/{len(a)}"})
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "draft.csv", index=False)
    print(f"plain decoding {mean(plain):.2f} tokens/s")
    print(table.round(4).to_string(index=False))
    (args.out / "draft_config.json").write_text(json.dumps({
        "profile": profile.to_dict(), "methods": {n: str(specs[n]) for n in specs}, "questions": args.limit,
        "max_new_tokens": args.max_new_tokens, "graphs_compiled": compiled,
        "environment": run_metadata(target.device, threads=torch.get_num_threads())}, indent=2, default=str))


if __name__ == "__main__":
    main()
