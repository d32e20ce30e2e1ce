"""How a command ends: the errors said in one line instead of a traceback, Ctrl-C, and the exit status."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
from pathlib import Path
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

from .files import DISK_FULL


# The errors a command line reports as one line (no traceback): module -> class. A class is looked up only
# when its module is loaded (it cannot have been raised otherwise), so classifying imports nothing heavy.
KNOWN_ERRORS: dict[str, tuple[str, ...]] = {
    "jakiro_lib.config": ("ConfigError",), "jakiro_lib.models.draft": ("DraftLoadError",),
    "jakiro_lib.data.feature_store": ("CacheError",), "jakiro_lib.data.sources": ("DataError",),
    "jakiro_lib.training.train": ("TrainError",),
    "jakiro_lib.training.checkpoints": ("CheckpointError",),
    "jakiro_lib.report.stages": ("PipelineError",), "jakiro_lib.models.target": ("TargetError",),
    "jakiro_lib.decoding.result": ("ContextLengthError",),
    "jakiro_lib.files": ("PathError",), "jakiro_lib.distributed": ("LaunchError",),
    "jakiro_lib.compiling": ("DeviceMemoryError", "CompileError"),
    "jakiro_lib.runlock": ("RunLockError",), "jakiro_lib.study.stamps": ("RecordsError",),
}


INTERRUPTED = "error: interrupted; finished work is kept (rerun the same command to resume)"


# Refusals of the file system that the user fixes, not the code: said in one line like the known errors
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)
# What torch.save's writer raises when a write fails (a full disk): its C++ stream's errors, the second one raised
# while closing the file during the first
TORCH_WRITE_FAILED = ("iostream error", "PytorchStreamWriter failed", "file write failed")


def known_error(exc: BaseException) -> bool:
    """Whether ``exc`` is one of :data:`KNOWN_ERRORS` (its message is meant for the user as it is), the file
    system refusing a path (:data:`UNWRITABLE`: no permission, read-only) or a full disk (:func:`disk_full`)."""
    if isinstance(exc, OSError) and exc.errno in UNWRITABLE and exc.filename is not None or disk_full(exc):
        return True
    classes = [getattr(sys.modules[m], n, None) for m, names in KNOWN_ERRORS.items() if m in sys.modules
               for n in names]
    return any(isinstance(exc, c) for c in classes if isinstance(c, type))


def disk_full(exc: BaseException | None) -> BaseException | None:
    """The full-disk error in ``exc`` or in the errors it was raised from or while handling: an OSError of
    :data:`~jakiro_lib.files.DISK_FULL` (no space, over quota), or torch.save's writer failing
    (:data:`TORCH_WRITE_FAILED`); None if there is none."""
    for e in cause_chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return e
        if isinstance(e, RuntimeError) and any(m in str(e) for m in TORCH_WRITE_FAILED):
            return e
    return None


def cause_chain(e: BaseException | None) -> Iterator[BaseException]:
    """``e`` and the exceptions it was raised from or during, outermost first (nothing for None)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def error_line(exc: BaseException, written: Sequence[Path] = ()) -> str:
    """``error: <message>`` on one line (a multi-line message is joined); a full disk names the path written (or
    else the first of the command's ``written`` folders) and the disk, with its free space."""
    failure = disk_full(exc)
    if failure is not None:
        return _disk_full_line(failure, written)
    if isinstance(exc, OSError) and exc.errno in UNWRITABLE and exc.filename is not None:
        return f"error: {exc.strerror}: {exc.filename}"
    return "error: " + " ".join(str(exc).split())


def _disk_full_line(failure: BaseException, written: Sequence[Path]) -> str:
    named = isinstance(failure, OSError) and failure.filename is not None
    path = Path(os.fsdecode(failure.filename)) if named else (Path(written[0]) if written else Path.cwd())
    there = next(p for p in (path.absolute(), *path.absolute().parents) if p.exists())
    disk = next(p for p in (there, *there.parents) if os.path.ismount(p))
    free = f"{shutil.disk_usage(there).free / 2 ** 20:.1f} MiB free"
    advice = "free some space there (or write elsewhere) and rerun: finished work is kept"
    if isinstance(failure, OSError):
        return f"error: {failure.strerror} writing {path}: the disk {disk} is full ({free}); {advice}"
    cause = " ".join(str(failure).split())
    return (f"error: writing under {path} failed ({cause}): is the disk {disk} full? ({free}); {advice}")


@dataclass
class ExitStatus:
    """The status a command exits with: 0, what the command's block sets, or what :func:`exit_status` says."""
    code: int = 0


@contextlib.contextmanager
def exit_status(*, hint: Callable[[], str] = lambda: "", also: tuple[type[BaseException], ...] = (),
                written: Callable[[], Sequence[Path]] = lambda: ()) -> Iterator[ExitStatus]:
    """Around a command's block: Ctrl-C ends it with status 130 and a known error (or one of ``also``) with 1, each
    said in one line on stderr instead of a traceback; other exceptions propagate. ``written``: the folders the
    command writes in, named where a full disk stopped a write that named no path."""
    status = ExitStatus()
    try:
        yield status
    except KeyboardInterrupt:
        close_progress_bars()
        print(INTERRUPTED, file=sys.stderr)
        status.code = 130
    except Exception as exc:
        if not (known_error(exc) or isinstance(exc, also)):
            raise
        close_progress_bars()
        print(error_line(exc, written()) + hint(), file=sys.stderr)
        status.code = 1


def close_progress_bars() -> None:
    """Close the tqdm bars an error cut short, so that the error line starts a line of its own."""
    bars = getattr(getattr(sys.modules.get("tqdm"), "tqdm", None), "_instances", None) or ()
    for bar in list(bars):
        bar.close()
