"""A head's int8 screen through AVX-512 VNNI against the package's fp32 sums of the same int8 values, and what int8
activations would leave to rescore. Part 1: ``int8_linear`` (fp32 FMAs over int8 panels, the package's way on CPUs
without AMX) against ``vnni.cpp``'s sums (int16 activations in two bytes, exact; or int8 activations, one byte) over
the same weights in AMX's layout, for the target's head shape (49152 x 576, 28 MB) and the draft's reduced head (8192 x
576, 4.7 MB), random weights, 1-16 rows, cold (after a 64 MB read) and warm; 25 interleaved rounds, medians. Part 2:
greedy decoding's screen over SmolLM2's real head and last hidden states (every third position of six MT-bench first
turns): the words a row's screen cannot rule out (which the exact fp32 logit must then rescore), with the activations
exact (the package's screen), rounded to int16, or to int8 with the row's largest 0-16 values kept exact.

    python reports/measured/2026-12-01-vnni-head-cpu-zen5/vnni_bench.py > reports/measured/2026-12-01-vnni-head-cpu-zen5/vnni.txt
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.cycles import cycle_prompts
from jakiro_lib.models import kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

HERE = Path(__file__).parent


def timings() -> None:
    ops = torch.ops.jakiro_stream_gemm
    torch.manual_seed(0)
    junk = torch.rand(16 << 20)
    for V in (49152, 8192):
        W = torch.randn(V, 576) * 0.03
        panels, scales = ops.pack_int8(W, False)  # [P, K, 16]
        P = panels.shape[0]
        amx_layout = panels.view(P, 144, 4, 16).transpose(2, 3).contiguous()  # [P, K / 4, 16, 4]
        for M in (1, 2, 4, 6, 8, 12, 16):
            x = torch.randn(M, 576) * 2
            ref = ops.int8_linear(x, panels, scales, V)
            ways = {"fp32 sums": lambda: ops.int8_linear(x, panels, scales, V),
                    "int16 acts, 4-row chunks": lambda: torch.ops.vnni_head.vsums(x, amx_layout, scales, 0, 4, True),
                    "int16 acts, 8-row chunks": lambda: torch.ops.vnni_head.vsums(x, amx_layout, scales, 0, 8, True),
                    "int8 acts": lambda: torch.ops.vnni_head.vsums(x, amx_layout, scales, 1, 8, True)}
            exact16 = (ways["int16 acts, 4-row chunks"]()[:, :V] - ref).abs().max() / ref.abs().max()
            for cold in (True, False):
                times: dict[str, list[float]] = {k: [] for k in ways}
                for _ in range(25):
                    for k, f in ways.items():
                        if cold:
                            junk.sum()
                        t0 = time.perf_counter()
                        f()
                        times[k].append(time.perf_counter() - t0)
                print(f"  {V} words, {M:2d} rows, {'cold' if cold else 'warm'}: " + ", ".join(
                    f"{k} {1e6 * statistics.median(v):7.1f} us" for k, v in times.items())
                    + (f" (int16 sums within {exact16:.1e} of fp32's)" if cold else ""), flush=True)


def candidates() -> None:
    profile = get_profile("default")
    target = load_target(profile.target)
    W = target.model.lm_head.weight.detach().double()  # [V, K]
    V, K = W.shape
    scale = W.abs().amax(1) / 127
    Wq = (W / scale[:, None]).round() * scale[:, None]
    bound = 1.01 * ((Wq - W).abs().amax(1) + 2.02 * K * 2 ** -24 * W.abs().amax(1))  # the package's (head_screen)
    l1 = Wq.abs().sum(1)
    rows = []
    with torch.inference_mode():
        for ids in cycle_prompts(profile, target, 6):
            rows.append(target.model.model(ids.reshape(1, -1)).last_hidden_state[0].double())
    H = torch.cat(rows)[::3]

    def count(x: torch.Tensor, top: int | None, kept: int) -> int:
        xq, err = x, 0.0
        if top is not None:
            out = x.abs().topk(kept).indices if kept else torch.empty(0, dtype=torch.long)
            rest = x.clone()
            rest[out] = 0
            sx = rest.abs().max() / top
            xq = sx * (rest / sx).round().clamp(-top, top)
            err = float((rest - xq).abs().max())
            xq[out] = x[out]
        s = Wq @ xq
        B = bound * x.abs().sum() + 1.01 * l1 * err
        return int((s + B >= (s - B).max()).sum())

    print(f"  {H.shape[0]} rows; |x| largest values, medians over rows: "
          + ", ".join(f"{v:.1f}" for v in H.abs().sort(1, descending=True).values[:, :8].median(0).values.tolist()))
    for label, top, kept in [("exact activations (the package's screen)", None, 0), ("int16 activations", 16383, 0),
                             *[(f"int8 activations, {k} largest kept exact", 127, k) for k in (0, 2, 4, 8, 16)]]:
        c = torch.tensor([count(x, top, kept) for x in H], dtype=torch.float)
        print(f"  {label:44s} words to rescore a row: median {c.median():.0f}, 90th percentile "
              f"{c.quantile(0.9):.0f}, max {c.max():.0f}", flush=True)


def main() -> None:
    assert kernels.stream_gemm_available()
    with tempfile.TemporaryDirectory() as build:
        cpp_extension.load(name="vnni_head", sources=[str(HERE / "vnni.cpp")], is_python_module=False,
                           build_directory=build, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"])
    print(run_metadata(torch.device("cpu")))
    print("Part 1: the screen's sums, microseconds a call")
    timings()
    print("Part 2: SmolLM2-135M-Instruct's head, the words a greedy screen leaves")
    candidates()


if __name__ == "__main__":
    main()
