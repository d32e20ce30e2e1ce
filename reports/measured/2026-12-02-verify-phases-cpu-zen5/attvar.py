"""The attention kernel: the package against variants, warm, one layer's shapes, alternating."""
import random, statistics, sys, tempfile, time
from pathlib import Path
import torch
from torch.utils import cpp_extension
from jakiro_lib.models import kernels
SOURCE = (Path(kernels.__file__).parent / "stream_gemm.cpp").read_text()

SUM_OUT = [
 ("""  for (int i = 0; i < C; ++i) {
    sum[i] = total[i];
    for (int c = 0; c < DV; ++c) acc[i][c] = load(out[i] + c * L);""",
  """  for (int i = 0; i < C; ++i) {
    for (int c = 0; c < DV; ++c) acc[i][c] = load(out[i] + c * L);"""),
 ("""      const float x = w[i * stride + j];
      sum[i] += x;
""", """      const float x = w[i * stride + j];
"""),
 ("""  for (int i = 0; i < C; ++i) {
    total[i] = sum[i];
    for (int c = 0; c < DV; ++c) store(out[i] + c * L, acc[i][c]);""",
  """  for (int i = 0; i < C; ++i) {
    for (int c = 0; c < DV; ++c) store(out[i] + c * L, acc[i][c]);"""),
 ("""  std::vector<float> total(P, 0.0f);
  for (int64_t j0 = 0; j0 < S; j0 += L) {""",
  """  std::vector<float> total(P, 0.0f);
  for (int64_t i0 = 0; i0 < P; i0 += 8) {  // each query's sum of its weights, in key order, 8 queries' chains at once
    const int64_t c = std::min<int64_t>(8, P - i0);
    float t[8] = {};
    const float* w0 = s + i0 * Sp;
    if (c == 8) {
      for (int64_t j = 0; j < S; ++j)
        for (int i = 0; i < 8; ++i) t[i] += w0[i * Sp + j];
    } else {
      for (int64_t j = 0; j < S; ++j)
        for (int64_t i = 0; i < c; ++i) t[i] += w0[i * Sp + j];
    }
    for (int64_t i = 0; i < c; ++i) total[i0 + i] = t[i];
  }
  for (int64_t j0 = 0; j0 < S; j0 += L) {"""),
]
VARIANTS = {"sumout": SUM_OUT}

def build(name):
    source = SOURCE.replace("jakiro_stream_gemm", f"jsg_{name}")
    for old, new in VARIANTS[name]:
        assert old in source, old
        source = source.replace(old, new)
    folder = tempfile.mkdtemp(); (Path(folder) / f"{name}.cpp").write_text(source)
    cpp_extension.load(name=f"jsg_{name}", sources=[str(Path(folder) / f"{name}.cpp")], is_python_module=False,
                       build_directory=folder, extra_cflags=list(kernels.STREAM_FLAGS), extra_ldflags=["-fopenmp"])
    return getattr(torch.ops, f"jsg_{name}")

if __name__ == "__main__":
    names = sys.argv[1].split(",")
    assert kernels.stream_gemm_available()
    ops = {"package": torch.ops.jakiro_stream_gemm, **{n: build(n) for n in names}}
    S = 300
    for n in (1, 3, 8, 12):
        q = torch.randn(1, 9, n, 64); k = torch.randn(1, 3, S, 64); v = torch.randn(1, 3, S, 64)
        mask = torch.where(torch.rand(1, 1, n, S) < 0.1, -1e30, 0.0) if n > 1 else None
        ref = ops["package"].attend(q, k, v, mask, 0.125)
        for name in names:
            assert torch.equal(ops[name].attend(q, k, v, mask, 0.125), ref), (name, n)
        t = {name: [] for name in ops}
        for r in range(15):
            for name in random.sample(list(ops), len(ops)):
                op = ops[name]
                t0 = time.perf_counter()
                for _ in range(200): op.attend(q, k, v, mask, 0.125)
                t[name].append((time.perf_counter() - t0) / 200)
        base = statistics.median(t["package"])
        print(n, "package", f"{base*1e6:.1f} us", *(f"{name} {statistics.median(t[name])*1e6:.1f} us ({base/statistics.median(t[name]):.3f}x)" for name in names))
