// A weight-streaming GEMM for the few rows of a decoding step: y[m, :] = x[m, :] @ W^T for up to a few dozen rows
// m, with W read from memory once for all of them. W is packed once into panels of L output columns (one vector
// register: 16 with AVX-512, 8 elsewhere), [ceil(N / L)][K][L], so that each panel streams contiguously; a block of
// NB panels keeps M x NB accumulator vectors in registers, one FMA per (row, panel) for each k, and no horizontal
// sums. Each row's outputs are computed by the same sequence of FMAs whatever the number of rows, so a row's result
// does not depend on the rows beside it (a plain step and a verify forward agree bit for bit on the linears). Built
// for the CPU it runs on by jakiro_lib/models/kernels.py (stream_gemm_available, -O3 -march=native). The file also
// carries the RoPE and the RMSNorm of the target's lean forward and of the draft, the attention of a decoding step's
// few rows, greedy decoding's argmax and the screened head that finds it without reading the fp32 head in full.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <limits>
#include <cstring>
#include <utility>
#include <vector>
#include <torch/library.h>

namespace {

// L: output columns per panel, one vector register. NB(M): panels a block keeps in registers for M rows (M x NB
// accumulators, NB weight vectors and a broadcast); CHUNK: the most rows a pass over a block of panels takes (more
// rows: even chunks, each a pass).
#if defined(__AVX512F__)  // 32 registers of 16 floats
constexpr int64_t L = 16;
constexpr int CHUNK = 12;
template <int M> constexpr int panels_in_registers() { return M == 1 ? 6 : M == 2 ? 6 : M <= 4 ? 4 : M <= 8 ? 3 : 2; }
#else  // AVX2 and the rest: 16 registers of 8 floats
constexpr int64_t L = 8;
constexpr int CHUNK = 4;
template <int M> constexpr int panels_in_registers() { return M == 1 ? 6 : M == 2 ? 4 : M == 3 ? 3 : 2; }
#endif
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define TILE_SCREEN 1  // the head's screen through AMX's int8 tiles (integer_screen)
#else
#define TILE_SCREEN 0
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && !TILE_SCREEN
#define VNNI_SCREEN 1  // the head's integer screen through AVX-512 VNNI alone (integer_screen, signed_screen_sums)
#else
#define VNNI_SCREEN 0
#endif
typedef float vec __attribute__((vector_size(L * sizeof(float))));
typedef uint16_t half_vec __attribute__((vector_size(L * sizeof(uint16_t))));
typedef uint32_t wide_vec __attribute__((vector_size(L * sizeof(uint32_t))));
// Sixteen int32 sums in GCC's vector type (the integer screens' blocks): GCC keeps an array of them in registers, where
// with one of __m512i it copied each sum to another register and back around every vpdpbusd, or kept it on the stack.
typedef int32_t sums_vec __attribute__((vector_size(64)));

// Prefetch localities (__builtin_prefetch's third argument). Weights read again (a draft's, a block passed over once per
// chunk of rows) are prefetched to every level (KEEP, prefetcht0). Weights a step reads once (a target's fp32 panels
// and its head's screen) are prefetched with ``streamed_hint``: PAST (prefetchnta), through the caches without
// evicting what the step and the draft read again, or TO_L2 (prefetcht1) where the load-time probe measured the
// stream much faster so (kernels.probe_stream_prefetch: a CPU whose non-temporal prefetches stream slowly from memory,
// DESIGN section 9). The hint moves no arithmetic.
constexpr int PAST = 0, TO_L2 = 2, KEEP = 3;
int streamed_hint = PAST;  // process-wide, set at load (stream_prefetch), read as each linear or screen starts

// One panel row of L weights as fp32: stored fp32, or bf16 (the upper half of an fp32, widened in registers).
inline vec load(const float* p) {
  vec v;
  __builtin_memcpy(&v, p, sizeof(vec));
  return v;
}
inline void store(float* p, vec v) { __builtin_memcpy(p, &v, sizeof(vec)); }
inline vec load(const uint16_t* p) {
  half_vec h;
  __builtin_memcpy(&h, p, sizeof(half_vec));
  const wide_vec u = __builtin_convertvector(h, wide_vec) << 16;
  vec v;
  __builtin_memcpy(&v, &u, sizeof(vec));
  return v;
}
// int8: each output column's weights scaled into [-127, 127] and rounded (pack_int8); the column's scale multiplies its
// sums afterwards. Sign-extended and converted in registers (GCC's convertvector does it by scalars).
inline vec load(const int8_t* p) {
  vec v;
#if defined(__AVX512F__)
  const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  __builtin_memcpy(&v, &w, sizeof(vec));
#elif defined(__AVX2__)
  const __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  __builtin_memcpy(&v, &w, sizeof(vec));
#else
  for (int i = 0; i < L; ++i) v[i] = p[i];
#endif
  return v;
}

// ``scales`` (int8 panels): each column's sums times its scale, rounded once; null for fp32 and bf16 panels.
// ``Hint``: the panels' prefetch locality, KEEP (prefetcht0) for weights read again, or for weights a step reads once
// (run's ``stream``) the streamed hint stream_prefetch chose (streamed_hint).
template <int M, int NB, int Hint, typename W>
inline void block(const float* x, const W* panels, const float* scales, float* y, int64_t K, int64_t Np, int64_t p) {
  constexpr int64_t ahead = 2048 / (L * sizeof(W));  // k steps: 2 KB ahead on each panel's stream
  vec acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = vec{};
  const W* src = panels + p * K * L;
  for (int64_t k = 0; k < K; ++k) {
    vec w[NB];
    for (int j = 0; j < NB; ++j) {
      w[j] = load(src + (j * K + k) * L);
      __builtin_prefetch(src + (j * K + k + ahead) * L, 0, Hint);
    }
    for (int m = 0; m < M; ++m) {
      const float xv = x[m * K + k];
      for (int j = 0; j < NB; ++j) acc[m][j] += xv * w[j];
    }
  }
  if (scales != nullptr)
    for (int j = 0; j < NB; ++j) {
      const vec scale = load(scales + (p + j) * L);
      for (int m = 0; m < M; ++m) acc[m][j] *= scale;
    }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) store(y + m * Np + (p + j) * L, acc[m][j]);
}

template <int M, int Hint, typename W>
void rows(const float* x, const W* panels, const float* scales, float* y, int64_t K, int64_t Np, int64_t p,
          int64_t p_end) {
  constexpr int NB = panels_in_registers<M>();
  for (; p + NB <= p_end; p += NB) block<M, NB, Hint>(x, panels, scales, y, K, Np, p);
  for (; p < p_end; ++p) block<M, 1, Hint>(x, panels, scales, y, K, Np, p);
}

// rows<M> for M = 1..CHUNK at index M, under prefetch hint Hint
template <typename W>
using RowsFn = void (*)(const float*, const W*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
template <int Hint, typename W, size_t... I>
const RowsFn<W>* rows_table(std::index_sequence<I...>) {
  static constexpr RowsFn<W> table[] = {nullptr, rows<int(I) + 1, Hint, W>...};
  return table;
}
template <int Hint, typename W>
const RowsFn<W>* rows_by_count() { return rows_table<Hint, W>(std::make_index_sequence<CHUNK>{}); }

// One linear of a run: its panels (P of them), its scales (int8 panels; null otherwise), its output rows y [M, P L],
// and whether its weights stream (``stream``: weights a step reads once, a target's, prefetched with the streamed hint
// where one pass over each block serves every row, M <= CHUNK; more rows pass over a block once per chunk and need it
// kept in cache between passes).
template <typename W>
struct Job {
  const W* panels;
  const float* scales;
  float* y;
  int64_t P;
  bool stream;
};

// The panels of each of ``linears`` linears in a block a thread passes over once per chunk of rows: about 512 KB of
// them in all, a multiple of 12 of each, which every NB divides, so that no panel is left to a one-panel pass (one
// stream, M FMA chains) where a thread's share allows.
template <typename W>
int64_t block_panels(int64_t K, int64_t linears = 1) {
  return std::max<int64_t>(12, (512 * 1024) / (linears * K * L * int64_t(sizeof(W))) / 12 * 12);
}

// A job's panels b..b_end for rows x [M, K]: one pass over them per chunk of rows (rows split evenly), the block
// staying in cache between chunks.
template <typename W>
void pass(const float* x, int64_t M, int64_t K, const Job<W>& job, int64_t b, int64_t b_end) {
  const int64_t chunks = (M + CHUNK - 1) / CHUNK, per_chunk = (M + chunks - 1) / chunks, Np = job.P * L;
  const RowsFn<W>* by_rows = !(job.stream && M <= CHUNK) ? rows_by_count<KEEP, W>()
                             : streamed_hint == TO_L2 ? rows_by_count<TO_L2, W>() : rows_by_count<PAST, W>();
  for (int64_t m = 0; m < M; m += per_chunk)
    by_rows[std::min(per_chunk, M - m)](x + m * K, job.panels, job.scales, job.y + m * Np, K, Np, b, b_end);
}

// The jobs' linears of the same rows x [M, K] in one parallel region: the threads split the jobs' panels laid end to
// end, so linears that read the same input (a layer's q, k and v) meet once at the end, not once each. Each column's
// sums are the same whichever thread and block take its panel.
template <typename W>
void run_jobs(const float* x, int64_t M, int64_t K, const Job<W>* jobs, int64_t n_jobs) {
  const int64_t per_block = block_panels<W>(K);
  int64_t total = 0;
  for (int64_t j = 0; j < n_jobs; ++j) total += jobs[j].P;
  at::parallel_for(0, total, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t j = 0, first = 0; j < n_jobs; first += jobs[j].P, ++j) {
      const int64_t from = std::max<int64_t>(p0 - first, 0), to = std::min(p1 - first, jobs[j].P);
      for (int64_t b = from; b < to; b += per_block) pass(x, M, K, jobs[j], b, std::min(b + per_block, to));
    }
  });
}

template <typename W>
void run(const float* x, const W* panels, float* y, int64_t M, int64_t K, int64_t P, const float* scales, bool stream) {
  const Job<W> job{panels, scales, y, P, stream};
  run_jobs(x, M, K, &job, 1);
}

// Rows [N, K] as panels [ceil(N / L), K, L] of ``dtype``, the last panel's missing columns zero.
at::Tensor to_panels(const at::Tensor& rows, at::ScalarType dtype) {
  const int64_t N = rows.size(0), K = rows.size(1), P = (N + L - 1) / L;
  at::Tensor padded = at::zeros({P * L, K}, rows.options().dtype(dtype));
  padded.narrow(0, 0, N).copy_(rows);
  return padded.view({P, L, K}).transpose(1, 2).contiguous();  // [P, K, L]
}

// bf16: the panels hold the weight rounded to bf16 (half the bytes to stream); the arithmetic stays fp32.
at::Tensor pack(const at::Tensor& weight, bool bf16) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "stream_gemm.pack takes a 2-D fp32 CPU weight");
  return to_panels(weight, bf16 ? at::kBFloat16 : at::kFloat);
}

// int8 panels [P, K, L] of an fp32 weight [N, K] and each column's scale [P * L]: max_k |w_ck| / 127 (1 where the
// column is zero), each weight divided by it and rounded to the nearest integer. ``tiles``: the tile screen's layout
// [P, Kt / 4, L, 4], K padded with zeros to Kt, a multiple of 64, each column's weights at four successive k side by
// side (what an AMX tile of int8 B rows holds).
std::tuple<at::Tensor, at::Tensor> pack_int8(const at::Tensor& weight, bool tiles) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu() &&
              (!tiles || TILE_SCREEN || VNNI_SCREEN),
              "stream_gemm.pack_int8 takes a 2-D fp32 CPU weight (tiles: with AMX or AVX-512 VNNI)");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + L - 1) / L;
  const at::Tensor top = weight.abs().amax(1);
  const at::Tensor scale = at::where(top > 0, top / 127.0, at::ones_like(top));
  at::Tensor scales = at::ones({P * L}, weight.options());
  scales.narrow(0, 0, N).copy_(scale);
  at::Tensor panels = to_panels((weight / scale.unsqueeze(1)).round().clamp(-127, 127), at::kChar);  // [P, K, L]
  if (tiles) {
    const int64_t Kt = (K + 63) / 64 * 64;
    if (Kt > K) panels = at::cat({panels, at::zeros({P, Kt - K, L}, panels.options())}, 1);
    panels = panels.view({P, Kt / 4, 4, L}).transpose(2, 3).contiguous();  // [P, Kt / 4, L, 4]
  }
  return {panels, scales};
}

// The panels an int8 copy of n columns holds, and the panels its scales' bytes take after them (pack_scaled).
inline int64_t scaled_panels(int64_t n) { return (n + L - 1) / L; }
inline int64_t scale_panels(int64_t P, int64_t K) { return (4 * P + K - 1) / K; }

// A linear's int8 copy in one tensor: pack_int8's panels [P, K, L] of an fp32 weight [N, K], then as many panels
// again as its columns' fp32 scales [P * L] fill, their bytes (what linear reads as int8 panels).
at::Tensor pack_scaled(const at::Tensor& weight) {
  const auto [panels, scales] = pack_int8(weight, false);
  const int64_t P = panels.size(0), K = panels.size(1);
  at::Tensor out = at::zeros({P + scale_panels(P, K), K, L}, panels.options());
  out.narrow(0, 0, P).copy_(panels);
  std::memcpy(out.data_ptr<int8_t>() + P * K * L, scales.data_ptr<float>(), P * L * sizeof(float));
  return out;
}

// The panels ``packed`` holds for n output columns, and whether it serves rows of K inputs.
inline int64_t panels_of(const at::Tensor& packed, int64_t n) {
  return packed.scalar_type() == at::kChar ? scaled_panels(n) : packed.size(0);
}
bool linear_serves(const at::Tensor& packed, int64_t K, int64_t n) {
  const bool scaled = packed.scalar_type() == at::kChar;
  const int64_t P = panels_of(packed, n);
  return packed.dim() == 3 && packed.size(1) == K && packed.size(2) == L && packed.is_contiguous() && n <= P * L &&
         (!scaled || packed.size(0) == P + scale_panels(P, K));
}

// The floats linear_rows writes for M rows through ``packed``'s panels of n columns (their padded columns included).
inline int64_t padded_floats(const at::Tensor& packed, int64_t n, int64_t M) { return M * panels_of(packed, n) * L; }

// Rows written P L floats apart closed up to n apart.
inline void close_rows(float* y, int64_t M, int64_t P, int64_t n) {
  if (P * L != n)
    for (int64_t m = 1; m < M; ++m) std::memmove(y + m * n, y + m * P * L, n * sizeof(float));
}

// The job of a linear's panels ``packed`` (of W: fp32, bf16 or int8) for n output columns of rows of K inputs,
// writing y. fp32 panels (a target's weights, or a draft's kept in fp32) are streamed; bf16 and int8 panels
// (pack_scaled's, each column's sums times its scale), a draft's copies read several times a cycle, are kept in cache.
template <typename W>
Job<W> job_of(const at::Tensor& packed, int64_t n, int64_t K, float* y) {
  const int64_t P = panels_of(packed, n);
  const W* panels = reinterpret_cast<const W*>(packed.data_ptr());
  const bool scaled = packed.scalar_type() == at::kChar;
  const float* scales = !scaled ? nullptr  // the scales start P K L bytes on: a multiple of a float's
                        : reinterpret_cast<const float*>(reinterpret_cast<const int8_t*>(panels) + P * K * L);
  return {panels, scales, y, P, packed.scalar_type() == at::kFloat};
}

// f(W{}) for the panels' element type W of a kind of panels (bf16, int8, else fp32).
template <typename F>
void by_kind(at::ScalarType kind, F&& f) {
  if (kind == at::kBFloat16) {
    f(uint16_t{});
  } else if (kind == at::kChar) {
    f(int8_t{});
  } else {
    f(float{});
  }
}

// Linears of the same rows x [M, K] through panels of fp32, bf16 or int8 (``packed[i]`` for ``outs[i]`` columns, rows
// into ``ys[i]`` as linear_rows writes them), in one parallel region where their panels are of one kind (run_jobs),
// else one after another (each as job_of makes it).
void linears_rows(const float* x, int64_t M, int64_t K, std::initializer_list<const at::Tensor*> packed,
                  std::initializer_list<int64_t> outs, std::initializer_list<float*> ys) {
  const int64_t count = int64_t(packed.size());
  const at::ScalarType kind = packed.begin()[0]->scalar_type();
  for (int64_t i = 1; i < count; ++i)
    if (packed.begin()[i]->scalar_type() != kind) {
      for (int64_t j = 0; j < count; ++j)
        linears_rows(x, M, K, {packed.begin()[j]}, {outs.begin()[j]}, {ys.begin()[j]});
      return;
    }
  by_kind(kind, [&](auto tag) {  // each linear's job over its panels of type decltype(tag)
    using W = decltype(tag);
    std::vector<Job<W>> out;
    for (int64_t i = 0; i < count; ++i) out.push_back(job_of<W>(*packed.begin()[i], outs.begin()[i], K, ys.begin()[i]));
    run_jobs(x, M, K, out.data(), count);
  });
  for (int64_t i = 0; i < count; ++i)
    close_rows(ys.begin()[i], M, panels_of(*packed.begin()[i], outs.begin()[i]), outs.begin()[i]);
}

// linear's arithmetic on raw rows: x [M, K] -> y [M, n], rows n apart; y holds padded_floats (the panels' padded
// columns are written, then the rows closed up).
void linear_rows(const float* x, const at::Tensor& packed, int64_t M, int64_t K, int64_t n, float* y) {
  linears_rows(x, M, K, {&packed}, {n}, {y});
}

// input [..., K] -> [..., n] (linear_rows): the leading dimensions flattened into rows and restored here, not in
// Python.
at::Tensor linear(const at::Tensor& input, const at::Tensor& packed, int64_t n) {
  const int64_t K = input.dim() >= 1 ? input.size(-1) : 0;
  TORCH_CHECK(input.dim() >= 1 && input.scalar_type() == at::kFloat && linear_serves(packed, K, n),
              "stream_gemm.linear: shapes do not match");
  const at::Tensor x = input.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0), padded = padded_floats(packed, n, M);
  at::Tensor y = at::empty({padded}, x.options());
  linear_rows(x.data_ptr<float>(), packed, M, K, n, y.data_ptr<float>());
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = n;
  return (padded == M * n ? y : y.narrow(0, 0, M * n)).view(sizes);
}

at::Tensor linear_meta(const at::Tensor& input, const at::Tensor& packed, int64_t n) {
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = n;
  return at::empty(sizes, input.options());
}

