"""Target hidden-state features for draft training: the target forward and a sharded, resumable disk cache. The feature
at t is the target's last hidden state after its final norm (docs/DESIGN.md section 4); the cache's format is in
:mod:`jakiro_lib.data.feature_store`, the pipeline around the forwards in :mod:`jakiro_lib.data.cache_pipeline`, what
training reads in :mod:`jakiro_lib.data.dataset`.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .cache_pipeline import ShardTokens, ShardWriter, Tokens, store_shard, to_host, worker_count
from .chat import conversation_id, messages_of, tokenize_conversation
from .feature_store import (FORMAT, bytes_per_token, cache_settings, cached_shards, estimate_disk, feature_torch_dtype,
                            human_bytes, merge_sidecars, shard_name, sidecar_path, summarise)
from ..layout import MANIFEST
from ..files import write_json
from ..distributed import World, launched_world
from ..machine import keep_freed_memory, run_metadata, synchronize

log = logging.getLogger(__name__)
ESTIMATE_CHUNK = 256  # conversations per worker task when estimate_cache tokenizes in workers


# Target features


@torch.no_grad()
def target_features(model: torch.nn.Module, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The target's last hidden state after the final norm (the input of ``lm_head``): [B, L, H], from
    ``input_ids`` [L] or [B, L] (``model.model`` is the decoder)."""
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    device = next(model.parameters()).device
    mask = None if attention_mask is None else attention_mask.to(device, non_blocking=True)
    out = model.model(input_ids=input_ids.to(device, non_blocking=True), attention_mask=mask, use_cache=False)
    return out.last_hidden_state


@torch.no_grad()
def target_top1(model: torch.nn.Module, hidden: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Full-vocabulary argmax of ``lm_head(hidden)`` ([..., H] -> [...] long), in chunks of positions."""
    head = model.get_output_embeddings()
    flat = hidden.reshape(-1, hidden.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
    for s in range(0, flat.shape[0], chunk):
        out[s:s + chunk] = head(flat[s:s + chunk].to(head.weight.dtype)).argmax(-1)
    return out.reshape(hidden.shape[:-1])


def _source_sha(convs: Sequence[Any], start: int) -> str:
    """Fingerprint of a shard's input conversations, so a rerun on other data never reuses it."""
    h = hashlib.sha256()
    for i, c in enumerate(convs):
        h.update(json.dumps([conversation_id(c, start + i), messages_of(c)], sort_keys=True, default=str).encode())
    return h.hexdigest()


def estimate_cache(target: Any, conversations: Sequence[Any], *, max_length: int, template: str = "auto",
                   feature_dtype: str = "float16", tokenize_workers: int = 1) -> dict[str, Any]:
    """Tokenize (no target forward; ``tokenize_workers`` as :func:`cache_features`'s) and return token counts
    and the disk the cache would take."""
    tokens = loss_tokens = kept = 0
    n, chunk = math.ceil(len(conversations) / ESTIMATE_CHUNK), ESTIMATE_CHUNK
    with ShardTokens(target.tokenizer, lambda i: conversations[i * chunk:(i + 1) * chunk], range(n),
                     max_length=max_length, template=template, workers=worker_count(tokenize_workers)) as made:
        for ids, mask in (pair for i in range(n) for pair in made.get(i)):
            if sum(mask):
                kept, tokens, loss_tokens = kept + 1, tokens + len(ids), loss_tokens + sum(mask)
    H = target.model.config.hidden_size
    size = estimate_disk(tokens, H, feature_dtype)
    return {"conversations": kept, "skipped_empty_mask": len(conversations) - kept, "tokens": tokens,
            "loss_tokens": loss_tokens, "bytes": size, "human": human_bytes(size),
            "bytes_per_token": bytes_per_token(H, feature_dtype)}


# Writing the cache

PAD_ID = 0  # token id on padded positions of a batched forward; masked out, so any id gives the same rows


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Positions grouped into batches of at most ``batch_size``, sorted by length, the longest batch first (so
    that running out of memory shows at once)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]


