"""Faults of the machine and the process: what the compile-cache sweep and repair may delete (only libraries inductor
built in its own cache), an out-of-memory error said as one, the precision a GPU favours, and the run lock where
the file system cannot lock. Outside files are compared byte for byte before and after."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from jakiro_lib import compiling, precision, runlock
from jakiro_lib.cli import main
from jakiro_lib.config import ConfigError, TargetConfig, TrainConfig
from jakiro_lib.data.dataset import FeatureDataset
from jakiro_lib.data.features import cache_features
from jakiro_lib.decoding.compiled import CapturedStep, CompileError, call_compiled
from jakiro_lib.errors import error_line, known_error
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile
from jakiro_lib.training.train import TrainError, train_draft

from helpers import word_conversations

SETTLED = time.time() - 2 * compiling.SETTLED_S


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
    assert compiling.sweep_compile_cache.__wrapped__() == [cut]
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
    assert compiling.repair_compile_cache(error) == []
    error.__cause__ = ImportError(f"{truncated}: file too short; {ext}: file too short")
    assert compiling.repair_compile_cache(error) == sorted([truncated, swept])
    assert {p: p.read_bytes() for p in keep} == before


def test_the_cuda_graph_path_neither_sweeps_nor_repairs(monkeypatch):
    """A step recorded as a CUDA graph compiles nothing: its first call sweeps no cache and a failure in it is
    not taken for a compile error (nor repaired)."""
    calls: list[str] = []
    monkeypatch.setattr(compiling, "sweep_compile_cache", lambda: calls.append("sweep") or [])
    monkeypatch.setattr(compiling, "repair_compile_cache", lambda error: calls.append("repair") or [])
    step = CapturedStep(lambda x: x + 1, capture=lambda s, args: lambda: s(*args))
    assert call_compiled(step, torch.zeros(2), device=torch.device("cpu"), first=True).tolist() == [1.0, 1.0]
    assert calls == []

    def fails(x):
        raise RuntimeError("/tmp/x/ab/lib.so: a kernel of the eager step failed")
    with pytest.raises(RuntimeError, match="eager step failed") as info:
        call_compiled(CapturedStep(fails), torch.zeros(2), device=torch.device("cpu"), first=True)
    assert not isinstance(info.value, CompileError) and calls == []


# --------------------------------------------------------------------------------------------------
# Out of memory is said as such, not as a compile error; the training step's backward is under the repair
# --------------------------------------------------------------------------------------------------


def cuda_oom() -> Exception:
    return torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (GPU 0; 79.1 GiB total)")


def wrapped_oom() -> Exception:
    """An out-of-memory RuntimeError behind the error a compiler raised."""
    try:
        try:
            raise RuntimeError("CUDA error: out of memory")
        except RuntimeError as e:
            raise CompileError("backend compiler failed") from e
    except CompileError as outer:
        return outer


@pytest.mark.parametrize("oom", [cuda_oom, wrapped_oom], ids=["OutOfMemoryError", "RuntimeError-behind"])
@pytest.mark.parametrize("captured", [False, True], ids=["inductor", "captured"])
def test_out_of_memory_in_a_first_step_is_one_line_naming_memory(oom, captured, monkeypatch):
    """A first step that runs out of memory (a captured step's eager warm-up included) ends in one line that names
    memory and what to do, not in "torch.compile failed ... needs a C++ compiler"; nothing is repaired."""
    repaired: list[int] = []
    monkeypatch.setattr(compiling, "sweep_compile_cache", lambda: [])
    monkeypatch.setattr(compiling, "repair_compile_cache", lambda error: repaired.append(1) or [])

    def step(x):
        raise oom()
    with pytest.raises(compiling.DeviceMemoryError) as info:
        call_compiled(CapturedStep(step) if captured else step, torch.zeros(2), device=torch.device("cpu"), first=True)
    line = error_line(info.value)
    assert known_error(info.value) and "\n" not in line and repaired == []
    assert "out of memory" in line and "C++" not in line and "smaller" in line, line


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """``train(out_dir, **train settings)``: a dense smoke draft trained on a tiny target's cached features."""
    target = load_target(TargetConfig(model="tiny:llama"))
    cache = cache_features(target, word_conversations(8, n_long_prompt=0), tmp_path_factory.mktemp("features"),
                           max_length=48, shard_size=4, progress=False)
    train, held = FeatureDataset(cache, "train", 0.25), FeatureDataset(cache, "heldout", 0.25)
    draft = get_profile("smoke").drafts["dense"]

    def run(out: Path, **settings):
        cfg = TrainConfig(**{"epochs": 1, "batch_size": 2, "warmup_steps": 1, "seed": 0, **settings})
        return train_draft(target, draft, train, held, out, cfg, progress=False)
    return run


def test_the_training_steps_backward_compiles_under_the_repair(training, tmp_path, monkeypatch):
    """The compiled training step's backward compiles at its first call, after the forward: a backward that fails on
    a library its compilation left empty is repaired and retried like the forward; one that fails otherwise is the
    one-line TrainError naming train.compile=no."""
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    damaged = inductor_library(cache, "ab", b"")  # just cut: too recent for the sweep
    failures: list[str] = []

    class Backward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, loss):
            return loss.clone()

        @staticmethod
        def backward(ctx, grad):
            if damaged.exists():
                failures.append("backward")
                raise RuntimeError(f"backward compile: ImportError: {damaged}: file too short")
            return grad

    def compile_with_failing_backward(step, **kwargs):
        def compiled(batch):
            loss, metrics = step(batch)
            return Backward.apply(loss), metrics
        return compiled

    monkeypatch.setattr(torch, "compile", compile_with_failing_backward)
    results = training(tmp_path / "draft", compile="yes")
    assert failures == ["backward"] and not damaged.exists() and results["steps"] >= 2

    damaged.write_bytes(b"")  # again, but no longer beside its source: not provably inductor's, so not repaired
    damaged.with_suffix(".cpp").unlink()
    with pytest.raises(TrainError, match="train.compile=no"):
        training(tmp_path / "again", compile="yes")
    assert damaged.exists()


