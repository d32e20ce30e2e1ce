"""A draft's layers through int8 copies of their weights (`bench.draft_dtype="int8"`: each output column scaled into
[-127, 127], fp32 sums times the column's scale) against bf16 copies (`"bfloat16"`, what `"auto"` chose), side by side
in one process. First the jakiro draft's eleven linears alone (1, 4 and 8 rows, warm and after a 64 MB stream that
leaves none of them cached, 200 calls each way interleaved, medians); then the default main job's drafts decode
MT-bench first turns greedily on the engine (`target.capture` as given), each prompt both ways, the order turning
prompt by prompt, plain decoding timed beside them: tokens/s ratio int8 / bf16 and tau ratio with 95% paired
bootstrap intervals (`jakiro_lib.measure.summary.ratio_interval`), each way's cycle in plain steps, outputs against
vanilla's.

    python reports/measured/2026-12-01-draft-int8-cpu/ab.py --run-dir runs/default \\
        --out reports/measured/2026-12-01-draft-int8-cpu/compiled-tree [--capture none]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
from torch import nn

from jakiro_lib.files import write_table
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.measure.summary import ratio_interval
from jakiro_lib.models import kernels
from jakiro_lib.models.target import load_target, set_capture
from jakiro_lib.profiles import get_profile

METHODS = ("eagle2_auto", "jakiro_auto", "eagle2", "jakiro", "jakiro_cepd", "jakiro_lookup")
WAYS = {"int8": "int8", "bf16": "bfloat16"}


def linears_alone(drafts: dict, rows_list=(1, 4, 8), calls: int = 200) -> dict:
    """Median microseconds of the jakiro draft's linears in a row, each way, warm and cold."""
    flush, out = torch.empty(16 * 2**20), {}
    lins = {w: [m for m in d.modules() if isinstance(m, nn.Linear)] for w, d in drafts.items()}
    for rows in rows_list:
        xs = [torch.randn(rows, m.in_features) for m in lins["int8"]]
        for cold in (False, True):
            times = {w: [] for w in lins}
            for _ in range(calls):
                for w, ms in lins.items():
                    if cold:
                        flush.add_(1.0)
                    t0 = time.perf_counter()
                    for x, m in zip(xs, ms):
                        m(x)
                    times[w].append(time.perf_counter() - t0)
            out[f"{rows} rows, {'cold' if cold else 'warm'}"] = {w: round(1e6 * statistics.median(t), 1)
                                                                for w, t in times.items()}
    return out


def record(prompt: int, rep: int, r) -> dict:
    """What ratio_interval reads of a generation."""
    return {"benchmark": "mt_bench", "question_id": prompt, "turn": 1, "repeat": rep, "cycles": r.cycles,
            "accepted": list(r.accepted), "tokens_per_second": len(r.output_ids) / (r.wall_time - r.prefill_time),
            "seconds": r.wall_time - r.prefill_time, "output_ids": r.output_ids}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--capture", default=None, help="target.capture (default: the profile's)")
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    assert kernels.stream_gemm_available(), "the streaming GEMM is needed for reduced-precision drafts"
    profile = get_profile("default", **{"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    if args.capture is not None:
        set_capture(target.model, args.capture)
    base = cycle_methods(profile, args.run_dir, target, ["vanilla", *METHODS])
    methods = {(n, w): dataclasses.replace(base[n], draft_dtype=dt) for n in METHODS for w, dt in WAYS.items()}
    drafts = {key: spec.load_draft(target) for key, spec in methods.items()}
    backends = {"int8": kernels.INT8_WEIGHTS, "bf16": kernels.HALF_WEIGHTS}
    assert all(kernels.packed_gemm(d).backend == backends[key[1]] for key, d in drafts.items())
    prompts = cycle_prompts(profile, target, args.prompts)
    with torch.inference_mode():
        alone = linears_alone({w: drafts[("jakiro", w)] for w in WAYS})
    for key, spec in methods.items():  # warm-up: kernels loaded, the trees compiled
        _generate(target, drafts[key], spec, prompts[0], 16, None)
    runs: dict = {key: [] for key in methods}
    plain, vanilla = [], {}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            r = _generate(target, None, base["vanilla"], ids, 64, None)
            vanilla[i] = r.output_ids
            plain.append(record(i, rep, r))
            for name in METHODS:
                for w in (list(WAYS) if (i + rep) % 2 == 0 else list(WAYS)[::-1]):
                    r = _generate(target, drafts[(name, w)], methods[(name, w)], ids, 64, None)
                    runs[(name, w)].append({**record(i, rep, r), "equal": r.output_ids == vanilla[i]})
    plain_ms = 1e3 * sum(r["seconds"] for r in plain) / sum(r["cycles"] for r in plain)
    rows = []
    for name in METHODS:
        row: dict = {"method": name}
        for w in WAYS:
            rs = runs[(name, w)]
            cycles = sum(r["cycles"] for r in rs)
            row[f"{w}_cycle_per_plain"] = 1e3 * sum(r["seconds"] for r in rs) / cycles / plain_ms
            row[f"{w}_tau"] = sum(sum(r["accepted"]) for r in rs) / cycles
            row[f"{w}_equal_vanilla"] = f"{sum(r['equal'] for r in rs)}/{len(rs)}"
        a, b = runs[(name, "int8")], runs[(name, "bf16")]
        row["speed_int8_over_bf16"] = statistics.fmean(r["tokens_per_second"] for r in a) / statistics.fmean(
            r["tokens_per_second"] for r in b)
        row["speed_lo"], row["speed_hi"] = ratio_interval(a, b)
        row["tau_int8_over_bf16"] = row["int8_tau"] / row["bf16_tau"]
        row["tau_lo"], row["tau_hi"] = ratio_interval(a, b, measure="tau")
        rows.append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    write_table(args.out / "ab.csv", pd.DataFrame(rows))
    (args.out / "ab_config.json").write_text(json.dumps({
        "run_dir": str(args.run_dir), "capture": args.capture or profile.target.capture, "prompts": len(prompts),
        "repeats": args.repeats, "plain_ms": plain_ms, "linears_alone_us": alone,
        "environment": run_metadata(target.device)}, indent=2, default=str))
    print(json.dumps(alone, indent=1))


if __name__ == "__main__":
    main()
