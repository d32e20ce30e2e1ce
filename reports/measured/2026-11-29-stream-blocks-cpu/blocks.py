"""The streaming GEMM before and after its blocks became a multiple of 12 panels, over the default target's linear
shapes (30 layers of q, k, v, o, gate, up, down and the tied head, random fp32 weights, 538 MB), at 1 to 32 rows.
"before" is jakiro_lib/models/stream_gemm.cpp at the commit given (blocks of max(8, 512 KB) panels, so a thread's
last panels of a block ran one at a time), "after" the package's source; each is compiled as its own op, and the two
are timed in interleaved rounds.

    python reports/measured/2026-11-29-stream-blocks-cpu/blocks.py --before ddb2f4e \
        --out reports/measured/2026-11-29-stream-blocks-cpu

Writes blocks.csv (per row count the median ms of all the linears before and after, and after / before) and
blocks_config.json (the commit compared, rounds, threads, versions and machine).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch
from torch.utils.cpp_extension import load

from jakiro_lib.machine import run_metadata
from jakiro_lib.models.kernels import STREAM_FLAGS, STREAM_SOURCE

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30 + [(49152, 576)]
ROWS = (1, 2, 4, 8, 16, 32)


def build(name: str, source: str, folder: Path):
    path = folder / f"blocks_{name}.cpp"
    path.write_text(source.replace("jakiro_stream_gemm", f"blocks_{name}"))
    load(name=f"blocks_{name}", sources=[str(path)], extra_cflags=list(STREAM_FLAGS), extra_ldflags=["-fopenmp"],
         is_python_module=False, build_directory=str(folder))
    return getattr(torch.ops, f"blocks_{name}")


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True, help="the commit whose stream_gemm.cpp is 'before'")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=12)
    args = ap.parse_args()
    old = subprocess.run(["git", "show", f"{args.before}:jakiro_lib/models/stream_gemm.cpp"], check=True,
                         capture_output=True, text=True).stdout
    folder = Path(tempfile.mkdtemp(prefix="blocks_"))
    ops = {"before": build("before", old, folder), "after": build("after", STREAM_SOURCE.read_text(), folder)}
    torch.manual_seed(0)
    weights = [torch.randn(s) * 0.02 for s in SHAPES]
    packed = {n: [op.pack(w, False) for w in weights] for n, op in ops.items()}
    xs = {m: {k: torch.randn(m, k) for k in (576, 1536)} for m in ROWS}

    def run(name: str, m: int) -> None:
        for w, p in zip(weights, packed[name]):
            ops[name].linear(xs[m][w.shape[1]], p, w.shape[0])

    for m in ROWS:  # the two agree bit for bit: only the grouping of panels into passes changed
        for w, a, b in zip(weights[:8], packed["before"], packed["after"]):
            assert torch.equal(ops["before"].linear(xs[m][w.shape[1]], a, w.shape[0]),
                               ops["after"].linear(xs[m][w.shape[1]], b, w.shape[0]))
    times = {(n, m): [] for n in ops for m in ROWS}
    for _ in range(args.rounds):  # rounds interleave the two and the row counts
        for m in ROWS:
            for n in ops:
                run(n, m)
                t0 = time.perf_counter()
                run(n, m)
                times[(n, m)].append(time.perf_counter() - t0)
    rows = []
    for m in ROWS:
        before, after = (1e3 * statistics.median(times[(n, m)]) for n in ops)
        rows.append({"rows": m, "before_ms": round(before, 2), "after_ms": round(after, 2),
                     "after_over_before": round(after / before, 3)})
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "blocks.csv", index=False)
    config = {"before": args.before, "rows": ROWS, "rounds": args.rounds, "threads": torch.get_num_threads(),
              **run_metadata()}
    (args.out / "blocks_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    print(table.to_string(index=False))


if __name__ == "__main__":
    main()
