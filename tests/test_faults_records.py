"""Faults around what the project writes and keeps: atomic writes flushed to the disk and the leftovers of a
killed writer swept; self-distillation resumed after a torn line and keyed by its data; benchmark records keyed
by what was asked and never displaced by a narrower run; a full disk, bad input and odd names said in one line.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

import jakiro_lib.decoding.methods as methods
from jakiro_lib.study.context import StudyContext
from jakiro_lib import files
from jakiro_lib.api import generate
from jakiro_lib.cli import main
from jakiro_lib.config import TargetConfig
from jakiro_lib.data.conversations import Question, load_question_file
from jakiro_lib.measure.bench import question_sha, run_benchmark
from jakiro_lib.decoding.methods import MethodSpec
from jakiro_lib.measure.summary import load_records
from jakiro_lib.models.target import TargetError, load_target
from jakiro_lib.report.plots import plot_speedup
from jakiro_lib.profiles import get_profile
from jakiro_lib.study import prepare_features
from jakiro_lib.study.tables import study_table

from helpers import single_thread

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("JAKIRO_NO_BUSY_CHECK", "1")  # other processes on a shared machine: not under test


# --------------------------------------------------------------------------------------------------
# Atomic writes: flushed before they take the name; a killed writer's leftovers swept
# --------------------------------------------------------------------------------------------------


def test_an_atomic_write_is_flushed_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    dest = tmp_path / "manifest.json"
    files.write_json(dest, {"shards": [1, 2]})
    names = [(kind, Path(p).name) for kind, p in events]
    assert names == [("fsync", "manifest.json"), ("replace", "manifest.json"), ("fsync", tmp_path.name)], events
    assert events[0][1] != str(dest)  # the temporary file, flushed before it takes the name
    events.clear()
    with files.atomic_path(tmp_path / "draft") as tmp:  # a folder: every file in it, then the folder
        tmp.mkdir()
        (tmp / "model.safetensors").write_bytes(b"w")
        (tmp / "draft_config.json").write_text("{}")
    flushed = [Path(p).name for kind, p in events if kind == "fsync"]
    assert flushed[:-1] and set(flushed[:2]) == {"model.safetensors", "draft_config.json"}
    assert flushed[2] == "draft" and flushed[-1] == tmp_path.name and events[3] == ("replace", str(tmp_path / "draft"))


KILLED_WRITER = r"""
import os, sys
from jakiro_lib import files
with files.atomic_path(sys.argv[1]) as tmp:
    tmp.write_text("half a shard")
    os._exit(9)  # as SIGKILL would end it: no cleanup runs
"""


def killed_write(dest: Path) -> Path:
    """The temporary folder a writer killed inside :func:`files.atomic_path` leaves beside ``dest``."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    assert subprocess.run([sys.executable, "-c", KILLED_WRITER, str(dest)], env=env).returncode == 9
    (left,) = [p for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}.")]
    return left


def test_a_killed_writers_temporary_folder_is_swept_and_a_live_ones_kept(tmp_path):
    dead = killed_write(tmp_path / "records.jsonl")
    live = tmp_path / f".summary.csv.tmp{os.getpid()}@{socket.gethostname()}.abcd1234"
    elsewhere = tmp_path / ".summary.csv.tmp1@another-machine.abcd1234"  # its pid means nothing here
    mine_not = tmp_path / ".cache.tmp999999999"  # a user's, not of our naming
    for p in (live, elsewhere, mine_not):
        p.mkdir()
    assert files.sweep_temps(tmp_path) == [dead.name]
    assert not dead.exists() and live.is_dir() and elsewhere.is_dir() and mine_not.is_dir()


def test_the_feature_cache_sweeps_a_killed_writers_shard_when_it_starts(tmp_path):
    profile = get_profile("smoke", **{"data.num_conversations": "4", "data.shard_size": "2", "data.max_length": "64"})
    prepare_features(StudyContext.at(profile, tmp_path), progress=False)
    dead = killed_write(tmp_path / "features" / "shard_00001.safetensors")
    before = (tmp_path / "features" / "manifest.json").read_bytes()
    prepare_features(StudyContext.at(profile, tmp_path), progress=False)
    assert not dead.exists() and (tmp_path / "features" / "manifest.json").read_bytes() == before


