"""The run lock: one command writing a run directory at a time (an exclusive ``flock`` on ``<dir>/.lock``), taken
by the commands for their run (:func:`run_lock`) and by a notebook's kernel for its life (:func:`hold_run_lock`)."""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from .files import die_with_parent, read_json
from .distributed import main_rank

LOCK_FILE = ".lock"  # in a run directory (or a benchmark's --out folder) while a command writes there
HOLDER_ENV = "JAKIRO_RUN_LOCK_HOLDER"  # the pid whose run locks its child processes work under (the pipeline's)
_HELD: dict[Path, int | None] = {}  # directory -> lock descriptor held for this process's life; None: the parent's


class RunLockError(RuntimeError):
    """Another process holds a run directory's lock (the message names it), or the lock cannot be taken."""


@contextlib.contextmanager
def run_lock(*dirs: str | Path, command: str | None = None, for_children: bool = False) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<dir>/.lock`` for each of ``dirs`` (created if missing) while the block
    runs; the file names the holder's pid, command and start time, and a second process gets a
    :class:`RunLockError` naming it. Only the main process (``RANK`` 0) locks. ``for_children``: child processes
    that call :func:`hold_run_lock` meanwhile work under these locks. On NFS: docs/DESIGN.md section 11."""
    if not main_rank():
        yield
        return
    holder = _holder_line(command)
    with contextlib.ExitStack() as stack:
        for d in _directories(dirs):
            if d not in _HELD:
                stack.enter_context(_locked(d, holder))
        if for_children:
            stack.enter_context(_environment(HOLDER_ENV, str(os.getpid())))
        yield


def hold_run_lock(*dirs: str | Path, command: str) -> None:
    """Hold the run lock of each of ``dirs`` for the rest of this process (a notebook's kernel), letting go of
    those an earlier call held that are not among them. A child started under its parent's lock
    (``run_lock(..., for_children=True)``) works under that lock instead and is set to die with the parent."""
    if not main_rank():
        return
    paths = _directories(dirs)
    holder = _holder_line(command)
    for d in paths:
        if d not in _HELD:
            _HELD[d] = _take_or_share(d, holder)
    for d in [d for d in _HELD if d not in paths]:
        fd = _HELD.pop(d)
        if fd is not None:
            os.close(fd)


def _directories(dirs: tuple[str | Path, ...]) -> list[Path]:
    return list(dict.fromkeys(Path(d).expanduser().resolve() for d in dirs))  # one lock per directory


def _holder_line(command: str | None) -> str:
    """What a lock file says of its holder: pid, command, start time."""
    return json.dumps({"pid": os.getpid(), "command": command or " ".join(sys.argv),
                       "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}) + "\n"


@contextlib.contextmanager
def _environment(name: str, value: str) -> Iterator[None]:
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _take_or_share(directory: Path, holder: str) -> int | None:
    """The descriptor of ``directory``'s lock, taken; None where the parent holds it for this process (see
    :func:`hold_run_lock`); else a :class:`RunLockError`."""
    fd = _take(directory, holder)
    if fd is None and not _parent_holds(directory):
        raise _in_use(directory)
    return fd


def _parent_holds(directory: Path) -> bool:
    """Whether this process's parent holds ``directory``'s lock for it (:data:`HOLDER_ENV` and the lock file name
    the parent); if so, this process is set to die with it."""
    parent, said = os.getppid(), read_json(directory / LOCK_FILE)
    if os.environ.get(HOLDER_ENV) != str(parent) or not (isinstance(said, dict) and said.get("pid") == parent):
        return False
    die_with_parent()
    return os.getppid() == parent  # the parent did not end before the signal was set


@contextlib.contextmanager
def _locked(directory: Path, holder: str) -> Iterator[None]:
    fd = _take(directory, holder)
    if fd is None:
        raise _in_use(directory)
    try:
        yield
    finally:
        os.close(fd)  # releases the lock (the file stays: removing it would race with a waiting process)


def _take(directory: Path, holder: str) -> int | None:
    """A descriptor of ``directory``'s lock, taken, with ``holder`` written in it; None where another process holds
    it."""
    fd = _open(directory)
    try:
        if _flock(fd, directory):
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _open(directory: Path) -> int:
    """A descriptor of ``directory``'s lock file (both made if missing)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        return os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunLockError(f"cannot lock {directory} for this run: {exc.strerror} ({exc.filename})") from None


def _flock(fd: int, directory: Path) -> bool:
    """Take the lock of ``fd``: True; False where another process holds it; a :class:`RunLockError` where the file
    system cannot lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        raise RunLockError(f"cannot lock {directory} for this run: flock failed ({exc.strerror}); its file system "
                           "takes no locks (NFS without its lock daemon, some FUSE mounts): use a run directory on a "
                           "local disk") from None
    return True


def _in_use(directory: Path) -> RunLockError:
    return RunLockError(f"{directory} is in use by another run ({_holder(directory / LOCK_FILE)}); one run per "
                        "directory at a time: wait for it to end, or stop it")


def _holder(lock: Path) -> str:
    """Who holds ``lock``, from what it wrote there (it may not have written yet: a short wait)."""
    for _ in range(20):
        info = read_json(lock)
        if isinstance(info, dict) and "pid" in info:
            return f"pid {info['pid']}: {info.get('command', '?')}, since {info.get('started', '?')}"
        time.sleep(0.05)
    return "pid unknown"
