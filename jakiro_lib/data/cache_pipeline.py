"""Feature caching as a pipeline, so that the device does not wait on the host: :class:`ShardTokens` tokenizes
the next shards in worker processes, :func:`to_host` copies a batch's rows off a GPU without waiting, and
:class:`ShardWriter` writes shard k on a background thread while shard k + 1 is computed. What is written is
the same bytes as without them.
"""
from __future__ import annotations

import hashlib
import logging
import math
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from safetensors.torch import save

from .chat import tokenize_conversation
from .feature_store import CacheError
from ..files import atomic_path, die_with_parent

log = logging.getLogger(__name__)

Tokens = tuple[list[int], list[int]]  # one conversation's token ids and loss mask
R = TypeVar("R")
AHEAD = 2  # shards tokenized ahead of the one the device works on
MAX_AUTO_WORKERS = 16


def worker_count(setting: int, processes: int = 1) -> int:
    """How many worker processes tokenize: ``setting`` when >= 2; 0 (auto): this process's share of the CPUs
    (``processes`` caching side by side) less one, at most 16. Fewer than 2 is 0: tokenized in this process."""
    if setting < 0:
        raise ValueError(f"tokenize_workers must be >= 0, got {setting}")
    if setting == 0:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        setting = min(cpus // max(processes, 1) - 1, MAX_AUTO_WORKERS)
    return setting if setting >= 2 else 0


# Tokenizing ahead

_WORKER: tuple[Any, int, str] | None = None  # in a worker process: (tokenizer, max_length, template)


def _start_worker(tokenizer: Any, max_length: int, template: str) -> None:
    """A worker's setup: Ctrl-C is for the caching process to handle, and the worker dies with it (Linux)."""
    global _WORKER
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a worker: the pool is the parallelism
    die_with_parent()  # no orphan left waiting for work when the caller is killed
    _WORKER = (tokenizer, max_length, template)


def _tokenize_chunk(convs: Sequence[Any]) -> list[Tokens]:
    """In a worker: (token ids, loss mask) of each conversation."""
    assert _WORKER is not None, "a tokenizing worker runs _start_worker first"
    tokenizer, max_length, template = _WORKER
    return [tokenize_conversation(tokenizer, conv, max_length, template) for conv in convs]


def _context() -> Any:
    """Workers forked where Linux allows (they start at once, the tokenizer already in memory), else spawned (the
    tokenizer pickled to each)."""
    return multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")


def _gather(futures: list[Future[list[Tokens]]]) -> list[Tokens]:
    """The chunks' tokens in order; a bad conversation raises what tokenizing it in this process raises."""
    try:
        return [tokens for future in futures for tokens in future.result()]
    except BrokenProcessPool as exc:
        raise CacheError(f"a tokenizing worker process died ({exc}); rerun to resume, or set "
                         "data.tokenize_workers=1 to tokenize in the caching process") from None
    except Exception as exc:  # noqa: BLE001 - the worker's own error, without the worker's traceback attached
        raise exc from None


class ShardTokens:
    """Each shard's (token ids, loss mask) per conversation, made by ``workers`` processes up to :data:`AHEAD` shards
    ahead of the one asked for (in ``order``), or in this process with fewer than 2 workers. Leaving the context
    stops the workers."""

    def __init__(self, tokenizer: Any, shard: Callable[[int], Sequence[Any]], order: Sequence[int], *,
                 max_length: int, template: str, workers: int) -> None:
        self._tokenizer, self._shard, self._order = tokenizer, shard, list(order)
        self._max_length, self._template, self._workers = max_length, template, workers
        self._pending: dict[int, list[Future[list[Tokens]]]] = {}  # shard index -> its chunks, submitted
        self._submitted = 0  # how many of order are submitted
        self._pool: ProcessPoolExecutor | None = None
        if workers >= 2 and self._order:
            self._pool = ProcessPoolExecutor(workers, mp_context=_context(), initializer=_start_worker,
                                             initargs=(tokenizer, max_length, template))
            self._submit_through(0)

    def get(self, index: int) -> list[Tokens]:
        """Shard ``index``'s (token ids, loss mask) per conversation, in input order."""
        if self._pool is None:
            return [tokenize_conversation(self._tokenizer, conv, self._max_length, self._template)
                    for conv in self._shard(index)]
        self._submit_through(self._order.index(index))
        return _gather(self._pending.pop(index))

    def _submit_through(self, position: int) -> None:
        """Hand the workers the shards of ``order`` up to ``position + AHEAD``, each in about 2 chunks a worker."""
        assert self._pool is not None
        while self._submitted < min(position + AHEAD + 1, len(self._order)):
            index = self._order[self._submitted]
            convs = list(self._shard(index))
            size = max(1, math.ceil(len(convs) / (2 * self._workers)))
            self._pending[index] = [self._pool.submit(_tokenize_chunk, convs[s:s + size])
                                    for s in range(0, len(convs), size)]
            self._submitted += 1

    def __enter__(self) -> ShardTokens:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


# Copying to the host and writing behind


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tensors`` on the host, one copy each; from a GPU into pinned memory without waiting for the device:
    synchronize it before reading them. Host tensors come back as they are."""
    if not tensors or not tensors[0].is_cuda:
        return tensors
    host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
    for dst, src in zip(host, tensors):
        dst.copy_(src, non_blocking=True)
    return host



def store_shard(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[int, str]:
    """Write ``tensors`` to ``path`` atomically as ``safetensors.torch.save_file`` would, byte for byte; returns
    the file's (size, sha256), hashed in memory rather than read back."""
    data = save(tensors, metadata=metadata)
    sha = hashlib.sha256(data).hexdigest()  # releases the GIL
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return len(data), sha


class ShardWriter(Generic[R]):
    """Writes run one at a time on a background thread, in order; ``written(index, result)`` is called on the
    caller's thread for each, where a write's error is raised too. Leaving the context waits for a write under
    way and raises its error (logs it when another error is on its way out)."""

    def __init__(self, written: Callable[[int, R], None] | None = None) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="shard-writer")
        self._pending: tuple[int, Future[R]] | None = None
        self._written = written

    def put(self, index: int, write: Callable[[], R]) -> None:
        """Start ``write`` (shard ``index``) once the write before has ended."""
        self.wait()
        self._pending = (index, self._thread.submit(write))

    def wait(self) -> None:
        """Wait for the write under way, if any, and hand on its result."""
        if self._pending is None:
            return
        (index, future), self._pending = self._pending, None
        result = future.result()
        if self._written is not None:
            self._written(index, result)

    def __enter__(self) -> ShardWriter[R]:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        pending, self._pending = self._pending, None
        self._thread.shutdown(wait=True)
        failed = pending[1].exception() if pending is not None else None
        if failed is not None and exc is None:
            raise failed
        if failed is not None:
            log.error("writing shard %d failed too: %s", pending[0], failed)