# --------------------------------------------------------------------------------------------------
# "auto" precision: bf16 only where the configured GPU computes it natively
# --------------------------------------------------------------------------------------------------


def test_auto_precision_asks_the_configured_gpu_for_native_bf16(monkeypatch):
    """A T4 (7.5) or V100 (7.0) emulates bf16 (torch.cuda.is_bf16_supported() says yes): "auto" keeps fp32 there.
    The device asked is the configured one, not the current one."""
    capability = {0: (8, 0), 1: (7, 5), 2: (7, 0), 3: (9, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)  # emulation counted
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[index])
    favoured = {d: precision.favoured_dtype(torch.device(d)) for d in ("cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda")}
    assert favoured == {"cuda:0": "bfloat16", "cuda:1": None, "cuda:2": None, "cuda:3": "bfloat16", "cuda": None}
    assert precision.resolve_precision("auto", favoured["cuda:1"]) == "no"


# --------------------------------------------------------------------------------------------------
# The run lock where the file system cannot lock
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP, errno.EIO], ids=["ENOLCK", "EOPNOTSUPP", "EIO"])
def test_a_file_system_that_cannot_lock_is_one_line(tmp_path, monkeypatch, capsys, code):
    """flock failing otherwise than "held by another" (an NFS mount without lockd, a FUSE mount without locks) ends
    in one RunLockError line naming the directory and the cause, before anything is written; no descriptor leaks."""
    def flock(fd, operation):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(fcntl, "flock", flock)
    monkeypatch.setenv("JAKIRO_NO_BUSY_CHECK", "1")  # a busy torch process here would add a warning line
    opened = len(os.listdir("/proc/self/fd"))
    with pytest.raises(runlock.RunLockError) as info:
        with runlock.run_lock(tmp_path / "run"):
            pytest.fail("ran without the lock")
    line = error_line(info.value)
    assert known_error(info.value) and "\n" not in line and str(tmp_path / "run") in line, line
    assert os.strerror(code) in line and "local" in line, line
    assert len(os.listdir("/proc/self/fd")) == opened
    rc = main(["cache", "--profile", "smoke", "--run-dir", str(tmp_path / "cli")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("error: cannot lock") and os.strerror(code) in err[0], err
    assert not (tmp_path / "cli" / "features").exists()


# --------------------------------------------------------------------------------------------------
# A notebook's kernel holds the run lock; one started under a lock works under it and dies with its holder
# --------------------------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = r"""
import sys, time
import IPython.display
IPython.display.display = lambda *objects: None  # no notebook to show the header in
from jakiro_lib.study import notebook_setup
notebook_setup("smoke", run_dir=sys.argv[1], report_dir=sys.argv[2])
print("ready", flush=True)
time.sleep(300)
"""


def cli_lines(capsys, *argv: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    rc = main(list(argv))
    return rc, [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_a_notebook_holds_its_run_directory_against_a_cli_run(tmp_path, monkeypatch, capsys):
    """A notebook's setup cell takes the run lock of its run and report directories for the kernel's life: a
    `train` there meanwhile is refused in one line naming the notebook; once the kernel ends, it runs."""
    monkeypatch.setenv("JAKIRO_NO_BUSY_CHECK", "1")
    run, report = tmp_path / "run", tmp_path / "report"
    kernel = subprocess.Popen([sys.executable, "-c", NOTEBOOK, str(run), str(report)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert kernel.stdout.readline().strip() == "ready"
        rc, errors = cli_lines(capsys, "train", "--profile", "smoke", "--run-dir", str(run))
        assert rc == 1 and len(errors) == 1, errors
        assert "in use by another run" in errors[0] and f"pid {kernel.pid}" in errors[0] and "notebook" in errors[0]
    finally:
        kernel.kill()
        kernel.wait()
    rc, errors = cli_lines(capsys, "train", "--profile", "smoke", "--run-dir", str(run))
    assert not any("in use" in e for e in errors), errors  # it ran (and stopped: there is no feature cache)


HOLDER = r"""
import subprocess, sys, time
from jakiro_lib.runlock import run_lock
with run_lock(sys.argv[1], command="a pipeline", for_children=True):
    child = subprocess.Popen([sys.executable, "-c", sys.argv[2], sys.argv[1], sys.argv[3]])
    time.sleep(300)
"""
WORKER = r"""
import os, sys, time
from pathlib import Path
from jakiro_lib.runlock import hold_run_lock
hold_run_lock(sys.argv[1], command="a notebook's kernel")
beats = Path(sys.argv[2])
beats.write_text(f"{os.getpid()}\n")
while True:
    with beats.open("a") as f:
        f.write(f"{time.time()}\n")
    time.sleep(0.02)
"""


def test_a_child_working_under_its_parents_lock_dies_with_the_parent(tmp_path):
    """A process started under its parent's run lock (as the pipeline's notebook kernels are) takes that lock as
    its own, leaves the lock file naming the parent, and dies the moment the parent is killed: it never writes
    into the run directory unguarded."""
    run, beats = tmp_path / "run", tmp_path / "beats.txt"
    parent = subprocess.Popen([sys.executable, "-c", HOLDER, str(run), WORKER, str(beats)], cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not (beats.is_file() and len(beats.read_text().splitlines()) > 3):
            assert parent.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert json.loads((run / runlock.LOCK_FILE).read_text())["pid"] == parent.pid
        child = int(beats.read_text().splitlines()[0])
        killed = time.time()
        parent.kill()
    finally:
        parent.kill()
        parent.wait()
    time.sleep(1.0)
    last = float(beats.read_text().splitlines()[-1])
    gone = not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text()
    if not gone:
        os.kill(child, signal.SIGKILL)
    assert gone and last < killed + 0.25, (gone, last - killed)


# --------------------------------------------------------------------------------------------------
# Notebook parameters as papermill passes them (-p gives strings): checked, coerced, or one line naming the parameter
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def setup_notebook(tmp_path, monkeypatch):
    """``notebook_setup`` as the notebooks call it, displaying nothing, with the run and report dirs under tmp."""
    import logging

    import IPython.display

    from jakiro_lib.study import notebook_setup

    monkeypatch.setattr(IPython.display, "display", lambda *objects: None)
    monkeypatch.setattr(logging.root, "handlers", list(logging.root.handlers))  # restored after the test

    def run(profile="smoke", overrides=None, *, force=False, run_dir=str(tmp_path / "run"),
            report_dir=str(tmp_path / "report")):
        return notebook_setup(profile, overrides, run_dir=run_dir, report_dir=report_dir, force=force)
    return run


@pytest.mark.parametrize("given, meant", [(False, False), (True, True), ("false", False), ("False", False),
                                          ("no", False), ("0", False), (0, False), ("true", True), ("YES", True),
                                          ("1", True), (1, True)])
def test_force_from_papermill_strings(setup_notebook, given, meant):
    assert setup_notebook(force=given).force is meant


@pytest.mark.parametrize("given", ['{"bench.limit": 2, "train.epochs": 3}', "bench.limit: 2\ntrain.epochs: 3",
                                   "{bench.limit: 2, train.epochs: 3}", {"bench.limit": 2, "train.epochs": "3"}],
                         ids=["json", "yaml", "yaml-flow", "dict"])
def test_overrides_as_a_dict_or_its_json_or_yaml_text(setup_notebook, given):
    ctx = setup_notebook(overrides=given)
    assert ctx.profile.bench.limit == 2 and ctx.profile.train.epochs == 3


def test_empty_overrides_and_paths(setup_notebook, tmp_path):
    ctx = setup_notebook(overrides="", run_dir=tmp_path / "a", report_dir=str(tmp_path / "b"))
    assert ctx.overrides == {} and ctx.run_dir == (tmp_path / "a").resolve() and ctx.report_dir == tmp_path / "b"


@pytest.mark.parametrize("name, value, said", [
    ("force", "maybe", "true or false"), ("force", 2, "true or false"), ("force", None, "true or false"),
    ("overrides", "[1, 2]", "mapping"), ("overrides", "{bench.limit: [", "neither JSON nor YAML"),
    ("overrides", 5, "mapping"), ("overrides", {1: 2}, "mapping"),
    ("run_dir", 123, "a path"), ("run_dir", "", "a path"), ("report_dir", ["x"], "a path"),
    ("profile", 5, "profile name"), ("profile", "", "profile name"),
])
def test_a_bad_notebook_parameter_is_one_line_naming_it(setup_notebook, tmp_path, name, value, said):
    with pytest.raises(ConfigError) as info:
        setup_notebook(**{name: value})
    line = error_line(info.value)
    assert known_error(info.value) and "\n" not in line and f"notebook parameter {name}" in line and said in line, line
    assert not (tmp_path / "run").exists() and not (tmp_path / "report").exists()  # checked before anything


@pytest.mark.parametrize("notebook", sorted((REPO / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_the_notebooks_use_the_checked_force(notebook):
    """Every notebook hands its parameters to notebook_setup and passes on ``ctx.force``, never the raw parameter
    (papermill's ``-p force false`` is the string "false", which is true)."""
    cells = ["".join(c["source"]) for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code"]
    code = "\n".join(cells[1:])  # after the parameters cell
    assert "notebook_setup(profile, overrides, run_dir=run_dir, report_dir=report_dir" in code
    calls = [line for line in code.splitlines() if "force" in line and "notebook_setup(" not in line]
    assert all("force=ctx.force" in line and "force=force" not in line for line in calls), calls
    assert [line for line in code.splitlines() if "notebook_setup(" in line][0].count("force=force") == 1