# --------------------------------------------------------------------------------------------------
# A full disk: one line naming the disk and the path, whatever write met it
# --------------------------------------------------------------------------------------------------

SMALL = {"data.num_conversations": "6", "data.shard_size": "3", "data.max_length": "96",
         "data.heldout_fraction": "0.34", "train.epochs": "1", "train.max_steps": "2", "bench.limit": "1",
         "bench.max_new_tokens": "4", "bench.warmup": "0",
         "bench.temperatures": "0", "bench.tuned": "false", "bench.compiled_baseline": "false"}


def sets(extra: dict[str, str] | None = None) -> list[str]:
    return [x for k, v in {**SMALL, **(extra or {})}.items() for x in ("--set", f"{k}={v}")]


def cli(capsys, *argv: str) -> tuple[int, str]:
    """(exit status, stderr) of the CLI run in this process, as a shell would see them."""
    capsys.readouterr()
    try:
        with single_thread():
            rc = main(list(argv))
    except SystemExit as exc:  # argparse, or a handler's SystemExit("error: ...")
        rc = exc.code if isinstance(exc.code, int) else (print(exc.code, file=sys.stderr) or 1)
    return rc, capsys.readouterr().err


def assert_one_error(rc: int, err: str, *fragments: str, status: int = 1) -> str:
    """Exit ``status``, no traceback, exactly one ``error:`` line holding every fragment; returns it."""
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == status and "Traceback" not in err and len(lines) == 1, err
    assert all(f in lines[0] for f in fragments), lines[0]
    return lines[0]


def full_disk_on(monkeypatch, cls: type, method: str, code: int = errno.ENOSPC) -> None:
    """``cls.method`` fails as a write to a full disk does: an OSError that names no file."""
    def full(*args, **kwargs):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(cls, method, full)


def mount_of(path: Path) -> str:
    return str(next(p for p in (path, *path.parents) if os.path.ismount(p)))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
def test_a_full_disk_while_caching_is_one_line_naming_the_disk_and_the_file(tmp_path, capsys, monkeypatch, code):
    full_disk_on(monkeypatch, Path, "write_bytes", code)  # the shard's write
    rc, err = cli(capsys, "cache", "--profile", "smoke", "--run-dir", str(tmp_path), *sets())
    line = assert_one_error(rc, err, os.strerror(code), str(tmp_path / "features" / "shard_00000.safetensors"),
                            f"the disk {mount_of(tmp_path)}", "free")
    assert "finished work is kept" in line


def test_a_full_disk_under_torch_save_is_one_line_naming_the_disk_and_the_run(tmp_path, capsys, monkeypatch):
    prepare_features(StudyContext.at(get_profile("smoke", **SMALL), tmp_path), progress=False)

    def save(*args, **kwargs):  # as torch.save fails on a full disk: a second error while closing the file
        try:
            raise RuntimeError("basic_ios::clear: iostream error")
        except RuntimeError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 54592 vs 54480")

    monkeypatch.setattr(torch, "save", save)
    rc, err = cli(capsys, "train", "--profile", "smoke", "--run-dir", str(tmp_path), "--drafts", "dense", *sets())
    assert_one_error(rc, err, "disk", mount_of(tmp_path), str(tmp_path), "free")


def test_a_full_disk_while_benchmarking_is_one_line_and_keeps_the_records(tmp_path, capsys, monkeypatch):
    argv = ["bench", "--profile", "smoke", "--methods", "vanilla", "--run-dir", str(tmp_path), *sets()]
    rc, err = cli(capsys, *argv)
    assert rc == 0, err
    records = tmp_path / "bench" / "main" / "records.jsonl"
    before = records.read_bytes()
    records.write_bytes(before[:before.index(b"\n") + 1])  # one record left to redo
    full_disk_on(monkeypatch, Path, "write_text")  # the benchmark's config and stamp
    rc, err = cli(capsys, *argv)
    assert_one_error(rc, err, "No space left on device", "the disk", str(tmp_path / "bench" / "main"))
    assert records.read_bytes() == before[:before.index(b"\n") + 1]


