"""Stage 00 (notebook 00): training conversations -> the sharded target-feature cache, and its tables.

:func:`prepare_features`: ShareGPT conversations -> ``run_dir/features`` (or nothing in online mode);
the cache resumes and verifies itself. The rest turns the cache into what the notebook shows.
"""
from __future__ import annotations

import dataclasses
import html
import logging
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import torch

from ..data.chat import format_conversation
from ..config import Profile
from ..data.conversations import load_conversations
from ..data.distill import regenerate
from ..data.feature_store import (OPTIONAL_SETTINGS, CacheError, estimate_disk, human_bytes, read_manifest, resolve_cache_dtype,
                                  verify_cache)
from ..data.features import cache_features, estimate_cache
from ..layout import RunLayout
from ..files import read_json, write_json
from ..precision import favoured_dtype
from .context import StudyContext, default_run_dir, get_target

log = logging.getLogger(__name__)

PAPER_CONVERSATIONS = 68_000  # ShareGPT conversations the paper trains on (docs/DESIGN.md section 4)
PAPER_TOKENS_PER_CONVERSATION = 1_330  # what 740 GB at 8 KB/token for 68k conversations implies


def load_training_conversations(profile: Profile, run_dir: Path | None = None, target: Any = None, *,
                                progress: bool = False) -> list[Any]:
    """The profile's training conversations; with ``data.self_distill`` their first user turns answered
    by the target itself (generated once into ``run_dir/distill/``, resumable; see
    :mod:`jakiro_lib.data.distill`)."""
    d = profile.data
    convs = load_conversations(d.source, path=d.path, limit=d.num_conversations)
    if not d.self_distill:
        return convs
    rdir = run_dir if run_dir is not None else default_run_dir(profile.name)
    source = d.source if d.path is None else f"{d.source}:{Path(d.path).expanduser().resolve()}"
    return regenerate(target or get_target(profile), convs, RunLayout(rdir).distill_conversations,
                      max_prompt_tokens=d.max_length // 2, max_new_tokens=d.distill_max_new_tokens,
                      batch_size=d.distill_batch_size, template=profile.target.template, progress=progress,
                      source=source)


def cache_dtype(prof: Profile, cache_dir: Path, *, force: bool = False) -> str:
    """The target's dtype for caching: ``data.cache_dtype`` with "auto" resolved (see :func:`prepare_features`)."""
    begun = None if force or prof.data.cache_dtype != "auto" else read_manifest(cache_dir)
    if begun is not None:
        return begun.get("target_dtype", OPTIONAL_SETTINGS["target_dtype"])
    return resolve_cache_dtype(prof, favoured_dtype(torch.device(prof.target.device)))


