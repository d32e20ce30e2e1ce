"""Run the study notebooks end to end with papermill and turn them into an HTML report.

``run_pipeline("default")`` executes ``notebooks/00_data_caching.ipynb`` ... ``03_result_figures.ipynb``
in order, each with the papermill parameters ``profile``, ``overrides``, ``run_dir``, ``report_dir`` and
``force``; the executed copies land in ``reports/<profile>/`` next to their HTML (code kept visible), the
CSV/JSON tables and PNG figures the notebooks write, and an ``index.html`` that links everything.

Scale: where the profile sets ``data.scale="auto"`` (the default profile), the number of conversations and epochs is
chosen before stage 00 from a short measurement of this machine, to fit the 90-minute main job, recorded in
``<run_dir>/scale.json`` (copied to the report, and a line on its front page), reused by a rerun, and passed to the
notebooks as overrides; ``--set data.num_conversations=...`` / ``train.epochs=...`` win (:mod:`jakiro_lib.training.scale`).

Staleness: a stage is skipped when its executed notebook exists, is newer than the notebook source, was
executed with the same resolved configuration (a stamp in ``<report_dir>/.stamps/``), and no earlier
stage was executed after it. ``force=True`` re-executes every selected stage and passes ``force=True``
to the notebooks, which then retrain drafts and rerun benchmarks (the feature cache is verified and
reused; delete ``runs/<profile>/features`` to recompute it). Library code changes are not tracked:
use ``force`` after editing ``jakiro_lib``.

CLI: ``python -m jakiro_lib pipeline --profile P [--set key=value ...] [--force] [--stages 00,01]`` (or
``python -m jakiro_lib.report.pipeline`` with the same flags).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from ..profiles import PROFILE_NAMES, parse_overrides
from .page import write_front_page
from ..training.scale import SCALE_JSON, resolve_scale
from ..training.scale import log as scale_log
from ..study.context import default_report_dir, default_run_dir, resolve_profile
from ..measure.bench import headline_table
from ..errors import exit_status
from ..files import check_paths, read_json, write_json, write_text
from ..machine import run_lock
from ..files import REPO_ROOT
from ..machine import busy_warning

log = logging.getLogger(__name__)

NOTEBOOK_DIR = REPO_ROOT / "notebooks"
STAGES: tuple[str, ...] = (
    "00_data_caching",
    "01_train_moe_head",
    "02_hybrid_decoding_ablations",
    "03_result_figures",
)
PARAMETERS: tuple[str, ...] = ("profile", "overrides", "run_dir", "report_dir", "force")
STAMP_DIR = ".stamps"
RUNNING_DIR = ".running"
STAMP_VERSION = 1


class PipelineError(RuntimeError):
    """A stage failed; the message names the notebook and where its partial executed copy is."""


@dataclass
class StageResult:
    stage: str
    status: str  # "executed" | "skipped"
    seconds: float
    notebook: str
    html: str
    reason: str = ""


# --------------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------------


def select_stages(stages: Sequence[str] | str | None) -> list[str]:
    """Stage names from ``"00,01"``, ``["0", "02_hybrid_decoding_ablations"]``, ``["train_moe_head"]``..."""
    if stages is None:
        return list(STAGES)
    if isinstance(stages, str):
        stages = [s for s in stages.split(",")]
    chosen: set[str] = set()
    for raw in stages:
        key = str(raw).strip().removesuffix(".ipynb")
        if not key:
            continue
        match = [s for s in STAGES if s == key or s.split("_", 1)[0] == key.zfill(2) or s.split("_", 1)[1] == key]
        if len(match) != 1:
            raise ValueError(f"unknown stage {raw!r}; stages are {', '.join(STAGES)} (or their numbers 00-03)")
        chosen.add(match[0])
    if not chosen:
        raise ValueError("no stage selected")
    return [s for s in STAGES if s in chosen]


def _plain(value: Any) -> Any:
    """Overrides as papermill-friendly literals (tuples -> lists, paths -> str)."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    return value


def _fingerprint(profile_dict: dict[str, Any], run_dir: Path, report_dir: Path) -> str:
    """Canonical JSON of what the notebooks compute from: the resolved profile and the two directories."""
    return json.dumps({"profile": profile_dict, "run_dir": str(run_dir), "report_dir": str(report_dir)},
                      sort_keys=True, default=str)


