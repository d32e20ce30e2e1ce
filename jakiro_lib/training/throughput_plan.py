"""The throughput model: a profile's caching and training stages in expected minutes on the machine that measured
a throughput table (:mod:`jakiro_lib.training.throughput` measures it; :mod:`jakiro_lib.training.scale_plan` sizes
the main job with it).
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from ..config import Profile
from ..data.feature_store import resolve_cache_dtype
from ..precision import compiles_step, resolve_precision


PLAN_COLUMNS = ("stage", "draft", "basis", "tokens", "tokens_per_s", "seconds", "minutes")


def measured_favoured(table: pd.DataFrame) -> str | None:
    """The dtype the measuring machine favours: the one its cache rows used besides fp32 (run_throughput measures
    both)."""
    return next((d for d in table.loc[table["part"] == "cache", "dtype"] if d != "float32"), None)


def _prefer(rows: pd.DataFrame, column: str, value: Any) -> pd.DataFrame:
    """The rows where ``column`` equals ``value`` if there are any, else all of them."""
    match = rows[rows[column] == value]
    return match if not match.empty else rows


def stage_plan(profile: Profile, table: pd.DataFrame, *, tokens: int) -> pd.DataFrame:
    """Expected seconds of ``profile``'s caching and training stages on the machine that measured ``table``
    (docs/DESIGN.md section 4, the throughput model); ``tokens``: the profile's conversations, tokenized
    (:func:`jakiro_lib.data.features.estimate_cache`). ``basis`` says which measured row each stage's rate is."""
    rows: list[dict[str, Any]] = []
    favoured = measured_favoured(table)
    dtype = resolve_cache_dtype(profile, favoured)
    cache = table[(table["part"] == "cache") & (table["dtype"] == dtype)]
    if not cache.empty:
        cache = _prefer(cache, "allocator", "kept")
        best = cache.loc[(cache["batch_size"] - profile.data.cache_batch_size).abs().idxmin()]
        rows.append({"stage": "cache", "draft": "", "basis": f"{best['variant']} ({dtype})", "tokens": tokens,
                     "tokens_per_s": best["tokens_per_s"]})
    precision = resolve_precision(profile.train.mixed_precision, favoured)
    train = table[(table["part"] == "train") & (table["dtype"] == ("bf16 autocast" if precision == "bf16" else "float32"))]
    train = _prefer(_prefer(_prefer(train, "compiled", compiles_step(profile.train.compile, precision)),
                            "allocator", "kept"), "bucketed", profile.train.bucket_by_length)
    measured = {r["draft"]: r for _, r in train.iterrows()}
    train_tokens = round(tokens * (1.0 - profile.data.heldout_fraction))
    unroll = {n: c.unroll_steps or profile.train.unroll_steps for n, c in profile.drafts.items()}
    for name, cfg in profile.drafts.items():
        if name in measured:
            basis, rate = measured[name]["variant"], measured[name]["tokens_per_s"]
        else:
            same = [m for m in measured if profile.drafts[m].mlp == cfg.mlp] or list(measured)
            if not same:
                continue
            ref = same[0]
            rate = measured[ref]["tokens_per_s"] * unroll[ref] / unroll[name]
            basis = f"as {measured[ref]['variant']}" + (f" x {unroll[ref]}/{unroll[name]} unroll steps"
                                                        if unroll[ref] != unroll[name] else "")
        rows.append({"stage": "train", "draft": name, "basis": basis, "tokens": profile.train.epochs * train_tokens,
                     "tokens_per_s": rate})
    plan = pd.DataFrame(rows).reindex(columns=list(PLAN_COLUMNS))
    plan["seconds"] = plan["tokens"] / plan["tokens_per_s"]
    total = {"stage": "total", "draft": "", "basis": "caching + training", "tokens": float("nan"),
             "tokens_per_s": float("nan"), "seconds": plan["seconds"].sum()}
    plan = pd.concat([plan, pd.DataFrame([total])], ignore_index=True) if rows else plan
    plan["minutes"] = plan["seconds"] / 60.0
    return plan


def format_plan(plan: pd.DataFrame) -> str:
    """The plan as the command prints it: expected minutes per stage and the measured rate behind each."""
    formats = {"tokens": "{:,.0f}".format, "tokens_per_s": "{:,.0f}".format, "minutes": "{:.1f}".format}
    return plan[["stage", "draft", "tokens", "tokens_per_s", "minutes", "basis"]].to_string(
        index=False, na_rep="", formatters=formats)
