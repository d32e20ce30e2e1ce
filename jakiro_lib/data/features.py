"""Target hidden-state features for draft training: the target forward and a sharded, resumable disk cache.

A target forward over each conversation gives, at every position t, the target's last hidden state f_t
(after the final norm: the input of ``lm_head``) -- what the draft learns to predict
(docs/DESIGN.md section 4). What training reads from the cache is in :mod:`jakiro_lib.data.dataset`.
Several conversations can share one forward (``batch_size``: sorted by length within a shard,
right-padded, the padded rows dropped); the stored tensors equal the one-conversation ones up to float
rounding.

Cache layout (``out_dir``)::

    manifest.json                 settings, per-shard counts/size/sha256, run metadata
    shard_00000.safetensors       conversations [0, shard_size) of the input list
    shard_00001.safetensors       ...

Each shard holds the concatenation of its kept conversations: ``input_ids`` (int32 [T]), ``hidden``
(fp16/bf16 [T, H]), ``loss_mask`` (uint8 [T], assistant tokens), ``target_top1`` (int32 [T], the
target's full-vocabulary argmax at each position, for exact draft accuracy with a reduced draft
vocabulary), ``offsets`` (int64 [n, 2], start/end of each conversation) and ``conversation_index``
(int64 [n], its index in the input list). Conversations whose loss mask is empty are skipped and counted.
Shards are written atomically and listed in the manifest only once complete, so an interrupted run
continues where it stopped and never leaves a half-written shard behind.

Under ``accelerate launch`` with N processes, process i computes the shards whose index % N == i. Only
the main process writes ``manifest.json``; the others write a per-shard sidecar record
(``shard_00003.json``) that the main process merges into the manifest after a barrier, then deletes.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from .chat import format_conversation
from ..layout import MANIFEST
from ..files import atomic_path, file_sha256, read_json, write_json
from ..machine import distributed_state, keep_freed_memory, run_metadata, world_size

log = logging.getLogger(__name__)

FORMAT = "jakiro-features-v1"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_SHARD_KEYS = ("input_ids", "hidden", "loss_mask", "target_top1", "offsets", "conversation_index")


class CacheError(RuntimeError):
    """A feature cache that is missing, incomplete, corrupt or made with other settings."""


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


def _feature_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"feature_dtype must be one of {', '.join(_DTYPES)}, got {name!r}") from None


# --------------------------------------------------------------------------------------------------
# Target features
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def target_features(model: torch.nn.Module, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The target's last hidden state after the final norm (the input of ``lm_head``): [B, L, H].

    ``input_ids`` may be [L] or [B, L]; works for Llama/Mistral/Qwen2 (``model.model`` is the decoder).
    """
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    device = next(model.parameters()).device
    out = model.model(input_ids=input_ids.to(device),
                      attention_mask=None if attention_mask is None else attention_mask.to(device),
                      use_cache=False)
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


# --------------------------------------------------------------------------------------------------
# Disk estimates
# --------------------------------------------------------------------------------------------------


def bytes_per_token(hidden_size: int, dtype: str | torch.dtype = "float16") -> int:
    """Shard bytes per token: the feature (H x itemsize) + input id (4) + top-1 id (4) + mask (1)."""
    return hidden_size * _feature_dtype(dtype).itemsize + 4 + 4 + 1


def estimate_disk(num_tokens: int, hidden_size: int, dtype: str | torch.dtype = "float16") -> int:
    """Bytes a cache of ``num_tokens`` tokens takes on disk (headers and offsets are negligible)."""
    return int(num_tokens) * bytes_per_token(hidden_size, dtype)


def human_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# --------------------------------------------------------------------------------------------------
# Formatting conversations
# --------------------------------------------------------------------------------------------------


def _messages(conv: Any) -> Any:
    return conv["messages"] if isinstance(conv, dict) else conv.messages


def _conv_id(conv: Any, index: int) -> str:
    value = conv.get("id") if isinstance(conv, dict) else getattr(conv, "id", None)
    return str(index if value is None else value)


def tokenize_conversation(tokenizer: Any, conv: Any, max_length: int | None,
                          template: str) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one conversation in the chat template, cut to ``max_length``."""
    f = format_conversation(tokenizer, _messages(conv), template=template, max_length=max_length)
    ids, mask = list(f.input_ids), list(f.loss_mask)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def _source_sha(convs: Sequence[Any], start: int) -> str:
    """Fingerprint of a shard's input conversations, so a rerun on other data never reuses it."""
    h = hashlib.sha256()
    for i, c in enumerate(convs):
        h.update(json.dumps([_conv_id(c, start + i), _messages(c)], sort_keys=True, default=str).encode())
    return h.hexdigest()


