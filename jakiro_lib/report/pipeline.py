"""Run the study notebooks end to end with papermill and turn them into an HTML report.

:func:`run_pipeline` executes notebooks 00-03 in order, each given the resolved profile (``<run_dir>/profile.json``),
into ``reports/<profile>/``. A stage is skipped when its executed notebook is newer than its source, ran with the same
resolved configuration (``.stamps/``) and no earlier stage ran after it; edits to ``jakiro_lib`` need ``force``."""
from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import pandas as pd

from ..config import Profile
from ..files import REPO_ROOT, write_json
from ..layout import RunLayout
from ..measure.summary import headline_table
from ..profiles import override
from ..runlock import run_lock
from ..study.context import default_report_dir, default_run_dir, resolve_profile, write_resolved
from ..training.scale import SCALE_JSON, resolve_scale, set_keys
from ..training.scale import log as scale_log
from .page import write_front_page
from .stages import (RUNNING_DIR, STAMP_DIR, PipelineError, StageResult, StageRun, run_stages, select_stages,
                     write_pipeline_log)
from .stages import log as stages_log

log = logging.getLogger(__name__)

NOTEBOOK_DIR = REPO_ROOT / "notebooks"


def _plain(value: Any) -> Any:
    """Overrides as papermill-friendly literals (tuples -> lists, paths -> str)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


PATH_KEYS = ("import_from", "init_from")  # override keys (last part) that may name a local folder


def _local_paths(overrides: dict[str, Any]) -> dict[str, Any]:
    """Overrides naming a folder relative to here made absolute: the notebooks' kernels run in the repository root."""
    def local(key: str, value: Any) -> bool:
        return key.rsplit(".", 1)[-1] in PATH_KEYS and isinstance(value, str) and Path(value).expanduser().exists()
    return {k: str(Path(v).expanduser().resolve()) if local(k, v) else v for k, v in overrides.items()}


def _fingerprint(profile_dict: dict[str, Any], run_dir: Path, report_dir: Path) -> str:
    """Canonical JSON of what the notebooks compute from: the resolved profile and the two directories."""
    return json.dumps({"profile": profile_dict, "run_dir": str(run_dir), "report_dir": str(report_dir)},
                      sort_keys=True, default=str)


def _directories(profile_name: str, run_dir: str | Path | None, report_dir: str | Path | None,
                 selected: list[str], notebook_dir: str | Path | None) -> tuple[Path, Path, Path]:
    """(run, report, notebook) directories, the first two made; every selected stage's notebook must be there."""
    run_dir = Path(run_dir).expanduser().resolve() if run_dir is not None else default_run_dir(profile_name)
    report_dir = (Path(report_dir).expanduser().resolve() if report_dir is not None
                  else default_report_dir(profile_name))
    nb_dir = Path(notebook_dir) if notebook_dir is not None else NOTEBOOK_DIR
    for stage in selected:
        if not (nb_dir / f"{stage}.ipynb").is_file():
            raise PipelineError(f"notebook {nb_dir / (stage + '.ipynb')} is missing")
    report_dir.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / STAMP_DIR).mkdir(exist_ok=True)
    return run_dir, report_dir, nb_dir


@contextlib.contextmanager
def _progress_logging(log_output: bool) -> Iterator[None]:
    """Our per-stage lines shown (on stderr when the caller configured no logging), papermill's per-cell ones
    only with ``log_output``; every logger as it was afterwards."""
    pm_log = logging.getLogger("papermill")
    pm_level = pm_log.level
    if not log_output:  # papermill logs every cell at INFO; keep our per-stage lines only
        pm_log.setLevel(logging.WARNING)
    handler = None
    loggers = {lg: lg.level for lg in (log, stages_log, scale_log)}
    if not log.hasHandlers():  # progress must show even when the caller configured no logging
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        for lg in loggers:
            lg.addHandler(handler)
            if lg.getEffectiveLevel() > logging.INFO:
                lg.setLevel(logging.INFO)
    try:
        yield
    finally:
        pm_log.setLevel(pm_level)
        if handler is not None:
            for lg, level in loggers.items():
                lg.removeHandler(handler)
                lg.setLevel(level)