def prepare_features(ctx: StudyContext, *, target: Any = None, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Cache target features for ``profile.data.num_conversations`` conversations in ``run_dir/features``
    (:func:`jakiro_lib.data.features.cache_features`); a cache made with other settings raises
    :class:`~jakiro_lib.data.feature_store.CacheError` unless ``force`` rebuilds it. Online (``data.online``) nothing is
    written. ``data.cache_dtype="auto"``: bf16 where the device has bf16 units (docs/DESIGN.md section 11), a begun
    cache in its own dtype. Returns a summary (also ``run_dir/features_summary.json``)."""
    prof, rdir = ctx.profile, ctx.run_dir
    layout = ctx.layout
    d = prof.data
    cache_target = dataclasses.replace(prof.target, dtype=cache_dtype(prof, layout.features, force=force))
    if target is None or target.config != cache_target:
        target = get_target(dataclasses.replace(prof, target=cache_target))
    t0 = time.perf_counter()
    convs = load_training_conversations(prof, rdir, target, progress=progress)
    t_load = time.perf_counter() - t0
    estimate = estimate_cache(target, convs, max_length=d.max_length, template=prof.target.template,
                              feature_dtype=d.feature_dtype, tokenize_workers=d.tokenize_workers)
    summary: dict[str, Any] = {
        "mode": "online" if d.online else "cache", "source": d.source, "path": d.path,
        "self_distill": d.self_distill,
        "conversations_loaded": len(convs), "estimate": estimate, "load_seconds": round(t_load, 2),
        "hidden_size": target.model.config.hidden_size, "feature_dtype": d.feature_dtype,
        "max_length": d.max_length,
    }
    cache_dir = layout.features
    if not d.online:
        t1 = time.perf_counter()
        kwargs = dict(max_length=d.max_length, shard_size=d.shard_size, feature_dtype=d.feature_dtype,
                      template=prof.target.template, batch_size=d.cache_batch_size, progress=progress,
                      tokenize_workers=d.tokenize_workers)
        try:
            cache_features(target, convs, cache_dir, **kwargs)
        except CacheError:
            if not force:
                raise
            log.warning("rebuilding %s (it was made with other settings)", cache_dir)
            shutil.rmtree(cache_dir)
            cache_features(target, convs, cache_dir, **kwargs)
        manifest = verify_cache(cache_dir)
        summary.update({
            "cache_dir": str(cache_dir), "cache_seconds": round(time.perf_counter() - t1, 2),
            "conversations": manifest["num_conversations"], "skipped_empty_mask": manifest["skipped_empty_mask"],
            "tokens": manifest["num_tokens"], "loss_tokens": manifest["num_loss_tokens"],
            "shards": manifest["num_shards"], "bytes": manifest["bytes"], "human": human_bytes(manifest["bytes"]),
        })
    else:
        summary.update({"cache_dir": None, "conversations": estimate["conversations"],
                        "skipped_empty_mask": estimate["skipped_empty_mask"], "tokens": estimate["tokens"],
                        "loss_tokens": estimate["loss_tokens"], "shards": 0, "bytes": 0, "human": "0 B (online)"})
    write_json(layout.features_summary, summary)
    return summary


def disk_estimates(summary: dict[str, Any], profile: Profile) -> pd.DataFrame:
    """Feature-cache disk cost: this run, this profile at full ShareGPT size, and the paper's setting."""
    H = summary["hidden_size"]
    dtype = summary["feature_dtype"]
    n = max(summary["conversations"], 1)
    per_conv = summary["tokens"] / n
    rows = [
        {"setting": f"this run ({summary['conversations']} conversations, max_length {summary['max_length']})",
         "conversations": summary["conversations"], "tokens": summary["tokens"], "hidden_size": H,
         "dtype": dtype, "bytes": estimate_disk(summary["tokens"], H, dtype)},
        {"setting": f"{PAPER_CONVERSATIONS:,} conversations at this run's {per_conv:.0f} tokens each",
         "conversations": PAPER_CONVERSATIONS, "tokens": int(per_conv * PAPER_CONVERSATIONS), "hidden_size": H,
         "dtype": dtype, "bytes": estimate_disk(int(per_conv * PAPER_CONVERSATIONS), H, dtype)},
        {"setting": "paper: Vicuna-7B, 68k ShareGPT conversations (~1330 tokens each, docs/DESIGN.md section 4)",
         "conversations": PAPER_CONVERSATIONS, "tokens": PAPER_CONVERSATIONS * PAPER_TOKENS_PER_CONVERSATION,
         "hidden_size": 4096, "dtype": "bfloat16",
         "bytes": estimate_disk(PAPER_CONVERSATIONS * PAPER_TOKENS_PER_CONVERSATION, 4096, "bfloat16")},
    ]
    df = pd.DataFrame(rows)
    df["size"] = df["bytes"].map(human_bytes)
    return df


def manifest_table(ctx: StudyContext) -> pd.DataFrame:
    """One row per cache shard (file, conversations, tokens, loss tokens, size)."""
    m = read_json(ctx.layout.features_manifest)
    if m is None:
        return pd.DataFrame(columns=["file", "conversations", "tokens", "loss_tokens", "bytes"])
    cols = ["file", "first_conversation", "conversations", "skipped_empty_mask", "tokens", "loss_tokens", "bytes"]
    return pd.DataFrame([{k: s.get(k) for k in cols} for s in m["shards"]])


def loss_mask_html(tokenizer: Any, messages: Sequence[dict[str, str]], *, template: str = "auto",
                   max_length: int | None = None, max_chars: int = 4000) -> str:
    """HTML of one formatted conversation: assistant (loss-mask = 1) tokens bold green, the rest grey.

    Runs of tokens with the same mask are decoded together (so multi-byte characters stay whole).
    """
    f = format_conversation(tokenizer, list(messages), template=template, max_length=max_length)
    ids, mask = list(f.input_ids), list(f.loss_mask)
    pieces: list[str] = []
    shown = 0
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            text = tokenizer.decode(ids[start:i], skip_special_tokens=False)
            if shown + len(text) > max_chars:
                text = text[:max(0, max_chars - shown)] + " …"
            shown += len(text)
            esc = html.escape(text)
            if mask[start]:
                pieces.append(f"<b style='color:#116329;background:#dafbe1'>{esc}</b>")
            else:
                pieces.append(f"<span style='color:#57606a'>{esc}</span>")
            start = i
            if shown >= max_chars:
                break
    n_mask = sum(mask)
    head = (f"<p><b>{len(ids)}</b> tokens (max_length {max_length}), <b>{n_mask}</b> with loss mask 1 "
            f"(<b style='color:#116329;background:#dafbe1'>assistant, trained on</b>) and {len(ids) - n_mask} "
            f"with mask 0 (<span style='color:#57606a'>template, system and user text</span>).</p>")
    body = "".join(pieces)
    return head + ("<pre style='white-space:pre-wrap;font-size:0.85em;border:1px solid #ddd;padding:6px'>"
                   f"{body}</pre>")


def sample_conversation_html(ctx: StudyContext, index: int | None = None, *,
                             target: Any = None, max_chars: int = 4000) -> str:
    """:func:`loss_mask_html` of training conversation ``index`` of the profile (default: the first one
    that keeps at least one assistant token within ``max_length``)."""
    prof, rdir = ctx.profile, ctx.run_dir
    target = target or get_target(prof)
    d = prof.data
    convs = load_training_conversations(prof, rdir, target)
    if not convs:
        return "<p>no conversations</p>"
    if index is None:
        index = 0
        for i, c in enumerate(convs):
            f = format_conversation(target.tokenizer, c.messages, template=prof.target.template,
                                    max_length=d.max_length)
            if sum(f.loss_mask) > 0:
                index = i
                break
    conv = convs[index]
    head = f"<p>Conversation {index} (id <code>{html.escape(str(conv.id))}</code>, {len(conv.messages)} messages)</p>"
    return head + loss_mask_html(target.tokenizer, conv.messages, template=prof.target.template,
                                 max_length=d.max_length, max_chars=max_chars)
