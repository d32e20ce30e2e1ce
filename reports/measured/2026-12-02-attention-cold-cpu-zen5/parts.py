"""The attention op's parts, warm, one layer's shapes (9 query heads, 3 KV heads, D 64; a boolean mask padded as
decoder_layers pads it): the package's kernel file built with a switch that skips parts (the values' pass, the
scores, the softmax's exp, the prefetches; the outputs are not the attention's when a part is skipped), 9 rounds of
200 calls of each mode in turn, medians:

    python reports/measured/2026-12-02-attention-cold-cpu-zen5/parts.py > reports/measured/2026-12-02-attention-cold-cpu-zen5/parts.txt
"""
import statistics, time
import torch
from jakiro_lib.machine import run_metadata
from jakiro_lib.models import kernels
from kernel_build import build
R = [("namespace {\n", "namespace {\nint64_t g_mode = 0;\n"),
     ("  for (; i + C <= P; i += C) values_pass<DV, C>", "  if (!(g_mode & 1)) for (; i + C <= P; i += C) values_pass<DV, C>"),
     ("  if (i < P) values_rest", "  if (!(g_mode & 1) && i < P) values_rest"),
     ("      vec x = scores<DV>(q[i], k, ks, j0, S) * scale;", "      vec x = ((g_mode & 2) ? load(q[i]) : scores<DV>(q[i], k, ks, j0, S)) * scale;"),
     ("    for (int64_t j = 0; j < Sp; j += L) store(si + j, exp_nonpositive(load(si + j) - m));", "    if (!(g_mode & 4)) for (int64_t j = 0; j < Sp; j += L) store(si + j, exp_nonpositive(load(si + j) - m));"),
     ("inline void prefetch_rows(const float* x, int64_t xs, int64_t j0, int64_t j1, int64_t S) {\n", "inline void prefetch_rows(const float* x, int64_t xs, int64_t j0, int64_t j1, int64_t S) {\n  if (g_mode & 8) return;\n"),
     ("TORCH_LIBRARY(jakiro_stream_gemm, m) {", "TORCH_LIBRARY(jakiro_stream_gemm, m) {\n  m.def(\"set_mode(int w) -> int\", +[](int64_t w) { g_mode = w; return w; });")]
op = build("jsg_parts", R)
torch.set_grad_enabled(False)
assert kernels.stream_gemm_available()
print(run_metadata(torch.device("cpu")), flush=True)
modes = {"all": 0, "-values": 1, "-scores": 2, "-values -scores": 3, "-values -scores -exp": 7, "-all four": 15}
for S in (300, 800):
    for n in (1, 8):
        q = torch.randn(1, 9, n, 64); k = torch.randn(1, 3, S, 64); v = torch.randn(1, 3, S, 64)
        mask = (torch.rand(1, 1, n, S) < 0.9) if n > 1 else None  # boolean, seen_rows' path (True: seen)
        ts = {m: [] for m in modes}
        for r in range(9):
            for m, bits in modes.items():
                op.set_mode(bits)
                t0 = time.perf_counter()
                for _ in range(200): op.attend(q, k, v, mask, 0.125)
                ts[m].append((time.perf_counter() - t0) / 200)
        print(f"S {S} rows {n}: " + ", ".join(f"{m} {statistics.median(t)*1e6:.1f} us" for m, t in ts.items()), flush=True)
        op.set_mode(0)
