"""What the parts of a drafted cycle cost on their own, on this CPU: the numbers behind the issue's breakdown.

A. The streaming GEMM's arithmetic rate, one thread, weights in cache (the default target's q/o shape, and a wider
   one) at 1-16 rows, beside MKL's sgemm on 1024 x 1024 x 1024, one thread: how fast 8 rows' FMAs can go at all.
B. SDPA as the target's layers call it (9 query heads over 3 KV heads of 64, a 300-position cache), one row with no
   mask (a plain step) and 2-16 rows under an additive tree mask (a verify forward), two threads.
C. The draft's head (8192 rows of the target's head in bf16 panels, fp32 arithmetic: the default "auto" draft
   precision here) at 1-6 rows, weights in cache; and one of the draft's 576 x 576 linears at 3 rows.
D. The trained Jakiro draft's forward (`moe2_xgate` of --run-dir) at 3 rows over a 300-position window, weights in
   cache and after a 600 MB sweep (as after a verify forward), and its parts.

    python reports/measured/2026-11-29-cycle-floor-cpu/floor.py --run-dir runs/default \
        --out reports/measured/2026-11-29-cycle-floor-cpu

Writes floor.csv (part, item, value, unit) and floor_config.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from jakiro_lib.decoding.static_tree import StaticKV
from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import cycle_methods
from jakiro_lib.models import kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.study.context import resolve_profile

ROWS: list[dict] = []


def per_call_us(f, n: int = 2000, warm: int = 100) -> float:
    for _ in range(warm):
        f()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t0) / n * 1e6


def add(part: str, item: str, value: float, unit: str) -> None:
    ROWS.append({"part": part, "item": item, "value": round(value, 3), "unit": unit})
    print(f"{part} {item}: {value:.3f} {unit}", flush=True)


@torch.inference_mode()
def part_a() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
        us = per_call_us(lambda: torch.mm(a, b), n=50, warm=5)
        add("A", "mkl sgemm 1024^3, 1 thread", 1024 ** 3 / us / 1e3, "GFMA/s")
        for n_out in (384, 1024):
            w = torch.randn(n_out, 576)
            packed = kernels.pack_weight(w, 64, "stream")
            for m in (1, 4, 8, 16):
                x = torch.randn(m, 576)
                us = per_call_us(lambda: torch.ops.jakiro_stream_gemm.linear(x, packed, n_out))
                add("A", f"stream fp32 [{n_out}x576] {m} rows, 1 thread", m * n_out * 576 / us / 1e3, "GFMA/s")
    finally:
        torch.set_num_threads(threads)


@torch.inference_mode()
def part_b() -> None:
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, 512, 64, generator=gen)[:, :, :300]  # a view of a larger cache, as the runner's
    v = torch.randn(1, 3, 512, 64, generator=gen)[:, :, :300]
    for n in (1, 2, 4, 8, 16):
        q = torch.randn(1, 9, n, 64, generator=gen)
        mask = None
        if n > 1:
            allowed = torch.ones(n, 300, dtype=torch.bool)
            allowed[:, 300 - n:] = torch.ones(n, n, dtype=torch.bool).tril()
            mask = torch.zeros(n, 300).masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
        us = per_call_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
        add("B", f"sdpa {n} rows{' (tree mask)' if n > 1 else ' (no mask)'}, 300 positions", us, "us a layer")


@torch.inference_mode()
def part_c(draft) -> None:
    w = draft.head_weight()
    packed = kernels.pack_weight(w.float(), 64, kernels.HALF_WEIGHTS)
    for m in (1, 2, 3, 6):
        x = torch.randn(m, 576)
        us = per_call_us(lambda: torch.ops.jakiro_stream_gemm.linear(x, packed, w.shape[0]), n=500)
        add("C", f"draft head [{w.shape[0]}x576] bf16 panels, {m} rows", us, "us")
        add("C", f"draft head {m} rows, rate", m * w.numel() / us / 1e3, "GFMA/s")
        add("C", f"draft head {m} rows, weight read", packed.numel() * 2 / us / 1e3, "GB/s")
    lin = draft.mlp.experts[0].gate_proj
    x = torch.randn(1, 3, 576)
    add("C", "a draft linear [576x576] at 3 rows (module call)", per_call_us(lambda: lin(x)), "us")


@torch.inference_mode()
def part_d(draft) -> None:
    cache = StaticKV(512)
    cache.window = 300
    cache.slots = torch.tensor([260, 261, 262])
    feats, toks, pos = torch.randn(1, 3, 576), torch.tensor([[5, 6, 7]]), torch.tensor([[250, 250, 250]])
    allowed = torch.ones(1, 1, 3, 300, dtype=torch.bool)

    def forward():
        return draft(feats, toks, pos, cache, allowed)

    add("D", "draft forward, 3 rows, weights in cache", per_call_us(forward, n=1000), "us")
    sweep = torch.randn(150_000_000)  # 600 MB: more than the 260 MB L3, as a verify forward's stream
    cold = []
    for _ in range(20):
        sweep.sum()
        t0 = time.perf_counter()
        forward()
        cold.append((time.perf_counter() - t0) * 1e6)
    add("D", "draft forward, 3 rows, after a 600 MB sweep (median of 20)", sorted(cold)[10], "us")
    z = torch.randn(1, 3, 576)
    cos_sin = draft.rotary(z, pos)
    add("D", "part: experts (2 x SwiGLU)", per_call_us(lambda: [e(z) for e in draft.mlp.experts]), "us")
    add("D", "part: MoE block (experts, router, gates, branch B)", per_call_us(lambda: draft.mlp(z, z)), "us")
    add("D", "part: attention (q, k, v, o, rope, cache, SDPA)", per_call_us(lambda: draft.attn(z, cos_sin, cache, allowed)), "us")
    add("D", "part: rotary cos/sin", per_call_us(lambda: draft.rotary(z, pos)), "us")
    add("D", "part: embed, concat, fc", per_call_us(
        lambda: draft.fc(torch.cat([draft.embed(toks).to(feats.dtype), feats], -1))), "us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    profile = resolve_profile("default", {"data.num_conversations": 800, "train.epochs": 2})
    target = load_target(profile.target)
    spec = cycle_methods(profile, args.run_dir, target, ["jakiro"])["jakiro"]
    draft = spec.load_draft(target)
    part_a()
    part_b()
    part_c(draft)
    part_d(draft)
    args.out.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(ROWS).to_csv(args.out / "floor.csv", index=False)
    config = {"run_dir": str(args.run_dir), "draft": spec.draft, "draft_dtype": spec.draft_dtype,
              "threads": torch.get_num_threads(), **run_metadata()}
    (args.out / "floor_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
