"""Glue between the library and the study notebooks (and the ``cache``/``train``/``bench`` CLI commands).

The notebooks stay thin: each calls one function per step and displays what it returns.

* :func:`setup` resolves a profile (name + dotted overrides) and the two directories every stage shares:
  ``run_dir`` for heavy artifacts (``$JAKIRO_RUNS/<profile>``, default ``runs/<profile>``) and
  ``report_dir`` for what is published (``reports/<profile>``).
* :func:`prepare_features` (notebook 00): ShareGPT conversations -> sharded target-feature cache
  ``run_dir/features`` (or nothing in online mode).
* :func:`train_all` (notebook 01): every draft of ``profile.drafts`` with the same budget ->
  ``run_dir/drafts/<name>/`` (``draft/``, ``results.json``, ``history.json``).
* :func:`run_study` (notebook 02): ``study="main"`` / ``"ablations"`` -> ``run_dir/bench/<study>/records.jsonl``
  and a summary table.
* Tables and the published-numbers comparison (notebook 03) are plain DataFrames.

Reruns are cheap: the feature cache resumes and verifies itself, a draft is retrained only when its
configuration (draft, training, target, data, features) changed or ``force`` is set, and benchmark
records are reused while the methods, drafts and settings are unchanged (else they are moved aside to
``records.stale.jsonl`` and rerun).
"""
from __future__ import annotations

import dataclasses
import functools
import html
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import pandas as pd

from .config import Profile, get_profile, override
from .utils import (REPO_ROOT, file_sha256, replace_dir_atomically, restore_replaced_dir, run_metadata,
                    write_json)

if TYPE_CHECKING:
    from .bench import MethodSpec

log = logging.getLogger(__name__)

STUDIES = ("main", "ablations")
PAPER_CONVERSATIONS = 68_000  # ShareGPT conversations the paper trains on (DESIGN.md 4)
PAPER_TOKENS_PER_CONVERSATION = 1_330  # what 740 GB at 8 KB/token for 68k conversations implies


# --------------------------------------------------------------------------------------------------
# Profiles and directories
# --------------------------------------------------------------------------------------------------


def runs_root() -> Path:
    """Root of heavy run outputs: ``$JAKIRO_RUNS`` or ``<repo>/runs`` (gitignored)."""
    return Path(os.environ.get("JAKIRO_RUNS") or REPO_ROOT / "runs").expanduser().resolve()


def reports_root() -> Path:
    """Root of the reports: ``$JAKIRO_REPORTS`` or ``<repo>/reports``."""
    return Path(os.environ.get("JAKIRO_REPORTS") or REPO_ROOT / "reports").expanduser().resolve()


def default_run_dir(profile_name: str) -> Path:
    return runs_root() / profile_name


def default_report_dir(profile_name: str) -> Path:
    return reports_root() / profile_name


def resolve_profile(profile: str | Profile, overrides: dict[str, Any] | None = None) -> Profile:
    """A :class:`Profile` from a name (or a Profile) plus dotted-key overrides (``{"bench.limit": 2}``)."""
    overrides = dict(overrides or {})
    if isinstance(profile, Profile):
        return override(profile, **overrides) if overrides else profile
    return get_profile(profile, **overrides)


def _run_dir(profile: Profile, run_dir: str | Path | None) -> Path:
    return Path(run_dir).expanduser().resolve() if run_dir is not None else default_run_dir(profile.name)


@dataclass
class StudyContext:
    """What a notebook works with: the resolved profile and its directories."""

    profile: Profile
    overrides: dict[str, Any] = field(default_factory=dict)
    run_dir: Path = Path()
    report_dir: Path = Path()

    @property
    def features_dir(self) -> Path:
        return self.run_dir / "features"

    @property
    def drafts_dir(self) -> Path:
        return self.run_dir / "drafts"

    def bench_dir(self, study: str) -> Path:
        return self.run_dir / "bench" / study

    def describe(self) -> pd.DataFrame:
        """The profile as a two-column table (section.key, value), for display."""
        rows = []
        for section, values in self.profile.to_dict().items():
            if isinstance(values, dict) and section != "drafts":
                rows += [{"setting": f"{section}.{k}", "value": _short(v)} for k, v in values.items()]
            elif section == "drafts":
                for name, cfg in values.items():
                    rows.append({"setting": f"drafts.{name}", "value": _short(
                        {k: v for k, v in cfg.items() if v is not None})})
            else:
                rows.append({"setting": section, "value": _short(values)})
        return pd.DataFrame(rows)


def _short(value: Any) -> str:
    return json.dumps(value, default=str) if not isinstance(value, str) else value


def setup(profile: str | Profile = "default", overrides: dict[str, Any] | None = None, *,
          run_dir: str | Path | None = None, report_dir: str | Path | None = None,
          write_config: bool = True) -> StudyContext:
    """Resolve the notebook parameters; create the directories; write ``report_dir/run_config.json``.

    ``JAKIRO_THREADS`` (env) sets torch's intra-op thread count (tiny targets run faster on one).
    """
    prof = resolve_profile(profile, overrides)
    threads = os.environ.get("JAKIRO_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    ctx = StudyContext(
        profile=prof,
        overrides=dict(overrides or {}),
        run_dir=_run_dir(prof, run_dir),
        report_dir=(Path(report_dir).expanduser().resolve() if report_dir is not None
                    else default_report_dir(prof.name)),
    )
    ctx.run_dir.mkdir(parents=True, exist_ok=True)
    ctx.report_dir.mkdir(parents=True, exist_ok=True)
    if write_config:
        write_json(ctx.report_dir / "run_config.json", {
            "profile": prof.name, "overrides": ctx.overrides, "config": prof.to_dict(),
            "run_dir": str(ctx.run_dir), "report_dir": str(ctx.report_dir),
            "run_metadata": run_metadata(prof.target.device),
        })
    return ctx


