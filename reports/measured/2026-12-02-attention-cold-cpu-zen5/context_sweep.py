"""T(8)/T(1) at 100, 300, 500 and 800 tokens of context, the package as it is: one runner prefilled with 800 random
tokens, each round scoring one row and the 8-row bushy tree at each context in turn (the order rotated round by round,
measure.paired), the ratio of mean seconds with its paired 95% interval:

    python reports/measured/2026-12-02-attention-cold-cpu-zen5/context_sweep.py --rounds 40 > reports/measured/2026-12-02-attention-cold-cpu-zen5/context_sweep.txt
"""
import time
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.paired import paired_rounds, speed_ratio
from kernel_build import arguments, runner_over_context

CONTEXTS = (100, 300, 500, 800)


def main() -> None:
    args = arguments()
    target, runner, trees = runner_over_context(max(CONTEXTS))
    print(run_metadata(target.device), flush=True)

    def score(n: int, context: int) -> float:
        tokens, depths, anc = trees[n]
        t0 = time.perf_counter()
        runner.score(tokens, depths, anc if n > 1 else None, context, greedy=True)
        return time.perf_counter() - t0

    ways = {f"T({n}) at {c}": (lambda item, n=n, c=c: score(n, c)) for c in CONTEXTS for n in (1, 8)}
    s = paired_rounds(ways, [None], repeats=args.rounds)
    for c in CONTEXTS:
        t1, t8 = s[f"T(1) at {c}"], s[f"T(8) at {c}"]
        print(f"context {c}: T(1) {1e3 * sum(t1) / len(t1):.3f} ms, T(8) {1e3 * sum(t8) / len(t8):.3f} ms, "
              "T(8)/T(1) {:.3f} [{:.3f}, {:.3f}]".format(*speed_ratio(t8, t1)), flush=True)


if __name__ == "__main__":
    main()
