"""Each tuned method over its fixed-tree twin in every run of this record (eagle2_auto / eagle2, jakiro_auto / jakiro:
same draft, same 8 tokens, the tuner's depth and width against the profile's depth 4 and 3 children): tokens/s and tau
with the package's paired bootstrap over prompts (measure.summary.ratio_interval), and the tree each ran.

    python reports/measured/2026-12-01-tuned-shapes-cpu-zen5/ratios.py   # writes ratios.json beside itself
"""
from __future__ import annotations

import json
from pathlib import Path

from jakiro_lib.measure.summary import load_records, ratio_interval

HERE = Path(__file__).resolve().parent
PAIRS = (("eagle2_auto", "eagle2"), ("jakiro_auto", "jakiro"))


def main() -> None:
    out = {}
    for run in sorted(p for p in HERE.iterdir() if (p / "records.jsonl").is_file()):
        methods = json.loads((run / "bench_config.json").read_text())["methods"]
        by: dict[str, list] = {}
        for r in load_records(run / "records.jsonl"):
            by.setdefault(r["method"], []).append(r)
        for tuned, fixed in PAIRS:
            trees = [methods[m]["tree"] for m in (tuned, fixed)]
            row = {"trees": [f"depth {t['depth']}, top_k {t['top_k']}, {t['total_tokens']} tokens" for t in trees],
                   "speed": ratio_interval(by[tuned], by[fixed]),
                   "tau": ratio_interval(by[tuned], by[fixed], measure="tau")}
            out[f"{run.name} {tuned}/{fixed}"] = row
            print(f"{run.name:14s} {tuned:12s} ({row['trees'][0]}) over {fixed} ({row['trees'][1]}): "
                  f"tokens/s [{row['speed'][0]:.3f}, {row['speed'][1]:.3f}], tau [{row['tau'][0]:.3f}, {row['tau'][1]:.3f}]")
    (HERE / "ratios.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
