"""The target's decoder layers at 1 and 8 rows through the package's streaming GEMM against two builds of the same
source whose blocks for 5-8 rows keep one or two panels in registers instead of three (`panels_in_registers`), in
one process: each build loaded under its own operator namespace, `decoder_layers` called with the arguments a T(n)
measurement passed it (context 300), the three alternated, 40 rounds; outputs compared.

    python reports/measured/2026-12-01-cycle-cpu-zen5-int8/blocking.py > reports/measured/2026-12-01-cycle-cpu-zen5-int8/blocking.txt
"""
from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from jakiro_lib.machine import run_metadata
from jakiro_lib.measure.costmodel import measure_target_costs
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

PANELS = "template <int M> constexpr int panels_in_registers() { return M == 1 ? 6 : M == 2 ? 6 : M <= 4 ? 4 : 3; }"
VARIANTS = {"nb1": 1, "nb2": 2}


def build_variants(folder: Path) -> None:
    source = kernels.STREAM_SOURCE.read_text()
    assert PANELS in source, "the AVX-512 blocking this script varies is not in the package's source"
    source = source.replace(PANELS, PANELS.replace(": 3; }", ": BIG; }"))
    for tag in ("TORCH_LIBRARY(", "TORCH_LIBRARY_IMPL("):
        source = source.replace(f"{tag}jakiro_stream_gemm,", f"{tag}NS,")
    (folder / "variant.cpp").write_text(source)
    for name, big in VARIANTS.items():
        cpp_extension.load(name=f"blocking_{name}", sources=[str(folder / "variant.cpp")], is_python_module=False,
                           extra_cflags=[*kernels.STREAM_FLAGS, f"-DNS={name}", f"-DBIG={big}"],
                           extra_ldflags=["-fopenmp"])


def main() -> None:
    target = load_target(get_profile("default").target)
    print(run_metadata(target.device))
    with tempfile.TemporaryDirectory() as tmp:
        build_variants(Path(tmp))
    base = torch.ops.jakiro_stream_gemm.decoder_layers
    captured = {}

    def spy(*args):
        captured[args[0].shape[1]] = args
        return base(*args)
    real = fast_paths._kernel_without_grad
    fast_paths._kernel_without_grad = lambda name, x, *others: spy if name == "decoder_layers" else real(name, x, *others)
    try:
        measure_target_costs(target.model, [1, 8], context=300, repeats=1, greedy=True)
    finally:
        fast_paths._kernel_without_grad = real
    ops = {"base": base, **{n: getattr(torch.ops, n).decoder_layers for n in VARIANTS}}
    for n, args in sorted(captured.items()):
        outs = {k: f(*args) for k, f in ops.items()}
        print(n, "rows: largest difference from the package's build",
              {k: float((outs[k] - outs["base"]).abs().max()) for k in VARIANTS})
    times = {n: {k: [] for k in ops} for n in captured}
    for rnd in range(40):
        for n, args in captured.items():
            for k in (list(ops) if rnd % 2 == 0 else list(ops)[::-1]):
                t0 = time.perf_counter()
                ops[k](*args)
                times[n][k].append(time.perf_counter() - t0)
    for n in sorted(times):
        med = {k: 1e3 * statistics.median(v) for k, v in times[n].items()}
        paired = {k: statistics.median(a / b for a, b in zip(times[n][k], times[n]["base"])) for k in VARIANTS}
        print(f"{n} rows: median ms {({k: round(v, 3) for k, v in med.items()})}; "
              f"paired ratio to the package's build {({k: round(v, 3) for k, v in paired.items()})}")


if __name__ == "__main__":
    main()
