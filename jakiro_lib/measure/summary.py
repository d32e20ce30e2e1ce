"""What benchmark records (:func:`jakiro_lib.measure.bench.run_benchmark`) say: per-method summaries with speedups
over the fastest plain decoder, paired bootstrap intervals of ratios (docs/DESIGN.md section 11), greedy identity
with our vanilla loop and, where it fails, how near a tie the target's logits were.
"""
from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd
import torch

from ..data.chat import answer_message, format_prompt_ids
from ..decoding.runner import TargetRunner
from ..models.target import Target
from ..config import SPEC, VANILLA_KINDS
from ..files import read_jsonl
from .methods import record_capture, record_label
from .paired import bootstrap_interval


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``records.jsonl`` as written (old ones are read by
    :func:`~jakiro_lib.measure.methods.record_label`, the one adapter for their run names)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"no records file {path}")
    return read_jsonl(path)


# what names a benchmark record (bench.Record): a JSON-lines file whose objects lack them is something else
RECORD_KEYS = ("method", "kind", "benchmark", "question_id", "turn", "repeat", "temperature")


def load_bench_records(path: Path) -> list[dict[str, Any]]:
    """:func:`load_records`, with a ValueError naming the file when what it holds are not benchmark records."""
    records = load_records(path)
    for i, r in enumerate(records, 1):
        missing = [k for k in RECORD_KEYS if k not in r] if isinstance(r, dict) else list(RECORD_KEYS)
        if missing:
            raise ValueError(f"{path} is not benchmark records: entry {i} has no {', '.join(map(repr, missing[:3]))}"
                             f"{' ...' if len(missing) > 3 else ''} (give a records.jsonl that `bench` wrote)")
    return records


