"""The target's verify forward at one row and at eight, the package's kernel file against variants of its linears'
blocking for five to eight rows, each variant the package's file with one or two lines changed, built under its own
op namespace and swapped in (``torch.ops.jakiro_stream_gemm`` pointed at it, the ops ``fast_paths`` keeps looked up
again). One round times every variant once, T(1) then T(8), in a shuffled order; ratios are paired within a round.

    python reports/measured/2026-12-01-linears-blocking-cpu-zen5/blocking.py --rounds 150 \\
        > reports/measured/2026-12-01-linears-blocking-cpu-zen5/run1.txt
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.machine import run_metadata
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

SOURCE = (Path(kernels.__file__).parent / "stream_gemm.cpp").read_text()
NB = "template <int M> constexpr int panels_in_registers() { return M == 1 ? 6 : M == 2 ? 6 : M <= 4 ? 4 : 3; }"
HINT = "const RowsFn<W>* by_rows = stream && M <= CHUNK ?"
AHEAD = "constexpr int64_t ahead = 2048 /"
BLOCK = "(512 * 1024) / (K * L"
VARIANTS = {  # name -> (the package's line, the variant's)
    "nb1": [(NB, NB.replace("M <= 4 ? 4 : 3", "M <= 4 ? 4 : 1"))],  # one panel a block from five rows
    "nb2": [(NB, NB.replace("M <= 4 ? 4 : 3", "M <= 4 ? 4 : 2"))],
    "chunk4": [("constexpr int CHUNK = 8;", "constexpr int CHUNK = 4;")],  # eight rows in two passes of four
    "ahead1k": [(AHEAD, "constexpr int64_t ahead = 1024 /")],  # the prefetch's distance on each panel's stream
    "ahead4k": [(AHEAD, "constexpr int64_t ahead = 4096 /")],
    "ahead_by_rows": [(AHEAD, "constexpr int64_t ahead = (M <= 4 ? 1024 : 2048) /")],  # 1 KB up to four rows
    "block256k": [(BLOCK, "(256 * 1024) / (K * L")],  # the panels a thread passes over at once
    "block1m": [(BLOCK, "(1024 * 1024) / (K * L")],
    "temporal": [(HINT, "const RowsFn<W>* by_rows = stream && M <= 4 ?")],  # from five rows prefetched into the caches
    "temporal_nb1": [(HINT, "const RowsFn<W>* by_rows = stream && M <= 4 ?"),
                     (NB, NB.replace("M <= 4 ? 4 : 3", "M <= 4 ? 4 : 1"))],
}


def build(name: str) -> object:
    """The package's kernel file with ``name``'s lines changed, built as op namespace ``jsg_<name>``."""
    source = SOURCE.replace("jakiro_stream_gemm", f"jsg_{name}")
    for old, new in VARIANTS[name]:
        assert old in source, old
        source = source.replace(old, new)
    folder = tempfile.mkdtemp()
    (Path(folder) / f"{name}.cpp").write_text(source)
    cpp_extension.load(name=f"jsg_{name}", sources=[str(Path(folder) / f"{name}.cpp")], is_python_module=False,
                       build_directory=folder, extra_cflags=list(kernels.STREAM_FLAGS), extra_ldflags=["-fopenmp"])
    return getattr(torch.ops, f"jsg_{name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--context", type=int, default=300)
    args = ap.parse_args()
    target = load_target(get_profile("default").target)
    print(run_metadata(target.device))
    package = torch.ops.jakiro_stream_gemm
    ops = {"package": package, **{name: build(name) for name in args.variants.split(",")}}
    runner = TargetRunner(target.model, 512)
    g = torch.Generator().manual_seed(0)
    runner.prefill(torch.randint(0, target.model.config.vocab_size, (args.context,), generator=g))
    parents = [0, 0, 0, 1, 1, 3, 3, 5]  # an 8-token tree of depth 4 (what jakiro's d4 k3 n8 verifies)
    depths = torch.tensor([0, 1, 1, 2, 2, 3, 3, 4])
    anc = torch.eye(8, dtype=torch.bool)
    for i in range(1, 8):
        j = i
        while j:
            j = parents[j]
            anc[i, j] = True
    tokens = torch.randint(0, target.model.config.vocab_size, (8,), generator=g)

    def use(name: str) -> None:
        torch.ops.__dict__["jakiro_stream_gemm"] = ops[name]
        fast_paths._kernels.clear()

    def timed(rows: int) -> float:
        t0 = time.perf_counter()
        if rows == 1:  # greedy, as an eager greedy cycle verifies: the rows' argmaxes through the head's screen
            runner.score(tokens[:1], depths[:1], None, args.context, greedy=True)
        else:
            runner.score(tokens, depths, anc, args.context, greedy=True)
        return time.perf_counter() - t0

    for name in ops:  # each variant's shapes loaded once
        use(name)
        for _ in range(3):
            timed(1), timed(8)
    use(list(ops)[-1])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        timed(8)
    ran = {e.key for e in prof.key_averages() if "decoder_layers" in e.key}
    assert ran == {f"jsg_{list(ops)[-1]}::decoder_layers"}, ran  # the swap reaches the layers' one call
    times = {name: ([], []) for name in ops}
    rng = random.Random(0)
    try:
        for _ in range(args.rounds):
            order = list(ops)
            rng.shuffle(order)
            for name in order:
                use(name)
                times[name][0].append(timed(1))
                times[name][1].append(timed(8))
    finally:
        torch.ops.__dict__["jakiro_stream_gemm"] = package
        fast_paths._kernels.clear()
    base1, base8 = times["package"]
    print(f"package: T(1) {statistics.median(base1) * 1e3:.2f} ms, T(8) {statistics.median(base8) * 1e3:.2f} ms, "
          f"T(8)/T(1) {statistics.median(b / a for a, b in zip(base1, base8)):.3f} (medians of {args.rounds} rounds)")
    for name in list(ops)[1:]:
        line = [f"{name}:"]
        for rows, base, mine in ((1, base1, times[name][0]), (8, base8, times[name][1])):
            ratios = [b / v for b, v in zip(base, mine)]  # > 1: the variant faster
            boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
            line.append(f"T({rows}) {statistics.median(mine) * 1e3:.2f} ms, speed / package "
                        f"{statistics.median(ratios):.3f} [{boot[50]:.3f}, {boot[1949]:.3f}];")
        print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
