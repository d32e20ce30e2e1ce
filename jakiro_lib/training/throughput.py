"""Tokens per second of the training pipeline on this machine, stage by stage (``python -m jakiro_lib throughput``;
docs/DESIGN.md section 4): **cache** rows (the target's features, no disk write) and **train** rows
(:func:`jakiro_lib.training.train.train_draft`'s steps, timed part by part and free-running), per batching, precision
and compilation, and with glibc's freed memory kept. Tokens exclude padding; ``speedup`` compares a row with its
part's first. Writes ``throughput.csv``, its config and environment, and ``plan.csv``."""
from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from ..data.batching import padded_tokens
from ..config import DataConfig, DraftConfig, Profile, TargetConfig, TrainConfig
from ..data.conversations import load_conversations
from ..data.dataset import FeatureDataset, build_draft_vocab, token_frequencies
from ..models.draft import DraftModel
from ..data.features import cache_features, estimate_cache, length_batches, shard_tensors
from ..models.target import load_target
from ..models.loss import COMPILED_STEP, step_loss, training_loss_options
from .throughput_plan import stage_plan
from .train import training_loader
from ..files import write_json
from ..profiles import draft_names
from ..compiling import run_compiling
from ..machine import environment, keep_freed_memory, seed_everything, synchronize
from ..precision import compiles_step, favoured_dtype

CSV = "throughput.csv"
PLAN_CSV = "plan.csv"
CONFIG_JSON = "throughput_config.json"
ENV_JSON = "throughput_env.json"
COMPILED_WARMUP = 8  # untimed steps before a compiled row (compilation)
STAGES = ("data", "forward", "backward", "optimizer", "sync")
COLUMNS = ("part", "variant", "draft", "device", "dtype", "allocator", "batch_size", "bucketed", "compiled", "items",
           "tokens", "padded_tokens", "padding", "seconds", "tokens_per_s", "speedup", *(f"{s}_ms" for s in STAGES),
           "step_ms")


class _Clock:
    """Adds the time since the previous lap to a stage; with ``sync``, CUDA work is finished first."""

    def __init__(self, device: torch.device, sync: bool) -> None:
        self.device, self.sync = device, sync
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.t = 0.0

    def start(self) -> None:
        synchronize(self.device)
        self.t = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.sync:
            synchronize(self.device)
        now = time.perf_counter()
        self.seconds[stage] += now - self.t
        self.t = now


# Feature caching


def _cache_pass(target: Any, convs: Sequence[Any], data: DataConfig, template: str, batch_size: int) -> dict[str, Any]:
    """Features of ``convs`` shard by shard, as caching computes them (no disk write): time and tokens."""
    stored = getattr(torch, data.feature_dtype)
    lengths: list[list[int]] = []
    synchronize(target.device)
    t0 = time.perf_counter()
    for start in range(0, len(convs), data.shard_size):
        tensors, _, _ = shard_tensors(target, convs[start:start + data.shard_size], start, max_length=data.max_length,
                                      template=template, dtype=stored, bar=None, batch_size=batch_size)
        lengths.append((tensors["offsets"][:, 1] - tensors["offsets"][:, 0]).tolist())
    synchronize(target.device)
    seconds = time.perf_counter() - t0
    padded = sum(padded_tokens(ls, length_batches(ls, batch_size)) for ls in lengths)
    return {"items": len(convs), "tokens": sum(map(sum, lengths)), "padded_tokens": padded, "seconds": seconds}