// RoPE as transformers applies it, x cos + rotate_half(x) sin with rotate_half(x) = [-x2, x1], to queries and keys
// in one call (the lean forward's, models/fast_paths.py): each product and the sum rounded once, as torch's
// elementwise operators round them, never contracted into an FMA, so the result equals theirs bit for bit.
#if defined(__clang__)
#define NO_CONTRACTION _Pragma("clang fp contract(off)")
#else
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#define NO_CONTRACTION
#endif
// One sequence's heads: head h of row t at x + h * sh + t * st (D contiguous floats), cos and sin [n, D] -> out
// [n, H, D].
void rotate_rows(const float* x, int64_t sh, int64_t st, int64_t H, int64_t n, int64_t D, const float* cp,
                 const float* sp, float* out) {
  NO_CONTRACTION
  const int64_t half = D / 2;
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < n; ++t) {
      const float* in = x + h * sh + t * st;
      const float *ct = cp + t * D, *s = sp + t * D;
      float* y = out + (t * H + h) * D;
      for (int64_t d = 0; d < half; ++d) {
        const float kept = in[d] * ct[d], turned = -in[d + half] * s[d];
        y[d] = kept + turned;
      }
      for (int64_t d = half; d < D; ++d) {
        const float kept = in[d] * ct[d], turned = in[d - half] * s[d];
        y[d] = kept + turned;
      }
    }
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t B = x.size(0), H = x.size(1), n = x.size(2), D = x.size(3);
  TORCH_CHECK(x.stride(3) == 1 && D % 2 == 0 && cos.sizes() == sin.sizes() && cos.size(1) == 1 &&
              cos.size(2) == n && cos.size(3) == D && (cos.size(0) == B || cos.size(0) == 1),
              "stream_gemm.rope: shapes do not match");
  const at::Tensor c = cos.contiguous(), s = sin.contiguous();
  // [B, n, H, D], returned as [B, H, n, D]: the layout of the projections' views
  at::Tensor y = at::empty({B, n, H, D}, x.options());
  for (int64_t b = 0; b < B; ++b) {
    const int64_t row = (cos.size(0) == 1 ? 0 : b) * n * D;  // cos and sin at (b, 0)
    rotate_rows(x.data_ptr<float>() + b * x.stride(0), x.stride(1), x.stride(2), H, n, D, c.data_ptr<float>() + row,
                s.data_ptr<float>() + row, y.data_ptr<float>() + b * n * H * D);
  }
  return y.transpose(1, 2);
}
#if !defined(__clang__)
#pragma GCC pop_options
#endif

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                        const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 4 && q.scalar_type() == at::kFloat &&
              k.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "stream_gemm.rope takes fp32 [B, heads, n, D] queries and keys and [B, 1, n, D] cos and sin");
  return {rotate(q, cos, sin), rotate(k, cos, sin)};
}

std::tuple<at::Tensor, at::Tensor> rope_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                             const at::Tensor& sin) {
  auto like = [](const at::Tensor& x) {  // rotate's layout
    return at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options()).transpose(1, 2);
  };
  return {like(q), like(k)};
}

// RMSNorm as transformers' RMSNorm computes it in fp32, weight * (x * rsqrt(mean(x^2) + eps)), in one call (the lean
// forward's norms, models/fast_paths.py): each row alone, its sum of squares in L lanes along the row then the lanes
// added in order, so a row's result does not depend on the rows beside it. Equal to torch's operators to rounding
// (their sum runs in another order), not bit for bit.
void norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t H, double eps) {
  const float e = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * H;
    float* out = y + r * H;
    vec acc{};
    int64_t i = 0;
    for (; i + L <= H; i += L) {
      const vec v = load(in + i);
      acc += v * v;
    }
    float squares = 0.0f;
    for (int64_t lane = 0; lane < L; ++lane) squares += acc[lane];
    for (; i < H; ++i) squares += in[i] * in[i];
    const float scale = 1.0f / std::sqrt(squares / static_cast<float>(H) + e);
    for (int64_t j = 0; j < H; ++j) out[j] = w[j] * (in[j] * scale);
  }
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && weight.dim() == 1 &&
              input.dim() >= 1 && input.size(-1) == weight.size(0) && weight.size(0) > 0,
              "stream_gemm.rms_norm takes fp32 [..., H] rows and an fp32 [H] weight");
  const at::Tensor x = input.contiguous(), w = weight.contiguous();
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t H = w.size(0), rows = x.numel() / H;
  at::parallel_for(0, rows, 256, [&](int64_t r0, int64_t r1) {
    norm_rows(x.data_ptr<float>() + r0 * H, w.data_ptr<float>(), y.data_ptr<float>() + r0 * H, r1 - r0, H, eps);
  });
  return y;
}

at::Tensor rms_norm_meta(const at::Tensor& input, const at::Tensor& weight, double eps) {
  return at::empty_like(input, at::MemoryFormat::Contiguous);
}

// n rows of H heads of D floats copied into a cache part: row t of head h from in + h * ih + t * it to out + h * oh +
// p * op at position p = start + t, or slots[t] where given.
void write_rows(const float* in, int64_t ih, int64_t it, float* out, int64_t oh, int64_t op, int64_t H, int64_t n,
                int64_t D, int64_t start, const int64_t* slots) {
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < n; ++t)
      std::memcpy(out + h * oh + (slots == nullptr ? start + t : slots[t]) * op, in + h * ih + t * it,
                  D * sizeof(float));
}

// A decoding step's keys and values [B, n_kv, n, D] written into one layer's slot of the runner's cache buffer
// [layers, 2, B, n_kv, capacity, D] at positions start.. (models/fast_paths.py's write_kv), and that slot's keys and
// values up to the last written position returned as views: one call where the views and copies were ten a layer.
std::tuple<at::Tensor, at::Tensor> kv_write(const at::Tensor& stack, int64_t slot, const at::Tensor& keys,
                                            const at::Tensor& values, int64_t start) {
  TORCH_CHECK(stack.dim() == 6 && stack.size(1) == 2 && stack.is_contiguous() && keys.dim() == 4 &&
              keys.sizes() == values.sizes() && keys.size(0) == stack.size(2) && keys.size(1) == stack.size(3) &&
              keys.size(3) == stack.size(5) && keys.scalar_type() == stack.scalar_type() &&
              values.scalar_type() == stack.scalar_type() && 0 <= slot && slot < stack.size(0) && 0 <= start &&
              start + keys.size(2) <= stack.size(4), "stream_gemm.kv_write: shapes do not match");
  const int64_t B = keys.size(0), H = keys.size(1), n = keys.size(2), D = keys.size(3), end = start + n;
  const at::Tensor layer = stack.select(0, slot);  // [2, B, n_kv, capacity, D]
  at::Tensor k = layer.select(0, 0), v = layer.select(0, 1);
  if (stack.scalar_type() == at::kFloat && keys.stride(3) == 1 && values.stride(3) == 1) {  // rows of D floats
    const int64_t cap = stack.size(4);
    for (int part = 0; part < 2; ++part) {
      const at::Tensor& src = part == 0 ? keys : values;
      for (int64_t b = 0; b < B; ++b)
        write_rows(src.data_ptr<float>() + b * src.stride(0), src.stride(1), src.stride(2),
                   (part == 0 ? k : v).data_ptr<float>() + b * H * cap * D, cap * D, D, H, n, D, start, nullptr);
    }
  } else {
    k.narrow(2, start, n).copy_(keys);
    v.narrow(2, start, n).copy_(values);
  }
  return {k.narrow(2, 0, end), v.narrow(2, 0, end)};
}

// The attention of a decoding step's few query rows over the cache (DESIGN section 9), grouped KV heads read once for
// all their query heads. For each row and query head, over the keys j in order: s_j = (q . k_j) * scale (+ mask_j),
// m = max_j s_j, p_j = exp(s_j - m), out = (sum_j p_j v_j) / (sum_j p_j), both sums sequential in j, each dot product
// in one fixed order over the head's dimension, exp elementwise. A key the mask hides (its p_j exactly 0) adds exact
// zeros, so a tree row's output equals, bit for bit, the same row's over its path laid out contiguously: a plain
// step's (SDPA's blocked kernels do not promise that).
typedef int32_t int_vec __attribute__((vector_size(L * sizeof(int32_t))));
constexpr int VECTOR_REGISTERS = L == 16 ? 32 : 16;  // AVX-512's, or AVX2's and SSE's (with 8-lane vectors)

// exp(x) for x <= 0: Cody-Waite reduction by ln 2 and Cephes' expf polynomial (about one ulp); 0 below -87.3
// (no subnormals) and for -inf.
inline vec exp_nonpositive(vec x) {
  const int_vec under = x < -87.3f;
  x = under ? vec{} - 87.3f : x;
  const vec round = vec{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vec n = (x * 1.44269504088896341f + round) - round;
  const vec r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  vec p = vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int_vec bits = (__builtin_convertvector(n, int_vec) + 127) << 23;  // 2^n
  vec two_n;
  __builtin_memcpy(&two_n, &bits, sizeof(vec));
  return under ? vec{} : p * two_n;
}

// The largest of a row's V values (exact in any order: the same bits however the row is split), and
// sum_v exp(r_v - max) for r_v <= max.
float row_max(const float* r, int64_t V) {
  vec m = vec{} - std::numeric_limits<float>::infinity();
  int64_t v = 0;
  for (; v + L <= V; v += L) {
    const vec x = load(r + v);
    m = x > m ? x : m;
  }
  float out = m[0];
  for (int i = 1; i < L; ++i) out = std::max(out, m[i]);
  for (; v < V; ++v) out = std::max(out, r[v]);
  return out;
}

float exp_sum(const float* r, int64_t V, float max) {
  vec acc{};
  int64_t v = 0;
  for (; v + L <= V; v += L) acc += exp_nonpositive(load(r + v) - max);
  float out = 0.0f;
  for (int i = 0; i < L; ++i) out += acc[i];
  for (; v < V; ++v) out += std::exp(r[v] - max);
  return out;
}

// Lane sums of 2W vectors, two at a time: lanes x and x + W of each block of 2W added, the two vectors' halves packed
// into one. L vectors folded down to one give each vector's lane sum in its own lane, every sum by the same tree.
constexpr int half_lane(int W, int half, size_t i) { return int(i / W) * 2 * W + half * W + int(i % W); }
template <int W, size_t... I>
inline vec fold(vec x, vec y, std::index_sequence<I...>) {
#if defined(__clang__)
  return __builtin_shufflevector(x, y, half_lane(W, 0, I)...) + __builtin_shufflevector(x, y, half_lane(W, 1, I)...);
#else
  constexpr int_vec lo{half_lane(W, 0, I)...}, hi{half_lane(W, 1, I)...};
  return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi);
#endif
}

// Keys j .. j + L/W - 1 of a block of L keys (k: its first; those from `keys` on count 0, unless Full), their dot
// products with q (DV vectors qv) folded to width W: W = 1 gives the block's L scores, lane i key i. Depth first, so
// that few vectors are live at once (16 registers without AVX-512).
template <int DV, int W, bool Full>
inline vec key_sums(const vec* qv, const float* k, int64_t ks, int64_t j, int64_t keys) {
  if constexpr (W == L) {
    const float* kj = k + (Full || j < keys ? j : 0) * ks;  // past the last key: the first again, then zeroed
    vec t{};  // from zero: every product added by one FMA (q0 k0 + q1 k1 could contract either way)
    for (int c = 0; c < DV; ++c) t += qv[c] * load(kj + c * L);
    return Full || j < keys ? t : vec{};
  } else {
    return fold<W>(key_sums<DV, 2 * W, Full>(qv, k, ks, j, keys),
                   key_sums<DV, 2 * W, Full>(qv, k, ks, j + L / (2 * W), keys), std::make_index_sequence<L>{});
  }
}

// The scores (dot products) of keys j0 <= j < j0 + L (those < S; the rest 0) with query q [D = DV L].
template <int DV, bool Full>
inline vec block_scores(const vec* qv, const float* k, int64_t ks, int64_t keys) {
#if !defined(__AVX512F__) && defined(__AVX__)
  // AVX2: the same kind of tree through hadd, which pairs neighbouring lanes within each 128-bit half, then the
  // halves added (GCC's two-source shuffles of 8 lanes take several instructions each)
  auto pair = [&](int64_t j) {
    __m256 a, b;
    const vec x = key_sums<DV, L, Full>(qv, k, ks, j, keys), y = key_sums<DV, L, Full>(qv, k, ks, j + 1, keys);
    __builtin_memcpy(&a, &x, sizeof(vec));
    __builtin_memcpy(&b, &y, sizeof(vec));
    return _mm256_hadd_ps(a, b);
  };
  const __m256 low = _mm256_hadd_ps(pair(0), pair(2)), high = _mm256_hadd_ps(pair(4), pair(6));
  const __m256 sums = _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
  vec out;
  __builtin_memcpy(&out, &sums, sizeof(vec));
  return out;
#else
  return key_sums<DV, 1, Full>(qv, k, ks, 0, keys);
#endif
}
template <int DV>
inline vec scores(const float* q, const float* k, int64_t ks, int64_t j0, int64_t S) {
  vec qv[DV];
  for (int c = 0; c < DV; ++c) qv[c] = load(q + c * L);
  k += j0 * ks;
  return j0 + L <= S ? block_scores<DV, true>(qv, k, ks, L) : block_scores<DV, false>(qv, k, ks, S - j0);
}

// Rows j0 <= j < min(S, j1) of x (stride xs, DV vectors each) fetched into the cache ahead of their use.
template <int DV>
inline void prefetch_rows(const float* x, int64_t xs, int64_t j0, int64_t j1, int64_t S) {
  for (int64_t j = j0; j < std::min(S, j1); ++j)
    for (int64_t c = 0; c < DV * L; c += 16) __builtin_prefetch(x + j * xs + c);
}

// out[i] = (sum_j w[i][j] v_j) / (sum_j w[i][j]) over the keys j < S in order, for C queries at once (their chains
// interleaved, each query's order unchanged), the accumulators in registers over all the keys and the values fetched
// a block of L keys ahead; w[i] at w + i * stride.
template <int DV, int C>
inline void values_pass(const float* w, int64_t stride, const float* v, int64_t vs, int64_t S, float* const* out) {
  vec acc[C][DV];
  float sum[C];
  for (int i = 0; i < C; ++i) {
    sum[i] = 0.0f;
    for (int c = 0; c < DV; ++c) acc[i][c] = vec{};
  }
  for (int64_t j0 = 0; j0 < S; j0 += L) {
    const int64_t j1 = std::min(S, j0 + L);
    prefetch_rows<DV>(v, vs, j1, j1 + L, S);
    for (int64_t j = j0; j < j1; ++j) {
      vec vj[DV];
      for (int c = 0; c < DV; ++c) vj[c] = load(v + j * vs + c * L);
      for (int i = 0; i < C; ++i) {
        const float x = w[i * stride + j];
        sum[i] += x;
        for (int c = 0; c < DV; ++c) acc[i][c] += x * vj[c];
      }
    }
  }
  for (int i = 0; i < C; ++i)
    for (int c = 0; c < DV; ++c) store(out[i] + c * L, acc[i][c] / sum[i]);
}

// values_pass for the last r queries of a task, r < C, in one pass (R: the most this instance takes).
template <int DV, int R>
inline void values_rest(int64_t r, const float* w, int64_t stride, const float* v, int64_t vs, int64_t S,
                        float* const* out) {
  if constexpr (R >= 1) {
    if (r == R)
      values_pass<DV, R>(w, stride, v, vs, S, out);
    else
      values_rest<DV, R - 1>(r, w, stride, v, vs, S, out);
  }
}

// P queries q[i] [D] over one KV head's keys and values [S, D] (strides ks, vs), query i under mask[i] [Sp] (0 past
// S; null: none); out[i] [D]; s: [P, Sp] scratch. Keys go by blocks of L, in L1 for every query.
template <int DV>
void attend_queries(const float* const* q, const float* k, int64_t ks, const float* v, int64_t vs,
                    const float* const* mask, int64_t S, int64_t P, float scale, float* const* out, float* s) {
  const int64_t Sp = (S + L - 1) / L * L;
  // Each block's keys, and each block's values, fetched one block ahead: a block of L keys with 64-dimension heads
  // is a 4 KB page, past which the hardware's prefetcher does not follow
  for (int64_t j0 = 0; j0 < S; j0 += L) {
    prefetch_rows<DV>(k, ks, j0 + L, j0 + 2 * L, S);
    for (int64_t i = 0; i < P; ++i) {
      vec x = scores<DV>(q[i], k, ks, j0, S) * scale;
      if (mask != nullptr) x += load(mask[i] + j0);
      store(s + i * Sp + j0, x);
    }
  }
  prefetch_rows<DV>(v, vs, 0, L, S);
  for (int64_t i = 0; i < P; ++i) {
    float* si = s + i * Sp;
    for (int64_t j = S; j < Sp; ++j) si[j] = -INFINITY;
    const float m = row_max(si, Sp);
    for (int64_t j = 0; j < Sp; j += L) store(si + j, exp_nonpositive(load(si + j) - m));
  }
  constexpr int C = std::max(1, VECTOR_REGISTERS / 2 / DV);  // queries whose accumulators fit half the registers
  int64_t i = 0;
  for (; i + C <= P; i += C) values_pass<DV, C>(s + i * Sp, Sp, v, vs, S, out + i);
  if (i < P) values_rest<DV, C - 1>(P - i, s + i * Sp, Sp, v, vs, S, out + i);
}

using QueriesFn = void (*)(const float* const*, const float*, int64_t, const float*, int64_t, const float* const*,
                           int64_t, int64_t, float, float* const*, float*);
QueriesFn queries_fn(int64_t D) {  // head sizes 16 to 128 with either register width
  switch (D % L == 0 ? D / L : 0) {
    case 1: return attend_queries<1>;
    case 2: return attend_queries<2>;
    case 4: return attend_queries<4>;
    case 8: return attend_queries<8>;
    case 16: return attend_queries<16>;
    default: return nullptr;
  }
}

// padded_mask's rows from a boolean mask [n, S] on raw memory (True: seen): 0 where seen, fp32's lowest elsewhere,
// 0 past S to whole blocks of L; out [n, Sp].
void seen_rows(const bool* seen, int64_t n, int64_t S, float* out) {
  const int64_t Sp = (S + L - 1) / L * L;
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t c = 0; c < S; ++c) out[r * Sp + c] = seen[r * S + c] ? 0.0f : std::numeric_limits<float>::lowest();
    std::fill(out + r * Sp + S, out + (r + 1) * Sp, 0.0f);
  }
}

