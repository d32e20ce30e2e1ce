"""Jakiro's tau over EAGLE-2's at the same 8-token tree, with the package's paired bootstrap interval over prompts
(measure.summary.ratio_interval), in each run of this record; writes tau_ratio.json beside this file.

    python reports/measured/2026-12-01-main5000-cpu-zen5/tau_ratio.py
"""
from __future__ import annotations

import json
from pathlib import Path

from jakiro_lib.measure.summary import ratio_interval

HERE = Path(__file__).parent
PAIRS = (("jakiro", "eagle2"), ("jakiro_cepd", "eagle2"), ("jakiro_auto", "eagle2_auto"))


def tau(records: list[dict]) -> float:
    return sum(sum(r["accepted"]) for r in records) / sum(r["cycles"] for r in records)


def main() -> None:
    out = {}
    for run in ("run1", "run2", "run3-t1", "run4-t1-q40"):
        records = [json.loads(line) for line in (HERE / run / "records.jsonl").read_text().splitlines() if line]
        by = {}
        for r in records:
            by.setdefault(r["method"], []).append(r)
        for a, b in PAIRS:
            if a not in by:
                continue
            lo, hi = ratio_interval(by[a], by[b], measure="tau")
            out[f"{run}/{a}/{b}"] = {"temperature": by[a][0]["temperature"], "tau": tau(by[a]), "tau_ref": tau(by[b]),
                                     "ratio": tau(by[a]) / tau(by[b]), "ci_low": lo, "ci_high": hi}
    (HERE / "tau_ratio.json").write_text(json.dumps(out, indent=1) + "\n")
    for key, v in out.items():
        print(f"{key}: T={v['temperature']:g} tau {v['tau']:.3f} / {v['tau_ref']:.3f} = {v['ratio']:.3f} "
              f"[{v['ci_low']:.3f}, {v['ci_high']:.3f}]")


if __name__ == "__main__":
    main()
