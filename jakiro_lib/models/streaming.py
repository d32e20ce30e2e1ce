"""The weight-streaming GEMM of ``stream_gemm.cpp`` (docs/DESIGN.md section 9): a few rows times a packed fp32
weight, the weight read from memory once for all rows, each row's result independent of the rows beside it.
Built for this CPU on first use (``-march=native``; half a minute, once per machine and torch version, in torch's
extensions folder); :func:`available` is False where it cannot be built, and the packed copies fall back to MKL
or oneDNN. ``JAKIRO_STREAM_GEMM=0`` leaves it out."""
from __future__ import annotations

import hashlib
import logging
import os
import platform
from functools import lru_cache
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("stream_gemm.cpp")
log = logging.getLogger(__name__)


def _build_name() -> str:
    """One build per source, torch version and CPU: a build for one CPU's flags may not run on another's."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    key = f"{platform.machine()} {platform.processor()} {flags} {torch.__version__}".encode() + SOURCE.read_bytes()
    return f"jakiro_stream_gemm_{hashlib.sha1(key).hexdigest()[:12]}"


@lru_cache(maxsize=1)
def available() -> bool:
    """Whether the kernel is loaded in this process (built here first if it has not been)."""
    if os.environ.get("JAKIRO_STREAM_GEMM", "1") == "0":
        return False
    try:
        from torch.utils import cpp_extension  # needs setuptools and a C++ compiler: optional

        cpp_extension.load(name=_build_name(), sources=[str(SOURCE)], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    except Exception as exc:  # noqa: BLE001 - any failure to build or load means: not here
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("the streaming GEMM could not be built here (%s); packed weights use MKL or oneDNN", first[:200])
        return False
    return True


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] (fp32, CPU) as panels of 16 output columns, [ceil(out / 16), in, 16], zero-padded."""
    return torch.ops.jakiro_stream_gemm.pack(weight.detach())


def linear(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through ``packed`` (:func:`pack` of ``weight``); x [..., in] fp32."""
    rows = x.numel() // x.shape[-1]
    y = torch.ops.jakiro_stream_gemm.linear(x.reshape(rows, x.shape[-1]), packed, weight.shape[0])  # [rows, out]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])