// The mask [.., n, S] as the kernel reads it: [n, Sp], additive, the keys' whole blocks of L, 0 past S; undefined for
// none. An fp32 mask is additive; a boolean one (True: seen) adds 0 where seen (the bits of no mask where all are)
// and fp32's lowest value elsewhere (seen_rows' loop where it holds n rows of S contiguous, torch's operators else).
at::Tensor padded_mask(const c10::optional<at::Tensor>& mask, int64_t n, int64_t S) {
  if (!mask.has_value() || !mask->defined()) return at::Tensor();
  const bool seen = mask->scalar_type() == at::kBool;
  TORCH_CHECK(seen || mask->scalar_type() == at::kFloat, "stream_gemm.attend takes an fp32 additive or a boolean mask");
  if (seen && mask->is_contiguous() && mask->numel() == n * S && mask->size(-1) == S) {
    at::Tensor padded = at::empty({n, (S + L - 1) / L * L}, mask->options().dtype(at::kFloat));
    seen_rows(mask->data_ptr<bool>(), n, S, padded.data_ptr<float>());
    return padded;
  }
  at::Tensor padded = at::zeros({n, (S + L - 1) / L * L}, mask->options().dtype(at::kFloat));
  const at::Tensor rows = mask->expand({1, 1, n, S})[0][0];
  if (seen)
    padded.narrow(1, 0, S).masked_fill_(rows.logical_not(), std::numeric_limits<float>::lowest());
  else
    padded.narrow(1, 0, S).copy_(rows);
  return padded;
}

bool attend_serves(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return q.dim() == 4 && q.size(0) == 1 && k.dim() == 4 && k.sizes() == v.sizes() && k.size(0) == 1 &&
         q.size(3) == k.size(3) && k.size(1) > 0 && q.size(1) % k.size(1) == 0 && q.scalar_type() == at::kFloat &&
         k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && queries_fn(q.size(3)) != nullptr;
}

// The attention on raw rows: query head h of row r at qp + h * qh + r * qr, KV head g's key j at kp + g * kh + j * ks
// (values alike), each D contiguous floats; mask [n, Sp] or null; out [n, Hq, D].
void attend_rows(const float* qp, int64_t qh, int64_t qr, const float* kp, int64_t kh, int64_t ks, const float* vp,
                 int64_t vh, int64_t vs, const float* mp, int64_t Hq, int64_t Hk, int64_t n, int64_t S, int64_t D,
                 double scale, float* op) {
  const int64_t G = Hq / Hk, Sp = (S + L - 1) / L * L;
  const QueriesFn fn = queries_fn(D);
  const int64_t chunks = std::max<int64_t>((n + 7) / 8, std::min<int64_t>(n, (4 + Hk - 1) / Hk));
  const int64_t R = (n + chunks - 1) / chunks;
  at::parallel_for(0, (n + R - 1) / R * Hk, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(R * G * Sp);
    std::vector<const float*> qs(R * G), ms(R * G);
    std::vector<float*> os(R * G);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t % Hk, r0 = t / Hk * R, P = std::min(R, n - r0) * G;
      for (int64_t i = 0; i < P; ++i) {
        const int64_t r = r0 + i / G, h = g * G + i % G;
        qs[i] = qp + h * qh + r * qr;
        ms[i] = mp == nullptr ? nullptr : mp + r * Sp;
        os[i] = op + (r * Hq + h) * D;
      }
      fn(qs.data(), kp + g * kh, ks, vp + g * vh, vs, mp == nullptr ? nullptr : ms.data(), S, P, float(scale),
         os.data(), s.data());
    }
  });
}

// attend with its mask padded (padded_mask)
at::Tensor attend_padded(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& mask,
                         double scale) {
  TORCH_CHECK(attend_serves(q_, k_, v_) && (!mask.defined() || (mask.size(0) == q_.size(2) &&
              mask.size(1) == (k_.size(2) + L - 1) / L * L)), "stream_gemm.attend: shapes do not match");
  auto last_contiguous = [](const at::Tensor& x) { return x.stride(3) == 1 ? x : x.contiguous(); };
  const at::Tensor q = last_contiguous(q_), k = last_contiguous(k_), v = last_contiguous(v_);
  at::Tensor out = at::empty({1, q.size(2), q.size(1), q.size(3)}, q.options());
  attend_rows(q.data_ptr<float>(), q.stride(1), q.stride(2), k.data_ptr<float>(), k.stride(1), k.stride(2),
              v.data_ptr<float>(), v.stride(1), v.stride(2), mask.defined() ? mask.data_ptr<float>() : nullptr,
              q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), scale, out.data_ptr<float>());
  return out;
}

// q [1, Hq, n, D], k and v [1, Hk, S, D] (Hk dividing Hq), mask additive [.., n, S] or none -> [1, n, Hq, D], the
// layout SDPA's output is transposed to. Tasks: a KV head and a chunk of rows (at most 8, even chunks, four tasks
// where the rows allow).
at::Tensor attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const c10::optional<at::Tensor>& mask,
                  double scale) {
  TORCH_CHECK(attend_serves(q, k, v), "stream_gemm.attend: shapes do not match");
  return attend_padded(q, k, v, padded_mask(mask, q.size(2), k.size(2)), scale);
}

at::Tensor attend_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const c10::optional<at::Tensor>& mask, double scale) {
  return at::empty({1, q.size(2), q.size(1), q.size(3)}, q.options());
}

// Each row's argmax as torch.argmax(-1) gives it: the first of equal maxima (-0 and +0 equal), the first NaN where a
// row has one. Greedy decoding reads it after every forward (DESIGN section 9 has what torch's costs).
int64_t row_argmax(const float* r, int64_t V) {
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(r + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, v);
  }
  float best = _mm512_reduce_max_ps(top);
  for (int64_t j = i; j < V; ++j) {
    if (r[j] != r[j]) nan = 1;
    else if (r[j] > best) best = r[j];
  }
  if (nan) {
    for (int64_t j = 0; j < V; ++j)
      if (r[j] != r[j]) return j;
  }
  const __m512 b = _mm512_set1_ps(best);
  for (i = 0; i + 16 <= V; i += 16) {
    const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + i), b, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < V; ++i)
    if (r[i] == best) return i;
  return 0;
#else
  int64_t at = 0;
  for (int64_t i = 0; i < V; ++i) {
    if (r[i] != r[i]) return i;
    if (r[i] > r[at]) at = i;
  }
  return at;
#endif
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0 && x.scalar_type() == at::kFloat,
              "stream_gemm.argmax takes fp32 [rows, words]");
  const at::Tensor c = x.contiguous();
  const int64_t M = c.size(0), V = c.size(1);
  at::Tensor out = at::empty({M}, c.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const float* p = c.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) o[m] = row_argmax(p + m * V, V);
  });
  return out;
}

at::Tensor argmax_meta(const at::Tensor& x) { return at::empty({x.size(0)}, x.options().dtype(at::kLong)); }

// Greedy decoding's argmax of each row's logits W x without reading W in full (DESIGN section 9): a screen through
// W's int8 panels (a quarter of the bytes, fp32 FMAs, each column's scale after) gives s_c within bound_c * |x|_1 of
// the word's exact logit, bound_c holding the largest rounding of the word's weights in the copy and both dot
// products' accumulation error (set in Python, with an allowance for underflow); every word whose s_c + bound_c |x|_1 reaches the largest s_j - bound_j |x|_1 is a
// candidate, the exact argmax always among them. Exact: a candidate's logit is sum_k x_k w_ck in fp32, one FMA per k
// in k's order (`exact`), the first of equal maxima chosen; where the screen is not finite every word is a candidate.
constexpr float kUnderflowAllowance = 1e-30f;  // what each side of the screen's comparison allows for underflow

float exact(const float* x, const float* w, int64_t K) {
  float acc = 0.0f;
  for (int64_t k = 0; k < K; ++k) acc = std::fma(x[k], w[k], acc);
  return acc;
}

// The largest s_c - B_c, B_c = bound_c * norm + l1_c * t, less the allowance for underflow; NaN where some s_c is not
// finite. ``word``: where given, set to a word c of that largest s_c - B_c.
float screen_cut(const float* s, const float* bound, const float* l1, float norm, float t, int64_t V,
                 int64_t* word = nullptr) {
  float cut = -INFINITY, bad = 0.0f;  // bad: 0 while every s_c is finite (s * 0 is NaN for an infinity or a NaN)
  int64_t c = 0, at = 0;
#if defined(__AVX512F__)
  __m512 top = _mm512_set1_ps(-INFINITY), bad_lanes = _mm512_setzero_ps();
  __m512i where = _mm512_setzero_si512(), here = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 n = _mm512_set1_ps(norm), tt = _mm512_set1_ps(t);
  for (; c + 16 <= V; c += 16, here = _mm512_add_epi32(here, _mm512_set1_epi32(16))) {
    const __m512 v = _mm512_loadu_ps(s + c);
    bad_lanes = _mm512_add_ps(bad_lanes, _mm512_mul_ps(v, _mm512_setzero_ps()));
    const __m512 b = _mm512_fmadd_ps(_mm512_loadu_ps(bound + c), n, _mm512_mul_ps(_mm512_loadu_ps(l1 + c), tt));
    const __m512 lo = _mm512_sub_ps(v, b);
    const __mmask16 more = _mm512_cmp_ps_mask(lo, top, _CMP_GT_OQ);
    top = _mm512_mask_mov_ps(top, more, lo);
    where = _mm512_mask_mov_epi32(where, more, here);
  }
  cut = _mm512_reduce_max_ps(top);
  bad = _mm512_reduce_add_ps(bad_lanes);
  alignas(64) float tops[16];
  alignas(64) int32_t words[16];
  _mm512_store_ps(tops, top);
  _mm512_store_si512(words, where);
  for (int i = 0; i < 16; ++i)
    if (tops[i] == cut) at = words[i];
#endif
  for (; c < V; ++c) {
    bad += s[c] * 0.0f;
    const float lo = s[c] - std::fma(bound[c], norm, l1[c] * t);
    if (lo > cut) cut = lo, at = c;
  }
  if (word != nullptr) *word = at;
  return bad == 0.0f ? cut - kUnderflowAllowance : NAN;
}

// The first index of the largest exact logit among the words whose s_c + B_c, plus the same allowance for underflow as
// ``cut`` took off, reaches ``cut`` (every word where ``cut`` is NaN); B_c = bound_c * norm + l1_c * t.
int64_t screened_argmax(const float* x, const float* s, const float* bound, const float* l1, float t,
                        const float* weight, int64_t V, int64_t K) {
  float norm = 0.0f;
  for (int64_t k = 0; k < K; ++k) norm += std::fabs(x[k]);
  const float cut = std::isfinite(norm) ? screen_cut(s, bound, l1, norm, t, V) : NAN;
  int64_t best = -1;
  float top = 0.0f;
  auto consider = [&](int64_t c) {  // false where the word's logit is NaN: torch's argmax gives the first NaN
    const float v = exact(x, weight + c * K, K);
    if (best < 0 || v > top || v != v) {
      best = c;
      top = v;
    }
    return v == v;
  };
  int64_t c = 0;
#if defined(__AVX512F__)
  if (cut == cut) {
    const __m512 n = _mm512_set1_ps(norm), tt = _mm512_set1_ps(t), edge = _mm512_set1_ps(cut - kUnderflowAllowance);
    for (; c + 16 <= V; c += 16) {
      const __m512 b = _mm512_fmadd_ps(_mm512_loadu_ps(bound + c), n, _mm512_mul_ps(_mm512_loadu_ps(l1 + c), tt));
      const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(s + c), b);
      for (__mmask16 hit = _mm512_cmp_ps_mask(hi, edge, _CMP_GE_OQ); hit; hit &= hit - 1)
        if (!consider(c + __builtin_ctz(hit))) return best;
    }
  }
#endif
  for (; c < V; ++c) {
    if (cut == cut && s[c] + std::fma(bound[c], norm, l1[c] * t) + kUnderflowAllowance < cut) continue;
    if (!consider(c)) return best;
  }
  return best;
}

#if TILE_SCREEN
// Whether this process may use AMX's tiles: Linux grants them on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA), once for every thread.
bool tiles_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return permitted;
}

struct alignas(64) TileConfig {  // ldtilecfg's 64 bytes: palette 1, each tile's bytes a row and rows
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The screened logits s [M, P * L] = (sum_k q_ck p_k) * scale_c * sx_m of rows p [M, Kt] (int16, held as a signed
// high byte ph and an unsigned low byte pl, p = 256 ph + pl) with the tile panels [P, Kt / 4, L, 4]: per 16 rows and
// pair of panels, tiles 0-1 the rows' bytes for 64 k, 2-3 the panels' weights for them, 4-7 the four int32 sums
// (tdpbssd for the high bytes, tdpbusd for the low), exact; each sum then rounded to fp32 and scaled.
void tile_screen_sums(const int8_t* ph, const uint8_t* pl, const int8_t* panels, const float* scales, const float* sx,
                      float* s, int64_t M, int64_t Kt, int64_t P) {
  const int64_t Np = P * L, steps = Kt / 64;
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    alignas(64) int32_t hi[16 * 16], lo[16 * 16];
    for (int64_t m0 = 0; m0 < M; m0 += 16) {
      const int rows = int(std::min<int64_t>(16, M - m0));
      TileConfig config;
      for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = t == 2 || t == 3 ? 16 : rows;
      }
      _tile_loadconfig(&config);
      auto keep = [&](int64_t p) {  // panel p's sums 256 hi + lo (modulo 2^32: exact in int32), rounded and scaled
        for (int r = 0; r < rows; ++r)
          for (int c = 0; c < 16; ++c)
            s[(m0 + r) * Np + p * L + c] =
                float(int32_t(256u * uint32_t(hi[r * 16 + c]) + uint32_t(lo[r * 16 + c]))) * scales[p * L + c] *
                sx[m0 + r];
      };
      for (int64_t p = p0; p < p1; p += 2) {
        const bool pair = p + 1 < p1;
        const int8_t* w = panels + p * Kt * L;
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t step = 0; step < steps; ++step) {
          for (int64_t b = 0; b < 2048; b += 64) __builtin_prefetch(w + 4 * Kt * L + step * 2048 + b);  // 2 pairs on
          _tile_loadd(0, ph + m0 * Kt + step * 64, Kt);
          _tile_loadd(1, pl + m0 * Kt + step * 64, Kt);
          _tile_loadd(2, w + step * 64 * L, 64);
          _tile_dpbssd(4, 0, 2);
          _tile_dpbusd(5, 1, 2);
          if (pair) {
            _tile_loadd(3, w + (Kt + step * 64) * L, 64);
            _tile_dpbssd(6, 0, 3);
            _tile_dpbusd(7, 1, 3);
          }
        }
        _tile_stored(4, hi, 64);  // the tile instructions name their tiles as constants
        _tile_stored(5, lo, 64);
        keep(p);
        if (pair) {
          _tile_stored(6, hi, 64);
          _tile_stored(7, lo, 64);
          keep(p + 1);
        }
      }
      _tile_release();
    }
  });
}

// The same sums through AVX-512 VNNI for a few rows, from vector loads of the same panels: vpdpbusd multiplies unsigned
// by signed bytes, so each row's high byte goes in offset by 128 (hu = ph + 128) and 128 sum_k q_ck, accumulated
// once for all rows, comes off: sum = 256 (sum hu q - 128 sum q) + sum pl q, exact in int32.
template <int M, int NB>
inline void vnni_block(const uint8_t* hu, const uint8_t* pl, const int8_t* panels, const float* scales,
                       const float* sx, float* s, int64_t Kt, int64_t Np, int64_t p) {
  sums_vec hi[M][NB], lo[M][NB], off[NB];
  for (int j = 0; j < NB; ++j) {
    off[j] = sums_vec{};
    for (int m = 0; m < M; ++m) hi[m][j] = lo[m][j] = sums_vec{};
  }
  const int8_t* src = panels + p * Kt * L;
  const __m512i bias = _mm512_set1_epi8(char(0x80));
  for (int64_t g = 0; g < Kt / 4; ++g) {  // four k a step: 16 columns x 4 bytes
    __m512i w[NB];
    for (int j = 0; j < NB; ++j) {
      w[j] = _mm512_loadu_si512(src + (j * Kt / 4 + g) * 64);
      __builtin_prefetch(src + (j * Kt / 4 + g + 32) * 64);
      off[j] = sums_vec(_mm512_dpbusd_epi32(__m512i(off[j]), bias, w[j]));
    }
    for (int m = 0; m < M; ++m) {
      int32_t a, b;
      __builtin_memcpy(&a, hu + m * Kt + 4 * g, 4);
      __builtin_memcpy(&b, pl + m * Kt + 4 * g, 4);
      const __m512i av = _mm512_set1_epi32(a), bv = _mm512_set1_epi32(b);
      for (int j = 0; j < NB; ++j) {
        hi[m][j] = sums_vec(_mm512_dpbusd_epi32(__m512i(hi[m][j]), av, w[j]));
        lo[m][j] = sums_vec(_mm512_dpbusd_epi32(__m512i(lo[m][j]), bv, w[j]));
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512 sc = _mm512_loadu_ps(scales + (p + j) * L);
    for (int m = 0; m < M; ++m) {
      const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(_mm512_sub_epi32(__m512i(hi[m][j]), __m512i(off[j])), 8),
                                           __m512i(lo[m][j]));
      _mm512_storeu_ps(s + m * Np + (p + j) * L,
                       _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), sc), _mm512_set1_ps(sx[m])));
    }
  }
}

template <int M>
void vnni_rows(const uint8_t* hu, const uint8_t* pl, const int8_t* panels, const float* scales, const float* sx,
               float* s, int64_t Kt, int64_t Np, int64_t p, int64_t p_end) {
  constexpr int NB = M == 1 ? 6 : M == 2 ? 4 : 2;
  for (; p + NB <= p_end; p += NB) vnni_block<M, NB>(hu, pl, panels, scales, sx, s, Kt, Np, p);
  for (; p < p_end; ++p) vnni_block<M, 1>(hu, pl, panels, scales, sx, s, Kt, Np, p);
}

constexpr int64_t kVnniRows = 4;  // rows the VNNI sums serve; the tiles past them