def caching_rows(target_cfg: TargetConfig, convs: Sequence[Any], data: DataConfig, *,
                 batch_sizes: Sequence[int], dtypes: Sequence[str], allocator: str = "system") -> list[dict[str, Any]]:
    """One row per (target dtype, conversations per forward); a warm-up pass per dtype is not timed.
    ``allocator``: glibc's own settings ("system") or freed memory kept ("kept") while these rows run."""
    _allocator(allocator)
    rows = []
    for dtype in dtypes:
        target = load_target(dataclasses.replace(target_cfg, dtype=dtype))
        _cache_pass(target, convs[:max(batch_sizes)], data, target_cfg.template, max(batch_sizes))
        for bs in batch_sizes:
            variant = ("per conversation" if bs == 1 else f"batch {bs}") + _SUFFIX[allocator]
            rows.append({"part": "cache", "variant": variant,
                         "device": str(target.device), "dtype": dtype, "allocator": allocator, "batch_size": bs,
                         **_cache_pass(target, convs, data, target_cfg.template, bs)})
        del target
    return rows


# Draft training steps


def _loader(dataset: Any, train_cfg: TrainConfig, bucketed: bool, device: torch.device) -> Iterator[dict[str, Any]]:
    """Batches forever, epoch after epoch, from the loader train_draft builds."""
    sampler, loader = training_loader(dataset, train_cfg, bucketed, device)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def _steps(core: DraftModel, loss_of: Any, optimizer: Any, batches: Iterator[dict[str, Any]], n: int,
           train_cfg: TrainConfig, precision: str, clock: _Clock) -> tuple[int, int]:
    """Run ``n`` training steps, lapping ``clock`` at every stage; returns (real, padded) tokens."""
    device = clock.device
    tokens = padded = 0
    clock.start()
    for _ in range(n):
        batch = next(batches)
        padded += batch["input_ids"].numel()
        batch = {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}
        clock.lap("data")
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, _ = loss_of(batch)
        clock.lap("forward")
        loss.backward()
        clock.lap("backward")
        torch.nn.utils.clip_grad_value_(core.parameters(), train_cfg.grad_clip_value)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.lap("optimizer")
        tokens += int(batch["lengths"].sum())  # the loop's per-step read-back (tokens seen)
        clock.lap("sync")
    synchronize(device)
    return tokens, padded


def _train_variant(target: Any, draft_cfg: DraftConfig, d2t: torch.Tensor | None, dataset: Any, train_cfg: TrainConfig,
                   *, precision: str, bucketed: bool, steps: int, warmup: int, compiled: bool = False) -> dict[str, Any]:
    device = target.device
    seed_everything(train_cfg.seed)
    core = DraftModel.build(draft_cfg, target.model, d2t).float()
    core.train()
    optimizer = torch.optim.AdamW(core.parameters(), lr=train_cfg.lr, betas=tuple(train_cfg.betas),
                                  weight_decay=train_cfg.weight_decay)
    batches = _loader(dataset, train_cfg, bucketed, device)
    loss_of = step_loss(core, training_loss_options(draft_cfg, train_cfg),
                        compile_batch=train_cfg.batch_size if compiled else None)
    # a compiled step compiles at its first call, again at the first new sizes, and maybe at a new length
    run_compiling(lambda: _steps(core, loss_of, optimizer, batches, max(warmup, COMPILED_WARMUP if compiled else 0),
                                 train_cfg, precision, _Clock(device, sync=True)),
                  compiling=compiled, **COMPILED_STEP)
    staged = _Clock(device, sync=True)
    _steps(core, loss_of, optimizer, batches, steps, train_cfg, precision, staged)
    free = _Clock(device, sync=False)
    t0 = time.perf_counter()
    tokens, padded = _steps(core, loss_of, optimizer, batches, steps, train_cfg, precision, free)
    seconds = time.perf_counter() - t0
    return {"device": str(device), "dtype": "float32" if precision == "fp32" else "bf16 autocast",
            "batch_size": train_cfg.batch_size, "bucketed": bucketed, "items": steps, "tokens": tokens,
            "padded_tokens": padded, "seconds": seconds, "step_ms": 1000 * seconds / steps,
            **{f"{s}_ms": 1000 * staged.seconds[s] / steps for s in STAGES}}


