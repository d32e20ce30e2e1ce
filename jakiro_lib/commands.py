"""The sub-commands' handlers behind :mod:`jakiro_lib.cli` (one ``cmd_<name>(args) -> exit status`` each, but
``pipeline``'s, which is in cli): the same functions the notebooks call, with the command line's output."""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import pandas as pd
import torch

from .api import generate
from .measure.summary import (common_prompts, greedy_agreement, greedy_divergences, load_bench_records, load_records,
                              versus)
from .measure.budgets import fixed_tree, resolve_tree_budgets, tuning_prompts
from .config import Profile, TargetConfig
from .profiles import PROFILE_NAMES, get_profile, override, parse_overrides
from .measure.costmodel import measure_draft_costs, measure_draft_cycle, measure_target_costs, shape_key, tune_tree
from .data.conversations import DataError, Question, load_question_file, load_questions
from .models.draft import DraftModel, resolve_draft_dtype
from .data.feature_store import MANIFEST, CacheError, verify_cache
from .decoding.methods import MethodSpec
from .measure.methods import SPEC, record_label
from .measure.papercost import run_papercost
from .measure.perf import performance_targets
from .study.context import StudyContext, default_run_dir
from .study.performance import cycle_cost_table
from .study.gpucheck import CHECK_METHODS, gpu_check
from .report.plots import plot_papercost, save_figure
from .study.s00_data import prepare_features
from .study.s01_train import train_all, training_table
from .study.s02_bench import run_study
from .study.heads import export_draft
from .study.tables import category_table, display_table, study_table
from .models.target import load_target
from .training.scale import SCALE_JSON, recorded_scale, set_keys as scale_keys
from .training.throughput import format_table, plan_from, run_throughput
from .training.throughput_plan import format_plan
from .files import write_json, write_table
from .distributed import main_rank
from .machine import run_metadata

TRAIN_COLUMNS = ("draft", "status", "steps", "acc_a", "acc_b", "heldout_loss", "wall_time_s")


@contextlib.contextmanager
def one_line(*errors: type[Exception]) -> Iterator[None]:
    """Bad input (one of ``errors``) ends the command in one ``error:`` line, exit status 1."""
    try:
        yield
    except errors as exc:
        raise SystemExit("error: " + " ".join(str(exc).split())) from None


def resolved_profile(args: argparse.Namespace) -> Profile:
    """The profile with ``--set`` applied; for a command with ``--run-dir`` (cache, train, bench) and a profile whose
    ``data.scale`` is "auto", the conversations and epochs the pipeline chose there (scale.json; never measured here)."""
    with one_line(ValueError):
        overrides = parse_overrides(args.set)
        profile = get_profile(args.profile, **overrides)
        if not hasattr(args, "run_dir") or profile.data.scale != "auto":
            return profile
        run_dir = args.run_dir or default_run_dir(profile.name)
        overrides, record = recorded_scale(profile, overrides, run_dir)
        if record is None:
            if len(scale_keys(overrides)) < 2:
                print(f"[data.scale=auto: no scale recorded for these settings in {run_dir / SCALE_JSON} (the pipeline "
                      f"measures and records one): {profile.data.num_conversations} conversations x "
                      f"{profile.train.epochs} epochs]", file=sys.stderr)
            return profile
        profile = override(profile, **scale_keys(overrides))
        print(f"[scale: {profile.data.num_conversations} conversations x {profile.train.epochs} epochs, chosen by the "
              f"pipeline on {record.get('date', '?')} ({run_dir / SCALE_JSON})]", file=sys.stderr)
        return profile