# --------------------------------------------------------------------------------------------------
# Unchecked input: one line naming the problem, before anything runs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair, fragments", [
    ("target.device=foo", ("target.device", "'foo'", "'cuda:<index>'")),
    ("bench.jakiro_draft=moe2_xgatee", ("bench.jakiro_draft", "'moe2_xgatee'", "moe2_xgate")),
    ("bench.eagle2_draft=dence", ("bench.eagle2_draft", "'dence'", "dense")),
    ("bench.temperatures=", ("bench.temperatures", "empty")),
])
def test_a_bad_setting_is_one_line_before_anything_is_written(tmp_path, capsys, pair, fragments):
    rc, err = cli(capsys, "bench", "--profile", "smoke", "--methods", "vanilla", "--run-dir", str(tmp_path / "run"),
                  *sets(), "--set", pair)
    assert_one_error(rc, err, *fragments)
    assert written(tmp_path / "run") == []


def written(run: Path) -> list[str]:
    """What a command wrote in ``run`` besides the run lock it takes first."""
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.name != ".lock") if run.exists() else []


def test_a_device_torch_reads_is_allowed():
    assert get_profile("smoke", **{"target.device": "cuda:1"}).target.device == "cuda:1"


def test_a_prompt_of_bytes_that_are_not_utf8_is_one_line(capsys):
    rc, err = cli(capsys, "generate", "--profile", "smoke", "--method", "vanilla", "--max-new-tokens", "2",
                  "hi \udcff\udcfe there")  # what Python makes of the argument bytes b"hi \xff\xfe there"
    line = [x for x in err.splitlines() if "error:" in x]
    assert rc == 2 and "Traceback" not in err and len(line) == 1 and "'\\udcff' at character 4" in line[0], err
    with pytest.raises(ValueError, match="not text"):
        generate(load_target(get_profile("smoke").target), "a \ud800 b", method="vanilla", max_new_tokens=2)


def test_a_question_file_with_a_lone_surrogate_is_one_line_before_anything_runs(tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "turns": ["fine"]}\n{"question_id": 2, "turns": ["ok", "hi \\ud800"]}\n')
    rc, err = cli(capsys, "bench", "--profile", "smoke", "--methods", "vanilla", "--run-dir", str(tmp_path / "run"),
                  "--questions", str(questions), *sets())
    assert_one_error(rc, err, f"line 2 in {questions}", "turn 2", "'\\ud800'", "not text")
    assert written(tmp_path / "run") == []


# --------------------------------------------------------------------------------------------------
# Names, paths and words
# --------------------------------------------------------------------------------------------------


def test_a_question_file_name_that_is_not_a_plain_name_is_refused(tmp_path, capsys):
    questions = tmp_path / "q.jsonl"
    questions.write_text('{"question_id": 1, "turns": ["hi"]}\n')
    run = tmp_path / "a" / "run"
    rc, err = cli(capsys, "bench", "--profile", "smoke", "--methods", "vanilla", "--run-dir", str(run),
                  "--questions", str(questions), "--name", "../../x", *sets())
    assert_one_error(rc, err, "--name '../../x'", "plain name")
    assert written(run) == [] and not (tmp_path / "a" / "x").exists() and not (run / "x").exists()


@pytest.fixture(scope="module")
def vanilla_run(tmp_path_factory) -> Path:
    """A run directory where ``bench --methods vanilla`` ran without --out."""
    run = tmp_path_factory.mktemp("vanilla") / "run"
    with single_thread():
        assert main(["bench", "--profile", "smoke", "--methods", "vanilla", "--run-dir", str(run), *sets()]) == 0
    return run


def test_bench_without_out_writes_its_summary_beside_the_records(vanilla_run):
    study = vanilla_run / "bench" / "main"
    assert (study / "summary.csv").is_file() and (study / "summary.json").is_file()


def test_summary_counts_a_records_file_given_twice_once(vanilla_run, capsys):
    records = vanilla_run / "bench" / "main" / "records.jsonl"
    capsys.readouterr()
    assert main(["summary", "--records", str(records)]) == 0
    once = capsys.readouterr().out
    assert main(["summary", "--records", str(records), str(records.parent / ".." / "main" / records.name)]) == 0
    assert capsys.readouterr().out == once