_TARGETS: dict[str, Any] = {}


def get_target(profile: Profile | StudyContext) -> Any:
    """The profile's target, loaded once per process (notebooks call several steps with it)."""
    from .target import load_target

    prof = profile.profile if isinstance(profile, StudyContext) else profile
    key = json.dumps(dataclasses.asdict(prof.target), sort_keys=True)
    if key not in _TARGETS:
        _TARGETS.clear()  # one target at a time: they can be large
        t0 = time.perf_counter()
        _TARGETS[key] = load_target(prof.target)
        log.info("loaded target %s in %.1f s", prof.target.model, time.perf_counter() - t0)
    return _TARGETS[key]


def _profile_of(profile: str | Profile | StudyContext) -> Profile:
    if isinstance(profile, StudyContext):
        return profile.profile
    return resolve_profile(profile)


def _dirs(profile: str | Profile | StudyContext, run_dir: str | Path | None) -> tuple[Profile, Path]:
    if isinstance(profile, StudyContext):
        return profile.profile, (Path(run_dir).resolve() if run_dir is not None else profile.run_dir)
    prof = _profile_of(profile)
    return prof, _run_dir(prof, run_dir)


# --------------------------------------------------------------------------------------------------
# Stage 00: data and features
# --------------------------------------------------------------------------------------------------


DISTILL_FILE = "distill/conversations.jsonl"


def load_training_conversations(profile: Profile, run_dir: Path | None = None, target: Any = None, *,
                                progress: bool = False) -> list[Any]:
    """The profile's training conversations; with ``data.self_distill`` their first user turns answered
    by the target itself (generated once into ``run_dir/distill/``, resumable; see
    :mod:`jakiro_lib.distill`)."""
    from .data import load_conversations

    d = profile.data
    convs = load_conversations(d.source, path=d.path, limit=d.num_conversations)
    if not d.self_distill:
        return convs
    from .distill import regenerate

    rdir = run_dir if run_dir is not None else default_run_dir(profile.name)
    return regenerate(target or get_target(profile), convs, rdir / DISTILL_FILE,
                      max_prompt_tokens=d.max_length // 2, max_new_tokens=d.distill_max_new_tokens,
                      batch_size=d.distill_batch_size, template=profile.target.template, progress=progress)


def prepare_features(profile: str | Profile | StudyContext, run_dir: str | Path | None = None, *,
                     target: Any = None, force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Cache target features for ``profile.data.num_conversations`` conversations in ``run_dir/features``.

    Resumable and self-verifying (see :func:`jakiro_lib.features.cache_features`). A cache made with
    other settings raises :class:`~jakiro_lib.features.CacheError` unless ``force`` (then it is rebuilt).
    In online mode (``data.online``) nothing is written; the estimate says what caching would cost.
    ``data.cache_dtype`` runs the target in another dtype for this step only (bf16 on an AMX CPU).
    Returns a summary dict (also written to ``run_dir/features_summary.json``).
    """
    from .features import CacheError, cache_features, estimate_cache, human_bytes, verify_cache

    prof, rdir = _dirs(profile, run_dir)
    d = prof.data
    cache_target = dataclasses.replace(prof.target, dtype=d.cache_dtype or prof.target.dtype)
    if target is None or target.config != cache_target:
        target = get_target(dataclasses.replace(prof, target=cache_target))
    t0 = time.perf_counter()
    convs = load_training_conversations(prof, rdir, target, progress=progress)
    t_load = time.perf_counter() - t0
    estimate = estimate_cache(target, convs, max_length=d.max_length, template=prof.target.template,
                              feature_dtype=d.feature_dtype)
    summary: dict[str, Any] = {
        "mode": "online" if d.online else "cache", "source": d.source, "path": d.path,
        "self_distill": d.self_distill,
        "conversations_loaded": len(convs), "estimate": estimate, "load_seconds": round(t_load, 2),
        "hidden_size": target.model.config.hidden_size, "feature_dtype": d.feature_dtype,
        "max_length": d.max_length,
    }
    cache_dir = rdir / "features"
    if not d.online:
        t1 = time.perf_counter()
        kwargs = dict(max_length=d.max_length, shard_size=d.shard_size, feature_dtype=d.feature_dtype,
                      template=prof.target.template, progress=progress)
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
    write_json(rdir / "features_summary.json", summary)
    return summary


def disk_estimates(summary: dict[str, Any], profile: Profile) -> pd.DataFrame:
    """Feature-cache disk cost: this run, this profile at full ShareGPT size, and the paper's setting."""
    from .features import estimate_disk, human_bytes

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
        {"setting": "paper: Vicuna-7B, 68k ShareGPT conversations (~1330 tokens each, DESIGN.md 4)",
         "conversations": PAPER_CONVERSATIONS, "tokens": PAPER_CONVERSATIONS * PAPER_TOKENS_PER_CONVERSATION,
         "hidden_size": 4096, "dtype": "bfloat16",
         "bytes": estimate_disk(PAPER_CONVERSATIONS * PAPER_TOKENS_PER_CONVERSATION, 4096, "bfloat16")},
    ]
    df = pd.DataFrame(rows)
    df["size"] = df["bytes"].map(human_bytes)
    return df


def manifest_table(profile: str | Profile | StudyContext, run_dir: str | Path | None = None) -> pd.DataFrame:
    """One row per cache shard (file, conversations, tokens, loss tokens, size)."""
    from .features import MANIFEST

    _, rdir = _dirs(profile, run_dir)
    path = rdir / "features" / MANIFEST
    if not path.is_file():
        return pd.DataFrame(columns=["file", "conversations", "tokens", "loss_tokens", "bytes"])
    m = json.loads(path.read_text())
    cols = ["file", "first_conversation", "conversations", "skipped_empty_mask", "tokens", "loss_tokens", "bytes"]
    return pd.DataFrame([{k: s.get(k) for k in cols} for s in m["shards"]])