def notebook_to_html(notebook: str | Path, html: str | Path | None = None) -> Path:
    """Convert an executed notebook to standalone HTML (code cells kept visible)."""
    import nbformat  # optional, heavy (Jupyter's): only reports need them
    from nbconvert import HTMLExporter  # optional, heavy, like nbformat

    notebook = Path(notebook)
    html = Path(html) if html is not None else notebook.with_suffix(".html")
    nb = nbformat.read(str(notebook), as_version=4)
    exporter = HTMLExporter()
    level = exporter.log.level
    exporter.log.setLevel(logging.ERROR)  # "alternative text is missing": the lab template ignores alt
    try:
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": notebook.stem}})
    finally:
        exporter.log.setLevel(level)
    write_text(html, body)
    return html


def _stage_status(stage: str, *, source: Path, report_dir: Path, fingerprint: str, force: bool,
                  upstream_finished: float) -> tuple[bool, str]:
    """(up to date?, reason it is not)."""
    executed = report_dir / f"{stage}.ipynb"
    stamp = read_json(report_dir / STAMP_DIR / f"{stage}.json")
    if force:
        return False, "forced"
    if not executed.is_file() or stamp is None or stamp.get("status") != "ok":
        return False, "never executed"
    if stamp.get("version") != STAMP_VERSION:
        return False, "stamp format changed"
    if source.stat().st_mtime > min(executed.stat().st_mtime, float(stamp.get("started", 0.0))):
        return False, "notebook source changed"
    if stamp.get("fingerprint") != fingerprint:
        return False, "parameters changed"
    if stamp.get("finished", 0.0) < upstream_finished:
        return False, "an earlier stage was executed after it"
    return True, ""


# --------------------------------------------------------------------------------------------------
# The pipeline
# --------------------------------------------------------------------------------------------------


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
    """Execute the study notebooks for ``profile`` and write the report; returns the report directory.

    ``overrides``: dotted profile keys (``{"bench.limit": 2}``; strings are parsed as on the CLI).
    ``stages``: subset to run (``"00,01"`` or names); the others are left as they are. ``run_dir``
    defaults to ``$JAKIRO_RUNS/<profile>`` (``runs/<profile>``), ``report_dir`` to
    ``reports/<profile>``. ``log_output`` streams the kernels' output into the log.
    Raises :class:`PipelineError` when a stage fails (the partial notebook is kept as
    ``<report_dir>/<stage>.failed.ipynb`` and converted to HTML).
    """
    import papermill as pm  # optional, heavy: only the pipeline runs notebooks

    overrides = _plain(dict(overrides or {}))
    prof = resolve_profile(profile, overrides)  # fails early on unknown profiles or keys
    run_dir = Path(run_dir).expanduser().resolve() if run_dir is not None else default_run_dir(prof.name)
    report_dir = (Path(report_dir).expanduser().resolve() if report_dir is not None
                  else default_report_dir(prof.name))
    nb_dir = Path(notebook_dir) if notebook_dir is not None else NOTEBOOK_DIR
    selected = select_stages(stages)
    for stage in selected:
        if not (nb_dir / f"{stage}.ipynb").is_file():
            raise PipelineError(f"notebook {nb_dir / (stage + '.ipynb')} is missing")
    report_dir.mkdir(parents=True, exist_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / STAMP_DIR).mkdir(exist_ok=True)

    pm_log = logging.getLogger("papermill")
    pm_level = pm_log.level
    if not log_output:  # papermill logs every cell at INFO; keep our per-stage lines only
        pm_log.setLevel(logging.WARNING)
    handler = None
    loggers = {lg: lg.level for lg in (log, scale_log)}
    if not log.hasHandlers():  # progress must show even when the caller configured no logging
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))
        for lg in loggers:
            lg.addHandler(handler)
            if lg.getEffectiveLevel() > logging.INFO:
                lg.setLevel(logging.INFO)
    try:
        log.info("pipeline %s: stages %s; runs in %s, reports in %s", prof.name, ", ".join(selected), run_dir,
                 report_dir)
        with run_lock(run_dir, report_dir):  # one run per run directory (the notebooks' kernels take none)
            # data.scale="auto": the conversations and epochs that fit this machine, measured once before stage 00
            # and recorded in the run directory; the notebooks get them as overrides like any --set
            overrides, record = resolve_scale(prof, overrides, run_dir)
            if record is None:
                (report_dir / SCALE_JSON).unlink(missing_ok=True)  # an earlier run's choice no longer applies
            else:
                write_json(report_dir / SCALE_JSON, record)
                prof = resolve_profile(profile, overrides)
            parameters = {"profile": prof.name, "overrides": overrides, "run_dir": str(run_dir),
                          "report_dir": str(report_dir), "force": bool(force)}
            fingerprint = _fingerprint(json.loads(prof.to_json()), run_dir, report_dir)
            return _run_stages(pm, prof.name, selected, parameters, fingerprint, nb_dir, run_dir, report_dir,
                               force=force, kernel_name=kernel_name, log_output=log_output,
                               execution_timeout=execution_timeout)
    finally:
        pm_log.setLevel(pm_level)
        if handler is not None:
            for lg, level in loggers.items():
                lg.removeHandler(handler)
                lg.setLevel(level)


