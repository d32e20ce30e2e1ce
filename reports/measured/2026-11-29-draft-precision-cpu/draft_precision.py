"""One draft step (a frontier of w nodes: forward, logits, top-k) with the draft's own layers in fp32 and in bf16,
the target (and the borrowed head) in fp32, rounds interleaved; the default main job's trained drafts.

    python reports/measured/2026-11-29-draft-precision-cpu/draft_precision.py --run-dir runs/default --out DIR
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import measure_draft_costs
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

DRAFTS, WIDTHS, DTYPES, ROUNDS = ("dense", "moe2_xgate"), (1, 4, 8), ("float32", "bfloat16"), 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    target = load_target(get_profile("default").target)
    drafts = {(n, d): DraftModel.load(args.run_dir / "drafts" / n / "draft", target.model, dtype=getattr(torch, d))
              for n in DRAFTS for d in DTYPES}
    times: dict[tuple[str, str, int], list[float]] = {}
    with torch.inference_mode():
        for _ in range(ROUNDS):
            for (name, dtype), draft in drafts.items():
                for w, s in measure_draft_costs(draft, WIDTHS, repeats=15).items():
                    times.setdefault((name, dtype, w), []).append(1e3 * s)
    rows = [{"draft": n, "dtype": d, "width": w, "ms": round(statistics.median(v), 3)} for (n, d, w), v in times.items()]
    table = pd.DataFrame(rows)
    fp32 = table[table.dtype == "float32"].set_index(["draft", "width"])["ms"]
    table["vs_fp32"] = [round(r.ms / fp32[(r.draft, r.width)], 3) for r in table.itertuples()]
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "draft_precision.csv", index=False)
    (args.out / "environment.json").write_text(json.dumps(run_metadata("cpu", rounds=ROUNDS), indent=2) + "\n")
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
