"""What a study folder's records were made under (``study_stamp.json``), and whether a run may add to them: a stamp
holds the settings every record shares and the scope they cover (per run label its method and draft, per question the
sha256 of its turns, the temperatures); :func:`claim_records` keeps, sets aside or refuses (docs/usage.md)."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any, Sequence

from ..config import Profile
from ..files import free_name, read_json, write_json
from ..layout import RECORDS_FILE, STALE_RECORDS_FILE, STUDY_STAMP
from ..measure.bench import question_sha
from ..measure.budgets import draft_fingerprint
from ..decoding.methods import MethodSpec
from ..measure.methods import portable

log = logging.getLogger(__name__)

SCOPES = ("methods", "drafts", "questions", "temperatures")  # what the records cover, merged run after run
SELECTION = ("benchmarks", "limit", "skip", "temperatures")  # bench settings that choose what runs, not how


class RecordsError(ValueError):
    """A run that would have to displace a study's records it does not replace (a narrower run)."""


def make_stamp(study: str, methods: dict[str, MethodSpec], prof: Profile, temps: Sequence[float],
               questions: Sequence[Any]) -> dict[str, Any]:
    """What the records depend on, as it reads back from JSON (drafts by name and weights' digest)."""
    bench = {k: v for k, v in dataclasses.asdict(prof.bench).items() if k not in SELECTION}
    return json.loads(json.dumps({
        "study": study, "methods": {k: portable(v) for k, v in methods.items()},
        "drafts": {k: draft_fingerprint(v.draft) for k, v in methods.items()},
        "bench": bench, "target": dataclasses.asdict(prof.target), "temperatures": list(temps),
        "questions": [[q.benchmark, str(q.question_id), question_sha(q)] for q in questions],
    }, default=str))


def _questions(stamp: dict[str, Any]) -> dict[tuple[str, str], str | None]:
    """(benchmark, id) -> the sha256 of its turns, None for a stamp written before they were recorded."""
    return {(q[0], q[1]): (q[2] if len(q) > 2 else None) for q in stamp.get("questions", [])}


def _settings(stamp: dict[str, Any]) -> dict[str, Any]:
    """The stamp less its scopes and less the bench settings that only choose what runs."""
    out = {k: v for k, v in stamp.items() if k not in SCOPES}
    out["bench"] = {k: v for k, v in out.get("bench", {}).items() if k not in SELECTION}
    return out


def conflicts(old: dict[str, Any], new: dict[str, Any], *, unhashed_ok: bool) -> list[str]:
    """What keeps records made under stamp ``old`` from being valid under ``new`` (empty: they are valid).
    ``unhashed_ok``: an old stamp without question texts is taken to hold the texts asked now (built-in
    benchmarks, whose texts are the package's)."""
    a, b = _settings(old), _settings(new)
    why = [f"{key}.{k}".rstrip(".") for key in sorted({*a, *b}) for k in sorted(_differ(a.get(key), b.get(key)))]
    why += [f"{label}'s {'settings' if key == 'methods' else 'draft'}" for key in ("methods", "drafts")
            for label, value in old.get(key, {}).items() if label in new.get(key, {}) and new[key][label] != value]
    qa, qb = _questions(old), _questions(new)
    shared = [k for k in qa if k in qb]
    if any(qa[k] is None for k in shared) and not unhashed_ok:
        why.append("the questions' texts (not recorded then)")
    why += [f"the text of question {k[1]!r} of {k[0]!r}" for k in shared if qa[k] is not None and qa[k] != qb[k]]
    return why


def _differ(a: Any, b: Any) -> list[str]:
    """The keys whose values differ between two settings dicts ([""] for two values that are not dicts)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for k in {*a, *b} if a.get(k) != b.get(k)]
    return [] if a == b else [""]


def narrower(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """Whether records under ``old`` cover something a run under ``new`` does not (a method, question or
    temperature): such a run is part of what the records hold."""
    return (bool(set(old.get("methods", {})) - set(new.get("methods", {})))
            or bool(set(_questions(old)) - set(_questions(new)))
            or bool(set(old.get("temperatures", [])) - set(new.get("temperatures", []))))


def merged(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """The stamp of records made under ``old`` and then ``new`` (valid under both): the union of their scopes."""
    questions = {**_questions(old), **_questions(new)}
    temps = [*old.get("temperatures", []), *(t for t in new["temperatures"] if t not in old.get("temperatures", []))]
    return {**new, "methods": {**old.get("methods", {}), **new["methods"]},
            "drafts": {**old.get("drafts", {}), **new["drafts"]}, "temperatures": temps,
            "questions": [[b, i, sha] for (b, i), sha in questions.items()]}


def claim_records(out_dir: Path, stamp: dict[str, Any], study: str, *, force: bool, unhashed_ok: bool) -> None:
    """Make ``out_dir``'s records valid for a run under ``stamp``: keep them (the stamp grows to cover both),
    or move them aside to ``records.stale[.N].jsonl`` (said) where the settings changed or ``force``; a
    narrower run of other settings raises :class:`RecordsError`, nothing touched. Writes the stamp."""
    records, old = out_dir / RECORDS_FILE, read_json(out_dir / STUDY_STAMP)
    if records.exists() and not force:
        why = ["no stamp says how they were made"] if old is None else conflicts(old, stamp, unhashed_ok=unhashed_ok)
        if not why:
            write_json(out_dir / STUDY_STAMP, merged(old, stamp))
            return
        if old is not None and narrower(old, stamp):
            raise RecordsError(f"{out_dir} holds study {study!r}'s records of more methods, questions or "
                               f"temperatures than this run, made with other {_listed(why)}; a run of part of them "
                               "does not replace them: run all of them, write elsewhere (--out), or force")
    if records.exists():
        aside = free_name(out_dir / STALE_RECORDS_FILE)
        log.info("study %s: %s; old records moved to %s", study,
                 "forced" if force else f"other {_listed(why)}", aside.name)
        os.replace(records, aside)
        if (out_dir / STUDY_STAMP).is_file():
            os.replace(out_dir / STUDY_STAMP, aside.with_suffix(".stamp.json"))
    write_json(out_dir / STUDY_STAMP, stamp)


def _listed(why: list[str], most: int = 3) -> str:
    return ", ".join(why[:most]) + (f" and {len(why) - most} more" if len(why) > most else "")