def _run_stages(pm: Any, profile_name: str, selected: list[str], parameters: dict[str, Any], fingerprint: str,
                nb_dir: Path, run_dir: Path, report_dir: Path, *, force: bool, kernel_name: str,
                log_output: bool, execution_timeout: int | None) -> Path:
    results: list[StageResult] = []
    upstream_finished = 0.0  # latest finish time of an earlier stage
    t_all = time.perf_counter()
    for stage in STAGES:
        stamp_path = report_dir / STAMP_DIR / f"{stage}.json"
        source = nb_dir / f"{stage}.ipynb"
        executed = report_dir / f"{stage}.ipynb"
        html = report_dir / f"{stage}.html"
        if stage not in selected:
            stamp = read_json(stamp_path)
            if stamp and stamp.get("status") == "ok":
                upstream_finished = max(upstream_finished, float(stamp.get("finished", 0.0)))
            continue
        fresh, reason = _stage_status(stage, source=source, report_dir=report_dir, fingerprint=fingerprint,
                                      force=force, upstream_finished=upstream_finished)
        if fresh:
            stamp = read_json(stamp_path) or {}
            upstream_finished = max(upstream_finished, float(stamp.get("finished", 0.0)))
            if not html.is_file() or html.stat().st_mtime < executed.stat().st_mtime:
                notebook_to_html(executed, html)
            log.info("stage %s: up to date, skipped", stage)
            results.append(StageResult(stage, "skipped", 0.0, str(executed), str(html), "up to date"))
            continue

        log.info("stage %s: executing (%s)", stage, reason)
        running = report_dir / RUNNING_DIR / f"{stage}.ipynb"
        running.parent.mkdir(exist_ok=True)
        failed = report_dir / f"{stage}.failed.ipynb"
        stamp_path.unlink(missing_ok=True)
        started = time.time()
        t0 = time.perf_counter()
        try:
            pm.execute_notebook(
                str(source), str(running), parameters=parameters, kernel_name=kernel_name,
                cwd=str(REPO_ROOT), progress_bar=False, log_output=log_output,
                request_save_on_cell_execute=True, execution_timeout=execution_timeout,
            )
        except BaseException as exc:
            seconds = time.perf_counter() - t0
            where = ""
            if running.is_file():
                os.replace(running, failed)
                try:
                    notebook_to_html(failed, failed.with_suffix(".html"))
                except Exception:  # noqa: BLE001 - the HTML of a broken notebook is a convenience
                    pass
                where = f"; partial executed copy: {failed} (HTML: {failed.with_suffix('.html')})"
            if isinstance(exc, pm.PapermillExecutionError):
                detail = f"cell {exc.exec_count} raised {exc.ename}: {exc.evalue}"
            elif isinstance(exc, KeyboardInterrupt):
                detail = "interrupted"
            else:
                detail = f"{type(exc).__name__}: {exc}"
            msg = (f"pipeline stage {stage} failed after {seconds:.1f} s: {detail}\n"
                   f"  notebook: {source}{where}")
            log.error(msg)
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise PipelineError(msg) from exc
        seconds = time.perf_counter() - t0
        os.replace(running, executed)
        failed.unlink(missing_ok=True)
        failed.with_suffix(".html").unlink(missing_ok=True)
        notebook_to_html(executed, html)
        finished = time.time()
        write_json(stamp_path, {
            "version": STAMP_VERSION, "stage": stage, "status": "ok", "fingerprint": fingerprint,
            "parameters": parameters, "source": str(source), "started": started, "finished": finished,
            "finished_iso": datetime.fromtimestamp(finished, timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(seconds, 2), "kernel_name": kernel_name,
        })
        upstream_finished = finished
        log.info("stage %s: done in %.1f s -> %s", stage, seconds, html)
        results.append(StageResult(stage, "executed", round(seconds, 2), str(executed), str(html), reason))

    shutil.rmtree(report_dir / RUNNING_DIR, ignore_errors=True)
    _write_pipeline_log(report_dir, profile_name, parameters, results, time.perf_counter() - t_all)
    index = write_report_index(report_dir, profile_name=profile_name)
    log.info("pipeline %s: done in %.1f s; index: %s", profile_name, time.perf_counter() - t_all, index)
    return report_dir


def _write_pipeline_log(report_dir: Path, profile: str, parameters: dict[str, Any],
                        results: list[StageResult], seconds: float) -> None:
    """``pipeline.json``: the last invocation's stages (executed or skipped) and their wall times."""
    stages: dict[str, Any] = {}
    for stage in STAGES:
        stamp = read_json(report_dir / STAMP_DIR / f"{stage}.json")
        if stamp:
            stages[stage] = {"last_executed": stamp.get("finished_iso"), "seconds": stamp.get("seconds")}
    for r in results:
        stages.setdefault(r.stage, {}).update({"this_run": r.status, "this_run_seconds": r.seconds,
                                               "reason": r.reason})
    write_json(report_dir / "pipeline.json", {
        "profile": profile, "parameters": parameters, "total_seconds": round(seconds, 2),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "stages": stages,
        "results": [asdict(r) for r in results],
    })


def write_report_index(report_dir: str | Path, *, profile_name: str | None = None) -> Path:
    """(Re)write ``index.html`` from what the report directory holds: the verdict (goals met or not),
    the headline figure, then the summary, goals and levers tables (:mod:`jakiro_lib.report.page`)."""
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


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def configure_parser(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the pipeline flags to ``p`` (used by :func:`add_cli` and :func:`main`)."""
    p.add_argument("--profile", default="default", choices=PROFILE_NAMES, help="named configuration")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile field, e.g. --set bench.limit=2 (repeatable)")
    p.add_argument("--force", action="store_true",
                   help="re-execute the stages even when up to date (and retrain / rerun inside them)")
    p.add_argument("--stages", help="comma-separated subset, e.g. 00,01 (default: all)")
    p.add_argument("--report-dir", type=Path, default=None, help="default reports/<profile>")
    p.add_argument("--run-dir", type=Path, default=None, help="default $JAKIRO_RUNS/<profile> or runs/<profile>")
    p.add_argument("--kernel", default="python3", help="Jupyter kernel name (default python3)")
    p.add_argument("--log-output", action="store_true", help="stream the notebooks' output")
    p.set_defaults(func=cli_handler)
    return p


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``pipeline`` sub-command on an argparse ``subparsers`` object."""
    p = subparsers.add_parser("pipeline", help="run all notebooks with papermill and write HTML reports")
    return configure_parser(p)


def cli_handler(args: argparse.Namespace) -> int:
    """Run the pipeline; known errors (and Ctrl-C, status 130) end in one ``error:`` line."""
    def run() -> int:
        check_paths(dirs={"--run-dir": args.run_dir, "--report-dir": args.report_dir})
        out = run_pipeline(args.profile, overrides=parse_overrides(args.set), force=args.force, stages=args.stages,
                           report_dir=args.report_dir, run_dir=args.run_dir,
                           kernel_name=getattr(args, "kernel", "python3"),
                           log_output=getattr(args, "log_output", False))
        print(f"reports written to {out} (open {out / 'index.html'})")
        return 0

    return exit_status(run, also=(ValueError,))  # a bad --stages or --set value


def main(argv: Sequence[str] | None = None) -> int:
    parser = configure_parser(argparse.ArgumentParser(prog="python -m jakiro_lib.report.pipeline",
                                                      description=__doc__.split("\n\n")[0]))
    args = parser.parse_args(argv)
    warning = busy_warning()
    if warning:
        print(warning, file=sys.stderr)
    return cli_handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
