"""This machine and process: seeding, the device's name, run metadata and glibc's freed-memory policy. The launch is
:mod:`jakiro_lib.distributed`'s, precision :mod:`jakiro_lib.precision`'s, compiling :mod:`jakiro_lib.compiling`'s,
other torch processes busy here :mod:`jakiro_lib.busy`'s, the run lock :mod:`jakiro_lib.runlock`'s."""
from __future__ import annotations

import os
import platform
import random
import subprocess
from datetime import datetime, timezone
from typing import Any

import numpy as np
import torch
import transformers

from .files import REPO_ROOT, c_library
from .precision import cpu_flags, cuda_bf16_units, favoured_dtype


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); a no-op elsewhere. Timings read the clock after it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device: str | torch.device = "cpu") -> str:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def run_metadata(device: str | torch.device = "cpu", **extra: Any) -> dict[str, Any]:
    """Versions, machine, device and commit: written next to every result."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "device": str(device),
        "device_name": device_name(device),
        "malloc_keeps_freed": _HEAP_KEPT,
        **extra,
    }


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4  # glibc mallopt parameters (malloc.h)


GLIBC_MMAP_THRESHOLD_MAX = 32 * 2**20  # the ceiling of glibc's own dynamic mmap threshold (64-bit)


_HEAP_KEPT = False


def keep_freed_memory(keep: bool = True) -> bool:
    """Make glibc's malloc keep freed memory in the heap (no ``mmap`` for large blocks, no trimming; docs/DESIGN.md
    section 11); True if it took, False where the C library has no ``mallopt``. Process-wide: the peak heap stays until
    exit. ``keep=False`` restores glibc's steady state (mmap above 32 MB), for side-by-side measurements."""
    global _HEAP_KEPT
    libc = c_library()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    if keep:
        ok = libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
    else:
        ok = (libc.mallopt(M_MMAP_MAX, 65536) and libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX)
              and libc.mallopt(M_TRIM_THRESHOLD, 2 * GLIBC_MMAP_THRESHOLD_MAX))
    _HEAP_KEPT = keep and bool(ok)
    return _HEAP_KEPT


def environment(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on: versions, machine, threads, the vector and matrix units."""
    flags = cpu_flags()
    env = run_metadata(device, threads=torch.get_num_threads(),
                       cpu_capability=torch.backends.cpu.get_cpu_capability(),
                       cpu_flags=sorted(f for f in flags if f.startswith(("avx", "amx", "fma"))),
                       favoured_dtype=favoured_dtype(device))
    if device.type == "cuda":
        env["cuda"] = {"name": torch.cuda.get_device_name(device), "bf16": cuda_bf16_units(device),
                       "capability": torch.cuda.get_device_capability(device), "cuda_version": torch.version.cuda}
    return env
