"""The main job sized by measurement: how many conversations and epochs fit 90 minutes on this machine (docs/DESIGN.md
sections 4 and 11). Where ``data.scale="auto"``, :func:`resolve_scale` measures for about a minute (:func:`measure`),
:func:`~jakiro_lib.training.scale_plan.choose_scale` chooses, and ``<run_dir>/scale.json`` keeps the choice while the
settings are the same; ``--set data.num_conversations`` or ``train.epochs`` win."""
from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import Profile
from ..profiles import DEFAULT_SCALE
from ..measure.costmodel import measure_target_costs
from ..data.conversations import load_conversations
from ..data.feature_store import resolve_cache_dtype
from ..data.features import estimate_cache
from ..models.target import load_target
from .scale_plan import (BENCH_SECONDS_PER_T1_MS, CONVERSATIONS_PER_EPOCH, MAIN_JOB_MINUTES, MARGIN, MAX_EPOCHS,
                         PLAN_OVERRUN, Measurement, ScaleError, choose_scale, compile_gain, plan_at, rates)
from .throughput import cached_dataset, caching_rows, rows_table, training_rows
from ..files import read_json, write_json
from ..machine import environment, keep_freed_memory
from ..precision import favoured_dtype, resolve_precision

log = logging.getLogger(__name__)

SCALE_JSON = "scale.json"
VERSION = 1
KEYS = ("data.num_conversations", "train.epochs")


# The measurement


def _measured_drafts(profile: Profile) -> list[str]:
    """Each single-step draft, and the first draft of an MLP kind that has no single-step one: stage_plan gives the
    others their kind's rate over their unroll steps (measured: docs/results.md, CPU with AMX: the throughput model
    against a main job)."""
    unroll = {n: c.unroll_steps or profile.train.unroll_steps for n, c in profile.drafts.items()}
    names = [n for n in profile.drafts if unroll[n] == 1]
    kinds = {profile.drafts[n].mlp for n in names}
    for n, c in profile.drafts.items():
        if c.mlp not in kinds:
            names.append(n)
            kinds.add(c.mlp)
    return names


def measure(profile: Profile, *, conversations: int = 16, steps: int = 6, warmup: int = 2,
            token_sample: int = 400) -> Measurement:
    """Measure ``profile``'s costs on this machine (module docstring); about a minute for the default profile on a
    2-core CPU. ``conversations`` are cached (timed) and trained on, ``steps`` eager steps per draft after ``warmup``
    untimed ones; ``token_sample`` conversations are tokenized for tokens per conversation."""
    t0 = time.perf_counter()
    d = profile.data
    device = torch.device(profile.target.device)
    favoured = favoured_dtype(device)
    convs = load_conversations(d.source, path=d.path, limit=conversations)
    allocator = "kept" if device.type == "cpu" and keep_freed_memory(True) else "system"  # as caching runs
    rows = caching_rows(profile.target, convs, d, batch_sizes=(d.cache_batch_size,),
                        dtypes=(resolve_cache_dtype(profile, favoured),), allocator=allocator)
    target = load_target(profile.target)
    t1 = measure_target_costs(target.model, sizes=(1,), repeats=5)[1]
    everything = load_conversations(d.source, path=d.path)
    sample = estimate_cache(target, everything[:token_sample], max_length=d.max_length, template=profile.target.template)
    precision = resolve_precision(profile.train.mixed_precision, favoured)
    with cached_dataset(target, convs, profile, d.cache_batch_size) as dataset:
        if len(dataset) == 0:  # a loader over nothing would never yield a step
            raise ScaleError(f"no trained token in the first {conversations} conversations within data.max_length="
                             f"{d.max_length}: nothing to time training on")
        drafts = {n: profile.drafts[n] for n in _measured_drafts(profile)}
        rows += training_rows(target, drafts, dataset, profile.train, steps=steps, warmup=warmup,
                              precisions=("bf16" if precision == "bf16" else "fp32",), allocator=allocator,
                              bucketing=(profile.train.bucket_by_length,))
    return Measurement(table=rows_table(rows), t1_ms=1000.0 * t1,
                       tokens_per_conversation=sample["tokens"] / max(1, min(token_sample, len(everything))),
                       available=len(everything), seconds=time.perf_counter() - t0, environment=environment(device))