def training_rows(target: Any, drafts: dict[str, DraftConfig], dataset: Any, train_cfg: TrainConfig, *,
                  steps: int, warmup: int, precisions: Sequence[str], allocator: str = "system",
                  bucketing: Sequence[bool] = (False, True), compiled: bool = False) -> list[dict[str, Any]]:
    """One row per (draft, precision, bucketing); every variant starts from the same seed. ``allocator``: as
    in :func:`caching_rows`; ``compiled``: the step through torch.compile (:func:`jakiro_lib.models.loss.step_loss`)."""
    _allocator(allocator)
    freqs = None
    rows = []
    for name, cfg in drafts.items():
        d2t = None
        if cfg.draft_vocab_size is not None:
            freqs = token_frequencies(dataset, target.model.config.vocab_size) if freqs is None else freqs
            d2t = build_draft_vocab(freqs, min(cfg.draft_vocab_size, freqs.numel()), always=target.eos_token_ids)
        for precision in precisions:
            for bucketed in bucketing:
                row = _train_variant(target, cfg, d2t, dataset, train_cfg, precision=precision, bucketed=bucketed,
                                     steps=steps, warmup=warmup, compiled=compiled)
                rows.append({"part": "train", "draft": name, "variant": f"{name} {precision}" + (" bucketed" if bucketed else "")
                             + _SUFFIX[allocator] + (", compiled" if compiled else ""), "allocator": allocator,
                             "compiled": compiled, **row})
    return rows


# The whole measurement


_SUFFIX = {"system": "", "kept": ", freed memory kept"}


def _allocator(name: str) -> None:
    if name not in _SUFFIX:
        raise ValueError(f"allocator must be 'system' or 'kept', got {name!r}")
    keep_freed_memory(name == "kept")


def rows_table(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The measured rows as a table of :data:`COLUMNS`: tokens per second, padding and speedup filled in."""
    df = pd.DataFrame(rows).reindex(columns=list(COLUMNS))
    df["tokens_per_s"] = df["tokens"] / df["seconds"]
    df["padding"] = 1.0 - df["tokens"] / df["padded_tokens"]
    first = df.groupby("part", sort=False)["tokens_per_s"].transform("first")
    df["speedup"] = df["tokens_per_s"] / first
    return df


@contextlib.contextmanager
def cached_dataset(target: Any, convs: Sequence[Any], profile: Profile, batch_size: int,
                   folder: Path | None = None) -> Iterator[FeatureDataset]:
    """``convs``' features cached as ``profile`` caches them, in a temporary folder (in ``folder``, else the system's)
    that goes when the block ends: all of them as one dataset."""
    d = profile.data
    with tempfile.TemporaryDirectory(dir=folder, prefix=".features.") as tmp:
        cache_features(target, convs, tmp, max_length=d.max_length, shard_size=d.shard_size,
                       feature_dtype=d.feature_dtype, template=profile.target.template, progress=False,
                       batch_size=batch_size, tokenize_workers=d.tokenize_workers)
        yield FeatureDataset(tmp, "all", 0.0)


def run_throughput(profile: Profile, out_dir: str | Path, *, conversations: int = 64, steps: int = 20,
                   warmup: int = 2, cache_batch_sizes: Sequence[int] = (1, 4, 8, 16),
                   drafts: Sequence[str] | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measure caching and training throughput for ``profile`` on ``conversations`` of its data, ``steps``
    timed training steps per variant after ``warmup``, for ``drafts`` (default: the profile's first); returns
    (and writes) the table and the stage plan of the profile's whole data."""
    if conversations < 1 or steps < 1 or warmup < 0 or not cache_batch_sizes or min(cache_batch_sizes) < 1:
        raise ValueError("need conversations >= 1, steps >= 1, warmup >= 0 and cache batch sizes >= 1")
    names = draft_names(profile, drafts or list(profile.drafts)[:1])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(profile.target.device)
    favoured = favoured_dtype(device)
    options = {"conversations": conversations, "steps": steps, "warmup": warmup,
               "cache_batch_sizes": list(cache_batch_sizes), "drafts": names}
    write_json(out_dir / CONFIG_JSON, {"profile": profile.to_dict(), "options": options})
    write_json(out_dir / ENV_JSON, environment(device))
    d = profile.data
    convs = load_conversations(d.source, path=d.path, limit=conversations)
    dtypes = ["float32"] + ([favoured] if favoured else [])
    # glibc's allocator settings can be switched: "kept" rows (the favoured dtype) follow the "system" ones
    kept = device.type == "cpu" and keep_freed_memory(True)
    rows = caching_rows(profile.target, convs, d, batch_sizes=cache_batch_sizes, dtypes=dtypes)
    if kept:
        rows += caching_rows(profile.target, convs, d, batch_sizes=cache_batch_sizes, dtypes=dtypes[-1:],
                             allocator="kept")
    target = load_target(profile.target)
    with cached_dataset(target, convs, profile, max(cache_batch_sizes), out_dir) as dataset:
        precisions = ["fp32"] + (["bf16"] if favoured else [])
        drafts_cfg = {n: profile.drafts[n] for n in names}
        rows += training_rows(target, drafts_cfg, dataset, profile.train, steps=steps, warmup=warmup,
                              precisions=precisions)
        if kept:
            rows += training_rows(target, drafts_cfg, dataset, profile.train, steps=steps, warmup=warmup,
                                  precisions=precisions[-1:], allocator="kept", bucketing=(False,))
        if compiles_step(profile.train.compile, precisions[-1]):  # as the profile's own training would: last rows
            rows += training_rows(target, drafts_cfg, dataset, profile.train, steps=steps, warmup=warmup,
                                  precisions=precisions[-1:], allocator="kept" if kept else "system",
                                  bucketing=(False,), compiled=True)
    table = rows_table(rows)
    table.to_csv(out_dir / CSV, index=False)
    plan = stage_plan(profile, table, tokens=profile_tokens(profile, target))
    plan.to_csv(out_dir / PLAN_CSV, index=False)
    return table, plan


