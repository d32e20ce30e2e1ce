"""Small shared helpers: atomic writes, run metadata, seeding, cache location."""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import random
import shutil
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """Where converted models and feature caches live (``JAKIRO_CACHE`` or ``<repo>/.cache``)."""
    path = Path(os.environ.get("JAKIRO_CACHE", REPO_ROOT / ".cache"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling path; on success it replaces ``path`` (file or directory) atomically.

    A crash leaves the old content (or nothing) in place, never a half-written file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)) / path.name
    try:
        yield tmp
        if path.is_dir() and tmp.is_dir():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")


def read_json(path: str | Path) -> Any:
    """The JSON content of ``path``, or None when it is missing or unreadable (a cut write, say)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_jsonl(path: str | Path) -> list[Any]:
    """The records of a JSON-lines file, skipping lines an interrupted write cut short; [] when missing."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def world_size() -> int:
    """Processes of this run: ``WORLD_SIZE`` as ``accelerate launch`` / torchrun set it, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


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
        **extra,
    }
