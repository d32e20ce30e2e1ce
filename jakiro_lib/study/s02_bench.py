"""Stage 02 (notebook 02, the ``bench`` CLI): the studies' methods benchmarked on the profile's questions.

:func:`run_study`: ``study="main"`` / ``"ablations"`` -> ``run_dir/bench/<study>/records.jsonl`` and a
summary table. Records are reused while the methods, drafts and settings are unchanged (else they are
moved aside to ``records.stale[.N].jsonl``, never overwriting, and rerun).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from ..measure.bench import run_benchmark
from ..measure.summary import load_records
from ..measure.budgets import draft_fingerprint, resolve_tree_budgets
from ..config import Profile
from ..data.conversations import DataError, Question, load_questions
from ..layout import (BENCH_CONFIG, RECORDS_FILE, SKIPPED_FILE, STALE_RECORDS_FILE, STUDY_STAMP, STUDY_TREE_BUDGET,
                      RunLayout, draft_name, has_weights)
from ..measure.methods import (SPEC, STUDIES, MethodSpec, method_name, parse_names, portable, resolve_engine,
                                study_methods)
from ..files import read_json, write_json
from .context import StudyContext, _dirs, get_target
from .tables import method_setting, study_table

log = logging.getLogger(__name__)

METHOD_COLUMNS = ("draft", "depth", "top_k", "total_tokens", "decoupled", "ar_steps", "scoring", "lookup_tokens")


def study_questions(profile: Profile) -> tuple[list[Any], dict[str, str]]:
    """Questions of ``profile.bench.benchmarks`` (``limit`` each, after the first ``skip``); unavailable
    benchmarks (e.g. hub-only ones offline) are skipped and returned with the reason."""
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


def profile_methods(prof: Profile, drafts_dir: Path, study: str) -> dict[str, MethodSpec]:
    """The methods of ``study`` under the profile's switches (tuned budgets, the compiled HF baseline, the
    drafted methods' engine on the profile's device, the static engine's twins eager and compiled); methods on a
    draft the profile does not train are left out, the authors' configurations run where the profile imports heads."""
    return study_methods(prof.tree, drafts_dir, study=study, tuned=prof.bench.tuned,
                         compiled=prof.bench.compiled_baseline, compiled_engine=prof.bench.compiled_engine,
                         static_engine=prof.bench.static_engine,
                         engine=resolve_engine(prof.bench.engine, prof.target.device),
                         drafts=prof.drafts, eagle2_draft=prof.bench.eagle2_draft,
                         jakiro_draft=prof.bench.jakiro_draft,
                         imported=any(d.import_from for d in prof.drafts.values()))


def methods_table(profile: str | Profile | StudyContext, study: str = "main",
                  run_dir: str | Path | None = None) -> pd.DataFrame:
    """The methods a study compares and their settings (draft, tree, decoupled, CEPD ar_steps)."""
    prof, rdir = _dirs(profile, run_dir)
    rows = []
    for name, m in profile_methods(prof, RunLayout(rdir).drafts, study).items():
        row: dict[str, Any] = {"method": name, "kind": m.kind, "engine": m.runs_on, "compiled": m.compile}
        if m.kind == SPEC:
            row.update({k: method_setting(m, k) for k in METHOD_COLUMNS})
        rows.append(row)
    return pd.DataFrame(rows)


def _select(methods: dict[str, MethodSpec], only: str | Sequence[str] | None, study: str) -> dict[str, MethodSpec]:
    """The runs named in ``only``: run labels (``jakiro_auto_static_compiled``), or one comma-separated string of
    them (:func:`parse_names`); a method's bare name that labels no run selects every run of that method."""
    if not only:
        return methods
    runs: dict[str, list[str]] = {}
    for label, spec in methods.items():
        runs.setdefault(method_name(label, spec), []).append(label)
    only = parse_names(only, {*methods, *runs}) if isinstance(only, str) else only
    unknown = sorted(set(only) - set(methods) - set(runs))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown} for study {study!r}; choose from {', '.join(methods)}")
    chosen = {label for name in only for label in ([name] if name in methods else runs[name])}
    return {k: v for k, v in methods.items() if k in chosen}


def _stamp(study: str, methods: dict[str, MethodSpec], prof: Profile, temps: Sequence[float],
           questions: Sequence[Question]) -> dict[str, Any]:
    """What the records depend on, as it reads back from JSON (drafts by name and weights' digest)."""
    return json.loads(json.dumps({
        "study": study, "methods": {k: portable(v) for k, v in methods.items()},
        "drafts": {k: draft_fingerprint(v.draft) for k, v in methods.items()},
        "bench": dataclasses.asdict(prof.bench), "target": dataclasses.asdict(prof.target),
        "temperatures": temps, "questions": [[q.benchmark, str(q.question_id)] for q in questions],
    }, default=str))