void vnni_screen_sums(const uint8_t* hu, const uint8_t* pl, const int8_t* panels, const float* scales,
                      const float* sx, float* s, int64_t M, int64_t Kt, int64_t P) {
  using RowsFn = void (*)(const uint8_t*, const uint8_t*, const int8_t*, const float*, const float*, float*, int64_t,
                          int64_t, int64_t, int64_t);
  static constexpr RowsFn by_rows[5] = {nullptr, vnni_rows<1>, vnni_rows<2>, vnni_rows<3>, vnni_rows<4>};
  const int64_t Np = P * L;
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t m = 0; m < M; m += 4) {
      const int64_t r = std::min<int64_t>(4, M - m);
      by_rows[r](hu + m * Kt, pl + m * Kt, panels, scales, sx + m, s + m * Np, Kt, Np, p0, p1);
    }
  });
}

#endif

#if VNNI_SCREEN
// The integer screen's sums through AVX-512 VNNI alone, the activations the signed operand so that each row's bytes
// reach vpdpbusd as a broadcast: each row's p = 128 h + l (h = p >> 7 and l = p & 127, both signed bytes), each word's
// weights offset to unsigned bytes (q + 128, the panel's bytes with their top bit flipped), and the offsets' share,
// 128 sum_k h_k and 128 sum_k l_k a row (``off``), taken off: sum = 128 (sum (q + 128) h - 128 sum h) + sum (q + 128) l
// - 128 sum l, exact in int32 (sums wrap on the way; the total is within int32 by ``top``). ``hw`` and ``lw`` [M, Kt /
// 4]: a row's h and l, four k a word.
template <int M, int NB, int Hint>
inline void signed_block(const int32_t* hw, const int32_t* lw, const int32_t* off, const int8_t* panels,
                         const float* scales, const float* sx, float* s, int64_t Kt, int64_t Np, int64_t p) {
  const int64_t G = Kt / 4;
  sums_vec hi[M][NB], lo[M][NB];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) hi[m][j] = lo[m][j] = sums_vec{};
  const int8_t* src = panels + p * Kt * L;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  // prefetched 2 KB ahead; a streamed head's rows past four 12 KB ahead (their sums take about eight cycles a line of
  // weights, and at 2 KB the loads waited: DESIGN section 9)
  constexpr int64_t ahead = Hint != KEEP && M > 4 ? 192 : 32;
  for (int64_t g = 0; g < G; ++g) {  // four k a step: 16 columns x 4 bytes
    __m512i w[NB];
    for (int j = 0; j < NB; ++j) {
      w[j] = _mm512_xor_si512(_mm512_loadu_si512(src + (j * G + g) * 64), flip);
      __builtin_prefetch(src + (j * G + g + ahead) * 64, 0, Hint);
    }
    for (int m = 0; m < M; ++m) {
      const __m512i h = _mm512_set1_epi32(hw[m * G + g]), l = _mm512_set1_epi32(lw[m * G + g]);
      for (int j = 0; j < NB; ++j) {
        hi[m][j] = sums_vec(_mm512_dpbusd_epi32(__m512i(hi[m][j]), w[j], h));
        lo[m][j] = sums_vec(_mm512_dpbusd_epi32(__m512i(lo[m][j]), w[j], l));
      }
    }
  }
  for (int j = 0; j < NB; ++j) {
    const __m512 sc = _mm512_loadu_ps(scales + (p + j) * L);
    for (int m = 0; m < M; ++m) {
      const __m512i high = _mm512_sub_epi32(__m512i(hi[m][j]), _mm512_set1_epi32(off[2 * m]));
      const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(high, 7),
                                           _mm512_sub_epi32(__m512i(lo[m][j]), _mm512_set1_epi32(off[2 * m + 1])));
      _mm512_storeu_ps(s + m * Np + (p + j) * L,
                       _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sum), sc), _mm512_set1_ps(sx[m])));
    }
  }
}

template <int M, int Hint>
void signed_rows(const int32_t* hw, const int32_t* lw, const int32_t* off, const int8_t* panels, const float* scales,
                 const float* sx, float* s, int64_t Kt, int64_t Np, int64_t p, int64_t p_end) {
  // 2 M NB sums, NB panels, the flip and two broadcasts in 32 registers; a streamed head's rows past two in one panel
  // at a time (more streams at once ran slower from memory), a cached head's (a draft's) in two to four
  constexpr int NB = M == 1 ? 6 : M == 2 ? 4 : Hint != KEEP ? 1 : M == 3 ? 4 : M == 4 ? 3 : M <= 6 ? 2 : 1;
  for (; p + NB <= p_end; p += NB) signed_block<M, NB, Hint>(hw, lw, off, panels, scales, sx, s, Kt, Np, p);
  for (; p < p_end; ++p) signed_block<M, 1, Hint>(hw, lw, off, panels, scales, sx, s, Kt, Np, p);
}

using SignedFn = void (*)(const int32_t*, const int32_t*, const int32_t*, const int8_t*, const float*, const float*,
                          float*, int64_t, int64_t, int64_t, int64_t);
template <int Hint>
constexpr SignedFn signed_by_rows[9] = {
    nullptr, signed_rows<1, Hint>, signed_rows<2, Hint>, signed_rows<3, Hint>, signed_rows<4, Hint>,
    signed_rows<5, Hint>, signed_rows<6, Hint>, signed_rows<7, Hint>, signed_rows<8, Hint>};

// The rows' integer activations p [M, Kt] (within int16) through the panels [P, Kt / 4, L, 4], eight rows a pass
// over each block of panels (about 512 KB, kept in cache between passes; the weights of a one-pass ``stream``
// prefetched with the streamed hint), the threads splitting the panels.
void signed_screen_sums(const int32_t* pv, const int8_t* panels, const float* scales, const float* sx, float* s,
                        int64_t M, int64_t Kt, int64_t P, bool stream) {
  const int64_t G = Kt / 4, Np = P * L;
  std::vector<int32_t> hw(M * G), lw(M * G), off(2 * M);
  for (int64_t m = 0; m < M; ++m) {
    int32_t sum_h = 0, sum_l = 0;
    for (int64_t g = 0; g < G; ++g) {
      uint32_t h = 0, l = 0;
      for (int b = 0; b < 4; ++b) {
        const int32_t v = pv[m * Kt + 4 * g + b];
        sum_h += v >> 7;
        sum_l += v & 127;
        h |= uint32_t(uint8_t(int8_t(v >> 7))) << (8 * b);
        l |= uint32_t(uint8_t(v & 127)) << (8 * b);
      }
      hw[m * G + g] = int32_t(h);
      lw[m * G + g] = int32_t(l);
    }
    off[2 * m] = 128 * sum_h;
    off[2 * m + 1] = 128 * sum_l;
  }
  const SignedFn* by_rows = !(stream && M <= 8) ? signed_by_rows<KEEP>
                            : streamed_hint == TO_L2 ? signed_by_rows<TO_L2> : signed_by_rows<PAST>;
  const int64_t per_block = std::max<int64_t>(12, (512 * 1024) / (Kt * L) / 12 * 12);
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t b = p0; b < p1; b += per_block) {
      const int64_t b_end = std::min(b + per_block, p1);
      for (int64_t m = 0; m < M; m += 8) {
        const int64_t r = std::min<int64_t>(8, M - m);
        by_rows[r](hw.data() + m * G, lw.data() + m * G, off.data() + 2 * m, panels, scales, sx + m, s + m * Np, Kt,
                   Np, b, b_end);
      }
    }
  });
}
#endif

#if TILE_SCREEN || VNNI_SCREEN
// The integer screen: each row's activations rounded to integers p_k = round(x_k / sx) of at most ``top`` in magnitude
// (sx = max_k |x_k| / top; top keeps every sum of Kt products with int8 weights within int32), the exact integer sums
// (AMX: tile_screen_sums, or vnni_screen_sums for a few rows, over p's signed high and unsigned low bytes; VNNI alone:
// signed_screen_sums) and s_c of them. Against the fp32 screen B_c gains l1_c * t, l1_c = sum_k |scale_c q_ck|
// (Python, rounded up): t covers the activations' rounding (the largest |x_k - sx p_k|, 1% spared) and the three fp32
// roundings of s_c (2^-21 max_k |x_k|).
void integer_screen(const float* x, const int8_t* panels, const float* scales, float* s, float* t, int64_t M,
                    int64_t K, int64_t Kt, int64_t P, bool stream) {
  const float top = float(std::min<int64_t>(16383, ((int64_t(1) << 31) - 1) / (127 * Kt)));
  std::vector<int32_t> pv(M * Kt, 0);  // each row's p, K padded with zeros to Kt
  std::vector<float> sx(M);
  for (int64_t m = 0; m < M; ++m) {
    const float* r = x + m * K;
    float big = 0.0f;
    for (int64_t k = 0; k < K; ++k) big = std::max(big, std::fabs(r[k]));  // NaN rows: screened_argmax's cut
    sx[m] = std::isfinite(big) && big > 0.0f ? big / top : (big == 0.0f ? 1.0f : NAN);
    double err = 0.0;
    if (sx[m] == sx[m])
      for (int64_t k = 0; k < K; ++k) {
        const float v = std::min(top, std::max(-top, std::nearbyint(r[k] / sx[m])));
        pv[m * Kt + k] = int32_t(v);
        err = std::max(err, std::fabs(double(r[k]) - double(sx[m]) * double(v)));
      }
    t[m] = std::nextafter(float(1.01 * err + std::ldexp(double(big), -21)), INFINITY);
  }
#if TILE_SCREEN
  std::vector<int8_t> ph(M * Kt);  // p = 256 (p >> 8) + (p & 255), the high byte signed, the low unsigned
  std::vector<uint8_t> pl(M * Kt);
  for (int64_t i = 0; i < M * Kt; ++i) {
    ph[i] = int8_t(pv[i] >> 8);
    pl[i] = uint8_t(pv[i] & 255);
  }
  if (M <= kVnniRows) {
    std::vector<uint8_t> hu(M * Kt);
    for (int64_t i = 0; i < M * Kt; ++i) hu[i] = uint8_t(ph[i] + 128);
    vnni_screen_sums(hu.data(), pl.data(), panels, scales, sx.data(), s, M, Kt, P);
  } else {
    tile_screen_sums(ph.data(), pl.data(), panels, scales, sx.data(), s, M, Kt, P);
  }
#else
  signed_screen_sums(pv.data(), panels, scales, sx.data(), s, M, Kt, P, stream);
#endif
}
#endif

// The argmaxes of ``input`` [..., K]'s rows: [...] int64, on its device (the CPU op's output, and its meta)
at::Tensor greedy_head_meta(const at::Tensor& input, const at::Tensor& screen, const at::Tensor& scales,
                            const at::Tensor& bound, const at::Tensor& l1, const at::Tensor& weight) {
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.pop_back();
  return at::empty(sizes, input.options().dtype(at::kLong));
}

// Whether W's int8 panels ([P, K, L], or the tile screen's [P, Kt / 4, L, 4], contiguous) and their columns' scales
// (pack_int8) serve rows of K.
bool screen_serves(const at::Tensor& screen, const at::Tensor& scales, int64_t K) {
  const int64_t P = screen.dim() >= 1 ? screen.size(0) : 0;
  const bool tiles = screen.dim() == 4;
  return screen.scalar_type() == at::kChar && screen.is_contiguous() &&
         (tiles ? (TILE_SCREEN || VNNI_SCREEN) && screen.size(1) * 4 == (K + 63) / 64 * 64 && screen.size(3) == 4
                : screen.dim() == 3 && screen.size(1) == K) && screen.size(2) == L && scales.dim() == 1 &&
         scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.size(0) == P * L;
}

// The screened logits s [M, P * L] of raw rows x [M, K] through panels and scales that serve them (screen_serves):
// the tile screen's (integer_screen, each row's t [M] set) or the fp32 screen's (t 0). ``stream``: the screen is a
// target's head, read once a step (run's ``stream``).
void screen_rows(const float* x, int64_t M, int64_t K, const at::Tensor& screen, const at::Tensor& scales, float* s,
                 float* t, bool stream) {
  const int64_t P = screen.size(0);
  std::fill(t, t + M, 0.0f);
  if (screen.dim() == 4) {
#if TILE_SCREEN
    TORCH_CHECK(tiles_permitted(), "stream_gemm: the operating system refuses AMX's tiles");
#endif
#if TILE_SCREEN || VNNI_SCREEN
    integer_screen(x, screen.data_ptr<int8_t>(), scales.data_ptr<float>(), s, t, M, K, screen.size(1) * 4, P, stream);
#endif
  } else {
    // each word's screened logit: its sums times its scale, rounded once
    run(x, screen.data_ptr<int8_t>(), s, M, K, P, scales.data_ptr<float>(), stream);
  }
}

// screen_rows of x [M, K] (contiguous) into a tensor; ``op`` names the caller in its errors.
at::Tensor screened_logits(const at::Tensor& x, const at::Tensor& screen, const at::Tensor& scales,
                           std::vector<float>& t, const char* op, bool stream) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(screen_serves(screen, scales, K), op, ": shapes do not match");
  at::Tensor s = at::empty({M, screen.size(0) * L}, x.options());
  t.resize(M);
  screen_rows(x.data_ptr<float>(), M, K, screen, scales, s.data_ptr<float>(), t.data(), stream);
  return s;
}

// x [..., K] fp32, screen and scales (screened_logits), bound and l1 [V], weight [V, K] fp32 -> each row's word [...],
// ``pick(m, x_m, s_m, bound, l1, t_m, weight, V, K)`` on the threads: what greedy_head and sampled_head share.
template <typename Pick>
at::Tensor screened_head(const char* op, const at::Tensor& input, const at::Tensor& screen, const at::Tensor& scales,
                         const at::Tensor& bound, const at::Tensor& l1, const at::Tensor& weight, const Pick& pick) {
  const int64_t K = input.dim() >= 1 ? input.size(-1) : 0;
  TORCH_CHECK(input.dim() >= 1 && input.scalar_type() == at::kFloat && screen.dim() >= 3 && weight.dim() == 2 &&
              weight.scalar_type() == at::kFloat && weight.size(1) == K && bound.dim() == 1 &&
              bound.scalar_type() == at::kFloat && bound.size(0) == weight.size(0) && l1.sizes() == bound.sizes() &&
              l1.scalar_type() == at::kFloat && weight.size(0) <= screen.size(0) * L,
              op, ": shapes do not match");
  const at::Tensor x = input.reshape({-1, K}).contiguous(), w = weight.contiguous();
  const at::Tensor b = bound.contiguous(), l = l1.contiguous();
  const int64_t M = x.size(0), P = screen.size(0), V = w.size(0);
  std::vector<float> t;  // B_c = bound_c * norm, and l1_c * t on the tiles
  const at::Tensor s = screened_logits(x, screen, scales, t, op, true);
  at::Tensor out = greedy_head_meta(input, screen, scales, bound, l1, weight);
  int64_t* o = out.data_ptr<int64_t>();
  const float *xp = x.data_ptr<float>(), *sp = s.data_ptr<float>(), *bp = b.data_ptr<float>();
  const float *lp = l.data_ptr<float>(), *wp = w.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) o[m] = pick(m, xp + m * K, sp + m * P * L, bp, lp, t[m], wp, V, K);
  });
  return out;
}

// The argmax of each row [...] (screened_argmax).
at::Tensor greedy_head(const at::Tensor& input, const at::Tensor& screen, const at::Tensor& scales,
                       const at::Tensor& bound, const at::Tensor& l1, const at::Tensor& weight) {
  return screened_head("stream_gemm.greedy_head", input, screen, scales, bound, l1, weight,
                       [](int64_t, const float* x, const float* s, const float* b, const float* l, float t,
                          const float* w, int64_t V, int64_t K) { return screened_argmax(x, s, b, l, t, w, V, K); });
}

