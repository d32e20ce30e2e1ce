"""Two threads' peak rates here: vpdpbusd and vfmadd231ps on zmm registers, 24 independent chains a thread (sums in
GCC's vector type, so that they stay in registers), three runs.

    python reports/measured/2026-12-02-draft-cold-cpu-zen5/peak.py
"""
from torch.utils.cpp_extension import load_inline
src = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
typedef int32_t iv __attribute__((vector_size(64)));
typedef float fv __attribute__((vector_size(64)));
double dpbusd_rate(int64_t iters) {  // vpdpbusd per second on two threads, 24 independent chains each
  double t0 = omp_get_wtime();
  int sink = 0;
#pragma omp parallel num_threads(2) reduction(+:sink)
  {
    iv a[24];
    for (int i = 0; i < 24; ++i) a[i] = iv(_mm512_set1_epi32(i));
    __m512i x = _mm512_set1_epi32(0x01020304), y = _mm512_set1_epi32(0x05060708);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
      for (int i = 0; i < 24; ++i) a[i] = iv(_mm512_dpbusd_epi32(__m512i(a[i]), x, y));
      __asm__ volatile("" : "+v"(x));
    }
    int s = 0;
    for (int i = 0; i < 24; ++i) s += _mm512_reduce_add_epi32(__m512i(a[i]));
    sink += s;
  }
  double t = omp_get_wtime() - t0;
  if (sink == 42) printf(" ");
  return 2.0 * 24 * iters / t;
}
double fma_rate(int64_t iters) {  // vfmadd231ps zmm per second on two threads, 24 chains each
  double t0 = omp_get_wtime();
  float sink = 0;
#pragma omp parallel num_threads(2) reduction(+:sink)
  {
    fv a[24];
    for (int i = 0; i < 24; ++i) a[i] = fv(_mm512_set1_ps(i));
    __m512 x = _mm512_set1_ps(1.0001f), y = _mm512_set1_ps(0.9999f);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
      for (int i = 0; i < 24; ++i) a[i] = fv(_mm512_fmadd_ps(__m512(a[i]), x, y));
      __asm__ volatile("" : "+v"(x));
    }
    float s = 0;
    for (int i = 0; i < 24; ++i) s += _mm512_reduce_add_ps(__m512(a[i]));
    sink += s;
  }
  double t = omp_get_wtime() - t0;
  if (sink == 42.0f) printf(" ");
  return 2.0 * 24 * iters / t;
}
"""
m = load_inline("jakiro_peak_probe", [src], functions=["dpbusd_rate", "fma_rate"],
                extra_cflags=["-O2", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
for _ in range(3):
    d = m.dpbusd_rate(20_000_000); f = m.fma_rate(20_000_000)
    print(f"vpdpbusd {d/1e9:.2f} G/s on two threads, vfmadd231ps {f/1e9:.2f} G/s ({f*32/1e9:.0f} GFLOP/s); ratio {d/f:.2f}")
