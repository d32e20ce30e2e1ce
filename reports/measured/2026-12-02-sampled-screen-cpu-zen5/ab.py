"""Sampled decoding (T=1) with each row's draw through the head's screen (``fast_paths.sampled_argmax``, the package's
way) against the same engine drawing from the full head's logits by inverse CDF (``sampled_argmax`` answering None,
the way every sampled draw went before), side by side in one process: each prompt both ways with the same seed, the
order turning; per generation the seconds less the prefill, paired; tau both ways.

    python reports/measured/2026-12-02-sampled-screen-cpu-zen5/ab.py --run-dir runs/main5000 \\
        --set data.num_conversations=5000 --set train.epochs=4 > reports/measured/2026-12-02-sampled-screen-cpu-zen5/ab.txt
"""
from __future__ import annotations

import argparse
import random
import statistics
from collections import defaultdict
from pathlib import Path

import torch

from jakiro_lib.decoding.static import static_generate
from jakiro_lib.decoding.verify import SamplingParams
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import cycle_methods, cycle_prompts
from jakiro_lib.config import SPEC
from jakiro_lib.models import fast_paths
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

METHODS = ("vanilla", "jakiro_auto", "eagle2_auto", "jakiro", "eagle2", "jakiro_cepd")
WAYS = ("full", "screen")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--set", action="append", default=[], help="profile overrides, key=value (ints)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    profile = get_profile("default", **{k: int(v) for k, v in (s.split("=", 1) for s in args.set)})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, list(METHODS))
    prompts = cycle_prompts(profile, target, args.prompts)
    drafts = {n: methods[n].load_draft(target) if n != "vanilla" else None for n in METHODS}
    params = SamplingParams(temperature=args.temperature)
    screened = fast_paths.sampled_argmax
    print(run_metadata(target.device))

    def run(way: str, name: str, ids: torch.Tensor, seed: int):
        fast_paths.sampled_argmax = screened if way == "screen" else (lambda *a: None)
        try:
            spec = methods[name]
            return static_generate(target.model, drafts[name], spec.tree if spec.kind == SPEC else None, ids,
                                   max_new_tokens=64, eos_token_ids=target.eos_token_ids,
                                   max_context=target.config.max_context, params=params,
                                   generator=torch.Generator().manual_seed(seed))
        finally:
            fast_paths.sampled_argmax = screened

    seconds, tau, tokens = defaultdict(list), defaultdict(lambda: [0, 0]), defaultdict(int)
    with torch.inference_mode():
        for name in METHODS:  # warm-up
            for way in WAYS:
                run(way, name, prompts[0], 0)
        for rep in range(args.repeats):
            for i, ids in enumerate(prompts):
                for name in METHODS:
                    for way in WAYS[::1 if (i + rep) % 2 == 0 else -1]:
                        r = run(way, name, ids, 1000 * rep + i)
                        seconds[name, way].append((r.wall_time - r.prefill_time) / max(len(r.output_ids) - 1, 1))
                        tau[name, way][0] += sum(r.accepted)
                        tau[name, way][1] += r.cycles
                        tokens[name, way] += len(r.output_ids)
    rng = random.Random(0)
    plain = {way: seconds["vanilla", way] for way in WAYS}
    for name in METHODS:
        t = methods[name].tree
        tree = "" if t is None or name == "vanilla" else f" d{t.depth} k{t.top_k} n{t.total_tokens}"
        ratios = [f / s for f, s in zip(seconds[name, "full"], seconds[name, "screen"])]  # > 1: the screen faster
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        taus = " / ".join(f"{tau[name, w][0] / max(tau[name, w][1], 1):.3f}" for w in WAYS)
        ms = " / ".join(f"{1e3 * statistics.median(seconds[name, w]):.2f}" for w in WAYS)
        vs_plain = " / ".join(f"{statistics.median(p) / statistics.median(seconds[name, w]):.3f}"
                              for w, p in plain.items())
        print(f"{name}{tree}: speed screen / full {statistics.median(ratios):.3f} [{boot[50]:.3f}, {boot[1949]:.3f}] "
              f"({len(ratios)} paired generations); ms a token full / screen {ms}; tokens a cycle full / screen "
              f"{taus}; against plain decoding the same way, full / screen {vs_plain}", flush=True)


if __name__ == "__main__":
    main()
