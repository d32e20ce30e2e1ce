"""engines.csv from a benchmark's records: every method with its engine and whether it compiles, tokens/s,
speedup over hf_compiled and over hf_prompt_lookup with paired 95% bootstrap intervals over prompts, tau,
and greedy identity with our vanilla loop.

    python scripts/engines.py <bench out dir> <record dir>

Used by the records 2026-11-27-engines-cpu and 2026-11-27-engines-default-cpu.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from jakiro_lib.measure.methods import record_label
from jakiro_lib.measure.summary import greedy_agreement, load_records, ratio_interval, summarize_measure

BASELINES = ("hf_compiled", "hf_prompt_lookup")


def engines_table(records: list[dict], methods: dict[str, dict]) -> pd.DataFrame:
    rows = []
    for temp in sorted({r["temperature"] for r in records}):
        at = [r for r in records if r["temperature"] == temp]
        by = {m: [r for r in at if record_label(r) == m] for m in methods if any(record_label(r) == m for r in at)}
        for method, recs in by.items():
            spec = methods[method]
            row = {"method": method, "kind": spec["kind"], "temperature": temp,
                   "engine": spec.get("engine", "loop") if spec["kind"] in ("vanilla", "spec") else "hf",
                   "compiled": bool(spec.get("compile")), "prompts": len(recs),
                   "tokens_per_s": summarize_measure(recs, "tokens_per_s"),
                   "tau": (summarize_measure(recs, "tau") if spec["kind"] == "spec"
                           else 1.0 if spec["kind"] == "vanilla" else float("nan"))}  # HF counts no cycles
            for base in BASELINES:
                b = by.get(base)
                row[f"speedup_{base}"] = row["tokens_per_s"] / summarize_measure(b, "tokens_per_s") if b else None
                lo, hi = ratio_interval(recs, b, measure="tokens_per_s") if b else (None, None)
                row[f"speedup_{base}_ci_low"], row[f"speedup_{base}_ci_high"] = lo, hi
            same, compared = greedy_agreement(recs, by.get("vanilla", [])) if temp == 0 else (None, None)
            row["greedy_same"], row["greedy_compared"] = same, compared
            rows.append(row)
    table = pd.DataFrame(rows)
    table.insert(table.columns.get_loc("speedup_hf_compiled"), "speedup", table["speedup_hf_compiled"])
    return table


def main(bench_dir: str, out_dir: str) -> None:
    bench, out = Path(bench_dir), Path(out_dir)
    methods = json.loads((bench / "bench_config.json").read_text())["methods"]
    table = engines_table(load_records(bench / "records.jsonl"), methods)
    table.to_csv(out / "engines.csv", index=False, float_format="%.4g")
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3g}"))


if __name__ == "__main__":
    main(*sys.argv[1:3])