// Sampling's draw of each row's next token through the same screen (DESIGN section 9): the word argmax_c (l_c + T g_c),
// l_c the exact logit as screened_argmax computes it, T the temperature and g_c Gumbel noise, is a draw from
// softmax(l / T) (the Gumbel-max identity). g_c = -log(-log u_c), u_c of 53 bits (never 0 or 1) from SplitMix64 of the
// row's key and the word's index, in double precision; only the words whose screened bound l_c <= s_c + B_c, plus
// T g_c, reaches the largest s_j - B_j + T g_j read their fp32 weights (screened_draw).
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr int DL = L / 2;  // doubles a vector register
typedef double dvec __attribute__((vector_size(DL * sizeof(double))));
typedef uint64_t uvec __attribute__((vector_size(DL * sizeof(uint64_t))));
typedef int64_t ivec __attribute__((vector_size(DL * sizeof(int64_t))));
#if defined(__AVX512F__)
extern "C" __m512d Sleef_logd8_u10(__m512d);
inline dvec vlog(dvec x) { return Sleef_logd8_u10(x); }
#elif defined(__AVX2__)
extern "C" __m256d Sleef_logd4_u10(__m256d);
inline dvec vlog(dvec x) { return Sleef_logd4_u10(x); }
#else
inline dvec vlog(dvec x) {
  for (int i = 0; i < DL; ++i) x[i] = std::log(x[i]);
  return x;
}
#endif
template <typename U>
inline U splitmix(U z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The 53 bits of words w .. w + DL - 1 of a row whose stream is ``base`` (splitmix of its key), and their noise T g_c.
inline uvec bits_at(uint64_t base, int64_t w) {
  uvec c;
  for (int i = 0; i < DL; ++i) c[i] = uint64_t(w + i + 1);
  return splitmix(base + c * kGolden) >> 11;
}
inline dvec noise_at(uint64_t base, int64_t w, double T) {
  const dvec u = (__builtin_convertvector(__builtin_convertvector(bits_at(base, w), ivec), dvec) + 0.5) * 0x1p-53;
  return -vlog(-vlog(u)) * T;
}

// The row's noise for words 0 <= c < V (padded to whole vectors; g: room for them) from its key.
void gumbel_row(uint64_t key, double T, int64_t V, double* g) {
  const uint64_t base = splitmix(key);
  for (int64_t w = 0; w < V; w += DL) {
    const dvec noise = noise_at(base, w, T);
    __builtin_memcpy(g + w, &noise, sizeof(dvec));
  }
}

// The row's key from its draw (a uniform of [0, 1) in float64: its 53 bits).
inline uint64_t draw_key(double u) { return uint64_t(u * 0x1p53); }

// argmax_c (l_c + T g_c) for a row x [K] with its screened logits s and the screen's bounds (as screened_argmax), the
// noise of the row's ``key``: l_c lies within s_c -+ r_c, so a word is a candidate only where s_c + r_c + T g_c (with a
// relative slack far above the double roundings) reaches the largest s_j - r_j + T g_j; then each candidate's exact
// logit plus its noise decides, the first of equal maxima (a NaN logit returned as torch's argmax would; every word a
// candidate where the screen is not finite). The noise is computed only where it could matter: the cut is at least
// ``cut0``, the best s_j - r_j + T g_j of the DL words around the best s_j - r_j; a vector of words whose best
// s_c + r_c lies theta T below cut0 holds a candidate only if some noise there passes theta, which the words' bits
// alone tell (u_c >= exp(-exp(-theta)), for a ladder of theta: about e^-theta of the words), so the logs run for a few
// vectors of words a row, whatever its distribution.
constexpr int kLadder = 6;
constexpr double kTheta[kLadder] = {1.5, 2.5, 4.0, 6.0, 9.0, 14.0};

int64_t screened_draw(const float* x, const float* s, const float* bound, const float* l1, float t,
                      const float* weight, uint64_t key, double T, int64_t V, int64_t K, double* noise,
                      std::vector<int64_t>& near) {
  static const auto rare = [] {  // the bits from which a word's noise may reach each theta (0.01 below it)
    std::array<uint64_t, kLadder> r{};
    for (int i = 0; i < kLadder; ++i) r[i] = uint64_t(std::exp(-std::exp(-(kTheta[i] - 0.01))) * 0x1p53);
    return r;
  }();
  float norm = 0.0f;
  for (int64_t k = 0; k < K; ++k) norm += std::fabs(x[k]);
  auto reach = [&](int64_t c) { return double(std::fma(bound[c], norm, l1[c] * t)) + 1e-30; };
  const vec n = vec{} + norm, tt = vec{} + t;
  int64_t first = 0;  // a word of the largest s_c - r_c (any word gives a sound first bound; that one a tight one)
  const bool finite = std::isfinite(norm) && !std::isnan(screen_cut(s, bound, l1, norm, t, V, &first));
  const uint64_t base = splitmix(key);
  near.clear();
  double cut = -INFINITY;
  if (!finite) {
    gumbel_row(key, T, V, noise);
    for (int64_t c = 0; c < V; ++c) near.push_back(c);
  } else {
    const int64_t w0 = first / DL * DL;
    const dvec n0 = noise_at(base, w0, T);
    double cut0 = -INFINITY;  // the cut's first lower bound
    for (int64_t c = w0; c < std::min(V, w0 + DL); ++c) cut0 = std::max(cut0, double(s[c]) - reach(c) + n0[c - w0]);
    const double slack0 = 1e-12 * (1.0 + std::fabs(cut0)), margin = 1e-3 * (1.0 + std::fabs(cut0));
    vec hi{};
    for (int64_t w = 0; w < V; w += DL) {
      const int64_t end = std::min(V, w + DL);
      if (w % L == 0 && w + L <= V) hi = load(s + w) + load(bound + w) * n + load(l1 + w) * tt;
      float high = -INFINITY;  // the vector's best s_c + r_c, in float (the margin covers its roundings)
      if (w / L * L + L <= V)
        for (int i = 0; i < DL; ++i) high = std::max(high, hi[w % L + i]);
      else
        for (int64_t c = w; c < end; ++c) high = std::max(high, s[c] + bound[c] * norm + l1[c] * t);
      const double gap = cut0 - double(high) - margin;  // T times the noise a word here needs to reach cut0
      int rung = -1;  // the highest rung of the ladder under that noise (branch-free: the rungs rise)
      for (int i = 0; i < kLadder; ++i) rung += T * kTheta[i] <= gap;
      if (rung >= 0 && end - w == DL) {  // the bits alone: none reaches kTheta[rung], so none reaches cut0
        const uvec reached = bits_at(base, w) >= rare[rung];
        uint64_t any = 0;
        for (int i = 0; i < DL; ++i) any |= reached[i];
        if (!any) continue;
      }
      const dvec noise_v = noise_at(base, w, T);
      __builtin_memcpy(noise + w, &noise_v, sizeof(dvec));
      for (int64_t c = w; c < end; ++c) {  // the lanes from the register (a load of what was just stored stalls)
        const double r = reach(c), z = noise_v[c - w];
        cut = std::max(cut, double(s[c]) - r + z);
        if (double(s[c]) + r + z + slack0 >= cut0) near.push_back(c);
      }
    }
  }
  const double slack = 1e-12 * (1.0 + std::fabs(cut));
  int64_t best = -1;
  double top = 0.0;
  for (const int64_t c : near) {
    if (finite && double(s[c]) + reach(c) + noise[c] + slack < cut) continue;
    const float v = exact(x, weight + c * K, K);
    if (v != v) return c;
    const double z = double(v) + noise[c];
    if (best < 0 || z > top) {
      best = c;
      top = z;
    }
  }
  return best;
}

// x [..., K] fp32, the head's screen (greedy_head), draws [...] float64 in [0, 1), the temperature T > 0 -> each
// row's draw from softmax(W x / T) [...] (screened_draw).
at::Tensor sampled_head(const at::Tensor& input, const at::Tensor& screen, const at::Tensor& scales,
                        const at::Tensor& bound, const at::Tensor& l1, const at::Tensor& weight,
                        const at::Tensor& draws, double temperature) {
  TORCH_CHECK(input.dim() >= 1 && draws.scalar_type() == at::kDouble &&
              draws.numel() * input.size(-1) == input.numel() && temperature > 0,
              "stream_gemm.sampled_head: shapes do not match");
  const at::Tensor u = draws.contiguous();
  const double* up = u.data_ptr<double>();
  return screened_head("stream_gemm.sampled_head", input, screen, scales, bound, l1, weight,
                       [&](int64_t m, const float* x, const float* s, const float* b, const float* l, float t,
                           const float* w, int64_t V, int64_t K) {
    thread_local std::vector<double> noise;  // kept: its pages are not faulted in again each step
    thread_local std::vector<int64_t> near;
    if (int64_t(noise.size()) < V + DL) noise.resize(V + DL);  // room for whole vectors
    return screened_draw(x, s, b, l, t, w, draw_key(up[m]), temperature, V, K, noise.data(), near);
  });
}

// draws [M] float64, V -> [M, V] float64: each row's noise T g_c as sampled_head adds it (T = temperature).
at::Tensor gumbel_noise(const at::Tensor& draws, int64_t V, double temperature) {
  TORCH_CHECK(draws.dim() == 1 && draws.scalar_type() == at::kDouble && V > 0, "stream_gemm.gumbel_noise: bad draws");
  const int64_t M = draws.size(0), Vp = (V + DL - 1) / DL * DL;
  const at::Tensor u = draws.contiguous();
  at::Tensor out = at::empty({M, Vp}, draws.options());
  for (int64_t m = 0; m < M; ++m)
    gumbel_row(draw_key(u.data_ptr<double>()[m]), temperature, V, out.data_ptr<double>() + m * Vp);
  return out.narrow(1, 0, V).contiguous();
}

// x [..., K] fp32 -> [..., n]: the screened logits (screened_logits), x W^T to within the weights' (and, on the
// tiles, the activations') rounding, for a draft's head, whose precision is ours to choose (verification stays exact).
at::Tensor int8_linear(const at::Tensor& input, const at::Tensor& screen, const at::Tensor& scales, int64_t n) {
  TORCH_CHECK(input.dim() >= 1 && input.scalar_type() == at::kFloat && scales.dim() == 1 && n <= scales.size(0),
              "stream_gemm.int8_linear: shapes do not match");
  std::vector<float> t;
  const at::Tensor s = screened_logits(input.reshape({-1, input.size(-1)}).contiguous(), screen, scales, t,
                                       "stream_gemm.int8_linear", false);
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = n;
  return (n == s.size(1) ? s : s.narrow(1, 0, n).contiguous()).view(sizes);
}

at::Tensor int8_linear_meta(const at::Tensor& input, const at::Tensor& screen, const at::Tensor& scales, int64_t n) {
  std::vector<int64_t> sizes = input.sizes().vec();
  sizes.back() = n;
  return at::empty(sizes, input.options());
}

// The streamed hint (streamed_hint) set to ``hint`` where it is PAST or TO_L2 (-1: left as it is); the hint in force.
int64_t stream_prefetch(int64_t hint) {
  TORCH_CHECK(hint == -1 || hint == PAST || hint == TO_L2,
              "stream_gemm.stream_prefetch: the hint is 0 (prefetchnta) or 2 (prefetcht1), or -1 to read it; got ", hint);
  if (hint != -1) streamed_hint = int(hint);
  return streamed_hint;
}

// Whether the heads' int8 copies take the integer screen's layout here (pack_int8's ``tiles``): built with AMX's tiles
// and granted them by the operating system, or built with AVX-512 VNNI (signed_screen_sums).
bool tile_screen() {
#if TILE_SCREEN
  return tiles_permitted();
#elif VNNI_SCREEN
  return true;
#else
  return false;
#endif
}

// silu(g) * u in place of g, count floats (a multiple of L), as torch computes silu_ and then a multiply on this CPU:
// x / (1 + exp(-x)) a vector at a time with SLEEF's exp, the one libtorch_cpu exports and its vectorized silu calls
// (16 or 8 floats a call as torch's vectors), then the product rounded once. torch's loop takes the last floats short
// of two vectors one at a time through the C library's exp: silu_product serves only counts of whole pairs (SILU_RUN).
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
extern "C" __m512 Sleef_expf16_u10(__m512);
inline vec sleef_exp(vec x) { return Sleef_expf16_u10(x); }
#else
extern "C" __m256 Sleef_expf8_u10(__m256);
inline vec sleef_exp(vec x) { return Sleef_expf8_u10(x); }
#endif
constexpr int64_t SILU_RUN = 2 * L;
inline void silu_product(float* g, const float* u, int64_t count) {
  for (int64_t i = 0; i < count; i += L) {
    const vec x = load(g + i);
    store(g + i, x / (1.0f + sleef_exp(-x)) * load(u + i));
  }
}
#else
constexpr int64_t SILU_RUN = 0;  // no vector silu here: torch's silu_ serves
inline void silu_product(float*, const float*, int64_t) {}
#endif

// Whether silu_product computes torch's silu_ bit for bit here: checked once against it over 65,536 bit patterns
// spread over every exponent and sign, so that a torch whose CPU kernel runs another exp (another build, or
// ATEN_CPU_CAPABILITY choosing other vectors) sends the SwiGLUs back to torch's silu_.
bool silu_is_torchs() {
  static const bool same = [] {
    if (SILU_RUN == 0) return false;
    const int64_t count = 65536;
    at::Tensor bits = at::arange(count, at::TensorOptions().dtype(at::kLong)).mul_(65537).to(at::kInt);
    at::Tensor x = bits.view(at::kFloat);
    x = at::where(at::isfinite(x), x, at::zeros_like(x)).contiguous();
    at::Tensor ours = x.clone(), ones = at::ones_like(x);
    silu_product(ours.data_ptr<float>(), ones.data_ptr<float>(), count);
    const at::Tensor theirs = at::silu(x);
    return at::equal(ours.view(at::kInt), theirs.view(at::kInt));
  }();
  return same;
}

// A SwiGLU's gate and up of the same rows x [M, K] in one parallel region, each thread taking the same panels of both
// and then silu(g) * u on those columns of every row into g (silu_product), so the activation splits over the threads
// inside the linears' region instead of running on one thread after it. Bit for bit run_jobs' g and u, then torch's
// silu_ and multiply.
template <typename W>
void gated_jobs(const float* x, int64_t M, int64_t K, const Job<W>& gate, const Job<W>& up) {
  const int64_t per_block = block_panels<W>(K, 2), Np = gate.P * L;
  at::parallel_for(0, gate.P, 4, [&](int64_t p0, int64_t p1) {
    for (int64_t b = p0; b < p1; b += per_block) {
      const int64_t b_end = std::min(b + per_block, p1);
      pass(x, M, K, gate, b, b_end);
      pass(x, M, K, up, b, b_end);
      for (int64_t m = 0; m < M; ++m) silu_product(gate.y + m * Np + b * L, up.y + m * Np + b * L, (b_end - b) * L);
    }
  });
}

// A SwiGLU MLP on raw rows: y [n, H] = down(silu(gate(x)) * up(x)) for x [n, H] through each projection's panels.
// g and u: buffers of padded_floats each (linear_rows writes the padded columns past the n I floats the rows hold).
// Where I is a multiple of torch's vectorized run and silu_product is torch's, the activation runs inside the gate's
// and up's region (gated_jobs); else torch's silu on g's rows in place and the product (one rounding, as torch's
// multiply) in a loop. Either way the Python loop's bits.
void swiglu_rows(const float* x, const at::Tensor& gate_panels, const at::Tensor& up_panels,
                 const at::Tensor& down_panels, int64_t n, int64_t H, int64_t I, float* g, float* u, float* y) {
  const at::ScalarType kind = gate_panels.scalar_type();
  if (SILU_RUN > 0 && I % SILU_RUN == 0 && up_panels.scalar_type() == kind && panels_of(gate_panels, I) * L == I &&
      panels_of(up_panels, I) * L == I && silu_is_torchs()) {
    by_kind(kind, [&](auto tag) {
      using W = decltype(tag);
      gated_jobs(x, n, H, job_of<W>(gate_panels, I, H, g), job_of<W>(up_panels, I, H, u));
    });
  } else {
    linears_rows(x, n, H, {&gate_panels, &up_panels}, {I, I}, {g, u});
    at::Tensor rows = at::from_blob(g, {n * I}, at::TensorOptions().dtype(at::kFloat));
    at::silu_(rows);
    for (int64_t i = 0; i < n * I; ++i) g[i] *= u[i];
  }
  linear_rows(g, down_panels, n, I, H, y);
}

// The decoder layers of the lean forward (models/fast_paths.py's lean_forward) for a decoding step, in one call: each
// layer's norms, projections, RoPE, cache write, attention, residual adds and SwiGLU MLP by the same kernels (their
// raw-row forms) and torch's silu and multiply, in the same order, as the Python loop, so the hidden states equal its
// bit for bit; what goes is the interpreter's work between them and, the rows living in one scratch buffer, the
// tensors each kernel's wrapper would make (some seventy dispatched operators a layer, views and allocations most of
// them: DESIGN section 9). hidden [1, n, H]; weights, 9 a layer (the input norm's weight, the q, k, v and
// o projections' stream panels, the post-attention norm's weight, the gate, up and down projections' panels), or 12
// with the q, k and v projections' biases after them; outs: the 7 projections' output sizes; stack: the runner's
// cache [layers, 2, 1, n_kv, capacity, D], each layer writing its slot at start..start+n; cos and sin [1, 1, n, D];
// mask additive [1, 1, n, start + n] or none (one row); attention by the kernel up to attend_rows_max rows where it
// serves, else SDPA, as _sdpa_gqa chooses.
at::Tensor decoder_layers(const at::Tensor& hidden, at::TensorList weights, at::IntArrayRef outs,
                          const at::Tensor& stack, int64_t start, const at::Tensor& cos, const at::Tensor& sin,
                          const c10::optional<at::Tensor>& mask, int64_t D, double eps, double scale,
                          int64_t attend_rows_max) {
  const int64_t n = hidden.dim() == 3 ? hidden.size(1) : 0, layers = stack.dim() == 6 ? stack.size(0) : 0;
  const int64_t per = layers > 0 ? int64_t(weights.size()) / layers : 0, H = hidden.dim() == 3 ? hidden.size(2) : 0;
  TORCH_CHECK(hidden.dim() == 3 && hidden.size(0) == 1 && hidden.scalar_type() == at::kFloat && layers > 0 &&
              (per == 9 || per == 12) && int64_t(weights.size()) == per * layers && outs.size() == 7 && D > 0 &&
              D % 2 == 0 && stack.size(1) == 2 && stack.size(2) == 1 && stack.size(5) == D &&
              stack.scalar_type() == at::kFloat && stack.is_contiguous() && outs[0] % D == 0 && outs[1] % D == 0 &&
              outs[1] == outs[2] && outs[1] / D == stack.size(3) && (outs[0] / D) % stack.size(3) == 0 &&
              outs[3] == H && outs[4] == outs[5] && outs[6] == H && 0 <= start && start + n <= stack.size(4) &&
              cos.sizes() == sin.sizes() && cos.numel() == n * D && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && (n == 1 || (mask.has_value() && mask->defined())),
              "stream_gemm.decoder_layers: shapes do not match");
  const int64_t Q = outs[0], KV = outs[1], I = outs[4], Hq = Q / D, Hk = KV / D, S = start + n;
  const int64_t cap = stack.size(4);
  int64_t most[7] = {};  // the floats each projection's output needs, the most of any layer (padded_floats)
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + per * l;
    const int64_t ins[7] = {H, H, H, Q, H, H, I};
    bool ok = w[0].numel() == H && w[5].numel() == H && w[0].scalar_type() == at::kFloat &&
              w[5].scalar_type() == at::kFloat && w[0].is_contiguous() && w[5].is_contiguous();
    for (int i = 0; i < 7; ++i) {
      const at::Tensor& panels = w[i < 4 ? 1 + i : 2 + i];
      ok = ok && linear_serves(panels, ins[i], outs[i]);
      if (ok) most[i] = std::max(most[i], padded_floats(panels, outs[i], n));
    }
    for (int i = 0; per == 12 && i < 3; ++i)
      ok = ok && w[9 + i].numel() == outs[i] && w[9 + i].scalar_type() == at::kFloat && w[9 + i].is_contiguous();
    TORCH_CHECK(ok, "stream_gemm.decoder_layers: layer ", l, "'s weights do not match");
  }
  // Every layer's work on raw rows in one scratch buffer, no tensor made a layer: the norms' output x [n, H], the
  // projections' outputs (each with room for its panels' padded columns), the rotated queries [n, Hq, D] and keys
  // [n, Hk, D], attention's output [n, Hq, D], the o and down projections' outputs y before the residual adds, the
  // gate and up projections' outputs.
  const int64_t sizes[10] = {n * H, most[0], most[1], most[2], n * Q, n * KV, n * Q, std::max(most[3], most[6]),
                             most[4], most[5]};
  int64_t total = 0;
  for (const int64_t size : sizes) total += size;
  const at::Tensor scratch = at::empty({total}, hidden.options());
  float* const base = scratch.data_ptr<float>();
  float *x = base, *q = x + sizes[0], *k = q + sizes[1], *v = k + sizes[2], *qr = v + sizes[3], *kr = qr + sizes[4];
  float *att = kr + sizes[5], *y = att + sizes[6], *gate_rows = y + sizes[7], *up_rows = gate_rows + sizes[8];
  at::Tensor h = hidden.clone(at::MemoryFormat::Contiguous);  // [1, n, H]: the residual stream, added to in place
  float* hp = h.data_ptr<float>();
  const at::Tensor c = cos.contiguous(), si = sin.contiguous();
  const bool kernel = n <= attend_rows_max && queries_fn(D) != nullptr;
  const at::Tensor padded = kernel ? padded_mask(mask, n, S) : at::Tensor();
  auto add_rows = [](float* to, const float* from, int64_t count) {
    for (int64_t i = 0; i < count; ++i) to[i] += from[i];
  };
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + per * l;
    norm_rows(hp, w[0].data_ptr<float>(), x, n, H, eps);
    linears_rows(x, n, H, {&w[1], &w[2], &w[3]}, {Q, KV, KV}, {q, k, v});
    if (per == 12)
      for (int64_t r = 0; r < n; ++r) {
        add_rows(q + r * Q, w[9].data_ptr<float>(), Q);
        add_rows(k + r * KV, w[10].data_ptr<float>(), KV);
        add_rows(v + r * KV, w[11].data_ptr<float>(), KV);
      }
    rotate_rows(q, D, Q, Hq, n, D, c.data_ptr<float>(), si.data_ptr<float>(), qr);
    rotate_rows(k, D, KV, Hk, n, D, c.data_ptr<float>(), si.data_ptr<float>(), kr);
    float* keys = stack.data_ptr<float>() + l * 2 * Hk * cap * D;  // [Hk, cap, D], the values after them
    float* values = keys + Hk * cap * D;
    write_rows(kr, D, KV, keys, cap * D, D, Hk, n, D, start, nullptr);
    write_rows(v, D, KV, values, cap * D, D, Hk, n, D, start, nullptr);
    if (kernel) {
      attend_rows(qr, D, Q, keys, cap * D, D, values, cap * D, D, padded.defined() ? padded.data_ptr<float>() : nullptr,
                  Hq, Hk, n, S, D, scale, att);
    } else {  // SDPA over the slot's views, as _sdpa_gqa calls it
      const at::Tensor slot = stack.select(0, l).select(1, 0);  // [2, Hk, cap, D]
      const at::Tensor turned = scratch.narrow(0, qr - base, n * Q).view({1, n, Hq, D}).transpose(1, 2);
      const at::Tensor out = at::scaled_dot_product_attention(
          turned, slot.select(0, 0).narrow(1, 0, S).unsqueeze(0), slot.select(0, 1).narrow(1, 0, S).unsqueeze(0), mask,
          0.0, false, scale, Hq != Hk).transpose(1, 2).contiguous();
      std::memcpy(att, out.data_ptr<float>(), n * Q * sizeof(float));
    }
    linear_rows(att, w[4], n, Q, H, y);
    add_rows(hp, y, n * H);
    norm_rows(hp, w[5].data_ptr<float>(), x, n, H, eps);
    swiglu_rows(x, w[6], w[7], w[8], n, H, I, gate_rows, up_rows, y);
    add_rows(hp, y, n * H);
  }
  return h;
}


