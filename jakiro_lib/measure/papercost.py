"""Paper scale by simulation: the paper's methods' cycle costs on a Vicuna-7B-shaped target with random weights,
and the speedups the paper's acceptance lengths would give at those costs (docs/usage.md, "Paper scale by simulation").

The static engine's shapes are fixed, so random weights cost what trained ones would; the acceptance is not measured.
Writes ``tn.csv`` (T(n), eager and captured), ``cycles.csv`` (ms per cycle, modelled speedup) and ``papercost.json``.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import pandas as pd
import torch
from transformers import PreTrainedModel

from ..config import DraftConfig, TreeConfig
from ..decoding.compiled import CapturedStep, compiled_cache_len
from ..decoding.result import GenerationResult
from ..decoding.runner import TargetRunner
from ..decoding.static import static_generate
from ..decoding.static_tree import ancestor_mask
from ..files import write_json, write_table
from ..machine import run_metadata
from ..models.target import _dtype, set_capture
from ..profiles import get_profile
from .costmodel import median_seconds
from .methods import MAIN, RELEASED, Method
from .random_models import check_device, random_draft, random_target, shape_config

TREE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 60, 64)
PAPER_PROFILE = "vicuna-7b"  # the paper-scale profile: its tree (depth 6, top-10, 60 tokens) and its drafts
# The methods timed: EAGLE-2, Jakiro, Jakiro + CEPD (the paper's hybrid step: ar_steps = depth - 2) from the
# main study, and the authors' released configuration (coupled mixture + CEPD)
METHOD_NAMES = ("eagle2", "jakiro", "jakiro_cepd", RELEASED.name)

# The paper's measured acceptance lengths and speedups at T=0 (docs/DESIGN.md section 8, study.published). Each
# Jakiro row gets Jakiro's numbers: the paper reports one Jakiro.
PAPER: dict[str, dict[str, float]] = {"eagle2": {"tau": 4.68, "speedup": 2.73},
                                      "jakiro": {"tau": 4.69, "speedup": 2.85}}
PAPER_SOURCE = ("Jakiro (arXiv 2502.06282), authors' A40 logs recomputed: Vicuna-7B, T=0, mean over MT-bench, "
                "HumanEval, GSM8K, Alpaca, CNN/DM, NQ; tau = tokens / (cycles - 1)")
SPEEDUP_BASIS = "model: tau_paper x ms_per_token_plain / ms_per_cycle (acceptance not measured)"
TN_COLUMNS = ("n", "eager_ms", "captured_ms")
CYCLE_COLUMNS = ("method", "draft", "tree", "cycles", "ms_per_cycle", "ms_per_token_plain", "tau_paper",
                 "modelled_speedup", "paper_speedup", "speedup_basis")


def modelled_speedup(tau: float, ms_per_token_plain: float, ms_per_cycle: float) -> float:
    """The speedup ``tau`` tokens per cycle would give at these costs: tau x plain ms per token / ms per cycle."""
    if not (ms_per_cycle > 0 and ms_per_token_plain > 0):
        return math.nan
    return tau * ms_per_token_plain / ms_per_cycle


def paper_methods(tree: TreeConfig | None = None) -> list[tuple[Method, TreeConfig, DraftConfig]]:
    """:data:`METHOD_NAMES` from the method registry on ``tree`` (default: the paper profile's), with their drafts'
    configurations (the paper profile's: full vocabulary)."""
    profile = get_profile(PAPER_PROFILE)
    tree = tree or profile.tree
    registry = {m.name: m.on_drafts(profile.bench.eagle2_draft, profile.bench.jakiro_draft) for m in (*MAIN, RELEASED)}
    out = []
    for name in METHOD_NAMES:
        m = registry[name]
        out.append((m, m.spec(tree, ".", tuned=False).tree, profile.drafts[m.draft]))
    return out


def _tree_label(tree: TreeConfig) -> str:
    parts = [f"depth={tree.depth}", f"top_k={tree.top_k}", f"total_tokens={tree.total_tokens}"]
    if tree.decoupled:
        parts.append("decoupled")
    if tree.ar_steps is not None:
        parts.append(f"ar_steps={tree.ar_steps}")
    return ",".join(parts)


def _replay_eagerly(step: Callable[..., Any], args: tuple[torch.Tensor, ...]) -> Callable[[], Any]:
    """CapturedStep's ``capture`` off CUDA: the replay runs the step over the recorded argument copies."""
    return lambda: step(*args)


@torch.inference_mode()
def measure_tn(model: PreTrainedModel, sizes: Sequence[int] = TREE_SIZES, *, context: int = 256,
               cache_len: int | None = None, repeats: int = 10, warmup: int = 2,
               log: Callable[[str], None] = print, errors: list[str] | None = None) -> list[dict[str, Any]]:
    """Rows (n, eager_ms, captured_ms): the target scoring an n-node tree (a chain: the cost follows n, not the
    shape) at position ``context`` over a runner of ``cache_len`` positions (default: the compiled engines'),
    eager and through :class:`~jakiro_lib.decoding.compiled.CapturedStep`; medians of ``repeats`` calls after ``warmup``.
    A failed measurement is NaN, its error line appended to ``errors``."""
    dev = model.device
    cache_len = cache_len or compiled_cache_len(context + max(sizes))
    if context + max(sizes) > cache_len:
        raise ValueError(f"a {max(sizes)}-token tree after {context} positions does not fit {cache_len} cached ones")
    runner = TargetRunner(model, cache_len)
    g = torch.Generator().manual_seed(1)
    runner.prefill(torch.randint(0, model.config.vocab_size, (context,), generator=g).to(dev))
    start = torch.full((), context, dtype=torch.long, device=dev)
    capture = {} if dev.type == "cuda" else {"capture": _replay_eagerly}
    rows = []
    for n in sizes:
        tokens = torch.randint(0, model.config.vocab_size, (n,), generator=g).to(dev)
        parents = torch.arange(n, device=dev).sub(1).clamp_min(0)  # a chain: node i's parent is i - 1
        depths = torch.arange(n, device=dev)
        anc = ancestor_mask(parents, n - 1)
        row: dict[str, Any] = {"n": n}
        for col, step in (("eager_ms", runner.score), ("captured_ms", CapturedStep(runner.score, **capture))):
            try:
                for _ in range(max(warmup, 2)):  # a captured step's first call runs eagerly, its second records
                    step(tokens, depths, anc, start)
                row[col] = 1e3 * median_seconds(lambda: step(tokens, depths, anc, start), repeats, dev)
            except Exception as exc:  # noqa: BLE001 - one failed reading must not lose the others
                row[col] = math.nan
                _failed(f"T({n}) {col[:-3]}", exc, log, errors)
        rows.append(row)
        log(f"[papercost] T({n:2d}) after {context} positions: eager {row['eager_ms']:8.3f} ms, "
            f"captured {row['captured_ms']:8.3f} ms")
    return rows


def _failed(what: str, exc: BaseException, log: Callable[[str], None], errors: list[str] | None) -> None:
    line = f"{what} failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    log(f"[papercost] {line}")
    if errors is not None:
        errors.append(line)


def _per_cycle_ms(runs: Sequence[GenerationResult]) -> tuple[float, int]:
    """Median milliseconds per cycle after the prefill over ``runs``, and the cycles of the last run."""
    per = [1e3 * (r.wall_time - r.prefill_time) / r.cycles for r in runs if r.cycles]
    if not per:
        raise RuntimeError("no cycle ran (the prompt left no room?)")
    return statistics.median(per), runs[-1].cycles


def measure_generation(run: Callable[[], GenerationResult], *, runs: int = 3, warmup: int = 1) -> tuple[float, int]:
    """``run()`` ``warmup`` times (compilation or capture happens there), then ``runs`` times: (median ms per
    cycle after the prefill, cycles of a run)."""
    for _ in range(warmup):
        run()
    return _per_cycle_ms([run() for _ in range(runs)])


@dataclass(frozen=True)
class _Plan:
    """One papercost run's checked settings and what follows from them (the cache lengths, the methods)."""

    shape: str
    device: torch.device
    dtype: str
    context: int
    new_tokens: int
    compile: bool
    sizes: Sequence[int]
    repeats: int
    runs: int
    seed: int
    methods: list[tuple[Method, TreeConfig, DraftConfig]]
    max_context: int  # room for a whole tree in every cycle (the engine's "whole" cycles)
    cache_len: int  # the runner's positions for T(n)

    def generate_kw(self) -> dict[str, Any]:
        """The static engine's generation settings every timed run shares."""
        return dict(max_new_tokens=self.new_tokens, max_context=self.max_context, compile=self.compile)


def _plan(shape: str, device: str, dtype: str, context: int, new_tokens: int, compile: bool | None,
          sizes: Sequence[int], tree: TreeConfig | None, repeats: int, runs: int, seed: int) -> _Plan:
    """Check :func:`run_papercost`'s arguments (a ValueError before anything is written) and derive the rest."""
    dev = check_device(device)
    shape_config(shape)  # a ValueError for an unknown shape
    _dtype(dtype)
    if context < 1 or new_tokens < 2 or repeats < 1 or runs < 1 or not sizes or min(sizes) < 1:
        raise ValueError("need context >= 1, new_tokens >= 2, repeats >= 1, runs >= 1 and tree sizes >= 1")
    max_context = context + new_tokens + 64
    return _Plan(shape=shape, device=dev, dtype=dtype, context=context, new_tokens=new_tokens,
                 compile=dev.type == "cuda" if compile is None else compile, sizes=sizes, repeats=repeats,
                 runs=runs, seed=seed, methods=paper_methods(tree), max_context=max_context,
                 cache_len=compiled_cache_len(max(max_context, context + max(sizes))))


def _settings(plan: _Plan, errors: list[str]) -> dict[str, Any]:
    """``papercost.json`` before anything is measured: the settings, the paper's numbers, the environment."""
    dev = plan.device
    return {
        "shape": plan.shape, "config": shape_config(plan.shape, plan.max_context).to_diff_dict(), "device": str(dev),
        "dtype": plan.dtype, "context": plan.context, "new_tokens": plan.new_tokens, "max_context": plan.max_context,
        "tn_cache_len": plan.cache_len,
        "tn_captured": ("one CUDA graph per n (CapturedStep)" if dev.type == "cuda" else
                        "off CUDA: the eager step replayed over its recorded argument copies"),
        "compile": plan.compile, "capture": "graphs" if dev.type == "cuda" and plan.compile else None,
        "tree_sizes": list(plan.sizes), "repeats": plan.repeats, "runs": plan.runs, "seed": plan.seed,
        "methods": {m.name: {"draft": m.draft, "draft_config": dataclasses.asdict(d), "tree": dataclasses.asdict(t)}
                    for m, t, d in plan.methods},
        "paper": {"source": PAPER_SOURCE, **PAPER}, "speedup_basis": SPEEDUP_BASIS,
        "note": ("random weights: the costs are the real ones (the static engine's shapes are fixed), the "
                 "acceptance is not measured; modelled_speedup uses the paper's tau"),
        "environment": run_metadata(dev, threads=torch.get_num_threads()), "status": "running",
        "tn": [], "cycles": [], "errors": errors,
    }


def _build_target(plan: _Plan, result: dict[str, Any], log: Callable[[str], None]) -> PreTrainedModel:
    """The random target, its compiled static step captured as CUDA graphs; its size goes into ``result``."""
    log(f"[papercost] {plan.shape} {plan.dtype} on {result['environment']['device_name']}: building the random target")
    model = random_target(plan.shape, plan.dtype, plan.device, plan.max_context, seed=plan.seed)
    set_capture(model, "auto")  # on CUDA a compiled static step is its eager kernels as CUDA graphs
    result["target_params"] = sum(p.numel() for p in model.parameters())
    log(f"[papercost] target: {result['target_params'] / 1e6:,.1f} M parameters on {plan.device}")
    return model


def _random_prompt(model: PreTrainedModel, plan: _Plan) -> torch.Tensor:
    """The ``context`` random tokens every timed generation starts from."""
    g = torch.Generator().manual_seed(plan.seed + 2)
    return torch.randint(0, model.config.vocab_size, (plan.context,), generator=g).to(plan.device)


def _cycle_recorder(out: Path, result: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    """A function that adds one row to ``result["cycles"]`` and rewrites ``cycles.csv`` (a crash keeps the rows)."""
    rows: list[dict[str, Any]] = []
    result["cycles"] = rows

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        write_table(out / "cycles.csv", pd.DataFrame(rows, columns=list(CYCLE_COLUMNS)))

    return record


def _time_plain(model: PreTrainedModel, prompt: torch.Tensor, plan: _Plan, record: Callable[[dict[str, Any]], None],
                log: Callable[[str], None], errors: list[str]) -> float:
    """Plain decoding on the static engine, recorded as the vanilla row: its ms per token (NaN if it failed)."""
    try:
        t_token, n = measure_generation(lambda: static_generate(model, None, None, prompt, **plan.generate_kw()),
                                        runs=plan.runs)
    except Exception as exc:  # noqa: BLE001
        t_token, n = math.nan, 0
        _failed("plain decoding", exc, log, errors)
    log(f"[papercost] plain decoding (static engine{', compiled' if plan.compile else ''}): {t_token:.3f} ms/token")
    record({"method": "vanilla", "draft": None, "tree": None, "cycles": n, "ms_per_cycle": t_token,
            "ms_per_token_plain": t_token, "tau_paper": 1.0, "modelled_speedup": 1.0 if t_token > 0 else math.nan,
            "paper_speedup": 1.0, "speedup_basis": "measured: the baseline"})
    return t_token


def _time_methods(model: PreTrainedModel, prompt: torch.Tensor, plan: _Plan, t_token: float,
                  result: dict[str, Any], record: Callable[[dict[str, Any]], None], log: Callable[[str], None],
                  errors: list[str]) -> None:
    """Each paper method's cycle with a random draft of its shape, recorded with its modelled speedup; the drafts'
    sizes go into ``result["draft_params"]``."""
    result["draft_params"] = {}
    for i, (m, mtree, dcfg) in enumerate(plan.methods):
        paper = PAPER["eagle2" if m.draft == "dense" else "jakiro"]
        try:
            draft = random_draft(dcfg, model, seed=plan.seed + 10 + i)
            result["draft_params"][m.name] = sum(p.numel() for p in draft.parameters())  # not the borrowed head
            t_cycle, n = measure_generation(
                lambda: static_generate(model, draft, mtree, prompt, **plan.generate_kw()), runs=plan.runs)
        except Exception as exc:  # noqa: BLE001
            t_cycle, n = math.nan, 0
            _failed(m.name, exc, log, errors)
        speedup = modelled_speedup(paper["tau"], t_token, t_cycle)
        log(f"[papercost] {m.name} ({m.draft} draft, {_tree_label(mtree)}): {t_cycle:.3f} ms/cycle -> modelled "
            f"{speedup:.2f}x at the paper's tau {paper['tau']} (paper: {paper['speedup']}x)")
        record({"method": m.name, "draft": m.draft, "tree": _tree_label(mtree), "cycles": n, "ms_per_cycle": t_cycle,
                "ms_per_token_plain": t_token, "tau_paper": paper["tau"], "modelled_speedup": speedup,
                "paper_speedup": paper["speedup"], "speedup_basis": SPEEDUP_BASIS})


def _finish(result: dict[str, Any], out: Path, t_start: float, log: Callable[[str], None]) -> None:
    """Mark the run done and rewrite ``papercost.json``."""
    result.update(status="done", seconds=round(time.perf_counter() - t_start, 1))
    write_json(out / "papercost.json", result)
    errors = result["errors"]
    log(f"[papercost] {result['seconds']:.1f} s; tn.csv, cycles.csv and papercost.json in {out}"
        + (f"; {len(errors)} measurement(s) failed" if errors else ""))


def run_papercost(shape: str = "vicuna-7b", *, device: str = "cuda", dtype: str = "bfloat16", context: int = 256,
                  new_tokens: int = 64, out_dir: str | Path, compile: bool | None = None,
                  sizes: Sequence[int] = TREE_SIZES, tree: TreeConfig | None = None, repeats: int = 10,
                  runs: int = 3, seed: int = 0, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure T(n), plain decoding and the paper's methods' cycles on a random target of ``shape`` and write the
    module's three files to ``out_dir`` (each table as soon as its part is measured); returns what the JSON holds.

    ``compile``: the static engine's step compiled (default: on CUDA, where it is captured as CUDA graphs of the
    eager kernels, ``target.capture="graphs"``; on a CPU compiling means inductor, minutes). ``tree``: default the
    paper's. ``repeats``: timed calls per T(n); ``runs``: timed generations per method (after one warm-up)."""
    t_start = time.perf_counter()
    plan = _plan(shape, device, dtype, context, new_tokens, compile, sizes, tree, repeats, runs, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    result = _settings(plan, errors)
    write_json(out / "papercost.json", result)
    model = _build_target(plan, result, log)
    result["tn"] = measure_tn(model, plan.sizes, context=plan.context, cache_len=plan.cache_len,
                              repeats=plan.repeats, log=log, errors=errors)
    write_table(out / "tn.csv", pd.DataFrame(result["tn"], columns=list(TN_COLUMNS)))
    prompt = _random_prompt(model, plan)
    record = _cycle_recorder(out, result)
    t_token = _time_plain(model, prompt, plan, record, log, errors)
    _time_methods(model, prompt, plan, t_token, result, record, log, errors)
    _finish(result, out, t_start, log)
    return result
