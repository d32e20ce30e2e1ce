"""Profiles, the study's directories and the notebooks' setup: what every stage starts from. :func:`setup` resolves a
profile (name + dotted overrides), ``run_dir`` for heavy artifacts (``$JAKIRO_RUNS/<profile>``, default
``runs/<profile>``; :class:`~jakiro_lib.layout.RunLayout`) and ``report_dir`` for what is published
(``reports/<profile>``); :func:`notebook_setup` is the notebooks' first cell."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import transformers

from ..config import ConfigError, Profile
from ..profiles import SMOKE_BANNER, get_profile, override, profile_from_dict
from ..layout import RunLayout
from ..models.target import load_target
from ..files import REPO_ROOT, read_json, write_json
from ..machine import run_metadata
from ..runlock import hold_run_lock

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(name)s: %(message)s"
TRUE, FALSE = ("true", "yes", "1"), ("false", "no", "0")  # a notebook's flag parameter given as text


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


def write_resolved(path: Path, profile: Profile, overrides: dict[str, Any]) -> None:
    """The run's resolved profile (and the overrides that made it) as the JSON the notebooks start from."""
    write_json(path, {"profile": profile.to_dict(), "overrides": overrides})


def read_resolved(path: str | Path, overrides: dict[str, Any]) -> tuple[Profile, dict[str, Any]]:
    """The profile and overrides :func:`write_resolved` wrote; a :class:`ConfigError` where ``overrides`` are given
    too (a resolved profile is applied as it is) or the file is not one."""
    if overrides:
        raise ConfigError(f"profile {path} is resolved already: give its overrides to the command that wrote it")
    data = read_json(path)
    if not isinstance(data, dict) or "profile" not in data:
        raise ConfigError(f"profile {path} is not a resolved profile's JSON (a run directory's profile.json)")
    return profile_from_dict(data["profile"]), dict(data.get("overrides") or {})


def _run_dir(profile: Profile, run_dir: str | Path | None) -> Path:
    return Path(run_dir).expanduser().resolve() if run_dir is not None else default_run_dir(profile.name)


@dataclass
class StudyContext:
    """What a notebook works with: the resolved profile and its directories."""

    profile: Profile
    overrides: dict[str, Any] = field(default_factory=dict)
    run_dir: Path = Path()
    report_dir: Path = Path()
    force: bool = False  # the notebooks' ``force`` parameter: retrain drafts, rerun benchmarks

    @classmethod
    def at(cls, profile: Profile, run_dir: str | Path | None = None) -> StudyContext:
        """``profile`` over ``run_dir`` (None: its default), with no report directory: what a command works with."""
        return cls(profile=profile, run_dir=_run_dir(profile, run_dir))

    @property
    def layout(self) -> RunLayout:
        """Every path under ``run_dir``."""
        return RunLayout(self.run_dir)

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
    """Resolve the notebook parameters (``profile``: a name, or the path of a run's resolved ``profile.json``, which
    takes no overrides); create the directories; write ``report_dir/run_config.json``.

    ``JAKIRO_THREADS`` (env) sets torch's intra-op thread count (tiny targets run faster on one).
    """
    if isinstance(profile, str) and profile.endswith(".json"):
        prof, overrides = read_resolved(profile, overrides or {})
    else:
        prof = resolve_profile(profile, overrides)
    threads = os.environ.get("JAKIRO_THREADS")
    if threads:
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
        write_run_config(ctx)
    return ctx


def write_run_config(ctx: StudyContext) -> None:
    """``report_dir/run_config.json``: the profile, its overrides and settings, the directories, the machine."""
    write_json(ctx.report_dir / "run_config.json", {
        "profile": ctx.profile.name, "overrides": ctx.overrides, "config": ctx.profile.to_dict(),
        "run_dir": str(ctx.run_dir), "report_dir": str(ctx.report_dir),
        "run_metadata": run_metadata(ctx.profile.target.device),
    })


_TARGETS: dict[str, Any] = {}


def get_target(profile: Profile | StudyContext) -> Any:
    """The profile's target, loaded once per process (notebooks call several steps with it)."""
    prof = profile.profile if isinstance(profile, StudyContext) else profile
    key = json.dumps(dataclasses.asdict(prof.target), sort_keys=True)
    if key not in _TARGETS:
        _TARGETS.clear()  # one target at a time: they can be large
        t0 = time.perf_counter()
        _TARGETS[key] = load_target(prof.target)
        log.info("loaded target %s in %.1f s", prof.target.model, time.perf_counter() - t0)
    return _TARGETS[key]