def test_the_headline_figure_says_its_baseline_is_the_fastest_plain_decoder():
    row = {"method": "eagle2", "kind": "spec", "benchmark": "mt_bench", "temperature": 0.0, "speedup": 1.2,
           "speedup_ci_low": 1.1, "speedup_ci_high": 1.3}
    fig = plot_speedup([row, {**row, "method": "hf_generate", "kind": "hf", "speedup": 1.0, "speedup_ci_low": 1.0,
                              "speedup_ci_high": 1.0}])
    title = fig._suptitle.get_text()
    assert "fastest plain decoder" in title and "vanilla" not in title


@pytest.mark.parametrize("model, fragments", [("builtin:smollm3", ("unknown built-in", "builtin:smollm2")),
                                              ("{file}", ("is a file", "folder of a saved model"))])
def test_a_target_that_names_no_model_says_what_it_is_not_the_hub(tmp_path, model, fragments):
    (tmp_path / "weights.bin").write_bytes(b"0")
    with pytest.raises(TargetError) as info:
        load_target(TargetConfig(model=model.format(file=tmp_path / "weights.bin")))
    assert all(f in str(info.value) for f in fragments) and "hub" not in str(info.value), info.value


# --------------------------------------------------------------------------------------------------
# Benchmark records: keyed by what was asked; a narrower or failing run displaces nothing
# --------------------------------------------------------------------------------------------------

PLAIN = "vanilla,hf_generate,lookup_only"  # main-study methods that need no trained draft


def bench(capsys, run: Path, *extra: str, methods: str = PLAIN, limit: str = "2") -> tuple[int, str]:
    return cli(capsys, "bench", "--profile", "smoke", "--methods", methods, "--run-dir", str(run), *sets(),
               "--limit", limit, *extra)


def folder_hash(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A run directory whose main study ran :data:`PLAIN` on 2 questions (2 turns each) to the end."""
    run = tmp_path_factory.mktemp("finished") / "run"
    with single_thread():
        assert main(["bench", "--profile", "smoke", "--methods", PLAIN, "--run-dir", str(run), *sets(),
                     "--limit", "2"]) == 0
    return run


@pytest.fixture
def study(finished, tmp_path) -> Path:
    """A fresh copy of :func:`finished`'s run directory; returns its main study's folder."""
    return Path(shutil.copytree(finished, tmp_path / "run")) / "bench" / "main"


def counted_runs(monkeypatch) -> list[str]:
    calls: list[str] = []
    real = methods.MethodRunner.__call__

    def counted(self, *args, **kwargs):
        calls.append(self.spec.kind)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(methods.MethodRunner, "__call__", counted)
    return calls


def test_a_subset_of_a_finished_study_reuses_its_records_and_moves_nothing(study, capsys, monkeypatch):
    before, calls = folder_hash(study), counted_runs(monkeypatch)
    rc, err = bench(capsys, study.parent.parent, methods="vanilla")
    assert rc == 0 and calls == [] and "moved" not in err, err
    assert sorted(p.name for p in study.iterdir()) == sorted(before) and len(study_lines(study)) == 12
    rc, err = bench(capsys, study.parent.parent, "--temperature", "0", limit="1")
    assert rc == 0 and calls == [] and not list(study.glob("records.stale*")), err


def study_lines(study: Path) -> list[str]:
    return (study / "records.jsonl").read_text().splitlines()


def test_a_narrower_run_with_other_settings_is_refused_and_moves_nothing(study, capsys):
    before = folder_hash(study)
    rc, err = bench(capsys, study.parent.parent, "--set", "bench.max_new_tokens=5", methods="vanilla")
    assert_one_error(rc, err, str(study), "bench.max_new_tokens", "part of them", "--out")
    assert folder_hash(study) == before


def test_a_run_that_fails_its_context_check_moves_nothing(study, capsys):
    before = folder_hash(study)
    rc, err = bench(capsys, study.parent.parent, "--set", "bench.max_new_tokens=100000", limit="1")
    assert_one_error(rc, err, "bench.max_new_tokens", "target.max_context=512", "at most")
    assert folder_hash(study) == before


def test_a_prompt_longer_than_the_context_is_refused_before_any_record(tmp_path, capsys):
    questions = tmp_path / "long.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n"
                                 for i, t in enumerate(["short", "word " * 200, "short again"])))
    rc, err = bench(capsys, tmp_path / "run", "--questions", str(questions), methods="vanilla", limit="3")
    assert_one_error(rc, err, "question '1' of 'long'", "the prompt alone does not fit")
    assert written(tmp_path / "run") == []


def write_questions(path: Path, texts: list[list[str]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"question_id": i, "turns": t}) + "\n" for i, t in enumerate(texts)))
    return path


def test_another_question_file_with_the_same_ids_is_run_not_answered_from_the_first(tmp_path, capsys):
    run = tmp_path / "run"
    first = write_questions(tmp_path / "a" / "q.jsonl", [["Say hi."], ["Count to three."]])
    assert bench(capsys, run, "--questions", str(first), methods="vanilla")[0] == 0
    folder = run / "bench" / "main-q"
    answers = [json.loads(line)["output_ids"] for line in study_lines(folder)]
    second = write_questions(tmp_path / "b" / "q.jsonl", [["Name a colour."], ["Spell 'cat'."]])
    rc, err = bench(capsys, run, "--questions", str(second), methods="vanilla")
    assert rc == 0 and "records.stale.jsonl" in err and "the text of question '0'" in err, err
    records = [json.loads(line) for line in study_lines(folder)]
    assert {r["question_sha256"] for r in records} == {question_sha(q) for q in load_question_file(second, "q")}
    assert [r["output_ids"] for r in records] != answers
    write_questions(second, [["Name a colour."], ["Spell 'dog'."]])  # one text edited in place
    rc, err = bench(capsys, run, "--questions", str(second), methods="vanilla")
    assert rc == 0 and "the text of question '1'" in err and (folder / "records.stale.1.jsonl").is_file(), err


def as_written_before_hashes(folder: Path) -> None:
    """Make a study folder's records and stamp as the benchmark wrote them before they named question texts."""
    lines = [json.loads(line) for line in study_lines(folder)]
    (folder / "records.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if k != "question_sha256"})
                                                  + "\n" for r in lines))
    stamp = json.loads((folder / "study_stamp.json").read_text())
    stamp["questions"] = [q[:2] for q in stamp["questions"]]
    (folder / "study_stamp.json").write_text(json.dumps(stamp))