// A draft's decoding step (models/draft.py's DraftModel._step) in two calls, the cache written between them in Python
// (whatever the cache): the same kernels (their raw-row forms, shared with draft_step) and torch operators, in the
// same order, as the Python step, whose interpreter and dispatch took most of a step of a few rows (DESIGN section
// 12); the attention by the kernel above.

// Whether draft_qkv's weights serve rows of K inputs: every projection's panels, fc's fp32 bias, whole heads.
bool qkv_serves(int64_t K, const at::Tensor& fc, const at::Tensor& fc_bias, const at::Tensor& q_panels,
                const at::Tensor& k_panels, const at::Tensor& v_panels, at::IntArrayRef outs, int64_t D) {
  return outs.size() == 4 && D > 0 && D % 2 == 0 && outs[1] % D == 0 && outs[2] % D == 0 && outs[2] == outs[3] &&
         linear_serves(fc, K, outs[0]) && linear_serves(q_panels, outs[0], outs[1]) &&
         linear_serves(k_panels, outs[0], outs[2]) && linear_serves(v_panels, outs[0], outs[3]) &&
         fc_bias.scalar_type() == at::kFloat && fc_bias.numel() == outs[0] && fc_bias.is_contiguous();
}

// draft_qkv's work on raw rows: x [n, K] -> z [n, H] (fc's output plus its bias), the queries and keys before RoPE
// (q, k) and rotated (qr [n, Hq, D], kr [n, Hk, D]), the values v [n, Hk D]; cos and sin [n, D]. z, q, k and v have
// room for their panels' padded columns (linear_rows).
void qkv_rows(const float* x, int64_t n, int64_t K, const at::Tensor& fc, const at::Tensor& fc_bias,
              const at::Tensor& q_panels, const at::Tensor& k_panels, const at::Tensor& v_panels, at::IntArrayRef outs,
              int64_t D, const float* cos, const float* sin, float* z, float* q, float* k, float* v, float* qr,
              float* kr) {
  const int64_t H = outs[0];
  linear_rows(x, fc, n, K, H, z);
  const float* bias = fc_bias.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < H; ++c) z[r * H + c] += bias[c];
  linears_rows(z, n, H, {&q_panels, &k_panels, &v_panels}, {outs[1], outs[2], outs[3]}, {q, k, v});
  rotate_rows(q, D, outs[1], outs[1] / D, n, D, cos, sin, qr);
  rotate_rows(k, D, outs[2], outs[2] / D, n, D, cos, sin, kr);
}

