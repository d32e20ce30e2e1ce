// The head's int8 panels through AVX-512 VNNI (vpdpbusd), for one record: each row's activations rounded to int16 and
// split into a high and a low byte (hi/lo: two vpdpbusd for each 64 products, the integer sums exact) or rounded to int8 (hi
// only: one), over the AMX layout [P, Kt / 4, 16, 4]; blocks of panels of 512 KB, rows in chunks of ``chunk``.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>
#include <cmath>
#include <vector>
constexpr int64_t L = 16;
// hi/lo int16 activations (exact) or hi-only int8 (HI_ONLY) sums, M rows, NB panels
template <int M, int NB, bool LO, bool NTA>
inline void vblock(const uint8_t* hu, const uint8_t* pl, const int8_t* panels, const float* scales,
                   const float* sx, float* s, int64_t Kt, int64_t Np, int64_t p) {
  __m512i hi[M][NB], lo[M][NB], off[NB];
  for (int j = 0; j < NB; ++j) { off[j] = _mm512_setzero_si512();
    for (int m = 0; m < M; ++m) { hi[m][j] = _mm512_setzero_si512(); if (LO) lo[m][j] = _mm512_setzero_si512(); } }
  const int8_t* src = panels + p * Kt * L;
  const __m512i bias = _mm512_set1_epi8(char(0x80));
  for (int64_t g = 0; g < Kt / 4; ++g) {
    __m512i w[NB];
    for (int j = 0; j < NB; ++j) {
      w[j] = _mm512_loadu_si512(src + (j * Kt / 4 + g) * 64);
      __builtin_prefetch(src + (j * Kt / 4 + g + 32) * 64, 0, NTA ? 0 : 3);
      off[j] = _mm512_dpbusd_epi32(off[j], bias, w[j]);
    }
    for (int m = 0; m < M; ++m) {
      const __m512i av = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(hu + m * Kt + 4 * g));
      for (int j = 0; j < NB; ++j) hi[m][j] = _mm512_dpbusd_epi32(hi[m][j], av, w[j]);
      if (LO) {
        const __m512i bv = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(pl + m * Kt + 4 * g));
        for (int j = 0; j < NB; ++j) lo[m][j] = _mm512_dpbusd_epi32(lo[m][j], bv, w[j]);
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512 sc = _mm512_loadu_ps(scales + (p + j) * L);
    for (int m = 0; m < M; ++m) {
      __m512i sum = _mm512_sub_epi32(hi[m][j], off[j]);
      if (LO) sum = _mm512_add_epi32(_mm512_slli_epi32(sum, 8), lo[m][j]);
      _mm512_storeu_ps(s + m * Np + (p + j) * L, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), sc), _mm512_set1_ps(sx[m])));
    }
  }
}
template <int M, bool LO, bool NTA>
void vrows(const uint8_t* hu, const uint8_t* pl, const int8_t* panels, const float* scales, const float* sx,
           float* s, int64_t Kt, int64_t Np, int64_t p, int64_t p_end) {
  constexpr int NB = LO ? (M == 1 ? 6 : M == 2 ? 4 : 2) : (M <= 2 ? 6 : M <= 4 ? 4 : 3);
  for (; p + NB <= p_end; p += NB) vblock<M, NB, LO, NTA>(hu, pl, panels, scales, sx, s, Kt, Np, p);
  for (; p < p_end; ++p) vblock<M, 1, LO, NTA>(hu, pl, panels, scales, sx, s, Kt, Np, p);
}
using VFn = void (*)(const uint8_t*, const uint8_t*, const int8_t*, const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
template <bool LO, bool NTA> constexpr VFn vby[9] = {nullptr, vrows<1,LO,NTA>, vrows<2,LO,NTA>, vrows<3,LO,NTA>, vrows<4,LO,NTA>,
  vrows<5,LO,NTA>, vrows<6,LO,NTA>, vrows<7,LO,NTA>, vrows<8,LO,NTA>};
// x [M, K] fp32, panels [P, Kt/4, L, 4] int8, scales [P*L] -> s [M, P*L]; mode 0: hi/lo, 1: hi only (int8 acts)
at::Tensor vsums(const at::Tensor& x, const at::Tensor& panels, const at::Tensor& scales, int64_t mode, int64_t chunk, bool nta) {
  const int64_t M = x.size(0), K = x.size(1), P = panels.size(0), Kt = panels.size(1) * 4;
  const bool lo = mode == 0;
  const float top = lo ? float(std::min<int64_t>(16383, ((int64_t(1) << 31) - 1) / (127 * Kt))) : 127.0f;
  std::vector<uint8_t> hu(M * Kt, 128), pl(M * Kt, 0);
  std::vector<float> sx(M);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float big = 0; for (int64_t k = 0; k < K; ++k) big = std::max(big, std::fabs(xp[m*K+k]));
    sx[m] = big > 0 ? big / top : 1.0f;
    for (int64_t k = 0; k < K; ++k) {
      const int32_t p = int32_t(std::nearbyint(xp[m*K+k] / sx[m]));
      if (lo) { hu[m*Kt+k] = uint8_t((p >> 8) + 128); pl[m*Kt+k] = uint8_t(p & 255); }
      else hu[m*Kt+k] = uint8_t(p + 128);
    }
  }
  at::Tensor s = at::empty({M, P * L}, x.options());
  const int64_t Np = P * L;
  const int8_t* pp = panels.data_ptr<int8_t>(); const float* sc = scales.data_ptr<float>(); float* sp = s.data_ptr<float>();
  const int64_t per_block = std::max<int64_t>(12, (512 * 1024) / (Kt * L) / 12 * 12);
  const int64_t C = chunk;
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t b = p0; b < p1; b += per_block) {
      const int64_t be = std::min(b + per_block, p1);
      for (int64_t m = 0; m < M; m += C) {
        const int64_t r = std::min<int64_t>(C, M - m);
        const bool one = M <= C && nta;
        (lo ? (one ? vby<true,true> : vby<true,false>) : (one ? vby<false,true> : vby<false,false>))[r](
            hu.data() + m*Kt, pl.data() + m*Kt, pp, sc, sx.data() + m, sp + m*Np, Kt, Np, b, be);
      }
    }
  });
  return s;
}
TORCH_LIBRARY(vnni_head, m) { m.def("vsums(Tensor x, Tensor panels, Tensor scales, int mode, int chunk, bool nta) -> Tensor"); m.impl("vsums", c10::DispatchKey::CPU, vsums); }
