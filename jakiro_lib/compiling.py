"""Compiling safely: inductor's on-disk cache swept and repaired, and a compiled call's failure (or running out of
memory) said in one line."""
from __future__ import annotations

import functools
import logging
import os
import re
import struct
import sys
import time
from pathlib import Path
from stat import S_ISREG
from typing import Callable, Iterator, TypeVar

import torch

from .errors import cause_chain

log = logging.getLogger(__name__)
T = TypeVar("T")


_LIBRARY = re.compile(r"(/[^\s:'\"]+\.so)\b")  # a shared library's absolute path inside an error message
_INDUCTOR_LIBRARY = re.compile(r"c[a-z2-7]{51}(?:\.main)?\.so")  # inductor's name for a library it built
_COMPILER_ERROR = re.compile(r"^\S+:\d+:\d+: error: (.+)$", re.MULTILINE)  # a compiler's "f:1:2: error: ..."
SETTLED_S = 120  # an empty library of inductor's cache older than this is no build in progress
REPAIRS = 3  # retries of a first compiled call, each after repair_compile_cache deleted something
RECOMPILE_LIMIT = 64  # dynamo's default (8) is below the cache lengths x sampling settings one process may compile


class CompileError(RuntimeError):
    """torch.compile failed for the target (no C++ compiler for inductor on CPU, no triton on CUDA)."""


def compile_cause(error: BaseException, width: int = 240) -> str:
    """The innermost exception behind a failed compilation, as one line ("ImportError: ...: file too short"),
    so that an error saying what compiling needs also says what actually went wrong; where a C++ compiler's output is
    in the chain, its first error instead (the innermost exception is then the command that failed)."""
    chain = list(cause_chain(error))
    root, text = chain[-1], str(chain[-1])
    for e in reversed(chain):
        if found := _COMPILER_ERROR.search(str(e)):
            root, text = e, found.group(1)
            break
    text = " ".join(text.split())
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
    """Once a process, before its first compilation: delete the empty libraries a compilation cut short left in
    inductor's on-disk cache (docs/DESIGN.md section 11); returns them. Only regular files of inductor's own layout are
    touched (:func:`_inductors`)."""
    return _delete(_empty_libraries(_compile_cache()))


def repair_compile_cache(error: BaseException) -> list[Path]:
    """After a compilation failed: delete the libraries inductor built in its cache that ``error`` (or an exception
    behind it) names and that are damaged (empty, too recent for :func:`sweep_compile_cache`, or an ELF file shorter
    than its header says) and, if there were any, every settled empty one there; returns those deleted, which the
    caller's retry rebuilds. A whole library, and any file not of inductor's own layout, is never touched."""
    root = _compile_cache()
    named = {Path(os.path.abspath(m)) for e in cause_chain(error) for m in _LIBRARY.findall(str(e))}
    damaged = {p for p in named if _damaged(p, root)}
    return _delete(damaged | _empty_libraries(root)) if damaged else []


class DeviceMemoryError(RuntimeError):
    """The device (or the host) ran out of memory: the message says where and what to do."""


_OUT_OF_MEMORY = re.compile(r"out of memory|can't allocate memory", re.IGNORECASE)  # CUDA's, the CPU allocator's


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error``, or an exception behind it, is running out of memory (CUDA's OutOfMemoryError, a
    RuntimeError saying so, MemoryError)."""
    return any(isinstance(e, (torch.cuda.OutOfMemoryError, MemoryError))
               or isinstance(e, RuntimeError) and _OUT_OF_MEMORY.search(str(e)) is not None for e in cause_chain(error))


def _say_out_of_memory(error: Exception, what: str) -> None:
    """Raise ``error`` as the :class:`DeviceMemoryError` it is, where it is running out of memory."""
    if out_of_memory(error):
        raise DeviceMemoryError(f"{what} ran out of memory ({compile_cause(error)}); free the device's memory (is "
                                "another process using it?) or ask for less: a smaller batch, context or tree") from error


def _compiler_failed(error: BaseException) -> bool:
    """Whether ``error``, or an exception behind it, is a compiler backend's failure (dynamo's, inductor's)."""
    exc = sys.modules.get("torch._dynamo.exc")  # loaded wherever anything compiled
    return exc is not None and any(isinstance(e, exc.BackendCompilerFailed) for e in cause_chain(error))


def run_compiling(call: Callable[[], T], *, compiling: bool, what: str, remedy: str,
                  error: type[Exception] = RuntimeError) -> T:
    """``call()``. Where that compiles (``compiling``): after :func:`sweep_compile_cache`. Where it fails compiling
    (``compiling``, or a later graph's backend failed), again while the failure named a damaged library of inductor's
    cache (:func:`repair_compile_cache` deleted it; nothing ran before a compilation failed), at most :data:`REPAIRS`
    times, else one ``error`` raised from the failure: ``what`` failed, :func:`compile_cause`'s line, what compiling
    needs, then ``remedy``. Running out of memory, compiling or not, is one :class:`DeviceMemoryError` instead (no
    repair: nothing was damaged)."""
    if compiling:
        sweep_compile_cache()
    try:
        return call()
    except Exception as e:
        _say_out_of_memory(e, what)
        if not (compiling or _compiler_failed(e)):
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
