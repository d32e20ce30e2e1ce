"""What an 8-token Jakiro cycle cannot cost less than on this machine, part by part: the floors of its two largest
parts measured here, beside what the cycle-cost table measured for them.

- The target's linears at n rows: the simplest kernels that stream the same bytes (a panel-packed fp32 weight the
  size of the default target's linear panels, K = 576) with n rows of multiply-adds per weight (`stream.cpp`: a
  grid of blockings and prefetch distances, 2 threads), beside the package's streaming GEMM on the same panels, in
  interleaved rounds; their 8-row rise over one row is the floor of the linears' rise in T(8).
- The draft's side of a cycle: the bytes its forwards must read (the draft layer's bf16 linears, the reduced head's
  int8 copy), once from memory (the target's 453 MB stream evicts them every cycle) and then from the last-level
  cache, at the read rates measured here (a 1 GiB and a 32 MB fp32 sum), with the forwards and head calls of the
  method's tree (`draft_schedule`).

    python reports/measured/2026-12-01-cycle-bounds-cpu/bounds.py --run-dir runs/default \
        --out reports/measured/2026-12-01-cycle-bounds-cpu
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from jakiro_lib.config import TreeConfig
from jakiro_lib.decoding.drafting import draft_schedule
from jakiro_lib.machine import run_metadata
from jakiro_lib.models import kernels
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

HERE = Path(__file__).resolve().parent
K = 576
# (rows, panels a block, prefetch bytes ahead); rows 0: read only
KERNELS = [(0, 0, 0), (1, 6, 2048), (1, 6, 0), (1, 4, 2048), (8, 3, 2048), (8, 3, 0), (8, 3, 1024), (8, 3, 4096),
           (8, 2, 2048), (8, 4, 2048), (8, 1, 2048)]
JAKIRO_TREE = TreeConfig(depth=4, top_k=3, total_tokens=8, decoupled=True)  # the default profile's jakiro


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=41)
    args = ap.parse_args()
    assert kernels.stream_gemm_available()
    ops = torch.ops.jakiro_stream_gemm
    with tempfile.TemporaryDirectory() as build:
        stream = cpp_extension.load(name="cycle_bounds_stream", sources=[str(HERE / "stream.cpp")],
                                    extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                                    build_directory=build)
    target = load_target(get_profile("default").target)
    model = target.model
    linears = [x for layer in model.model.layers for x in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    panel_bytes = sum(x._jakiro_packed.numel() * x._jakiro_packed.element_size() for x in linears)
    draft = DraftModel.load(args.run_dir / "drafts" / "moe2_xgate" / "draft", model, dtype="bfloat16")
    layer_bytes = sum(m._jakiro_packed.numel() * m._jakiro_packed.element_size() for m in draft.modules()
                      if isinstance(m, torch.nn.Linear))  # the bf16 panels its forwards stream
    head_rows = draft.head_weight().shape[0]
    head_bytes = head_rows * draft.head_weight().shape[1]  # int8
    steps = draft_schedule(draft, JAKIRO_TREE)
    del target, model, linears, draft

    P = panel_bytes // (K * 16 * 4) // 12 * 12
    panels = torch.randn(P, K, 16)
    x = torch.randn(8, K)
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB, past any cache here
    layer, head = torch.ones(layer_bytes // 4), torch.ones(head_bytes // 4)  # the draft's bytes, as fp32 sums
    # a cycle's reads in order: the accepted path's forward, the root's head call, then a forward and its head call
    # for each later step
    reads = ["layer", "head"] * len(steps)
    parts = {"layer": layer, "head": head}
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    times: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        times.setdefault(name, []).append(seconds)

    for _ in range(3):
        ops.linear(x, panels, P * 16), stream.run(x, panels, 1, 6, 2048)
    for r in range(args.rounds):
        add("read 1 GiB", timed(lambda: big.sum()))
        add("draft reads after the stream", sum(timed(parts[part].sum) for part in reads))
        add("sgemm 2048", timed(lambda: torch.mm(a, b)))
        order = KERNELS if r % 2 == 0 else KERNELS[::-1]
        for m, nb, pf in order:
            add(f"simple M={m} NB={nb} PF={pf}", stream.run(x, panels, m, nb, pf))
        for m in ((1, 8) if r % 2 == 0 else (8, 1)):
            add(f"package M={m}", timed(lambda: ops.linear(x[:m], panels, P * 16)))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    nbytes = P * K * 16 * 4
    one_row = times["package M=1"]  # each kernel's time over the package's one-row time of the same round

    def rise(name: str) -> float:
        return statistics.median(t / t1 for t, t1 in zip(times[name], one_row))

    kernels_rows = [{"kernel": name, "median_ms": 1e3 * med[name], "min_ms": 1e3 * min(times[name]),
                     "gb_per_s": nbytes / med[name] / 1e9, "over_package_one_row": rise(name)}
                    for name in times if " M=" in name]
    simple8 = min((r for r in kernels_rows if r["kernel"].startswith("simple M=8 ")), key=lambda r: r["median_ms"])
    result = {
        "read_gb_per_s_1gib": big.numel() * 4 / med["read 1 GiB"] / 1e9,
        "sgemm_gflop_per_s": 2 * 2048 ** 3 / med["sgemm 2048"] / 1e9,
        "panel_bytes_streamed": nbytes, "target_linear_panel_bytes": panel_bytes,
        "package_rise_8": rise("package M=8"), "simple_best_m8": simple8["kernel"],
        "simple_best_rise_8": simple8["over_package_one_row"],
        "draft_layer_bytes_bf16": layer_bytes, "draft_head_bytes_int8": head_bytes, "draft_head_rows": head_rows,
        "jakiro_tree": str(JAKIRO_TREE), "draft_steps": steps, "draft_reads": reads,
        "draft_reads_ms": 1e3 * med["draft reads after the stream"],
        "draft_reads_over_one_row_pass": rise("draft reads after the stream"),  # over the package's 425 MB at 1 row
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bounds.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "kernels.json").write_text(json.dumps({"rows": kernels_rows, "all_seconds": times}, indent=2) + "\n")
    config = {"rounds": args.rounds, "run_dir": str(args.run_dir), "kernels": KERNELS,
              "environment": run_metadata(torch.device("cpu"), threads=torch.get_num_threads())}
    (args.out / "bounds_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    for row in kernels_rows:
        print(f"{row['kernel']:28s} median {row['median_ms']:7.2f} ms  min {row['min_ms']:7.2f}  "
              f"{row['gb_per_s']:5.1f} GB/s  x package M=1 {row['over_package_one_row']:.3f}")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
