"""Operators dispatched per cycle by the engine and by the loop reference on the tests' tiny llama (deterministic, no
timing): plain decoding, and 2-token trees of the tests' trained moe2 draft, coupled and decoupled.

    python reports/measured/2026-11-29-engines-ab-cpu/operators.py --out reports/measured/2026-11-29-engines-ab-cpu

Writes operators.csv: per case and engine, operators per cycle (views included) and the cycles counted.
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))  # the loop engine and the tiny models
from helpers import tiny_target, trained_draft  # noqa: E402
from reference.drafting import FeatureDrafter  # noqa: E402
from reference.loop import speculative_generate, vanilla_generate  # noqa: E402

from jakiro_lib.config import TreeConfig  # noqa: E402
from jakiro_lib.decoding.static import static_generate  # noqa: E402


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def per_cycle(generate) -> tuple[float, int]:
    """Operators per cycle: the difference between 40 and 8 new tokens over the cycles between (prefill left out)."""
    counts = []
    for n in (8, 40):
        with Count() as c:
            result = generate(n)
        counts.append((c.n, result.cycles))
    (a, ca), (b, cb) = counts
    return (b - a) / (cb - ca), cb - ca


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    model = tiny_target()
    draft = trained_draft(model, "moe2")
    ids = torch.arange(5, 40)
    cases = {"vanilla": {"engine": lambda n: static_generate(model, None, None, ids, max_new_tokens=n),
                         "loop": lambda n: vanilla_generate(model, ids, max_new_tokens=n)}}
    for decoupled in (False, True):
        tree = TreeConfig(depth=4, top_k=3, total_tokens=2, decoupled=decoupled)
        cases[f"2-token tree, {'decoupled' if decoupled else 'coupled'}"] = {
            "engine": lambda n, t=tree: static_generate(model, draft, t, ids, max_new_tokens=n),
            "loop": lambda n, t=tree: speculative_generate(model, FeatureDrafter(draft, t), ids, max_new_tokens=n)}
    rows = []
    for case, engines in cases.items():
        for engine, generate in engines.items():
            ops, cycles = per_cycle(generate)
            rows.append({"case": case, "engine": engine, "operators_per_cycle": round(ops, 1), "cycles": cycles})
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "operators.csv", index=False)
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