def test_records_without_question_texts_are_kept_for_the_packaged_benchmarks(study, capsys, monkeypatch):
    as_written_before_hashes(study)
    calls = counted_runs(monkeypatch)
    rc, err = bench(capsys, study.parent.parent)
    assert rc == 0 and calls == [] and not list(study.glob("records.stale*")), err


def test_records_without_question_texts_are_not_reused_for_a_question_file(tmp_path, capsys, monkeypatch):
    run, questions = tmp_path / "run", write_questions(tmp_path / "q.jsonl", [["Say hi."]])
    assert bench(capsys, run, "--questions", str(questions), methods="vanilla")[0] == 0
    as_written_before_hashes(run / "bench" / "main-q")
    calls = counted_runs(monkeypatch)
    rc, err = bench(capsys, run, "--questions", str(questions), methods="vanilla")
    assert rc == 0 and calls and "texts (not recorded then)" in err, err


def test_the_benchmark_refuses_records_of_another_text_in_its_folder(tmp_path):
    target = load_target(get_profile("smoke").target)
    asked = [Question("q1", "writing", ["Say hi."], "mine")]
    run_benchmark(target, {"vanilla": MethodSpec("vanilla")}, asked, max_new_tokens=2, warmup=0, out_dir=tmp_path,
                  progress=False)
    with pytest.raises(ValueError, match="another text of question 'q1'"):
        run_benchmark(target, {"vanilla": MethodSpec("vanilla")}, [Question("q1", "writing", ["Other."], "mine")],
                      max_new_tokens=2, warmup=0, out_dir=tmp_path, progress=False)


COLUMNS = ("method", "benchmark", "temperature", "questions", "tokens_per_s", "speedup", "tau")


@pytest.mark.parametrize("records", sorted(p for p in (REPO / "reports" / "measured").rglob("records.jsonl")
                                           if (p.parent / "summary.csv").is_file()), ids=lambda p: p.parent.name)
def test_committed_records_summarize_to_their_committed_summary(records):
    """Records written before they named question texts read as they did: the summary committed beside them."""
    committed = pd.read_csv(records.parent / "summary.csv")[list(COLUMNS)]
    again = study_table(load_records(records))[list(COLUMNS)]
    pd.testing.assert_frame_equal(again.reset_index(drop=True), committed, check_dtype=False, rtol=1e-6)
