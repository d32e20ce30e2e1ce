"""Stage 02 (notebook 02, the ``bench`` CLI): the studies' methods benchmarked on the profile's questions
(:func:`run_study`), their records kept or set aside as :mod:`jakiro_lib.study.stamps` decides."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from ..measure.bench import check_context, run_benchmark
from ..measure.summary import load_records
from ..measure.budgets import resolve_tree_budgets
from ..config import Profile
from ..data.conversations import DataError, Question, load_questions
from ..layout import BENCH_CONFIG, RECORDS_FILE, SKIPPED_FILE, STUDY_TREE_BUDGET, RunLayout, draft_name, has_weights
from ..decoding.methods import MethodSpec
from ..measure.methods import SPEC, STUDIES, parse_names, profile_methods
from ..files import read_json, write_json
from .context import StudyContext, get_target
from .stamps import claim_records, make_stamp
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


def methods_table(ctx: StudyContext, study: str = "main") -> pd.DataFrame:
    """The methods a study compares and their settings (draft, tree, decoupled, CEPD ar_steps)."""
    prof, rdir = ctx.profile, ctx.run_dir
    rows = []
    for name, m in profile_methods(prof, RunLayout(rdir).drafts, study).items():
        row: dict[str, Any] = {"method": name, "kind": m.kind, "engine": m.runs_on}
        if m.kind == SPEC:
            row.update({k: method_setting(m, k) for k in METHOD_COLUMNS})
        rows.append(row)
    return pd.DataFrame(rows)


def _select(methods: dict[str, MethodSpec], only: str | Sequence[str] | None, study: str) -> dict[str, MethodSpec]:
    """The methods named in ``only``, or in one comma-separated string of them (:func:`parse_names`)."""
    if not only:
        return methods
    only = parse_names(only, set(methods)) if isinstance(only, str) else only
    unknown = sorted(set(only) - set(methods))
    if unknown:
        raise ValueError(f"unknown method(s) {unknown} for study {study!r}; choose from {', '.join(methods)}")
    return {k: v for k, v in methods.items() if k in set(only)}


def run_study(ctx: StudyContext, study: str = "main", *,
              target: Any = None, force: bool = False, progress: bool = True,
              only: str | Sequence[str] | None = None, out_dir: str | Path | None = None,
              questions: Sequence[Question] | None = None) -> pd.DataFrame:
    """Benchmark the methods of ``study`` (:func:`jakiro_lib.measure.methods.study_methods`), ``only`` some (names, or
    one comma-separated string), on the profile's benchmarks or ``questions`` into ``out_dir`` (default
    ``run_dir/bench/<study>``). Old records are reused or set aside as :func:`~jakiro_lib.study.stamps.claim_records`
    decides (``force``: set aside), once every prompt fits the context
    (:func:`~jakiro_lib.measure.bench.check_context`). Returns the summary of this run's questions and temperatures."""
    if study not in STUDIES:
        raise ValueError(f"unknown study {study!r}: use {' or '.join(STUDIES)}")
    prof, rdir = ctx.profile, ctx.run_dir
    layout = RunLayout(rdir)
    methods = _select(profile_methods(prof, layout.drafts, study), only, study)
    missing = sorted({draft_name(m.draft) for m in methods.values() if m.draft and not has_weights(m.draft)})
    if missing:
        raise FileNotFoundError(f"study {study!r} needs trained drafts {missing} in {layout.drafts}: run "
                                "notebook 01 (or `python -m jakiro_lib train`) first")
    skipped: dict[str, str] = {}
    asked = questions is not None  # a question file's texts, not the packaged benchmarks'
    if questions is None:
        questions, skipped = study_questions(prof)
    if not questions:
        raise DataError(f"no benchmark questions to run for {', '.join(prof.bench.benchmarks)} (bench.skip="
                        f"{prof.bench.skip}, bench.limit={prof.bench.limit}; not loaded: {skipped or 'none'})")
    temps = study_temperatures(prof, study)
    out_dir = Path(out_dir).expanduser().resolve() if out_dir is not None else layout.bench(study)
    target = target or get_target(prof)
    check_context(target, questions, prof.bench.max_new_tokens)
    methods, budgets = resolve_tree_budgets(prof, rdir, methods, target, force=force,
                                            exclude=[t for q in questions for t in q.turns])
    out_dir.mkdir(parents=True, exist_ok=True)
    claim_records(out_dir, make_stamp(study, methods, prof, temps, questions), study, force=force,
                  unhashed_ok=not asked)
    if budgets:
        write_json(out_dir / STUDY_TREE_BUDGET, budgets)
    b = prof.bench
    t0 = time.perf_counter()
    run_benchmark(target, methods, questions, temperatures=temps, max_new_tokens=b.max_new_tokens,
                  repeats=b.repeats, warmup=b.warmup, seed=b.seed, out_dir=out_dir, progress=progress,
                  tuning=budgets.get("tuning_prompts"))
    log.info("study %s: %d methods x %d questions x %d temperatures in %.1f s", study, len(methods),
             len(questions), len(temps), time.perf_counter() - t0)
    table = study_table(_asked_now(load_records(out_dir / RECORDS_FILE), questions, temps), methods)
    table.attrs["skipped_benchmarks"] = skipped
    table.attrs["records"] = str(out_dir / RECORDS_FILE)
    write_json(out_dir / SKIPPED_FILE, skipped)
    return table


def _asked_now(records: list[dict[str, Any]], questions: Sequence[Question], temps: Sequence[float]
               ) -> list[dict[str, Any]]:
    """The records of these questions at these temperatures (the folder may hold more of a wider run)."""
    keys = {(q.benchmark, str(q.question_id)) for q in questions}
    return [r for r in records if (r["benchmark"], str(r["question_id"])) in keys and r["temperature"] in temps]


def bench_environment(run_dir: str | Path, study: str = "main") -> dict[str, Any]:
    """The ``run_metadata`` recorded with the benchmark (machine, device, date, versions)."""
    cfg = read_json(RunLayout(Path(run_dir)).bench(study) / BENCH_CONFIG) or {}
    return cfg.get("environment", {})
