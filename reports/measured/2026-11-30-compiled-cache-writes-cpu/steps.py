"""Plain decoding's step on the CPU, eager (target.capture "none") and compiled by inductor ("inductor"), side by side:
the default profile's target, MT-bench questions 1-6 (first turns), 64 new tokens, greedy, the two alternated per prompt.

    python reports/measured/2026-11-30-compiled-cache-writes-cpu/steps.py --out reports/measured/2026-11-30-compiled-cache-writes-cpu

Writes steps.csv (per prompt and capture: ms a step, the text the same) and steps_config.json (machine, versions).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.decoding.static import static_generate
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import cycle_prompts
from jakiro_lib.models.target import load_target, set_capture
from jakiro_lib.profiles import get_profile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    profile = get_profile("default")
    target = load_target(profile.target)
    model = target.model
    prompts = cycle_prompts(profile, target, args.prompts)

    def step_ms(capture: str, ids: torch.Tensor, tokens: int) -> tuple[float, list[int]]:
        set_capture(model, capture)
        r = static_generate(model, None, None, ids, max_new_tokens=tokens, eos_token_ids=target.eos_token_ids,
                            max_context=target.config.max_context, compile=capture == "inductor")
        return 1e3 * (r.wall_time - r.prefill_time) / r.cycles, r.output_ids

    t0 = time.perf_counter()
    step_ms("inductor", prompts[0], 8)  # compiles
    compile_s = time.perf_counter() - t0
    step_ms("none", prompts[0], 8)
    rows = []
    for i, ids in enumerate(prompts):
        out = {}
        for capture in ("none", "inductor") if i % 2 == 0 else ("inductor", "none"):
            ms, out[capture] = step_ms(capture, ids, args.tokens)
            rows.append({"prompt": i, "capture": capture, "ms_per_step": ms})
        rows[-1]["same_text"] = rows[-2]["same_text"] = out["none"] == out["inductor"]
    df = pd.DataFrame(rows)
    df.to_csv(args.out / "steps.csv", index=False, float_format="%.2f")
    for capture, g in df.groupby("capture"):
        print(f"{capture}: median {statistics.median(g.ms_per_step):.1f} ms a step; same text on every prompt: "
              f"{bool(g.same_text.all())}")
    meta = {"prompts": args.prompts, "max_new_tokens": args.tokens, "first_compile_s": round(compile_s, 1),
            **run_metadata(target.device, threads=torch.get_num_threads())}
    (args.out / "steps_config.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
