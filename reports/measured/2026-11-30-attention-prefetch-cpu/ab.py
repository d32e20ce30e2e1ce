"""The attention kernel's prefetch of the next block, side by side in one process: the package's kernels against the
same file at ``--before`` (built here under another op namespace), interleaved round by round. The target's layers
in one call (``decoder_layers``) are swapped between the two builds, so T(1) and T(8) are the verify forward as eager
greedy decoding runs it (a host position, the screened head, a 300-token cache, bushy trees); attention alone (30
layers' keys and values, distinct buffers) is timed right after a 512 MB stream ("cold") and again ("hot"). Outputs
are asserted equal bit for bit.

    python reports/measured/2026-11-30-attention-prefetch-cpu/ab.py --before d97a0af~1 \\
        --out reports/measured/2026-11-30-attention-prefetch-cpu
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
from torch.utils import cpp_extension

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

SOURCE = "jakiro_lib/models/stream_gemm.cpp"
BEFORE = "jakiro_sg_before"
CONTEXT = 300


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=61)
    args = ap.parse_args()
    assert kernels.stream_gemm_available()
    source = subprocess.run(["git", "show", f"{args.before}:{SOURCE}"], capture_output=True, text=True,
                            check=True).stdout.replace("jakiro_stream_gemm", BEFORE)
    with tempfile.TemporaryDirectory() as build:
        path = Path(build) / "before.cpp"
        path.write_text(source)
        cpp_extension.load(name="attention_prefetch_before", sources=[str(path)], is_python_module=False,
                           build_directory=build, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"])
    builds = {"before": getattr(torch.ops, BEFORE), "package": torch.ops.jakiro_stream_gemm}
    target = load_target(get_profile("default").target)
    model, cfg = target.model, target.model.config

    def use(name: str) -> None:  # the op fast_paths runs the layers with
        fast_paths._kernels["decoder_layers"] = (len(torch.ops.loaded_libraries), builds[name].decoder_layers)

    runner = TargetRunner(model, CONTEXT + 64)
    g = torch.Generator().manual_seed(0)
    D, heads, kv_heads = model.model.layers[0].self_attn.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    caches = [(torch.randn(1, kv_heads, CONTEXT + 8, D, generator=g), torch.randn(1, kv_heads, CONTEXT + 8, D,
               generator=g)) for _ in range(cfg.num_hidden_layers)]
    big = torch.ones(128 * 1024 * 1024)
    times: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        times.setdefault(key, []).append(seconds)

    with torch.inference_mode():
        runner.prefill(torch.randint(0, cfg.vocab_size, (CONTEXT,), generator=g))
        trees = {n: bushy_tree(n, torch.device("cpu")) for n in (1, 8)}

        def score(n: int) -> torch.Tensor:
            tokens, depths, anc = trees[n]
            return runner.score(tokens, depths, anc if n > 1 else None, CONTEXT, True)[0]

        queries = {n: torch.randn(1, heads, n, D, generator=g) for n in (1, 8)}
        masks = {1: None, 8: torch.zeros(1, 1, 8, CONTEXT + 8)}

        def attention(name: str, n: int) -> list[torch.Tensor]:
            return [builds[name].attend(queries[n], k, v, masks[n], D ** -0.5) for k, v in caches]

        for n in (1, 8):
            outs = {}
            for name in builds:
                use(name)
                outs[name] = (score(n), attention(name, n))
            assert torch.equal(outs["before"][0], outs["package"][0])
            assert all(torch.equal(a, b) for a, b in zip(outs["before"][1], outs["package"][1]))
        for r in range(args.rounds):
            order = list(builds) if r % 2 == 0 else list(builds)[::-1]
            for n in ((1, 8) if r % 2 == 0 else (8, 1)):
                for name in order:
                    use(name)
                    add(f"T({n}) {name}", timed(lambda: score(n)))
                    big.sum()
                    add(f"attention {n} cold {name}", timed(lambda: attention(name, n)))
                    add(f"attention {n} hot {name}", timed(lambda: attention(name, n)))
    use("package")
    rows = []
    for part in ("T(1)", "T(8)", "attention 1 cold", "attention 1 hot", "attention 8 cold", "attention 8 hot"):
        a, b = times[f"{part} before"], times[f"{part} package"]
        rows.append({"part": part, "before_ms": 1e3 * statistics.median(a), "package_ms": 1e3 * statistics.median(b),
                     "paired_ratio": statistics.median(y / x for x, y in zip(a, b)),
                     "package_faster_rounds": sum(y < x for x, y in zip(a, b)), "rounds": len(a)})
    ratio = {name: statistics.median(times[f"T(8) {name}"]) / statistics.median(times[f"T(1) {name}"])
             for name in builds}
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"rows": rows, "t8_over_t1": ratio, "before": args.before}
    (args.out / "ab.json").write_text(json.dumps(result, indent=2) + "\n")
    config = {"rounds": args.rounds, "before": args.before, "context": CONTEXT,
              "environment": run_metadata(torch.device("cpu"), threads=torch.get_num_threads())}
    (args.out / "ab_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    for row in rows:
        print(f"{row['part']:18s} before {row['before_ms']:7.3f} ms  package {row['package_ms']:7.3f} ms  "
              f"paired {row['paired_ratio']:.4f}  faster in {row['package_faster_rounds']}/{row['rounds']}")
    print("T(8)/T(1):", {k: round(v, 3) for k, v in ratio.items()})


if __name__ == "__main__":
    main()
