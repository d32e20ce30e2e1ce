"""The feature cache that :func:`jakiro_lib.data.features.cache_features` writes: ``manifest.json`` (settings, each
complete shard's counts, size and sha256) and ``shard_NNNNN.safetensors``, each its kept conversations concatenated:
``input_ids``, ``loss_mask``, ``target_top1`` (the target's full-vocabulary argmax) [T], ``hidden`` [T, H], ``offsets``
[n, 2], ``conversation_index`` [n]. With N processes, process i writes the shards i mod N and a sidecar for each
(``shard_00003.json``) that the main process merges into the manifest."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..config import Profile
from ..files import file_sha256, read_json, sweep_temps, write_json
from ..layout import MANIFEST

FORMAT = "jakiro-features-v1"
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_SHARD_KEYS = ("input_ids", "hidden", "loss_mask", "target_top1", "offsets", "conversation_index")

# Settings recorded only when they differ from these values, so caches made before them stay valid.
OPTIONAL_SETTINGS = {"target_dtype": "float32"}


def resolve_cache_dtype(profile: Profile, favoured: str | None) -> str:
    """The target's dtype for caching: ``data.cache_dtype``, where "auto" is ``favoured`` (the device's bf16, or None)
    or else the target's dtype, as an unset one is."""
    setting = profile.data.cache_dtype
    return (favoured or profile.target.dtype) if setting == "auto" else setting or profile.target.dtype


class CacheError(RuntimeError):
    """A feature cache that is missing, incomplete, corrupt or made with other settings."""


def shard_name(index: int) -> str:
    return f"shard_{index:05d}.safetensors"


def sidecar_path(out_dir: Path, index: int) -> Path:
    """Where a non-main process records shard ``index`` for the main process to merge."""
    return out_dir / f"shard_{index:05d}.json"


def feature_torch_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype a cache stores its features in, from its name (``"float16"``) or itself."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"feature_dtype must be one of {', '.join(_DTYPES)}, got {name!r}") from None


# Disk estimates


def bytes_per_token(hidden_size: int, dtype: str | torch.dtype = "float16") -> int:
    """Shard bytes per token: the feature (H x itemsize) + input id (4) + top-1 id (4) + mask (1)."""
    return hidden_size * feature_torch_dtype(dtype).itemsize + 4 + 4 + 1


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


# Manifest and shards


def cache_settings(target: Any, *, max_length: int, shard_size: int, feature_dtype: str, template: str,
                   num_input: int) -> dict[str, Any]:
    """What a cache records of how it was made; all but ``num_input_conversations`` must match on a rerun."""
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


def check_shard(out_dir: Path, entry: dict[str, Any], full: bool = False) -> None:
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


def read_sidecar(path: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The shard entry a non-main process recorded, if readable and made with these settings."""
    record = read_json(path)
    if not isinstance(record, dict):
        return None
    return record.get("shard") if record.get("settings") == settings else None


def summarise(manifest: dict[str, Any]) -> None:
    """The manifest's totals and ``complete`` flag, recounted from its shard entries."""
    shards = manifest["shards"]
    manifest["num_shards"] = len(shards)
    manifest["num_conversations"] = sum(s["conversations"] for s in shards)
    manifest["num_tokens"] = sum(s["tokens"] for s in shards)
    manifest["num_loss_tokens"] = sum(s["loss_tokens"] for s in shards)
    manifest["skipped_empty_mask"] = sum(s["skipped_empty_mask"] for s in shards)
    manifest["bytes"] = sum(s["bytes"] for s in shards)
    manifest["complete"] = len(shards) == manifest["num_shards_expected"]


def cached_shards(out_dir: Path, fixed: dict[str, Any]
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
    sweep_temps(out_dir)  # shards whose writer was killed mid-write
    # shards finished by a multi-process run that stopped before the main process merged them
    entries += [e for p in sorted(out_dir.glob("shard_*.json")) if (e := read_sidecar(p, fixed))]
    done: dict[str, dict[str, Any]] = {}
    damaged: dict[str, str] = {}
    for entry in entries:
        try:
            check_shard(out_dir, entry)
        except CacheError as exc:
            damaged[entry["file"]] = str(exc)  # recomputed
            continue
        done[entry["file"]] = entry
        damaged.pop(entry["file"], None)
    return old, done, damaged


def merge_sidecars(out_dir: Path, manifest: dict[str, Any], fixed: dict[str, Any], n_shards: int, *,
                   unchanged: bool, old: dict[str, Any] | None) -> None:
    """The main process's last step: other processes' shards (their sidecars) into the manifest, written
    unless nothing was computed; the merged sidecars removed."""
    listed = {e["file"] for e in manifest["shards"]}
    for s in range(n_shards):
        entry = read_sidecar(sidecar_path(out_dir, s), fixed)
        if entry is not None and entry["file"] not in listed:
            try:
                check_shard(out_dir, entry)
            except CacheError:
                continue  # left out: the manifest says incomplete and a rerun recomputes it
            manifest["shards"].append(entry)
    manifest["shards"].sort(key=lambda e: e["file"])
    summarise(manifest)
    if not (unchanged and old is not None and old.get("complete") and manifest["shards"] == old.get("shards")):
        write_json(out_dir / MANIFEST, manifest)  # else nothing was computed: the manifest stays as it was
    for path in out_dir.glob("shard_*.json"):  # merged (or stale) sidecars
        path.unlink(missing_ok=True)


def verify_cache(cache_dir: str | Path, *, full: bool = False, allow_incomplete: bool = False) -> dict[str, Any]:
    """Check the manifest and every shard (existence, size, header, counts; sha256 too if ``full``); returns
    the manifest, or raises :class:`CacheError` naming the first bad shard."""
    cache_dir = Path(cache_dir)
    manifest = read_manifest(cache_dir)
    if manifest is None:
        raise CacheError(f"no feature cache at {cache_dir} ({MANIFEST} missing); make it first with "
                         "`python -m jakiro_lib cache` (notebook 00) with the same --profile, --set and --run-dir")
    if not allow_incomplete and not manifest.get("complete", False):
        raise CacheError(f"feature cache {cache_dir} is incomplete ({len(manifest.get('shards', []))} of "
                         f"{manifest.get('num_shards_expected')} shards); rerun caching to finish it")
    for entry in manifest.get("shards", []):
        check_shard(cache_dir, entry, full=full)
    return manifest