def loss_mask_html(tokenizer: Any, messages: Sequence[dict[str, str]], *, template: str = "auto",
                   max_length: int | None = None, max_chars: int = 4000) -> str:
    """HTML of one formatted conversation: assistant (loss-mask = 1) tokens bold green, the rest grey.

    Runs of tokens with the same mask are decoded together (so multi-byte characters stay whole).
    """
    from .chat import format_conversation

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


def sample_conversation_html(profile: str | Profile | StudyContext, index: int | None = None, *,
                             target: Any = None, max_chars: int = 4000) -> str:
    """:func:`loss_mask_html` of training conversation ``index`` of the profile (default: the first one
    that keeps at least one assistant token within ``max_length``)."""
    from .chat import format_conversation

    prof, rdir = _dirs(profile, None)
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


def method_setting(spec: Any, key: str) -> Any:
    """One setting of a method as the tables show it (None where it does not apply)."""
    if spec.kind != "spec":
        return None
    if spec.draft is None:  # the lookup chain alone: no draft, no drafted tree
        return {"draft": "none", "lookup_tokens": spec.tree.lookup_tokens}.get(key)
    if key == "draft":
        return Path(spec.draft).parent.name
    return getattr(spec.tree, key)


def _profile_methods(prof: Profile, drafts_dir: Path, study: str) -> dict[str, MethodSpec]:
    """The methods of ``study`` under the profile's switches (tuned budgets, the compiled HF baseline, our
    loops compiled)."""
    from .bench import study_methods

    return study_methods(prof.tree, drafts_dir, study=study, tuned=prof.bench.tuned,
                         compiled=prof.bench.compiled_baseline, compiled_loops=prof.bench.compiled_loops)


def methods_table(profile: str | Profile | StudyContext, study: str = "main",
                  run_dir: str | Path | None = None) -> pd.DataFrame:
    """The methods a study compares and their settings (draft, tree, decoupled, CEPD ar_steps)."""
    prof, rdir = _dirs(profile, run_dir)
    rows = []
    for name, m in _profile_methods(prof, rdir / "drafts", study).items():
        row: dict[str, Any] = {"method": name, "kind": m.kind}
        if m.kind == "spec":
            row.update({k: method_setting(m, k) for k in ("draft", "depth", "top_k", "total_tokens", "decoupled",
                                                          "ar_steps", "scoring", "lookup_tokens")})
        rows.append(row)
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------------------------------
# Stage 01: training
# --------------------------------------------------------------------------------------------------

TRAIN_STAMP = "train_stamp.json"


def training_datasets(profile: Profile, run_dir: Path, target: Any) -> tuple[Any, Any]:
    """(train, held-out) datasets: from the feature cache, or online from the conversations."""
    from .features import FeatureDataset, OnlineFeatureDataset

    d = profile.data
    if d.online:
        convs = load_training_conversations(profile, run_dir, target)
        kw = dict(max_length=d.max_length, template=profile.target.template, heldout_fraction=d.heldout_fraction)
        return (OnlineFeatureDataset(target, convs, split="train", **kw),
                OnlineFeatureDataset(target, convs, split="heldout", **kw))
    cache = run_dir / "features"
    return (FeatureDataset(cache, "train", d.heldout_fraction),
            FeatureDataset(cache, "heldout", d.heldout_fraction))


def _features_fingerprint(profile: Profile, run_dir: Path) -> Any:
    if profile.data.online:
        return {"online": dataclasses.asdict(profile.data)}
    from .features import MANIFEST

    path = run_dir / "features" / MANIFEST
    m = json.loads(path.read_text()) if path.is_file() else {}
    return {"settings": m.get("settings"), "shards": [s.get("sha256") for s in m.get("shards", [])],
            "heldout_fraction": profile.data.heldout_fraction}


def _train_stamp(profile: Profile, name: str, run_dir: Path) -> dict[str, Any]:
    return json.loads(json.dumps({
        "draft": dataclasses.asdict(profile.drafts[name]), "train": dataclasses.asdict(profile.train),
        "target": dataclasses.asdict(profile.target), "features": _features_fingerprint(profile, run_dir),
    }, default=str))


