"""The two interleaved runs of engines.py at one commit (run-a, run-b) pooled into one table.

    python reports/measured/2026-11-29-engines-cpu/pooled.py

Each run's prompts keep their pairing (the one engine and the loop engine back to back on a prompt); a prompt of
run-a and the same prompt of run-b are two resampling units of the bootstrap (their ``repeat`` 0 and 1), so every
method's interval rests on 40 pairs instead of 20. Writes pooled_a_b.csv beside this script, the columns of each run's.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from engines import engines_table  # noqa: E402  (the record's own script, beside this one)


def main() -> None:
    records = []
    for repeat, run in enumerate(("run-a", "run-b")):
        with open(HERE / run / "records.jsonl") as fh:
            records += [{**json.loads(line), "repeat": repeat} for line in fh]
    names = list(dict.fromkeys(r["method"] for r in records if r["engine"] == "static"))
    table = engines_table(records, names)
    table.to_csv(HERE / "pooled_a_b.csv", index=False)
    print(table.round(3).to_string(index=False))


if __name__ == "__main__":
    main()
