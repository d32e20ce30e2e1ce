"""Where the default target's verify forward goes once its layers run in one call (`decoder_layers`), beside this
machine's bounds: T(1) and T(8) as eager greedy decoding runs them (a host position, the screened head), and their
parts timed alone with the same shapes, in interleaved rounds: the 210 linears on the streaming GEMM (random rows,
the target's panels), the head's screen (`greedy_head`), the attention kernel over the cache (30 layers) and the
layers' elementwise work (two norms, RoPE, SiLU and product, two residual adds; 30 layers); the rest is T(n) less
those. Bounds: a 1 GiB fp32 sum's read rate, MKL's sgemm on 2048 x 2048 (near the cores' fp32 FMA peak); the bytes a
forward must read (the linears' fp32 panels and the head's int8 screen) and the multiply-adds of n rows.

    python reports/measured/2026-11-30-verify-parts-tiles-cpu/parts.py --out reports/measured/2026-11-30-verify-parts-tiles-cpu
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

ROWS = (1, 8)
CONTEXT = 300


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    target = load_target(get_profile("default").target)
    model, cfg = target.model, target.model.config
    ops = torch.ops.jakiro_stream_gemm
    assert kernels.stream_gemm_available() and model.__dict__[fast_paths.SCREEN] is not None
    linears = [x for layer in model.model.layers for x in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    assert all(x.__dict__.get("_jakiro_packed") is not None for x in linears), "the linears are not packed"
    panel_bytes = sum(x._jakiro_packed.numel() * x._jakiro_packed.element_size() for x in linears)
    screen = model.__dict__[fast_paths.SCREEN]
    screen_bytes = screen[0].numel() * screen[0].element_size()
    params = sum(x.weight.numel() for x in linears)
    H, D, L = cfg.hidden_size, model.model.layers[0].self_attn.head_dim, cfg.num_hidden_layers
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    g = torch.Generator().manual_seed(0)
    runner = TargetRunner(model, CONTEXT + 64)
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB, past any cache here
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    parts: dict[str, dict[int, list[float]]] = {}

    def add(name: str, n: int, seconds: float) -> None:
        parts.setdefault(name, {r: [] for r in ROWS})[n].append(seconds)

    with torch.inference_mode():
        runner.prefill(torch.randint(0, cfg.vocab_size, (CONTEXT,), generator=g))
        trees = {n: bushy_tree(n, torch.device("cpu")) for n in ROWS}
        inputs = {n: (torch.randn(1, n, H, generator=g), torch.randn(1, n, cfg.intermediate_size, generator=g))
                  for n in ROWS}
        q = {n: torch.randn(1, heads, n, D, generator=g) for n in ROWS}
        k, v = (torch.randn(1, kv, CONTEXT + max(ROWS), D, generator=g) for _ in range(2))
        cos, sin = torch.randn(1, 1, max(ROWS), D, generator=g), torch.randn(1, 1, max(ROWS), D, generator=g)
        norm = torch.rand(H, generator=g)
        for n in ROWS:  # warm-up
            tokens, depths, anc = trees[n]
            runner.score(tokens, depths, anc if n > 1 else None, CONTEXT, True)
        for r in range(args.rounds):
            add("read_gb_per_s", 1, big.numel() * 4 / timed(lambda: big.sum()) / 1e9)
            add("sgemm_gflop_per_s", 1, 2 * 2048 ** 3 / timed(lambda: torch.mm(a, b)) / 1e9)
            for n in (ROWS if r % 2 == 0 else ROWS[::-1]):
                tokens, depths, anc = trees[n]
                add("T(n)", n, timed(lambda: runner.score(tokens, depths, anc if n > 1 else None, CONTEXT, True)))
                x, xi = inputs[n]
                add("linears", n, timed(lambda: [ops.linear(xi if lin.in_features != H else x, lin._jakiro_packed,
                                                            lin.out_features) for lin in linears]))
                add("head screen", n, timed(lambda: ops.greedy_head(x[0], *screen, model.lm_head.weight)))
                mask = torch.zeros(1, 1, n, CONTEXT + n) if n > 1 else None
                add("attention", n, timed(lambda: [ops.attend(q[n], k[:, :, :CONTEXT + n], v[:, :, :CONTEXT + n],
                                                              mask, D ** -0.5) for _ in range(L)]))

                def elementwise() -> None:
                    for _ in range(L):
                        h = x + ops.rms_norm(x, norm, 1e-5)
                        ops.rope(q[n], k[:, :, :n], cos[:, :, :n], sin[:, :, :n])
                        h = h + ops.rms_norm(h, norm, 1e-5)
                        F.silu(xi) * xi
                add("elementwise", n, timed(elementwise))
    med = {name: {n: statistics.median(xs) for n, xs in by.items() if xs} for name, by in parts.items()}
    read, peak = med["read_gb_per_s"][1], med["sgemm_gflop_per_s"][1]
    rows = []
    for n in ROWS:
        t = med["T(n)"][n]
        timed_parts = {p: med[p][n] for p in ("linears", "head screen", "attention", "elementwise")}
        rows.append({"n": n, "T_ms": 1e3 * t, "T_over_T1": t / med["T(n)"][1],
                     **{f"{p.replace(' ', '_')}_ms": 1e3 * s for p, s in timed_parts.items()},
                     "rest_ms": 1e3 * (t - sum(timed_parts.values())),
                     "read_bound_ms": 1e3 * (panel_bytes + screen_bytes) / (read * 1e9),
                     "fma_bound_ms": 1e3 * 2 * params * n / (peak * 1e9)})
    table = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "parts.csv", index=False)
    print(table.round(3).to_string(index=False))
    machine = {"read_gb_per_s": read, "read_gb_per_s_all": parts["read_gb_per_s"][1],
               "sgemm_gflop_per_s": peak, "panel_bytes": panel_bytes, "screen_bytes": screen_bytes,
               "linear_params": params, "threads": torch.get_num_threads()}
    print(json.dumps({k: v for k, v in machine.items() if not isinstance(v, list)}))
    (args.out / "machine.json").write_text(json.dumps(machine, indent=2) + "\n")
    meta = run_metadata(model.device)
    meta.update(script="parts.py", rounds=args.rounds, rows=list(ROWS), context=CONTEXT, gemm=kernels.gemm_choice(model))
    (args.out / "parts_config.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
