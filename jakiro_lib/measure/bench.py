"""One evaluation loop for every method of :mod:`jakiro_lib.measure.methods` (Spec-Bench style) and one results schema:
same prompts, chat template, token budget and machine, methods interleaved question by question, each first in turn
(docs/DESIGN.md section 11). Records are JSONL, one line per (method, temperature, question, turn, repeat):
``method`` is the registry's name, ``engine`` and ``capture`` how it ran."""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from tqdm import tqdm

from ..data.chat import answer_message, format_prompt_ids
from ..decoding.compiled import engine_cycles, graphs_compiled, prepare_windows
from ..layout import BENCH_CONFIG, RECORDS_FILE
from ..decoding.methods import MethodRunner, MethodSpec
from .methods import SPEC, portable, record_label
from ..models import kernels
from ..models.target import Target
from ..decoding.result import ContextLengthError
from ..files import end_last_line, read_jsonl, sweep_temps, text_sha256, write_json
from ..machine import environment
from ..decoding.verify import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class Record:
    method: str  # the registry's name (jakiro_auto): engine and capture say how it ran
    kind: str
    benchmark: str
    question_id: str
    turn: int
    repeat: int
    temperature: float
    new_tokens: int
    cycles: int
    accepted: list[int]
    wall_time: float
    prefill_time: float
    draft_forwards: int
    tokens_per_second: float
    tau: float
    stop_reason: str
    output_ids: list[int] = field(default_factory=list)
    category: str | None = None  # the question's category (Spec-Bench's 13, MT-bench's 8); absent in older records
    # graphs compiled or recorded during this timed prompt: 0 when the warm-up covered what it runs
    compiled_graphs: int = 0
    # how the method ran (MethodSpec.runs_on, .capture): "static" (our engine) or "hf"; "none", "graphs" or "inductor"
    engine: str = "static"
    capture: str = "none"
    # what was asked: the sha256 of the question's turns (question_sha); absent in records written before it was
    question_sha256: str | None = None


def question_sha(question: Any) -> str:
    """The sha256 of a question's turns: records answer this text (their benchmark and id only name it)."""
    return text_sha256(json.dumps(list(question.turns)))


def _params(temperature: float, top_p: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p if temperature > 0 else 1.0)


