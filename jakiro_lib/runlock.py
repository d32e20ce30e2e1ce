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
    lock = directory / LOCK_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise RunLockError(f"cannot lock {directory} for this run: {exc.strerror} ({exc.filename})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunLockError(f"{directory} is in use by another run ({_holder(lock)}); one run per directory "
                               f"at a time: wait for it to end, or stop it") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, holder.encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock (the file stays: removing it would race with a waiting process)


def _holder(lock: Path) -> str:
    """Who holds ``lock``, from what it wrote there (it may not have written yet: a short wait)."""
    for _ in range(20):
        info = read_json(lock)
        if isinstance(info, dict) and "pid" in info:
            return f"pid {info['pid']}: {info.get('command', '?')}, since {info.get('started', '?')}"
        time.sleep(0.05)
    return "pid unknown"
