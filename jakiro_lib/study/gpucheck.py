"""The GPU check, ``python -m jakiro_lib gpucheck`` (docs/usage.md): on the default profile's drafts in fp32,
:data:`CHECK_METHODS` on MT-bench q1-10 at T=0 and T=1 (``records.jsonl``, ``summary.csv``,
``performance_targets.csv``), :func:`cycle_breakdown` eager and compiled (``cycles.csv``), and ``gpu_check.json``, one
file to commit. It runs on a CPU too (the tests run it on the smoke profile); its numbers mean something on a GPU."""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Sequence

import pandas as pd
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ..data.chat import format_prompt_ids
from ..measure.summary import load_records
from ..measure.budgets import resolve_tree_budgets
from ..config import Profile, TreeConfig
from ..profiles import get_profile
from ..models.draft import DraftModel
from ..layout import RECORDS_FILE
from ..measure.methods import parse_names
from ..measure.perf import performance_targets
from ..decoding.clock import STEP_RANGES
from ..decoding.static import static_generate
from .context import StudyContext, get_target
from .s02_bench import profile_methods, run_study, study_questions
from ..files import write_json, write_table
from ..machine import run_metadata
from ..decoding.verify import SamplingParams

# vanilla: plain decoding on the engine (captured on a GPU: the fast baseline); hf_compiled: HF's (its eager
# generate would only cost time); Jakiro's and EAGLE-2's tuned trees, Jakiro + CEPD (the paper's hybrid step) and
# Jakiro + a lookup chain, all captured as the target says (target.capture "auto": CUDA graphs)
CHECK_METHODS = ("vanilla", "hf_compiled", "jakiro_auto", "eagle2_auto", "jakiro_cepd", "jakiro_lookup")
# the method whose cycle the profiler takes apart (eager, then captured), at the tree its study run was tuned to
PROFILED = "jakiro_auto"
# new tokens per profiled prompt in the breakdown (its figures are per cycle: fewer tokens, a shorter check);
# each row is written as it is done, so a stopped check keeps those it finished
BREAKDOWN_TOKENS = 32
CHECK_SETTINGS = {"bench.compiled_baseline": "true",
                  "bench.benchmarks": "mt_bench", "bench.limit": "10", "bench.max_new_tokens": "64",
                  "bench.temperatures": "0,1", "target.dtype": "float32", "target.packed_gemm": "0"}


def check_profile(profile: str = "default", device: str | None = None, **overrides: str) -> Profile:
    """``profile`` with :data:`CHECK_SETTINGS` (fp32: the exact setting, where greedy identity must hold) on
    ``device`` (default: cuda when there is one, else the profile's), then ``overrides``."""
    device = device or ("cuda" if torch.cuda.is_available() else get_profile(profile).target.device)
    return get_profile(profile, **{**CHECK_SETTINGS, "target.device": device, **overrides})


def cycle_breakdown(model: Any, draft: DraftModel | None, tree: TreeConfig | None, prompts: Sequence[torch.Tensor],
                    *, compile: bool, params: SamplingParams = SamplingParams(), max_new_tokens: int = 64,
                    seed: int = 0) -> dict[str, Any]:
    """Milliseconds per cycle of the static engine by named range (:data:`jakiro_lib.decoding.clock.STEP_RANGES`), on
    the host (``cpu_ms``) and the device (``device_ms``), the wall time per cycle and, on a GPU, the device operations a
    cycle and their time (``device_ops``, ``device_total_ms``). Each prompt runs once unprofiled first (compiling or
    capturing); a compiled cycle keeps only the ``cycle`` and ``read`` ranges. ``draft`` None: plain decoding."""
    device = model.device

    def run(p: torch.Tensor) -> Any:
        gen = torch.Generator(device=device).manual_seed(seed)
        return static_generate(model, draft, tree, p.to(device), max_new_tokens=max_new_tokens, params=params,
                               generator=gen, compile=compile)

    for p in prompts:
        run(p)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    cycles, tokens, wall = 0, 0, 0.0
    with profile(activities=activities) as prof:
        for p in prompts:
            t0 = time.perf_counter()
            r = run(p)
            wall += time.perf_counter() - t0 - r.prefill_time
            cycles, tokens = cycles + r.cycles, tokens + len(r.output_ids) - 1
    events = {e.key: e for e in prof.key_averages()}
    out: dict[str, Any] = {"decoder": "plain" if draft is None else "speculative", "compiled": compile,
                           "cycles": cycles, "tau": tokens / max(cycles, 1), "wall_ms": 1e3 * wall / max(cycles, 1)}
    ops = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith("jakiro::")]
    out["device_ops"] = len(ops) / max(cycles, 1) if device.type == "cuda" else math.nan
    out["device_total_ms"] = (sum(e.device_time_total for e in ops) / 1e3 / max(cycles, 1) if device.type == "cuda"
                              else math.nan)
    for name, label in STEP_RANGES.items():
        e = events.get(label)
        out[f"{name}_cpu_ms"] = e.cpu_time_total / 1e3 / max(cycles, 1) if e else math.nan
        device_us = getattr(e, "device_time_total", math.nan) if e and device.type == "cuda" else math.nan
        out[f"{name}_device_ms"] = device_us / 1e3 / max(cycles, 1)
    return out