# The pipeline's step: reuse the recorded choice or measure and record one


def set_keys(overrides: dict[str, Any]) -> dict[str, Any]:
    """The scale keys the user set, in dotted spelling (papermill's ``train__epochs`` too)."""
    return {k.replace("__", "."): v for k, v in overrides.items() if k.replace("__", ".") in KEYS}


def basis(profile: Profile, fixed: dict[str, Any]) -> dict[str, Any]:
    """What the choice depends on: the target, data, training and drafts (not the benchmark's settings: a rerun with
    another ``bench.limit`` continues at the same scale), with the scale keys only where the user set them."""
    out = {k: v for k, v in profile.to_dict().items() if k in ("target", "data", "train", "drafts")}
    out["data"] = {k: v for k, v in out["data"].items() if k != "num_conversations" or "data.num_conversations" in fixed}
    out["data"].pop("tokenize_workers", None)  # how caching tokenizes: neither the cache nor the measured rate changes
    out["train"] = {k: v for k, v in out["train"].items() if k != "epochs" or "train.epochs" in fixed}
    return json.loads(json.dumps(out, default=str))


def _changed(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two bases."""
    keys = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += _changed(a, b, f"{prefix}{k}.")
        elif a != b:
            keys.append(f"{prefix}{k}")
    return keys


def _valid(record: Any) -> bool:
    return (isinstance(record, dict) and record.get("version") == VERSION and isinstance(record.get("chosen"), dict)
            and all(isinstance(record["chosen"].get(k), int) for k in ("num_conversations", "epochs")))


def _made_with(record: Any, basis_now: dict[str, Any]) -> bool:
    """Whether ``record`` is a readable scale choice made on ``basis_now`` (reused, not measured again)."""
    return _valid(record) and record.get("basis") == basis_now


def _with_choice(overrides: dict[str, Any], record: dict[str, Any], fixed: dict[str, Any]) -> dict[str, Any]:
    c = record["chosen"]
    chosen = {"data.num_conversations": c["num_conversations"], "train.epochs": c["epochs"]}
    return {**overrides, **{k: v for k, v in chosen.items() if k not in fixed}}


def recorded_scale(profile: Profile, overrides: dict[str, Any],
                   run_dir: str | Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The overrides with the scale recorded in ``<run_dir>/scale.json`` filled in, where ``profile`` is "auto" and
    the record was made with the same :func:`basis`; else ``(overrides, None)``. Never measures: for a stage run on
    its own (``python -m jakiro_lib cache|train|bench``) after a pipeline chose the scale."""
    fixed = set_keys(overrides)
    if profile.data.scale != "auto" or len(fixed) == len(KEYS):
        return overrides, None
    record = read_json(Path(run_dir) / SCALE_JSON)
    if not _made_with(record, basis(profile, fixed)):
        return overrides, None
    return _with_choice(overrides, record, fixed), record


def resolve_scale(profile: Profile, overrides: dict[str, Any], run_dir: str | Path, *,
                  measure: Callable[[Profile], Measurement] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The pipeline's overrides with the scale keys filled in where ``profile.data.scale`` is "auto", and the record
    (None where nothing was chosen). Reuses ``<run_dir>/scale.json`` when it was made with the same :func:`basis`;
    else measures (``measure``: default :func:`measure`), chooses and writes it."""
    if profile.data.scale != "auto":
        return overrides, None
    fixed = set_keys(overrides)
    if len(fixed) == len(KEYS):
        log.info("scale: %s set: auto scale not used", " and ".join(f"{k}={fixed[k]}" for k in KEYS))
        return overrides, None
    path = Path(run_dir) / SCALE_JSON
    now = basis(profile, fixed)
    record = read_json(path)
    if _made_with(record, now):
        c = record["chosen"]
        log.info("scale: reusing %s conversations x %s epochs, chosen by measurement on %s (%s; delete it to measure "
                 "again)", c["num_conversations"], c["epochs"], record.get("date", "?"), path)
    else:
        if _valid(record):
            log.info("scale: %s was chosen with other settings (%s): measuring again", path,
                     ", ".join(_changed(record["basis"], now)[:6]))
        elif path.exists():
            log.warning("scale: %s is unreadable: measuring again", path)
        # the module's measure looked up now, not bound at definition: tests replace it
        record = _measure_and_choose(profile, fixed, now, measure or globals()["measure"])
        write_json(path, record)
        c = record["chosen"]
        b = record["budget"]
        log.info("scale: %s conversations x %s epochs: caching + training expected %.1f of the %.1f minutes left of "
                 "the %d-minute main job after the benchmark (about %.1f min, from T(1) = %.1f ms), this measurement "
                 "(%.1f min) and a %d%% margin; %s. Recorded in %s", c["num_conversations"], c["epochs"],
                 c["expected_minutes"], b["caching_training_minutes"], MAIN_JOB_MINUTES, b["benchmark_minutes"],
                 record["measured"]["t1_ms"], b["measurement_minutes"], round(100 * MARGIN), c["reason"], path)
    for key, value in fixed.items():
        log.info("scale: %s=%s set: it wins over auto", key, value)
    return _with_choice(overrides, record, fixed), record


def _measure_and_choose(profile: Profile, fixed: dict[str, Any], basis_now: dict[str, Any],
                        measure: Callable[[Profile], Measurement]) -> dict[str, Any]:
    log.info("scale: measuring this machine's caching, training and decoding speed to size the main job "
             "(data.scale=auto; about a minute)")
    m = measure(profile)
    r = rates(profile, m)
    choice = choose_scale(r, conversations=int(fixed["data.num_conversations"]) if "data.num_conversations" in fixed
                          else None, epochs=int(fixed["train.epochs"]) if "train.epochs" in fixed else None)
    plan = plan_at(profile, m, choice.num_conversations, choice.epochs)
    train = m.table[m.table["part"] == "train"]
    cache = m.table[m.table["part"] == "cache"].iloc[0]
    return {
        "version": VERSION,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "profile": profile.name,
        "chosen": {"num_conversations": choice.num_conversations, "epochs": choice.epochs,
                   "expected_minutes": round(choice.seconds / 60.0, 2), "reason": choice.reason},
        "measured": {
            "cache": {"tokens_per_s": float(cache["tokens_per_s"]), "dtype": cache["dtype"],
                      "batch_size": int(cache["batch_size"]), "variant": cache["variant"]},
            "train": {row["draft"]: {"tokens_per_s": float(row["tokens_per_s"]), "dtype": row["dtype"],
                                     "variant": row["variant"]} for _, row in train.iterrows()},
            "t1_ms": m.t1_ms, "tokens_per_conversation": m.tokens_per_conversation,
            "conversations_available": m.available, "seconds": round(m.seconds, 1),
        },
        "budget": {"main_job_minutes": MAIN_JOB_MINUTES, "margin": MARGIN,
                   "benchmark_minutes": round(r.bench_s / 60.0, 2), "bench_seconds_per_t1_ms": BENCH_SECONDS_PER_T1_MS,
                   "measurement_minutes": round(r.measure_s / 60.0, 2),
                   "caching_training_minutes": round(choice.budget_s / 60.0, 2), "plan_overrun": PLAN_OVERRUN,
                   "compile_gain": compile_gain(profile, m.table), "conversations_per_epoch": CONVERSATIONS_PER_EPOCH,
                   "max_epochs": MAX_EPOCHS, "floor": list(DEFAULT_SCALE)},
        "plan": json.loads(plan.to_json(orient="records")),
        "set_by_user": fixed,
        "basis": basis_now,
        "environment": m.environment,
    }