def cmd_profiles(args: argparse.Namespace) -> int:
    if args.show:
        print(get_profile(args.show).to_json())
    else:
        for name in PROFILE_NAMES:
            p = get_profile(name)
            print(f"{name:20s} target={p.target.model}  device={p.target.device}  tree=depth {p.tree.depth}, "
                  f"top-k {p.tree.top_k}, {p.tree.total_tokens} tokens")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    profile = resolved_profile(args)
    target = load_target(profile.target)
    tree = replace(profile.tree, decoupled=args.decoupled, ar_steps=args.ar_steps) if args.method == SPEC else None
    if args.method == SPEC and not args.draft and not tree.lookup_tokens:
        raise SystemExit("error: --method spec needs --draft DIR (a trained draft, e.g. runs/default/drafts/moe2/draft) "
                         "or --set tree.lookup_tokens=N (prompt lookup alone)")
    if tree is not None and args.draft and tree.tuned:  # tuned once per machine and draft, then cached
        spec = MethodSpec(SPEC, draft=str(Path(args.draft).expanduser().resolve()), tree=tree,
                          draft_dtype=resolve_draft_dtype(profile.bench.draft_dtype, profile.target))
        tree = resolve_tree_budgets(profile, default_run_dir(profile.name), {SPEC: spec}, target)[0][SPEC].tree
        print(f"[tree: depth {tree.depth}, top-k {tree.top_k}, {tree.total_tokens} tokens, tuned for this machine]",
              file=sys.stderr)
    out = generate(target, args.prompt, method=args.method, draft=args.draft, tree=tree,
                   max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   seed=args.seed, on_text=lambda text: print(text, end="", flush=True),
                   draft_dtype=profile.bench.draft_dtype)
    r = out.result
    print(f"\n\n[{r.new_tokens} tokens in {r.wall_time:.2f} s = {r.tokens_per_second:.1f} tok/s"
          + (f", tau {r.tau:.2f} over {r.cycles} cycles" if args.method == SPEC else "")
          + (", stopped at the end of the context" if r.stop_reason == "context" else "") + "]", file=sys.stderr)
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    ctx = StudyContext.at(resolved_profile(args), args.run_dir)
    profile, cache = ctx.profile, ctx.layout.features
    if (cache / MANIFEST).is_file() and not profile.data.online:  # say whether this run resumes or repairs
        try:
            m = verify_cache(cache, allow_incomplete=True)
            if not m.get("complete"):
                print(f"resuming the feature cache in {cache}: {len(m.get('shards', []))} of "
                      f"{m.get('num_shards_expected')} shards are done", file=sys.stderr)
        except CacheError as exc:
            print(f"repairing the feature cache: {' '.join(str(exc).split())}; recomputing what is bad",
                  file=sys.stderr)
    s = prepare_features(ctx)
    print(f"{s['conversations']} conversations, {s['tokens']} tokens ({s['loss_tokens']} trained on), "
          f"{s['shards']} shards, {s['human']} in {s['cache_dir'] or '(online mode: nothing cached)'}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    ctx = StudyContext.at(resolved_profile(args), args.run_dir)
    names = [n for arg in args.drafts or () for n in arg.split(",") if n]  # "a b" or "a,b"
    results = train_all(ctx, only=names or None, force=args.force)
    if not main_rank():  # under `accelerate launch`: the main process prints the table
        return 0
    table = training_table(results)
    table.insert(1, "status", ["skipped" if r.get("skipped") else "imported" if r.get("imported") else "trained"
                               for r in results.values()])
    print(table[list(TRAIN_COLUMNS)].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    print("results.json and history.json of each draft in", ctx.layout.drafts)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    sets = {}
    if args.bench:
        sets["bench.benchmarks"] = args.bench
    if args.temperature:
        sets["bench.temperatures"] = ",".join(str(t) for t in args.temperature)
    if args.limit is not None:
        sets["bench.limit"] = str(args.limit)
    if args.skip:
        sets["bench.skip"] = str(args.skip)
    with one_line(ValueError, FileNotFoundError, DataError):
        ctx = StudyContext.at(override(resolved_profile(args), **sets), args.run_dir)
        questions, out = None, args.out
        if args.questions:
            questions = _question_file(args)
            if out is None:  # beside the studies, never into their folders (their records would go stale)
                out = ctx.layout.bench(f"{args.study}-{questions[0].benchmark}")
        table = run_study(ctx, args.study, out_dir=out, questions=questions, only=args.methods or None)
    print(display_table(table).to_string())
    out = Path(table.attrs["records"]).parent  # --out, or the study's folder in the run directory
    _write_summary(out, table, _print_categories(load_records(out / "records.jsonl")))
    print("records and summary.csv in", out)
    return 0


def _question_file(args: argparse.Namespace) -> list[Question]:
    """``--questions FILE``: an EAGLE / Spec-Bench / FastChat question.jsonl under ``--name`` (default: the
    file's name, or its folder's for a file called question.jsonl), ``--skip`` / ``--limit`` applied."""
    path = Path(args.questions).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"no question file {path}")
    name = args.name or (path.parent.name if path.stem == "question" else path.stem)
    if Path(name).name != name or name in (".", ".."):
        raise ValueError(f"--name {name!r} is not a plain name: it names a folder under bench/ (no / or ..)")
    stop = None if args.limit is None else args.skip + args.limit
    questions = load_question_file(path, name)[args.skip:stop]
    if not questions:
        raise DataError(f"no questions in {path} (after --skip {args.skip})")
    return questions


def _write_summary(out: Path, table: pd.DataFrame, by_category: pd.DataFrame) -> None:
    """``summary`` and, where the questions have categories, ``summary_by_category`` in ``out`` (.csv and .json)."""
    write_table(out / "summary.csv", table)
    if not by_category.empty:
        write_table(out / "summary_by_category.csv", by_category)


def _print_categories(records: list[dict]) -> pd.DataFrame:
    """The per-category table (Spec-Bench style) where the questions carry more than one category."""
    table = category_table(records)
    if not table.empty:
        print("\nper question category:")
        print(display_table(table).to_string())
    return table


def cmd_divergences(args: argparse.Namespace) -> int:
    """Check a benchmark's greedy records position by position against vanilla's (low-precision runs)."""
    with one_line(ValueError, FileNotFoundError):
        records = load_bench_records(args.records)
        greedy = [r for r in records if r["temperature"] == 0]
        vanilla = [r for r in greedy if record_label(r) == "vanilla"]
        if not vanilla:
            raise ValueError(f"{args.records} has no greedy (T=0) records of the 'vanilla' method to compare with")
        config = resolved_profile(args).target
        saved = args.records.parent / "bench_config.json"  # the target the records were made with
        if saved.is_file():
            config = TargetConfig(**json.loads(saved.read_text())["target"])
        questions = [q for b in sorted({r["benchmark"] for r in greedy}) for q in load_questions(b)]
        target = load_target(config)
    print(f"target {config.model} in {config.dtype}; greedy outputs identical to vanilla's:")
    for method in dict.fromkeys(record_label(r) for r in greedy):
        same, compared = greedy_agreement([r for r in greedy if record_label(r) == method], vanilla)
        print(f"  {method:20s} {same}/{compared}")
    table = pd.DataFrame(greedy_divergences(target, records, questions))
    if table.empty:
        print("no divergences")
    else:
        print(table.to_string(index=False))
        print(f"largest top-2 gap at a divergence: {table['gap'].max():.4g} "
              f"({table['gap_steps'].max():.1f} steps of {config.dtype} at the top logit)")
    if args.out:
        table.to_csv(args.out, index=False)
        print("written to", args.out)
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    """The main table and the speed goals of benchmark records (several files are pooled: e.g. a T=0 and a
    T=1 run, or records copied back from a GPU machine)."""
    missing = [str(p) for p in args.records if not p.is_file()]
    if missing:
        raise SystemExit(f"error: no records file {', '.join(missing)}")
    with one_line(ValueError):  # a file given twice (by any path to it) counts once
        records = [r for path in {p.resolve(): p for p in args.records}.values() for r in load_bench_records(path)]
    if not records:
        raise SystemExit(f"error: no records in {', '.join(map(str, args.records))}")
    if args.common_prompts:
        records = common_prompts(records)
    table = study_table(records)
    goals = performance_targets(table, records)
    print(display_table(table).to_string())
    by_category = _print_categories(records)
    if goals.empty:
        print("no speed goals to judge: the records hold no Jakiro method")
    else:
        cols = ["goal", "temperature", "method", "baseline", "ratio", "ratio_ci_low", "ratio_ci_high", "met",
                "resolved"]
        print(goals[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    against = pd.DataFrame(versus(records, args.versus)) if args.versus else pd.DataFrame()
    if args.versus:
        if against.empty:
            raise SystemExit(f"error: no drafted method to compare with {args.versus!r} in these records")
        cols = ["temperature", "method", "prompts", "tokens_per_s_ratio", "tokens_per_s_ci_low", "tokens_per_s_ci_high",
                "tokens_per_s_verdict", "tau", "baseline_tau", "tau_ratio", "tau_ci_low", "tau_ci_high", "tau_verdict"]
        print(f"against {args.versus} (paired bootstrap over prompts, 95%):")
        print(against[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        _write_summary(args.out, table, by_category)
        write_table(args.out / "performance_targets.csv", goals)
        if not against.empty:
            write_table(args.out / f"versus_{re.sub(r'[^A-Za-z0-9_.-]+', '_', args.versus).strip('_')}.csv", against)
        print("summary and performance_targets (.csv, .json) in", args.out)
    return 0


def cmd_costs(args: argparse.Namespace) -> int:
    """Per-cycle cost breakdown on this machine (and, with a draft, the tree budget it implies)."""
    profile = resolved_profile(args)
    target = load_target(profile.target)
    sizes = args.sizes
    result: dict = {"profile": profile.name, "target": profile.target.model, "context": args.context,
                    "environment": run_metadata(target.device, threads=torch.get_num_threads())}
    costs = measure_target_costs(target.model, sizes, context=args.context)
    result["target_tree_ms"] = {n: round(t * 1000, 2) for n, t in costs.items()}
    print("target: verify n tokens after a", args.context, "token context")
    for n, t in costs.items():
        print(f"  n={n:3d}  {t * 1000:7.1f} ms  ({t / costs[min(costs)]:.2f}x one step)")
    if args.draft:
        dtype = resolve_draft_dtype(profile.bench.draft_dtype, profile.target)  # as the benchmark decodes it
        draft = DraftModel.load(args.draft, target.model, dtype=dtype)
        fixed = fixed_tree(profile.tree, profile.tree)  # the profile's tree, its "auto" settings fixed
        dcost = measure_draft_costs(draft, widths=(1, fixed.top_k), context=args.context)
        result["draft_step_ms"] = {w: round(t * 1000, 2) for w, t in dcost.items()}
        print("draft step (frontier width: ms):", result["draft_step_ms"])
        # as the benchmark tunes (jakiro_lib.measure.budgets): held-out training conversations, never benchmark
        # prompts, and the estimate's pick kept only where it measures faster than the profile's fixed tree
        prompts, tuned_on = tuning_prompts(profile, target)
        prompts = prompts[:args.tune_prompts]
        tuned_on = {**tuned_on, "conversations": tuned_on["conversations"][:args.tune_prompts]}
        tuned = tune_tree(target, draft, profile.tree, prompts, candidates=[n for n in sizes if n >= 2],
                          max_new_tokens=64, context=args.context, reference=fixed)
        result["tuning"], result["tuning_prompts"] = tuned, tuned_on
        best = replace(profile.tree, depth=tuned["depth"], top_k=tuned["top_k"], total_tokens=tuned["best"])
        print(f"best tree on this machine: {shape_key(best.depth, best.top_k, best.total_tokens)} (depth, top-k, "
              "tokens)")
        for row in tuned["table"]:
            print(f"  {shape_key(row['depth'], row['top_k'], row['total_tokens']):12s}  "
                  f"E[tokens/cycle]={row['expected_tokens_per_cycle']:.2f}  est. {row['tokens_per_s']:.1f} tok/s")
        result["draft_cycle_ms"] = {}
        for key, tree in {shape_key(t.depth, t.top_k, t.total_tokens): t for t in (best, fixed)}.items():
            result["draft_cycle_ms"][key] = ms = round(1000 * measure_draft_cycle(draft, tree, context=args.context), 3)
            print(f"drafting per cycle (propose + accept 2 tokens), {key}, decoupled={tree.decoupled}: {ms:.2f} ms")
    if args.out:
        write_json(args.out, result)
        print("written to", args.out)
    return 0


def cmd_cycles(args: argparse.Namespace) -> int:
    """The cycle-cost table (jakiro_lib.measure.cycles) of the main study's methods on this machine."""
    ctx = StudyContext.at(resolved_profile(args), args.run_dir)
    out = args.out or ctx.layout.root / "cycles"
    with one_line(ValueError, FileNotFoundError, DataError):
        table = cycle_cost_table(ctx, names=[m.strip() for m in args.methods.split(",") if m.strip()],
                                 limit=args.limit, max_new_tokens=args.max_new_tokens, out_dir=out)
    print(table.round(3).to_string(index=False))
    print("cycles.csv and cycles_config.json in", out)
    return 0


def cmd_throughput(args: argparse.Namespace) -> int:
    """Tokens/s of feature caching and draft training on this machine (jakiro_lib.training.throughput)."""
    profile = resolved_profile(args)
    out = args.out or default_run_dir(profile.name) / "throughput"
    if args.plan_from:  # no measuring: the profile's stages on the machine that wrote that table
        with one_line(OSError, ValueError):
            plan = plan_from(profile, args.plan_from, out)
        print(f"expected minutes of the {profile.name} profile's stages on the machine of {args.plan_from}:\n"
              f"{format_plan(plan)}\nplan.csv in {out}")
        return 0
    with one_line(ValueError):
        table, plan = run_throughput(profile, out, conversations=args.conversations, steps=args.steps,
                                     cache_batch_sizes=list(args.cache_batch_sizes),
                                     drafts=args.drafts.split(",") if args.drafts else None)
    print(format_table(table))
    print(f"\nexpected minutes of the {profile.name} profile's stages here (compilation, evaluation, benchmarks not"
          f" counted):\n{format_plan(plan)}")
    print("throughput.csv, plan.csv, throughput_config.json and throughput_env.json in", out)
    return 0


def cmd_gpucheck(args: argparse.Namespace) -> int:
    """The decoding goals in one run on the device (jakiro_lib.study.gpucheck): records, goals, cycle breakdown."""
    with one_line(ValueError, FileNotFoundError, DataError):
        result = gpu_check(args.profile, run_dir=args.run_dir, out_dir=args.out, device=args.device,
                           overrides=parse_overrides(args.set), profiled_prompts=args.profiled_prompts,
                           methods=args.methods or CHECK_METHODS)
    summary = pd.DataFrame(result["summary"])
    print(summary.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    goals = pd.DataFrame(result["goals"])
    if not goals.empty:
        print(goals[["goal", "temperature", "method", "baseline", "ratio", "met", "resolved"]].to_string(index=False))
    if result["cycles"]:
        print(pd.DataFrame(result["cycles"]).to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print(f"{result['minutes']:.1f} min; gpu_check.json, records.jsonl, summary.csv, performance_targets.csv and "
          f"cycles.csv in {result['out_dir']}")
    return 0


def cmd_papercost(args: argparse.Namespace) -> int:
    """Paper scale by simulation (jakiro_lib.measure.papercost): T(n), plain decoding and the paper's cycles on a random
    target of a named shape, with speedups modelled from the paper's tau."""
    with one_line(ValueError):
        result = run_papercost(args.shape, device=args.device, dtype=args.dtype, context=args.context,
                               new_tokens=args.new_tokens, out_dir=args.out)
    save_figure(plot_papercost(result["tn"], result["cycles"]), Path(args.out) / "papercost.png")
    cycles = pd.DataFrame(result["cycles"]).drop(columns=["speedup_basis"])
    print(cycles.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print("modelled_speedup: tau_paper x ms_per_token_plain / ms_per_cycle (random weights: acceptance not measured)")
    return 1 if result["errors"] else 0


def cmd_export(args: argparse.Namespace) -> int:
    """A saved draft in EAGLE's or the Jakiro authors' layout, for their code, vLLM and SGLang (study.heads)."""
    target = load_target(resolved_profile(args).target)
    done = export_draft(args.draft, target, args.format, args.out)
    print(f"{done['layout']} layout: {', '.join(done['files'])} in {done['out']}")
    return 0