def _log_every(n_train: int, train_cfg: Any) -> int:
    steps = math.ceil(n_train / max(train_cfg.batch_size, 1)) * max(train_cfg.epochs, 1)
    if train_cfg.max_steps is not None:
        steps = min(steps, train_cfg.max_steps)
    return max(1, steps // 200)


def train_all(profile: str | Profile | StudyContext, run_dir: str | Path | None = None, *,
              only: Sequence[str] | None = None, force: bool = False, target: Any = None,
              progress: bool = True) -> dict[str, dict[str, Any]]:
    """Train every draft of ``profile.drafts`` (or ``only`` those) with the same data and budget.

    Output per draft: ``run_dir/drafts/<name>/`` with ``draft/``, ``results.json``, ``history.json`` and
    ``train_stamp.json`` (the configuration it was trained with). A draft whose ``results.json`` exists
    and whose stamp matches is skipped unless ``force``; a changed configuration retrains it from
    scratch. With ``draft_vocab_size`` set, the reduced draft vocabulary (most frequent tokens of the
    training split, EOS forced in) is built once and shared by all drafts of that size.
    Nothing that exists is lost: the feature cache is verified before anything starts, each draft trains
    in ``drafts/.<name>.training/`` (an interrupted training resumes there from its newest checkpoint)
    and replaces ``drafts/<name>/`` atomically only once complete.
    Returns ``{name: results}`` (each results dict also gets ``skipped`` and ``vocab_coverage``).
    """
    from .features import MANIFEST, build_draft_vocab, token_frequencies, verify_cache, vocab_coverage
    from .train import RESULTS, list_checkpoints, train_draft

    prof, rdir = _dirs(profile, run_dir)
    names = list(prof.drafts) if not only else list(only)
    unknown = [n for n in names if n not in prof.drafts]
    if unknown:
        raise ValueError(f"unknown draft(s) {unknown}; the profile has {', '.join(prof.drafts)}")
    if not prof.data.online and (rdir / "features" / MANIFEST).is_file():
        verify_cache(rdir / "features", allow_incomplete=True)  # the stamps below read it: CacheError if corrupt
    drafts_dir = rdir / "drafts"
    todo: list[str] = []
    out: dict[str, dict[str, Any]] = {}
    main_process, wait = _process_state()  # under `accelerate launch`: one process manages the files
    for name in names:
        d = drafts_dir / name
        if main_process and restore_replaced_dir(d):
            log.warning("draft %s: put back the previous draft that an interrupted replacement left aside", name)
        res, old = _read_json(d / RESULTS), _read_json(d / TRAIN_STAMP)
        if res is not None and (d / "draft").is_dir() and old == _train_stamp(prof, name, rdir) and not force:
            res["skipped"] = True
            out[name] = res
            log.info("draft %s: already trained (held-out acc_a %s), skipped", name, _fmt(res.get("acc_a")))
        else:
            todo.append(name)
            if d.exists():
                log.info("draft %s: %s; retraining, the old draft stays until the new one is complete", name,
                         "forced" if force else "configuration changed" if old else "no training stamp")
    if not todo:
        return {n: out[n] for n in names}

    if not prof.data.online:
        verify_cache(rdir / "features", full=True)  # a CacheError now (sha256 too: seconds), not after hours
    target = target or get_target(prof)
    train_ds, held_ds = training_datasets(prof, rdir, target)
    log.info("training %s on %d conversations (%d held out)", ", ".join(todo), len(train_ds), len(held_ds))
    vocabs: dict[int, tuple[Any, float]] = {}
    freqs = None
    for name in todo:
        cfg = prof.drafts[name]
        d2t = None
        coverage = None
        if cfg.draft_vocab_size is not None:
            size = int(cfg.draft_vocab_size)
            if size not in vocabs:
                if freqs is None:
                    freqs = token_frequencies(train_ds, target.model.config.vocab_size)
                voc = build_draft_vocab(freqs, min(size, freqs.numel()), always=target.eos_token_ids)
                vocabs[size] = (voc, vocab_coverage(freqs, voc))
            d2t, coverage = vocabs[size]
        work = drafts_dir / f".{name}.training"  # replaces drafts/<name> once complete
        stamp = _train_stamp(prof, name, rdir)
        if main_process:
            if force or _read_json(work / TRAIN_STAMP) != stamp:
                shutil.rmtree(work, ignore_errors=True)
            elif list_checkpoints(work):
                step, ckpt = list_checkpoints(work)[-1]
                log.warning("draft %s: resuming an interrupted training from %s (step %d)", name, ckpt, step)
            work.mkdir(parents=True, exist_ok=True)
            write_json(work / TRAIN_STAMP, stamp)
        wait()
        t0 = time.perf_counter()
        res = train_draft(target, cfg, train_ds, held_ds, work, prof.train, d2t=d2t, progress=progress,
                          log_every=_log_every(len(train_ds), prof.train))
        res = dict(res)
        res["skipped"] = False
        res["vocab_coverage"] = coverage
        if main_process:
            if coverage is not None:
                extra = _read_json(work / RESULTS) or {}
                extra["vocab_coverage"] = coverage
                write_json(work / RESULTS, extra)
            replace_dir_atomically(work, drafts_dir / name)
        wait()
        out[name] = res
        log.info("draft %s: trained in %.1f s, held-out acc_a %s acc_b %s", name, time.perf_counter() - t0,
                 _fmt(res.get("acc_a")), _fmt(res.get("acc_b")))
    return {n: out[n] for n in names}


def _process_state() -> tuple[bool, Any]:
    """(is main process, barrier): trivial in one process, accelerate's state under ``accelerate launch``."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return True, lambda: None
    from accelerate import PartialState

    state = PartialState()
    return state.is_main_process, state.wait_for_everyone


def _fmt(x: Any) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def load_training_results(profile: str | Profile | StudyContext, run_dir: str | Path | None = None
                          ) -> dict[str, dict[str, Any]]:
    """``{name: results.json}`` of the profile's trained drafts (missing ones left out)."""
    prof, rdir = _dirs(profile, run_dir)
    out = {}
    for name in prof.drafts:
        res = _read_json(rdir / "drafts" / name / "results.json")
        if res is not None:
            out[name] = res
    return out


def training_table(results: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per draft: architecture, budget, held-out accuracy per branch, router load, time."""
    rows = []
    for name, r in results.items():
        cfg = r.get("draft_config", {})
        data = r.get("data", {})
        load = r.get("router_load") or []
        rows.append({
            "draft": name, "mlp": cfg.get("mlp"), "experts": cfg.get("num_experts"),
            "top_k_experts": cfg.get("top_k_experts"), "branch_b": cfg.get("branch_b"),
            "contrastive": cfg.get("contrastive"), "draft_vocab_size": cfg.get("draft_vocab_size"),
            "vocab_coverage": r.get("vocab_coverage"),
            "train_conversations": data.get("train_conversations"), "train_tokens": data.get("train_tokens"),
            "heldout_conversations": data.get("heldout_conversations"), "epochs": r.get("epochs_completed"),
            "steps": r.get("steps"), "acc_a": r.get("acc_a"), "acc_b": r.get("acc_b"),
            "heldout_loss": r.get("heldout_loss"),
            "router_load": " / ".join(f"{x:.2f}" for x in load) if load else None,
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


def training_history(profile: str | Profile | StudyContext, run_dir: str | Path | None = None) -> pd.DataFrame:
    """Long table (draft, step, series, value): training losses/accuracies per logged step, held-out
    accuracy per epoch."""
    prof, rdir = _dirs(profile, run_dir)
    rows = []
    for name in prof.drafts:
        h = _read_json(rdir / "drafts" / name / "history.json")
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


def write_table(csv_path: Path, df: pd.DataFrame) -> None:
    from .utils import atomic_path

    with atomic_path(csv_path) as tmp:
        df.to_csv(tmp, index=False)
    write_json(csv_path.with_suffix(".json"), json.loads(df.to_json(orient="records")))


# --------------------------------------------------------------------------------------------------
# Stage 02: benchmarks
# --------------------------------------------------------------------------------------------------

STUDY_STAMP = "study_stamp.json"


def study_questions(profile: Profile) -> tuple[list[Any], dict[str, str]]:
    """Questions of ``profile.bench.benchmarks`` (``limit`` each, after the first ``skip``); unavailable
    benchmarks (e.g. hub-only ones offline) are skipped and returned with the reason."""
    from .data import DataError, load_questions

    questions: list[Any] = []
    skipped: dict[str, str] = {}
    skip, limit = profile.bench.skip, profile.bench.limit
    for b in profile.bench.benchmarks:
        try:
            questions += load_questions(b, limit=None if limit is None else skip + limit)[skip:]
        except DataError as exc:
            log.warning("benchmark %s skipped: %s", b, exc)
            skipped[b] = str(exc)
    return questions, skipped


def study_temperatures(profile: Profile, study: str) -> tuple[float, ...]:
    """Main study: the profile's temperatures; ablations: greedy only."""
    return tuple(profile.bench.temperatures) if study == "main" else (0.0,)


def _draft_fingerprint(path: str | None) -> Any:
    """The draft weights' size and content digest: records and tuned budgets stay valid when drafts are
    copied (to a GPU machine, say), and not when they are retrained."""
    if path is None:
        return None
    w = Path(path) / "model.safetensors"
    if not w.is_file():
        return None
    st = w.stat()
    return [st.st_size, _file_digest(str(w), st.st_size, st.st_mtime_ns)]


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """The first 16 hex digits of a file's SHA-256, cached per size and mtime within a process."""
    return file_sha256(path)[:16]


TREE_BUDGETS = "tree_budgets.json"
TUNE_PROMPTS = 4  # MT-bench questions (from the end of the set) the tree budget is tuned on
TUNE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # up to the paper's 60-token trees (GPU)


def _tune_prompts(target: Any, n: int = TUNE_PROMPTS) -> list[Any]:
    """First turns of the LAST ``n`` MT-bench questions: small benchmark limits never include them."""
    from .bench import format_prompt_ids
    from .data import load_questions

    questions = load_questions("mt_bench")[-n:]
    return [format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}]) for q in questions]


