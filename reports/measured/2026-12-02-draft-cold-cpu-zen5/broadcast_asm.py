"""The integer screen's vpdpbusd with each row's activations broadcast from memory inside the instruction (an
`{1to16}` operand through inline asm, where GCC emits a vpbroadcastd before each), built beside the package's kernel
(the replacement names the kernel file's lines at 0d60c83): the target head's greedy argmax at 1 and 8 rows, a draft
head's logits at 3 and 6 rows (12 rounds each) and T(8) (40 rounds), side by side, outputs checked equal.

    python reports/measured/2026-12-02-draft-cold-cpu-zen5/broadcast_asm.py
"""
import statistics
import time

import torch

from common import build
from kernel_build import forward_seconds, runner_over_context
from jakiro_lib.measure.paired import paired_rounds, speed_ratio
from jakiro_lib.models import fast_paths
old = """      const __m512i h = _mm512_set1_epi32(hw[m * G + g]), l = _mm512_set1_epi32(lw[m * G + g]);
      for (int j = 0; j < NB; ++j) {
        hi[m][j] = sums_vec(_mm512_dpbusd_epi32(__m512i(hi[m][j]), w[j], h));
        lo[m][j] = sums_vec(_mm512_dpbusd_epi32(__m512i(lo[m][j]), w[j], l));
      }"""
new = """      for (int j = 0; j < NB; ++j) {
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(hi[m][j]) : "v"(w[j]), "m"(hw[m * G + g]));
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(lo[m][j]) : "v"(w[j]), "m"(lw[m * G + g]));
      }"""
variant = build("bcast", [(old, new)])
torch.set_grad_enabled(False)
target, runner, trees = runner_over_context(300)
ops = {"package": torch.ops.jakiro_stream_gemm, "bcast": variant}
screen, W = fast_paths.current_screen(target.model), target.model.lm_head.weight
g = torch.Generator().manual_seed(0)
emb = target.model.get_input_embeddings().weight
D = torch.randn(8192, 576, generator=g) * 0.05
dscreen, dscales = ops["package"].pack_int8(D, True)
def timed(f, n):
    def run(op):
        t0 = time.perf_counter()
        for _ in range(n): f(op)
        return (time.perf_counter() - t0) / n
    return run
for rows in (1, 8):
    x = emb[torch.randint(0, emb.shape[0], (rows,), generator=g)] * 30
    assert torch.equal(ops["package"].greedy_head(x, *screen, W), ops["bcast"].greedy_head(x, *screen, W))
    f = timed(lambda op: op.greedy_head(x, *screen, W), 30)
    r = paired_rounds({k: (lambda _, op=op: f(op)) for k, op in ops.items()}, [None], repeats=12)
    s = speed_ratio(r["package"], r["bcast"]); print(f"greedy_head {rows} rows: {1e6*statistics.median(r['bcast']):.0f} us vs {1e6*statistics.median(r['package']):.0f}, speed {s[0]:.3f} [{s[1]:.3f}, {s[2]:.3f}]", flush=True)
for rows in (3, 6):
    x = torch.randn(rows, 576, generator=g) * 3
    assert torch.equal(ops["package"].int8_linear(x, dscreen, dscales, 8192), ops["bcast"].int8_linear(x, dscreen, dscales, 8192))
    f = timed(lambda op: op.int8_linear(x, dscreen, dscales, 8192), 200)
    r = paired_rounds({k: (lambda _, op=op: f(op)) for k, op in ops.items()}, [None], repeats=12)
    s = speed_ratio(r["package"], r["bcast"]); print(f"draft head {rows} rows: {1e6*statistics.median(r['bcast']):.1f} us vs {1e6*statistics.median(r['package']):.1f}, speed {s[0]:.3f} [{s[1]:.3f}, {s[2]:.3f}]", flush=True)
r = forward_seconds(ops, runner, trees, 300, 8, 40)
s = speed_ratio(r["package"], r["bcast"]); print(f"T(8): {1e3*statistics.median(r['bcast']):.2f} ms vs {1e3*statistics.median(r['package']):.2f}, speed {s[0]:.3f} [{s[1]:.3f}, {s[2]:.3f}]", flush=True)
