"""How many words a bf16 screen of the target's head leaves for an exact greedy argmax (a measurement, no package change).

Greedy decoding needs only each row's argmax of the fp32 logits W x. With the head's weights rounded to bf16 (half the
bytes), each word's screened logit s_c differs from the computed fp32 one by at most
B_c = (2^-9 + 2.02 K u) * sum_k |x_k| |w_ck|   (bf16 rounding, then both fp32 dot products' accumulation, u = 2^-24),
and sum_k |x_k| |w_ck| <= ||x||_1 * max_k |w_ck| (the "cheap" bound: one norm a step, one number a word, stored).
Every word whose s_c + B_c reaches max_j (s_j - B_j) is a candidate, the argmax always among them; only those would
need their fp32 logits. This script decodes MT-bench prompts greedily with the default target, keeps the head's input
of every step, and counts the candidates under the cheap and the tight bound, checking that the argmax is among them.

    python reports/measured/2026-11-29-head-screen-cpu/screen.py --out reports/measured/2026-11-29-head-screen-cpu
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.data.chat import format_prompt_ids
from jakiro_lib.data.conversations import load_questions
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.machine import run_metadata
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    target = load_target(get_profile("default").target)
    model = target.model
    inputs: list[torch.Tensor] = []  # the head's input at each decoding step (the last row)
    hook = model.lm_head.register_forward_hook(lambda mod, inp, out: inputs.append(inp[0].reshape(-1, inp[0].shape[-1])[-1].clone()))
    for q in load_questions("mt_bench", limit=args.limit):
        ids = format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}])
        static_generate(model, None, None, ids, max_new_tokens=args.max_new_tokens, max_context=2048)
    hook.remove()
    w = model.lm_head.weight.detach()  # [V, K] fp32
    screened_w = w.bfloat16().float()
    factor = 2.0 ** -9 + 2.02 * w.shape[1] * 2.0 ** -24
    row_max = w.abs().amax(1)  # [V]
    rows = []
    for x in inputs:
        exact, screened = model.lm_head(x[None])[0], screened_w @ x  # the package's fp32 logits, the bf16 screen
        best = int(exact.argmax())
        for name, bound in (("cheap", factor * x.abs().sum() * row_max), ("tight", factor * (w.abs() @ x.abs()))):
            candidates = screened + bound >= (screened - bound).max()
            assert candidates[best], "the argmax fell outside the screen's candidates"
            rows.append({"bound": name, "candidates": int(candidates.sum()),
                         "margin": float(exact.topk(2).values.diff().abs()[0]), "bound_at_best": float(bound[best])})
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "screen.csv", index=False)
    summary = {name: {"steps": len(g), "median": statistics.median(g.candidates),
                      "p90": float(g.candidates.quantile(0.9)), "p99": float(g.candidates.quantile(0.99)),
                      "max": int(g.candidates.max())} for name, g in table.groupby("bound")}
    print(json.dumps(summary, indent=2))
    (args.out / "screen_config.json").write_text(json.dumps({
        "summary": summary, "questions": args.limit, "max_new_tokens": args.max_new_tokens, "factor": factor,
        "head": list(w.shape), "environment": run_metadata(target.device, threads=torch.get_num_threads())},
        indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
