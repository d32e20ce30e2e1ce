"""``python -m jakiro_lib``: the command line over the same functions the notebooks call.

Every sub-command takes ``--profile`` and ``--set section.key=value`` overrides, as a notebook takes its parameters.
Known errors end in one ``error:`` line and a non-zero exit status (130 for Ctrl-C); others keep their traceback.
"""
from __future__ import annotations

import argparse
import logging
import math
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from .commands import (cmd_bench, cmd_cache, cmd_costs, cmd_cycles, cmd_divergences, cmd_export, cmd_generate,
                       cmd_gpucheck, cmd_papercost, cmd_profiles, cmd_summary, cmd_throughput, cmd_train, one_line)
from .data.conversations import not_text
from .errors import exit_status
from .files import check_paths
from .busy import busy_warning
from .distributed import main_rank, world_size
from .measure.cycles import CYCLE_METHODS
from .runlock import run_lock
from .study.gpucheck import CHECK_METHODS
from .config import KINDS, SPEC
from .measure.methods import MAIN, STUDIES
from .measure.random_models import SHAPES
from .profiles import PROFILE_NAMES, parse_overrides
from .report.pipeline import run_pipeline
from .study.context import default_run_dir

# Sub-commands that run torch for a while: they check first whether another torch process is busy here.
BUSY_COMMANDS = ("generate", "cache", "train", "bench", "costs", "cycles", "divergences", "pipeline")


def _bounded(kind: type, low: float, high: float | None = None, *, open_low: bool = False) -> Callable[[str], Any]:
    """argparse ``type``: a ``kind`` number >= ``low`` (> with ``open_low``) and <= ``high``."""
    shown = f"{'>' if open_low else '>='} {low}" + (f" and <= {high}" if high is not None else "")

    def parse(value: str) -> Any:
        try:
            x = kind(value)
        except ValueError:
            x = None
        if x is None or not math.isfinite(x) or (x <= low if open_low else x < low) or (high is not None and x > high):
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'} {shown}, "
                                             f"got {value!r}")
        return x
    return parse


_positive_int = _bounded(int, 1)


def _positive_ints(value: str) -> tuple[int, ...]:
    """argparse ``type``: a comma-separated list of integers >= 1."""
    try:
        return tuple(_positive_int(x) for x in value.split(","))
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {value!r}") from None


def _text(value: str) -> str:
    """argparse ``type``: text (a prompt); bytes that are not UTF-8 are refused."""
    problem = not_text(value)
    if problem:
        raise argparse.ArgumentTypeError(f"the prompt {problem}")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default="default", choices=PROFILE_NAMES, help="named configuration")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a profile field, e.g. --set train.epochs=2 --set tree.depth=5")


def _args_profiles(p: argparse.ArgumentParser) -> None:
    p.add_argument("--show", choices=PROFILE_NAMES)


def _args_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", type=_text)
    p.add_argument("--method", default=SPEC, choices=KINDS, help="method kind (jakiro_lib.measure.methods)")
    p.add_argument("--draft", help="directory of a saved draft (method spec)")
    p.add_argument("--decoupled", action="store_true", help="Jakiro decoupled expert candidates")
    p.add_argument("--ar-steps", type=_bounded(int, 0), default=None, help="CEPD: autoregressive layers before parallel ones")
    p.add_argument("--max-new-tokens", type=_positive_int, default=128)
    p.add_argument("--temperature", type=_bounded(float, 0), default=0.0)
    p.add_argument("--top-p", type=_bounded(float, 0, 1, open_low=True), default=1.0)
    p.add_argument("--seed", type=int, default=0)


def _args_run_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", type=Path, default=None, help="artifacts directory (default runs/<profile>)")


def _args_train(p: argparse.ArgumentParser) -> None:
    _args_run_dir(p)
    p.add_argument("--drafts", nargs="*", help="drafts to train, space- or comma-separated (default: all of the profile's)")
    p.add_argument("--force", action="store_true",
                   help="retrain drafts that are already trained; an interrupted training of the same "
                        "settings still resumes from its checkpoint (delete drafts/.<name>.training "
                        "to start it over)")


