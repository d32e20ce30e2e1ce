"""Training batches of similar length (``train.bucket_by_length``): less padding per step. :class:`LengthBucketSampler`
sorts each shuffled window of ``window`` batches' worth by length, cuts it into batches and shuffles those; like
:class:`EpochSampler`, its order depends only on (seed, epoch), so a resumed training sees the same batches.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import Sampler

WINDOW = 32
"""Batches' worth of conversations sorted together. Larger pads less but varies batches less."""


class EpochSampler(Sampler[int]):
    """A permutation that depends only on (seed, epoch): resumable data order without RNG state."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())


def padded_tokens(lengths: Sequence[int], batches: Sequence[Sequence[int]]) -> int:
    """Tokens a right-padded collate of ``batches`` (lists of positions) computes on, padding included."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches if b)


class LengthBucketSampler(Sampler[list[int]]):
    """Batches of positions with similar ``lengths``, for ``DataLoader(batch_sampler=...)``; every position
    appears once per epoch, in ``ceil(n / batch_size)`` batches."""

    def __init__(self, lengths: Sequence[int], batch_size: int, seed: int, *, window: int = WINDOW) -> None:
        if batch_size < 1 or window < 1:
            raise ValueError(f"batch_size and window must be >= 1, got {batch_size} and {window}")
        self.lengths = [int(n) for n in lengths]
        self.batch_size, self.seed, self.window, self.epoch = batch_size, seed, window, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch_size)

    def batches(self) -> list[list[int]]:
        """This epoch's batches, in the order they are served."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        order = torch.randperm(len(self.lengths), generator=g).tolist()
        span = self.batch_size * self.window  # a multiple of batch_size: only the very last batch is short
        out: list[list[int]] = []
        for w in range(0, len(order), span):
            chunk = sorted(order[w:w + span], key=lambda i: self.lengths[i])  # stable: ties keep shuffled order
            out += [chunk[s:s + self.batch_size] for s in range(0, len(chunk), self.batch_size)]
        return [out[i] for i in torch.randperm(len(out), generator=g).tolist()]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches())
