"""Turning ``tree.total_tokens="auto"`` into a number: the tree budget tuned on this machine, cached. The cost model
(:mod:`jakiro_lib.measure.costmodel`) measures T(n) and proposes a budget; this module decides when to measure and on
what (:func:`tuning_prompts`), keeps the estimate only where it runs faster than the fixed tree, and caches T(n) and the
choices in ``run_dir/bench/tree_budgets.json`` (docs/DESIGN.md section 11), each with other processes' CPU use while it
timed (a warning above :data:`BUSY_CORES`)."""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from ..busy import family_ticks
from ..config import SPEC, Profile, TreeConfig
from ..data.chat import format_prompt_ids
from ..data.conversations import DataError, load_conversations
from ..data.dataset import _stable_hash, split_indices
from ..decoding.methods import MethodSpec
from ..files import file_sha256, read_json, write_json
from ..layout import RunLayout
from ..machine import device_name
from ..models import kernels
from ..models.draft import WEIGHTS_FILE
from ..models.target import compiles_cycle
from . import costmodel

log = logging.getLogger(__name__)

TUNE_PROMPTS = 4  # held-out ShareGPT first turns the tree budget is tuned on (tuning_prompts)
# A first turn's text is cut to this many tokens (at most a quarter of target.max_context): ShareGPT's first
# turns run from a line to pasted documents, and the benchmark's prompts are questions of a few lines.
TUNE_PROMPT_TOKENS = 256
PAPER_TREE_TOKENS = 8  # the fixed tree where a profile's own total_tokens is "auto" (EAGLE-2's CPU-sized tree here)
# The tuner's version in a choice's key: choices made by an earlier tuner are not reused.
TUNER_VERSION = 5
# Other processes' CPU use, in cores beyond those this process leaves idle, above which the tuner warns
BUSY_CORES = 0.25
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
TUNE_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # up to the paper's 60-token trees (GPU)
# Budgets the check runs outright for a method recorded as CUDA graphs: the estimate's eager timings are
# launch-bound on a GPU (docs/DESIGN.md section 11), and a captured budget costs a few replays, no compilation.
CAPTURED_SIZES = (4, 8, 16, 32, 64)


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


