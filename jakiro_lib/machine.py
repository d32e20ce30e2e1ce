"""This machine and process: the distributed launch, seeding, the device and CPU features (bf16 units), the
mixed precision they favour, inductor's on-disk cache and compile failures, run metadata and glibc's freed-memory
policy. Other torch processes busy here are :mod:`jakiro_lib.busy`'s, the run lock :mod:`jakiro_lib.runlock`'s."""
from __future__ import annotations

import functools
import logging
import os
import platform
import random
import re
import struct
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from stat import S_ISREG
from typing import Any, Callable, Iterator, TypeVar

import numpy as np
import torch
import transformers

from .files import REPO_ROOT, c_library

log = logging.getLogger(__name__)
T = TypeVar("T")


def world_size() -> int:
    """Processes of this run: ``WORLD_SIZE`` as ``accelerate launch`` / torchrun set it, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def main_rank() -> bool:
    """Whether this is the main process (``RANK`` 0, or no launcher): the one that speaks and takes locks."""
    return int(os.environ.get("RANK", "0") or 0) == 0


class LaunchError(RuntimeError):
    """The processes of a multi-process launch did not join one group (each would redo, and rewrite, all the work)."""


def distributed_state() -> Any:
    """accelerate's ``PartialState`` of a run launched in several processes (``world_size() > 1``), joined into one
    group: NCCL where CUDA is, else gloo on the CPU.

    ``PartialState()`` alone joins no group on a machine without CUDA: under ``accelerate launch --multi_gpu
    --num_processes 2`` (torchrun) on a 2-core CPU each process reported 1 process and rank 0, and both cached every
    shard and wrote the same manifest (issue 43; tests/test_multiprocess.py). ``cpu=True`` there makes it a gloo
    group. A :class:`LaunchError` when the group still does not hold ``WORLD_SIZE`` processes.
    """
    from accelerate import PartialState  # only under a multi-process launch: optional, heavy

    state = PartialState(cpu=not torch.cuda.is_available())
    if state.num_processes != world_size():
        raise LaunchError(f"launched as {world_size()} processes (WORLD_SIZE), but accelerate sees "
                          f"{state.num_processes} ({state.distributed_type}); launch with `accelerate launch "
                          "--multi_gpu --num_processes N -m jakiro_lib ...` (docs/usage.md)")
    return state


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


BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none), read once per process: several callers
    ask (favoured_dtype, the throughput environment), and /proc/cpuinfo is long on many-core machines."""
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


_LIBRARY = re.compile(r"(/[^\s:'\"]+\.so)\b")  # a shared library's absolute path inside an error message
_INDUCTOR_LIBRARY = re.compile(r"c[a-z2-7]{51}(?:\.main)?\.so")  # inductor's name for a library it built
SETTLED_S = 120  # an empty library of inductor's cache older than this is no build in progress
REPAIRS = 3  # retries of a first compiled call, each after repair_compile_cache deleted something


def _chain(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from or during, outermost first."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def compile_cause(error: BaseException, width: int = 240) -> str:
    """The innermost exception behind a failed compilation, as one line ("ImportError: ...: file too short"),
    so that an error saying what compiling needs also says what actually went wrong."""
    root = list(_chain(error))[-1]
    text = " ".join(str(root).split())
    line = f"{type(root).__name__}: {text}" if text else type(root).__name__
    return line if len(line) <= width else line[:width - 3] + "..."


def _compile_cache() -> Path:
    """Inductor's cache directory, resolved: ``TORCHINDUCTOR_CACHE_DIR`` where the user set it, else the one inductor
    makes (``/tmp/torchinductor_<user>``)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir  # loads inductor: only where something compiles

    return Path(cache_dir()).resolve()


def _inductors(path: Path, root: Path) -> os.stat_result | None:
    """``path``'s own ``lstat`` where it is a library inductor built in its cache ``root``, else None: a regular file
    (no link) named as inductor names one, ``c`` and a base32 hash, in the folder named by the hash's first two
    characters right under ``root`` (no link either), beside its C++ source."""
    folder = path.parent
    if not (_INDUCTOR_LIBRARY.fullmatch(path.name) and folder.name == path.name[1:3]):
        return None
    try:
        if folder.is_symlink() or folder.resolve() != root / folder.name:
            return None
        st, source = os.lstat(path), os.lstat(path.with_suffix(".cpp"))
    except OSError:  # gone since listed: another process's sweep (ranks start together), a rename
        return None
    return st if S_ISREG(st.st_mode) and S_ISREG(source.st_mode) else None


def _libraries(root: Path) -> Iterator[Path]:
    """The ``.so`` files of inductor's layout in ``root``: ``<root>/<two characters>/*.so``, nothing deeper (a broad
    cache directory may hold virtual environments)."""
    try:
        folders = [e.path for e in os.scandir(root) if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except OSError:
        return
    for folder in folders:
        try:
            names = os.listdir(folder)
        except OSError:  # vanished since listed
            continue
        yield from (Path(folder, name) for name in names if name.endswith(".so"))


def _empty_libraries(root: Path) -> set[Path]:
    """Inductor's empty libraries in its cache ``root`` older than :data:`SETTLED_S` (none another process is linking)."""
    settled = time.time() - SETTLED_S
    found: set[Path] = set()
    for path in _libraries(root):
        st = _inductors(path, root)
        if st is not None and st.st_size == 0 and st.st_mtime < settled:
            found.add(path)
    return found