def estimate_cache(target: Any, conversations: Sequence[Any], *, max_length: int, template: str = "auto",
                   feature_dtype: str = "float16") -> dict[str, Any]:
    """Tokenize (no target forward) and return token counts and the disk the cache would take."""
    tokens = loss_tokens = kept = 0
    for conv in conversations:
        ids, mask = tokenize_conversation(target.tokenizer, conv, max_length, template)
        if sum(mask) == 0:
            continue
        kept += 1
        tokens += len(ids)
        loss_tokens += sum(mask)
    H = target.model.config.hidden_size
    size = estimate_disk(tokens, H, feature_dtype)
    return {"conversations": kept, "skipped_empty_mask": len(conversations) - kept, "tokens": tokens,
            "loss_tokens": loss_tokens, "bytes": size, "human": human_bytes(size),
            "bytes_per_token": bytes_per_token(H, feature_dtype)}


# --------------------------------------------------------------------------------------------------
# Writing the cache
# --------------------------------------------------------------------------------------------------


# Settings recorded only when they differ from these values, so caches made before them stay valid.
OPTIONAL_SETTINGS = {"target_dtype": "float32"}


def _settings(target: Any, *, max_length: int, shard_size: int, feature_dtype: str, template: str,
              num_input: int) -> dict[str, Any]:
    cfg = target.model.config
    tcfg = getattr(target, "config", None)
    name = getattr(tcfg, "model", None) or getattr(cfg, "_name_or_path", "")
    settings = {
        "format": FORMAT,
        "target": name,
        "target_model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "feature_dtype": feature_dtype,
        "max_length": max_length,
        "template": template,
        "shard_size": shard_size,
    }
    if str(name).startswith("tiny:"):
        settings["target_seed"] = getattr(tcfg, "seed", None)
    dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    if dtype != OPTIONAL_SETTINGS["target_dtype"]:
        settings["target_dtype"] = dtype
    settings["num_input_conversations"] = num_input
    return settings


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    """The cache's manifest, None when there is none; CacheError when it is there but unreadable."""
    path = out_dir / MANIFEST
    if not path.is_file():
        return None
    manifest = read_json(path)
    if manifest is None:
        raise CacheError(f"{path} is corrupt (not readable JSON); delete the cache directory and rerun caching")
    return manifest


def _check_shard(out_dir: Path, entry: dict[str, Any], full: bool = False) -> None:
    """Raise CacheError if the shard file is missing, truncated or corrupt."""
    name = entry["file"]
    path = out_dir / name
    advice = "delete it and rerun caching to recompute it (intact shards are kept)"
    if not path.is_file():
        raise CacheError(f"{name} is missing from {out_dir}; rerun caching to recompute it")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CacheError(f"{name} is corrupt (truncated or altered: {size} bytes on disk, "
                         f"{entry['bytes']} expected); {advice}")
    try:
        with safe_open(str(path), "pt") as f:
            keys = set(f.keys())
            missing = [k for k in _SHARD_KEYS if k not in keys]
            if missing:
                raise CacheError(f"{name} is corrupt (missing tensors {missing}); {advice}")
            n = f.get_slice("offsets").get_shape()[0]
            t = f.get_slice("input_ids").get_shape()[0]
            if n != entry["conversations"] or t != entry["tokens"]:
                raise CacheError(f"{name} is corrupt (holds {n} conversations / {t} tokens, the manifest "
                                 f"says {entry['conversations']} / {entry['tokens']}); {advice}")
    except CacheError:
        raise
    except Exception as exc:  # safetensors raises its own error types for damaged headers
        raise CacheError(f"{name} is corrupt ({exc}); {advice}") from exc
    if full and entry.get("sha256") and file_sha256(path) != entry["sha256"]:
        raise CacheError(f"{name} is corrupt (sha256 mismatch); {advice}")


PAD_ID = 0  # token id on padded positions of a batched forward; masked out, so any id gives the same rows


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Positions grouped into batches of at most ``batch_size``, longest first, so a batch pads little.

    Sorting happens within the list given (one shard's conversations when caching): order across shards
    is untouched, and the longest batch comes first, so running out of memory shows at once.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[s:s + batch_size] for s in range(0, len(order), batch_size)]