def run_benchmark(target: Target, methods: dict[str, MethodSpec], questions: Iterable[Any], *,
                  temperatures: Iterable[float] = (0.0,), max_new_tokens: int = 128, repeats: int = 1,
                  warmup: int = 1, top_p: float = 1.0, seed: int = 0, out_dir: str | Path,
                  progress: bool = True, tuning: dict[str, Any] | None = None) -> Path:
    """Run every method (keyed by name) on every question turn, appending records to ``out_dir/records.jsonl``; records
    already there (same run, temperature, question, turn, repeat) are skipped. A multi-turn question feeds each method
    its own previous answer. ``tuning``: what the tree budgets were tuned on
    (:func:`~jakiro_lib.measure.budgets.tuning_prompts`; None: none), written to ``bench_config.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sweep_temps(out_dir)  # what a killed writer left of a summary or config
    questions, temperatures = _with_distinct_ids(questions), list(temperatures)
    records_path = out_dir / RECORDS_FILE
    check_context(target, questions, max_new_tokens)
    old = read_jsonl(records_path)  # a line cut by an interruption is skipped: that record is simply redone
    _same_texts(old, questions, records_path)
    done = {(record_label(r), r["temperature"], r["benchmark"], r["question_id"], r["turn"], r["repeat"]) for r in old}
    write_json(out_dir / BENCH_CONFIG, {
        "methods": {k: portable(v, relative_to=out_dir) for k, v in methods.items()},
        "temperatures": temperatures, "max_new_tokens": max_new_tokens, "repeats": repeats, "warmup": warmup,
        "top_p": top_p, "seed": seed, "num_questions": len(questions), "target": dataclasses.asdict(target.config),
        "environment": environment(target.device), "packed_gemm": kernels.gemm_choice(target.model),
        "tree_budget_tuning": tuning,
    })
    runners = {name: MethodRunner(target, spec) for name, spec in methods.items()}
    if warmup and questions:  # first calls pay allocator and kernel set-up: keep them out of the timings
        _warm_up(target, runners, questions[0], temperatures, warmup, min(16, max_new_tokens), top_p, seed)
    late_compiles = 0
    bar = tqdm(total=len(questions) * len(temperatures) * repeats * len(methods), desc="bench", disable=not progress)
    end_last_line(records_path)  # a crash may have cut the last record short
    order, first = list(runners.items()), 0
    with records_path.open("a") as fh:
        for q in questions:
            for temp in temperatures:
                for rep in range(repeats):  # each method first in turn: none keeps one place after another
                    for name, runner in order[first:] + order[:first]:
                        late_compiles += _run_turns(target, name, runner, q, _params(temp, top_p), rep, done, fh,
                                                    max_new_tokens=max_new_tokens, seed=seed)
                        bar.update(1)
                    first = (first + 1) % len(order)
    bar.close()
    if late_compiles:
        log.warning("%d timed prompts compiled graphs (their times include compilation): the warm-up did not "
                    "cover every shape they ran (records' compiled_graphs)", late_compiles)
    return records_path


def _with_distinct_ids(questions: Iterable[Any]) -> list[Any]:
    """The questions, refused where two share a (benchmark, id): records are keyed by the id."""
    questions, seen = list(questions), set()
    for key in ((q.benchmark, str(q.question_id)) for q in questions):
        if key in seen:
            raise ValueError(f"question_id {key[1]!r} of {key[0]!r} is given twice: each question needs an id of its own")
        seen.add(key)
    return questions


def _same_texts(records: list[Any], questions: list[Any], path: Path) -> None:
    """Refuse records that answer another text of a question asked now (records name it by benchmark and id)."""
    asked = {(q.benchmark, str(q.question_id)): question_sha(q) for q in questions}
    for r in records:
        key, sha = (r["benchmark"], str(r["question_id"])), r.get("question_sha256")
        if sha is not None and asked.get(key, sha) != sha:
            raise ValueError(f"{path} holds answers to another text of question {key[1]!r} of {key[0]!r}: write "
                             "these questions' records to another folder")


def check_context(target: Target, questions: Iterable[Any], max_new_tokens: int) -> None:
    """Refuse, before anything runs, a question whose last turn cannot fit the target's context after the earlier
    turns and answers of up to ``max_new_tokens`` each (the last answer stops at the context)."""
    limit = target.config.max_context
    for q in questions:
        empty = {"role": "assistant", "content": ""}  # every turn, an empty answer after each but the last
        history = [m for text in q.turns for m in ({"role": "user", "content": text}, empty)][:-1]
        base, answers = len(format_prompt_ids(target, history)), len(q.turns) - 1
        if base + answers * max_new_tokens + 1 <= limit:
            continue
        room = (limit - 1 - base) // answers if answers else 0
        fits = (f"; at most {room} new tokens (bench.max_new_tokens) fit" if room > 0 else
                ": the prompt alone does not fit")
        raise ContextLengthError(f"question {q.question_id!r} of {q.benchmark!r}: its {len(q.turns)} turn(s) with "
                                 f"answers of up to {max_new_tokens} tokens need {base + answers * max_new_tokens + 1} "
                                 f"positions, more than target.max_context={limit}{fits}")


def _warm_up(target: Target, runners: dict[str, MethodRunner], question: Any, temperatures: list[float],
             times: int, max_new_tokens: int, top_p: float, seed: int) -> None:
    """Each method ``times`` on the first question's first turn at every temperature (a compiled engine samples
    through a step of its own), then every captured engine's attention windows up to the context recorded."""
    ids = format_prompt_ids(target, [{"role": "user", "content": question.turns[0]}])
    before = engine_cycles(target.model)
    for runner in runners.values():
        for temp in temperatures:
            for _ in range(times):
                runner(ids, max_new_tokens=max_new_tokens, params=_params(temp, top_p), seed=seed)
    prepare_windows(target.model, target.config.max_context, before)


def _run_turns(target: Target, name: str, runner: MethodRunner, q: Any, params: SamplingParams, rep: int,
               done: set[tuple], fh: Any, *, max_new_tokens: int, seed: int) -> int:
    """One method on every turn of question ``q`` (fed its own earlier answers), a record per turn not yet
    ``done`` appended to ``fh``; returns how many turns compiled graphs while timed."""
    temp, spec = params.temperature, runner.spec
    keys = [(name, temp, q.benchmark, str(q.question_id), t, rep) for t in range(len(q.turns))]
    if all(k in done for k in keys):
        return 0
    late, history = 0, []
    for turn, (text, key) in enumerate(zip(q.turns, keys)):
        history.append({"role": "user", "content": text})
        ids = format_prompt_ids(target, history)
        graphs = graphs_compiled()
        res = runner(ids, max_new_tokens=max_new_tokens, params=params, seed=seed + 1000 * rep + turn)
        graphs = graphs_compiled() - graphs
        late += graphs > 0
        history.append(answer_message(target, res.output_ids))
        if key in done:
            continue
        rec = Record(
            method=name, kind=spec.kind, benchmark=q.benchmark, question_id=str(q.question_id), turn=turn,
            repeat=rep, temperature=temp, new_tokens=res.new_tokens, cycles=res.cycles,
            accepted=res.accepted, wall_time=res.wall_time, prefill_time=res.prefill_time,
            draft_forwards=res.draft_forwards, tokens_per_second=res.tokens_per_second,
            tau=res.tau if spec.kind == SPEC else 1.0, stop_reason=res.stop_reason,
            output_ids=res.output_ids, category=q.category, compiled_graphs=graphs,
            engine=spec.runs_on, capture=spec.capture(target), question_sha256=question_sha(q),
        )
        fh.write(json.dumps(dataclasses.asdict(rec)) + "\n")
        fh.flush()
    return late