def _whole_elf(path: Path, size: int) -> bool:
    """Whether ``path`` (``size`` bytes) is an ELF file as long as its header says: the magic, and its program and
    section header tables inside it (a library whose linking was cut short is not)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return True  # unreadable: not judged damaged, so not deleted
    wide = head[4:5] == b"\x02"  # 64-bit
    if len(head) < (64 if wide else 52) or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
        return False
    order = "<" if head[5] == 1 else ">"
    phoff, shoff = struct.unpack_from(order + ("QQ" if wide else "II"), head, 0x20 if wide else 0x1C)
    phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 0x36 if wide else 0x2A)
    return size >= max(phoff + phentsize * phnum, shoff + shentsize * shnum)


def _damaged(path: Path, root: Path) -> bool:
    """Whether ``path`` is a library inductor built in its cache ``root`` and is not a whole one (empty or cut short)."""
    st = _inductors(path, root)
    return st is not None and (st.st_size == 0 or not _whole_elf(path, st.st_size))


def _delete(libraries: set[Path]) -> list[Path]:
    deleted = sorted(libraries)
    for p in deleted:
        p.unlink(missing_ok=True)
        log.warning("deleted %s from inductor's cache: it is empty or cut short (a compilation cut short?); "
                    "it will be rebuilt", p)
    return deleted


@functools.cache
def sweep_compile_cache() -> list[Path]:
    """Once a process, before its first compilation: delete the empty libraries inductor built in its on-disk cache;
    returns them. A compilation cut short (Ctrl-C, a kill, a time limit) leaves the libraries it was linking empty
    (one per build in flight), and inductor, which builds only what its cache lacks, then fails to load a kernel's
    in every later process ("file too short"; pytorch/pytorch#102539) and, worse, silently takes a damaged probe of
    a vector ISA for an ISA the CPU lacks (slower kernels). Only regular files of inductor's own layout are touched
    (:func:`_inductors`; docs/DESIGN.md section 11)."""
    return _delete(_empty_libraries(_compile_cache()))


def repair_compile_cache(error: BaseException) -> list[Path]:
    """After a compilation failed: delete the libraries inductor built in its cache that ``error`` (or an exception
    behind it) names and that are damaged (empty, too recent for :func:`sweep_compile_cache`, or an ELF file shorter
    than its header says) and, if there were any, every settled empty one there; returns those deleted, which the
    caller's retry rebuilds. A whole library, and any file not of inductor's own layout, is never touched."""
    root = _compile_cache()
    named = {Path(os.path.abspath(m)) for e in _chain(error) for m in _LIBRARY.findall(str(e))}
    damaged = {p for p in named if _damaged(p, root)}
    return _delete(damaged | _empty_libraries(root)) if damaged else []


class DeviceMemoryError(RuntimeError):
    """The device (or the host) ran out of memory: the message says where and what to do."""


_OUT_OF_MEMORY = re.compile(r"out of memory|can't allocate memory", re.IGNORECASE)  # CUDA's, the CPU allocator's


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error``, or an exception behind it, is running out of memory (CUDA's OutOfMemoryError, a
    RuntimeError saying so, MemoryError)."""
    return any(isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError))
               or isinstance(e, RuntimeError) and _OUT_OF_MEMORY.search(str(e)) is not None for e in _chain(error))


def _say_out_of_memory(error: Exception, what: str) -> None:
    """Raise ``error`` as the :class:`DeviceMemoryError` it is, where it is running out of memory."""
    if out_of_memory(error):
        raise DeviceMemoryError(f"{what} ran out of memory ({compile_cause(error)}); free the device's memory (is "
                                "another process using it?) or ask for less: a smaller batch, context or tree") from error


def run_compiling(call: Callable[[], T], *, compiling: bool, what: str, remedy: str,
                  error: type[Exception] = RuntimeError) -> T:
    """``call()``. Where that compiles (``compiling``): after :func:`sweep_compile_cache`, and where it fails, again
    while the failure named a damaged library of inductor's cache (:func:`repair_compile_cache` deleted it; nothing
    ran before a compilation failed), at most :data:`REPAIRS` times, else one ``error`` raised from the failure:
    ``what`` failed, :func:`compile_cause`'s line, what compiling needs, then ``remedy``. Running out of memory,
    compiling or not, is one :class:`DeviceMemoryError` instead (no repair: nothing was damaged)."""
    if compiling:
        sweep_compile_cache()
    try:
        return call()
    except Exception as e:
        _say_out_of_memory(e, what)
        if not compiling:
            raise
        failure = e
    for _ in range(REPAIRS):
        if not repair_compile_cache(failure):
            break
        try:
            return call()
        except Exception as e:
            _say_out_of_memory(e, what)
            failure = e
    raise error(f"{what} failed ({compile_cause(failure)}); it needs a C++ compiler on a CPU, triton on a GPU; "
                f"{remedy}") from failure


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
    """Make glibc's malloc keep freed memory for reuse instead of returning it to the system; True if it took.

    A training step on a CPU allocates and frees tensors of tens of MB (the [rows, vocabulary] logits).
    glibc serves every block over 32 MB with a fresh ``mmap``, so each such tensor is page-faulted in anew:
    measured on a 2-core Sapphire Rapids (2026-11-25), 15 ms of a 20 ms elementwise pass over 80 MB. With
    mmap and trimming off, freed blocks stay in the heap and are reused (docs/DESIGN.md section 11). Process-wide:
    the process keeps its peak heap until it exits. ``keep=False`` goes back to glibc's steady state (mmap above
    32 MB, the ceiling its dynamic threshold reaches), for side-by-side measurements. A no-op (False) where the
    C library has no ``mallopt`` (not glibc).
    """
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