def configure_logging(level: int = logging.INFO) -> None:
    """Log lines to stdout: an executed notebook shows stderr in red, which reads as an error."""
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    logging.getLogger("httpx").setLevel(logging.WARNING)


def quiet_libraries() -> None:
    """No library noise on stderr, which an executed notebook shows in red as if it were an error: HF's
    weight-loading bars, and transformers' deprecation of the ``past_key_values`` keyword, which its own
    models and ``generate`` still take in the versions this project supports."""
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=r".*`past_key_values` is deprecated", category=FutureWarning)


def notebook_setup(profile: Any = "default", overrides: Any = None, *, run_dir: Any = None, report_dir: Any = None,
                   force: Any = False, describe: bool = False) -> StudyContext:
    """The notebooks' first cell: parameters checked (:func:`notebook_parameters`), logging to stdout, display options,
    :func:`setup`, the run and report directories' lock held for the kernel's life
    (:func:`~jakiro_lib.runlock.hold_run_lock`; docs/DESIGN.md section 11) and a header naming the profile and
    directories (on the smoke profile, a banner). ``describe``: also show the profile's settings. Returns the
    :class:`StudyContext`, whose ``force`` the notebooks pass on."""
    from IPython.display import Markdown, display  # only notebooks call this; IPython comes with Jupyter

    params = notebook_parameters(profile, overrides, run_dir, report_dir, force)
    quiet_libraries()
    configure_logging()
    pd.set_option("display.precision", 3)
    pd.set_option("display.max_colwidth", 80)
    ctx = setup(params["profile"], params["overrides"], run_dir=params["run_dir"], report_dir=params["report_dir"],
                write_config=False)
    ctx.force = params["force"]
    hold_run_lock(ctx.run_dir, ctx.report_dir, command=f"a notebook's kernel, profile {ctx.profile.name}")
    write_run_config(ctx)
    if ctx.profile.name == "smoke":
        display(Markdown(f"> **{SMOKE_BANNER}**"))
    display(Markdown(f"**Profile `{ctx.profile.name}`**, overrides `{ctx.overrides}`  \n"
                     f"run dir `{ctx.run_dir}`  \nreport dir `{ctx.report_dir}`"))
    if describe:
        display(ctx.describe())
    return ctx


def notebook_parameters(profile: Any, overrides: Any, run_dir: Any, report_dir: Any, force: Any) -> dict[str, Any]:
    """The notebooks' papermill parameters checked and coerced, by name; a :class:`ConfigError` naming the first
    bad one. papermill's ``-p`` hands over strings (``-p force false`` is "false", ``-p overrides '{...}'`` text,
    ``-p run_dir 123`` a number): ``force`` is a bool or true/false, yes/no, 1/0; ``overrides`` a dict of dotted
    keys or its JSON or YAML text; ``run_dir`` and ``report_dir`` a path or None (the default); ``profile`` a
    profile's name, a resolved ``profile.json`` (the pipeline's) or a :class:`Profile`."""
    if not (isinstance(profile, Profile) or isinstance(profile, str) and profile.strip()):
        raise ConfigError(f"notebook parameter profile must be a profile name, got {profile!r}")
    return {"profile": profile, "overrides": _mapping("overrides", overrides), "run_dir": _path("run_dir", run_dir),
            "report_dir": _path("report_dir", report_dir), "force": _flag("force", force)}


def _flag(name: str, value: Any) -> bool:
    text = str(value).strip().lower() if isinstance(value, (bool, int, str)) else None
    if text in TRUE + FALSE:
        return text in TRUE
    raise ConfigError(f"notebook parameter {name} must be true or false (or yes/no, 1/0), got {value!r}")


def _path(name: str, value: Any) -> Path | None:
    if value is None or isinstance(value, os.PathLike) or isinstance(value, str) and value.strip():
        return None if value is None else Path(value)
    raise ConfigError(f"notebook parameter {name} must be a path (a string; None: the default), got {value!r}")


def _mapping(name: str, value: Any) -> dict[str, Any]:
    """A dict of dotted keys from a dict or its JSON or YAML text (empty text or None: no overrides)."""
    if isinstance(value, str):
        value = _parse_mapping(name, value)
    if value is None:
        return {}
    if not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
        raise ConfigError(f"notebook parameter {name} must be a mapping of dotted keys to values (a dict, or its "
                          f"JSON or YAML text, e.g. '{{\"bench.limit\": 2}}'), got {value!r}")
    return dict(value)


def _parse_mapping(name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    import yaml  # papermill's own dependency: there wherever notebooks run

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"notebook parameter {name} is neither JSON nor YAML ({' '.join(str(exc).split())}): "
                          f"{text!r}") from None
