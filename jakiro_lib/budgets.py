"""Turning ``tree.total_tokens="auto"`` into a number: the tree budget tuned on this machine, cached.

The cost model (:mod:`jakiro_lib.costmodel`) measures T(n) and picks the budget that maximises estimated
tokens/s; this module decides when to measure and keeps the results in ``run_dir/bench/tree_budgets.json``
(one entry per machine, target settings and runner; choices keyed by the draft weights' digest and the
tree settings), so that reruns, copied drafts and other target settings do not retune for nothing.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from . import costmodel
from .bench import format_prompt_ids
from .config import Profile
from .data import load_questions
from .draft import WEIGHTS_FILE, DraftModel
from .layout import RunLayout
from .methods import MethodSpec
from .utils import device_name, file_sha256, read_json, write_json

log = logging.getLogger(__name__)

TUNE_PROMPTS = 4  # MT-bench questions (from the end of the set) the tree budget is tuned on
TUNE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # up to the paper's 60-token trees (GPU)
# through the compiled runner each size is a compilation (22 s on a fresh H200, 2026-11-26): the sizes it
# compiles anyway, up to 32 (jakiro_lib.compiled.COMPILED_SIZES; larger trees run eagerly there)
COMPILED_TUNE_SIZES = (1, 2, 4, 8, 16, 32)


def draft_fingerprint(path: str | Path | None) -> Any:
    """The draft weights' size and content digest: records and tuned budgets stay valid when drafts are
    copied (to a GPU machine, say), and not when they are retrained."""
    if path is None:
        return None
    w = Path(path) / WEIGHTS_FILE
    if not w.is_file():
        return None
    st = w.stat()
    return [st.st_size, _file_digest(str(w), st.st_size, st.st_mtime_ns)]


@functools.lru_cache(maxsize=64)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    """The first 16 hex digits of a file's SHA-256, cached per size and mtime within a process."""
    return file_sha256(path)[:16]


def _tune_prompts(target: Any, n: int | None = None) -> list[Any]:
    """First turns of the LAST ``n`` MT-bench questions: small benchmark limits never include them."""
    questions = load_questions("mt_bench")[-(n or TUNE_PROMPTS):]
    return [format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}]) for q in questions]


def _machine(profile: Profile, target: Any) -> dict[str, Any]:
    return {"device": str(target.device), "device_name": device_name(target.device),
            "threads": torch.get_num_threads(), "target": dataclasses.asdict(profile.target)}


def _machine_key(machine: dict[str, Any], compiled: bool) -> dict[str, Any]:
    """This machine's key for the eager or the compiled target runner, as it reads back from JSON."""
    return json.loads(json.dumps({**machine, **({"compiled": True} if compiled else {})}, default=str))


def tune_sizes(compiled: bool) -> tuple[int, ...]:
    """The tree sizes T(n) is measured at, and the budgets tried (those from 2), for either runner."""
    return COMPILED_TUNE_SIZES if compiled else TUNE_SIZES


def _entry(entries: list[dict[str, Any]], key: dict[str, Any], target: Any, compiled: bool) -> dict[str, Any]:
    """The entry of ``key`` (created if missing), its T(n) measured."""
    found = next((e for e in entries if e.get("machine") == key), None)
    if found is None:
        found = {"machine": key, "target_costs_s": {}, "choices": {}}
        entries.append(found)
    sizes = tune_sizes(compiled)
    if not {str(n) for n in sizes} <= set(found["target_costs_s"]):
        t0 = time.perf_counter()
        costs = costmodel.measure_target_costs(target.model, sizes=sizes, static_compile=compiled)
        found["target_costs_s"] = {str(n): t for n, t in costs.items()}
        log.info("tree budget: target T(n) measured in %.1f s%s", time.perf_counter() - t0,
                 " (compiled)" if compiled else "")
    return found


