"""How the attention's time inside the layers' one call splits into fetching the layer's keys and values and the
arithmetic, and three ways tried to fetch them sooner, side by side in one process (T(1) and T(8) of the default
target over a random context, `bushy_tree` rows; the package's kernel file built with timers at each phase's end and
the ways below behind one switch, under its own op namespace):

    python reports/measured/2026-12-02-attention-cold-cpu-zen5/passes.py --context 300 --rounds 40

ways: 0 the package; 1 a second attention pass right after the first, timed apart (the first pass's data then in
cache); 2 the layer's keys and values read by both threads (one load a cache line) just before the attention;
3 the same lines prefetched (prefetcht1) instead; 4 the attention's tasks ordered by KV head (a thread's two tasks of
one head back to back) instead of by row chunk. Ways 2-4 change no sums (checked: the hidden states equal way 0's).
"""
import statistics, time
import torch
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.paired import paired_rounds, speed_ratio
from jakiro_lib.models import fast_paths
from kernel_build import arguments, build, runner_over_context

PHASES = ["norm", "q k v", "rope + cache write", "attention", "o", "add + norm", "swiglu", "add", "second pass"]
TOUCH = """    if (g_way == 2 || g_way == 3) {  // the layer's keys and values, positions < start, by both threads
      const float* kv0 = stack.data_ptr<float>() + l * 2 * Hk * cap * D;
      const int64_t lines = (start * D + 15) / 16;
      at::parallel_for(0, 2 * Hk, 1, [&](int64_t a, int64_t b) {
        for (int64_t t = a; t < b; ++t)
          for (int64_t i = 0; i < lines; ++i) {
            const float* p = kv0 + t * cap * D + 16 * i;
            if (g_way == 2) { volatile float sink = *p; (void)sink; } else _mm_prefetch((const char*)p, _MM_HINT_T1);
          }
      });
    }
"""
ATTEND = "    if (kernel) {\n      attend_rows(qr"
REPLACEMENTS = [
    ("namespace {\n", "namespace {\ndouble g_phase[12];\nint64_t g_way = 0;\ninline double now_ns() { return "
     "std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now().time_since_epoch()).count(); }\n"
     "#define MARK(i) { double t_ = now_ns(); g_phase[i] += t_ - t_last; t_last = t_; }\n"),
    ("    norm_rows(hp, w[0].data_ptr<float>(), x, n, H, eps);\n    linears_rows(",
     "    double t_last = now_ns();\n    norm_rows(hp, w[0].data_ptr<float>(), x, n, H, eps);\n    MARK(0)\n    linears_rows("),
    ("    rotate_rows(q, D, Q, Hq", "    MARK(1)\n    rotate_rows(q, D, Q, Hq"),
    (ATTEND, TOUCH + "    MARK(2)\n" + ATTEND),
    ("    linear_rows(att, w[4], n, Q, H, y);\n",
     "    MARK(3)\n    if (kernel && g_way == 1) attend_rows(qr, D, Q, keys, cap * D, D, values, cap * D, D, "
     "padded.defined() ? padded.data_ptr<float>() : nullptr, Hq, Hk, n, S, D, scale, att);\n    MARK(8)\n"
     "    linear_rows(att, w[4], n, Q, H, y);\n    MARK(4)\n"),
    ("    swiglu_rows(x, w[6]", "    MARK(5)\n    swiglu_rows(x, w[6]"),
    ("    add_rows(hp, y, n * H);\n  }\n  return h;", "    MARK(6)\n    add_rows(hp, y, n * H);\n    MARK(7)\n  }\n  return h;"),
    ("      const int64_t g = t % Hk, r0 = t / Hk * R, P = std::min(R, n - r0) * G;",
     "      const int64_t nch = (n + R - 1) / R, g = g_way == 4 ? t / nch : t % Hk;\n"
     "      const int64_t r0 = g_way == 4 ? t % nch * R : t / Hk * R, P = std::min(R, n - r0) * G;"),
    ("TORCH_LIBRARY(jakiro_stream_gemm, m) {",
     "at::Tensor phase_times() {\n  at::Tensor t = at::from_blob(g_phase, {12}, at::kDouble).clone();\n"
     "  for (auto& v : g_phase) v = 0;\n  return t;\n}\nTORCH_LIBRARY(jakiro_stream_gemm, m) {\n"
     "  m.def(\"phase_times() -> Tensor\", &phase_times);\n"
     "  m.def(\"set_way(int w) -> int\", +[](int64_t w) { g_way = w; return w; });"),
]


def main() -> None:
    args = arguments()
    target, runner, trees = runner_over_context(args.context)
    op = build("jsg_passes", REPLACEMENTS)
    torch.ops.__dict__["jakiro_stream_gemm"] = op  # the lean forward looks its ops up by this name
    fast_paths._kernels.clear()
    print(run_metadata(target.device), flush=True)
    ways = [0, 1, 2, 3, 4]
    phases: dict[tuple[int, int], list[torch.Tensor]] = {(w, n): [] for w in ways for n in (1, 8)}
    outputs: dict[int, torch.Tensor] = {}

    def score(way: int, n: int) -> float:
        tokens, depths, anc = trees[n]
        op.set_way(way)
        op.phase_times()
        t0 = time.perf_counter()
        chosen, hidden = runner.score(tokens, depths, anc if n > 1 else None, args.context, greedy=True)
        seconds = time.perf_counter() - t0
        phases[(way, n)].append(op.phase_times() / 1e6)  # ms
        first = outputs.setdefault(n, hidden.clone())
        assert torch.equal(hidden, first), f"way {way} changed T({n})'s hidden states"
        return seconds

    for n in (1, 8):
        seconds = paired_rounds({w: (lambda item, w=w, n=n: score(w, n)) for w in ways}, [None], repeats=args.rounds)
        for w in ways:
            del phases[(w, n)][:len(phases[(w, n)]) - args.rounds]  # the warm-up's
        base = seconds[0]
        for w in ways:
            p = torch.stack(phases[(w, n)]).mean(0)
            ratio = "" if w == 0 else " x{:.3f} [{:.3f}, {:.3f}] against way 0".format(*speed_ratio(base, seconds[w]))
            print(f"context {args.context} T({n}) way {w}: {1e3 * statistics.mean(seconds[w]):.3f} ms{ratio}; "
                  f"layers {p[:8].sum():.3f} ms: " + ", ".join(f"{name} {p[i]:.3f}" for i, name in enumerate(PHASES)),
                  flush=True)


if __name__ == "__main__":
    main()
