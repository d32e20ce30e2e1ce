"""Target hidden-state features for draft training: a sharded, resumable disk cache and an online mode.

A target forward over each conversation gives, at every position t, the target's last hidden state f_t
(after the final norm: the input of ``lm_head``) -- what the draft learns to predict (DESIGN.md 4).
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
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils.data import Dataset

from .utils import atomic_path, file_sha256, run_metadata, write_json

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "jakiro-features-v1"
SPLITS = ("train", "heldout", "all")
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


def _format(tokenizer: Any, conv: Any, max_length: int | None, template: str) -> tuple[list[int], list[int]]:
    from .chat import format_conversation  # lazy: chat formatting is only needed when caching

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
        ids, mask = _format(target.tokenizer, conv, max_length, template)
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


def _read_manifest(out_dir: Path) -> dict[str, Any] | None:
    path = out_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CacheError(f"{path} is corrupt ({exc}); delete the cache directory and rerun caching") from exc


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
    formatted = [_format(target.tokenizer, conv, max_length, template) for conv in convs]
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
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return World()  # never initialise a distributed state when not launched by accelerate
    from accelerate import PartialState

    state = PartialState()
    if state.num_processes <= 1:
        return World()
    return World(state.process_index, state.num_processes, state.wait_for_everyone, state.device)


def _sidecar(out_dir: Path, index: int) -> Path:
    return out_dir / f"shard_{index:05d}.json"


def _read_sidecar(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The shard entry a non-main process recorded, if readable and made with these settings."""
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
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
    old = _read_manifest(out_dir)
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
            damaged[entry["file"]] = str(exc)  # recomputed below
            continue
        done[entry["file"]] = entry
        damaged.pop(entry["file"], None)
    world.wait()  # every process has read the old state before the main process rewrites the manifest
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
        from tqdm.auto import tqdm

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
            tensors, conv_ids, skipped = shard_tensors(target, convs, start, max_length=max_length,
                                                        template=template, dtype=dtype, bar=bar,
                                                        batch_size=batch_size)
            with atomic_path(out_dir / name) as tmp:
                # one metadata key: safetensors writes several in hash order, and shards should be
                # byte-identical when their content is
                meta = json.dumps({"format": FORMAT, "conversation_ids": conv_ids})
                save_file(tensors, str(tmp), metadata={"jakiro": meta})
                size, sha = tmp.stat().st_size, file_sha256(tmp)
            entry = {
                "file": name, "index": s, "first_conversation": start, "input_conversations": len(convs),
                "conversations": int(tensors["offsets"].shape[0]), "skipped_empty_mask": skipped,
                "tokens": int(tensors["input_ids"].shape[0]), "loss_tokens": int(tensors["loss_mask"].sum()),
                "bytes": size, "sha256": sha, "source_sha256": _source_sha(convs, start), "batch_size": batch_size,
            }
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
        write_json(out_dir / MANIFEST, manifest)
        for path in out_dir.glob("shard_*.json"):  # merged (or stale) sidecars
            path.unlink(missing_ok=True)
    world.wait()  # every process returns with the final manifest written
    return out_dir


# --------------------------------------------------------------------------------------------------
# Reading the cache
# --------------------------------------------------------------------------------------------------


def verify_cache(cache_dir: str | Path, *, full: bool = False, allow_incomplete: bool = False) -> dict[str, Any]:
    """Check the manifest and every shard (existence, size, header, counts; sha256 too if ``full``).

    Returns the manifest; raises :class:`CacheError` naming the first bad shard.
    """
    cache_dir = Path(cache_dir)
    manifest = _read_manifest(cache_dir)
    if manifest is None:
        raise CacheError(f"no feature cache at {cache_dir} ({MANIFEST} missing); run cache_features first")
    if not allow_incomplete and not manifest.get("complete", False):
        raise CacheError(f"feature cache {cache_dir} is incomplete ({len(manifest.get('shards', []))} of "
                         f"{manifest.get('num_shards_expected')} shards); rerun caching to finish it")
    for entry in manifest.get("shards", []):
        _check_shard(cache_dir, entry, full=full)
    return manifest


