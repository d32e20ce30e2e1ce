"""What fusing the target's projections would buy in its verify forward, T(n) at 1, 2, 4 and 8 rows: q, k and v of
each layer as one streamed GEMM over their weights stacked, gate and up likewise, against the package's separate
calls. The fused calls are made here by a stand-in for measurement only: the first projection of a group computes the
group's GEMM and keeps the other outputs for the next calls with the same input (transformers calls q, k, v and gate,
up in that order); each output column is the same FMAs as in its own call, so the forward's outputs are bit for bit
the same (checked below). T(n) as the cycle-cost table times it (jakiro_lib.measure.costmodel, 256-token context,
the variants interleaved round by round).

    python reports/measured/2026-11-29-fused-projections-cpu/fused.py --out reports/measured/2026-11-29-fused-projections-cpu

Writes fused.csv (per n: T(n) separate and fused, fused / separate, T(n) / T(1) for each) and fused_config.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import types
from pathlib import Path

import pandas as pd
import torch

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import measure_target_cost_variants
from jakiro_lib.models import kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.study.context import resolve_profile

SIZES = (1, 2, 4, 8)
FUSED = {"on": False}


def fuse(group: list[torch.nn.Linear]) -> None:
    """The stand-in: ``group``'s first linear computes all of them while FUSED is on."""
    weight = torch.cat([m.weight for m in group]).detach()
    packed = torch.ops.jakiro_stream_gemm.pack(weight, False)
    sizes = [m.weight.shape[0] for m in group]
    kept: dict[str, object] = {}

    def first(self, x):
        if not FUSED["on"]:
            return kernels._packed_linear_forward(self, x)
        rows = x.numel() // x.shape[-1]
        y = torch.ops.jakiro_stream_gemm.linear(x.reshape(rows, x.shape[-1]), packed, weight.shape[0])
        kept["x"], kept["parts"] = x, y.reshape(*x.shape[:-1], -1).split(sizes, -1)
        return kept["parts"][0]

    def later(i):
        def forward(self, x):
            if FUSED["on"] and kept.get("x") is x:
                return kept["parts"][i]
            return kernels._packed_linear_forward(self, x)
        return forward

    group[0].forward = types.MethodType(first, group[0])
    for i, m in enumerate(group[1:], 1):
        m.forward = types.MethodType(later(i), m)


@contextlib.contextmanager
def fused():
    FUSED["on"] = True
    try:
        yield
    finally:
        FUSED["on"] = False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args()
    profile = resolve_profile("default", {})
    target = load_target(profile.target)
    model = target.model
    gemm = kernels.packed_gemm(model)
    assert gemm is not None and gemm.backend == "stream", "needs the streaming GEMM"
    for layer in model.model.layers:
        fuse([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
        fuse([layer.mlp.gate_proj, layer.mlp.up_proj])
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        plain = model(ids).logits
        with fused():
            assert torch.equal(model(ids).logits, plain), "the fused forward is not the same bit for bit"
    table = measure_target_cost_variants(model, SIZES, {"separate": contextlib.nullcontext, "fused": fused},
                                         context=256, repeats=args.repeats)
    rows = [{"n": n, "separate_ms": round(1e3 * t["separate"], 2), "fused_ms": round(1e3 * t["fused"], 2),
             "fused_over_separate": round(t["fused"] / t["separate"], 3),
             "separate_x1": round(t["separate"] / table[1]["separate"], 3),
             "fused_x1": round(t["fused"] / table[1]["fused"], 3)} for n, t in table.items()]
    frame = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "fused.csv", index=False)
    config = {"sizes": SIZES, "context": 256, "repeats": args.repeats, "threads": torch.get_num_threads(),
              "gemm": {"backend": gemm.backend, "min_rows": gemm.min_rows}, **run_metadata()}
    (args.out / "fused_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    print(frame.to_string(index=False))


if __name__ == "__main__":
    main()
