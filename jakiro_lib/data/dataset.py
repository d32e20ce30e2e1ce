"""What draft training reads: datasets over a feature cache (:class:`FeatureDataset`) or a live target
(:class:`OnlineFeatureDataset`, the same items), their train / held-out split, :func:`collate`, and the
reduced draft vocabulary (docs/DESIGN.md section 4).
"""
from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch.utils.data import Dataset

from .chat import tokenize_conversation
from .feature_store import CacheError, read_manifest, verify_cache
from .features import target_features, target_top1

SPLITS = ("train", "heldout", "all")


def _stable_hash(i: int) -> int:
    """splitmix64 of a conversation index: a split that does not depend on the order of anything else."""
    z = (i + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def split_indices(conversation_indices: Sequence[int], split: str, heldout_fraction: float) -> list[int]:
    """Positions (into ``conversation_indices``) of the requested split. Held-out: the ``round(n * fraction)``
    conversations (at least one when fraction > 0 and n > 1) with the smallest hash of their index."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if not 0.0 <= heldout_fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    n = len(conversation_indices)
    if split == "all":
        return list(range(n))
    n_held = round(n * heldout_fraction)
    if heldout_fraction > 0 and n > 1:
        n_held = max(1, n_held)
    order = sorted(range(n), key=lambda p: (_stable_hash(int(conversation_indices[p])), p))
    held = set(order[:n_held])
    return [p for p in range(n) if (p in held) == (split == "heldout")]


class FeatureDataset(Dataset):
    """Per-conversation items from a memory-mapped feature cache: ``input_ids`` LongTensor[L], ``hidden``
    [L, H] (``dtype``), ``loss_mask`` LongTensor[L] (0/1), ``target_top1`` LongTensor[L], ``index`` (the
    conversation's input index)."""

    def __init__(self, cache_dir: str | Path, split: str = "train", heldout_fraction: float = 0.05, *,
                 dtype: torch.dtype | None = torch.float32, verify: bool = True) -> None:
        self.cache_dir = Path(cache_dir)
        self.manifest = verify_cache(self.cache_dir) if verify else read_manifest(self.cache_dir)
        if self.manifest is None:
            raise CacheError(f"no feature cache at {self.cache_dir}")
        self.split = split
        self.heldout_fraction = heldout_fraction
        self.dtype = dtype
        self.vocab_size = self.manifest["vocab_size"]
        items: list[tuple[str, int, int, int]] = []  # (file, start, end, conversation index)
        for entry in self.manifest["shards"]:
            if entry["conversations"] == 0:
                continue
            with safe_open(str(self.cache_dir / entry["file"]), "pt") as f:
                offsets = f.get_tensor("offsets").tolist()
                index = f.get_tensor("conversation_index").tolist()
            items.extend((entry["file"], s, e, i) for (s, e), i in zip(offsets, index))
        keep = split_indices([it[3] for it in items], split, heldout_fraction)
        self.items = [items[p] for p in keep]
        self._handles: dict[str, Any] = {}

    def __len__(self) -> int:
        return len(self.items)

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers reopen their own handles
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state

    def _handle(self, name: str) -> Any:
        h = self._handles.get(name)
        if h is None:
            h = self._handles[name] = safe_open(str(self.cache_dir / name), "pt")
        return h

    def lengths(self) -> list[int]:
        return [e - s for _, s, e, _ in self.items]

    def token_arrays(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input_ids, loss_mask) of each item, without reading the features."""
        for name, s, e, _ in self.items:
            f = self._handle(name)
            yield f.get_slice("input_ids")[s:e].long(), f.get_slice("loss_mask")[s:e].long()

    def __getitem__(self, i: int) -> dict[str, Any]:
        name, s, e, index = self.items[i]
        f = self._handle(name)
        hidden = f.get_slice("hidden")[s:e]
        return {
            "input_ids": f.get_slice("input_ids")[s:e].long(),
            "hidden": hidden if self.dtype is None else hidden.to(self.dtype),
            "loss_mask": f.get_slice("loss_mask")[s:e].long(),
            "target_top1": f.get_slice("target_top1")[s:e].long(),
            "index": index,
        }


class OnlineFeatureDataset(Dataset):
    """Same items as :class:`FeatureDataset`, computed by the target on the fly (use ``num_workers=0``).
    Conversations are tokenized up front, so that empty-mask ones are dropped as the cache drops them."""

    def __init__(self, target: Any, conversations: Sequence[Any], max_length: int, template: str = "auto", *,
                 split: str = "all", heldout_fraction: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        self.target = target
        self.max_length = max_length
        self.template = template
        self.dtype = dtype
        self.vocab_size = target.model.config.vocab_size
        formatted = []
        for i, conv in enumerate(conversations):
            ids, mask = tokenize_conversation(target.tokenizer, conv, max_length, template)
            if sum(mask) > 0:
                formatted.append((i, ids, mask))
        self.skipped_empty_mask = len(conversations) - len(formatted)
        keep = split_indices([f[0] for f in formatted], split, heldout_fraction)
        self.items = [formatted[p] for p in keep]

    def __len__(self) -> int:
        return len(self.items)

    def lengths(self) -> list[int]:
        return [len(ids) for _, ids, _ in self.items]

    def token_arrays(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _, ids, mask in self.items:
            yield torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)

    def __getitem__(self, i: int) -> dict[str, Any]:
        index, ids, mask = self.items[i]
        x = torch.tensor(ids, dtype=torch.long)
        h = target_features(self.target.model, x)[0]
        return {
            "input_ids": x,
            "hidden": h.to(self.dtype).cpu(),
            "loss_mask": torch.tensor(mask, dtype=torch.long),
            "target_top1": target_top1(self.target.model, h).cpu(),
            "index": index,
        }


# Reduced draft vocabulary


UNMASKED_WEIGHT = 0.01  # a prompt token's count in token_frequencies, against an assistant token's 1


def token_frequencies(dataset: Any, vocab_size: int) -> torch.Tensor:
    """Weighted token counts [vocab] (float64) of a dataset's ``token_arrays()``: an assistant (loss-mask) token
    counts 1, any other token :data:`UNMASKED_WEIGHT`, so that ids seen only in prompts still rank above never-seen
    ids."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for ids, mask in dataset.token_arrays():
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"token id {int(ids.max())} is outside the vocabulary of {vocab_size}")
        counts.index_add_(0, ids, torch.where(mask > 0, 1.0, UNMASKED_WEIGHT).to(torch.float64))
    return counts


def build_draft_vocab(freqs: torch.Tensor, size: int, *, always: Sequence[int] = ()) -> torch.LongTensor:
    """``d2t``: the ``size`` most frequent ids (ties: the smaller id), sorted ascending; ``always`` (e.g. the
    EOS ids) included whatever their count."""
    freqs = torch.as_tensor(freqs, dtype=torch.float64)
    V = freqs.numel()
    if not 1 <= size <= V:
        raise ValueError(f"draft vocab size must be in [1, {V}], got {size}")
    score = freqs.clone()
    forced = [int(i) for i in always if 0 <= int(i) < V]
    if len(set(forced)) > size:
        raise ValueError(f"{len(set(forced))} forced ids do not fit a draft vocab of {size}")
    if forced:
        score[forced] = math.inf
    # stable sort on -score keeps ascending ids among equal counts
    order = np.argsort(-score.numpy(), kind="stable")[:size]
    return torch.as_tensor(np.sort(order), dtype=torch.long)


def vocab_coverage(freqs: torch.Tensor, d2t: torch.Tensor) -> float:
    """Fraction of the (weighted) token mass the draft vocabulary covers."""
    total = float(freqs.sum())
    return float(freqs[d2t].sum()) / total if total > 0 else 0.0


# Batching


def collate(batch: Sequence[dict[str, Any]], multiple: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad items to the batch's longest, rounded up to a multiple of ``multiple``: ``input_ids`` [B, T]
    (pad 0), ``hidden`` [B, T, H] (pad 0), ``loss_mask`` [B, T] float (0 on padding), ``attention_mask``
    [B, T] long, ``target_top1`` [B, T] (pad -1), ``lengths`` [B], ``index`` [B]."""
    if not batch:
        raise ValueError("empty batch")
    B = len(batch)
    T = max(int(item["input_ids"].shape[0]) for item in batch)
    T += -T % multiple
    H = batch[0]["hidden"].shape[-1]
    out = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "hidden": torch.zeros(B, T, H, dtype=batch[0]["hidden"].dtype),
        "loss_mask": torch.zeros(B, T, dtype=torch.float32),
        "attention_mask": torch.zeros(B, T, dtype=torch.long),
        "lengths": torch.zeros(B, dtype=torch.long),
        "index": torch.tensor([int(item.get("index", -1)) for item in batch], dtype=torch.long),
    }
    out["target_top1"] = torch.full((B, T), -1, dtype=torch.long)
    for b, item in enumerate(batch):
        n = int(item["input_ids"].shape[0])
        out["input_ids"][b, :n] = item["input_ids"]
        out["hidden"][b, :n] = item["hidden"]
        out["loss_mask"][b, :n] = torch.as_tensor(item["loss_mask"]).float()
        out["attention_mask"][b, :n] = 1
        out["lengths"][b] = n
        out["target_top1"][b, :n] = item["target_top1"]
    return out