def _args_bench(p: argparse.ArgumentParser) -> None:
    _args_run_dir(p)
    p.add_argument("--study", default="main", choices=STUDIES)
    p.add_argument("--methods", help="comma-separated subset of the study's methods (jakiro_lib.measure.methods); "
                                     f"main: {', '.join(m.name for m in MAIN)}")
    p.add_argument("--bench", help="benchmarks, e.g. mt_bench,humaneval,gsm8k (default: the profile's)")
    p.add_argument("--questions", type=Path, metavar="FILE",
                   help="an EAGLE / Spec-Bench / FastChat question.jsonl (question_id, category, turns) "
                        "instead of --bench; per-category rows when it has categories")
    p.add_argument("--name", help="benchmark name for --questions, a plain name (default: the file's name, or "
                                  "its folder's for question.jsonl)")
    p.add_argument("--temperature", type=float, action="append",
                   help="sampling temperature (repeatable; default: the profile's)")
    p.add_argument("--limit", type=_positive_int, help="first N questions of each benchmark (or of --questions)")
    p.add_argument("--skip", type=int, default=0,
                   help="pass over the first N questions of each benchmark (held-out checks)")
    p.add_argument("--out", type=Path, help="directory for records.jsonl and summary.csv, written either way "
                                           "(default runs/<profile>/bench/<study>, with --questions "
                                           "runs/<profile>/bench/<study>-<name>)")


def _args_costs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", type=_positive_ints, default=(1, 2, 4, 6, 8, 12, 16, 24, 32), help="tree sizes n to time")
    p.add_argument("--context", type=_positive_int, default=256)
    p.add_argument("--draft", help="a saved draft: also time its steps and choose total_tokens")
    p.add_argument("--tune-prompts", type=_positive_int, default=4, help="held-out training conversations (first user turns) for the budget choice, at most 4")
    p.add_argument("--out", type=Path, help="write the numbers to this JSON file")


def _args_cycles(p: argparse.ArgumentParser) -> None:
    _args_run_dir(p)
    p.add_argument("--methods", default=",".join(CYCLE_METHODS),
                   help=f"comma-separated methods of the main study (default: {','.join(CYCLE_METHODS)})")
    p.add_argument("--limit", type=_positive_int, help="first N questions of each benchmark, first turns (default: "
                                                       "the profile's bench.limit)")
    p.add_argument("--max-new-tokens", type=_positive_int, help="tokens a prompt (default: bench.max_new_tokens)")
    p.add_argument("--out", type=Path, help="directory for cycles.csv and cycles_config.json (default "
                                           "runs/<profile>/cycles)")


def _args_throughput(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, help="directory for throughput.csv (default runs/<profile>/throughput)")
    p.add_argument("--conversations", type=_positive_int, default=64, help="conversations to cache and train on")
    p.add_argument("--steps", type=_positive_int, default=20, help="timed training steps per variant")
    p.add_argument("--cache-batch-sizes", type=_positive_ints, default=(1, 4, 8, 16), help="conversations per target forward to compare")
    p.add_argument("--drafts", help="comma-separated drafts of the profile to train (default: the first)")
    p.add_argument("--plan-from", type=Path, help="measure nothing: the profile's expected stages from this "
                   "throughput.csv (another machine's), the data tokenized here")