def tuning_prompts(profile: Profile, target: Any, exclude: Iterable[str] = ()) -> tuple[list[Any], dict[str, Any]]:
    """The prompts the tree budget is tuned on, and what they are (recorded with every choice and in
    ``bench_config.json``): first user turns of :data:`TUNE_PROMPTS` conversations of the profile's training source that
    its drafts never train on (the held-out split, docs/DESIGN.md section 11; with ``data.heldout_fraction`` 0 those
    past ``data.num_conversations``), cut to :data:`TUNE_PROMPT_TOKENS` tokens (at most a quarter of the context).
    ``exclude``: the benchmark's prompt texts, passed over."""
    d = profile.data
    n = d.num_conversations
    skip = {t.strip() for t in exclude}
    try:
        if d.heldout_fraction > 0:  # split as training splits: over the conversations there are
            convs = load_conversations(d.source, path=d.path, limit=n)
            held = split_indices(range(len(convs)), "heldout", d.heldout_fraction)
            order, split = sorted(held, key=_stable_hash), "heldout"
        else:
            convs = load_conversations(d.source, path=d.path, limit=n + TUNE_PROMPTS + len(skip))
            order, split = list(range(n, len(convs))), "after the training range"
    except DataError as exc:
        raise DataError(f"the tree budget is tuned on conversations of data.source={d.source!r} the drafts did not "
                        f"train on, and those cannot be loaded: {exc}") from exc
    cap = min(TUNE_PROMPT_TOKENS, target.config.max_context // 4)
    prompts, picked = [], []
    for i in order:
        text = convs[i].messages[0]["content"]
        if text.strip() in skip:
            continue
        ids = target.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > cap:
            text = target.tokenizer.decode(ids[:cap], skip_special_tokens=True)
        prompt = format_prompt_ids(target, [{"role": "user", "content": text}])
        prompts.append(prompt)
        picked.append({"index": i, "id": convs[i].id, "text_tokens": min(len(ids), cap), "cut": len(ids) > cap,
                       "prompt_tokens": prompt.numel()})
        if len(prompts) == TUNE_PROMPTS:
            break
    if not prompts:
        raise DataError(f"no conversation of data.source={d.source!r} is left to tune the tree budget on: the drafts "
                        f"train on all {len(convs)} (data.heldout_fraction={d.heldout_fraction:g}) or the benchmark "
                        "holds the others")
    return prompts, {"source": d.source, "path": d.path, "split": split, "heldout_fraction": d.heldout_fraction,
                     "num_conversations": n, "conversations_loaded": len(convs), "conversations": picked,
                     "max_text_tokens": cap,
                     "excluded_benchmark_prompts": len(skip)}


def fixed_tree(tree: TreeConfig, study_tree: TreeConfig) -> TreeConfig:
    """The fixed tree a tuned ``tree`` must beat: each of its "auto" settings as the study's tree has it, else
    :data:`PAPER_TREE_TOKENS` tokens and :class:`TreeConfig`'s depth and width."""
    default = dataclasses.replace(TreeConfig(), total_tokens=PAPER_TREE_TOKENS)

    def fixed(name: str) -> int:
        return next(v for v in (getattr(tree, name), getattr(study_tree, name), getattr(default, name)) if v != "auto")

    return dataclasses.replace(tree, **{name: fixed(name) for name in ("depth", "top_k", "total_tokens")})


def _cpu_snapshot() -> tuple[float, int, int] | None:
    """(seconds, CPU ticks of the whole machine, CPU ticks of this process and those it started: the compiled tree's
    worker pool) from ``/proc``; None elsewhere."""
    try:
        machine = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        busy = sum(int(machine[i]) for i in (0, 1, 2, 5, 6, 7))  # user, nice, system, irq, softirq, steal
        return time.perf_counter(), busy, family_ticks()
    except (OSError, ValueError, IndexError):
        return None


class _OthersLoad:
    """Other processes' mean CPU use, in cores, over a ``with`` block (``cores``; None where unknown), and a
    warning where it exceeds the cores this process leaves idle by :data:`BUSY_CORES` (``JAKIRO_NO_BUSY_CHECK``,
    the CLI's switch for a machine known to be shared, silences it; the record stays)."""

    def __init__(self, what: str) -> None:
        self.what, self.cores = what, None

    def __enter__(self) -> "_OthersLoad":
        self.before = _cpu_snapshot()
        return self

    def __exit__(self, *exc: Any) -> None:
        after = _cpu_snapshot()
        if self.before is None or after is None or after[0] <= self.before[0]:
            return
        others = (after[1] - self.before[1]) - (after[2] - self.before[2])
        self.cores = round(max(others, 0) / CLOCK_TICKS / (after[0] - self.before[0]), 2)
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        spare = max(cpus - torch.get_num_threads(), 0)
        if exc[0] is None and self.cores > spare + BUSY_CORES and not os.environ.get("JAKIRO_NO_BUSY_CHECK"):
            log.warning("tree budget: other processes used %.1f cores of %d while %s was timed; the timings, and "
                        "the budget chosen from them, may be off: retune on a quiet machine (force)",
                        self.cores, cpus, self.what)


def _machine(profile: Profile, target: Any) -> dict[str, Any]:
    """What the target's T(n) depends on: the device, its threads, the target's settings, the GEMM kernel the
    load-time probe chose for them, the first row count it serves (from one row the streaming GEMM also runs a
    decoding step's layers in one call) and where it prefetches streamed weights, and the build of the package's
    kernels: another of any, another tuning."""
    gemm = kernels.gemm_choice(target.model)
    return {"device": str(target.device), "device_name": device_name(target.device),
            "threads": torch.get_num_threads(), "target": dataclasses.asdict(profile.target),
            "gemm": gemm["backend"] if gemm is not None else None,
            "gemm_from": gemm["min_rows"] if gemm is not None else None,
            "prefetch": gemm["prefetch"] if gemm is not None else None,
            "kernels": kernels.stream_build_name() if kernels.stream_gemm_available() else None}


def _machine_key(machine: dict[str, Any]) -> dict[str, Any]:
    """This machine's key, as it reads back from JSON; ``timing`` "min": T(n) is each size's fastest round (an
    earlier tuner's median timings are not reused). T(n) is eager: the measured check runs the method's engine."""
    return json.loads(json.dumps({**machine, "timing": "min"}, default=str))


def _entry(entries: list[dict[str, Any]], key: dict[str, Any], target: Any) -> dict[str, Any]:
    """The entry of ``key`` (created if missing), its T(n) measured."""
    found = next((e for e in entries if e.get("machine") == key), None)
    if found is None:
        found = {"machine": key, "target_costs_s": {}, "choices": {}}
        entries.append(found)
    if not {str(n) for n in TUNE_SIZES} <= set(found["target_costs_s"]):
        t0 = time.perf_counter()
        with _OthersLoad("the target's T(n)") as load:
            costs = costmodel.measure_target_costs(target.model, sizes=TUNE_SIZES, stat="min")
        found["target_costs_s"] = {str(n): t for n, t in costs.items()}
        found["others_cpu_cores"] = load.cores
        log.info("tree budget: target T(n) measured in %.1f s", time.perf_counter() - t0)
    return found


def _choice_key(spec: MethodSpec, capture: str, prompts: dict[str, Any], fixed: TreeConfig,
                measured: Sequence[int] = ()) -> str:
    """What a tuned budget depends on besides the machine: the draft's weights, the tree settings, how the engine
    runs the measured check (``capture``), the conversations it is tuned on, the fixed tree it must beat, the
    budgets it runs outright (where any) and the tuner's version."""
    tree = {k: v for k, v in dataclasses.asdict(spec.tree).items()
            if k != "total_tokens" and not k.startswith("lookup_")}
    tuned_on = [prompts["source"], prompts["path"], [c["id"] for c in prompts["conversations"]]]
    key = {"weights": draft_fingerprint(spec.draft), "tree": tree, "capture": capture, "prompts": tuned_on,
           "fixed": [fixed.depth, fixed.top_k, fixed.total_tokens], "tuner": TUNER_VERSION}
    if spec.draft_dtype is not None:  # a draft in another precision costs otherwise
        key["draft_dtype"] = spec.draft_dtype
    return json.dumps({**key, "measured": list(measured)} if measured else key, sort_keys=True, default=str)


def measured_sizes(capture: str) -> tuple[int, ...]:
    """:data:`CAPTURED_SIZES` where the engine records its cycles as CUDA graphs (``capture`` "graphs"), else none."""
    return CAPTURED_SIZES if capture == "graphs" else ()


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
                         force: bool = False, exclude: Iterable[str] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """Methods whose tree has "auto" settings (:attr:`TreeConfig.tuned`) get them tuned (budget, depth, width), unless
    the fixed tree (:func:`fixed_tree`) is measured as fast. T(n) is measured once per machine and target settings, each choice
    keyed by what it depends on (:func:`_choice_key`), so reruns do not retune; ``force`` retunes this machine's entry.
    ``exclude``: the benchmark's prompt texts. Returns (methods with numeric budgets, the measurements, choices and
    ``tuning_prompts``)."""
    auto = [k for k, m in methods.items() if m.kind == SPEC and m.draft and m.tree.tuned]
    if not auto:
        return methods, {}
    path = RunLayout(Path(run_dir)).tree_budgets
    machine = _machine(profile, target)
    entries = _saved_entries(path)
    if force:
        entries = [e for e in entries if e.get("machine") != _machine_key(machine)]
    prompts, tuned_on = tuning_prompts(profile, target, exclude)
    choices: dict[str, Any] = {}
    cache = _entry(entries, _machine_key(machine), target)
    costs = {int(n): t for n, t in cache["target_costs_s"].items()}
    for name in auto:
        spec = methods[name]
        capture = spec.capture(target)
        sizes = measured_sizes(capture)
        fixed = fixed_tree(spec.tree, profile.tree)
        key = _choice_key(spec, capture, tuned_on, fixed, sizes)
        if key not in cache["choices"]:
            t0 = time.perf_counter()
            draft = spec.load_draft(target)
            with _OthersLoad(f"the tree budget of {name}") as load:
                budget = spec.tree.total_tokens  # a fixed budget is its own only candidate
                candidates = [n for n in TUNE_SIZES if n >= 2] if budget == "auto" else [budget]
                tuned = costmodel.tune_tree(target, draft, spec.tree, prompts, target_costs=costs, reference=fixed,
                                            candidates=candidates, compile=compiles_cycle(capture), measure_sizes=sizes)
            tuned.update(seconds=round(time.perf_counter() - t0, 1), others_cpu_cores=load.cores, prompts=tuned_on)
            cache["choices"][key] = tuned
            log.info("tree for %s: %s (estimate %s, fixed tree %s; tuned in %.1f s)", name,
                     costmodel.shape_key(tuned["depth"], tuned["top_k"], tuned["best"]), tuned.get("estimated"),
                     tuned.get("fixed"), tuned["seconds"])
        choices[name] = cache["choices"][key]
    write_json(path, {"machines": entries})
    out = dict(methods)
    for name in auto:
        m, c = methods[name], choices[name]
        tuned = {"total_tokens": c["best"], "depth": c["depth"], "top_k": c["top_k"]}
        out[name] = dataclasses.replace(m, tree=dataclasses.replace(
            m.tree, **{k: v for k, v in tuned.items() if getattr(m.tree, k) == "auto"}))
    return out, {"target_costs_s": costs, "choices": choices, "tuning_prompts": tuned_on}