def gpu_check(profile: str = "default", *, run_dir: str | Path | None = None, out_dir: str | Path | None = None,
              device: str | None = None, overrides: dict[str, str] | None = None, profiled_prompts: int = 4,
              methods: str | Sequence[str] = CHECK_METHODS, progress: bool = True) -> dict[str, Any]:
    """Run the check (module docstring) and write its files to ``out_dir`` (default
    ``<run_dir>/gpucheck-<device>``); returns what ``gpu_check.json`` holds."""
    t0 = time.perf_counter()
    prof = check_profile(profile, device, **(overrides or {}))
    ctx = StudyContext.at(prof, run_dir)
    out = Path(out_dir) if out_dir is not None else ctx.run_dir / f"gpucheck-{prof.target.device}"
    target = get_target(prof)
    available = profile_methods(prof, ctx.layout.drafts, "main")
    names = parse_names(methods, available) if isinstance(methods, str) else methods  # as `bench --methods`
    chosen = [m for m in names if m in available]
    table = run_study(ctx, "main", target=target, out_dir=out, only=chosen, progress=progress)
    records = load_records(out / RECORDS_FILE)
    goals = performance_targets(table, records)
    write_table(out / "summary.csv", table)
    write_table(out / "performance_targets.csv", goals)
    rows = []
    if PROFILED in available:
        spec = resolve_tree_budgets(prof, ctx.run_dir, {PROFILED: available[PROFILED]}, target)[0][PROFILED]
        draft = spec.load_draft(target)
        questions = study_questions(prof)[0][:profiled_prompts]
        prompts = [format_prompt_ids(target, [{"role": "user", "content": q.turns[0]}]) for q in questions]
        new_tokens = min(prof.bench.max_new_tokens, BREAKDOWN_TOKENS)
        # Jakiro's cycle eager and compiled, then plain decoding's step the same way: captured on a GPU (eager
        # there too), eager only on a CPU, where compiling it would only add an inductor compilation to the check
        runs = [(draft, spec.tree, False), (draft, spec.tree, True), (None, None, False)]
        for d, tree, compile in runs + ([(None, None, True)] if target.device.type == "cuda" else []):
            t = time.perf_counter()
            rows.append({**cycle_breakdown(target.model, d, tree, prompts, compile=compile, max_new_tokens=new_tokens),
                         "new_tokens": new_tokens})
            write_table(out / "cycles.csv", pd.DataFrame(rows))
            if progress:
                print(f"breakdown: {rows[-1]['decoder']} {'captured' if compile else 'eager'} in "
                      f"{time.perf_counter() - t:.1f} s", flush=True)
    result = {"profile": prof.name, "target": prof.target.model, "device": prof.target.device,
              "dtype": prof.target.dtype, "methods": chosen, "run_dir": str(ctx.run_dir), "out_dir": str(out),
              "environment": run_metadata(prof.target.device), "minutes": (time.perf_counter() - t0) / 60,
              "summary": table[["temperature", "method", "tokens_per_s", "speedup", "tau", "greedy_same",
                                "greedy_compared"]].to_dict("records"),
              "goals": goals.to_dict("records"), "cycles": rows}
    write_json(out / "gpu_check.json", result)
    return result
