"""The attention's scores from keys laid out in lanes (each block of 16 keys stored [D][16], so a vector holds one
dimension of 16 keys): per block and query, the sixteen lane partials by key_sums' chain order, then the fold tree's
sums as vector adds (s1 = P_i + P_(i+8), then i+4, i+2, i+1) in place of its shuffles; the outputs checked equal to the
package's bit for bit. Warm, one layer's shapes, 15 rounds of 200 calls alternating in random order, medians. The
keys' transposed copy is made outside the timed calls (a layout the cache would have to keep):

    python reports/measured/2026-12-02-attention-cold-cpu-zen5/lanes.py > reports/measured/2026-12-02-attention-cold-cpu-zen5/lanes.txt
"""
import random, statistics, time
import torch
from jakiro_lib.models import kernels
from kernel_build import build
from jakiro_lib.machine import run_metadata
REPL = [
("namespace {\n", """namespace {
const float* g_kt = nullptr; const float* g_kbase = nullptr; int64_t g_kh = 0, g_ktb = 0;  // keys in lanes, set_kt
""", 1),
("""template <int DV>
void attend_queries(""", """// scores of one query q [DV L] against block b of 16 keys in lanes (kt: [D][16] of that block): lane-dim partials
// P_i (i < 16) by the key_sums chain order over c, then the fold's tree s1 = P_i + P_{i+8}, s2, s3, s4 as vector adds
template <int DV>
inline vec scores_t(const float* q, const float* ktb) {
  vec P[L];
  for (int i = 0; i < L; ++i) {
    vec t{};
    for (int c = 0; c < DV; ++c) t += q[c * L + i] * load(ktb + (c * L + i) * L);
    P[i] = t;
  }
  for (int i = 0; i < 8; ++i) P[i] = P[i] + P[i + 8];
  for (int i = 0; i < 4; ++i) P[i] = P[i] + P[i + 4];
  for (int i = 0; i < 2; ++i) P[i] = P[i] + P[i + 2];
  return P[0] + P[1];
}
template <int DV>
void attend_queries(""", 1),
("""    for (int64_t i = 0; i < P; ++i) {
      vec x = scores<DV>(q[i], k, ks, j0, S) * scale;""", """    const float* ktb = g_kt == nullptr ? nullptr : g_kt + ((k - g_kbase) / g_kh) * g_ktb + j0 * DV * L;
    for (int64_t i = 0; i < P; ++i) {
      vec x = (ktb != nullptr ? scores_t<DV>(q[i], ktb) : scores<DV>(q[i], k, ks, j0, S)) * scale;""", 1),
("TORCH_LIBRARY(jakiro_stream_gemm, m) {", """TORCH_LIBRARY(jakiro_stream_gemm, m) {
  m.def("set_kt(Tensor kt, Tensor k) -> int", +[](const at::Tensor& kt, const at::Tensor& k) -> int64_t {
    if (!kt.defined() || kt.numel() == 0) { g_kt = nullptr; return 0; }
    g_kt = kt.data_ptr<float>(); g_kbase = k.data_ptr<float>(); g_kh = k.stride(1); g_ktb = kt.stride(0); return 1; });""", 1),
]
if __name__ == "__main__":
    torch.set_grad_enabled(False)
    assert kernels.stream_gemm_available()
    var = build("jsg_lanes", [(old, new) for old, new, _ in REPL])
    print(run_metadata(torch.device("cpu")), flush=True)
    pkg = torch.ops.jakiro_stream_gemm
    for S in (300, 800):
        for n in (1, 3, 8):
            q = torch.randn(1, 9, n, 64); k = torch.randn(1, 3, S, 64); v = torch.randn(1, 3, S, 64)
            mask = torch.where(torch.rand(1, 1, n, S) < 0.1, -1e30, 0.0) if n > 1 else None
            Sp = (S + 15) // 16 * 16
            kt = torch.nn.functional.pad(k[0], (0, 0, 0, Sp - S)).reshape(3, Sp // 16, 16, 64).transpose(2, 3).contiguous()
            ref = pkg.attend(q, k, v, mask, 0.125)
            var.set_kt(kt, k)
            got = var.attend(q, k, v, mask, 0.125)
            assert torch.equal(got, ref), (S, n, (got - ref).abs().max())
            t = {"package": [], "lanes": []}
            for r in range(15):
                for name in random.sample(list(t), 2):
                    op = pkg if name == "package" else var
                    t0 = time.perf_counter()
                    for _ in range(200): op.attend(q, k, v, mask, 0.125)
                    t[name].append((time.perf_counter() - t0) / 200)
            a, b = statistics.median(t["package"]), statistics.median(t["lanes"])
            print(f"S {S} rows {n}: package {a*1e6:.1f} us, keys in lanes {b*1e6:.1f} us ({a/b:.3f}x), bit for bit equal", flush=True)
