"""Faults of the machine and the process: what the compile-cache sweep and repair may delete (only libraries inductor
built in its own cache), an out-of-memory error said as one, the precision a GPU favours, and the run lock where
the file system cannot lock. Outside files are compared byte for byte before and after."""
from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest
import torch

from jakiro_lib import machine
from jakiro_lib.decoding.compiled import CapturedStep, CompileError, call_compiled

SETTLED = time.time() - 2 * machine.SETTLED_S


def elf(claimed: int, size: int) -> bytes:
    """``size`` bytes of a 64-bit ELF file whose header places its section headers to end at ``claimed`` bytes."""
    head = bytearray(b"\x7fELF" + bytes([2, 1, 1]) + bytes(9))
    head += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, claimed - 128, 0, 64, 56, 1, 64, 2, 1)
    return bytes(head + bytes(max(0, size - len(head))))[:size]


def inductor_library(cache: Path, seed: str, data: bytes, *, main: bool = False) -> Path:
    """A library as inductor lays one out in ``cache``: ``<cache>/<hash[1:3]>/c<hash>[.main].so`` beside its source."""
    name = "c" + (seed * 51)[:51]
    folder = cache / name[1:3]
    folder.mkdir(parents=True, exist_ok=True)
    lib = folder / (name + (".main.so" if main else ".so"))
    lib.with_suffix(".cpp").write_text("// source")
    lib.write_bytes(data)
    return lib


def settle(*paths: Path) -> None:
    for p in paths:
        os.utime(p, (SETTLED, SETTLED), follow_symlinks=False)


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: a file's bytes, a link's target."""
    out: dict[str, bytes | str] = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            out[str(p)] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p)] = p.read_bytes()
    return out


# --------------------------------------------------------------------------------------------------
# The sweep and the repair touch only libraries inductor built in its own cache
# --------------------------------------------------------------------------------------------------


def test_the_sweep_follows_no_link_out_of_the_cache(tmp_path, monkeypatch):
    """Links in the cache (to an empty library outside it, a folder of inductor's shape that is a link to an
    outside folder) are not followed: the outside files are byte-identical afterwards. A settled empty library
    of inductor's own is still swept."""
    cache, outside = tmp_path / "cache", tmp_path / "outside"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    outside.mkdir()
    empty = outside / "empty.so"
    empty.write_bytes(b"")
    linked_folder = outside / "ef"
    inductor_library(outside, "ef", b"")  # an empty library of inductor's shape in the outside folder
    cut = inductor_library(cache, "ab", b"")
    named_like_inductor = cut.parent / ("c" + ("ac" * 26)[:51] + ".so")
    named_like_inductor.with_suffix(".cpp").write_text("// source")
    named_like_inductor.symlink_to(empty)
    (cache / "ab" / "link.so").symlink_to(empty)
    (cache / "ef").symlink_to(linked_folder, target_is_directory=True)
    settle(empty, *linked_folder.iterdir(), cut)
    before = snapshot(outside)
    assert machine.sweep_compile_cache.__wrapped__() == [cut]
    assert snapshot(outside) == before and not cut.exists() and named_like_inductor.is_symlink()


def test_a_broad_cache_directory_loses_nothing_that_is_not_inductors(tmp_path, monkeypatch):
    """TORCHINDUCTOR_CACHE_DIR set to a home cache that also holds virtual environments: neither the sweep nor a
    compile error naming a library there deletes anything outside inductor's own layout; a whole library of
    inductor's stays too. Only the truncated one the error names (and the settled empty one) go."""
    home = tmp_path / "cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(home))
    site = home / "venvs" / "env" / "lib" / "python3.12" / "site-packages" / "pkg"
    site.mkdir(parents=True)
    ext, empty_ext = site / "_ext.so", site / "_empty.so"
    ext.write_bytes(elf(4096, 100))  # a file too short by inductor's test, but not inductor's
    empty_ext.write_bytes(b"")
    stray = home / "ab" / "notinductor.so"  # right folder, not inductor's name
    stray.parent.mkdir()
    stray.write_bytes(b"")
    whole = inductor_library(home, "ab", elf(4096, 4096))
    truncated = inductor_library(home, "cd", elf(4096, 300), main=True)
    swept = inductor_library(home, "ef", b"")
    settle(empty_ext, stray, whole, swept)
    keep = [ext, empty_ext, stray, whole]
    before = {p: p.read_bytes() for p in keep}
    error = RuntimeError("compile failed")
    error.__cause__ = ImportError(f"{ext}: file too short; {stray}: file too short; {whole}: undefined symbol")
    assert machine.repair_compile_cache(error) == []
    error.__cause__ = ImportError(f"{truncated}: file too short; {ext}: file too short")
    assert machine.repair_compile_cache(error) == sorted([truncated, swept])
    assert {p: p.read_bytes() for p in keep} == before


def test_the_cuda_graph_path_neither_sweeps_nor_repairs(monkeypatch):
    """A step recorded as a CUDA graph compiles nothing: its first call sweeps no cache and a failure in it is
    not taken for a compile error (nor repaired)."""
    calls: list[str] = []
    monkeypatch.setattr(machine, "sweep_compile_cache", lambda: calls.append("sweep") or [])
    monkeypatch.setattr(machine, "repair_compile_cache", lambda error: calls.append("repair") or [])
    step = CapturedStep(lambda x: x + 1, capture=lambda s, args: lambda: s(*args))
    assert call_compiled(step, torch.zeros(2), device=torch.device("cpu"), first=True).tolist() == [1.0, 1.0]
    assert calls == []

    def fails(x):
        raise RuntimeError("/tmp/x/ab/lib.so: a kernel of the eager step failed")
    with pytest.raises(RuntimeError, match="eager step failed") as info:
        call_compiled(CapturedStep(fails), torch.zeros(2), device=torch.device("cpu"), first=True)
    assert not isinstance(info.value, CompileError) and calls == []