// draft_qkv: x [1, n, 2H] (the embedding and the features) -> z = fc(x) + bias [1, n, H], and the rotated queries
// and keys and the values [1, heads, n, D] as DraftAttention makes them; cos and sin [1, 1, n, D].
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_qkv(
    const at::Tensor& x_, const at::Tensor& fc, const at::Tensor& fc_bias, const at::Tensor& q_panels,
    const at::Tensor& k_panels, const at::Tensor& v_panels, at::IntArrayRef outs, int64_t D, const at::Tensor& cos_,
    const at::Tensor& sin_) {
  TORCH_CHECK(x_.dim() == 3 && x_.size(0) == 1 && x_.scalar_type() == at::kFloat &&
              qkv_serves(x_.size(2), fc, fc_bias, q_panels, k_panels, v_panels, outs, D) &&
              cos_.sizes() == sin_.sizes() && cos_.numel() == x_.size(1) * D && cos_.scalar_type() == at::kFloat &&
              sin_.scalar_type() == at::kFloat, "stream_gemm.draft_qkv: shapes do not match");
  const int64_t n = x_.size(1), K = x_.size(2), H = outs[0], Q = outs[1], KV = outs[2];
  const at::Tensor x = x_.contiguous(), cos = cos_.contiguous(), sin = sin_.contiguous();
  auto rows = [&](const at::Tensor& packed, int64_t width) {  // a [1, n, width] tensor with room for padded columns
    return at::empty({padded_floats(packed, width, n)}, x.options());
  };
  const at::Tensor z = rows(fc, H), v = rows(v_panels, KV), q_rows = rows(q_panels, Q), k_rows = rows(k_panels, KV);
  const at::Tensor qr = at::empty({1, n, Q / D, D}, x.options()), kr = at::empty({1, n, KV / D, D}, x.options());
  qkv_rows(x.data_ptr<float>(), n, K, fc, fc_bias, q_panels, k_panels, v_panels, outs, D, cos.data_ptr<float>(),
           sin.data_ptr<float>(), z.data_ptr<float>(), q_rows.data_ptr<float>(), k_rows.data_ptr<float>(),
           v.data_ptr<float>(), qr.data_ptr<float>(), kr.data_ptr<float>());
  return {z.narrow(0, 0, n * H).view({1, n, H}), qr.transpose(1, 2), kr.transpose(1, 2),
          v.narrow(0, 0, n * KV).view({1, n, KV / D, D}).transpose(1, 2)};  // [1, heads, n, D]
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_qkv_meta(
    const at::Tensor& x, const at::Tensor& fc, const at::Tensor& fc_bias, const at::Tensor& q_panels,
    const at::Tensor& k_panels, const at::Tensor& v_panels, at::IntArrayRef outs, int64_t D, const at::Tensor& cos,
    const at::Tensor& sin) {
  const int64_t n = x.size(1);
  auto turned = [&](int64_t width) {  // rotate's layout
    return at::empty({1, n, width / D, D}, x.options()).transpose(1, 2);
  };
  return {at::empty({1, n, outs[0]}, x.options()), turned(outs[1]), turned(outs[2]), turned(outs[3])};
}

// Buffers a thread's draft steps reuse from call to call, grown and never shrunk (a few hundred kilobytes): a step
// allocates nothing of its own.
float* reused(std::vector<float>& buffer, int64_t floats) {
  if (int64_t(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// torch's softmax of n rows of E values (row r at x + r * stride) into out [n, E]: the kernel MoEBlock's softmax runs,
// on the rows copied together first (as torch copies a strided input; its kernel takes contiguous rows).
void softmax_rows(const float* x, int64_t n, int64_t E, int64_t stride, float* out) {
  std::vector<float> rows(n * E);
  for (int64_t r = 0; r < n; ++r) std::memcpy(rows.data() + r * E, x + r * stride, E * sizeof(float));
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor o = at::from_blob(out, {n, E}, f32);
  at::_softmax_out(o, at::from_blob(rows.data(), {n, E}, f32), -1, false);
}

// The k largest of each of n rows of E values (row stride E), values and indices [n, k], in torch's topk's order: for
// at most two values in a loop (the larger first, the first of equal ones, as torch orders two), else by its topk.
void top_rows(const float* x, int64_t n, int64_t E, int64_t k, float* values, int64_t* indices) {
  if (E <= 2) {
    for (int64_t r = 0; r < n; ++r) {
      const float* v = x + r * E;
      const int64_t first = E == 2 && v[1] > v[0] ? 1 : 0;
      for (int64_t i = 0; i < k; ++i) {
        indices[r * k + i] = i == 0 ? first : 1 - first;
        values[r * k + i] = v[indices[r * k + i]];
      }
    }
    return;
  }
  const auto [top, order] = at::from_blob(const_cast<float*>(x), {n, E}, at::TensorOptions().dtype(at::kFloat))
                                .topk(k, -1);
  std::memcpy(values, top.contiguous().data_ptr<float>(), n * k * sizeof(float));
  std::memcpy(indices, order.contiguous().data_ptr<int64_t>(), n * k * sizeof(int64_t));
}

// MoEBlock._topk_weights on raw rows: each row's softmax over E logits (row r at logits + r * stride) into out [n, E],
// where k < E the k largest kept and renormalized by torch's operators.
void gate_weights(const float* logits, int64_t n, int64_t E, int64_t stride, int64_t k, float* out) {
  softmax_rows(logits, n, E, stride, out);
  if (k >= E) return;
  at::Tensor gates = at::from_blob(out, {n, E}, at::TensorOptions().dtype(at::kFloat));
  const auto [values, indices] = gates.topk(k, -1);
  const at::Tensor weights = at::zeros_like(gates).scatter(-1, indices, values);
  gates.copy_(weights / weights.sum(-1, true));
}

#if !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#endif
// out [n, H] = h + sum_e w_e m_e for w [n, E] and m [n, E, H]: each product and sum rounded once in e's order, as
// torch's h + (w.unsqueeze(-1) * m).sum(-2) rounds them.
void mixture_rows(const float* h, const float* w, const float* m, int64_t n, int64_t E, int64_t H, float* out) {
  NO_CONTRACTION
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < H; ++c) {
      float sum = w[r * E] * m[r * E * H + c];
      for (int64_t e = 1; e < E; ++e) sum += w[r * E + e] * m[(r * E + e) * H + c];
      out[r * H + c] = h[r * H + c] + sum;
    }
}

// Branch B's contrast, out [n, H] = h + t_0 m_{o_0} - t_1 m_{o_1} (t, o [n, 2]: the two leading experts' weights and
// indices; m [n, E, H]), left to right, as torch's h + top[0] * pick(0) - top[1] * pick(1).
void contrast_rows(const float* h, const float* t, const int64_t* o, const float* m, int64_t n, int64_t E, int64_t H,
                   float* out) {
  NO_CONTRACTION
  for (int64_t r = 0; r < n; ++r) {
    const float *lead = m + (r * E + o[2 * r]) * H, *next = m + (r * E + o[2 * r + 1]) * H;
    for (int64_t c = 0; c < H; ++c) {
      const float first = t[2 * r] * lead[c], second = t[2 * r + 1] * next[c];
      out[r * H + c] = (h[r * H + c] + first) - second;
    }
  }
}
#if !defined(__clang__)
#pragma GCC pop_options
#endif

// The MoE block's weights after the attention (draft_mix's, draft_step's): the output projection's panels, the
// post-attention norm, the router (undefined: one expert and no branch B), the experts (gate, up and down panels,
// three an expert), the widths of the output projection, the experts' gate, up and down projections and the router,
// the top k experts of branch A's mixture, and branch B (0 none, 1 a mixture, 2 the contrast).
struct MixWeights {
  const at::Tensor& o_panels;
  const at::Tensor& norm;
  double eps;
  const c10::optional<at::Tensor>& router;
  at::TensorList experts;
  at::IntArrayRef outs;
  int64_t top_k, branch;
};

// Whether draft_mix's weights serve z [.., H] and attention rows of Q: the panels of the output projection, the
// experts (SwiGLU, three an expert) and the router, an fp32 norm weight, a router where there are experts to gate
// or a branch B, two experts at least to contrast.
bool mix_serves(int64_t H, int64_t Q, const MixWeights& w) {
  const int64_t E = int64_t(w.experts.size()) / 3;
  const bool gated = w.router.has_value() && w.router->defined();
  const at::IntArrayRef outs = w.outs;
  bool ok = E >= 1 && int64_t(w.experts.size()) == 3 * E && outs.size() == 5 && outs[0] == H && outs[1] == outs[2] &&
            outs[3] == H && linear_serves(w.o_panels, Q, H) && w.norm.scalar_type() == at::kFloat &&
            w.norm.numel() == H && w.norm.is_contiguous() && (E == 1 || gated) && (w.branch == 0 || gated) &&
            (w.branch != 2 || E >= 2) && (!gated || linear_serves(*w.router, H, outs[4])) &&
            (!gated || outs[4] >= (w.branch != 0 ? 2 * E : E));
  for (int64_t e = 0; ok && e < E; ++e)
    ok = linear_serves(w.experts[3 * e], H, outs[1]) && linear_serves(w.experts[3 * e + 1], H, outs[2]) &&
         linear_serves(w.experts[3 * e + 2], outs[1], H);
  return ok;
}

// draft_mix's work after the attention, from its output att [n, Q] and z [n, H] on raw rows: h = z + o(att), the
// post-attention norm, each expert's SwiGLU, the router's gates and branch B, as MoEBlock.forward computes them
// (torch's softmax, and its topk for the top k of more than two experts, on the raw rows; the rest in loops that round
// as its operators do). Writes a [n, H], b [n, H] (branch B's; untouched without it), experts [n, E, H] (h plus each
// expert's output) and gates [n, E] (n ones without a router); scratch from a buffer the thread reuses.
void mix_rows(const float* z, const float* att, int64_t n, int64_t Q, const MixWeights& w, float* a, float* b,
              float* each, float* gates) {
  const int64_t E = int64_t(w.experts.size()) / 3, H = w.outs[0], I = w.outs[1], R = w.outs[4];
  const bool gated = w.router.has_value() && w.router->defined();
  int64_t most = padded_floats(w.o_panels, H, n), gate_room = 0, up_room = 0;  // the most any projection writes
  for (int64_t e = 0; e < E; ++e) {
    most = std::max(most, padded_floats(w.experts[3 * e + 2], H, n));
    gate_room = std::max(gate_room, padded_floats(w.experts[3 * e], I, n));
    up_room = std::max(up_room, padded_floats(w.experts[3 * e + 1], I, n));
  }
  const int64_t score_room = gated ? padded_floats(*w.router, R, n) : 0;
  thread_local std::vector<float> buffer;
  float* y = reused(buffer, most + 2 * n * H + gate_room + up_room + n * E * H + score_room + 3 * n * E);
  float *h = y + most, *u = h + n * H, *g = u + n * H, *up = g + gate_room, *mixed = up + up_room;
  float *scores = mixed + n * E * H, *weights_b = scores + score_room, *top = weights_b + n * E;
  linear_rows(att, w.o_panels, n, Q, H, y);
  for (int64_t i = 0; i < n * H; ++i) h[i] = z[i] + y[i];
  norm_rows(h, w.norm.data_ptr<float>(), u, n, H, w.eps);
  for (int64_t e = 0; e < E; ++e) {
    swiglu_rows(u, w.experts[3 * e], w.experts[3 * e + 1], w.experts[3 * e + 2], n, H, I, g, up, y);
    for (int64_t r = 0; r < n; ++r) std::memcpy(mixed + (r * E + e) * H, y + r * H, H * sizeof(float));
  }
  if (gated) {
    linear_rows(u, *w.router, n, H, R, scores);  // [n, E] branch A's logits, then [n, E] branch B's
    if (E > 1)
      gate_weights(scores, n, E, R, w.top_k, gates);
    else
      std::fill(gates, gates + n, 1.0f);
    if (w.branch == 2) {  // the two leading experts of branch B's softmax, contrasted
      softmax_rows(scores + E, n, E, R, weights_b);
      std::vector<int64_t> order(2 * n);
      top_rows(weights_b, n, E, 2, top, order.data());
      contrast_rows(h, top, order.data(), mixed, n, E, H, b);
    } else if (w.branch == 1) {
      if (E > 1)
        gate_weights(scores + E, n, E, R, w.top_k, weights_b);
      else
        softmax_rows(scores + E, n, E, R, weights_b);
      mixture_rows(h, weights_b, mixed, n, E, H, b);
    }
  } else {
    std::fill(gates, gates + n, 1.0f);
  }
  mixture_rows(h, gates, mixed, n, E, H, a);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t c = 0; c < H; ++c) each[(r * E + e) * H + c] = h[r * H + c] + mixed[(r * E + e) * H + c];
}

// draft_mix: the rest of the step from z [1, n, H], the rotated queries and the keys and values to attend [1, KV heads,
// S, D] (the cache's, this step's written): attention under ``mask`` (as padded_mask reads it; none: every
// key), the output projection and residual, the post-attention norm, then the MoE block: each expert's
// SwiGLU (gate, up and down panels, three an expert), the router (undefined: one expert and no branch B), branch A's
// top-k mixture and, ``branch`` 1 or 2, branch B's (its mixture, or contrastive: the two leading experts' difference).
// outs: the output projection's, the experts' gate, up and down projections' and the router's widths. Returns a, b
// (empty for no branch B), experts [1, n, E, H] and gates [1, n, E], as MoEBlock.forward does.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_mix(
    const at::Tensor& z, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
    const c10::optional<at::Tensor>& mask, double scale, const at::Tensor& o_panels, const at::Tensor& norm,
    double eps, const c10::optional<at::Tensor>& router, at::TensorList experts, at::IntArrayRef outs, int64_t top_k,
    int64_t branch) {
  const int64_t n = q.size(2);
  const MixWeights w{o_panels, norm, eps, router, experts, outs, top_k, branch};
  TORCH_CHECK(z.dim() == 3 && z.size(0) == 1 && z.size(1) == n && z.scalar_type() == at::kFloat &&
              attend_serves(q, keys, values) && mix_serves(z.size(2), q.size(1) * q.size(3), w),
              "stream_gemm.draft_mix: shapes do not match");
  const at::Tensor att = attend_padded(q, keys, values, padded_mask(mask, n, keys.size(2)), scale);
  const int64_t H = z.size(2), E = int64_t(experts.size()) / 3;
  const bool gated = router.has_value() && router->defined();
  at::Tensor a = at::empty({1, n, H}, z.options()), each = at::empty({1, n, E, H}, z.options());
  at::Tensor gates = at::empty({1, n, gated ? E : 1}, z.options());
  at::Tensor b = branch != 0 ? at::empty({1, n, H}, z.options()) : at::empty({0}, z.options());
  mix_rows(z.contiguous().data_ptr<float>(), att.data_ptr<float>(), n, q.size(1) * q.size(3), w, a.data_ptr<float>(),
           b.data_ptr<float>(), each.data_ptr<float>(), gates.data_ptr<float>());
  return {a, b, each, gates};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_mix_meta(
    const at::Tensor& z, const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
    const c10::optional<at::Tensor>& mask, double scale, const at::Tensor& o_panels, const at::Tensor& norm,
    double eps, const c10::optional<at::Tensor>& router, at::TensorList experts, at::IntArrayRef outs, int64_t top_k,
    int64_t branch) {
  const int64_t n = q.size(2), H = z.size(2), E = int64_t(experts.size()) / 3;
  const bool gated = router.has_value() && router->defined();
  const at::Tensor b = branch != 0 ? at::empty({1, n, H}, z.options()) : at::empty({0}, z.options());
  return {at::empty({1, n, H}, z.options()), b, at::empty({1, n, E, H}, z.options()),
          at::empty({1, n, gated ? E : 1}, z.options())};
}

// A draft step's weights and cache beside its rows: draft_step's arguments after the rows' own (the target's embedding
// table, RoPE's cos and sin tables [T, D], draft_qkv's weights, the cache [1, KV heads, capacity, D] read over its
// first ``window`` positions, the attention's scale, the MoE block's weights).
struct StepWeights {
  const at::Tensor& embed;
  const at::Tensor& cos_table;
  const at::Tensor& sin_table;
  const at::Tensor& fc;
  const at::Tensor& fc_bias;
  const at::Tensor& q_panels;
  const at::Tensor& k_panels;
  const at::Tensor& v_panels;
  at::IntArrayRef qkv_outs;
  int64_t D;
  at::Tensor& cache_k;
  at::Tensor& cache_v;
  int64_t window;
  double scale;
  MixWeights mix;
};

// Whether a step's weights serve rows of H features (the checks draft_step and draft_tree make once a call).
bool step_serves(const StepWeights& w, int64_t H) {
  const at::IntArrayRef outs = w.qkv_outs;
  const int64_t D = w.D, Q = outs.size() == 4 ? outs[1] : 0, KV = outs.size() == 4 ? outs[2] : 0;
  const int64_t Hk = D > 0 ? KV / D : 0;
  const at::Tensor &k = w.cache_k, &v = w.cache_v;
  return k.dim() == 4 && v.sizes() == k.sizes() && 0 < w.window && w.window <= k.size(2) && w.cos_table.dim() == 2 &&
         w.sin_table.sizes() == w.cos_table.sizes() && w.embed.dim() == 2 && w.embed.size(1) == H &&
         w.cos_table.scalar_type() == at::kFloat && w.sin_table.scalar_type() == at::kFloat &&
         w.cos_table.is_contiguous() && w.sin_table.is_contiguous() && w.cos_table.size(1) == D &&
         k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.size(0) == 1 && k.size(1) == Hk &&
         k.size(3) == D && k.stride(3) == 1 && v.stride(3) == 1 &&
         qkv_serves(2 * H, w.fc, w.fc_bias, w.q_panels, w.k_panels, w.v_panels, outs, D) && Hk > 0 &&
         (Q / D) % Hk == 0 && queries_fn(D) != nullptr && mix_serves(outs[0], Q, w.mix);
}

// The step of n rows on raw memory, for weights that serve them (step_serves): the embedding of ``id`` [n] beside
// ``feats`` [n, H], the rows ``pos`` [n] of RoPE's tables, draft_qkv's work, the keys and values written at ``slot``
// [n] of the cache, the attention over its first ``window`` positions under ``mask`` [n, Sp] (padded_mask's form; null:
// every position), then mix_rows into a, b, each and gates. The same arithmetic in the same order as the Python step
// (models/draft.py's DraftModel._step).
void step_rows(const StepWeights& w, const int64_t* id, const float* feats, const int64_t* pos, const int64_t* slot,
               const float* mask, int64_t n, float* a, float* b, float* each, float* gates) {
  const int64_t H = w.embed.size(1), D = w.D, Q = w.qkv_outs[1], KV = w.qkv_outs[2], Hk = KV / D;
  const int64_t cap = w.cache_k.size(2);
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(0 <= id[r] && id[r] < w.embed.size(0) && 0 <= pos[r] && pos[r] < w.cos_table.size(0) &&
                0 <= slot[r] && slot[r] < cap, "stream_gemm.draft_step: an id, position or slot out of range");
  // the embedding and features x [n, 2H], cos and sin [n, D], then draft_qkv's and the attention's rows (qkv_rows)
  const int64_t sizes[10] = {n * 2 * H, n * D, n * D, padded_floats(w.fc, w.qkv_outs[0], n),
                             padded_floats(w.q_panels, Q, n), padded_floats(w.k_panels, KV, n),
                             padded_floats(w.v_panels, KV, n), n * Q, n * KV, n * Q};
  int64_t total = 0;
  for (const int64_t size : sizes) total += size;
  thread_local std::vector<float> buffer;
  float* row[10] = {reused(buffer, total)};
  for (int i = 1; i < 10; ++i) row[i] = row[i - 1] + sizes[i - 1];
  float *x = row[0], *cos = row[1], *sin = row[2], *z = row[3], *qr = row[7], *kr = row[8], *att = row[9];
  const bool table = w.embed.scalar_type() == at::kFloat && w.embed.is_contiguous();
  const at::Tensor ids = at::from_blob(const_cast<int64_t*>(id), {n}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor taken = table ? w.embed : at::embedding(w.embed, ids).to(at::kFloat).contiguous();
  const float *ct = w.cos_table.data_ptr<float>(), *st = w.sin_table.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r) {  // as the embedding and its concatenation with the features, and the tables' rows
    std::memcpy(x + r * 2 * H, taken.data_ptr<float>() + (table ? id[r] : r) * H, H * sizeof(float));
    std::memcpy(x + r * 2 * H + H, feats + r * H, H * sizeof(float));
    std::memcpy(cos + r * D, ct + pos[r] * D, D * sizeof(float));
    std::memcpy(sin + r * D, st + pos[r] * D, D * sizeof(float));
  }
  qkv_rows(x, n, 2 * H, w.fc, w.fc_bias, w.q_panels, w.k_panels, w.v_panels, w.qkv_outs, D, cos, sin, z, row[4],
           row[5], row[6], qr, kr);
  float *ck = w.cache_k.data_ptr<float>(), *cv = w.cache_v.data_ptr<float>();
  // the keys and values at their slots, as index_copy_ writes them
  write_rows(kr, D, KV, ck, w.cache_k.stride(1), w.cache_k.stride(2), Hk, n, D, 0, slot);
  write_rows(row[6], D, KV, cv, w.cache_v.stride(1), w.cache_v.stride(2), Hk, n, D, 0, slot);
  attend_rows(qr, D, Q, ck, w.cache_k.stride(1), w.cache_k.stride(2), cv, w.cache_v.stride(1), w.cache_v.stride(2),
              mask, Q / D, Hk, n, w.window, D, w.scale, att);
  mix_rows(z, att, n, Q, w.mix, a, b, each, gates);
}

// draft_step: the whole step of a few rows for the engine's own draft cache, the two calls above and what the Python
// step does around them in one call (models/draft_step.py's one_call; step_rows): the embedding of ``ids`` [n] (the
// target's table ``embed``) beside ``features`` [n, H], the rows ``pos`` [n] of RoPE's cos and sin tables [T, D] (the
// draft's rotary at positions 0..T-1), draft_qkv, the keys and values written at ``slots`` [n] of the cache [1, KV
// heads, capacity, D], draft_mix over its first ``window`` positions under ``mask`` [1, 1, n, window]. Returns a, b
// (empty for no branch B), experts and gates without the batch dimension.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> draft_step(
    const at::Tensor& ids, const at::Tensor& features, const at::Tensor& pos, const at::Tensor& slots,
    const c10::optional<at::Tensor>& mask, const at::Tensor& embed, const at::Tensor& cos_table,
    const at::Tensor& sin_table, const at::Tensor& fc, const at::Tensor& fc_bias, const at::Tensor& q_panels,
    const at::Tensor& k_panels, const at::Tensor& v_panels, at::IntArrayRef qkv_outs, int64_t D, at::Tensor cache_k,
    at::Tensor cache_v, int64_t window, double scale, const at::Tensor& o_panels, const at::Tensor& norm, double eps,
    const c10::optional<at::Tensor>& router, at::TensorList experts, at::IntArrayRef mix_outs, int64_t top_k,
    int64_t branch) {
  const int64_t n = ids.dim() == 1 ? ids.size(0) : -1;
  const StepWeights w{embed, cos_table, sin_table, fc, fc_bias, q_panels, k_panels, v_panels, qkv_outs, D, cache_k,
                      cache_v, window, scale, {o_panels, norm, eps, router, experts, mix_outs, top_k, branch}};
  TORCH_CHECK(n > 0 && features.dim() == 2 && features.size(0) == n && features.scalar_type() == at::kFloat &&
              ids.scalar_type() == at::kLong && pos.sizes() == ids.sizes() && pos.scalar_type() == at::kLong &&
              slots.sizes() == ids.sizes() && slots.scalar_type() == at::kLong && step_serves(w, features.size(1)),
              "stream_gemm.draft_step: shapes do not match");
  const int64_t H = features.size(1), E = int64_t(experts.size()) / 3;
  const bool gated = router.has_value() && router->defined();
  const at::Tensor ids_c = ids.contiguous(), pos_c = pos.contiguous(), slots_c = slots.contiguous();
  const at::Tensor feats = features.contiguous();
  const at::Tensor padded = padded_mask(mask, n, window);
  at::Tensor a = at::empty({n, H}, feats.options()), each = at::empty({n, E, H}, feats.options());
  at::Tensor gates = at::empty({n, gated ? E : 1}, feats.options());
  at::Tensor b = branch != 0 ? at::empty({n, H}, feats.options()) : at::empty({0}, feats.options());
  step_rows(w, ids_c.data_ptr<int64_t>(), feats.data_ptr<float>(), pos_c.data_ptr<int64_t>(),
            slots_c.data_ptr<int64_t>(), padded.defined() ? padded.data_ptr<float>() : nullptr, n, a.data_ptr<float>(),
            b.data_ptr<float>(), each.data_ptr<float>(), gates.data_ptr<float>());
  return {a, b, each, gates};
}

// The indices of the ``cap`` largest of vals[0..count) into out, the largest first and the earlier first among equal
// (each value inserted among those held: a few of many); returns how many are held.
int64_t best_indices(const float* vals, int64_t count, int64_t cap, int64_t* out) {
  int64_t held = 0;
  float least = 0.0f;  // vals[out[cap - 1]] once cap are held
  for (int64_t c = 0; c < count; ++c) {
    if (held == cap && !(vals[c] > least)) continue;
    int64_t at = held < cap ? held++ : held - 1;
    while (at > 0 && vals[c] > vals[out[at - 1]]) {
      out[at] = out[at - 1];
      --at;
    }
    out[at] = c;
    least = vals[out[held - 1]];
  }
  return held;
}

// A frontier's children from the draft head's logits, as decoding/drafting.py's candidate_tensors chooses them
// (docs/DESIGN.md section 3), on raw rows: node n's S rows of V logits at logits + (n S + s) * stride (S = 1: the
// mixture's, coupled; S > 1: each selected expert's, decoupled), each read as its log-softmax, (x - max) - log(sum_v
// exp(x_v - max)), as torch's. Each row's top per_expert words (ties: the lower word), their union sorted by word; each
// word scored by logsumexp_s(logp_s + log(w_s / sum w)) (``weights`` [N, S], the mixture's) or, without weights (null),
// by its best row's log-prob; a word met twice scores -inf the second time; fewer than k words padded with the first
// word at -inf. The k best (ties: the earlier), and the row that backs each most (the first of equal, the weights' term
// included): words (draft vocabulary), scores and rows [N, k].
void children_rows(const float* logits, int64_t stride, int64_t N, int64_t S, int64_t V, const float* weights,
                   int64_t k, int64_t per_expert, int64_t* ids, float* scores, int64_t* rows) {
  const int64_t C = S * per_expert, Cp = std::max(C, k);
  const float inf = std::numeric_limits<float>::infinity();
  // each row's log-softmax terms and top per_expert words, the threads splitting the N S rows
  std::vector<float> shifts(N * S), log_sums(N * S);
  std::vector<int64_t> tops(N * C);
  at::parallel_for(0, N * S, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = logits + r * stride;
      shifts[r] = row_max(row, V);
      log_sums[r] = std::log(exp_sum(row, V, shifts[r]));
      best_indices(row, V, per_expert, tops.data() + r * per_expert);
    }
  });
  at::parallel_for(0, N, 1, [&](int64_t n0, int64_t n1) {
    std::vector<float> log_w(S, 0.0f), weighted(S * Cp), score(Cp);
    std::vector<int64_t> words(Cp), picked(k);
    for (int64_t n = n0; n < n1; ++n) {
      const float* node = logits + n * S * stride;
      const float *shift = shifts.data() + n * S, *log_sum = log_sums.data() + n * S;
      if (weights != nullptr) {
        const float* w = weights + n * S;
        float total = 0.0f;
        for (int64_t s = 0; s < S; ++s) total += w[s];
        for (int64_t s = 0; s < S; ++s) log_w[s] = std::log(w[s] / total);
      }
      std::copy(tops.begin() + n * C, tops.begin() + (n + 1) * C, words.begin());
      std::sort(words.begin(), words.begin() + C);
      for (int64_t c = 0; c < Cp; ++c) {
        const int64_t word = words[c < C ? c : 0];
        float most = -inf;
        for (int64_t s = 0; s < S; ++s) {
          const float x = ((node[s * stride + word] - shift[s]) - log_sum[s]) + log_w[s];
          weighted[s * Cp + c] = x;
          most = std::max(most, x);
        }
        float value = most;
        if (weights != nullptr) {
          const float m = std::isinf(most) ? 0.0f : most;
          float sum = 0.0f;
          for (int64_t s = 0; s < S; ++s) sum += std::exp(weighted[s * Cp + c] - m);
          value = std::log(sum) + m;
        }
        score[c] = c >= C || (c > 0 && words[c] == words[c - 1]) ? -inf : value;
      }
      best_indices(score.data(), Cp, k, picked.data());  // Cp >= k: k held
      for (int64_t i = 0; i < k; ++i) {
        const int64_t c = picked[i];
        int64_t row = 0;
        for (int64_t s = 1; s < S; ++s)
          if (weighted[s * Cp + c] > weighted[row * Cp + c]) row = s;
        ids[n * k + i] = words[c < C ? c : 0];
        scores[n * k + i] = score[c];
        rows[n * k + i] = row;
      }
    }
  });
}