def run_study(profile: str | Profile | StudyContext, run_dir: str | Path | None = None, study: str = "main", *,
              target: Any = None, force: bool = False, progress: bool = True,
              only: str | Sequence[str] | None = None, out_dir: str | Path | None = None,
              questions: Sequence[Question] | None = None) -> pd.DataFrame:
    """Benchmark the methods of ``study`` (see :func:`jakiro_lib.measure.methods.study_methods`) on the profile's
    benchmarks, or on ``questions`` (e.g. a Spec-Bench ``question.jsonl`` read with
    :func:`jakiro_lib.data.conversations.load_question_file`); records go to ``out_dir`` (default
    ``run_dir/bench/<study>``) as ``records.jsonl``. ``only``: a subset of the study's method names (or one
    comma-separated string of them).
    Returns the summary table.

    Records are reused (the benchmark resumes) while the methods, drafts and settings are unchanged;
    otherwise, or with ``force``, the old file (and its stamp) is moved to ``records.stale[.N].jsonl`` first.
    """
    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}: use {' or '.join(STUDIES)}")
    prof, rdir = _dirs(profile, run_dir)
    layout = RunLayout(rdir)
    methods = _select(profile_methods(prof, layout.drafts, study), only, study)
    missing = sorted({draft_name(m.draft) for m in methods.values() if m.draft and not has_weights(m.draft)})
    if missing:
        raise FileNotFoundError(f"study {study!r} needs trained drafts {missing} in {layout.drafts}: run "
                                "notebook 01 (or `python -m jakiro_lib train`) first")
    skipped: dict[str, str] = {}
    if questions is None:
        questions, skipped = study_questions(prof)
    if not questions:
        raise DataError(f"no benchmark questions to run for {', '.join(prof.bench.benchmarks)} (bench.skip="
                        f"{prof.bench.skip}, bench.limit={prof.bench.limit}; not loaded: {skipped or 'none'})")
    temps = study_temperatures(prof, study)
    out_dir = Path(out_dir).expanduser().resolve() if out_dir is not None else layout.bench(study)
    target = target or get_target(prof)
    methods, budgets = resolve_tree_budgets(prof, rdir, methods, target, force=force,
                                            exclude=[t for q in questions for t in q.turns])
    out_dir.mkdir(parents=True, exist_ok=True)
    if budgets:
        write_json(out_dir / STUDY_TREE_BUDGET, budgets)
    _renew_stamp(out_dir, _stamp(study, methods, prof, temps, questions), study, force)
    b = prof.bench
    t0 = time.perf_counter()
    run_benchmark(target, methods, questions, temperatures=temps, max_new_tokens=b.max_new_tokens,
                  repeats=b.repeats, warmup=b.warmup, seed=b.seed, out_dir=out_dir, progress=progress,
                  tuning=budgets.get("tuning_prompts"))
    log.info("study %s: %d methods x %d questions x %d temperatures in %.1f s", study, len(methods),
             len(questions), len(temps), time.perf_counter() - t0)
    table = study_table(load_records(out_dir / RECORDS_FILE), methods)
    table.attrs["skipped_benchmarks"] = skipped
    table.attrs["records"] = str(out_dir / RECORDS_FILE)
    write_json(out_dir / SKIPPED_FILE, skipped)
    return table


def _renew_stamp(out_dir: Path, stamp: dict[str, Any], study: str, force: bool) -> None:
    """Move old records aside when they were made with other settings (or ``force``); write the stamp."""
    records = out_dir / RECORDS_FILE
    if records.exists() and (force or not _describes(read_json(out_dir / STUDY_STAMP), stamp)):
        aside = _free_name(out_dir / STALE_RECORDS_FILE)  # never over earlier stale records
        log.info("study %s: %s; old records moved to %s", study,
                 "forced" if force else "settings or drafts changed", aside.name)
        os.replace(records, aside)
        if (out_dir / STUDY_STAMP).is_file():
            os.replace(out_dir / STUDY_STAMP, aside.with_suffix(".stamp.json"))
    write_json(out_dir / STUDY_STAMP, stamp)


def _free_name(path: Path) -> Path:
    """``path`` if nothing is there, else the first of ``<stem>.1<suffix>``, ``<stem>.2<suffix>``, ..."""
    n = 0
    while path.exists():
        n += 1
        path = path.with_name(f"{Path(STALE_RECORDS_FILE).stem}.{n}{path.suffix}")
    return path


def _describes(old: dict[str, Any] | None, new: dict[str, Any]) -> bool:
    """Whether records made under stamp ``old`` are valid under ``new``: the same settings, and every old
    method in the new set with the same settings and draft (a method added to a study, or a run with
    ``only`` a subset followed by the whole set, reruns nothing already there)."""
    if old is None:
        return False
    per_method = ("methods", "drafts")
    if {k: v for k, v in old.items() if k not in per_method} != {k: v for k, v in new.items() if k not in per_method}:
        return False
    return all(k in new.get(key, {}) and new[key][k] == v for key in per_method for k, v in old.get(key, {}).items())


def bench_environment(run_dir: str | Path, study: str = "main") -> dict[str, Any]:
    """The ``run_metadata`` recorded with the benchmark (machine, device, date, versions)."""
    cfg = read_json(RunLayout(Path(run_dir)).bench(study) / BENCH_CONFIG) or {}
    return cfg.get("environment", {})
