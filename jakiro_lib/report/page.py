"""The report's front page, ``reports/<profile>/index.html``: the verdict first (each goal of
``performance_targets.csv``, met or not, with its interval and whether that settles it), then the evidence: the headline
figure, the summary, goals and levers tables, and links to every notebook, table and figure. A ``smoke`` report carries
a banner: plumbing only."""
from __future__ import annotations

import html
import json
import math
import numbers
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from .plots import STAGE_TITLES
from ..training.scale import SCALE_JSON
from ..profiles import SMOKE_BANNER
from ..files import read_json, write_text

HEADLINE_FIGURE = "speedup.png"  # notebook 03: speedup per method and temperature, with intervals
EXTENSION_PREFIX = "Jakiro + lookup branch (extension)"
INDEX_NAME = "index.html"

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:1.5em auto;
 padding:0 1em;color:#222;line-height:1.4}
h1{font-size:1.6em;margin-bottom:.2em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}
.banner{background:#fff3cd;border:1px solid #e0c36a;padding:.6em 1em;font-weight:600;margin:.8em 0}
.verdict{border-left:5px solid #888;background:#f7f7f7;padding:.6em 1em;margin:.8em 0}
.verdict p{margin:.3em 0;font-size:1.05em}.verdict ul{margin:.4em 0;padding-left:1.2em;font-size:.92em}
.met{color:#1a7f37;font-weight:600}.notmet{color:#b42318;font-weight:600}.open{color:#9a6700;font-weight:600}
.tablebox{max-width:100%;overflow-x:auto;margin:.5em 0}
table{border-collapse:collapse;font-size:.8em}th,td{border:1px solid #ccc;padding:2px 6px;text-align:left;
 vertical-align:top;white-space:normal}th{background:#f3f3f3}td.num{text-align:right;white-space:nowrap}
td:first-child{min-width:10em;max-width:26em}
summary{cursor:pointer;color:#555;font-size:.92em}
figure{margin:.8em 0}figure img{max-width:100%;border:1px solid #ddd}figcaption{font-size:.85em;color:#555}
.figs{display:flex;flex-wrap:wrap;gap:12px}.figs a{display:block;width:340px;font-size:.85em;text-align:center}
.figs img{width:340px;border:1px solid #ddd}.note{color:#555;font-size:.9em}code{background:#f5f5f5;padding:0 3px}
"""


@dataclass(frozen=True)
class GoalVerdict:
    """One row of ``performance_targets.csv`` in words."""

    goal: str
    temperature: float
    ratio: float
    low: float
    high: float
    target: str
    met: bool | None  # None: a side of the ratio was not measured
    settled: bool  # False: the interval straddles the target, so these prompts do not decide it

    def _status(self, unsettled: str) -> str:
        if self.met is None:
            return "not measured"
        return ("met" if self.met else "not met") + ("" if self.settled else unsettled)

    @property
    def status(self) -> str:
        return self._status(" on the point estimate, not settled by the interval")

    @property
    def short(self) -> str:
        """The status in a table cell: "(not settled)" where the interval straddles the target."""
        return self._status(" (not settled)")

    @property
    def css(self) -> str:
        return "open" if self.met is None or not self.settled else ("met" if self.met else "notmet")

    def sentence(self) -> str:
        if self.met is None:
            return f"{self.goal}, T={self.temperature:g}: not measured in this run"
        interval = "" if math.isnan(self.low) else f" (95% interval {self.low:.2f}-{self.high:.2f})"
        return f"{self.goal}, T={self.temperature:g}: {self.ratio:.2f}x{interval}, target {self.target}"


def _flag(value: Any) -> bool | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return str(value).strip().lower() in ("true", "1", "1.0")


def goal_verdicts(goals: pd.DataFrame) -> list[GoalVerdict]:
    """``performance_targets.csv`` rows as verdicts (``resolved`` empty: no interval, the point decides)."""
    out = []
    for row in goals.to_dict("records"):
        out.append(GoalVerdict(
            goal=str(row["goal"]), temperature=float(row["temperature"]), ratio=float(row["ratio"]),
            low=float(row.get("ratio_ci_low", math.nan)), high=float(row.get("ratio_ci_high", math.nan)),
            target=str(row["target"]), met=_flag(row["met"]), settled=_flag(row.get("resolved")) is not False))
    return out


def _tally(verdicts: list[GoalVerdict]) -> str:
    met = sum(v.met is True for v in verdicts)
    open_ = sum(v.met is not None and not v.settled for v in verdicts)
    tail = f" ({open_} not settled by their intervals)" if open_ else ""
    return f"{met} of {len(verdicts)} met{tail}"


def _headline(paper: list[GoalVerdict]) -> str:
    """The paper's claim in one line: Jakiro against HF decoding at each temperature."""
    versus_hf = [v for v in paper if "HF generate" in v.goal or "HF sampling" in v.goal]
    if not versus_hf:
        return ""
    parts = [f"{v.ratio:.2f}x at T={v.temperature:g} (goal {html.escape(v.target)}: "
             f"<span class='{v.css}'>{html.escape(v.status)}</span>)" if v.met is not None
             else f"not measured at T={v.temperature:g}" for v in versus_hf]
    return f"<p><b>Verdict.</b> Jakiro against the fastest HF decoder: {'; '.join(parts)}.</p>"


def verdict_html(goals: pd.DataFrame | None) -> str:
    """The verdict block: the headline claim, a tally per goal family, and every goal on demand."""
    if goals is None or goals.empty:
        return ("<div class='verdict' id='verdict'><p><b>Verdict:</b> no speed goals in this report yet "
                "(stage 02 writes <code>performance_targets.csv</code>).</p></div>")
    verdicts = goal_verdicts(goals)
    paper = [v for v in verdicts if not v.goal.startswith(EXTENSION_PREFIX) and "vanilla loop" not in v.goal]
    ext = [v for v in verdicts if v.goal.startswith(EXTENSION_PREFIX)]
    base = [v for v in verdicts if "vanilla loop" in v.goal]
    lines = [_headline(paper), f"<p>All of Jakiro's goals (speed against HF, HF prompt lookup and EAGLE-2; "
                               f"tau against EAGLE-2): {_tally(paper)}.</p>"]
    if ext:
        lines.append(f"<p>This repository's extension (a prompt-lookup branch, not in the paper): "
                     f"{_tally(ext)}.</p>")
    if base:
        lines.append(f"<p>Our plain decoding loop against HF <code>generate</code>: {_tally(base)}.</p>")
    items = "".join(f"<li><span class='{v.css}'>{html.escape(v.status)}</span>: {html.escape(v.sentence())}</li>"
                    for v in verdicts)
    note = ("<p class='note'>Ratios of mean tokens/s (or tau) measured side by side in this run; "
            "\"HF generate\" is the fastest HF plain decoder; intervals are paired 95% bootstrap intervals "
            "over prompts.</p>")
    return (f"<div class='verdict' id='verdict'>{''.join(lines)}<details><summary>every goal</summary>"
            f"<ul>{items}</ul></details>{note}</div>")


def compact_goals(goals: pd.DataFrame) -> pd.DataFrame:
    """The goals table narrowed to what fits a page: the full one is ``performance_targets.csv``."""
    rows = []
    for v, row in zip(goal_verdicts(goals), goals.to_dict("records")):
        interval = "" if math.isnan(v.low) else f"{v.low:.2f}-{v.high:.2f}"
        rows.append({"goal": v.goal, "T": f"{v.temperature:g}", "method": row["method"],
                     "baseline": row["baseline"], "ratio": v.ratio, "95% interval": interval,
                     "target": v.target, "verdict": v.short})
    return pd.DataFrame(rows)


def is_smoke(profile_name: str | None, config: dict[str, Any] | None) -> bool:
    """The smoke profile, or any run whose target is a random tiny model built in code."""
    model = str(((config or {}).get("config") or {}).get("target", {}).get("model", ""))
    return profile_name == "smoke" or (config or {}).get("profile") == "smoke" or model.startswith("tiny:")


def table_html(df: pd.DataFrame, float_format: str = "{:.3g}") -> str:
    """A table in a box that scrolls sideways when it is wider than the page."""
    def cell(v: Any) -> str:
        if isinstance(v, numbers.Integral) and not isinstance(v, bool):
            return f"<td class='num'>{v}</td>"
        if isinstance(v, numbers.Real) and not isinstance(v, bool):
            text = "" if math.isnan(v) else f"{v:.0f}" if abs(v) >= 1000 else float_format.format(v)
            return f"<td class='num'>{text}</td>"
        return f"<td>{html.escape(str(v))}</td>"

    head = "".join(f"<th>{html.escape(str(c)).replace('_', '_<wbr>')}</th>" for c in df.columns)
    body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>"
                   for row in df.itertuples(index=False))
    return f"<div class='tablebox'><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>"


def _metadata_html(config: dict[str, Any] | None) -> str:
    if not config:
        return ""
    target = config.get("config", {}).get("target", {})
    meta = config.get("run_metadata", {})
    esc = lambda v: html.escape(str(v))  # noqa: E731 - local shorthand
    return (f"<p class='note'>Target <code>{esc(target.get('model'))}</code> ({esc(target.get('dtype'))}, "
            f"{esc(meta.get('device'))}) on {esc(meta.get('device_name'))}; run {esc(meta.get('date'))}; "
            f"commit {esc(meta.get('git_commit'))}; overrides "
            f"<code>{esc(json.dumps(config.get('overrides', {})))}</code>.</p>")


def scale_note(record: dict[str, Any]) -> str:
    """The report's line on the job's scale, from ``scale.json`` (:mod:`jakiro_lib.training.scale`): what was chosen and why."""
    c, b = record["chosen"], record["budget"]
    return (f"Scale: {c['num_conversations']:,} conversations x {c['epochs']} epochs, chosen by measurement "
            f"(data.scale=auto, {record.get('date', '?')}): caching and training expected {c['expected_minutes']:.1f} "
            f"min of the {b['caching_training_minutes']:.1f} left in the {b['main_job_minutes']}-minute main job after "
            f"the benchmark (about {b['benchmark_minutes']:.1f} min) and the measurement; {c['reason']}.")


def _scale_html(report_dir: Path) -> str:
    record = read_json(report_dir / SCALE_JSON)
    try:
        return f"<p class='note' id='scale'>{html.escape(scale_note(record))} <a href='{SCALE_JSON}'>{SCALE_JSON}</a></p>"
    except (KeyError, TypeError, ValueError):  # no record (a fixed scale) or one from another version
        return ""


def _figure_html(report_dir: Path) -> str:
    if not (report_dir / HEADLINE_FIGURE).is_file():
        return "<p class='note'>No headline figure yet (notebook 03 writes <code>speedup.png</code>).</p>"
    return (f"<figure id='headline-figure'><a href='{HEADLINE_FIGURE}'><img src='{HEADLINE_FIGURE}' "
            f"alt='speedup per method'></a><figcaption>Speedup per method over the fastest plain decoder of "
            f"this run (bars: 95% bootstrap interval over prompts), per temperature.</figcaption></figure>")


def _tables_html(summary: pd.DataFrame | None, goals: pd.DataFrame | None, levers: pd.DataFrame | None) -> list[str]:
    parts = []
    if summary is not None and not summary.empty:
        parts += ["<h2>Summary</h2>",
                  "<p class='note'>Mean over benchmarks; speedup = tokens/s over the fastest plain decoder of "
                  "the same run; tau = generated tokens / draft-verify cycles (bonus token included, vanilla = 1). "
                  "Published numbers on other hardware: <code>comparison_published.csv</code>.</p>",
                  table_html(summary)]
    if goals is not None and not goals.empty:
        parts += ["<h2>Performance goals</h2>",
                  "<p class='note'>All columns: <a href='performance_targets.csv'>performance_targets.csv</a>.</p>",
                  table_html(compact_goals(goals))]
    if levers is not None and not levers.empty:
        parts += ["<h2>What each speed lever bought</h2>",
                  "<p class='note'>Each lever measured with and without it in this run (speedup = without / "
                  "with for times, with / without for tokens/s).</p>", table_html(levers)]
    return parts


def _links_html(report_dir: Path, files: list[Path], pipeline: dict[str, Any] | None) -> list[str]:
    names = {p.name for p in files}
    stage_info = (pipeline or {}).get("stages", {})
    parts = ["<h2>Notebooks</h2><div class='tablebox'><table><thead><tr><th>stage</th><th>HTML</th>"
             "<th>executed notebook</th><th>last executed</th><th>seconds</th></tr></thead><tbody>"]
    stems = sorted({p.stem for p in files if p.suffix == ".ipynb"} |
                   {p.stem for p in files if p.suffix == ".html" and p.name != INDEX_NAME})
    for stem in stems:
        info = stage_info.get(stem, {})
        title = STAGE_TITLES.get(stem, "")
        link = lambda name: f"<a href='{name}'>{name}</a>" if name in names else ""  # noqa: E731
        parts.append(f"<tr><td>{html.escape(stem + (f' — {title}' if title else ''))}</td>"
                     f"<td>{link(stem + '.html')}</td><td>{link(stem + '.ipynb')}</td>"
                     f"<td>{html.escape(str(info.get('last_executed') or ''))}</td><td>{info.get('seconds') or ''}</td></tr>")
    parts.append("</tbody></table></div>")
    tables = [p for p in files if p.suffix in (".csv", ".json")]
    if tables:
        parts.append("<h2>Tables and configuration</h2><ul>")
        parts += [f"<li><a href='{html.escape(p.name)}'>{html.escape(p.name)}</a> "
                  f"<span class='note'>({p.stat().st_size:,} bytes)</span></li>" for p in tables]
        parts.append("</ul>")
    figures = [p for p in files if p.suffix == ".png"]
    if figures:
        parts.append("<h2>Figures</h2><div class='figs'>")
        parts += [f"<a href='{html.escape(p.name)}'><img src='{html.escape(p.name)}' alt='{html.escape(p.name)}'>"
                  f"<br>{html.escape(p.name)}</a>" for p in figures]
        parts.append("</div>")
    return parts


def write_front_page(report_dir: str | Path, *, title: str, profile_name: str | None = None,
                     summary: pd.DataFrame | None = None, goals: pd.DataFrame | None = None,
                     levers: pd.DataFrame | None = None) -> Path:
    """Write ``report_dir/index.html``: banner (smoke), verdict, headline figure, tables, links."""
    report_dir = Path(report_dir)
    files = sorted(p for p in report_dir.iterdir() if p.is_file() and not p.name.startswith(".")
                   and p.name != INDEX_NAME)
    config = read_json(report_dir / "run_config.json")
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'>"
             f"<meta name='viewport' content='width=device-width, initial-scale=1'>"
             f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    if is_smoke(profile_name, config):
        parts.append(f"<div class='banner' id='smoke-banner'>{html.escape(SMOKE_BANNER)}</div>")
    parts += [_metadata_html(config), _scale_html(report_dir), verdict_html(goals), _figure_html(report_dir)]
    parts += _tables_html(summary, goals, levers)
    parts += _links_html(report_dir, files, read_json(report_dir / "pipeline.json"))
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    parts.append(f"<p class='note'>Index written {stamp}. Regenerate with <code>python -m jakiro_lib pipeline "
                 f"--profile {html.escape(profile_name or report_dir.name)}</code>.</p></body></html>\n")
    out = report_dir / INDEX_NAME
    write_text(out, "\n".join(parts))
    return out
