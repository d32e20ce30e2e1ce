"""Phase times inside decoder_layers at 1 and 8 rows: the package's kernel file with timers added at each phase's end
(the calling thread's wall clock), built under its own op namespace and swapped in; each forward after a 256 MB write
(so each starts cold, and the host's work outside the layers pays the write-back), interleaved, medians.

    python reports/measured/2026-12-02-verify-phases-cpu-zen5/phases.py 30 > phases.txt
"""
import random, statistics, sys, tempfile, time
from pathlib import Path
import torch
from torch.utils import cpp_extension
from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

src = (Path(kernels.__file__).parent / "stream_gemm.cpp").read_text().replace("jakiro_stream_gemm", "jsg_t")
head = "at::Tensor decoder_layers(const at::Tensor& hidden,"
timers = """
static double g_phase[9];
static inline double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
at::Tensor phase_times() { at::Tensor t = at::empty({9}, at::kDouble); for (int i = 0; i < 9; ++i) { t.data_ptr<double>()[i] = g_phase[i]; g_phase[i] = 0; } return t; }
"""
src = src.replace(head, timers + head, 1)
body_start = src.index(head)
body = src[body_start:src.index("\n}\n", body_start)]
new = body
marks = [
 ("    norm_rows(hp, w[0].data_ptr<float>(), x, n, H, eps);\n", 0),
 ("    linears_rows(x, n, H, {&w[1], &w[2], &w[3]}, {Q, KV, KV}, {q, k, v});\n", 1),
 ("    write_rows(v, D, KV, values, cap * D, D, Hk, n, D, start, nullptr);\n", 2),
 ("      std::memcpy(att, out.data_ptr<float>(), n * Q * sizeof(float));\n    }\n", 3),
 ("    linear_rows(att, w[4], n, Q, H, y);\n", 4),
 ("    add_rows(hp, y, n * H);\n    norm_rows(hp, w[5].data_ptr<float>(), x, n, H, eps);\n", 5),
 ("    swiglu_rows(x, w[6], w[7], w[8], n, H, I, gate_rows, up_rows, y);\n", 6),
]
for text, i in marks:
    assert text in new, text
    new = new.replace(text, text + f"    {{ double t_ = now_s(); g_phase[{i}] += t_ - t_mark; t_mark = t_; }}\n", 1)
new = new.replace("  for (int64_t l = 0; l < layers; ++l) {\n    const at::Tensor* w = weights.data() + per * l;\n    norm_rows",
                  "  double t_mark = now_s();\n  for (int64_t l = 0; l < layers; ++l) {\n    const at::Tensor* w = weights.data() + per * l;\n    norm_rows", 1)
assert "double t_mark" in new
new = new.replace("    add_rows(hp, y, n * H);\n  }\n  return h;", "    add_rows(hp, y, n * H);\n    { double t_ = now_s(); g_phase[7] += t_ - t_mark; t_mark = t_; }\n  }\n  return h;")
assert "g_phase[7]" in new
src = src[:body_start] + new + src[body_start + len(body):]
src = src.replace('m.def("tile_screen() -> bool", tile_screen);', 'm.def("tile_screen() -> bool", tile_screen);\n  m.def("phase_times() -> Tensor", phase_times);', 1)
folder = tempfile.mkdtemp(); (Path(folder) / "t.cpp").write_text(src)
cpp_extension.load(name="jsg_t", sources=[str(Path(folder) / "t.cpp")], is_python_module=False, build_directory=folder,
                   extra_cflags=list(kernels.STREAM_FLAGS), extra_ldflags=["-fopenmp"])
torch.ops.jakiro_stream_gemm = torch.ops.jsg_t
fast_paths._kernels.clear()
torch.set_grad_enabled(False)
target = load_target(get_profile("default").target); model = target.model
CONTEXT = 300
g = torch.Generator().manual_seed(0)
runner = TargetRunner(model, 512); runner.prefill(torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=g))
trees = {n: bushy_tree(n, model.device) for n in (1, 8)}
big = torch.empty(64 * 2**20)
names = ["norm1", "qkv", "rope+write", "attend", "o", "add+norm2", "swiglu(gate,up,down)", "add"]
res = {n: [] for n in (1, 8)}; tot = {n: [] for n in (1, 8)}
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 30
for r in range(rounds + 1):
    for n in random.sample([1, 8], 2):
        big.add_(1.0)
        torch.ops.jsg_t.phase_times()
        tokens, depths, anc = trees[n]
        t0 = time.perf_counter()
        runner.score(tokens, depths, anc if n > 1 else None, CONTEXT, greedy=True)
        t = time.perf_counter() - t0
        p = torch.ops.jsg_t.phase_times()
        if r: res[n].append(p); tot[n].append(t)
for n in (1, 8):
    print(n, "T", f"{1e3*statistics.median(tot[n]):.2f}", "layers", f"{1e3*statistics.median([float(p[:8].sum()) for p in res[n]]):.2f}")
print("phase", "1 row ms", "8 rows ms", "rise")
for i, name in enumerate(names):
    a = 1e3 * statistics.median([float(p[i]) for p in res[1]]); b = 1e3 * statistics.median([float(p[i]) for p in res[8]])
    print(f"{name:24s} {a:7.3f} {b:7.3f} {b-a:+7.3f}")