def resolve_tree_budgets(profile: Profile, run_dir: Path, methods: dict[str, Any], target: Any, *,
                         force: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Methods with ``tree.total_tokens="auto"`` get the budget that maximises estimated tokens/s here.

    The target's T(n) is measured once per machine and target settings (dtype, fast paths) and cached
    with every choice in ``run_dir/bench/tree_budgets.json`` (one entry per machine, target settings and
    runner: eager, or compiled for methods with ``static_compile``; choices keyed by draft weights and tree
    settings), so reruns, also after a run with other target settings, do not retune. ``force`` remeasures
    and retunes this machine's entries.
    Returns (methods with numeric budgets, the measurements and choices).
    """
    from .costmodel import measure_target_costs, tune_total_tokens
    from .draft import DraftModel
    from .utils import device_name

    auto = [k for k, m in methods.items() if m.kind == "spec" and m.draft and m.tree.total_tokens == "auto"]
    if not auto:
        return methods, {}
    import torch

    path = run_dir / "bench" / TREE_BUDGETS
    machine = {"device": str(target.device), "device_name": device_name(target.device),
               "threads": torch.get_num_threads(), "target": dataclasses.asdict(profile.target)}
    saved = _read_json(path) or {}
    entries = saved.get("machines", [saved] if "machine" in saved else [])  # older files: one entry

    def machine_key(compiled: bool) -> dict[str, Any]:
        """This machine's key for the eager or the compiled target runner, as it reads back from JSON."""
        return json.loads(json.dumps({**machine, **({"compiled": True} if compiled else {})}, default=str))

    def entry(compiled: bool) -> dict[str, Any]:
        """This machine's entry for the eager or the compiled target runner, its T(n) measured."""
        key = machine_key(compiled)
        found = next((e for e in entries if e.get("machine") == key), None)
        if found is None:
            found = {"machine": key, "target_costs_s": {}, "choices": {}}
            entries.append(found)
        if not {str(n) for n in TUNE_SIZES} <= set(found["target_costs_s"]):
            t0 = time.perf_counter()
            costs = measure_target_costs(target.model, sizes=TUNE_SIZES, static_compile=compiled)
            found["target_costs_s"] = {str(n): t for n, t in costs.items()}
            log.info("tree budget: target T(n) measured in %.1f s%s", time.perf_counter() - t0,
                     " (compiled)" if compiled else "")
        return found

    if force:
        keys = [machine_key(False), machine_key(True)]
        entries = [e for e in entries if e.get("machine") not in keys]
    prompts = None
    choices: dict[str, Any] = {}
    costs_by_runner: dict[bool, dict[int, float]] = {}
    for name in auto:
        spec = methods[name]
        cache = entry(spec.static_compile)
        costs = costs_by_runner[spec.static_compile] = {int(n): t for n, t in cache["target_costs_s"].items()}
        key = json.dumps({"weights": _draft_fingerprint(spec.draft),
                          "tree": {k: v for k, v in dataclasses.asdict(spec.tree).items()
                                   if k != "total_tokens" and not k.startswith("lookup_")}},
                         sort_keys=True, default=str)
        if key not in cache["choices"]:
            prompts = prompts if prompts is not None else _tune_prompts(target)
            t0 = time.perf_counter()
            draft = DraftModel.load(spec.draft, target.model)
            tuned = tune_total_tokens(target, draft, spec.tree, prompts, candidates=[n for n in TUNE_SIZES if n >= 2],
                                      target_costs=costs)
            tuned["seconds"] = round(time.perf_counter() - t0, 1)
            cache["choices"][key] = tuned
            log.info("tree budget for %s: %d tokens (tuned in %.1f s)", name, tuned["best"], tuned["seconds"])
        choices[name] = cache["choices"][key]
    write_json(path, {"machines": entries})
    out = dict(methods)
    for name in auto:
        best = choices[name]["best"]
        m = methods[name]
        out[name] = dataclasses.replace(m, tree=dataclasses.replace(m.tree, total_tokens=best))
    info = {f"{'compiled_' if compiled else ''}target_costs_s": c for compiled, c in costs_by_runner.items()}
    return out, {**info, "choices": choices}


def tree_budget_table(run_dir: str | Path, study: str = "main") -> pd.DataFrame:
    """The tuning behind ``total_tokens="auto"``: per tuned method and candidate budget, expected tokens per
    cycle, verify time and estimated tokens/s (the chosen budget flagged)."""
    info = _read_json(Path(run_dir) / "bench" / study / "tree_budget.json") or {}
    rows = []
    for method, choice in info.get("choices", {}).items():
        for row in choice["table"]:
            rows.append({"method": method, "total_tokens": row["total_tokens"],
                         "expected_tokens_per_cycle": row["expected_tokens_per_cycle"],
                         "verify_ms": 1000 * row["verify_s"], "draft_ms": 1000 * row["draft_s"],
                         "tokens_per_s": row["tokens_per_s"], "chosen": row["total_tokens"] == choice["best"]})
    return pd.DataFrame(rows, columns=["method", "total_tokens", "expected_tokens_per_cycle", "verify_ms",
                                       "draft_ms", "tokens_per_s", "chosen"])


def run_study(profile: str | Profile | StudyContext, run_dir: str | Path | None = None, study: str = "main", *,
              target: Any = None, force: bool = False, progress: bool = True, only: Sequence[str] | None = None,
              out_dir: str | Path | None = None) -> pd.DataFrame:
    """Benchmark the methods of ``study`` (see :func:`jakiro_lib.bench.study_methods`) on the profile's
    benchmarks; records go to ``out_dir`` (default ``run_dir/bench/<study>``) as ``records.jsonl``.
    ``only``: a subset of the study's method names. Returns the summary table.

    Records are reused (the benchmark resumes) while the methods, drafts and settings are unchanged;
    otherwise, or with ``force``, the old file is moved to ``records.stale.jsonl`` first.
    """
    from .bench import run_benchmark

    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}: use {' or '.join(STUDIES)}")
    prof, rdir = _dirs(profile, run_dir)
    drafts_dir = rdir / "drafts"
    methods = _profile_methods(prof, drafts_dir, study)
    if only:
        unknown = sorted(set(only) - set(methods))
        if unknown:
            raise ValueError(f"unknown method(s) {unknown} for study {study!r}; choose from {', '.join(methods)}")
        methods = {k: v for k, v in methods.items() if k in only}
    missing = sorted({Path(m.draft).parent.name for m in methods.values()
                      if m.draft and not (Path(m.draft) / "model.safetensors").is_file()})
    if missing:
        raise FileNotFoundError(f"study {study!r} needs trained drafts {missing} in {drafts_dir}: run "
                                "notebook 01 (or `python -m jakiro_lib train`) first")
    questions, skipped = study_questions(prof)
    if not questions:
        raise RuntimeError(f"no benchmark questions could be loaded for {prof.bench.benchmarks}: {skipped}")
    temps = study_temperatures(prof, study)
    out_dir = Path(out_dir).expanduser().resolve() if out_dir is not None else rdir / "bench" / study
    target = target or get_target(prof)
    methods, budgets = resolve_tree_budgets(prof, rdir, methods, target, force=force)
    out_dir.mkdir(parents=True, exist_ok=True)
    if budgets:
        write_json(out_dir / "tree_budget.json", budgets)
    stamp = json.loads(json.dumps({
        "study": study, "methods": {k: _portable(v) for k, v in methods.items()},
        "drafts": {k: _draft_fingerprint(v.draft) for k, v in methods.items()},
        "bench": dataclasses.asdict(prof.bench), "target": dataclasses.asdict(prof.target),
        "temperatures": temps, "questions": [[q.benchmark, str(q.question_id)] for q in questions],
    }, default=str))
    records_path = out_dir / "records.jsonl"
    old = _read_json(out_dir / STUDY_STAMP)
    if records_path.exists() and (force or old != stamp):
        log.info("study %s: %s; old records moved to records.stale.jsonl", study,
                 "forced" if force else "settings or drafts changed")
        os.replace(records_path, out_dir / "records.stale.jsonl")
    write_json(out_dir / STUDY_STAMP, stamp)
    b = prof.bench
    t0 = time.perf_counter()
    run_benchmark(target, methods, questions, temperatures=temps, max_new_tokens=b.max_new_tokens,
                  repeats=b.repeats, warmup=b.warmup, seed=b.seed, out_dir=out_dir, progress=progress)
    log.info("study %s: %d methods x %d questions x %d temperatures in %.1f s", study, len(methods),
             len(questions), len(temps), time.perf_counter() - t0)
    from .bench import load_records

    table = study_table(load_records(records_path), methods)
    table.attrs["skipped_benchmarks"] = skipped
    write_json(out_dir / "skipped_benchmarks.json", skipped)
    return table


