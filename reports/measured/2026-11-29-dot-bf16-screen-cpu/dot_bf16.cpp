// A prototype, not part of the package: the head's screen through avx512_bf16's vdpbf16ps (rows and weights in bf16,
// two products per fp32 lane and instruction), beside the package's screen (bf16 weights widened, fp32 FMAs).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>
constexpr int64_t L = 16;
// W [V, K] fp32 -> [P][K/2][L][2] bf16 (as int16)
at::Tensor pack_pairs(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), P = (N + L - 1) / L;
  at::Tensor padded = at::zeros({P * L, K}, w.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, L, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();  // [P, K/2, L, 2]
}
template <int M, int NB>
inline void block(const uint32_t* xb, const uint16_t* panels, float* y, int64_t K2, int64_t Np, int64_t p) {
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m) for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const uint16_t* src = panels + p * K2 * L * 2;
  for (int64_t k = 0; k < K2; ++k) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) {
      w[j] = (__m512bh)_mm512_loadu_si512(src + (j * K2 + k) * L * 2);
      __builtin_prefetch(src + (j * K2 + k + 32) * L * 2);
    }
    for (int m = 0; m < M; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xb[m * K2 + k]);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], w[j], xv);
    }
  }
  for (int m = 0; m < M; ++m) for (int j = 0; j < NB; ++j) _mm512_storeu_ps(y + m * Np + (p + j) * L, acc[m][j]);
}
template <int M>
void rows(const uint32_t* x, const uint16_t* panels, float* y, int64_t K2, int64_t Np, int64_t p, int64_t pe) {
  constexpr int NB = M <= 2 ? 6 : M <= 4 ? 4 : 3;
  for (; p + NB <= pe; p += NB) block<M, NB>(x, panels, y, K2, Np, p);
  for (; p < pe; ++p) block<M, 1>(x, panels, y, K2, Np, p);
}
at::Tensor screen(const at::Tensor& x, const at::Tensor& packed) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0), K2 = K / 2;
  at::Tensor xb = x.to(at::kBFloat16).contiguous();
  at::Tensor y = at::empty({M, P * L}, x.options());
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(xb.data_ptr<at::BFloat16>());
  const uint16_t* pp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t Np = P * L;
  const int64_t per_block = std::max<int64_t>(12, (512 * 1024) / (K * L * 2) / 12 * 12);
  using F = void (*)(const uint32_t*, const uint16_t*, float*, int64_t, int64_t, int64_t, int64_t);
  static constexpr F by[9] = {nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t b = p0; b < p1; b += per_block) {
      const int64_t be = std::min(b + per_block, p1);
      for (int64_t m = 0; m < M; m += 8) by[std::min<int64_t>(8, M - m)](xp + m * K2, pp, yp + m * Np, K2, Np, b, be);
    }
  });
  return y;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("pack_pairs", &pack_pairs); m.def("screen", &screen); }
