"""Files and folders that survive interruption: atomic writes and directory swaps, JSON, checksums, the run
lock, and path checks that say in one line what is wrong."""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    import pandas as pd


REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout this package runs from
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where converted models and feature caches live (``JAKIRO_CACHE`` or ``<repo>/.cache``)."""
    path = Path(os.environ.get("JAKIRO_CACHE", REPO_ROOT / ".cache"))
    path.mkdir(parents=True, exist_ok=True)
    return path


# The folder an atomic write builds its content in, beside the destination: ``.<name>.tmp<pid>@<host>.<random>``,
# so that a later run can tell the leftovers of a writer that is gone (killed mid-write) from a live writer's
_TEMP_NAME = re.compile(r"^\..+\.tmp(?P<pid>\d+)@(?P<host>[^/]+)\.[a-z0-9_]{8}$")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # what a write meets on a full disk, or past the user's quota


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path; on success it replaces ``path`` (file or directory) atomically, flushed
    to the disk first. A kill leaves the temporary folder (:func:`sweep_temps` removes it); a full disk raises
    an OSError that names ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}.tmp{os.getpid()}@{socket.gethostname()}."
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=path.parent)) / path.name
    try:
        yield tmp
        _fsync_tree(tmp)
        if path.is_dir() and tmp.is_dir():
            replace_dir_atomically(tmp, path)
        else:
            os.replace(tmp, path)
        fsync_path(path.parent)
    except OSError as exc:
        if exc.errno in DISK_FULL and exc.filename is None:  # a write on an open file names no path
            exc.filename = str(path)
        raise
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def fsync_path(path: str | Path) -> None:
    """Flush a file's or a folder's content (a folder: its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF):  # a file system that cannot sync a folder
            raise
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    """:func:`fsync_path` of a written file, or of every file and folder of a written folder (itself last)."""
    if path.is_dir():
        for p in sorted(path.rglob("*"), key=lambda p: -len(p.parts)):  # the deepest first
            if p.is_file() or p.is_dir():
                fsync_path(p)
    fsync_path(path)


def sweep_temps(directory: str | Path) -> list[str]:
    """Remove the temporary folders in ``directory`` left by :func:`atomic_path` writers of this machine that
    are gone; returns their names. A live writer's and another machine's are left alone."""
    directory, host = Path(directory), socket.gethostname()
    gone = []
    for entry in (os.scandir(directory) if directory.is_dir() else ()):
        m = _TEMP_NAME.match(entry.name)
        if m and m["host"] == host and entry.is_dir(follow_symlinks=False) and not _alive(int(m["pid"])):
            shutil.rmtree(entry.path, ignore_errors=True)
            gone.append(entry.name)
    if gone:
        log.info("%s: removed %d temporary folder(s) left by writes cut short: %s", directory, len(gone),
                 ", ".join(sorted(gone)))
    return gone


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def text_sha256(text: str) -> str:
    """Hex SHA-256 of a text's UTF-8 bytes (a lone surrogate kept as it is)."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def relative_path(path: str | Path, start: str | Path) -> str:
    """``path`` from ``start`` (both resolved), as a POSIX string: how a written config names a folder beside it
    without the machine's directories."""
    return Path(os.path.relpath(Path(path).resolve(), Path(start).resolve())).as_posix()


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def write_table(csv_path: Path, df: pd.DataFrame) -> None:
    """``df`` as ``csv_path`` and as records in the ``.json`` beside it (both written atomically)."""
    with atomic_path(csv_path) as tmp:
        df.to_csv(tmp, index=False)
    write_json(csv_path.with_suffix(".json"), json.loads(df.to_json(orient="records")))


def read_json(path: str | Path) -> Any:
    """The JSON content of ``path``, or None when it is missing or unreadable (a cut write, say)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_jsonl(path: str | Path) -> list[Any]:
    """The records of a JSON-lines file, skipping lines an interrupted write cut short (or bytes that are
    not text), with one warning counting them; [] when missing."""
    path = Path(path)
    if not path.is_file():
        return []
    out, bad = [], 0
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            bad += line.strip() != ""
    if bad:
        log.warning("%s: skipped %d unreadable line(s) (a write cut short, or not JSON)", path, bad)
    return out


def end_last_line(path: str | Path) -> None:
    """End a JSON-lines file's last line if a crash cut it short, so the next record appended starts its own."""
    path = Path(path)
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as fh:
        fh.seek(-1, os.SEEK_END)
        if fh.read(1) != b"\n":
            fh.write(b"\n")


def free_name(path: str | Path) -> Path:
    """``path`` if nothing is there, else the first free one of ``<stem>.1<suffix>``, ``<stem>.2<suffix>``, ..."""
    path = Path(path)
    stem, suffix, n = path.stem, path.suffix, 0
    while path.exists():
        n += 1
        path = path.with_name(f"{stem}.{n}{suffix}")
    return path


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def replace_dir_atomically(new: str | Path, dest: str | Path) -> None:
    """Put the complete directory ``new`` (a sibling of ``dest``) at ``dest``, replacing what was there: one
    ``renameat2(RENAME_EXCHANGE)`` on Linux; elsewhere ``dest`` goes to ``.<name>.old`` first, which
    :func:`restore_replaced_dir` puts back after a crash between the two renames."""
    new, dest = Path(new), Path(dest)
    if not dest.exists():
        os.replace(new, dest)
    elif _exchange(new, dest):
        shutil.rmtree(new)  # the old content, swapped out
    else:
        backup = _backup_of(dest)
        shutil.rmtree(backup, ignore_errors=True)
        os.replace(dest, backup)
        os.replace(new, dest)
        shutil.rmtree(backup)


def restore_replaced_dir(dest: str | Path) -> bool:
    """Put back a directory that :func:`replace_dir_atomically` moved aside and a crash left there."""
    dest = Path(dest)
    backup = _backup_of(dest)
    if dest.exists() or not backup.is_dir():
        return False
    os.replace(backup, dest)
    return True


def _backup_of(dest: Path) -> Path:
    return dest.with_name(f".{dest.name}.old")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 with RENAME_EXCHANGE); False where unsupported."""
    libc = c_library()
    fn = getattr(libc, "renameat2", None) if libc is not None else None
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):  # old kernel or a file system without it
        return False
    raise OSError(err, os.strerror(err), str(a))


class PathError(ValueError):
    """A path given on the command line that cannot serve as what it is for (a file where a directory must be)."""


def check_paths(*, dirs: dict[str, Path | None] | None = None, files: dict[str, Path | None] | None = None) -> None:
    """Refuse, before anything runs, output paths that could only fail later: a directory option (``dirs``,
    option name -> path) that names a file or lies below one, a file option (``files``) that names a directory."""
    dirs, files = dirs or {}, files or {}
    for option, path in [*dirs.items(), *files.items()]:
        if path is None:
            continue
        if option in files and Path(path).is_dir():
            raise PathError(f"{option} {path} is a directory; give a file name")
        start = Path(path) if option in dirs else Path(path).parent
        there = next((p for p in (start, *start.parents) if p.exists()), None)  # the nearest that exists
        if there is not None and not there.is_dir():
            raise PathError(f"{option} {path}: {there} is a file, not a directory")


PR_SET_PDEATHSIG = 1  # Linux prctl option: the signal a process gets when its parent ends


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent ends (Linux; elsewhere nothing)."""
    prctl = getattr(c_library(), "prctl", None) if sys.platform.startswith("linux") else None
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


@functools.lru_cache(maxsize=1)
def c_library() -> Any:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except OSError:
        return None