def _portable(spec: Any) -> dict[str, Any]:
    """A method's settings with its draft named, not located: the weights' digest (in the stamp too) says
    which draft it is, so a run directory moved or copied elsewhere keeps its records."""
    d = dataclasses.asdict(spec)
    if spec.draft:
        d["draft"] = Path(spec.draft).parent.name
    return d


def load_study_records(run_dir: str | Path, study: str) -> list[dict[str, Any]]:
    from .bench import load_records

    path = Path(run_dir) / "bench" / study / "records.jsonl"
    return load_records(path) if path.is_file() else []


def study_table(records: list[dict[str, Any]], methods: dict[str, Any] | None = None) -> pd.DataFrame:
    """:func:`jakiro_lib.bench.summarize` as a DataFrame in the study's method order, with the method
    settings (draft, decoupled, ar_steps, scoring) as columns."""
    from .bench import summarize

    if methods is not None:
        records = [r for r in records if r["method"] in methods]
    df = pd.DataFrame(summarize(records))
    if df.empty:
        return df
    order = list(methods) if methods is not None else list(dict.fromkeys(r["method"] for r in records))
    df["_o"] = df["method"].map({m: i for i, m in enumerate(order)})
    df = df.sort_values(["temperature", "benchmark", "_o"]).drop(columns="_o").reset_index(drop=True)
    if methods is not None:
        for key in ("draft", "total_tokens", "decoupled", "ar_steps", "scoring", "lookup_tokens"):
            df.insert(df.columns.get_loc("benchmark"), key, [method_setting(methods[m], key) for m in df["method"]])
    return df