def profile_tokens(profile: Profile, target: Any) -> int:
    """Tokens of the profile's whole data (``data.num_conversations``, tokenized as caching does; no forward)."""
    d = profile.data
    convs = load_conversations(d.source, path=d.path, limit=d.num_conversations)
    return estimate_cache(target, convs, max_length=d.max_length, template=profile.target.template)["tokens"]


def plan_from(profile: Profile, table_csv: str | Path, out_dir: str | Path) -> pd.DataFrame:
    """:func:`stage_plan` of ``profile`` from a ``throughput.csv`` measured elsewhere (a GPU's, say), with the
    profile's data tokenized here (the target loaded on the CPU for its tokenizer); writes ``out_dir/plan.csv``."""
    try:
        table = pd.read_csv(table_csv)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ValueError(f"{table_csv} is not a throughput.csv ({type(exc).__name__})") from None
    if "draft" not in table.columns or not {"part", "dtype", "tokens_per_s"} <= set(table.columns):
        raise ValueError(f"{table_csv} is not a throughput.csv with a draft column (as this version writes it)")
    target = load_target(dataclasses.replace(profile.target, device="cpu", dtype="float32"))
    plan = stage_plan(profile, table, tokens=profile_tokens(profile, target))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    plan.to_csv(Path(out_dir) / PLAN_CSV, index=False)
    return plan


def format_table(table: pd.DataFrame) -> str:
    """The short table the command prints: tokens/s, speedup, padding and the step's stages in ms."""
    ms = [f"{s}_ms" for s in STAGES] + ["step_ms"]
    cols = ["part", "variant", "dtype", "batch_size", "tokens_per_s", "speedup", "padding", *ms]
    formats = {"tokens_per_s": "{:,.0f}".format, "speedup": "{:.2f}x".format, "padding": "{:.0%}".format,
               "batch_size": "{:.0f}".format, **{c: "{:.1f}".format for c in ms}}
    return table[cols].to_string(index=False, na_rep="", formatters=formats)
