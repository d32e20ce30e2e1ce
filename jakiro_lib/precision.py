"""The precision a device favours: its CPU features or GPU generation (bf16 matrix units), and the training settings
"auto" resolved from them."""
from __future__ import annotations

import functools
from pathlib import Path

import torch


BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none), read once per process: several callers
    ask (favoured_dtype, machine.environment), and /proc/cpuinfo is long on many-core machines."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def favoured_dtype(device: torch.device) -> str | None:
    """``"bfloat16"`` where the device has bf16 matrix units, else None (fp32 only)."""
    if device.type == "cuda":
        return "bfloat16" if cuda_bf16_units(device) else None
    return "bfloat16" if cpu_flags() & set(BF16_CPU_FLAGS) else None


def cuda_bf16_units(device: torch.device) -> bool:
    """Whether the GPU ``device`` (the current one where it names no index) computes bf16 natively: compute
    capability 8.0 or more (Ampere on). ``torch.cuda.is_bf16_supported()`` also counts emulation (a T4 or V100 says
    yes, and runs bf16 slower than fp32) and asks the current device, not this one."""
    if not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.cuda.get_device_capability(index) >= (8, 0)


def resolve_precision(setting: str, favoured: str | None) -> str:
    """``TrainConfig.mixed_precision`` with ``"auto"`` resolved: ``"bf16"`` where the device favours bfloat16
    (``favoured``: :func:`favoured_dtype` of it, or what a throughput table measured), else ``"no"``."""
    if setting != "auto":
        return setting
    return "bf16" if favoured == "bfloat16" else "no"


def compiles_step(setting: str, precision: str) -> bool:
    """``TrainConfig.compile`` with ``"auto"`` resolved: compile the training step where it runs in bf16 (in fp32 the
    GEMMs dominate and compiling bought nothing on an AMX CPU; docs/DESIGN.md section 11)."""
    return setting == "yes" or setting == "auto" and precision == "bf16"
