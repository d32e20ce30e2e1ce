"""Whether x / (1 + exp(-x)) with SLEEF's exp as libtorch_cpu exports it (Sleef_expf16_u10 on 16-float vectors, or
Sleef_expf8_u10 on 8 with --avx2) equals torch's silu bit for bit: 4M normal values at each of five scales and a
sweep of bit patterns every 4,099th of the 2^32 (NaN compared as NaN). Run under ATEN_CPU_CAPABILITY=avx512, avx2 or
default to see which of torch's CPU kernels agree (default, its scalar loop with the C library's exp, does not).

    python silu_probe.py [--avx2]
"""
import sys

import torch
from torch.utils.cpp_extension import load_inline

AVX2 = "--avx2" in sys.argv
W, T, E, P = (8, "__m256", "Sleef_expf8_u10", "_mm256") if AVX2 else (16, "__m512", "Sleef_expf16_u10", "_mm512")
SRC = f"""
#include <torch/extension.h>
#include <immintrin.h>
extern "C" {T} {E}({T});
at::Tensor sleef_silu(const at::Tensor& x_) {{
  at::Tensor x = x_.contiguous(), y = at::empty_like(x);
  const float* p = x.data_ptr<float>();
  float* q = y.data_ptr<float>();
  for (int64_t i = 0; i + {W} <= x.numel(); i += {W}) {{
    const {T} v = {P}_loadu_ps(p + i);
    const {T} e = {E}({P}_xor_ps(v, {P}_set1_ps(-0.0f)));
    {P}_storeu_ps(q + i, {P}_div_ps(v, {P}_add_ps({P}_set1_ps(1.0f), e)));
  }}
  return y;
}}
"""
m = load_inline("silu_probe" + ("_avx2" if AVX2 else ""), cpp_sources=SRC, functions=["sleef_silu"],
                extra_cflags=["-O3", "-march=haswell" if AVX2 else "-march=native"])
print("torch's CPU kernels:", torch.backends.cpu.get_cpu_capability(), "| ours:", E)
torch.manual_seed(0)
xs = [torch.randn(1 << 22) * s for s in (0.01, 1, 4, 20, 100)]
bits = torch.arange(0, 1 << 32, 4099, dtype=torch.int64).to(torch.int32).view(torch.float32)
xs.append(bits[: bits.numel() // 32 * 32])
for x in xs:
    a, b = torch.nn.functional.silu(x), m.sleef_silu(x)
    same = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
    print(f"{x.numel()} values, {int((~same).sum())} differ")
