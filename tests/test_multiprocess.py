"""Two real processes under ``accelerate launch`` on the CPU (gloo), on the smoke profile (issue 43, section 2).

Every other multi-process test simulates the processes one after the other (tests/test_features.py); these launch
them. The launcher is ``accelerate launch --multi_gpu --num_processes 2``: ``--cpu --num_processes 2`` starts ONE
process (accelerate's simple launcher spawns several only through ``mpirun`` with a hostfile; measured here with
accelerate 1.15, WORLD_SIZE unset in the child), and ``--multi_gpu`` is what spawns them (through
``torch.distributed.run``); on a machine without CUDA the processes then join a gloo group
(:func:`jakiro_lib.utils.distributed_state`). Each process runs one thread (two cores here).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).with_name("accelerate")
# 24 conversations keep 16 (the others have no assistant tokens), in 6 shards of 4: each process computes 3
SMOKE = ["--profile", "smoke", "--set", "data.num_conversations=24", "--set", "data.shard_size=4"]

from jakiro_lib.cli import BENCH_REFUSAL

pytestmark = pytest.mark.skipif(not ACCELERATE.is_file(), reason="accelerate's launcher is not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "JAKIRO_NO_BUSY_CHECK": "1",
            "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}


def launch_cmd(*args: str) -> list[str]:
    """``accelerate launch`` of ``python -m jakiro_lib <args>`` in two CPU processes (the command docs/usage.md shows)."""
    return [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
            "-m", "jakiro_lib", *args]


def one_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "jakiro_lib", *args]


def run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def caches(tmp_path_factory) -> dict[str, Path]:
    """The smoke cache made by one process and by two (run directories)."""
    base = tmp_path_factory.mktemp("mp")
    one, two = base / "one", base / "two"
    r1 = run(one_cmd("cache", *SMOKE, "--run-dir", str(one)))
    assert r1.returncode == 0, r1.stderr[-3000:]
    r2 = run(launch_cmd("cache", *SMOKE, "--run-dir", str(two)))
    assert r2.returncode == 0, r2.stderr[-3000:]
    return {"one": one, "two": two, "stderr_two": r2.stderr}


def test_two_process_caching_writes_the_single_process_shards(caches):
    one, two = caches["one"] / "features", caches["two"] / "features"
    err = caches["stderr_two"]
    assert "caching features [0/2]" in err and "caching features [1/2]" in err, err[-3000:]  # two did share it
    m1, m2 = (json.loads((d / "manifest.json").read_text()) for d in (one, two))
    assert m2["complete"] and m2["num_shards"] == m1["num_shards"] == 6
    assert m2["shards"] == m1["shards"]  # same counts, sizes and sha256 per shard
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())  # no sidecar left over
    for entry in m1["shards"]:
        assert (one / entry["file"]).read_bytes() == (two / entry["file"]).read_bytes(), entry["file"]


def test_benchmark_refuses_several_processes(tmp_path):
    r = run(launch_cmd("bench", "--profile", "smoke", "--run-dir", str(tmp_path / "run"), "--methods", "vanilla"))
    assert r.returncode != 0
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]
    assert lines == [BENCH_REFUSAL], (r.stdout + r.stderr)[-3000:]  # once, by the main process
    # no traceback of ours (the launcher then reports its failed child with a traceback of its own)
    assert f'File "{ROOT / "jakiro_lib"}' not in r.stderr
    assert not (tmp_path / "run" / "bench").exists()  # refused before anything ran
