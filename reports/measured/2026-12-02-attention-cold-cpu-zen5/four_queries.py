"""The 2026-12-01 patch that scores four queries together (each block's key vectors loaded once for them, every
query's folds its own: [record](../2026-12-01-attend-interleaved-cpu-zen5/README.md)), laid over the package with the
values pass kept in registers, against the package: the attention op warm (one layer's shapes, 15 rounds of 200 calls)
and T(1) and T(8) side by side in one process (measure.paired), outputs and hidden states checked equal. T(1)'s rows
(three queries a task, fewer than four) run the same code either way: its ratio shows the comparison's own bias.

    python reports/measured/2026-12-02-attention-cold-cpu-zen5/four_queries.py --context 300 --rounds 60
"""
from pathlib import Path
import torch
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.paired import speed_ratio
from jakiro_lib.models import kernels
from kernel_build import arguments, build, forward_seconds, op_seconds, runner_over_context

PATCH = Path(__file__).resolve().parent.parent / "2026-12-01-attend-interleaved-cpu-zen5" / "interleaved.patch"
SCORES_END = "  return j0 + L <= S ? block_scores<DV, true>(qv, k, ks, L) : block_scores<DV, false>(qv, k, ks, S - j0);\n}\n\n"


def patched_source() -> str:
    """The package's kernel file with the patch's two hunks: the first's added lines after ``scores`` (its context, the
    values pass before it, has changed since), the second's lines replaced as they stand."""
    lines = PATCH.read_text().split("\n")
    at = [i for i, line in enumerate(lines) if line.startswith("@@")]
    added = "\n".join(line[1:] for line in lines[at[0] + 1:at[1]] if line.startswith("+")) + "\n"
    second = [line for line in lines[at[1] + 1:] if line[:1] in (" ", "-", "+")]
    old = "\n".join(line[1:] for line in second if line[0] in " -")
    new = "\n".join(line[1:] for line in second if line[0] in " +")
    source = Path(kernels.STREAM_SOURCE).read_text()
    assert source.count(SCORES_END) == 1 and source.count(old) == 1
    return source.replace(SCORES_END, SCORES_END + added).replace(old, new)


def main() -> None:
    args = arguments()
    target, runner, trees = runner_over_context(args.context)
    ops = {"package": torch.ops.jakiro_stream_gemm, "four": build("jsg_four", source=patched_source())}
    print(run_metadata(target.device), flush=True)
    for S in (300, 800):
        for n in (1, 3, 8):
            s = op_seconds(ops, S, n)
            print(f"attention op, {S} keys, {n} rows: package {1e6 * sum(s['package']) / 15:.1f} us, four "
                  "x{:.3f} [{:.3f}, {:.3f}], equal".format(*speed_ratio(s["package"], s["four"])), flush=True)
    for n in (1, 8):
        s = forward_seconds(ops, runner, trees, args.context, n, args.rounds)
        print(f"context {args.context} T({n}): package {1e3 * sum(s['package']) / args.rounds:.3f} ms, four "
              "x{:.3f} [{:.3f}, {:.3f}] (above 1: faster), hidden states equal".format(
                  *speed_ratio(s["package"], s["four"])), flush=True)

if __name__ == "__main__":
    main()
