"""Stage 01 (notebook 01): every draft of the profile trained with the same data and budget (:func:`train_all`), and the
training tables."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from ..config import ConfigError, Profile, TargetConfig
from ..data.dataset import FeatureDataset, OnlineFeatureDataset, build_draft_vocab, token_frequencies, vocab_coverage
from ..data.feature_store import CacheError, verify_cache
from ..layout import TRAIN_STAMP, RunLayout, has_weights
from ..training.checkpoints import list_checkpoints, saved_vocab
from ..training.train import RESULTS, train_draft, train_identity
from ..files import read_json, replace_dir_atomically, restore_replaced_dir, write_json, write_table
from ..distributed import launched_world
from ..profiles import draft_names
from .context import StudyContext, get_target
from .heads import import_draft
from .s00_data import load_training_conversations

log = logging.getLogger(__name__)


def training_datasets(profile: Profile, run_dir: Path, target: Any) -> tuple[Any, Any]:
    """(train, held-out) datasets: from the feature cache, or online from the conversations."""
    d = profile.data
    if d.online:
        convs = load_training_conversations(profile, run_dir, target)
        kw = dict(max_length=d.max_length, template=profile.target.template, heldout_fraction=d.heldout_fraction)
        return (OnlineFeatureDataset(target, convs, split="train", **kw),
                OnlineFeatureDataset(target, convs, split="heldout", **kw))
    cache = RunLayout(run_dir).features
    return (FeatureDataset(cache, "train", d.heldout_fraction),
            FeatureDataset(cache, "heldout", d.heldout_fraction))


def _features_fingerprint(profile: Profile, run_dir: Path) -> Any:
    if profile.data.online:
        return {"online": dataclasses.asdict(profile.data)}
    m = read_json(RunLayout(run_dir).features_manifest) or {}
    return {"settings": m.get("settings"), "shards": [s.get("sha256") for s in m.get("shards", [])],
            "heldout_fraction": profile.data.heldout_fraction}


def _train_stamp(profile: Profile, name: str, run_dir: Path) -> dict[str, Any]:
    if profile.drafts[name].import_from:  # imported, not trained: the head and the target decide it
        return json.loads(json.dumps({"draft": profile.drafts[name].identity(), "target": profile.target.identity()}))
    return json.loads(json.dumps({
        "draft": profile.drafts[name].identity(), "train": train_identity(profile.train),
        "target": profile.target.identity(), "features": _features_fingerprint(profile, run_dir),
    }, default=str))


def _same_training(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether a draft trained under stamp ``old`` is the one ``new`` asks for. Stamps written before the
    target's kernel fields left them (TargetConfig.KERNEL_FIELDS: same outputs, other timings) still match."""
    if old is None:
        return False
    target = {k: v for k, v in old.get("target", {}).items() if k not in TargetConfig.KERNEL_FIELDS}
    return {**old, "target": target} == new