@torch.no_grad()
def batch_features(model: torch.nn.Module, seqs: Sequence[Sequence[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(hidden [L, H], full-vocabulary top-1 [L]) of each token sequence, from ONE right-padded forward.

    Causal attention never lets a real position see a later (padded) one, and the attention mask hides
    padded keys, so every kept row equals the one-sequence forward's up to float rounding (tested). A
    single sequence, or a batch of equal lengths, runs without a mask, exactly as one forward per
    conversation did.
    """
    lens = [len(s) for s in seqs]
    T = max(lens)
    ids = torch.full((len(seqs), T), PAD_ID, dtype=torch.long)  # [B, T]
    mask = torch.zeros(len(seqs), T, dtype=torch.long)  # [B, T], 1 on real tokens
    for b, s in enumerate(seqs):
        ids[b, :len(s)] = torch.as_tensor(list(s), dtype=torch.long)
        mask[b, :len(s)] = 1
    h = target_features(model, ids, None if min(lens) == T else mask)  # [B, T, H]
    rows = h[mask.to(h.device).bool()]  # [sum L, H], the real positions sequence by sequence
    top = target_top1(model, rows)  # [sum L]
    return list(zip(rows.split(lens), top.split(lens)))


def _cat(parts: list[torch.Tensor], empty: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else empty


def shard_tensors(target: Any, convs: Sequence[Any], start: int, *, max_length: int, template: str, dtype: torch.dtype,
                  bar: Any, batch_size: int = 1) -> tuple[dict[str, torch.Tensor], list[str], int]:
    """One shard's tensors, its kept conversations' ids and its count of skipped (empty-mask) ones.

    Conversations run ``batch_size`` per target forward, sorted by length within the shard
    (:func:`length_batches`), and are stored in input order whatever the batching.
    """
    formatted = [tokenize_conversation(target.tokenizer, conv, max_length, template) for conv in convs]
    kept = [i for i, (_, mask) in enumerate(formatted) if sum(mask) > 0]
    if bar is not None:
        bar.update(len(convs) - len(kept))  # skipped ones are done
    feats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # input position -> (hidden [L, H], top-1 [L])
    for group in length_batches([len(formatted[i][0]) for i in kept], batch_size):
        positions = [kept[g] for g in group]
        for i, (h, top) in zip(positions, batch_features(target.model, [formatted[i][0] for i in positions])):
            feats[i] = (h.to(dtype).cpu(), top.to(torch.int32).cpu())
        if bar is not None:
            bar.update(len(group))
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
    return tensors, [_conv_id(convs[i], start + i) for i in kept], len(convs) - len(kept)


class World(NamedTuple):
    """Which of ``size`` caching processes this one is, a barrier, and its device (None: leave the target)."""

    index: int = 0
    size: int = 1
    wait: Callable[[], None] = lambda: None
    device: torch.device | None = None


def _world() -> World:
    """One process, unless launched by ``accelerate launch`` with several (then accelerate's state)."""
    if world_size() <= 1:
        return World()  # never initialise a distributed state when not launched by accelerate
    state = distributed_state()
    if state.num_processes <= 1:
        return World()
    return World(state.process_index, state.num_processes, state.wait_for_everyone, state.device)


def _sidecar(out_dir: Path, index: int) -> Path:
    return out_dir / f"shard_{index:05d}.json"


def _read_sidecar(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The shard entry a non-main process recorded, if readable and made with these settings."""
    record = read_json(path)
    if not isinstance(record, dict):
        return None
    return record.get("shard") if record.get("settings") == settings else None


def _reusable(entry: dict[str, Any] | None, conversations: Sequence[Any], index: int, shard_size: int) -> bool:
    """Whether a verified shard entry holds shard ``index`` of these very conversations."""
    start = index * shard_size
    return entry is not None and entry.get("first_conversation") == start \
        and entry.get("source_sha256") == _source_sha(conversations[start:start + shard_size], start)


def _summarise(manifest: dict[str, Any]) -> None:
    shards = manifest["shards"]
    manifest["num_shards"] = len(shards)
    manifest["num_conversations"] = sum(s["conversations"] for s in shards)
    manifest["num_tokens"] = sum(s["tokens"] for s in shards)
    manifest["num_loss_tokens"] = sum(s["loss_tokens"] for s in shards)
    manifest["skipped_empty_mask"] = sum(s["skipped_empty_mask"] for s in shards)
    manifest["bytes"] = sum(s["bytes"] for s in shards)
    manifest["complete"] = len(shards) == manifest["num_shards_expected"]


def _cached_shards(out_dir: Path, fixed: dict[str, Any]
                   ) -> tuple[dict[str, Any] | None, dict[str, dict[str, Any]], dict[str, str]]:
    """(the old manifest, its shards that verify by file name, the damaged ones and why) of ``out_dir``;
    a cache made with other settings than ``fixed`` is refused."""
    old = read_manifest(out_dir)
    entries = [] if old is None else list(old.get("shards", []))
    if old is not None:
        cached = {**OPTIONAL_SETTINGS, **old}
        clash = {k: (cached.get(k), v) for k, v in {**OPTIONAL_SETTINGS, **fixed}.items() if cached.get(k) != v}
        if clash:
            detail = ", ".join(f"{k}: cached {a!r} vs now {b!r}" for k, (a, b) in clash.items())
            raise CacheError(f"{out_dir} holds a feature cache made with other settings ({detail}); "
                             "use another directory or delete this one")
    # shards finished by a multi-process run that stopped before the main process merged them
    entries += [e for p in sorted(out_dir.glob("shard_*.json")) if (e := _read_sidecar(p, fixed))]
    done: dict[str, dict[str, Any]] = {}
    damaged: dict[str, str] = {}
    for entry in entries:
        try:
            _check_shard(out_dir, entry)
        except CacheError as exc:
            damaged[entry["file"]] = str(exc)  # recomputed
            continue
        done[entry["file"]] = entry
        damaged.pop(entry["file"], None)
    return old, done, damaged


def _write_shard(target: Any, convs: Sequence[Any], index: int, start: int, out_dir: Path, *, max_length: int,
                 template: str, dtype: torch.dtype, bar: Any, batch_size: int) -> dict[str, Any]:
    """Shard ``index`` (``convs``, the first of them conversation ``start``) computed and written atomically;
    returns its manifest entry."""
    name = shard_name(index)
    tensors, conv_ids, skipped = shard_tensors(target, convs, start, max_length=max_length, template=template,
                                                dtype=dtype, bar=bar, batch_size=batch_size)
    with atomic_path(out_dir / name) as tmp:
        # one metadata key: safetensors writes several in hash order, and shards should be byte-identical
        # when their content is
        meta = json.dumps({"format": FORMAT, "conversation_ids": conv_ids})
        save_file(tensors, str(tmp), metadata={"jakiro": meta})
        size, sha = tmp.stat().st_size, file_sha256(tmp)
    return {
        "file": name, "index": index, "first_conversation": start, "input_conversations": len(convs),
        "conversations": int(tensors["offsets"].shape[0]), "skipped_empty_mask": skipped,
        "tokens": int(tensors["input_ids"].shape[0]), "loss_tokens": int(tensors["loss_mask"].sum()),
        "bytes": size, "sha256": sha, "source_sha256": _source_sha(convs, start), "batch_size": batch_size,
    }


def _merge_sidecars(out_dir: Path, manifest: dict[str, Any], fixed: dict[str, Any], n_shards: int, *,
                    unchanged: bool, old: dict[str, Any] | None) -> None:
    """The main process's last step: other processes' shards (their sidecars) into the manifest, written
    unless nothing was computed; the merged sidecars removed."""
    listed = {e["file"] for e in manifest["shards"]}
    for s in range(n_shards):
        entry = _read_sidecar(_sidecar(out_dir, s), fixed)
        if entry is not None and entry["file"] not in listed:
            try:
                _check_shard(out_dir, entry)
            except CacheError:
                continue  # left out: the manifest says incomplete and a rerun recomputes it
            manifest["shards"].append(entry)
    manifest["shards"].sort(key=lambda e: e["file"])
    _summarise(manifest)
    if not (unchanged and old is not None and old.get("complete") and manifest["shards"] == old.get("shards")):
        write_json(out_dir / MANIFEST, manifest)  # else nothing was computed: the manifest stays as it was
    for path in out_dir.glob("shard_*.json"):  # merged (or stale) sidecars
        path.unlink(missing_ok=True)


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
) -> Path:
    """Run the target over ``conversations`` and cache (ids, features, loss mask) in sharded safetensors.

    Resumable: shards listed in the manifest (or in a sidecar record) whose file verifies (size, header,
    counts) and whose input conversations are unchanged are skipped; the manifest is rewritten
    atomically after each shard. ``on_shard(index, entry)`` is called after each newly written shard.
    A resumed run logs how many shards it found, and a damaged shard (missing, truncated, corrupt) is
    rewritten with a warning that names it. ``batch_size`` conversations share one target forward
    (:func:`batch_features`); the stored tensors are the same up to float rounding whatever it is, so it
    is recorded in the manifest but not among the settings a rerun must match.
    Returns ``out_dir``. Raises :class:`CacheError` if ``out_dir`` holds a cache made with other settings.

    Under ``accelerate launch`` (several processes) every process must call this with the same
    arguments; each computes its share of the shards (see the module docstring) and the main process
    writes the manifest once all are done. The target is moved to the process's device
    (``PartialState().device``) unless it is already there. ``world`` overrides the process layout
    (tests); by default it comes from accelerate when launched by it, else one process.
    """
    if shard_size < 1 or batch_size < 1:
        raise ValueError(f"shard_size and batch_size must be >= 1, got {shard_size} and {batch_size}")
    world = _world() if world is None else world
    main = world.index == 0
    if world.device is not None and target.model.device != torch.device(world.device):
        target.model.to(world.device)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = _feature_dtype(feature_dtype)
    feature_dtype = str(dtype).removeprefix("torch.")
    settings = _settings(target, max_length=max_length, shard_size=shard_size, feature_dtype=feature_dtype,
                         template=template, num_input=len(conversations))
    fixed = {k: v for k, v in settings.items() if k != "num_input_conversations"}
    n_shards = math.ceil(len(conversations) / shard_size)
    old, done, damaged = _cached_shards(out_dir, fixed)
    world.wait()  # every process has read the old state before the main process rewrites the manifest
    if target.device.type == "cpu":
        keep_freed_memory()  # the [batch, tokens, vocabulary] logits are freshly page-faulted otherwise
    manifest: dict[str, Any] = {
        **settings, "settings": settings, "cache_batch_size": batch_size,
        "num_shards_expected": n_shards, "shards": [], "run_metadata": run_metadata(target.device),
    }
    mine = range(world.index, n_shards, world.size)  # this process's shards
    reuse = {s for s in range(n_shards) if _reusable(done.get(shard_name(s)), conversations, s, shard_size)}
    if reuse and main:
        log.info("resuming: %d of %d shards present in %s", len(reuse), n_shards, out_dir)
    bar = None
    if progress:
        total = sum(len(conversations[s * shard_size:(s + 1) * shard_size]) for s in mine)
        desc = "caching features" + (f" [{world.index}/{world.size}]" if world.size > 1 else "")
        bar = tqdm(total=total, desc=desc, unit="conv")
    try:
        for s in range(n_shards):
            start = s * shard_size
            convs = conversations[start:start + shard_size]
            name = shard_name(s)
            if s in reuse:
                if main:
                    manifest["shards"].append(done[name])
                if bar is not None and s in mine:
                    bar.update(len(convs))
                continue
            if s not in mine:
                continue
            if name in damaged:
                log.warning("rewriting damaged shard %s: %s", name, damaged[name])
            entry = _write_shard(target, convs, s, start, out_dir, max_length=max_length, template=template,
                                 dtype=dtype, bar=bar, batch_size=batch_size)
            if main:
                manifest["shards"].append(entry)
                _summarise(manifest)
                write_json(out_dir / MANIFEST, manifest)
            else:
                write_json(_sidecar(out_dir, s), {"settings": fixed, "shard": entry})
            if on_shard is not None:
                on_shard(s, entry)
    finally:
        if bar is not None:
            bar.close()
    world.wait()  # every process has written its shards and sidecars
    if main:
        _merge_sidecars(out_dir, manifest, fixed, n_shards, unchanged=set(reuse) == set(range(n_shards)), old=old)
    world.wait()  # every process returns with the final manifest written
    return out_dir


# --------------------------------------------------------------------------------------------------
# Verifying the cache
# --------------------------------------------------------------------------------------------------


def verify_cache(cache_dir: str | Path, *, full: bool = False, allow_incomplete: bool = False) -> dict[str, Any]:
    """Check the manifest and every shard (existence, size, header, counts; sha256 too if ``full``).

    Returns the manifest; raises :class:`CacheError` naming the first bad shard.
    """
    cache_dir = Path(cache_dir)
    manifest = read_manifest(cache_dir)
    if manifest is None:
        raise CacheError(f"no feature cache at {cache_dir} ({MANIFEST} missing); make it first with "
                         "`python -m jakiro_lib cache` (notebook 00) with the same --profile, --set and --run-dir")
    if not allow_incomplete and not manifest.get("complete", False):
        raise CacheError(f"feature cache {cache_dir} is incomplete ({len(manifest.get('shards', []))} of "
                         f"{manifest.get('num_shards_expected')} shards); rerun caching to finish it")
    for entry in manifest.get("shards", []):
        _check_shard(cache_dir, entry, full=full)
    return manifest