def records_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    """Per-record table without the output ids (accepted lengths as a JSON list)."""
    rows = []
    for r in records:
        row = {k: v for k, v in r.items() if k != "output_ids"}
        row["accepted"] = json.dumps(r.get("accepted", []))
        rows.append(row)
    return pd.DataFrame(rows)


def write_study_tables(report_dir: str | Path, study: str, table: pd.DataFrame,
                       records: list[dict[str, Any]] | None = None) -> Path:
    """``main_results.csv`` / ``ablations.csv`` (+ JSON) and ``<study>_records.csv`` in the report dir."""
    report_dir = Path(report_dir)
    name = "main_results" if study == "main" else "ablations"
    path = report_dir / f"{name}.csv"
    write_table(path, table)
    if records is not None:
        from .utils import atomic_path

        with atomic_path(report_dir / f"{study}_records.csv") as tmp:
            records_frame(records).to_csv(tmp, index=False)
    return path


def _interval(lo: float, hi: float) -> str:
    return "–" if lo is None or hi is None or math.isnan(lo) or math.isnan(hi) else f"[{lo:.2f}, {hi:.2f}]"


def display_table(table: pd.DataFrame) -> pd.DataFrame:
    """Compact view: tau and speedup as ``mean ± std`` (over repeats) strings, the speedup's bootstrap
    interval over prompts, the per-cycle breakdown, and (T=0) how many prompts gave vanilla's output."""
    if table.empty:
        return table

    def pm(m: float, s: float, digits: int = 2) -> str:
        if m is None or (isinstance(m, float) and math.isnan(m)):
            return "–"
        return f"{m:.{digits}f} ± {0.0 if s is None or math.isnan(s) else s:.{digits}f}"

    out = pd.DataFrame({
        "method": table["method"], "benchmark": table["benchmark"], "T": table["temperature"],
        "tokens/s": [pm(m, s, 1) for m, s in zip(table["tokens_per_s"], table["tokens_per_s_std"])],
        "speedup": [pm(m, s) for m, s in zip(table["speedup"], table["speedup_std"])],
        "speedup 95% CI": [_interval(lo, hi) for lo, hi in zip(table["speedup_ci_low"], table["speedup_ci_high"])],
        "tau": table["tau"].round(2), "tau (cycles-1)": table["tau_ref"].round(2),
        "draft fwd/cycle": table["draft_forwards_per_cycle"].round(2),
        "draft time %": (100 * table["draft_time_frac"]).round(1),
        "questions": table["questions"],
        "greedy = vanilla": [_fraction(a, b) for a, b in zip(table.get("greedy_same", [None] * len(table)),
                                                            table.get("greedy_compared", [None] * len(table)))],
    })
    return out


def _fraction(same: Any, compared: Any) -> str:
    if same is None or compared is None or any(isinstance(v, float) and math.isnan(v) for v in (same, compared)):
        return "–"
    return f"{int(same)}/{int(compared)}"


def headline_table(main: pd.DataFrame) -> pd.DataFrame:
    """Mean over benchmarks per (method, temperature): speedup, tau, tokens/s — the index's summary."""
    if main.empty:
        return main
    order = list(dict.fromkeys(main["method"].tolist()))
    g = (main.groupby(["temperature", "method"], sort=False)
         .agg(benchmarks=("benchmark", "nunique"), tokens_per_s=("tokens_per_s", "mean"),
              speedup=("speedup", "mean"), tau=("tau", "mean"), tau_ref=("tau_ref", "mean"))
         .reset_index())
    g["_o"] = g["method"].map({m: i for i, m in enumerate(order)})
    return g.sort_values(["temperature", "_o"]).drop(columns="_o").reset_index(drop=True)


# --------------------------------------------------------------------------------------------------
# Stage 03: published numbers
# --------------------------------------------------------------------------------------------------