def _log_every(n_train: int, train_cfg: Any) -> int:
    steps = math.ceil(n_train / max(train_cfg.batch_size, 1)) * max(train_cfg.epochs, 1)
    if train_cfg.max_steps is not None:
        steps = min(steps, train_cfg.max_steps)
    return max(1, steps // 200)


def train_all(ctx: StudyContext, *,
              only: Sequence[str] | None = None, force: bool = False, target: Any = None,
              progress: bool = True) -> dict[str, dict[str, Any]]:
    """Train every draft of ``profile.drafts`` (or ``only`` those) with the same data and budget into
    ``run_dir/drafts/<name>/``, the feature cache verified first; returns ``{name: results}`` (with ``skipped`` and
    ``vocab_coverage``). A draft whose stamp matches is skipped unless ``force``; an unfinished one resumes in
    ``drafts/.<name>.training/`` (delete it to start over), which replaces the old atomically. One with ``import_from``
    is imported (:func:`jakiro_lib.study.heads.import_draft`); drafts of one ``draft_vocab_size`` share a vocabulary."""
    prof, rdir = ctx.profile, ctx.run_dir
    layout = RunLayout(rdir)
    names = draft_names(prof, only or prof.drafts)
    if not prof.data.online and layout.features_manifest.is_file():
        manifest = verify_cache(layout.features, allow_incomplete=True)  # the stamps read it: CacheError if corrupt
        _check_cache_settings(prof, layout, manifest)
    world = launched_world()  # under `accelerate launch`: one process manages the files
    main_process, wait = world.index == 0, world.wait
    out, todo = _trained_already(prof, layout, names, force, main_process)
    for name in [n for n in todo if prof.drafts[n].import_from]:  # imported (loaded), not trained
        target = target or get_target(prof)
        out[name] = import_draft(prof, layout, name, target, _train_stamp(prof, name, rdir), main_process)
        todo.remove(name)
    if not todo:
        return {n: out[n] for n in names}
    starts = _warm_starts(prof, todo)
    if not prof.data.online:
        verify_cache(layout.features, full=True)  # a CacheError now (sha256 too: seconds), not after hours
    target = target or get_target(prof)

    train_ds, held_ds = training_datasets(prof, rdir, target)
    log.info("training %s on %d conversations (%d held out)", ", ".join(todo), len(train_ds), len(held_ds))
    vocabs = _Vocabularies(train_ds, target)
    for name in todo:
        d2t, coverage = vocabs.for_draft(prof.drafts[name], starts[name])
        work = _prepare_work(prof, layout, name, main_process)
        wait()
        t0 = time.perf_counter()
        res = train_draft(target, prof.drafts[name], train_ds, held_ds, work, prof.train, d2t=d2t, progress=progress,
                          log_every=_log_every(len(train_ds), prof.train), init_from=starts[name])
        res = {**res, "skipped": False, "vocab_coverage": coverage}
        _install(work, layout, name, coverage, main_process)
        wait()
        out[name] = res
        log.info("draft %s: trained in %.1f s, held-out acc_a %s acc_b %s", name, time.perf_counter() - t0,
                 _fmt(res.get("acc_a")), _fmt(res.get("acc_b")))
    return {n: out[n] for n in names}


def _trained_already(prof: Profile, layout: RunLayout, names: list[str], force: bool,
                     main_process: bool) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """(the results of the drafts already trained as asked, marked skipped; the drafts to train), after putting
    back any draft an interrupted replacement left aside."""
    todo: list[str] = []
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        d = layout.draft_dir(name)
        if main_process and restore_replaced_dir(d):
            log.warning("draft %s: put back the previous draft that an interrupted replacement left aside", name)
        res, old = read_json(layout.draft_results(name)), read_json(layout.train_stamp(name))
        if res is not None and layout.draft(name).is_dir() \
                and _same_training(old, _train_stamp(prof, name, layout.root)) and not force:
            res["skipped"] = True
            out[name] = res
            if res.get("imported"):
                log.info("draft %s: already imported from %s, skipped", name, res["imported"].get("source"))
            else:
                log.info("draft %s: already trained (held-out acc_a %s), skipped", name, _fmt(res.get("acc_a")))
        else:
            todo.append(name)
            if d.exists():
                log.info("draft %s: %s; retraining, the old draft stays until the new one is complete", name,
                         "forced" if force else "configuration changed" if old else "no training stamp")
    return out, todo


def _warm_starts(prof: Profile, todo: list[str]) -> dict[str, Path | None]:
    """Each draft's trained start under ``train.init_from`` (None: fresh); a missing one is a ConfigError."""
    starts = {n: RunLayout(Path(prof.train.init_from)).draft(n) if prof.train.init_from else None for n in todo}
    if missing := [str(d) for d in starts.values() if d is not None and not has_weights(d)]:
        raise ConfigError(f"train.init_from={prof.train.init_from}: no trained draft at {', '.join(missing)}")
    return starts


class _Vocabularies:
    """Reduced draft vocabularies: the most frequent tokens of the training split (EOS forced in), built once per
    size and shared by every draft of that size; the frequencies are counted once, when first needed."""

    def __init__(self, train_ds: Any, target: Any) -> None:
        self.train_ds, self.target = train_ds, target
        self.freqs: Any = None
        self.built: dict[int, tuple[Any, float]] = {}

    def for_draft(self, cfg: Any, start: Path | None) -> tuple[Any, float | None]:
        """(d2t, its coverage of the training split) for a draft; (None, None) with the full vocabulary."""
        if cfg.draft_vocab_size is None:
            return None, None
        size = int(cfg.draft_vocab_size)
        if self.freqs is None:
            self.freqs = token_frequencies(self.train_ds, self.target.model.config.vocab_size)
        if start is not None:  # a warm start keeps its draft's vocabulary, its coverage of this data
            d2t = saved_vocab(start)
            return d2t, None if d2t is None else vocab_coverage(self.freqs, d2t)
        if size not in self.built:
            voc = build_draft_vocab(self.freqs, min(size, self.freqs.numel()), always=self.target.eos_token_ids)
            self.built[size] = (voc, vocab_coverage(self.freqs, voc))
        return self.built[size]


def _prepare_work(prof: Profile, layout: RunLayout, name: str, main_process: bool) -> Path:
    """``drafts/.<name>.training``, which replaces ``drafts/<name>`` once complete: kept (the training resumes from
    its newest checkpoint) when stamped with this configuration, else started afresh."""
    work = layout.draft_training(name)
    stamp = _train_stamp(prof, name, layout.root)
    if main_process:
        if read_json(work / TRAIN_STAMP) != stamp:  # another configuration's (or none): start afresh
            shutil.rmtree(work, ignore_errors=True)
        elif checkpoints := list_checkpoints(work):
            step, ckpt = checkpoints[-1]
            log.warning("draft %s: resuming an interrupted training from %s (step %d)", name, ckpt, step)
        work.mkdir(parents=True, exist_ok=True)
        write_json(work / TRAIN_STAMP, stamp)
    return work


def _install(work: Path, layout: RunLayout, name: str, coverage: float | None, main_process: bool) -> None:
    """A finished training in place of ``drafts/<name>`` (atomically), with its vocabulary's coverage recorded."""
    if not main_process:
        return
    if coverage is not None:
        extra = read_json(work / RESULTS) or {}
        extra["vocab_coverage"] = coverage
        write_json(work / RESULTS, extra)
    replace_dir_atomically(work, layout.draft_dir(name))


def _check_cache_settings(prof: Profile, layout: RunLayout, manifest: dict[str, Any]) -> None:
    """A :class:`CacheError` when the feature cache was made with other data settings than ``prof`` asks for
    (``--set data.max_length=80`` on a cache made at 96): training would silently use the cache as it is."""
    made = manifest.get("settings") or {}
    wanted = {("max_length", "data.max_length"): prof.data.max_length,
              ("shard_size", "data.shard_size"): prof.data.shard_size,
              ("template", "target.template"): prof.target.template, ("target", "target.model"): prof.target.model}
    clash = {key: (made[key], v) for (key, _), v in wanted.items() if key in made and made[key] != v}
    if clash:
        shown = dict(wanted.keys())  # manifest key -> the profile's key
        detail = ", ".join(f"{shown[k]}: cached {a!r}, now {b!r}" for k, (a, b) in clash.items())
        raise CacheError(f"the feature cache in {layout.features} was made with other settings ({detail}); training "
                         "would use it as it is: cache with these settings first (`python -m jakiro_lib cache` "
                         "with the same --set, into another --run-dir) or train with the cache's settings")


def _fmt(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def load_training_results(ctx: StudyContext) -> dict[str, dict[str, Any]]:
    """``{name: results.json}`` of the profile's trained drafts (missing ones left out)."""
    prof, layout = ctx.profile, ctx.layout
    out = {}
    for name in prof.drafts:
        res = read_json(layout.draft_results(name))
        if res is not None:
            out[name] = res
    return out


ACC_DEPTHS = 4  # acc_depth columns of the training table: d = 1..4 drafted steps


def _joined(values: list[float | None] | None) -> str | None:
    return " / ".join("–" if x is None else f"{x:.2f}" for x in values) if values else None


def training_table(results: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per draft: architecture (parameters, MLP width), training options (per-expert loss, unrolled
    steps), budget, held-out accuracy per branch, per drafted depth (``acc_depth_1`` .. ``acc_depth_4``:
    branch A after d steps on the draft's own features, None past the depths evaluated) and per expert
    (``acc_experts``: each expert's own top-1, " / "-joined), router load, time."""
    rows = []
    for name, r in results.items():
        cfg = r.get("draft_config", {})
        data = r.get("data", {})
        load = r.get("router_load") or []
        depth = r.get("acc_depth") or []
        rows.append({
            "draft": name, "mlp": cfg.get("mlp"), "experts": cfg.get("num_experts"),
            "top_k_experts": cfg.get("top_k_experts"), "branch_b": cfg.get("branch_b"),
            "contrastive": cfg.get("contrastive"), "n_params": r.get("n_params"),
            "intermediate_size": r.get("intermediate_size", cfg.get("intermediate_size")),
            "expert_loss": cfg.get("expert_loss"), "unroll_steps": r.get("unroll_steps"),
            "draft_vocab_size": cfg.get("draft_vocab_size"), "vocab_coverage": r.get("vocab_coverage"),
            "train_conversations": data.get("train_conversations"), "train_tokens": data.get("train_tokens"),
            "heldout_conversations": data.get("heldout_conversations"), "epochs": r.get("epochs_completed"),
            "steps": r.get("steps"), "imported_from": (r.get("imported") or {}).get("source"),
            "acc_a": r.get("acc_a"), "acc_b": r.get("acc_b"),
            **{f"acc_depth_{d}": depth[d - 1] if d <= len(depth) else None for d in range(1, ACC_DEPTHS + 1)},
            "acc_experts": _joined(r.get("acc_experts")), "heldout_loss": r.get("heldout_loss"),
            "router_load": _joined(load),
            "router_load_max": max(load) if load else None,
            "wall_time_s": r.get("wall_time_s"), "train_tokens_per_s": r.get("train_tokens_per_s"),
        })
    return pd.DataFrame(rows)


def router_load_table(results: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """Long table (draft, expert, load) of the held-out router load of the MoE drafts."""
    rows = [{"draft": name, "expert": e, "load": x}
            for name, r in results.items() if (r.get("draft_config", {}).get("num_experts") or 1) > 1
            for e, x in enumerate(r.get("router_load") or [])]
    return pd.DataFrame(rows, columns=["draft", "expert", "load"])


def drafts_table(ctx: StudyContext) -> pd.DataFrame:
    """The profile's drafts and what sets each apart, read from ``profile.drafts`` (notebook 01 shows it)."""
    prof = ctx.profile
    rows = []
    for name, d in prof.drafts.items():
        block = "dense SwiGLU MLP (EAGLE-2)" if d.mlp == "dense" else f"MoE, {d.num_experts} experts, top-{d.top_k_experts}"
        branch_b = "-" if not d.branch_b else ("contrastive (top - second expert)" if d.contrastive
                                               else "weighted sum")
        rows.append({"draft": name, "MLP block": block, "width": d.intermediate_size or "hidden",
                     "branch B (CEPD)": branch_b, "expert loss": d.expert_loss,
                     "unroll steps": d.unroll_steps or prof.train.unroll_steps,
                     "draft vocabulary": d.draft_vocab_size or "full"})
    return pd.DataFrame(rows)


def training_history(ctx: StudyContext) -> pd.DataFrame:
    """Long table (draft, step, series, value): training losses/accuracies per logged step, held-out
    accuracy per epoch."""
    prof, layout = ctx.profile, ctx.layout
    rows = []
    for name in prof.drafts:
        h = read_json(layout.draft_history(name))
        if not h:
            continue
        for rec in h.get("steps", []):
            for key, series in (("loss", "train loss"), ("loss_a", "train loss A (t+1)"),
                                ("loss_b", "train loss B (t+2)"), ("acc_a", "train acc A")):
                if rec.get(key) is not None:
                    rows.append({"draft": name, "step": rec["step"], "series": series, "value": rec[key]})
        for rec in h.get("epochs", []):
            held = rec.get("heldout") or {}
            for key, series in (("acc_a", "held-out acc A"), ("acc_b", "held-out acc B")):
                if held.get(key) is not None:
                    rows.append({"draft": name, "step": rec["step"], "series": series, "value": held[key]})
    return pd.DataFrame(rows, columns=["draft", "step", "series", "value"])


def write_training_tables(report_dir: str | Path, results: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """``training.csv`` / ``training.json`` in the report directory; returns the table."""
    report_dir = Path(report_dir)
    table = training_table(results)
    write_table(report_dir / "training.csv", table)
    return table
