"""What the attention of a verify forward's rows costs on this machine, and what other formulations of the same
arithmetic cost beside it: the package's kernel (`stream_gemm.cpp`, `attend_queries`) against two variants of it built
here (variants.inc: queries scored four at a time, bit-identical; keys stored transposed by blocks, a cache layout the
package does not have), PyTorch's SDPA and the same arithmetic as MKL's batched GEMMs (with and without the softmax
between them), at 1 and 8 rows over the default target's shapes (9 query heads, 3 KV heads, 64 dimensions, a
300-token cache, 30 layers' distinct keys and values). Each is timed right after a 512 MB stream ("cold", as in the
forward, where the layers' weights stream between two layers' attention) and again at once ("hot"), in interleaved
rounds; the arithmetic's bound is sgemm's rate measured alongside. Outputs: the interleaved variant equal to the
package's bit for bit, every method within 1e-5 of SDPA, each row independent of the rows beside it (asserted).

    python reports/measured/2026-12-01-attention-bounds-cpu/attention.py \\
        --out reports/measured/2026-12-01-attention-bounds-cpu
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

from jakiro_lib.machine import run_metadata
from jakiro_lib.models import kernels

SOURCE = "jakiro_lib/models/stream_gemm.cpp"
HERE = Path(__file__).parent
NAMESPACE = "attention_variants"
LAYERS, HEADS, KV_HEADS, D, CONTEXT = 30, 9, 3, 64, 300


def build(commit: str) -> object:
    """The package's kernel file at ``commit`` with variants.inc added, under its own op namespace."""
    source = subprocess.run(["git", "show", f"{commit}:{SOURCE}"], capture_output=True, text=True,
                            check=True).stdout.replace("jakiro_stream_gemm", NAMESPACE)
    source = source.replace("#include <vector>", "#include <vector>\n#include <array>", 1)
    source = source.replace("}  // namespace\n\nTORCH_LIBRARY", (HERE / "variants.inc").read_text()
                            + "}  // namespace\n\nTORCH_LIBRARY", 1)
    source = source.replace(f"TORCH_LIBRARY({NAMESPACE}, m) {{", f"TORCH_LIBRARY({NAMESPACE}, m) {{\n"
                            '  m.def("interleaved(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");\n'
                            '  m.def("transposed(Tensor q, Tensor kt, Tensor v, float scale) -> Tensor");', 1)
    source = source.replace(f"TORCH_LIBRARY_IMPL({NAMESPACE}, CPU, m) {{", f"TORCH_LIBRARY_IMPL({NAMESPACE}, CPU, m) {{\n"
                            '  m.impl("interleaved", interleaved);\n  m.impl("transposed", transposed);', 1)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "variants.cpp"
        path.write_text(source)
        cpp_extension.load(name=NAMESPACE, sources=[str(path)], is_python_module=False, build_directory=folder,
                           extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    return getattr(torch.ops, NAMESPACE)


def transposed_keys(k: torch.Tensor) -> torch.Tensor:
    """Keys [1, Hk, S, D] as blocks of 16 positions stored [D][16]: [Hk, blocks, D, 16] (zeros past S)."""
    S = k.shape[2]
    padded = torch.zeros(1, k.shape[1], -(-S // 16) * 16, k.shape[3])
    padded[:, :, :S] = k
    return padded[0].view(k.shape[1], -1, 16, k.shape[3]).transpose(-1, -2).contiguous()


def cpu() -> dict:
    """The CPU's model name and the vector extensions that matter here, as /proc/cpuinfo gives them."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    flags = {f.strip() for f in fields.get("flags\t\t", "").split()} | set(fields.get("flags", "").split())
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16")
    return {"model": fields.get("model name\t", fields.get("model name", "")).strip(),
            "model_number": fields.get("model\t\t", "").strip(), "flags": [f for f in wanted if f in flags]}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--commit", default="HEAD")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", args.commit], capture_output=True, text=True,
                            check=True).stdout.strip()
    assert kernels.stream_gemm_available()
    variants, package = build(commit), torch.ops.jakiro_stream_gemm
    g = torch.Generator().manual_seed(0)
    scale = D ** -0.5
    caches = [(torch.randn(1, KV_HEADS, CONTEXT, D, generator=g), torch.randn(1, KV_HEADS, CONTEXT, D, generator=g))
              for _ in range(LAYERS)]
    turned = [transposed_keys(k) for k, _ in caches]
    queries = {n: torch.randn(1, HEADS, n, D, generator=g) for n in (1, 8)}
    group = HEADS // KV_HEADS

    def library(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax: bool = True) -> torch.Tensor:
        """The same arithmetic as MKL's batched GEMMs: [Hk, G n, D] x [Hk, D, S], softmax, x [Hk, S, D]."""
        n = q.shape[2]
        s = torch.matmul(q.view(KV_HEADS, group * n, D), k[0].transpose(1, 2)) * scale
        p = s.softmax(-1) if softmax else s
        return torch.matmul(p, v[0]).view(1, HEADS, n, D)

    methods = {
        "package": lambda q, i: package.attend(q, *caches[i], None, scale),
        "interleaved": lambda q, i: variants.interleaved(q, *caches[i], scale),
        "transposed keys": lambda q, i: variants.transposed(q, turned[i], caches[i][1], scale),
        "sdpa": lambda q, i: F.scaled_dot_product_attention(q, *caches[i], scale=scale, enable_gqa=True),
        "mkl gemms and softmax": lambda q, i: library(q, *caches[i]),
        "mkl gemms alone": lambda q, i: library(q, *caches[i], softmax=False),
    }
    layout = {"package": True, "interleaved": True, "transposed keys": True}  # [1, n, Hq, D]; the rest [1, Hq, n, D]
    with torch.inference_mode():
        for n, q in queries.items():  # the outputs
            ref = F.scaled_dot_product_attention(q, *caches[0], scale=scale, enable_gqa=True)
            outs = {name: fn(q, 0) for name, fn in methods.items()}
            outs = {name: (o.transpose(1, 2) if name in layout else o) for name, o in outs.items()}
            assert torch.equal(outs["package"], outs["interleaved"])
            for name in methods:
                if name != "mkl gemms alone":
                    assert (outs[name] - ref).abs().max() < 1e-5, name
            if n == 8:  # each row as it would be alone
                for name in ("package", "interleaved", "transposed keys"):
                    for r in range(n):
                        alone = methods[name](q[:, :, r:r + 1].contiguous(), 0).transpose(1, 2)
                        assert torch.equal(alone[:, :, 0], outs[name][:, :, r]), (name, r)
        big = torch.ones(128 * 1024 * 1024)
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
        times: dict[str, list[float]] = {}
        for r in range(args.rounds):
            times.setdefault("sgemm_gflop_per_s", []).append(2 * 2048 ** 3 / timed(lambda: torch.mm(a, b)) / 1e9)
            names = list(methods) if r % 2 == 0 else list(methods)[::-1]
            for n in ((1, 8) if r % 2 == 0 else (8, 1)):
                q = queries[n]
                for name in names:
                    fn = methods[name]
                    big.sum()
                    times.setdefault(f"{name}|{n}|cold", []).append(timed(lambda: [fn(q, i) for i in range(LAYERS)]))
                    times.setdefault(f"{name}|{n}|hot", []).append(timed(lambda: [fn(q, i) for i in range(LAYERS)]))
    peak = statistics.median(times["sgemm_gflop_per_s"])
    rows = []
    for name in methods:
        row = {"method": name}
        for when in ("cold", "hot"):
            for n in (1, 8):
                row[f"{when}_{n}_ms"] = 1e3 * statistics.median(times[f"{name}|{n}|{when}"])
            row[f"{when}_rise_ms"] = row[f"{when}_8_ms"] - row[f"{when}_1_ms"]
        rows.append(row)
    flops = {n: 2 * 2 * LAYERS * HEADS * n * CONTEXT * D for n in (1, 8)}  # two products, a multiply-add each
    bound = {n: 1e3 * flops[n] / (peak * 1e9) for n in (1, 8)}
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"rows": rows, "sgemm_gflop_per_s": peak, "fma_bound_ms": bound, "commit": commit,
              "all_rounds": {k: v for k, v in times.items()}}
    (args.out / "attention.json").write_text(json.dumps(result, indent=2) + "\n")
    config = {"rounds": args.rounds, "commit": commit, "layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS,
              "head_dim": D, "context": CONTEXT, "cpu": cpu(),
              "environment": run_metadata(torch.device("cpu"), threads=torch.get_num_threads())}
    (args.out / "attention_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    print(f"sgemm {peak:.0f} GFLOP/s; the arithmetic at that rate: 1 row {bound[1]:.3f} ms, 8 rows {bound[8]:.3f} ms")
    for row in rows:
        print(f"{row['method']:22s} cold 1 {row['cold_1_ms']:6.3f}  8 {row['cold_8_ms']:6.3f}  rise "
              f"{row['cold_rise_ms']:6.3f} | hot 1 {row['hot_1_ms']:6.3f}  8 {row['hot_8_ms']:6.3f}  rise "
              f"{row['hot_rise_ms']:6.3f} ms")


if __name__ == "__main__":
    main()