# DESIGN.md section 8, verbatim numbers (speedup over vanilla, tau where published).
PUBLISHED: list[dict[str, Any]] = [
    {"source": "Jakiro authors' A40 logs (recomputed)", "method": "jakiro", "target": "Vicuna-7B",
     "benchmarks": "mean of MT-bench, HumanEval, GSM8K, Alpaca, CNN/DM, NQ", "temperature": 0.0, "hardware": "A40",
     "speedup": 2.85, "tau": None, "tau_cycles_minus_1": 4.69, "note": "tau in the reference's cycles-1 convention"},
    {"source": "Jakiro authors' A40 logs (recomputed)", "method": "eagle2", "target": "Vicuna-7B",
     "benchmarks": "mean of MT-bench, HumanEval, GSM8K, Alpaca, CNN/DM, NQ", "temperature": 0.0, "hardware": "A40",
     "speedup": 2.73, "tau": None, "tau_cycles_minus_1": 4.68, "note": "tau in the reference's cycles-1 convention"},
    {"source": "Jakiro authors' A40 logs (recomputed)", "method": "jakiro", "target": "Vicuna-7B",
     "benchmarks": "mean of MT-bench, HumanEval, GSM8K, Alpaca, CNN/DM, NQ", "temperature": 1.0, "hardware": "A40",
     "speedup": 2.44, "tau": None, "tau_cycles_minus_1": 4.20, "note": "tau in the reference's cycles-1 convention"},
    {"source": "Jakiro authors' A40 logs (recomputed)", "method": "eagle2", "target": "Vicuna-7B",
     "benchmarks": "mean of MT-bench, HumanEval, GSM8K, Alpaca, CNN/DM, NQ", "temperature": 1.0, "hardware": "A40",
     "speedup": 2.36, "tau": None, "tau_cycles_minus_1": 4.20, "note": "tau in the reference's cycles-1 convention"},
    {"source": "Jakiro authors' A40 logs (recomputed)", "method": "jakiro", "target": "Vicuna-7B",
     "benchmarks": "MT-bench", "temperature": 0.0, "hardware": "A40", "speedup": 3.02, "tau": None,
     "tau_cycles_minus_1": 4.98, "note": "tau in the reference's cycles-1 convention"},
    {"source": "Jakiro README figure", "method": "jakiro*", "target": "Vicuna-7B", "benchmarks": "MT-bench",
     "temperature": 1.0, "hardware": "A100", "speedup": 3.86, "tau": None, "tau_cycles_minus_1": 5.68,
     "note": "matches the non-lossless Jakiro* sampler logs: not a target"},
    {"source": "Jakiro README figure", "method": "eagle2", "target": "Vicuna-7B", "benchmarks": "MT-bench",
     "temperature": 1.0, "hardware": "A100", "speedup": 2.69, "tau": None, "tau_cycles_minus_1": 4.27,
     "note": "README figure"},
    {"source": "EAGLE-2 paper", "method": "eagle2", "target": "Vicuna-7B", "benchmarks": "MT-bench",
     "temperature": 0.0, "hardware": "as published", "speedup": 3.62, "tau": None, "tau_cycles_minus_1": None,
     "note": ""},
    {"source": "EAGLE-2 paper", "method": "eagle2", "target": "Vicuna-13B", "benchmarks": "MT-bench",
     "temperature": 0.0, "hardware": "as published", "speedup": 4.26, "tau": None, "tau_cycles_minus_1": None,
     "note": ""},
    {"source": "EAGLE-2 paper", "method": "eagle2", "target": "LLaMA3-8B", "benchmarks": "MT-bench",
     "temperature": 0.0, "hardware": "as published", "speedup": 3.46, "tau": None, "tau_cycles_minus_1": None,
     "note": ""},
    {"source": "Spec-Bench (third party)", "method": "eagle2", "target": "Vicuna-7B", "benchmarks": "MT-bench",
     "temperature": 0.0, "hardware": "A100", "speedup": 2.84, "tau": 4.34, "tau_cycles_minus_1": None,
     "note": "tau convention as published by Spec-Bench"},
    {"source": "Spec-Bench (third party)", "method": "eagle3", "target": "Vicuna-13B", "benchmarks": "MT-bench",
     "temperature": 0.0, "hardware": "A100", "speedup": 3.48, "tau": 5.71, "tau_cycles_minus_1": None,
     "note": "tau convention as published by Spec-Bench"},
]


def bench_environment(run_dir: str | Path, study: str = "main") -> dict[str, Any]:
    """The ``run_metadata`` recorded with the benchmark (machine, device, date, versions)."""
    cfg = _read_json(Path(run_dir) / "bench" / study / "bench_config.json") or {}
    return cfg.get("environment", {})


def comparison_table(main: pd.DataFrame, *, target_model: str, environment: dict[str, Any],
                     methods: Sequence[str] = ("eagle2", "jakiro", "jakiro_cepd", "eagle2_auto",
                                               "jakiro_auto", "eagle2_lookup", "jakiro_lookup")) -> pd.DataFrame:
    """Our speculative methods (mean over our benchmarks) next to the published numbers.

    Ours is labelled with the target, machine and date of the run; theirs with paper and hardware.
    Both tau conventions are given for ours (tokens / cycles, and the reference's tokens / (cycles-1)).
    """
    rows = []
    if not main.empty:
        head = headline_table(main)
        benches = ", ".join(sorted(main["benchmark"].unique()))
        n_q = int(main.groupby("benchmark")["questions"].max().sum()) if "questions" in main else None
        for r in head.itertuples(index=False):
            if r.method not in methods:
                continue
            rows.append({
                "source": "ours (this run)", "method": r.method, "target": target_model,
                "benchmarks": f"mean of {benches} ({n_q} prompts)" if r.benchmarks > 1 else f"{benches} ({n_q} prompts)",
                "temperature": r.temperature,
                "hardware": f"{environment.get('device_name', '?')} [{environment.get('device', '?')}]",
                "speedup": r.speedup, "tau": r.tau, "tau_cycles_minus_1": r.tau_ref,
                "note": f"measured {environment.get('date', '?')}, torch {environment.get('torch', '?')}",
            })
    rows += [dict(p) for p in PUBLISHED]
    return pd.DataFrame(rows)
