"""Whether a pass over 512 MB that prefetches non-temporally keeps other data in cache on this CPU: a 4 MB buffer read
twice, then each kind of pass over 512 MB, then the buffer read again and timed (15 rounds, medians): nothing,
prefetchnta alone, prefetchnta 2 KB or 16 KB ahead of the loads (the streaming GEMM's pattern), movntdqa loads, plain
loads (each pass on two threads, a small extension built here), and the package's streaming GEMM at one and eight rows.

    python reports/measured/2026-12-02-draft-cold-cpu-zen5/prefetch.py
"""
import statistics
import time

import torch
from torch.utils.cpp_extension import load_inline

from jakiro_lib.models import kernels

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
// one pass over t's bytes on two threads: 0 prefetchnta alone, 1 prefetchnta ``ahead`` bytes ahead of each 64-byte
// load, 2 movntdqa loads, 3 plain loads
void pass_over(torch::Tensor t, int64_t mode, int64_t ahead) {
  const char* p = static_cast<const char*>(t.data_ptr());
  const int64_t n = t.numel() * t.element_size();
  float sums[2];
#pragma omp parallel for num_threads(2)
  for (int64_t part = 0; part < 2; ++part) {
    const char* q = p + part * (n / 2);
    __m512 a = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / 2; i += 64) {
      if (mode == 0) {
        _mm_prefetch(q + i, _MM_HINT_NTA);
      } else if (mode == 1) {
        _mm_prefetch(q + i + ahead, _MM_HINT_NTA);
        a = _mm512_add_ps(a, _mm512_loadu_ps(reinterpret_cast<const float*>(q + i)));
      } else if (mode == 2) {
        a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_stream_load_si512(const_cast<char*>(q + i))));
      } else {
        a = _mm512_add_ps(a, _mm512_loadu_ps(reinterpret_cast<const float*>(q + i)));
      }
    }
    sums[part] = _mm512_reduce_add_ps(a);
  }
  if (sums[0] == 1234.5f && sums[1] == 1234.5f) printf(" ");
}
"""
ext = load_inline("jakiro_prefetch_probe", [SOURCE], functions=["pass_over"],
                  extra_cflags=["-O2", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
torch.set_grad_enabled(False)
assert kernels.stream_gemm_available()
ops = torch.ops.jakiro_stream_gemm
big, buf = torch.randn(128 * 2**20), torch.randn(2**20)  # 512 MB, 4 MB
packed = ops.pack(torch.randn(128 * 1024, 1024) * 0.01, False)  # 512 MB of panels
x1, x8 = torch.randn(1, 1024), torch.randn(8, 1024)
ways = {"nothing": lambda: None, "prefetchnta alone": lambda: ext.pass_over(big, 0, 0),
        "prefetchnta 2 KB ahead + loads": lambda: ext.pass_over(big, 1, 2048),
        "prefetchnta 16 KB ahead + loads": lambda: ext.pass_over(big, 1, 16384),
        "movntdqa loads": lambda: ext.pass_over(big, 2, 0), "plain loads": lambda: ext.pass_over(big, 3, 0),
        "streaming GEMM, 1 row": lambda: ops.linear(x1, packed, 128 * 1024),
        "streaming GEMM, 8 rows": lambda: ops.linear(x8, packed, 128 * 1024)}
reread, passes = {k: [] for k in ways}, {k: [] for k in ways}
for _ in range(15):
    for k, work in ways.items():
        buf.sum()
        buf.sum()
        t0 = time.perf_counter()
        work()
        t1 = time.perf_counter()
        buf.sum()
        reread[k].append(time.perf_counter() - t1)
        passes[k].append(t1 - t0)
for k in ways:
    print(f"4 MB read again after {k:32s}: {1e6 * statistics.median(reread[k]):7.1f} us (the pass "
          f"{1e3 * statistics.median(passes[k]):.2f} ms)", flush=True)