// children_rows of logits [N, S, V] (``weights`` [N, S] or none): the words [N, k], their scores and rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_children(const at::Tensor& logits_,
                                                              const c10::optional<at::Tensor>& weights_, int64_t k,
                                                              int64_t per_expert) {
  TORCH_CHECK(logits_.dim() == 3 && logits_.scalar_type() == at::kFloat && k >= 1 && per_expert >= 1 &&
              per_expert <= logits_.size(2), "stream_gemm.draft_children: shapes do not match");
  const at::Tensor logits = logits_.contiguous();
  const int64_t N = logits.size(0), S = logits.size(1), V = logits.size(2);
  const bool mixture = weights_.has_value() && weights_->defined();
  at::Tensor weights;
  if (mixture) {
    weights = weights_->to(at::kFloat).contiguous();
    TORCH_CHECK(weights.dim() == 2 && weights.size(0) == N && weights.size(1) == S,
                "stream_gemm.draft_children: weights [N, S] expected");
  }
  at::Tensor ids = at::empty({N, k}, logits.options().dtype(at::kLong)), scores = at::empty({N, k}, logits.options());
  at::Tensor rows = at::empty({N, k}, logits.options().dtype(at::kLong));
  children_rows(logits.data_ptr<float>(), V, N, S, V, mixture ? weights.data_ptr<float>() : nullptr, k, per_expert,
                ids.data_ptr<int64_t>(), scores.data_ptr<float>(), rows.data_ptr<int64_t>());
  return {ids, scores, rows};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> draft_children_meta(const at::Tensor& logits,
                                                                   const c10::optional<at::Tensor>& weights, int64_t k,
                                                                   int64_t per_expert) {
  const int64_t N = logits.size(0);
  return {at::empty({N, k}, logits.options().dtype(at::kLong)), at::empty({N, k}, logits.options()),
          at::empty({N, k}, logits.options().dtype(at::kLong))};
}


// draft_tree: EAGLE-2's tree for the engine's eager cycle in one call, as decoding/static_tree.py's _pool_candidates
// and select_tree draft and select it (docs/DESIGN.md sections 3 and 12), by the same arithmetic in the same order
// where it rounds (step_rows, the int8 head's screen_rows, children_rows, branch B's log-softmax and top k by torch's)
// and by plain loops over the pool's few dozen entries where it does not (its scores are sums and minima of doubles,
// its orders stable sorts), on buffers the thread reuses. The root's outputs (a [H], b [H] or empty, experts [E, H],
// gates [E]) and token (0-dim); the head's int8 copy (screen, scales, rows) and ``d2t`` (draft to target ids, or
// empty); the schedule ``steps`` (1: branch A, 2: A then B's grandchildren), ``K`` children a node, ``m`` tokens kept;
// decoupled candidates from ``select`` experts, scored as their mixture or by the best; ``base`` positions cached; the
// rest draft_step's. Returns tokens, parents (the root's 0), depths, ranks [m] (the root's -1), the ancestor mask
// [m, m] and the nanoseconds spent in draft steps.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, int64_t> draft_tree(
    const at::Tensor& root_a, const at::Tensor& root_b, const at::Tensor& root_experts, const at::Tensor& root_gates,
    const at::Tensor& root_token, const at::Tensor& head_screen, const at::Tensor& head_scales, int64_t head_rows,
    const at::Tensor& d2t, at::IntArrayRef steps, int64_t K, int64_t m, bool decoupled, int64_t select, bool mixture,
    int64_t per_expert, int64_t base, const at::Tensor& embed, const at::Tensor& cos_table,
    const at::Tensor& sin_table, const at::Tensor& fc, const at::Tensor& fc_bias, const at::Tensor& q_panels,
    const at::Tensor& k_panels, const at::Tensor& v_panels, at::IntArrayRef qkv_outs, int64_t D, at::Tensor cache_k,
    at::Tensor cache_v, int64_t window, double scale, const at::Tensor& o_panels, const at::Tensor& norm, double eps,
    const c10::optional<at::Tensor>& router, at::TensorList experts, at::IntArrayRef mix_outs, int64_t top_k,
    int64_t branch) {
  const int64_t n_steps = int64_t(steps.size()), n_slots = (n_steps - 1) * K, H = root_a.size(-1);
  const int64_t E = int64_t(experts.size()) / 3, Eg = router.has_value() && router->defined() ? E : 1;
  const StepWeights w{embed, cos_table, sin_table, fc, fc_bias, q_panels, k_panels, v_panels, qkv_outs, D, cache_k,
                      cache_v, window, scale, {o_panels, norm, eps, router, experts, mix_outs, top_k, branch}};
  const bool cepd = std::find(steps.begin(), steps.end(), 2) != steps.end();
  TORCH_CHECK(n_steps >= 1 && K >= 1 && m >= 2 && root_a.dim() == 1 && root_a.scalar_type() == at::kFloat &&
              root_a.is_contiguous() && root_experts.dim() == 2 && root_experts.size(0) == E &&
              root_experts.size(1) == H && root_experts.is_contiguous() && root_gates.dim() == 1 &&
              root_gates.size(0) == Eg && root_gates.scalar_type() == at::kFloat && root_gates.is_contiguous() &&
              (!cepd || (root_b.numel() == H && root_b.is_contiguous() && branch != 0)) &&
              root_token.numel() == 1 && root_token.scalar_type() == at::kLong &&
              (d2t.numel() == 0 || (d2t.scalar_type() == at::kLong && d2t.is_contiguous() &&
                                    d2t.size(0) >= head_rows)) &&
              screen_serves(head_screen, head_scales, H) && 0 < head_rows && head_rows <= head_scales.size(0) &&
              (per_expert >= 1 && per_expert <= head_rows) && K <= head_rows && base + n_slots <= window &&
              step_serves(w, H), "stream_gemm.draft_tree: shapes do not match");
  const auto opts = root_a.options();
  const auto longs = opts.dtype(at::kLong);
  const int64_t V = head_rows, Pl = head_scales.size(0), S_most = decoupled ? std::min(select, Eg) : 1;
  const int64_t Sp = (window + L - 1) / L * L;
  // the thread's buffers: a step's outputs (a, b [K, H], experts [K, E, H], gates [K, Eg]), the head's rows [K, S,
  // H] and logits [K, S, Pl] (branch B's [K, Pl]), the frontier's features [K, H] and mask [K, Sp], the selected
  // experts' weights [K, S]
  const int64_t sizes[9] = {K * H, K * H, K * E * H, K * Eg, K * S_most * H, K * std::max<int64_t>(S_most, 1) * Pl,
                            K * H, K * Sp, K * S_most};
  int64_t total = 0;
  for (const int64_t size : sizes) total += size;
  thread_local std::vector<float> buffer;
  float* part[9] = {reused(buffer, total)};
  for (int i = 1; i < 9; ++i) part[i] = part[i - 1] + sizes[i - 1];
  float *out_a = part[0], *out_b = part[1], *out_each = part[2], *out_gates = part[3], *feats = part[4];
  float *logits = part[5], *front_feat = part[6], *mask = part[7], *chosen_w = part[8];
  std::vector<float> t(K * S_most);  // screen_rows' t, unused here
  std::vector<int64_t> chosen(K * S_most), words(K * K), rows(K * K), ids(K * K), slots(K), pos(K);
  std::vector<float> vals(K * K);
  const int64_t* d2t_ids = d2t.numel() ? d2t.data_ptr<int64_t>() : nullptr;
  auto target_id = [&](int64_t word) { return d2t_ids != nullptr ? d2t_ids[word] : word; };
  // the pool, the root first: tokens, parents, scores (doubles, as the Python pool's), depths
  std::vector<int64_t> tokens{*root_token.data_ptr<int64_t>()}, parents{0}, depths{0};
  std::vector<double> scores{0.0};
  auto add = [&](const int64_t* child_ids, const float* child_vals, const std::vector<int64_t>& owner,
                 const std::vector<double>& owner_score, int64_t n, int64_t depth) {  // n children an owner
    std::vector<double> child;
    for (size_t o = 0; o < owner.size(); ++o)
      for (int64_t i = 0; i < n; ++i) {
        const double s = owner_score[o] + double(child_vals[o * n + i]);
        child.push_back(std::min(s, owner_score[o]));  // a child never outscores its parent
        tokens.push_back(child_ids[o * n + i]);
        parents.push_back(owner[o]);
        scores.push_back(child.back());
        depths.push_back(depth);
      }
    return child;
  };
  auto best = [](const std::vector<double>& v, int64_t k) {  // stable descending order, the first k
    std::vector<int64_t> order(v.size());
    for (size_t i = 0; i < v.size(); ++i) order[i] = int64_t(i);
    std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return v[x] > v[y]; });
    order.resize(std::min<int64_t>(k, int64_t(order.size())));
    return order;
  };
  struct Frontier {  // pool indices, scores, tokens, and the forwarded slots each row sees [N][n_slots]
    std::vector<int64_t> idx, tok;
    std::vector<double> score;
    std::vector<std::vector<uint8_t>> anc;
  };
  // The next frontier: candidates `order` of those just pooled (the first at pool index `first`, scores `child`,
  // target ids `child_ids`, K an owner), each seeing what its owner row saw (`anc`)
  auto next = [&](const std::vector<int64_t>& order, int64_t first, const std::vector<double>& child,
                  const int64_t* child_ids, const std::vector<std::vector<uint8_t>>& anc) {
    Frontier f;
    for (int64_t c : order) {
      f.idx.push_back(first + c);
      f.score.push_back(child[c]);
      f.tok.push_back(child_ids[c]);
      f.anc.push_back(anc[c / K]);
    }
    return f;
  };
  Frontier front{{0}, {tokens[0]}, {0.0}, {std::vector<uint8_t>(n_slots, 0)}};
  // the outputs the frontier's children come from: the root's, then each step's
  const float *a = root_a.data_ptr<float>(), *b = cepd ? root_b.data_ptr<float>() : nullptr;
  const float *each = root_experts.data_ptr<float>(), *gates = root_gates.data_ptr<float>();
  int64_t N = 1, depth = 0, forward_ns = 0;
  for (int64_t k = 0; k < n_steps; ++k) {
    const bool last = k == n_steps - 1;
    std::vector<std::vector<uint8_t>> own = front.anc;
    if (k > 0) {  // one draft step for the whole frontier, into slots base + s0.. of the draft cache
      const int64_t s0 = (k - 1) * K;
      for (int64_t r = 0; r < K; ++r) {  // the text, and the slots it sees (padded_mask's form)
        own[r][s0 + r] = 1;  // each row also sees itself
        float* row = mask + r * Sp;
        std::fill(row, row + base, 0.0f);
        for (int64_t j = 0; j < n_slots; ++j) row[base + j] = own[r][j] ? 0.0f : std::numeric_limits<float>::lowest();
        std::fill(row + base + n_slots, row + window, std::numeric_limits<float>::lowest());
        std::fill(row + window, row + Sp, 0.0f);
        slots[r] = base + s0 + r;
        pos[r] = base + depth - 1;
      }
      const auto t0 = std::chrono::steady_clock::now();
      step_rows(w, front.tok.data(), front_feat, pos.data(), slots.data(), mask, K, out_a, out_b, out_each,
                out_gates);
      forward_ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
                        .count();
      a = out_a, b = out_b, each = out_each, gates = out_gates, N = K;
    }
    // the frontier's children (decoding/drafting.py's candidate_tensors): the head's rows, the mixture's or the
    // selected experts'
    int64_t S = 1, per = K;
    if (decoupled) {
      S = S_most;
      top_rows(gates, N, Eg, S, chosen_w, chosen.data());  // [N, S]
      for (int64_t n = 0; n < N; ++n)
        for (int64_t s = 0; s < S; ++s)
          std::memcpy(feats + (n * S + s) * H, each + (n * E + chosen[n * S + s]) * H, H * sizeof(float));
      per = per_expert;
    } else {
      std::memcpy(feats, a, N * H * sizeof(float));
    }
    screen_rows(feats, N * S, H, head_screen, head_scales, logits, t.data(), false);
    children_rows(logits, Pl, N, S, V, decoupled && mixture ? chosen_w : nullptr, K, per, words.data(), vals.data(),
                  rows.data());  // [N, K]
    for (int64_t i = 0; i < N * K; ++i) ids[i] = target_id(words[i]);
    const int64_t first = int64_t(tokens.size());
    const std::vector<double> child = add(ids.data(), vals.data(), front.idx, front.score, K, depth + 1);
    if (last && steps[k] == 1) break;  // the last layer's children are candidates, never forwarded
    const std::vector<int64_t> order = best(child, K);
    front = next(order, first, child, ids.data(), own);
    for (size_t i = 0; i < order.size(); ++i) {  // each child carries the head row that backs it
      const int64_t c = order[i];
      std::memcpy(front_feat + i * H, feats + ((c / K) * S + rows[c]) * H, H * sizeof(float));
    }
    ++depth;
    if (steps[k] == 2) {  // CEPD: the survivors' children from their parents' branch B
      std::vector<int64_t> up;  // each survivor's parent, a row of b
      for (int64_t c : order) up.push_back(c / K);
      screen_rows(b, N, H, head_screen, head_scales, logits, t.data(), false);
      const auto [top_v, top_i] = at::from_blob(logits, {N, V}, {Pl, 1}, at::TensorOptions().dtype(at::kFloat))
                                      .log_softmax(-1).topk(K, -1);  // [N, K]
      const at::Tensor top_vc = top_v.contiguous(), top_ic = top_i.contiguous();
      std::vector<int64_t> grand_ids(K * K);
      std::vector<float> grand_v(K * K);
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < K; ++j) {
          grand_ids[i * K + j] = target_id(top_ic.data_ptr<int64_t>()[up[i] * K + j]);
          grand_v[i * K + j] = top_vc.data_ptr<float>()[up[i] * K + j];
        }
      const int64_t first_b = int64_t(tokens.size());
      const std::vector<double> grand = add(grand_ids.data(), grand_v.data(), front.idx, front.score, K, depth + 1);
      if (last) break;
      const std::vector<int64_t> order_b = best(grand, K);
      front = next(order_b, first_b, grand, grand_ids.data(), front.anc);
      for (size_t i = 0; i < order_b.size(); ++i)  // each grandchild carries its parent's branch-B output
        std::memcpy(front_feat + i * H, b + up[order_b[i] / K] * H, H * sizeof(float));
      ++depth;
    }
  }
  // select_tree: the root and the best m - 1 candidates (ties: the earlier), kept in pool order
  const int64_t P = int64_t(scores.size());
  TORCH_CHECK(m <= P, "stream_gemm.draft_tree: a tree of ", m, " tokens from a pool of ", P);
  std::vector<double> rest(scores.begin() + 1, scores.end());
  const std::vector<int64_t> ranked = best(rest, m - 1);  // pool index - 1, best first
  std::vector<int64_t> rank_of(P, -1), kept{0};
  for (int64_t r = 0; r < m - 1; ++r) rank_of[ranked[r] + 1] = r;
  for (int64_t i = 1; i < P; ++i)
    if (rank_of[i] >= 0) kept.push_back(i);
  std::vector<int64_t> new_index(P, 0);
  for (int64_t j = 0; j < m; ++j) new_index[kept[j]] = j;
  at::Tensor out_tokens = at::empty({m}, longs), out_parents = at::empty({m}, longs);
  at::Tensor out_depths = at::empty({m}, longs), out_ranks = at::empty({m}, longs);
  at::Tensor anc = at::zeros({m, m}, opts.dtype(at::kBool));
  bool* am = anc.data_ptr<bool>();
  for (int64_t j = 0; j < m; ++j) {
    const int64_t i = kept[j], up = new_index[parents[i]];
    out_tokens.data_ptr<int64_t>()[j] = tokens[i];
    out_parents.data_ptr<int64_t>()[j] = up;
    out_depths.data_ptr<int64_t>()[j] = depths[i];
    out_ranks.data_ptr<int64_t>()[j] = j == 0 ? -1 : rank_of[i];
    if (j > 0)
      for (int64_t c = 0; c < m; ++c) am[j * m + c] = am[up * m + c];  // a parent precedes its children
    am[j * m + j] = true;
  }
  return {out_tokens, out_parents, out_depths, out_ranks, anc, forward_ns};
}

}  // namespace

TORCH_LIBRARY(jakiro_stream_gemm, m) {
  m.def("pack(Tensor weight, bool bf16=False) -> Tensor");
  m.def("pack_scaled(Tensor weight) -> Tensor");
  m.def("linear(Tensor input, Tensor packed, int n) -> Tensor");
  m.def("rope(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("kv_write(Tensor(a!) stack, int slot, Tensor keys, Tensor values, int start) -> (Tensor(a), Tensor(a))");
  m.def("attend(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor");
  m.def("argmax(Tensor x) -> Tensor");
  m.def("pack_int8(Tensor weight, bool tiles=False) -> (Tensor, Tensor)");
  m.def("greedy_head(Tensor x, Tensor screen, Tensor scales, Tensor bound, Tensor l1, Tensor weight) -> Tensor");
  m.def("tile_screen() -> bool", tile_screen);
  m.def("stream_prefetch(int hint=-1) -> int", stream_prefetch);
  m.def("silu_in_region() -> bool", silu_is_torchs);
  m.def("int8_linear(Tensor x, Tensor screen, Tensor scales, int n) -> Tensor");
  m.def("sampled_head(Tensor x, Tensor screen, Tensor scales, Tensor bound, Tensor l1, Tensor weight, Tensor draws, "
        "float temperature) -> Tensor");
  m.def("gumbel_noise(Tensor draws, int V, float temperature) -> Tensor");
  m.def("decoder_layers(Tensor hidden, Tensor[] weights, int[] outs, Tensor(a!) stack, int start, Tensor cos, "
        "Tensor sin, Tensor? mask, int D, float eps, float scale, int attend_rows) -> Tensor");
  m.def("draft_qkv(Tensor x, Tensor fc, Tensor fc_bias, Tensor q, Tensor k, Tensor v, int[] outs, int D, Tensor cos, "
        "Tensor sin) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("draft_mix(Tensor z, Tensor q, Tensor keys, Tensor values, Tensor? mask, float scale, Tensor o, Tensor norm, "
        "float eps, Tensor? router, Tensor[] experts, int[] outs, int top_k, int branch) -> (Tensor, Tensor, Tensor, "
        "Tensor)");
  m.def("draft_children(Tensor logits, Tensor? weights, int k, int per_expert) -> (Tensor, Tensor, Tensor)");
  m.def("draft_step(Tensor ids, Tensor features, Tensor pos, Tensor slots, Tensor? mask, Tensor embed, "
        "Tensor cos_table, Tensor sin_table, Tensor fc, Tensor fc_bias, Tensor q, Tensor k, Tensor v, int[] qkv_outs, "
        "int D, Tensor(a!) cache_k, Tensor(b!) cache_v, int window, float scale, Tensor o, Tensor norm, float eps, "
        "Tensor? router, Tensor[] experts, int[] mix_outs, int top_k, int branch) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("draft_tree(Tensor root_a, Tensor root_b, Tensor root_experts, Tensor root_gates, Tensor root_token, "
        "Tensor head_screen, Tensor head_scales, int head_rows, Tensor d2t, int[] steps, int K, int m, bool decoupled, "
        "int select, bool mixture, int per_expert, int base, Tensor embed, Tensor cos_table, Tensor sin_table, "
        "Tensor fc, Tensor fc_bias, Tensor q, Tensor k, Tensor v, int[] qkv_outs, int D, Tensor(a!) cache_k, "
        "Tensor(b!) cache_v, int window, float scale, Tensor o, Tensor norm, float eps, Tensor? router, "
        "Tensor[] experts, int[] mix_outs, int top_k, int branch) -> (Tensor, Tensor, Tensor, Tensor, Tensor, int)");
}
TORCH_LIBRARY_IMPL(jakiro_stream_gemm, CPU, m) {
  m.impl("pack", pack);
  m.impl("pack_scaled", pack_scaled);
  m.impl("linear", linear);
  m.impl("rope", rope);
  m.impl("rms_norm", rms_norm);
  m.impl("kv_write", kv_write);
  m.impl("attend", attend);
  m.impl("argmax", argmax_rows);
  m.impl("pack_int8", pack_int8);
  m.impl("greedy_head", greedy_head);
  m.impl("int8_linear", int8_linear);
  m.impl("sampled_head", sampled_head);
  m.impl("gumbel_noise", gumbel_noise);
  m.impl("decoder_layers", decoder_layers);
  m.impl("draft_qkv", draft_qkv);
  m.impl("draft_mix", draft_mix);
  m.impl("draft_children", draft_children);
  m.impl("draft_step", draft_step);
  m.impl("draft_tree", draft_tree);
}
TORCH_LIBRARY_IMPL(jakiro_stream_gemm, Meta, m) {
  m.impl("linear", linear_meta);
  m.impl("rope", rope_meta);
  m.impl("rms_norm", rms_norm_meta);
  m.impl("attend", attend_meta);
  m.impl("argmax", argmax_meta);
  m.impl("greedy_head", greedy_head_meta);
  m.impl("int8_linear", int8_linear_meta);
  m.impl("draft_qkv", draft_qkv_meta);
  m.impl("draft_mix", draft_mix_meta);
  m.impl("draft_children", draft_children_meta);
}
