"""A bf16-weights draft's reduced head through an int8 copy in the streaming GEMM's panels (a CPU without AMX:
`kernels.pack_int8_rows`, `int8_linear`, fp32 arithmetic on the int8 weights times each word's scale) against the
same head's bf16 panels, side by side in one process. First the head alone (the jakiro draft's, 1, 3 and 6 rows, warm
and after a 64 MB stream that leaves none of it cached, 100 calls each way interleaved, medians); then the default
main job's drafts decode MT-bench prompts greedily on the engine (the profile's `target.capture`), each prompt both
ways, the order turning prompt by prompt, plain decoding timed beside them as the unit: cycle time ratio with a 95%
bootstrap interval, tau each way, outputs against vanilla's.

    python reports/measured/2026-12-01-draft-head-int8-cpu/ab.py --run-dir runs/default \\
        --out reports/measured/2026-12-01-draft-head-int8-cpu
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import _generate, cycle_methods, cycle_prompts
from jakiro_lib.models import kernels
from jakiro_lib.models.draft import HEAD_PACK_MAX_ROWS, DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

METHODS = ("eagle2_auto", "jakiro_auto", "eagle2", "jakiro", "jakiro_cepd", "jakiro_lookup")
WAYS = ("int8", "bf16")


@contextlib.contextmanager
def way(draft: DraftModel, name: str, bf16: tuple):
    """The head as built (int8), or its bf16 panels with the int8 copy set aside."""
    kept = draft._head_int8, draft._head_packed
    if name == "bf16":
        draft._head_int8, draft._head_packed = None, bf16
    try:
        yield
    finally:
        draft._head_int8, draft._head_packed = kept


def bootstrap(ratios: list[float], rounds: int = 2000) -> tuple[float, float]:
    g = torch.Generator().manual_seed(0)
    x = torch.tensor(ratios)
    meds = sorted(float(x[torch.randint(len(x), (len(x),), generator=g)].median()) for _ in range(rounds))
    return meds[int(0.025 * rounds)], meds[int(0.975 * rounds) - 1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    assert kernels.stream_gemm_available() and not torch.ops.jakiro_stream_gemm.tile_screen(), "for CPUs without AMX"
    profile = get_profile("default", **{"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    methods = cycle_methods(profile, args.run_dir, target, ["vanilla", *METHODS])
    prompts = cycle_prompts(profile, target, args.prompts)
    drafts = {name: spec.load_draft(target) for name, spec in methods.items()}
    bf16 = {}
    with torch.inference_mode():
        for name, d in drafts.items():
            if d is not None:
                d.logits(torch.zeros(1, target.model.config.hidden_size))  # packs the int8 copy
                assert d._head_int8 is not None and d._head_int8[0].dim() == 3
                w = d.head_weight()
                bf16[name] = (w, kernels.pack_weight(w, HEAD_PACK_MAX_ROWS, kernels.HALF_WEIGHTS))
        head = {}
        d, flush = drafts["jakiro"], torch.empty(16 * 2**20)
        for rows in (1, 3, 6):
            x = torch.randn(rows, target.model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
            for cold in (False, True):
                times = {w: [] for w in WAYS}
                for _ in range(100):
                    for w in WAYS:
                        with way(d, w, bf16["jakiro"]):
                            if cold:
                                flush.add_(1.0)
                            t0 = time.perf_counter()
                            d.logits(x)
                            times[w].append(time.perf_counter() - t0)
                head[f"{rows} rows, {'cold' if cold else 'warm'}"] = {w: 1e6 * statistics.median(t) for w, t in times.items()}
    for name in methods:  # warm-up: kernels loaded, the trees compiled both ways
        for w in WAYS:
            with (way(drafts[name], w, bf16[name]) if name in bf16 else contextlib.nullcontext()):
                _generate(target, drafts[name], methods[name], prompts[0], 16, None)
    runs: dict[tuple[str, str], list[dict]] = {}
    vanilla: dict[int, list[int]] = {}
    for rep in range(args.repeats):
        for i, ids in enumerate(prompts):
            r = _generate(target, None, methods["vanilla"], ids, 64, None)
            vanilla[i] = r.output_ids
            runs.setdefault(("vanilla", "-"), []).append({"cycles": r.cycles, "seconds": r.wall_time - r.prefill_time})
            for name in METHODS:
                for w in (WAYS if (i + rep) % 2 == 0 else WAYS[::-1]):
                    with way(drafts[name], w, bf16[name]):
                        r = _generate(target, drafts[name], methods[name], ids, 64, None)
                    runs.setdefault((name, w), []).append(
                        {"prompt": i, "cycles": r.cycles, "tokens": len(r.output_ids),
                         "seconds": r.wall_time - r.prefill_time, "equal": r.output_ids == vanilla[i]})
    plain = sum(r["seconds"] for r in runs[("vanilla", "-")]) / sum(r["cycles"] for r in runs[("vanilla", "-")])
    rows = []
    for name in METHODS:
        row: dict = {"method": name}
        for w in WAYS:
            rs = runs[(name, w)]
            cycles = sum(r["cycles"] for r in rs)
            row[f"{w} ms/cycle"] = 1e3 * sum(r["seconds"] for r in rs) / cycles
            row[f"{w} cycle/plain"] = row[f"{w} ms/cycle"] / (1e3 * plain)
            row[f"{w} tau"] = sum(r["tokens"] for r in rs) / cycles
            row[f"{w} equal vanilla"] = f"{sum(r['equal'] for r in rs)}/{len(rs)}"
        ratios = [b["seconds"] / a["seconds"] for a, b in zip(runs[(name, "int8")], runs[(name, "bf16")])]
        row["bf16/int8 time (median)"] = statistics.median(ratios)
        row["95% interval"] = bootstrap(ratios)
        rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab.json").write_text(json.dumps({"head_us": head, "plain_ms": 1e3 * plain, "rows": rows,
                                                  "runs": {f"{k[0]}|{k[1]}": v for k, v in runs.items()}},
                                                 indent=2) + "\n")
    config = {"methods": ["vanilla", *METHODS], "ways": WAYS, "prompts": args.prompts, "repeats": args.repeats,
              "max_new_tokens": 64, "capture": profile.target.capture, "trees": {n: str(methods[n].tree) for n in METHODS},
              "run_dir": str(args.run_dir), "environment": run_metadata(target.model.device)}
    (args.out / "ab_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    for k, v in head.items():
        print(f"head {k}: int8 {v['int8']:.1f} us, bf16 {v['bf16']:.1f} us")
    print(f"plain step {1e3 * plain:.2f} ms")
    for row in rows:
        lo, hi = row["95% interval"]
        print(f"{row['method']:13s} int8 {row['int8 ms/cycle']:.2f} ms ({row['int8 cycle/plain']:.3f}, tau "
              f"{row['int8 tau']:.3f}, {row['int8 equal vanilla']}), bf16 {row['bf16 ms/cycle']:.2f} ms "
              f"({row['bf16 cycle/plain']:.3f}, tau {row['bf16 tau']:.3f}, {row['bf16 equal vanilla']}); bf16/int8 "
              f"time {row['bf16/int8 time (median)']:.3f} [{lo:.3f}, {hi:.3f}]")


if __name__ == "__main__":
    main()
