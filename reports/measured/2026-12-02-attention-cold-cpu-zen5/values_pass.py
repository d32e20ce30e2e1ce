"""The attention's values pass with each group's accumulators in registers over all keys (values_pass, the package
from this record's commit on) against the pass by blocks of 16 keys before it (the kernel file at 2082fda, built
under its own op namespace): T(1) and T(8) of the default target over a random context, `bushy_tree` rows, the two
alternating round by round in one process (measure.paired), the hidden states checked equal bit for bit; first the
attention op alone, warm, one layer's shapes (9 query heads, 3 KV heads, D 64, a boolean tree mask), 15 rounds of 200
calls each:

    python reports/measured/2026-12-02-attention-cold-cpu-zen5/values_pass.py --context 300 --rounds 40
"""
import subprocess
from pathlib import Path
import torch
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.paired import speed_ratio
from jakiro_lib.models import kernels
from kernel_build import arguments, build, forward_seconds, op_seconds, runner_over_context

BEFORE = "2082fda"


def source_before() -> str:
    """The kernel file at BEFORE."""
    root = Path(kernels.STREAM_SOURCE).resolve().parents[2]
    return subprocess.run(["git", "show", f"{BEFORE}:jakiro_lib/models/stream_gemm.cpp"], cwd=root, check=True,
                          capture_output=True, text=True).stdout


def main() -> None:
    args = arguments()
    target, runner, trees = runner_over_context(args.context)
    ops = {"before": build("jsg_before", source=source_before()), "after": torch.ops.jakiro_stream_gemm}
    print(run_metadata(target.device), flush=True)
    for S in (300, 800):
        for n in (1, 3, 8):
            s = op_seconds(ops, S, n)
            print(f"attention op, {S} keys, {n} rows: before {1e6 * sum(s['before']) / 15:.1f} us, after "
                  f"{1e6 * sum(s['after']) / 15:.1f} us, after x{{:.3f}} [{{:.3f}}, {{:.3f}}], equal".format(
                      *speed_ratio(s["before"], s["after"])), flush=True)
    for n in (1, 8):
        s = forward_seconds(ops, runner, trees, args.context, n, args.rounds)
        mean = {w: 1e3 * sum(v) / len(v) for w, v in s.items()}
        print(f"context {args.context} T({n}): before {mean['before']:.3f} ms, after {mean['after']:.3f} ms, "
              "after x{:.3f} [{:.3f}, {:.3f}] (above 1: faster), hidden states equal".format(
                  *speed_ratio(s["before"], s["after"])), flush=True)

if __name__ == "__main__":
    main()
