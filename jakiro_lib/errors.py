"""How a command ends: the errors said in one line instead of a traceback, Ctrl-C, and the exit status."""
from __future__ import annotations

import errno
import sys
from typing import Callable


# The errors a command line reports as one line (no traceback): module -> class. A class is looked up only
# when its module is loaded (it cannot have been raised otherwise), so classifying imports nothing heavy.
KNOWN_ERRORS: dict[str, tuple[str, ...]] = {
    "jakiro_lib.config": ("ConfigError",), "jakiro_lib.models.draft": ("DraftLoadError",),
    "jakiro_lib.data.feature_store": ("CacheError",), "jakiro_lib.data.sources": ("DataError",),
    "jakiro_lib.training.train": ("TrainError",),
    "jakiro_lib.training.checkpoints": ("CheckpointError",),
    "jakiro_lib.report.stages": ("PipelineError",), "jakiro_lib.models.target": ("TargetError",),
    "jakiro_lib.decoding.result": ("ContextLengthError",), "jakiro_lib.decoding.compiled": ("CompileError",),
    "jakiro_lib.files": ("PathError",), "jakiro_lib.machine": ("LaunchError", "DeviceMemoryError"),
    "jakiro_lib.runlock": ("RunLockError",),
}


INTERRUPTED = "error: interrupted; finished work is kept (rerun the same command to resume)"


# Refusals of the file system that the user fixes, not the code: said in one line like the known errors
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)


def known_error(exc: BaseException) -> bool:
    """Whether ``exc`` is one of :data:`KNOWN_ERRORS` (its message is meant for the user as it is), or the file
    system refusing a path (:data:`UNWRITABLE`: no permission, read-only, full)."""
    if isinstance(exc, OSError) and exc.errno in UNWRITABLE and exc.filename is not None:
        return True
    classes = [getattr(sys.modules[m], n, None) for m, names in KNOWN_ERRORS.items() if m in sys.modules
               for n in names]
    return any(isinstance(exc, c) for c in classes if isinstance(c, type))


def error_line(exc: BaseException) -> str:
    """``error: <message>`` on one line (a multi-line message is joined)."""
    if isinstance(exc, OSError) and exc.errno in UNWRITABLE and exc.filename is not None:
        return f"error: {exc.strerror}: {exc.filename}"
    return "error: " + " ".join(str(exc).split())


def exit_status(call: Callable[[], int | None], *, hint: Callable[[], str] = lambda: "",
                also: tuple[type[BaseException], ...] = ()) -> int:
    """A command's exit status: ``call()``'s, or 130 after Ctrl-C and 1 after a known error (or one of
    ``also``), each said in one line on stderr instead of a traceback. Other exceptions propagate."""
    try:
        return int(call() or 0)
    except KeyboardInterrupt:
        close_progress_bars()
        print(INTERRUPTED, file=sys.stderr)
        return 130
    except Exception as exc:
        if not (known_error(exc) or isinstance(exc, also)):
            raise
        close_progress_bars()
        print(error_line(exc) + hint(), file=sys.stderr)
        return 1


def close_progress_bars() -> None:
    """Close the tqdm bars an error cut short, so that the error line starts a line of its own."""
    bars = getattr(getattr(sys.modules.get("tqdm"), "tqdm", None), "_instances", None) or ()
    for bar in list(bars):
        bar.close()