def _apply_scale(prof: Profile, overrides: dict[str, Any], run_dir: Path,
                 report_dir: Path) -> tuple[Profile, dict[str, Any]]:
    """data.scale="auto": the conversations and epochs that fit this machine, measured once before stage 00 and
    recorded in the run directory (and copied to the report); the notebooks get them as overrides like any --set."""
    overrides, record = resolve_scale(prof, overrides, run_dir)
    if record is None:
        (report_dir / SCALE_JSON).unlink(missing_ok=True)  # an earlier run's choice no longer applies
        return prof, overrides
    write_json(report_dir / SCALE_JSON, record)
    return override(prof, **set_keys(overrides)), overrides


def _finish(report_dir: Path, profile_name: str, parameters: dict[str, Any], results: list[StageResult],
            seconds: float) -> None:
    """After the stages: the running copies' directory removed, ``pipeline.json`` and the index written."""
    shutil.rmtree(report_dir / RUNNING_DIR, ignore_errors=True)
    write_pipeline_log(report_dir, profile_name, parameters, results, seconds)
    index = write_report_index(report_dir, profile_name=profile_name)
    log.info("pipeline %s: done in %.1f s; index: %s", profile_name, seconds, index)


def run_pipeline(
    profile: str,
    *,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
    stages: Sequence[str] | str | None = None,
    report_dir: str | Path | None = None,
    run_dir: str | Path | None = None,
    kernel_name: str = "python3",
    log_output: bool = False,
    execution_timeout: int | None = None,
    notebook_dir: str | Path | None = None,
) -> Path:
    """Execute the study notebooks for ``profile`` and write the report; returns the report directory. ``overrides``:
    dotted profile keys (``{"bench.limit": 2}``; strings parsed as on the CLI); ``stages``: a subset (``"00,01"`` or
    names); ``run_dir`` defaults to ``$JAKIRO_RUNS/<profile>``, ``report_dir`` to ``reports/<profile>``. ``force``
    reruns every selected stage and its training and benchmarks (not the feature cache). Raises :class:`PipelineError`
    when a stage fails, its partial notebook kept as ``<report_dir>/<stage>.failed.ipynb``."""
    import papermill as pm  # optional, heavy: only the pipeline runs notebooks

    overrides = _local_paths(_plain(dict(overrides or {})))
    prof = resolve_profile(profile, overrides)  # fails early on unknown profiles or keys
    selected = select_stages(stages)
    run_dir, report_dir, nb_dir = _directories(prof.name, run_dir, report_dir, selected, notebook_dir)
    with _progress_logging(log_output):
        log.info("pipeline %s: stages %s; runs in %s, reports in %s", prof.name, ", ".join(selected), run_dir,
                 report_dir)
        with run_lock(run_dir, report_dir, for_children=True):  # one run per run directory: the kernels work under it
            prof, overrides = _apply_scale(prof, overrides, run_dir, report_dir)
            resolved = RunLayout(run_dir).profile  # the notebooks start from it: the profile is resolved here, once
            write_resolved(resolved, prof, overrides)
            parameters = {"profile": str(resolved), "run_dir": str(run_dir), "report_dir": str(report_dir),
                          "force": bool(force)}
            run = StageRun(pm, selected, parameters, _fingerprint(json.loads(prof.to_json()), run_dir, report_dir),
                           nb_dir, report_dir, force=force, kernel_name=kernel_name, log_output=log_output,
                           execution_timeout=execution_timeout)
            t_all = time.perf_counter()
            results = run_stages(run)
            _finish(report_dir, prof.name, parameters, results, time.perf_counter() - t_all)
            return report_dir


def write_report_index(report_dir: str | Path, *, profile_name: str | None = None) -> Path:
    """(Re)write ``index.html`` from the tables the report directory holds (:mod:`jakiro_lib.report.page`)."""
    report_dir = Path(report_dir)
    main, goals, levers = (_read_table(report_dir / name)
                           for name in ("main_results.csv", "performance_targets.csv", "levers.csv"))
    summary = None
    if main is not None:
        try:
            summary = headline_table(main)
        except (KeyError, ValueError, TypeError) as exc:  # an index without the summary beats no index
            log.warning("could not summarise %s: %s", report_dir / "main_results.csv", exc)
    return write_front_page(report_dir, title=f"Jakiro reproduction: profile {profile_name or report_dir.name}",
                            profile_name=profile_name, summary=summary, goals=goals, levers=levers)


def _read_table(path: Path) -> pd.DataFrame | None:
    """A CSV the notebooks wrote, or None when it is missing or unreadable."""
    try:
        return pd.read_csv(path) if path.is_file() else None
    except (OSError, ValueError) as exc:  # pandas' parser errors are ValueErrors
        log.warning("could not read %s: %s", path, exc)
        return None
