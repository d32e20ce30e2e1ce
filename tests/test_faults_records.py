"""Faults around what the project writes and keeps: atomic writes flushed to the disk and the leftovers of a
killed writer swept; self-distillation resumed after a torn line and keyed by its data; benchmark records keyed
by what was asked and never displaced by a narrower run; a full disk, bad input and odd names said in one line.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jakiro_lib import files
from jakiro_lib.profiles import get_profile
from jakiro_lib.study import prepare_features

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("JAKIRO_NO_BUSY_CHECK", "1")  # other processes on a shared machine: not under test


# --------------------------------------------------------------------------------------------------
# Atomic writes: flushed before they take the name; a killed writer's leftovers swept
# --------------------------------------------------------------------------------------------------


def test_an_atomic_write_is_flushed_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    dest = tmp_path / "manifest.json"
    files.write_json(dest, {"shards": [1, 2]})
    names = [(kind, Path(p).name) for kind, p in events]
    assert names == [("fsync", "manifest.json"), ("replace", "manifest.json"), ("fsync", tmp_path.name)], events
    assert events[0][1] != str(dest)  # the temporary file, flushed before it takes the name
    events.clear()
    with files.atomic_path(tmp_path / "draft") as tmp:  # a folder: every file in it, then the folder
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"w")
        (tmp / "draft_config.json").write_text("{}")
    flushed = [Path(p).name for kind, p in events if kind == "fsync"]
    assert flushed[:-1] and set(flushed[:2]) == {"model.safetensors", "draft_config.json"}
    assert flushed[2] == "draft" and flushed[-1] == tmp_path.name and events[3] == ("replace", str(tmp_path / "draft"))


KILLED_WRITER = r"""
import os, sys
from jakiro_lib import files
with files.atomic_path(sys.argv[1]) as tmp:
    tmp.write_text("half a shard")
    os._exit(9)  # as SIGKILL would end it: no cleanup runs
"""


def killed_write(dest: Path) -> Path:
    """The temporary folder a writer killed inside :func:`files.atomic_path` leaves beside ``dest``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert subprocess.run([sys.executable, "-c", KILLED_WRITER, str(dest)], env=env).returncode == 9
    (left,) = [p for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.")]
    return left


def test_a_killed_writers_temporary_folder_is_swept_and_a_live_ones_kept(tmp_path):
    dead = killed_write(tmp_path / "records.jsonl")
    live = tmp_path / f".summary.csv.tmp{os.getpid()}@{socket.gethostname()}.abcd1234"
    elsewhere = tmp_path / ".summary.csv.tmp1@another-machine.abcd1234"  # its pid means nothing here
    mine_not = tmp_path / ".cache.tmp999999999"  # a user's, not of our naming
    for p in (live, elsewhere, mine_not):
        p.mkdir()
    assert files.sweep_temps(tmp_path) == [dead.name]
    assert not dead.exists() and live.is_dir() and elsewhere.is_dir() and mine_not.is_dir()


def test_the_feature_cache_sweeps_a_killed_writers_shard_when_it_starts(tmp_path):
    profile = get_profile("smoke", **{"data.num_conversations": "4", "data.shard_size": "2", "data.max_length": "64"})
    prepare_features(profile, tmp_path, progress=False)
    dead = killed_write(tmp_path / "features" / "shard_00001.safetensors")
    before = (tmp_path / "features" / "manifest.json").read_bytes()
    prepare_features(profile, tmp_path, progress=False)
    assert not dead.exists() and (tmp_path / "features" / "manifest.json").read_bytes() == before
