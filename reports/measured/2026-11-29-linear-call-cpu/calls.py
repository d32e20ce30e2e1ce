"""The Python around each packed linear call, before and after it was trimmed: T(n) of the default fp32 target at 1,
2, 4 and 8 rows with every nn.Linear's forward as at commit ddb2f4e ("before": the backend validated and the
parameters read through nn.Module's __getattr__ at each call, the rows flattened and restored in Python) or as in
the package ("after": the backend resolved once, the parameters from their dict, the streaming GEMM taking [..., in]
itself). The "before" forward is that commit's code, written out below; both run the same packed copies and kernel.
T(n) as the cycle-cost table times it (jakiro_lib.measure.costmodel: 256-token context, variants interleaved).

    python reports/measured/2026-11-29-linear-call-cpu/calls.py --out reports/measured/2026-11-29-linear-call-cpu

Writes calls.csv (per n: T(n) before and after, after / before) and calls_config.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import types
from pathlib import Path

import pandas as pd
import torch
import torch.nn.functional as F

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import measure_target_cost_variants
from jakiro_lib.models import kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.study.context import resolve_profile

SIZES = (1, 2, 4, 8)


def before_linear(x, weight, bias, packed, min_rows, max_rows, backend="mkl"):
    """kernels.linear_maybe_packed at ddb2f4e."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if packed is None or not min_rows <= rows <= max_rows or (x.requires_grad and torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    kind = kernels.backend_for(weight, backend)
    if kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    flat = x.reshape(rows, x.shape[-1])
    if kind in kernels.STREAM_BACKENDS:
        y = torch.ops.jakiro_stream_gemm.linear(flat, packed, weight.shape[0])
        y = y if bias is None else y + bias
    else:
        y = torch.ops.mkl._mkl_linear(flat, packed, weight, bias, rows)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def before_forward(self, x):
    """kernels._packed_linear_forward at ddb2f4e."""
    gemm = self._jakiro_gemm
    packed = self._jakiro_packed if gemm.active else None
    return before_linear(x, self.weight, self.bias, packed, gemm.min_rows, gemm.max_rows, gemm.backend)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--repeats", type=int, default=11)
    args = ap.parse_args()
    target = load_target(resolve_profile("default", {}).target)
    model = target.model
    gemm = kernels.packed_gemm(model)
    assert gemm is not None, "needs a packed GEMM"
    linears = gemm.linears
    after = {lin: lin.forward for lin in linears}

    @contextlib.contextmanager
    def before():
        for lin in linears:
            lin.forward = types.MethodType(before_forward, lin)
        try:
            yield
        finally:
            for lin in linears:
                lin.forward = after[lin]

    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        now = model(ids).logits
        with before():
            assert torch.equal(model(ids).logits, now), "the two forwards differ"
    table = measure_target_cost_variants(model, SIZES, {"before": before, "after": contextlib.nullcontext},
                                         context=256, repeats=args.repeats)
    rows = [{"n": n, "before_ms": round(1e3 * t["before"], 2), "after_ms": round(1e3 * t["after"], 2),
             "after_over_before": round(t["after"] / t["before"], 3),
             "before_x1": round(t["before"] / table[1]["before"], 3),
             "after_x1": round(t["after"] / table[1]["after"], 3)} for n, t in table.items()]
    frame = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "calls.csv", index=False)
    config = {"sizes": SIZES, "context": 256, "repeats": args.repeats, "threads": torch.get_num_threads(),
              "linears": len(linears), "gemm": {"backend": gemm.backend, "min_rows": gemm.min_rows}, **run_metadata()}
    (args.out / "calls_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
    print(frame.to_string(index=False))


if __name__ == "__main__":
    main()