def _args_gpucheck(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", type=Path, default=None, help="where the trained drafts are (default runs/<profile>)")
    p.add_argument("--out", type=Path, help="output directory (default <run-dir>/gpucheck-<device>)")
    p.add_argument("--device", help="default: cuda when there is one, else the profile's")
    p.add_argument("--methods", help=f"comma-separated subset (default {','.join(CHECK_METHODS)})")
    p.add_argument("--profiled-prompts", type=_positive_int, default=4, help="MT-bench first turns the profiler runs")


def _args_papercost(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", default="vicuna-7b", help=f"named target shape ({', '.join(SHAPES)})")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", help="float32, float16 or bfloat16")
    p.add_argument("--out", type=Path, required=True, help="directory for tn.csv, cycles.csv and papercost.json")
    p.add_argument("--context", type=_positive_int, default=256, help="cached positions before each tree / token")
    p.add_argument("--new-tokens", type=_bounded(int, 2), default=64, help="tokens per timed generation")


def _args_divergences(p: argparse.ArgumentParser) -> None:
    p.add_argument("--records", type=Path, required=True,
                   help="records.jsonl of a `bench` run with vanilla at T=0 (its bench_config.json names the target)")
    p.add_argument("--out", type=Path, help="write the divergences to this CSV file")


def _args_summary(p: argparse.ArgumentParser) -> None:
    p.add_argument("--records", type=Path, nargs="+", required=True, help="records.jsonl files of `bench` runs")
    p.add_argument("--common-prompts", action="store_true",
                   help="compare methods only on prompts all of them ran (an interrupted run)")
    p.add_argument("--versus", metavar="METHOD",
                   help="also compare every drafted method with METHOD (e.g. eagle2): tokens/s and tau ratios "
                        "with paired bootstrap intervals (versus_METHOD.csv, the name's other characters as _)")
    p.add_argument("--out", type=Path, help="directory for summary.csv and performance_targets.csv")


def _args_pipeline(p: argparse.ArgumentParser) -> None:
    p.add_argument("--force", action="store_true",
                   help="re-execute the stages even when up to date (and retrain / rerun inside them)")
    p.add_argument("--stages", help="comma-separated subset, e.g. 00,01 (default: all)")
    p.add_argument("--report-dir", type=Path, default=None, help="default reports/<profile>")
    p.add_argument("--run-dir", type=Path, default=None, help="default $JAKIRO_RUNS/<profile> or runs/<profile>")
    p.add_argument("--kernel", default="python3", help="Jupyter kernel name (default python3)")
    p.add_argument("--log-output", action="store_true", help="stream the notebooks' output")


def cmd_pipeline(args: argparse.Namespace) -> int:
    """The study notebooks run with papermill into an HTML report (:mod:`jakiro_lib.report.pipeline`). The one
    handler kept here, not in :mod:`.commands`: commands importing the pipeline would add an import layer."""
    with one_line(ValueError):  # a bad --stages or --set value
        out = run_pipeline(args.profile, overrides=parse_overrides(args.set), force=args.force, stages=args.stages,
                           report_dir=args.report_dir, run_dir=args.run_dir, kernel_name=args.kernel,
                           log_output=args.log_output)
    print(f"reports written to {out} (open {out / 'index.html'})")
    return 0


def _args_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft", type=Path, required=True, help="a saved draft: <run>/drafts/<name> (or its draft/ folder)")
    p.add_argument("--format", required=True, choices=("eagle", "eagle3", "jakiro"),
                   help="eagle: EAGLE-1 layout (EAGLE-2, vLLM method 'eagle', SGLang EAGLE); jakiro: the Jakiro "
                        "authors' layout (Jakiro's or Jakiro*'s); eagle3: refused, with the reason")
    p.add_argument("--out", type=Path, required=True, help="folder for config.json and model.safetensors (new, "
                                                           "empty, or a previous export, which is replaced)")


# name -> (help, handler, its arguments, whether it takes --profile/--set): one row per sub-command
COMMANDS: dict[str, tuple[str, Callable[[argparse.Namespace], int], Callable[[argparse.ArgumentParser], None], bool]] = {
    "profiles": ("list the named profiles (or --show NAME as JSON)", cmd_profiles, _args_profiles, False),
    "generate": ("chat with the target, plain or speculative, streaming the answer", cmd_generate, _args_generate,
                 True),
    "cache": ("cache target features for draft training (notebook 00)", cmd_cache, _args_run_dir, True),
    "train": ("train the profile's drafts (notebook 01)", cmd_train, _args_train, True),
    "bench": ("benchmark methods on the profile's benchmarks (notebook 02)", cmd_bench, _args_bench, True),
    "costs": ("measure target tree / draft step costs; with --draft, tune the tree budget", cmd_costs, _args_costs,
              True),
    "cycles": ("what a decoding cycle costs on this machine, step by step, against a plain step (cycles.csv)",
               cmd_cycles, _args_cycles, True),
    "throughput": ("tokens/s of feature caching and draft training steps on this machine", cmd_throughput,
                   _args_throughput, True),
    "gpucheck": ("the decoding goals on this machine's GPU in one run: plain and speculative decoding "
                 "captured against HF's compiled generate, T=0 and T=1, and the cycle's breakdown from the profiler",
                 cmd_gpucheck, _args_gpucheck, True),
    "papercost": ("paper scale by simulation: T(n), plain decoding and the paper's cycles on a random target of a "
                  "named shape (a GPU), speedups modelled from the paper's tau", cmd_papercost, _args_papercost, False),
    "divergences": ("where greedy benchmark outputs leave vanilla's, and the target's top-2 logit gap there (checks "
                    "low-precision runs)", cmd_divergences, _args_divergences, True),
    "summary": ("tables and speed goals of benchmark records (one or more records.jsonl)", cmd_summary,
                _args_summary, False),
    "export": ("write a saved draft as an EAGLE or Jakiro head (config.json + model.safetensors); --profile names "
               "its target", cmd_export, _args_export, True),
    "pipeline": ("run all notebooks with papermill and write HTML reports", cmd_pipeline, _args_pipeline, True),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jakiro_lib", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_, handler, arguments, common) in COMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if common:
            _common(p)
        arguments(p)
        p.set_defaults(func=handler)
    return parser


FILE_OUT = ("costs", "divergences")  # the commands whose --out is a file; the others' is a directory
LOCKING_COMMANDS = ("cache", "train", "bench")  # one at a time per run directory (and bench's --out); pipeline too
# The commands refused under `accelerate launch` (only cache and train split their work), each with the reason
ONE_PROCESS = {
    "bench": "it times decoding, and processes side by side would share the machine and each run every prompt",
    "pipeline": "each process would run every notebook and write the same report; `accelerate launch -m jakiro_lib "
                "cache` and `train` split their stages' work",
    "gpucheck": "it times decoding, and each process would run every prompt",
    "costs": "it times the target and the draft, and processes side by side would share the machine",
    "cycles": "it times decoding cycles, and processes side by side would share the machine",
    "papercost": "it times the target, and processes side by side would share the device",
    "throughput": "it times each stage, and processes side by side would share the machine",
}


def one_process_refusal(command: str) -> str:
    return (f"error: `{command}` runs in one process ({ONE_PROCESS[command]}); run `python -m jakiro_lib {command}` "
            "without `accelerate launch`")


BENCH_REFUSAL = one_process_refusal("bench")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    with exit_status(hint=lambda: _hint(args), written=lambda: _written_dirs(args)) as status:
        status.code = _run(args, argv)
    return status.code


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    """The command, after the checks every command makes before it loads or writes anything."""
    if args.command in ONE_PROCESS and world_size() > 1:  # before anything loads or writes
        if not main_rank():  # exit 0, or the launcher stops the main process before its one line
            return 0
        print(one_process_refusal(args.command), file=sys.stderr)
        return 1
    if args.command in BUSY_COMMANDS and (warning := busy_warning()):  # a 0.2 s sample: Ctrl-C is one line
        print(warning, file=sys.stderr)
    out, file_out = {"--out": getattr(args, "out", None)}, args.command in FILE_OUT
    check_paths(dirs={"--run-dir": getattr(args, "run_dir", None), "--report-dir": getattr(args, "report_dir", None),
                      **({} if file_out else out)}, files=out if file_out else None)
    if args.command not in LOCKING_COMMANDS:
        return int(args.func(args) or 0)
    with run_lock(*_written_dirs(args), command=f"python -m jakiro_lib {shlex.join(argv)}"):
        return int(args.func(args) or 0)


def _written_dirs(args: argparse.Namespace) -> list[Path]:
    """The directories a command writes: its run directory (where it has one), and its ``--out``."""
    run_dir = getattr(args, "run_dir", None)
    if run_dir is None and hasattr(args, "run_dir"):
        run_dir = default_run_dir(args.profile)
    return [p for p in (run_dir, getattr(args, "out", None)) if p is not None]


def _hint(args: argparse.Namespace) -> str:
    """A likely fix for a known error: a draft path one folder above the saved draft."""
    draft = getattr(args, "draft", None)
    if draft and (Path(draft) / "draft").is_dir():
        return f" (did you mean --draft {Path(draft) / 'draft'}?)"
    return ""


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is at the time (tests and notebooks swap it)."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def _log_to_stderr() -> None:
    """The library's progress lines (resuming, retraining, skipped) on stderr, once per process."""
    lib = logging.getLogger("jakiro_lib")
    if not any(isinstance(h, _StderrHandler) for h in lib.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        lib.addHandler(handler)
        lib.setLevel(min(lib.getEffectiveLevel(), logging.INFO))
        if not main_rank():  # under `accelerate launch` the other processes say only what goes wrong (each their own)
            handler.setLevel(logging.WARNING)