def common_prompts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records of prompts that every method of their (benchmark, temperature) ran: an interrupted run's
    methods are then compared on the same prompts (a run that stopped mid-method leaves the last ones short)."""
    groups: dict[tuple, dict[str, set]] = {}
    for r in records:
        groups.setdefault((r["benchmark"], r["temperature"]), {}).setdefault(record_label(r), set()).add(_turn_key(r))
    keep = {g: set.intersection(*by_method.values()) for g, by_method in groups.items()}
    return [r for r in records if _turn_key(r) in keep[(r["benchmark"], r["temperature"])]]


def _mean_std(xs: list[float]) -> tuple[float, float]:
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


MEASURES = ("tokens_per_s", "tau")  # what ratio_interval compares


def _prompt_parts(recs: list[dict[str, Any]], measure: str) -> dict[tuple, tuple[float, float]]:
    """Per prompt (benchmark, question, turn, repeat): the numerator and denominator of ``measure``.

    tokens/s: (tokens/s, 1), averaged over prompts; tau: (tokens emitted, cycles), pooled over prompts as
    :func:`summarize` pools them (tokens / cycles of all a method's prompts, not a mean of per-prompt taus).
    """
    def parts(r: dict[str, Any]) -> tuple[float, float]:
        return (r["tokens_per_second"], 1.0) if measure == "tokens_per_s" else (float(sum(r["accepted"])), float(r["cycles"]))
    return {(r["benchmark"], str(r["question_id"]), r["turn"], r["repeat"]): parts(r) for r in recs}


def ratio_interval(method_records: list[dict[str, Any]], baseline_records: list[dict[str, Any]], *,
                   measure: str = "tokens_per_s", level: float = 0.95, resamples: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of ``measure`` (method) / ``measure`` (baseline): mean tokens/s, or tau (tokens /
    cycles pooled over prompts; kinds "spec" or "vanilla"). Prompts both ran are resampled in pairs within each
    benchmark, benchmarks weighing equally (docs/DESIGN.md section 11); NaNs when nothing pairs up."""
    if measure not in MEASURES:
        raise ValueError(f"unknown measure {measure!r}: use {' or '.join(MEASURES)}")
    a, b = _prompt_parts(method_records, measure), _prompt_parts(baseline_records, measure)
    common = sorted(set(a) & set(b))
    if not common:
        return math.nan, math.nan
    strata = [[k for k in common if k[0] == bench] for bench in sorted({k[0] for k in common})]
    # per benchmark, [P, 2] arrays of (numerator, denominator) per prompt
    pairs = [(np.array([a[k] for k in keys]), np.array([b[k] for k in keys])) for keys in strata]
    return bootstrap_interval(pairs, level=level, resamples=resamples, seed=seed)


def by_method_temperature(records: Iterable[dict[str, Any]]) -> dict[tuple[str, float], list[dict[str, Any]]]:
    """The records grouped by (run label, temperature), in the order they come (an old study's runs of one method on
    two engines are two groups: :func:`~jakiro_lib.measure.methods.record_label`)."""
    by: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in records:
        by.setdefault((record_label(r), r["temperature"]), []).append(r)
    return by


def versus(records: list[dict[str, Any]], baseline: str, *, level: float = 0.95) -> list[dict[str, Any]]:
    """Every drafted run against method ``baseline`` (e.g. ``eagle2``) on the prompts both ran, per temperature:
    the ratios of tokens/s and of tau with paired bootstrap intervals (:func:`ratio_interval`), and whether
    each interval lies wholly above 1 ("better"), wholly below ("worse") or straddles it ("unresolved"). A run of an
    old two-engine study meets the baseline's run on its own engine where there is one (column ``baseline``)."""
    by = by_method_temperature(records)
    rows = []
    for (method, temp), recs in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        against = record_label(recs[0], baseline)  # the baseline's label on this run's engine
        against = against if (against, temp) in by else baseline
        base = by.get((against, temp))
        if base is None or method == against or recs[0]["kind"] != SPEC:
            continue
        row: dict[str, Any] = {"method": method, "baseline": against, "temperature": temp,
                               "prompts": len({_turn_key(r) for r in recs} & {_turn_key(r) for r in base})}
        for measure in MEASURES:
            a, b = summarize_measure(recs, measure), summarize_measure(base, measure)
            lo, hi = ratio_interval(recs, base, measure=measure, level=level)
            row.update({f"{measure}": a, f"baseline_{measure}": b, f"{measure}_ratio": a / b if b else math.nan,
                        f"{measure}_ci_low": lo, f"{measure}_ci_high": hi,
                        f"{measure}_verdict": "better" if lo > 1 else "worse" if hi < 1 else "unresolved"})
        rows.append(row)
    return rows


def summarize_measure(recs: list[dict[str, Any]], measure: str) -> float:
    """``measure`` of one method's records, benchmarks weighing equally (the point :func:`ratio_interval` brackets)."""
    parts = _prompt_parts(recs, measure)
    per_bench = [sum(v[0] for k, v in parts.items() if k[0] == b) / sum(v[1] for k, v in parts.items() if k[0] == b)
                 for b in sorted({k[0] for k in parts})]
    return statistics.fmean(per_bench) if per_bench else math.nan


def _turn_key(r: dict[str, Any]) -> tuple:
    return r["benchmark"], str(r["question_id"]), r["repeat"], r["turn"]


def _greedy_pairs(method_records: list[dict[str, Any]], vanilla_records: list[dict[str, Any]]
                  ) -> list[tuple[dict[str, Any], list[int]]]:
    """(record, vanilla's output ids) for every prompt where both saw the same prompt: a later turn of a
    question only while every earlier turn matched (each method is fed its own previous answer)."""
    ref = {_turn_key(r): r.get("output_ids") for r in vanilla_records}
    turns: dict[tuple, list[dict[str, Any]]] = {}
    for r in method_records:
        turns.setdefault(_turn_key(r)[:3], []).append(r)
    pairs = []
    for key, recs in turns.items():
        for r in sorted(recs, key=lambda r: r["turn"]):
            expected = ref.get((*key, r["turn"]))
            if expected is None or r.get("output_ids") is None:
                break
            pairs.append((r, expected))
            if r["output_ids"] != expected:
                break
    return pairs


def greedy_agreement(method_records: list[dict[str, Any]], vanilla_records: list[dict[str, Any]]) -> tuple[int, int]:
    """(identical, compared): greedy outputs equal to our vanilla loop's, token for token, per prompt (in fp32
    all must match; in bf16/fp16 :func:`greedy_divergences` tells near ties: docs/DESIGN.md section 7)."""
    pairs = _greedy_pairs(method_records, vanilla_records)
    return sum(r["output_ids"] == expected for r, expected in pairs), len(pairs)


@torch.inference_mode()
def greedy_divergences(target: Target, records: list[dict[str, Any]], questions: Iterable[Any]) -> list[dict[str, Any]]:
    """Where each T=0 output first leaves vanilla's (of the prompts :func:`greedy_agreement` compares), and the target's
    top-2 logit gap there (docs/DESIGN.md section 7): ``gap``, and ``gap_steps`` in units of the dtype's spacing at the
    top logit (bf16: 0.125 at logits 16-32); a few steps is a rounding tie, a large gap a bug."""
    by_key = {(q.benchmark, str(q.question_id)): q for q in questions}
    greedy = [r for r in records if r["temperature"] == 0]
    vanilla = [r for r in greedy if record_label(r) == "vanilla"]  # our loop engine's, the greedy reference
    answers = {_turn_key(r): r["output_ids"] for r in vanilla}
    rows = []
    for method in dict.fromkeys(record_label(r) for r in greedy if record_label(r) != "vanilla"):
        for rec, expected in _greedy_pairs([r for r in greedy if record_label(r) == method], vanilla):
            out = rec["output_ids"]
            if out == expected:
                continue
            q = by_key.get((rec["benchmark"], str(rec["question_id"])))
            if q is None:
                raise ValueError(f"no question {rec['question_id']!r} of {rec['benchmark']!r} among those given")
            pos = next((i for i, (a, b) in enumerate(zip(out, expected)) if a != b), min(len(out), len(expected)))
            history: list[dict[str, str]] = []
            for turn in range(rec["turn"] + 1):
                history.append({"role": "user", "content": q.turns[turn]})
                if turn < rec["turn"]:
                    history.append(answer_message(target, answers[(*_turn_key(rec)[:3], turn)]))
            ids = torch.cat([format_prompt_ids(target, history), torch.tensor(expected[:pos], dtype=torch.long)])
            logits = TargetRunner(target.model, len(ids)).prefill(ids.to(target.device), last=True)[0][-1]
            top = logits.float().topk(2)
            first, second = top.values.tolist()
            spacing = 2.0 ** math.floor(math.log2(max(abs(first), 1e-30))) * torch.finfo(logits.dtype).eps
            rows.append({"method": method, "benchmark": rec["benchmark"], "question_id": str(rec["question_id"]),
                         "turn": rec["turn"], "repeat": rec["repeat"], "position": pos,
                         "method_token": out[pos] if pos < len(out) else None,
                         "vanilla_token": expected[pos] if pos < len(expected) else None,
                         "top1_token": int(top.indices[0]), "top1_logit": first, "gap": first - second,
                         "gap_steps": (first - second) / spacing})
    return rows


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (run, benchmark, temperature): tokens/s, speedup over the fastest vanilla kind (per repeat: mean and std, and
    a bootstrap interval over prompts, :func:`ratio_interval`), tau and tau_ref (cycles - 1; docs/DESIGN.md section 7);
    ``method`` is the run's label (:func:`~jakiro_lib.measure.methods.record_label`), ``engine`` and ``capture`` how it
    ran. At T=0, ``greedy_same`` of ``greedy_compared`` prompts gave vanilla's output (:func:`greedy_agreement`)."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((record_label(r), r["benchmark"], r["temperature"]), []).append(r)

    def per_repeat_tps(recs: list[dict]) -> dict[int, float]:
        by: dict[int, list[float]] = {}
        for r in recs:
            by.setdefault(r["repeat"], []).append(r["tokens_per_second"])
        return {k: statistics.fmean(v) for k, v in by.items()}

    rows = []
    for (method, bench, temp), recs in sorted(groups.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0])):
        tps = per_repeat_tps(recs)
        # baselines are found by kind: "vanilla" (our loop) and "hf" (hf_generate, hf_compiled)
        vanilla = {m: per_repeat_tps(g) for (m, b, t), g in groups.items()
                   if b == bench and t == temp and g[0]["kind"] in VANILLA_KINDS}
        speedups = []
        for rep, v in tps.items():
            base = max((b[rep] for b in vanilla.values() if rep in b), default=math.nan)
            speedups.append(v / base if base and not math.isnan(base) else math.nan)
        tokens = sum(r["new_tokens"] for r in recs)
        cycles = sum(r["cycles"] for r in recs)
        kind = recs[0]["kind"]
        emitted = sum(sum(r["accepted"]) for r in recs)
        # HF generate hides its cycles: no tau for hf/pld; vanilla emits one token per cycle by definition.
        tau = emitted / max(cycles, 1) if kind == SPEC else (1.0 if kind == "vanilla" else math.nan)
        tau_ref = emitted / max(cycles - len(recs), 1) if kind == SPEC else tau
        tps_m, tps_s = _mean_std(list(tps.values()))
        sp_m, sp_s = _mean_std(speedups)
        base_kind = max(vanilla, default=None, key=lambda m: statistics.fmean(vanilla[m].values()))
        ci = ratio_interval(recs, groups[(base_kind, bench, temp)]) if base_kind else (math.nan, math.nan)
        reference = groups.get(("vanilla", bench, temp)) if temp == 0 else None
        same, compared = greedy_agreement(recs, reference) if reference else (None, None)
        rows.append({
            "method": method, "kind": kind, "engine": recs[0].get("engine"), "capture": record_capture(recs[0]),
            "benchmark": bench, "temperature": temp, "questions": len({(r["question_id"], r["turn"]) for r in recs}),
            "tokens_per_s": tps_m, "tokens_per_s_std": tps_s, "speedup": sp_m, "speedup_std": sp_s,
            "speedup_ci_low": ci[0], "speedup_ci_high": ci[1],
            "tau": tau, "tau_ref": tau_ref, "new_tokens": tokens, "cycles": cycles,
            "draft_forwards_per_cycle": sum(r["draft_forwards"] for r in recs) / max(cycles, 1),
            "greedy_same": same, "greedy_compared": compared,
        })
    return rows


