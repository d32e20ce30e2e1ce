"""T(1), T(8) of the package against variants whose linears' regions share panels dynamically (an atomic counter)."""
import argparse, random, statistics, tempfile, time
from pathlib import Path
import torch
from torch.utils import cpp_extension
from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

SOURCE = (Path(kernels.__file__).parent / "stream_gemm.cpp").read_text()
OLD_RUN = """  at::parallel_for(0, total, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t j = 0, first = 0; j < n_jobs; first += jobs[j].P, ++j) {
      const int64_t from = std::max<int64_t>(p0 - first, 0), to = std::min(p1 - first, jobs[j].P);
      for (int64_t b = from; b < to; b += per_block) pass(x, M, K, jobs[j], b, std::min(b + per_block, to));
    }
  });"""
NEW_RUN = """  const int64_t grab = std::min<int64_t>(GRAB, per_block);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), (total + grab - 1) / grab), 1, [&](int64_t, int64_t) {
    for (int64_t p0; (p0 = next.fetch_add(grab, std::memory_order_relaxed)) < total;) {
      const int64_t p1 = std::min(p0 + grab, total);
      for (int64_t j = 0, first = 0; j < n_jobs; first += jobs[j].P, ++j) {
        const int64_t from = std::max<int64_t>(p0 - first, 0), to = std::min(p1 - first, jobs[j].P);
        if (from < to) pass(x, M, K, jobs[j], from, to);
      }
    }
  });"""
OLD_GATED = """  at::parallel_for(0, gate.P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t b = p0; b < p1; b += per_block) {
      const int64_t b_end = std::min(b + per_block, p1);"""
NEW_GATED = """  const int64_t grab = std::min<int64_t>(GRAB, per_block);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), (gate.P + grab - 1) / grab), 1, [&](int64_t, int64_t) {
    for (int64_t b; (b = next.fetch_add(grab, std::memory_order_relaxed)) < gate.P;) {
      const int64_t b_end = std::min(b + grab, gate.P);"""


def build(name, grab):
    source = SOURCE.replace("jakiro_stream_gemm", f"jsg_{name}")
    for old, new in ((OLD_RUN, NEW_RUN), (OLD_GATED, NEW_GATED)):
        assert old in source
        source = source.replace(old, new.replace("GRAB", str(grab)))
    source = source.replace("#include <algorithm>", "#include <algorithm>\n#include <atomic>", 1)
    folder = tempfile.mkdtemp()
    (Path(folder) / f"{name}.cpp").write_text(source)
    cpp_extension.load(name=f"jsg_{name}", sources=[str(Path(folder) / f"{name}.cpp")], is_python_module=False,
                       build_directory=folder, extra_cflags=list(kernels.STREAM_FLAGS), extra_ldflags=["-fopenmp"])
    return getattr(torch.ops, f"jsg_{name}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grabs", default="6,12")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--cold", action="store_true")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    target = load_target(get_profile("default").target)
    print(run_metadata(target.device))
    package = torch.ops.jakiro_stream_gemm
    ops = {"package": package, **{f"grab{g}": build(f"grab{g}", int(g)) for g in args.grabs.split(",")}}
    runner = TargetRunner(target.model, 512)
    g = torch.Generator().manual_seed(0)
    runner.prefill(torch.randint(0, target.model.config.vocab_size, (args.context,), generator=g))
    trees = {n: bushy_tree(n, target.model.device) for n in (1, 8)}
    big = torch.empty(64 * 2**20)
    outs = {}

    def use(name):
        torch.ops.__dict__["jakiro_stream_gemm"] = ops[name]
        fast_paths._kernels.clear()

    def timed(n, name):
        tokens, depths, anc = trees[n]
        if args.cold:
            big.add_(1.0)
        t0 = time.perf_counter()
        out = runner.score(tokens, depths, anc if n > 1 else None, args.context, greedy=True)
        t = time.perf_counter() - t0
        outs.setdefault((n, name), out[0] if isinstance(out, tuple) else out)
        return t

    for name in ops:
        use(name)
        for _ in range(3):
            timed(1, name), timed(8, name)
    for n in (1, 8):
        ref = outs[(n, "package")]
        for name in ops:
            o = outs[(n, name)]
            assert all(torch.equal(a, b) for a, b in zip(o, ref)) if isinstance(o, (tuple, list)) else torch.equal(o, ref), name
    print("outputs equal bit for bit")
    times = {name: ([], []) for name in ops}
    rng = random.Random(0)
    try:
        for _ in range(args.rounds):
            order = list(ops)
            rng.shuffle(order)
            for name in order:
                use(name)
                times[name][0].append(timed(1, name))
                times[name][1].append(timed(8, name))
    finally:
        torch.ops.__dict__["jakiro_stream_gemm"] = package
        fast_paths._kernels.clear()
    base1, base8 = times["package"]
    print(f"package: T(1) {statistics.median(base1) * 1e3:.2f} ms, T(8) {statistics.median(base8) * 1e3:.2f} ms, "
          f"T(8)/T(1) {statistics.median(b / a for a, b in zip(base1, base8)):.3f} ({args.rounds} rounds)")
    for name in list(ops)[1:]:
        line = [f"{name}:"]
        for rows, base, mine in ((1, base1, times[name][0]), (8, base8, times[name][1])):
            ratios = [b / v for b, v in zip(base, mine)]
            boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
            line.append(f"T({rows}) {statistics.median(mine) * 1e3:.2f} ms, speed / package "
                        f"{statistics.median(ratios):.3f} [{boot[50]:.3f}, {boot[1949]:.3f}];")
        print(" ".join(line), flush=True)


if __name__ == "__main__":
    main()
