"""A sampled root-only cycle (plain decoding at T > 0) drawing its token directly (static_tree.root_step now) against
the same draw through sampling_path's tensors (the code before, written out here), side by side in one process.

Plain decoding on the default target, MT-bench q1-10 first turns, 64 new tokens, T=1 (top_p 1); each prompt decoded
both ways back to back with the same seed (which first alternating); the outputs must be equal token for token.

    python reports/measured/2026-11-29-sampled-root-cpu/root.py --out reports/measured/2026-11-29-sampled-root-cpu
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.data.chat import format_prompt_ids
from jakiro_lib.data.conversations import load_questions
from jakiro_lib.decoding import static
from jakiro_lib.decoding.static import static_vanilla_generate
from jakiro_lib.decoding.static_tree import evaluate
from jakiro_lib.decoding.verify import SamplingParams
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

DIRECT = static.root_step


def through_tensors(target, token, params, uniforms, start, *, masked=True):
    """root_step as it was: the one-node tree's token through evaluate (sampling_path) at T > 0."""
    zero = torch.zeros(1, dtype=torch.long, device=token.device)
    tokens, anc = token.reshape(1), torch.ones(1, 1, dtype=torch.bool, device=token.device)
    out, _ = target.score(tokens, zero, anc if masked else None, start, params.greedy)
    bonus = out[0] if params.greedy else evaluate(params, tokens, zero, zero, anc, out, uniforms, 0)[2]
    token.copy_(bonus)
    return bonus


@contextlib.contextmanager
def root(direct: bool):
    static.root_step = DIRECT if direct else through_tensors
    try:
        yield
    finally:
        static.root_step = DIRECT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    profile = get_profile("default")
    target = load_target(profile.target)
    model = target.model
    params = SamplingParams(temperature=1.0)
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_ids=target.eos_token_ids,
                  max_context=target.config.max_context, params=params)
    questions = load_questions("mt_bench", limit=args.limit)
    prompts = [(q.question_id, format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}])) for q in questions]
    for direct in (True, False):
        with root(direct):
            static_vanilla_generate(model, prompts[0][1], generator=torch.Generator().manual_seed(0), **common)
    records, t0 = [], time.perf_counter()
    for i, (qid, ids) in enumerate(prompts):
        outputs = {}
        for direct in ((True, False) if i % 2 == 0 else (False, True)):
            with root(direct):
                res = static_vanilla_generate(model, ids, generator=torch.Generator().manual_seed(i), **common)
            outputs[direct] = res.output_ids
            records.append({"method": "vanilla", "path": "direct" if direct else "tensors", "kind": "vanilla",
                            "benchmark": "mt_bench", "question_id": str(qid), "turn": 0, "repeat": 0,
                            "tokens_per_second": res.tokens_per_second, "new_tokens": res.new_tokens,
                            "output_ids": res.output_ids})
        assert outputs[True] == outputs[False], f"question {qid}: the two draws differ"
        print(f"question {qid} done, {time.perf_counter() - t0:.0f} s", flush=True)
    with open(args.out / "records.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    a = [r for r in records if r["path"] == "direct"]
    b = [r for r in records if r["path"] == "tensors"]
    mean = lambda rs: sum(r["tokens_per_second"] for r in rs) / len(rs)  # noqa: E731
    low, high = ratio_interval(a, b)
    table = pd.DataFrame([{"method": "vanilla", "temperature": 1.0, "direct_tok_s": mean(a), "tensors_tok_s": mean(b),
                           "ratio": mean(a) / mean(b), "ci_low": low, "ci_high": high,
                           "same_outputs": f"{len(a)}/{len(b)}"}])
    table.to_csv(args.out / "root.csv", index=False)
    print(table.round(4).to_string(index=False))
    (args.out / "root_config.json").write_text(json.dumps({
        "profile": profile.to_dict(), "params": params.__dict__, "questions": args.limit,
        "max_new_tokens": args.max_new_tokens,
        "environment": run_metadata(target.device, threads=torch.get_num_threads())}, indent=2, default=str))


if __name__ == "__main__":
    main()
