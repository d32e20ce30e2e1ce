"""The run lock: one command writing a run directory at a time (an exclusive ``flock`` on ``<dir>/.lock``)."""
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

from .files import read_json
from .machine import main_rank

LOCK_FILE = ".lock"  # in a run directory (or a benchmark's --out folder) while a command writes there


class RunLockError(RuntimeError):
    """Another process holds a run directory's lock (the message names it), or the lock cannot be taken."""


@contextlib.contextmanager
def run_lock(*dirs: str | Path, command: str | None = None) -> Iterator[None]:
    """Hold an exclusive lock on each of ``dirs`` (created if missing) while the block runs: one writing run
    per run directory. Each is a ``flock`` on ``<dir>/.lock``, which holds the holder's pid, command and start
    time; a second process fails at once with a :class:`RunLockError` naming the holder. The kernel drops the
    lock when its holder exits, however it ends (SIGKILL included), so a lock is never stale. Under
    ``accelerate launch`` only the main process (``RANK`` 0) locks: the others are the same run.

    On NFS, Linux takes ``flock`` as a lock the server arbitrates (NFSv4, or v3 with its lock daemon), so runs on
    two machines sharing a run directory exclude each other too, and a lock of a machine that crashed lasts until
    the server lets it go (NFSv4's lease, about 90 s); a mount with ``nolock`` keeps locks to one machine. Where
    the file system cannot lock at all (``ENOLCK``: NFS without its lock daemon; ``EOPNOTSUPP``: some FUSE
    mounts), a :class:`RunLockError` says so before anything is written.
    """
    if not main_rank():
        yield
        return
    paths = list(dict.fromkeys(Path(d).expanduser().resolve() for d in dirs))  # one lock per directory
    holder = json.dumps({"pid": os.getpid(), "command": command or " ".join(sys.argv),
                         "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}) + "\n"
    with contextlib.ExitStack() as stack:
        for d in paths:
            stack.enter_context(_locked(d, holder))
        yield


@contextlib.contextmanager
def _locked(directory: Path, holder: str) -> Iterator[None]:
    fd = _open(directory)
    try:
        if not _flock(fd, directory):
            raise _in_use(directory)
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock (the file stays: removing it would race with a waiting process)


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