def _stable_hash(i: int) -> int:
    """splitmix64 of a conversation index: a split that does not depend on the order of anything else."""
    z = (i + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def split_indices(conversation_indices: Sequence[int], split: str, heldout_fraction: float) -> list[int]:
    """Positions (into ``conversation_indices``) of the requested split.

    Held-out = the ``round(n * fraction)`` conversations (at least one when fraction > 0 and n > 1)
    with the smallest hash of their conversation index: deterministic, and the same for the cached and
    the online dataset built from the same conversation list.
    """
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
    """Per-conversation items from a feature cache (shards are memory-mapped, read item by item).

    Item: ``input_ids`` LongTensor[L], ``hidden`` [L, H] (``dtype``, default float32), ``loss_mask``
    LongTensor[L] (0/1), ``target_top1`` LongTensor[L], ``index`` (the conversation's input index).
    """

    def __init__(self, cache_dir: str | Path, split: str = "train", heldout_fraction: float = 0.05, *,
                 dtype: torch.dtype | None = torch.float32, verify: bool = True) -> None:
        self.cache_dir = Path(cache_dir)
        self.manifest = verify_cache(self.cache_dir) if verify else _read_manifest(self.cache_dir)
        if self.manifest is None:
            raise CacheError(f"no feature cache at {self.cache_dir}")
        self.split = split
        self.heldout_fraction = heldout_fraction
        self.dtype = dtype
        self.hidden_size = self.manifest["hidden_size"]
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
    """Same items as :class:`FeatureDataset`, computed by the target on the fly (no disk).

    Conversations are tokenized up front (cheap) so empty-mask ones are dropped and the split matches the
    cached dataset built from the same list. Use ``num_workers=0``: the target runs in this process.
    """

    def __init__(self, target: Any, conversations: Sequence[Any], max_length: int, template: str = "auto", *,
                 split: str = "all", heldout_fraction: float = 0.0, dtype: torch.dtype = torch.float32) -> None:
        self.target = target
        self.max_length = max_length
        self.template = template
        self.dtype = dtype
        self.hidden_size = target.model.config.hidden_size
        self.vocab_size = target.model.config.vocab_size
        formatted = []
        for i, conv in enumerate(conversations):
            ids, mask = _format(target.tokenizer, conv, max_length, template)
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


# --------------------------------------------------------------------------------------------------
# Reduced draft vocabulary
# --------------------------------------------------------------------------------------------------


def _token_arrays(dataset: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(dataset, "token_arrays"):
        yield from dataset.token_arrays()
        return
    for i in range(len(dataset)):
        item = dataset[i]
        yield torch.as_tensor(item["input_ids"]).long(), torch.as_tensor(item["loss_mask"]).long()


def token_frequencies(dataset: Any, vocab_size: int | None = None, *, unmasked_weight: float = 0.01) -> torch.Tensor:
    """Weighted token counts [vocab] (float64): an assistant (loss-mask) token counts 1, any other token
    ``unmasked_weight`` -- the draft only ever predicts assistant tokens, but every token is counted so
    that ids seen only in prompts still rank above never-seen ids."""
    vocab_size = vocab_size or getattr(dataset, "vocab_size", None)
    counts = torch.zeros(vocab_size or 0, dtype=torch.float64)
    for ids, mask in _token_arrays(dataset):
        if ids.numel() == 0:
            continue
        need = int(ids.max()) + 1
        if need > counts.numel():
            if vocab_size is not None:
                raise ValueError(f"token id {need - 1} is outside the vocabulary of {vocab_size}")
            counts = torch.cat([counts, torch.zeros(need - counts.numel(), dtype=torch.float64)])
        counts.index_add_(0, ids, torch.where(mask > 0, 1.0, unmasked_weight).to(torch.float64))
    return counts


def build_draft_vocab(freqs: torch.Tensor, size: int, *, always: Sequence[int] = ()) -> torch.LongTensor:
    """``d2t``: the ``size`` most frequent ids (ties broken by the smaller id), sorted ascending.

    ``always`` (e.g. the EOS ids) are included whatever their count.
    """
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


# --------------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------------


def collate(batch: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-pad items to the batch's longest: ``input_ids`` [B, T] (pad 0), ``hidden`` [B, T, H] (pad 0),
    ``loss_mask`` [B, T] float (0 on padding), ``attention_mask`` [B, T] long, ``target_top1`` [B, T]
    (pad -1), ``lengths`` [B], ``index`` [B]."""
    if not batch:
        raise ValueError("empty batch")
    B = len(batch)
    T = max(int(item["input_ids"].shape[0]) for item in batch)
    H = batch[0]["hidden"].shape[-1]
    out = {
        "input_ids": torch.zeros(B, T, dtype=torch.long),
        "hidden": torch.zeros(B, T, H, dtype=batch[0]["hidden"].dtype),
        "loss_mask": torch.zeros(B, T, dtype=torch.float32),
        "attention_mask": torch.zeros(B, T, dtype=torch.long),
        "lengths": torch.zeros(B, dtype=torch.long),
        "index": torch.tensor([int(item.get("index", -1)) for item in batch], dtype=torch.long),
    }
    has_top1 = all("target_top1" in item for item in batch)
    if has_top1:
        out["target_top1"] = torch.full((B, T), -1, dtype=torch.long)
    for b, item in enumerate(batch):
        n = int(item["input_ids"].shape[0])
        out["input_ids"][b, :n] = item["input_ids"]
        out["hidden"][b, :n] = item["hidden"]
        out["loss_mask"][b, :n] = torch.as_tensor(item["loss_mask"]).float()
        out["attention_mask"][b, :n] = 1
        out["lengths"][b] = n
        if has_top1:
            out["target_top1"][b, :n] = item["target_top1"]
    return out