def categories(records: list[dict[str, Any]]) -> dict[str, list[str]]:
    """``{benchmark: categories}`` of the benchmarks whose records name more than one question category."""
    found: dict[str, dict[str, None]] = {}
    for r in records:
        if r.get("category") is not None:
            found.setdefault(r["benchmark"], {})[r["category"]] = None
    return {b: list(c) for b, c in found.items() if len(c) > 1}


def summarize_by_category(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """:func:`summarize` per (benchmark, question category), as Spec-Bench reports its 13 categories, for the
    benchmarks whose questions carry more than one category."""
    split = categories(records)
    sep = "\x1f"  # joins benchmark and category into summarize's group key, split again below
    keyed = [{**r, "benchmark": f"{r['benchmark']}{sep}{r['category']}"} for r in records
             if r["benchmark"] in split and r.get("category") is not None]
    rows = []
    for row in summarize(keyed):
        bench, category = row["benchmark"].split(sep, 1)
        rows.append({**row, "benchmark": bench, "category": category})
    return rows


def headline_table(main: pd.DataFrame) -> pd.DataFrame:
    """Mean over benchmarks per (method, temperature): speedup, tau, tokens/s — the index's summary."""
    if main.empty:
        return main
    order = list(dict.fromkeys(main["method"].tolist()))
    g = (main.groupby(["temperature", "method"], sort=False)
         .agg(benchmarks=("benchmark", "nunique"), tokens_per_s=("tokens_per_s", "mean"),
              speedup=("speedup", "mean"), tau=("tau", "mean"), tau_ref=("tau_ref", "mean"))
         .reset_index())
    g["_o"] = g["method"].map({m: i for i, m in enumerate(order)})
    return g.sort_values(["temperature", "_o"]).drop(columns="_o").reset_index(drop=True)