def _choice_key(spec: MethodSpec) -> str:
    """What a tuned budget depends on besides the machine: the draft's weights and the tree settings."""
    tree = {k: v for k, v in dataclasses.asdict(spec.tree).items()
            if k != "total_tokens" and not k.startswith("lookup_")}
    return json.dumps({"weights": draft_fingerprint(spec.draft), "tree": tree}, sort_keys=True, default=str)


def _saved_entries(path: Path) -> list[dict[str, Any]]:
    """The entries of a ``tree_budgets.json``; [] when there is none, or (with a warning) when what is there is
    not this cache's shape: it is measured again and rewritten."""
    saved = read_json(path)
    if saved is None:
        return []
    entries = saved.get("machines", [saved] if "machine" in saved else None) if isinstance(saved, dict) else None
    if isinstance(entries, list) and all(_valid_entry(e) for e in entries):  # older files: one entry
        return entries
    log.warning("%s is not a tree-budget cache (another shape); measuring again and rewriting it", path)
    return []


def _valid_entry(e: Any) -> bool:
    return (isinstance(e, dict) and isinstance(e.get("machine"), dict)
            and isinstance(costs := e.get("target_costs_s"), dict)
            and all(str(n).isdigit() and isinstance(t, (int, float)) for n, t in costs.items())
            and isinstance(choices := e.get("choices"), dict)
            and all(isinstance(c, dict) and isinstance(c.get("best"), int) for c in choices.values()))


def resolve_tree_budgets(profile: Profile, run_dir: Path, methods: dict[str, Any], target: Any, *,
                         force: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Methods with ``tree.total_tokens="auto"`` get the budget that maximises estimated tokens/s here.

    The target's T(n) is measured once per machine and target settings (dtype, fast paths) and cached
    with every choice in ``run_dir/bench/tree_budgets.json`` (one entry per machine, target settings and
    runner: eager, or compiled for methods with ``static_compile``; choices keyed by draft weights and tree
    settings), so reruns, also after a run with other target settings, do not retune. ``force`` remeasures
    and retunes this machine's entries.
    Returns (methods with numeric budgets, the measurements and choices).
    """
    auto = [k for k, m in methods.items() if m.kind == "spec" and m.draft and m.tree.total_tokens == "auto"]
    if not auto:
        return methods, {}
    path = RunLayout(Path(run_dir)).tree_budgets
    machine = _machine(profile, target)
    entries = _saved_entries(path)
    if force:
        keys = [_machine_key(machine, False), _machine_key(machine, True)]
        entries = [e for e in entries if e.get("machine") not in keys]
    prompts = None
    choices: dict[str, Any] = {}
    costs_by_runner: dict[bool, dict[int, float]] = {}
    for name in auto:
        spec = methods[name]
        cache = _entry(entries, _machine_key(machine, spec.static_compile), target, spec.static_compile)
        costs = costs_by_runner[spec.static_compile] = {int(n): t for n, t in cache["target_costs_s"].items()}
        key = _choice_key(spec)
        if key not in cache["choices"]:
            prompts = prompts if prompts is not None else _tune_prompts(target)
            t0 = time.perf_counter()
            draft = DraftModel.load(spec.draft, target.model)
            tuned = costmodel.tune_total_tokens(target, draft, spec.tree, prompts, target_costs=costs,
                                                candidates=[n for n in tune_sizes(spec.static_compile) if n >= 2])
            tuned["seconds"] = round(time.perf_counter() - t0, 1)
            cache["choices"][key] = tuned
            log.info("tree budget for %s: %d tokens (tuned in %.1f s)", name, tuned["best"], tuned["seconds"])
        choices[name] = cache["choices"][key]
    write_json(path, {"machines": entries})
    out = dict(methods)
    for name in auto:
        m = methods[name]
        out[name] = dataclasses.replace(m, tree=dataclasses.replace(m.tree, total_tokens=choices[name]["best"]))
    info = {f"{'compiled_' if compiled else ''}target_costs_s": c for compiled, c in costs_by_runner.items()}
    return out, {**info, "choices": choices}
