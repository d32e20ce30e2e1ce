"""The pipeline's stages one by one: their names, stamps and staleness (the rule:
:mod:`jakiro_lib.report.pipeline`), one notebook executed with papermill and turned into HTML, and ``pipeline.json``.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Sequence

from ..files import REPO_ROOT, read_json, write_json, write_text

log = logging.getLogger(__name__)

STAGES: tuple[str, ...] = (
    "00_data_caching",
    "01_train_moe_head",
    "02_hybrid_decoding_ablations",
    "03_result_figures",
)
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


@dataclass(frozen=True)
class StageRun:
    """One pipeline invocation's fixed inputs: what every stage step reads."""

    pm: Any  # the papermill module
    selected: list[str]
    parameters: dict[str, Any]
    fingerprint: str  # the resolved configuration a stage's stamp must match
    nb_dir: Path
    report_dir: Path
    force: bool
    kernel_name: str
    log_output: bool
    execution_timeout: int | None

    def stamp(self, stage: str) -> Path:
        return self.report_dir / STAMP_DIR / f"{stage}.json"

    def source(self, stage: str) -> Path:
        return self.nb_dir / f"{stage}.ipynb"

    def executed(self, stage: str) -> Path:
        return self.report_dir / f"{stage}.ipynb"

    def html(self, stage: str) -> Path:
        return self.report_dir / f"{stage}.html"


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


def _stage_status(run: StageRun, stage: str, upstream_finished: float) -> tuple[bool, str]:
    """(up to date?, reason it is not)."""
    executed, stamp = run.executed(stage), read_json(run.stamp(stage))
    if run.force:
        return False, "forced"
    if not executed.is_file() or stamp is None or stamp.get("status") != "ok":
        return False, "never executed"
    if stamp.get("version") != STAMP_VERSION:
        return False, "stamp format changed"
    if run.source(stage).stat().st_mtime > min(executed.stat().st_mtime, float(stamp.get("started", 0.0))):
        return False, "notebook source changed"
    if stamp.get("fingerprint") != run.fingerprint:
        return False, "parameters changed"
    if stamp.get("finished", 0.0) < upstream_finished:
        return False, "an earlier stage was executed after it"
    return True, ""


def _finished(run: StageRun, stage: str) -> float:
    """When ``stage`` last finished well (0: never)."""
    stamp = read_json(run.stamp(stage))
    return float(stamp.get("finished", 0.0)) if stamp and stamp.get("status") == "ok" else 0.0


def _skip_fresh(run: StageRun, stage: str) -> StageResult:
    """An up-to-date stage: its HTML remade only where older than its notebook."""
    executed, html = run.executed(stage), run.html(stage)
    if not html.is_file() or html.stat().st_mtime < executed.stat().st_mtime:
        notebook_to_html(executed, html)
    log.info("stage %s: up to date, skipped", stage)
    return StageResult(stage, "skipped", 0.0, str(executed), str(html), "up to date")


def _stage_failed(run: StageRun, stage: str, exc: BaseException, seconds: float, running: Path) -> PipelineError:
    """The error a failed stage ends in, logged; its partial notebook kept as ``<stage>.failed.ipynb`` (with HTML)."""
    failed = run.report_dir / f"{stage}.failed.ipynb"
    where = ""
    if running.is_file():
        os.replace(running, failed)
        try:
            notebook_to_html(failed, failed.with_suffix(".html"))
        except Exception:  # noqa: BLE001 - the HTML of a broken notebook is a convenience
            pass
        where = f"; partial executed copy: {failed} (HTML: {failed.with_suffix('.html')})"
    if isinstance(exc, run.pm.PapermillExecutionError):
        detail = f"cell {exc.exec_count} raised {exc.ename}: {exc.evalue}"
    elif isinstance(exc, KeyboardInterrupt):
        detail = "interrupted"
    else:
        detail = f"{type(exc).__name__}: {exc}"
    msg = f"pipeline stage {stage} failed after {seconds:.1f} s: {detail}\n  notebook: {run.source(stage)}{where}"
    log.error(msg)
    return PipelineError(msg)


def _record_stage(run: StageRun, stage: str, started: float, seconds: float) -> float:
    """A stage executed well: its notebook and HTML in place, an earlier failure's copies gone, its stamp written;
    returns when it finished."""
    failed = run.report_dir / f"{stage}.failed.ipynb"
    os.replace(run.report_dir / RUNNING_DIR / f"{stage}.ipynb", run.executed(stage))
    failed.unlink(missing_ok=True)
    failed.with_suffix(".html").unlink(missing_ok=True)
    notebook_to_html(run.executed(stage), run.html(stage))
    finished = time.time()
    write_json(run.stamp(stage), {
        "version": STAMP_VERSION, "stage": stage, "status": "ok", "fingerprint": run.fingerprint,
        "parameters": run.parameters, "source": str(run.source(stage)), "started": started, "finished": finished,
        "finished_iso": datetime.fromtimestamp(finished, timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 2), "kernel_name": run.kernel_name,
    })
    return finished


def _execute_stage(run: StageRun, stage: str, reason: str) -> tuple[StageResult, float]:
    """Execute one stage's notebook with papermill (into ``.running/`` until it succeeds); returns its result and
    when it finished. Raises :class:`PipelineError` (KeyboardInterrupt as itself) when it fails."""
    log.info("stage %s: executing (%s)", stage, reason)
    running = run.report_dir / RUNNING_DIR / f"{stage}.ipynb"
    running.parent.mkdir(exist_ok=True)
    run.stamp(stage).unlink(missing_ok=True)
    started = time.time()
    t0 = time.perf_counter()
    try:
        run.pm.execute_notebook(
            str(run.source(stage)), str(running), parameters=run.parameters, kernel_name=run.kernel_name,
            cwd=str(REPO_ROOT), progress_bar=False, log_output=run.log_output,
            request_save_on_cell_execute=True, execution_timeout=run.execution_timeout,
        )
    except BaseException as exc:
        error = _stage_failed(run, stage, exc, time.perf_counter() - t0, running)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise error from exc
    seconds = time.perf_counter() - t0
    finished = _record_stage(run, stage, started, seconds)
    log.info("stage %s: done in %.1f s -> %s", stage, seconds, run.html(stage))
    result = StageResult(stage, "executed", round(seconds, 2), str(run.executed(stage)), str(run.html(stage)), reason)
    return result, finished


def run_stages(run: StageRun) -> list[StageResult]:
    """Every selected stage in order: skipped when up to date, else executed; an unselected stage only counts as
    an earlier stage's finish time."""
    results: list[StageResult] = []
    upstream_finished = 0.0  # latest finish time of an earlier stage
    for stage in STAGES:
        if stage not in run.selected:
            upstream_finished = max(upstream_finished, _finished(run, stage))
            continue
        fresh, reason = _stage_status(run, stage, upstream_finished)
        if fresh:
            upstream_finished = max(upstream_finished, _finished(run, stage))
            results.append(_skip_fresh(run, stage))
            continue
        result, upstream_finished = _execute_stage(run, stage, reason)
        results.append(result)
    return results


def write_pipeline_log(report_dir: Path, profile: str, parameters: dict[str, Any],
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
