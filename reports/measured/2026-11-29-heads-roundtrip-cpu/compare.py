"""The default drafts beside their exported and re-imported copies: one row per method, tau and tokens/s of each,
how many prompts gave identical output ids and identical accepted lengths cycle by cycle; and whether each draft's
saved weights are equal tensor for tensor.

    python reports/measured/2026-11-29-heads-roundtrip-cpu/compare.py runs/default/bench/roundtrip/records.jsonl \
        runs/default-reimported/bench/roundtrip/records.jsonl --drafts runs/default/drafts \
        runs/default-reimported/drafts --out reports/measured/2026-11-29-heads-roundtrip-cpu

Writes roundtrip.csv and weights.csv, and copies both records files beside them (original.jsonl, reimported.jsonl).
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pandas as pd
import torch
from safetensors.torch import load_file


def load(path: Path) -> dict[tuple, dict]:
    with open(path) as fh:
        return {(r["method"], r["question_id"], r["turn"], r["temperature"]): r for r in map(json.loads, fh)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("original", type=Path)
    ap.add_argument("reimported", type=Path)
    ap.add_argument("--drafts", type=Path, nargs=2, required=True, metavar=("ORIGINAL", "REIMPORTED"))
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    a, b = load(args.original), load(args.reimported)
    rows = []
    for method in dict.fromkeys(k[0] for k in a):
        keys = [k for k in a if k[0] == method and k in b]
        tau = [sum(sum(x[k]["accepted"]) for k in keys) / max(sum(x[k]["cycles"] for k in keys), 1) for x in (a, b)]
        speed = [sum(x[k]["tokens_per_second"] for k in keys) / len(keys) for x in (a, b)]
        rows.append({"method": method, "prompts": len(keys), "tau_original": tau[0], "tau_reimported": tau[1],
                     "tokens_per_s_original": speed[0], "tokens_per_s_reimported": speed[1],
                     "identical_output": sum(a[k]["output_ids"] == b[k]["output_ids"] for k in keys),
                     "identical_accepted": sum(a[k]["accepted"] == b[k]["accepted"] for k in keys)})
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "roundtrip.csv", index=False)
    shutil.copyfile(args.original, args.out / "original.jsonl")
    shutil.copyfile(args.reimported, args.out / "reimported.jsonl")
    print(table.round(3).to_string(index=False))
    weights = []
    for name in ("dense", "moe2_xgate"):
        x, y = (load_file(str(d / name / "draft" / "model.safetensors")) for d in args.drafts)
        weights.append({"draft": name, "tensors": len(x), "same_keys": set(x) == set(y),
                        "equal": set(x) == set(y) and all(torch.equal(x[k], y[k]) for k in x)})
    pd.DataFrame(weights).to_csv(args.out / "weights.csv", index=False)
    print(pd.DataFrame(weights).to_string(index=False))


if __name__ == "__main__":
    main()