@torch.no_grad()
def batch_features(model: torch.nn.Module, seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden rows [sum L, H] and full-vocabulary top-1 [sum L] of token sequences, one sequence after another,
    from ONE right-padded forward on the model's device; each row equals the one-sequence forward's up to float
    rounding. Equal lengths run without a mask."""
    lens = [len(s) for s in seqs]
    T = max(lens)
    ids = torch.full((len(seqs), T), PAD_ID, dtype=torch.long)  # [B, T]
    mask = torch.zeros(len(seqs), T, dtype=torch.long)  # [B, T], 1 on real tokens
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[b, :len(s)] = 1
    real = mask.view(-1).nonzero().squeeze(1)  # [sum L], the real positions of the flat [B * T], in order
    if next(model.parameters()).is_cuda:
        ids, mask, real = ids.pin_memory(), mask.pin_memory(), real.pin_memory()
    h = target_features(model, ids, None if min(lens) == T else mask)  # [B, T, H]
    rows = h.reshape(-1, h.shape[-1]).index_select(0, real.to(h.device, non_blocking=True))  # [sum L, H]
    return rows, target_top1(model, rows)  # [sum L, H], [sum L]


def _cat(parts: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else empty


def shard_tensors(target: Any, convs: Sequence[Any], start: int, *, max_length: int, template: str, dtype: torch.dtype,
                  bar: Any, batch_size: int = 1, formatted: Sequence[Tokens] | None = None,
                  ) -> tuple[dict[str, torch.Tensor], list[str], int]:
    """One shard's tensors (in input order), its kept conversations' ids and its count of skipped (empty-mask)
    ones; ``batch_size`` conversations per forward. ``formatted``: the (token ids, loss mask) made ahead; None
    tokenizes them here."""
    if formatted is None:
        formatted = [tokenize_conversation(target.tokenizer, conv, max_length, template) for conv in convs]
    kept = [i for i, (_, mask) in enumerate(formatted) if sum(mask) > 0]
    if bar is not None:
        bar.update(len(convs) - len(kept))  # skipped ones are done
    feats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # input position -> (hidden [L, H], top-1 [L])
    for group in length_batches([len(formatted[i][0]) for i in kept], batch_size):
        positions = [kept[g] for g in group]
        lens = [len(formatted[i][0]) for i in positions]
        rows, top = batch_features(target.model, [formatted[i][0] for i in positions])  # [sum L, H], [sum L]
        rows, top = to_host(rows.to(dtype), top.to(torch.int32))  # one copy each: no wait for the device
        feats.update(zip(positions, zip(rows.split(lens), top.split(lens))))
        if bar is not None:
            bar.update(len(group))
    synchronize(target.device)  # the copies to the host have landed
    ends = np.cumsum([0] + [len(formatted[i][0]) for i in kept])  # [n + 1]
    H = target.model.config.hidden_size
    tensors = {
        "input_ids": _cat([torch.tensor(formatted[i][0], dtype=torch.int32) for i in kept],
                          torch.zeros(0, dtype=torch.int32)),  # [T]
        "hidden": _cat([feats[i][0] for i in kept], torch.zeros(0, H, dtype=dtype)),  # [T, H]
        "loss_mask": _cat([torch.tensor(formatted[i][1], dtype=torch.uint8) for i in kept],
                          torch.zeros(0, dtype=torch.uint8)),  # [T]
        "target_top1": _cat([feats[i][1] for i in kept], torch.zeros(0, dtype=torch.int32)),  # [T]
        "offsets": torch.tensor(np.stack([ends[:-1], ends[1:]], 1), dtype=torch.int64).reshape(-1, 2),  # [n, 2]
        "conversation_index": torch.tensor([start + i for i in kept], dtype=torch.int64),  # [n]
    }
    return tensors, [conversation_id(convs[i], start + i) for i in kept], len(convs) - len(kept)


@dataclass(frozen=True)
class _Job:
    """One caching call's fixed inputs: what every shard step reads."""

    target: Any
    conversations: Sequence[Any]
    out_dir: Path
    shard_size: int
    max_length: int
    template: str
    dtype: torch.dtype
    batch_size: int
    world: World
    fixed: dict[str, Any]  # the settings a rerun must match
    workers: int  # processes tokenizing ahead (cache_pipeline.worker_count); 0: tokenized in this one

    @property
    def n_shards(self) -> int:
        return math.ceil(len(self.conversations) / self.shard_size)

    @property
    def mine(self) -> range:
        """This process's shards."""
        return range(self.world.index, self.n_shards, self.world.size)

    def shard(self, index: int) -> Sequence[Any]:
        """Shard ``index``'s input conversations."""
        return self.conversations[index * self.shard_size:(index + 1) * self.shard_size]


def _plan(target: Any, conversations: Sequence[Any], out_dir: str | Path, world: World | None, *, max_length: int,
          shard_size: int, feature_dtype: str, template: str, batch_size: int,
          workers: int) -> tuple[_Job, dict[str, Any]]:
    """The call's job and the settings its manifest records; the target on this process's device and
    ``out_dir`` made."""
    if shard_size < 1 or batch_size < 1:
        raise ValueError(f"shard_size and batch_size must be >= 1, got {shard_size} and {batch_size}")
    world = launched_world() if world is None else world
    workers = worker_count(workers, world.size)
    if world.device is not None and target.model.device != torch.device(world.device):
        target.model.to(world.device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = feature_torch_dtype(feature_dtype)
    settings = cache_settings(target, max_length=max_length, shard_size=shard_size,
                         feature_dtype=str(dtype).removeprefix("torch."), template=template,
                         num_input=len(conversations))
    fixed = {k: v for k, v in settings.items() if k != "num_input_conversations"}
    job = _Job(target, conversations, out_dir, shard_size, max_length, template, dtype, batch_size, world, fixed,
               workers)
    return job, settings


def _new_manifest(job: _Job, settings: dict[str, Any]) -> dict[str, Any]:
    """The manifest this run fills, shard by shard."""
    return {
        **settings, "settings": settings, "cache_batch_size": job.batch_size,
        "num_shards_expected": job.n_shards, "shards": [], "run_metadata": run_metadata(job.target.device),
    }


def _reusable_shards(job: _Job, done: dict[str, dict[str, Any]]) -> set[int]:
    """The shards whose verified entry holds these very conversations (logged by the main process)."""
    reuse = set()
    for index in range(job.n_shards):
        entry = done.get(shard_name(index))
        start = index * job.shard_size
        if entry is not None and entry.get("first_conversation") == start \
                and entry.get("source_sha256") == _source_sha(job.shard(index), start):
            reuse.add(index)
    if reuse and job.world.index == 0:
        log.info("resuming: %d of %d shards present in %s", len(reuse), job.n_shards, job.out_dir)
    return reuse


def _progress_bar(job: _Job, progress: bool) -> Any:
    """A bar over this process's conversations, None without ``progress``."""
    if not progress:
        return None
    total = sum(len(job.shard(s)) for s in job.mine)
    desc = "caching features" + (f" [{job.world.index}/{job.world.size}]" if job.world.size > 1 else "")
    return tqdm(total=total, desc=desc, unit="conv")


def _store_shard(job: _Job, manifest: dict[str, Any], index: int, tensors: dict[str, torch.Tensor],
                 conv_ids: list[str], skipped: int) -> dict[str, Any]:
    """Shard ``index`` written atomically and recorded (on the writer's thread); returns its manifest entry."""
    name = shard_name(index)
    convs, start = job.shard(index), index * job.shard_size
    # one metadata key: safetensors writes several in hash order, and shards are byte-identical when their content is
    meta = json.dumps({"format": FORMAT, "conversation_ids": conv_ids})
    size, sha = store_shard(job.out_dir / name, tensors, {"jakiro": meta})
    entry = {
        "file": name, "index": index, "first_conversation": start, "input_conversations": len(convs),
        "conversations": int(tensors["offsets"].shape[0]), "skipped_empty_mask": skipped,
        "tokens": int(tensors["input_ids"].shape[0]), "loss_tokens": int(tensors["loss_mask"].sum()),
        "bytes": size, "sha256": sha, "source_sha256": _source_sha(convs, start), "batch_size": job.batch_size,
    }
    _record_shard(job, manifest, index, entry)
    return entry


def _record_shard(job: _Job, manifest: dict[str, Any], index: int, entry: dict[str, Any]) -> None:
    """A new shard into the manifest, rewritten atomically (main process), else into its sidecar."""
    if job.world.index == 0:
        manifest["shards"].append(entry)
        summarise(manifest)
        write_json(job.out_dir / MANIFEST, manifest)
    else:
        write_json(sidecar_path(job.out_dir, index), {"settings": job.fixed, "shard": entry})


def _cache_shards(job: _Job, manifest: dict[str, Any], reuse: set[int], done: dict[str, dict[str, Any]],
                  damaged: dict[str, str], bar: Any,
                  on_shard: Callable[[int, dict[str, Any]], None] | None) -> None:
    """Every shard in order: a reused one listed by the main process, each of this process's others computed
    while the next ones are tokenized (:class:`ShardTokens`) and the one before is written (:class:`ShardWriter`)."""
    todo = [s for s in job.mine if s not in reuse]
    with ShardTokens(job.target.tokenizer, job.shard, todo, max_length=job.max_length, template=job.template,
                     workers=job.workers) as tokens, ShardWriter[dict[str, Any]](on_shard) as writer:
        for s in range(job.n_shards):
            if s in reuse:
                writer.wait()  # the shard before is in the manifest first
                if job.world.index == 0:
                    manifest["shards"].append(done[shard_name(s)])
                if bar is not None and s in job.mine:
                    bar.update(len(job.shard(s)))
            elif s in job.mine:
                if shard_name(s) in damaged:
                    log.warning("rewriting damaged shard %s: %s", shard_name(s), damaged[shard_name(s)])
                computed = shard_tensors(job.target, job.shard(s), s * job.shard_size, max_length=job.max_length,
                                         template=job.template, dtype=job.dtype, bar=bar, batch_size=job.batch_size,
                                         formatted=tokens.get(s))
                writer.put(s, functools.partial(_store_shard, job, manifest, s, *computed))
        writer.wait()


def cache_features(
    target: Any,
    conversations: Sequence[Any],
    out_dir: str | Path,
    *,
    max_length: int,
    shard_size: int,
    feature_dtype: str = "float16",
    template: str = "auto",
    progress: bool = True,
    on_shard: Callable[[int, dict[str, Any]], None] | None = None,
    world: World | None = None,
    batch_size: int = 1,
    tokenize_workers: int = 0,
) -> Path:
    """Run the target over ``conversations`` and cache (ids, features, loss mask) in shards under ``out_dir``
    (returned), keeping the shards that verify; a cache made with other settings raises
    :class:`~jakiro_lib.data.feature_store.CacheError` (``batch_size`` and ``tokenize_workers`` are not settings).
    ``on_shard(index, entry)`` follows each new shard, in order. Under ``accelerate launch`` each process computes its
    share of the shards; ``world`` overrides that."""
    job, settings = _plan(target, conversations, out_dir, world, max_length=max_length, shard_size=shard_size,
                          feature_dtype=feature_dtype, template=template, batch_size=batch_size,
                          workers=tokenize_workers)
    old, done, damaged = cached_shards(job.out_dir, job.fixed)
    job.world.wait()  # every process has read the old state before the main process rewrites the manifest
    if target.device.type == "cpu":
        keep_freed_memory()  # the [batch, tokens, vocabulary] logits are freshly page-faulted otherwise
    manifest = _new_manifest(job, settings)
    reuse = _reusable_shards(job, done)
    bar = _progress_bar(job, progress)
    try:
        _cache_shards(job, manifest, reuse, done, damaged, bar, on_shard)
    finally:
        if bar is not None:
            bar.close()
    job.world.wait()  # every process has written its shards and sidecars
    if job.world.index == 0:
        merge_sidecars(job.out_dir, manifest, job.fixed, job.n_shards,
                       unchanged=reuse == set(range(job.n_shards)), old=old)
    job.world.wait()  # every process returns with the final manifest written
    return job.out_dir
