"""captured.csv from the check's records: tokens/s per method and temperature, the speedup over hf_compiled
and over our captured plain decoder (vanilla_static_compiled), each with the paired 95% bootstrap interval
over prompts, tau, and greedy identity with our vanilla loop; and inductor.csv: the same for the partial
run with target.capture=inductor (its prompts only, paired with the graphs run's same prompts). Another
check's folder (records.jsonl; no inductor run there: captured.csv only) as the argument:

    python reports/measured/2026-11-27-h200-graphs/captured.py [DIR]
"""
from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from jakiro_lib.measure.methods import record_label
from jakiro_lib.measure.summary import greedy_agreement, load_records, ratio_interval, summarize_measure

HERE = Path(__file__).parent
BASELINES = ("hf_compiled", "vanilla_static_compiled")


def tau(recs: list[dict]) -> float:
    return float("nan") if recs[0]["kind"] == "hf" else summarize_measure(recs, "tau")  # HF counts no cycles


def table(records: list[dict], vanilla: list[dict]) -> pd.DataFrame:
    rows = []
    for temp in sorted({r["temperature"] for r in records}):
        at = [r for r in records if r["temperature"] == temp]
        by: dict[str, list[dict]] = {}
        for r in at:
            by.setdefault(record_label(r), []).append(r)  # a run by its label (issue 45)
        for method, recs in by.items():
            row = {"temperature": temp, "method": method, "prompts": len(recs),
                   "tokens_per_s": summarize_measure(recs, "tokens_per_s"), "tau": tau(recs)}
            for base in BASELINES:
                b = by.get(base)
                row[f"x_{base}"] = row["tokens_per_s"] / summarize_measure(b, "tokens_per_s") if b else None
                row[f"x_{base}_lo"], row[f"x_{base}_hi"] = ratio_interval(recs, b, measure="tokens_per_s") if b else (None, None)
            v = [r for r in vanilla if r["temperature"] == temp]
            row["greedy_same"], row["greedy_compared"] = greedy_agreement(recs, v) if temp == 0 else (None, None)
            rows.append(row)
    return pd.DataFrame(rows)


def main(here: Path = HERE) -> None:
    records = load_records(here / "records.jsonl")
    vanilla = [r for r in records if record_label(r) == "vanilla"]
    out = table(records, vanilla)
    out.to_csv(here / "captured.csv", index=False, float_format="%.4g")
    print(out.to_string(index=False, float_format=lambda x: f"{x:.3g}"))
    if not (here / "inductor").is_dir():
        return
    inductor = load_records(HERE / "inductor" / "records.jsonl")
    keys = {(r["question_id"], r["turn"]) for r in inductor if record_label(r) == "vanilla_static_compiled"}
    both = [dict(r, method=record_label(r) + "[inductor]") for r in inductor] + [
        dict(r, method=record_label(r) + "[graphs]") for r in records
        if r["temperature"] == 0
        and record_label(r) in ("hf_compiled", "vanilla_static_compiled", "jakiro_auto_static_compiled")
        and (r["question_id"], r["turn"]) in keys]
    rows = []
    for method in sorted({r["method"] for r in both}):
        recs = [r for r in both if r["method"] == method and (r["question_id"], r["turn"]) in keys]
        rows.append({"method": method, "prompts": len(recs), "tokens_per_s": summarize_measure(recs, "tokens_per_s"),
                     "tau": tau(recs)})
    ind = pd.DataFrame(rows)
    ind.to_csv(HERE / "inductor.csv", index=False, float_format="%.4g")
    print(ind.to_string(index=False, float_format=lambda x: f"{x:.3g}"))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
