"""Fault injection on the smoke profile (issue 26): every fault ends in one clear ``error:`` line (or a
said-out-loud resume / repair) and no earlier result is lost or silently changed.

Faults: bad ``--set`` values; a truncated, altered or missing feature shard, a corrupt manifest, a cache
made with other settings; SIGINT and SIGKILL of a ``cache`` / ``train`` / ``bench`` subprocess at several
points (a driver slows the work down so that the signal lands mid-run); a corrupt checkpoint and a cut
records file; a draft pointed at a target with another hidden size, vocabulary or family, a missing or
one-folder-too-high draft path, corrupt draft weights; an empty library left in inductor's cache by a
compilation cut short. Trained drafts are compared by the sha256 of every file before and after.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from safetensors.torch import load_file

from jakiro_lib.study.context import StudyContext
from jakiro_lib import compiling, files, runlock
from jakiro_lib.cli import main
from jakiro_lib.config import DraftConfig
from jakiro_lib.profiles import get_profile
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.data.features import MANIFEST
from jakiro_lib.decoding.compiled import call_compiled
from jakiro_lib.study import prepare_features, train_all
from jakiro_lib.models.target import tiny_model
from jakiro_lib.training.checkpoints import CHECKPOINTS, list_checkpoints

from helpers import single_thread

REPO = Path(__file__).resolve().parent.parent
SMALL = {"data.num_conversations": "6", "data.shard_size": "3", "data.max_length": "96",
         "data.heldout_fraction": "0.34", "train.epochs": "1", "train.max_steps": "2", "bench.limit": "1",
         "bench.max_new_tokens": "4", "bench.warmup": "0", "bench.temperatures": "0", "bench.tuned": "false",
         "bench.compiled_baseline": "false"}
DRAFTS = ("dense", "moe2")
LONGER = {"train.epochs": "4", "train.max_steps": "none"}  # several checkpoints to interrupt between

# Runs the CLI in a subprocess with the slow steps (a cache shard, a training step, a benchmark answer)
# paused for FAULT_PAUSE seconds each, so a signal sent at a fault point lands while work is under way.
DRIVER = r"""
import os, signal, sys, time
import jakiro_lib.data.features as features, jakiro_lib.decoding.methods as methods, jakiro_lib.models.loss as loss
from jakiro_lib.cli import main

# A job a shell starts in the background inherits SIGINT ignored (and Python then installs no handler); a
# user's Ctrl-C in a terminal never is, so the driver restores what a terminal gives.
signal.signal(signal.SIGINT, signal.default_int_handler)

def slowed(fn):
    def wrapper(*args, **kwargs):
        time.sleep(float(os.environ["FAULT_PAUSE"]))
        return fn(*args, **kwargs)
    return wrapper

features.shard_tensors = slowed(features.shard_tensors)
loss.draft_loss = slowed(loss.draft_loss)
methods.MethodRunner.__call__ = slowed(methods.MethodRunner.__call__)
sys.exit(main(sys.argv[1:]))
"""


def sets(extra: dict[str, str] | None = None) -> list[str]:
    return [x for k, v in {**SMALL, **(extra or {})}.items() for x in ("--set", f"{k}={v}")]


def tree_hash(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (hidden work directories left out)."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and not p.relative_to(path).parts[0].startswith(".")}


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setenv("JAKIRO_NO_BUSY_CHECK", "1")  # other processes on a shared machine: not under test


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A run directory with a feature cache, two trained drafts and vanilla benchmark records."""
    run = tmp_path_factory.mktemp("base") / "run"
    profile = get_profile("smoke", **SMALL)
    with single_thread():
        prepare_features(StudyContext.at(profile, run), progress=False)
        train_all(StudyContext.at(profile, run), only=DRAFTS, progress=False)
        assert main(["bench", "--profile", "smoke", "--methods", "vanilla", "--run-dir", str(run), *sets()]) == 0
    return run


@pytest.fixture
def run(base, tmp_path) -> Path:
    """A fresh copy of :func:`base` for one fault."""
    return Path(shutil.copytree(base, tmp_path / "run"))


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


def drafts_hash(run: Path) -> dict[str, dict[str, str]]:
    return {name: tree_hash(run / "drafts" / name) for name in DRAFTS}


def shard(run: Path, index: int = 0) -> Path:
    return run / "features" / f"shard_{index:05d}.safetensors"


# --------------------------------------------------------------------------------------------------
# Bad --set values: rejected before anything is touched
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pair, fragments", [
    ("train.lr=fast", ("train.lr", "'fast'", "a number > 0")),
    ("train.epochs=abc", ("train.epochs", "'abc'", "an integer >= 1")),
    ("train.epochs=-1", ("train.epochs", "'-1'", ">= 1")),
    ("bench.temperatures=hot", ("bench.temperatures", "'hot'", "each a number >= 0")),
    ("train.nope=1", ("unknown config key 'train.nope'", "epochs")),
    ("train.batch_size=0", ("train.batch_size", ">= 1")),
    ("data.heldout_fraction=1.5", ("data.heldout_fraction", "in [0, 1)")),
    ("train.betas=0.9", ("train.betas", "a list of 2 values")),
    ("drafts.moe2.num_experts=x", ("drafts.moe2.num_experts", "'x'", "an integer")),
    ("train.mixed_precision=bf8", ("train.mixed_precision", "'no', 'fp16', 'bf16'")),
    ("train.lr", ("--set expects key=value",)),
    ("train.init_from=nowhere", ("train.init_from=nowhere", "no trained draft at nowhere")),
])
def test_bad_set_value_is_one_line_and_keeps_the_drafts(run, capsys, pair, fragments):
    before = drafts_hash(run)
    rc, err = cli(capsys, "train", "--profile", "smoke", "--run-dir", str(run), "--force", *sets(), "--set", pair)
    assert_one_error(rc, err, *fragments)
    assert drafts_hash(run) == before


def test_a_warm_start_trains_from_another_runs_drafts_keeps_their_vocabulary_and_is_stamped(base, run, tmp_path,
                                                                                             capsys):
    vocab = ["--set", "drafts.dense.draft_vocab_size=64"]
    argv = ["train", "--profile", "smoke", "--drafts", "dense", *sets(), *vocab]
    assert cli(capsys, *argv, "--run-dir", str(run), "--force")[0] == 0  # the draft to start from
    warm = Path(shutil.copytree(base, tmp_path / "warm"))
    # another training split: a vocabulary built from it would differ from the saved draft's
    argv = [*argv, "--run-dir", str(warm), "--set", "data.heldout_fraction=0.5", "--set", f"train.init_from={run}"]
    rc, err = cli(capsys, *argv)
    assert rc == 0 and "retraining" in err, err
    stamp = json.loads((warm / "drafts" / "dense" / "train_stamp.json").read_text())
    assert stamp["train"]["init_from"] == str(run)
    d2t = [load_file(str(r / "drafts" / "dense" / "draft" / "model.safetensors"))["d2t"] for r in (run, warm)]
    assert torch.equal(*d2t)
    rc, err = cli(capsys, *argv)
    assert rc == 0 and "already trained" in err, err


def test_bad_tree_budget_for_bench_keeps_the_records(run, capsys):
    records = (run / "bench" / "main" / "records.jsonl").read_bytes()
    argv = ["bench", "--profile", "smoke", "--run-dir", str(run), *sets(), "--set", "tree.total_tokens=many"]
    rc, err = cli(capsys, *argv)
    assert_one_error(rc, err, "tree.total_tokens", "'many'", "'auto'")
    assert (run / "bench" / "main" / "records.jsonl").read_bytes() == records


def test_pipeline_bad_set_value_is_one_line(capsys, tmp_path):
    rc, err = cli(capsys, "pipeline", "--profile", "smoke", "--set", "train.epochs=abc", "--run-dir",
                  str(tmp_path / "r"), "--report-dir", str(tmp_path / "rep"))
    assert_one_error(rc, err, "train.epochs", "'abc'")
    assert not (tmp_path / "rep").exists()


def test_pipeline_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("jakiro_lib.cli.run_pipeline", interrupted)
    assert_one_error(*cli(capsys, "pipeline", "--profile", "smoke"), "interrupted", status=130)


# --------------------------------------------------------------------------------------------------
# The feature cache: damage is found before training starts, and repaired out loud by `cache`
# --------------------------------------------------------------------------------------------------


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, fragments", [
    (lambda run: truncate(shard(run)), ("shard_00000", "corrupt")),
    (lambda run: flip_last_byte(shard(run, 1)), ("shard_00001", "sha256")),
    (lambda run: shard(run).unlink(), ("shard_00000", "missing")),
    (lambda run: (run / "features" / MANIFEST).write_text("{not json"), (MANIFEST, "corrupt")),
    (lambda run: shutil.rmtree(run / "features"), ("no feature cache",)),
], ids=["truncated", "altered", "missing", "manifest", "no-cache"])
def test_damaged_cache_stops_training_before_any_draft_is_touched(run, capsys, damage, fragments):
    before = drafts_hash(run)
    damage(run)
    rc, err = cli(capsys, "train", "--profile", "smoke", "--run-dir", str(run), "--force", *sets())
    assert_one_error(rc, err, *fragments)
    assert drafts_hash(run) == before
    assert not list((run / "drafts").glob(".*.training"))  # nothing started


def test_cache_repairs_a_truncated_shard_out_loud(run, capsys):
    good = tree_hash(run / "features")
    truncate(shard(run, 1))
    rc, err = cli(capsys, "cache", "--profile", "smoke", "--run-dir", str(run), *sets())
    assert rc == 0 and "repairing the feature cache" in err and "shard_00001" in err, err
    assert {k: v for k, v in tree_hash(run / "features").items() if k != MANIFEST} == \
        {k: v for k, v in good.items() if k != MANIFEST}  # the same bytes as before the damage


def test_cache_with_other_settings_is_refused_and_the_cache_kept(run, capsys):
    good = tree_hash(run / "features")
    rc, err = cli(capsys, "cache", "--profile", "smoke", "--run-dir", str(run), *sets({"data.max_length": "80"}))
    assert_one_error(rc, err, "other settings", "max_length")
    assert tree_hash(run / "features") == good


# --------------------------------------------------------------------------------------------------
# Killed subprocesses: SIGINT is one line and status 130; after SIGKILL too, nothing earlier is lost
# --------------------------------------------------------------------------------------------------


def kill_when(argv: list[str], ready: Callable[[], bool], sig: int, log: Path, pause: float) -> tuple[int, str]:
    """Run the CLI (slowed by ``pause`` s per step) in a subprocess, send ``sig`` once ``ready()``."""
    env = {**os.environ, "FAULT_PAUSE": str(pause), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, *argv], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 120
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                pytest.fail(f"the fault point was never reached:\n{log.read_text()}")
            time.sleep(0.05)
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
    return rc, log.read_text()


def shards_listed(run: Path) -> int:
    try:
        return len(json.loads((run / "features" / MANIFEST).read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


@pytest.mark.parametrize("sig, point", [
    (signal.SIGINT, "after the first shard"), (signal.SIGKILL, "after the first shard"),
    (signal.SIGKILL, "inside the first shard"),
])
def test_killed_caching_resumes_out_loud_to_the_same_shards(base, tmp_path, capsys, sig, point):
    run = tmp_path / "run"
    (run / "features").mkdir(parents=True)
    log = tmp_path / "log"
    ready = (lambda: shards_listed(run) >= 1) if point.startswith("after") else (lambda: _log_says(log, "caching"))
    argv = ["cache", "--profile", "smoke", "--run-dir", str(run), *sets()]
    rc, err = kill_when(argv, ready, sig, log, pause=0.8)
    if sig == signal.SIGINT:
        assert_one_error(rc, err, "interrupted", status=130)
    else:
        assert rc == -signal.SIGKILL
    assert shards_listed(run) < 2  # really cut short
    rc, err = cli(capsys, *argv)
    assert rc == 0
    if point.startswith("after"):
        assert "resuming the feature cache" in err and "1 of 2 shards" in err, err
    shards = {k: v for k, v in tree_hash(run / "features").items() if k.endswith(".safetensors")}
    assert shards == {k: v for k, v in tree_hash(base / "features").items() if k.endswith(".safetensors")}


def _log_says(log: Path, text: str) -> bool:
    return log.is_file() and text in log.read_text()


@pytest.mark.parametrize("sig, force", [(signal.SIGINT, True), (signal.SIGKILL, False)])
def test_killed_training_keeps_the_old_draft_and_resumes_out_loud(run, tmp_path, capsys, sig, force):
    before = drafts_hash(run)
    work = run / "drafts" / ".dense.training"
    argv = ["train", "--profile", "smoke", "--run-dir", str(run), "--drafts", "dense", *sets(LONGER)]
    rc, err = kill_when(argv + ["--force"] * force, lambda: bool(list_checkpoints(work)), sig, tmp_path / "log",
                        pause=0.3)
    if sig == signal.SIGINT:
        assert_one_error(rc, err, "interrupted", status=130)
    else:
        assert rc == -signal.SIGKILL
    assert drafts_hash(run) == before  # the old draft is whole while the new one trains
    rc, err = cli(capsys, *argv, *["--force"] * force)  # the same command: --force too resumes (issue 43)
    assert rc == 0 and "draft dense: resuming an interrupted training from" in err, err
    assert drafts_hash(run)["moe2"] == before["moe2"] and drafts_hash(run)["dense"] != before["dense"]
    assert json.loads((run / "drafts" / "dense" / "results.json").read_text())["epochs_completed"] == 4
    assert not work.exists()
    reference = tmp_path / "reference"  # the same training, never interrupted
    shutil.copytree(run / "features", reference / "features")
    assert cli(capsys, *argv[:4], str(reference), *argv[5:])[0] == 0
    weights = "draft/model.safetensors"
    assert tree_hash(run / "drafts" / "dense")[weights] == tree_hash(reference / "drafts" / "dense")[weights]


def records_lines(run: Path) -> list[str]:
    path = run / "bench" / "main" / "records.jsonl"
    return path.read_text().splitlines() if path.is_file() else []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_killed_benchmark_keeps_its_records_and_resumes(run, tmp_path, capsys, sig):
    (run / "bench").rename(run / "bench.old")
    argv = ["bench", "--profile", "smoke", "--methods", "vanilla", "--run-dir", str(run), *sets({"bench.limit": "3"})]
    rc, err = kill_when(argv, lambda: len(records_lines(run)) >= 2, sig, tmp_path / "log", pause=0.4)
    if sig == signal.SIGINT:
        assert_one_error(rc, err, "interrupted", status=130)
    else:
        assert rc == -signal.SIGKILL
    kept = records_lines(run)
    assert 2 <= len(kept) < 6
    assert cli(capsys, *argv)[0] == 0
    after = records_lines(run)
    assert after[: len(kept)] == kept and len(after) == 6  # 3 questions x 2 turns, none twice
    keys = [(r["question_id"], r["turn"]) for r in map(json.loads, after)]
    assert len(set(keys)) == 6


# --------------------------------------------------------------------------------------------------
# Damaged checkpoints and records
# --------------------------------------------------------------------------------------------------


def test_corrupt_checkpoint_is_one_line_and_keeps_the_draft(run, tmp_path, capsys):
    before = drafts_hash(run)
    argv = ["train", "--profile", "smoke", "--run-dir", str(run), "--drafts", "dense", *sets(LONGER)]
    work = run / "drafts" / ".dense.training"
    kill_when(argv, lambda: bool(list_checkpoints(work)), signal.SIGKILL, tmp_path / "log", pause=0.3)
    truncate(list_checkpoints(work)[-1][1] / "draft" / "model.safetensors")
    rc, err = cli(capsys, *argv)
    assert drafts_hash(run) == before
    assert rc == 0 or assert_one_error(rc, err, CHECKPOINTS)


def test_benchmark_after_a_cut_records_line_loses_nothing(run, capsys):
    path = run / "bench" / "main" / "records.jsonl"
    lines = records_lines(run)
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][: len(lines[-1]) // 2])  # a crash mid-write
    argv = ["bench", "--profile", "smoke", "--methods", "vanilla", "--run-dir", str(run), *sets()]
    assert cli(capsys, *argv)[0] == 0
    parsed = [json.loads(line) for line in records_lines(run) if line.startswith("{") and line.endswith("}")]
    assert len(parsed) == len(lines)


def test_summary_of_a_garbage_records_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "records.jsonl"
    bad.write_text("{cut\nnot json at all\n")
    assert_one_error(*cli(capsys, "summary", "--records", str(bad)), "no records in")


def test_summary_of_a_binary_garbage_records_file_is_one_line(tmp_path, capsys):
    bad = tmp_path / "records.jsonl"
    bad.write_bytes(bytes(range(128, 256)) * 3)
    assert_one_error(*cli(capsys, "summary", "--records", str(bad)), "no records in")


# --------------------------------------------------------------------------------------------------
# Drafts pointed at the wrong target, wrong paths, corrupt weights
# --------------------------------------------------------------------------------------------------


def foreign_draft(path: Path, **target_kw) -> Path:
    DraftModel.build(DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False, contrastive=False),
                     tiny_model("llama", **target_kw)).save(path)
    return path


@pytest.mark.parametrize("argv, fragments", [
    (lambda run, tmp: ["--draft", str(foreign_draft(tmp / "d", hidden_size=96))], ("hidden_size=96", "hidden_size=64")),
    (lambda run, tmp: ["--draft", str(foreign_draft(tmp / "d", vocab_size=300))], ("vocab_size=300", "vocab_size=260")),
    (lambda run, tmp: ["--draft", str(run / "drafts" / "dense" / "draft"), "--set", "target.model=tiny:qwen2"],
     ("model_type='llama'", "model_type='qwen2'")),
    (lambda run, tmp: ["--draft", str(tmp / "nowhere")], ("no saved draft", "nowhere")),
    (lambda run, tmp: ["--draft", str(run / "drafts" / "moe2")], ("no saved draft", "did you mean --draft",
                                                                   "/drafts/moe2/draft?")),
    (lambda run, tmp: [truncate(run / "drafts" / "moe2" / "draft" / "model.safetensors"),
                       "--draft", str(run / "drafts" / "moe2" / "draft")][1:], ("corrupt draft weights",)),
], ids=["hidden-size", "vocabulary", "family", "missing", "one-folder-too-high", "corrupt-weights"])
def test_generate_with_a_wrong_draft_is_one_line(run, tmp_path, capsys, argv, fragments):
    rc, err = cli(capsys, "generate", "--profile", "smoke", "--method", "spec", "--max-new-tokens", "2",
                  *argv(run, tmp_path), "hi")
    assert_one_error(rc, err, *fragments)


def test_bench_with_a_draft_for_another_target_keeps_the_records(run, capsys):
    records = records_lines(run)
    shutil.rmtree(run / "drafts" / "dense" / "draft")
    foreign_draft(run / "drafts" / "dense" / "draft", hidden_size=96)
    rc, err = cli(capsys, "bench", "--profile", "smoke", "--methods", "vanilla,eagle2", "--run-dir", str(run), *sets())
    assert_one_error(rc, err, "hidden_size=96")
    main_dir = run / "bench" / "main"
    kept = [line for name in ("records.jsonl", "records.stale.jsonl") if (main_dir / name).is_file()
            for line in (main_dir / name).read_text().splitlines()]
    assert set(records) <= set(kept)  # moved aside at most, never lost


# --------------------------------------------------------------------------------------------------
# The directory swap itself
# --------------------------------------------------------------------------------------------------


def test_a_crash_inside_the_fallback_swap_leaves_the_old_draft_restorable(tmp_path, monkeypatch):
    old, new = tmp_path / "moe2", tmp_path / ".moe2.training"
    for d, text in ((old, "old"), (new, "new")):
        d.mkdir()
        (d / "weights").write_text(text)
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)  # no renameat2 here
    real_replace, calls = os.replace, []

    def crash_on_second(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise KeyboardInterrupt  # killed between the two renames
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "replace", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        files.replace_dir_atomically(new, old)
    monkeypatch.setattr(files.os, "replace", real_replace)
    assert not old.exists() and files.restore_replaced_dir(old)
    assert (old / "weights").read_text() == "old"


def test_the_swap_replaces_a_whole_directory(tmp_path):
    old, new = tmp_path / "moe2", tmp_path / ".moe2.training"
    old.mkdir()
    (old / "stale").write_text("old")
    new.mkdir()
    (new / "weights").write_text("new")
    files.replace_dir_atomically(new, old)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe2"] and [p.name for p in old.iterdir()] == ["weights"]


# --------------------------------------------------------------------------------------------------
# Two runs at once (issue 43): one run per run directory, the second refused in one line naming the first
# --------------------------------------------------------------------------------------------------

HOLDER = r"""
import sys, time
from jakiro_lib.runlock import run_lock
with run_lock(*sys.argv[1:], command="holder --of the lock"):
    print("locked", flush=True)
    time.sleep(300)
"""


def hold_lock(*dirs: Path) -> subprocess.Popen:
    """Another process holding the run lock of ``dirs``; returns once it holds it."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, *map(str, dirs)], cwd=REPO, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.parametrize("command, locked", [
    (["cache"], "run"), (["train", "--force", "--drafts", "dense"], "run"),
    (["bench", "--methods", "vanilla"], "run"), (["bench", "--methods", "vanilla", "--out", "{out}"], "out"),
], ids=["cache", "train", "bench", "bench-out"])
def test_a_second_run_on_a_locked_directory_is_one_line_naming_the_holder_and_the_lock_dies_with_it(
        run, tmp_path, capsys, command, locked):
    out = tmp_path / "out"
    argv = [c.format(out=out) for c in command] + ["--profile", "smoke", "--run-dir", str(run), *sets()]
    before, records = drafts_hash(run), records_lines(run)
    holder = hold_lock(run if locked == "run" else out)
    try:
        rc, err = cli(capsys, *argv)
        assert_one_error(rc, err, "in use by another run", f"pid {holder.pid}", "holder --of the lock")
        assert drafts_hash(run) == before and records_lines(run) == records
        assert not list((run / "drafts").glob(".*.training"))
    finally:
        holder.kill()  # SIGKILL: no chance to clean up, and still no stale lock
        holder.wait()
    rc, err = cli(capsys, *argv)
    assert rc == 0, err


def test_two_trainings_at_once_the_second_is_refused_and_the_first_completes_stamped(run, tmp_path, capsys):
    argv = ["train", "--profile", "smoke", "--run-dir", str(run), "--drafts", "dense", "--force", *sets()]
    env = {**os.environ, "FAULT_PAUSE": "0.2", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, "-c", DRIVER, *argv], cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    lock = run / runlock.LOCK_FILE
    deadline = time.monotonic() + 60
    while (files.read_json(lock) or {}).get("pid") != first.pid:
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
        time.sleep(0.05)
    rc, err = cli(capsys, *argv)  # the same command again, while the first runs
    assert_one_error(rc, err, "in use by another run", f"pid {first.pid}", "python -m jakiro_lib train")
    assert first.wait(timeout=120) == 0, first.stderr.read()
    assert (run / "drafts" / "dense" / "train_stamp.json").is_file()
    rc, err = cli(capsys, *[a for a in argv if a != "--force"])
    assert rc == 0 and "already trained" in err, err  # the stamp matches: no retraining from scratch


def test_a_pipeline_on_a_locked_run_directory_is_one_line(tmp_path, capsys):
    holder = hold_lock(tmp_path / "r")
    try:
        rc, err = cli(capsys, "pipeline", "--profile", "smoke", "--run-dir", str(tmp_path / "r"), "--report-dir",
                      str(tmp_path / "rep"))
        assert_one_error(rc, err, "in use by another run", f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()


# --------------------------------------------------------------------------------------------------
# Inputs nobody tried yet (issue 43)
# --------------------------------------------------------------------------------------------------


def test_a_question_file_with_a_repeated_question_id_is_one_line(run, tmp_path, capsys):
    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": qid, "category": "x", "turns": [text]}) + "\n"
                                 for qid, text in [(1, "Hi there."), (2, "Name a colour."), (1, "Count to three.")]))
    rc, err = cli(capsys, "bench", "--profile", "smoke", "--methods", "vanilla", "--run-dir", str(run),
                  "--questions", str(questions), *sets())
    assert_one_error(rc, err, "question_id '1'", "lines 1 and 3", str(questions))
    assert not list((run / "bench").glob("main-*"))  # nothing benchmarked


@pytest.mark.parametrize("command", ["summary", "divergences"])
@pytest.mark.parametrize("lines", [
    [{"question_id": 1, "category": "x", "turns": ["Hi."]}],  # a question file
    [{"method": "vanilla", "benchmark": "mt_bench"}],  # records of something else
    [["not", "an", "object"]],
], ids=["questions", "other-objects", "lists"])
def test_summary_and_divergences_of_a_file_that_is_not_records_is_one_line(tmp_path, capsys, command, lines):
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    extra = ["--profile", "smoke"] if command == "divergences" else []
    assert_one_error(*cli(capsys, command, *extra, "--records", str(path)), str(path), "not benchmark records")


def not_a_model(tmp: Path, config: bool) -> Path:
    """A folder that is not a model: notes only, or a llama config.json without weights or tokenizer."""
    (tmp / "m").mkdir()
    (tmp / "m" / "notes.txt").write_text("not a model")
    if config:
        (tmp / "m" / "config.json").write_text(tiny_model("llama").config.to_json_string())
    return tmp / "m"


@pytest.mark.parametrize("config", [False, True], ids=["no-config", "config-only"])
@pytest.mark.parametrize("command", [["generate", "--max-new-tokens", "2", "hi"], ["cache"], ["costs", "--sizes", "1"],
                                     ["bench", "--methods", "vanilla"]], ids=lambda c: c[0])
def test_a_target_folder_that_is_not_a_model_is_one_line(run, tmp_path, capsys, command, config):
    model = not_a_model(tmp_path, config)
    where = ["--run-dir", str(run)] if command[0] in ("cache", "bench") else []
    rc, err = cli(capsys, *command, "--profile", "smoke", *where, *sets({"target.model": str(model)}))
    assert_one_error(rc, err, "cannot load target", str(model))


def test_ctrl_c_while_the_cli_is_still_importing_is_one_line_and_status_130():
    # SIGINT as a terminal leaves it: a test run started in the background hands its children SIGINT ignored,
    # and Python then keeps it ignored (the command finished with status 0 under `nohup make test &`)
    proc = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "jakiro_lib", "profiles"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stderr:  # -X importtime: one line per module imported, torch's long before the CLI's
        seen.append(line)
        if line.split("|")[-1].strip() == "torch":
            proc.send_signal(signal.SIGINT)
            break
    err = "".join(seen) + proc.stderr.read()
    rc = proc.wait(timeout=60)
    assert_one_error(rc, "\n".join(x for x in err.splitlines() if not x.startswith("import time:")), "interrupted",
                     status=130)


@pytest.mark.parametrize("content", ['[{"machine": {}}]', '{"machines": "none"}', '{"machines": [1, 2]}',
                                     '{"machines": [{"machine": {}, "target_costs_s": [], "choices": {}}]}',
                                     '{"machines": [{"machine": {}, "target_costs_s": {"1": "x"}, "choices": 3}]}'],
                         ids=["list", "string", "numbers", "costs-list", "bad-values"])
def test_a_tree_budgets_file_of_the_wrong_shape_is_measured_again_out_loud(run, capsys, content):
    budgets = run / "bench" / "tree_budgets.json"
    budgets.write_text(content)
    argv = ["bench", "--profile", "smoke", "--methods", "eagle2_auto", "--run-dir", str(run), "--out",
            str(run / "bench" / "auto"), *sets({"bench.tuned": "true"})]
    rc, err = cli(capsys, *argv)
    assert rc == 0 and "Traceback" not in err and "not a tree-budget cache" in err and str(budgets) in err, err
    assert json.loads(budgets.read_text())["machines"][0]["choices"]  # rewritten, whole


def read_only(path: Path, monkeypatch) -> None:
    """Make ``path`` unwritable: chmod where that binds; as root (it does not), every os.open for writing and
    every mkdir under it fails as the kernel would refuse them (the CLI's own writes all start with one)."""
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode & ~0o222)
    if os.geteuid() != 0:
        return
    real_open, real_mkdir = os.open, os.mkdir

    def refused(p: Any) -> bool:
        return Path(os.path.abspath(p)).is_relative_to(path)

    def open_(p, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and refused(p):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, flags, *args, **kwargs)

    def mkdir(p, *args, **kwargs):
        if refused(p):
            raise PermissionError(13, "Permission denied", str(p))
        return real_mkdir(p, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(os, "mkdir", mkdir)


@pytest.mark.parametrize("command", [["cache"], ["train", "--force", "--drafts", "dense"], ["bench", "--methods", "vanilla"],
                                     ["costs", "--sizes", "1", "--out", "{run}/costs.json"],
                                     ["summary", "--records", "{run}/bench/main/records.jsonl", "--out", "{run}/t"]],
                         ids=lambda c: c[0])
def test_a_run_directory_that_cannot_be_written_is_one_line(run, capsys, monkeypatch, command):
    before = tree_hash(run)
    read_only(run, monkeypatch)
    try:
        argv = [c.format(run=run) for c in command]
        where = ["--run-dir", str(run)] if command[0] in ("cache", "train", "bench") else []
        smoke = [] if command[0] == "summary" else ["--profile", "smoke", *sets()]
        assert_one_error(*cli(capsys, *argv, *where, *smoke), "Permission denied", str(run))
    finally:
        monkeypatch.undo()
        for p in [run, *run.rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)
    assert tree_hash(run) == before


def test_cache_on_a_complete_cache_leaves_its_manifest_alone(run, capsys):
    manifest = run / "features" / MANIFEST
    before = manifest.read_bytes(), manifest.stat().st_mtime_ns
    rc, err = cli(capsys, "cache", "--profile", "smoke", "--run-dir", str(run), *sets())
    assert rc == 0, err
    assert (manifest.read_bytes(), manifest.stat().st_mtime_ns) == before


@pytest.mark.parametrize("method", ["vanilla", "hf", "pld", "spec"])
def test_max_new_tokens_past_the_context_is_one_rule_said_once(run, capsys, method):
    draft = ["--draft", str(run / "drafts" / "dense" / "draft")] if method == "spec" else []
    rc, err = cli(capsys, "generate", "--profile", "smoke", "--method", method, *draft, "--max-new-tokens", "100000",
                  "--set", "target.max_context=64", "hi")
    said = [line for line in err.splitlines() if "100000" in line]
    assert rc == 0 and len(said) == 1 and "context" in said[0] and "friendly reminder" not in err, err
    room = int(said[0].split("room for ")[1].split()[0])
    tokens = int(err.split("\n[")[-1].split()[0])
    assert 0 < room < 64 and tokens <= room


def test_training_with_other_data_settings_than_the_cache_is_one_line(run, capsys):
    before = drafts_hash(run)
    rc, err = cli(capsys, "train", "--profile", "smoke", "--run-dir", str(run), "--force", *sets({"data.max_length": "80"}))
    assert_one_error(rc, err, "max_length", "96", "80", "cache")
    assert drafts_hash(run) == before


def test_training_without_a_cache_names_the_cache_command(run, capsys):
    shutil.rmtree(run / "features")
    rc, err = cli(capsys, "train", "--profile", "smoke", "--run-dir", str(run), "--force", *sets())
    line = assert_one_error(rc, err, "no feature cache", "python -m jakiro_lib cache")
    assert "cache_features" not in line


# A later process meeting a damaged library of inductor's cache (the damage only shows in a new process: one that
# loaded the library keeps it): compiled once without the repair, then once with it.
LATER_PROCESS = r"""
import torch
from torch._inductor.utils import clear_caches
from jakiro_lib import compiling
from jakiro_lib.decoding.compiled import CompileError, call_compiled

def f(x):
    return (x * 2).sin() + 1

def compiled():
    torch._dynamo.reset()
    clear_caches()
    return call_compiled(torch.compile(f, fullgraph=True), X, device=torch.device("cpu"), first=True)

X = torch.linspace(-3, 3, 64)
repair = compiling.repair_compile_cache
compiling.sweep_compile_cache = lambda: []  # the reactive repair alone: as where the libraries were cut just now
compiling.repair_compile_cache = lambda error: []
try:
    compiled()
    print("unrepaired: compiled")
except CompileError as e:
    print("unrepaired:", e)
compiling.repair_compile_cache, compiling.REPAIRS = repair, 1  # one repair mends every library the cut left empty
print("repaired:", "same" if torch.allclose(compiled(), f(X), atol=1e-5) else "different")
"""


def test_a_compilation_cut_short_is_rebuilt_and_a_failure_names_its_cause(tmp_path):
    """A compilation killed while linking leaves the libraries it was building empty in inductor's cache, which
    inductor (building only what its cache lacks) then failed to load in every later process, under an error that
    blamed a missing C++ compiler (seen 2026-11-28 after a timed-out dry run, two libraries left empty). The first
    compiled call now deletes the one it failed on and every other empty one, then compiles again; without that
    repair the error names the cause."""
    from torch._inductor.utils import fresh_cache  # loads inductor: only for the test that compiles

    def f(x):  # as LATER_PROCESS's
        return (x * 2).sin() + 1

    def g(x):  # another kernel, whose library the later process never loads
        return (x + 1).cos() * 3

    with fresh_cache(dir=str(tmp_path)):
        for fn in (f, g):
            torch._dynamo.reset()
            call_compiled(torch.compile(fn, fullgraph=True), torch.zeros(64), device=torch.device("cpu"), first=True)
        torch._dynamo.reset()
        libraries = sorted(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).rglob("*.main.so"))  # f's and g's kernels
        assert len(libraries) == 2
        cut = time.time() - 2 * compiling.SETTLED_S
        for lib in libraries:  # what a kill mid-link leaves (a new file: this process still maps the old one)
            lib.unlink()
            lib.write_bytes(b"")
            os.utime(lib, (cut, cut))
        out = subprocess.run([sys.executable, "-c", LATER_PROCESS], capture_output=True, text=True, cwd=REPO,
                             timeout=300)
        said = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "file too short" in said["unrepaired"] and "without compile" in said["unrepaired"], out.stdout
        assert said["repaired"] == "same", out.stdout
        assert all(lib.stat().st_size > 0 for lib in libraries if lib.exists())  # rebuilt (f's) or deleted (g's)


def test_the_first_compilation_of_a_process_sweeps_out_empty_libraries(tmp_path, monkeypatch):
    """Before a process compiles, the settled empty libraries of inductor's cache go (a damaged ISA probe would
    otherwise silently cost the vector kernels); a library being linked now, and any whole one, stay."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def library(seed: str) -> Path:  # as inductor names and places one: <cache>/<hash[1:3]>/c<hash>.so
        name = "c" + (seed * 51)[:51]
        return tmp_path / name[1:3] / f"{name}.so"

    cut, fresh, whole, gone = library("ab"), library("cd"), library("ab7"), library("cd7")
    for lib, data in ((cut, b""), (fresh, b""), (whole, b"\x7fELF")):
        lib.parent.mkdir(exist_ok=True)
        lib.write_bytes(data)
        lib.with_suffix(".cpp").write_text("// source")
    gone.with_suffix(".cpp").write_text("// source")
    gone.symlink_to(tmp_path / "nowhere.so")  # listed, then gone: another rank's sweep
    settled = time.time() - 2 * compiling.SETTLED_S
    for lib in (cut, whole):
        os.utime(lib, (settled, settled))
    assert compiling.sweep_compile_cache.__wrapped__() == [cut.resolve()]
    assert not cut.exists() and fresh.exists() and whole.exists()

    swept: list[int] = []
    monkeypatch.setattr(compiling, "sweep_compile_cache", lambda: swept.append(1) or [])
    named = {"what": "a test's call", "remedy": "none"}
    assert compiling.run_compiling(lambda: 3, compiling=False, **named) == 3 and swept == []
    assert compiling.run_compiling(lambda: 4, compiling=True, **named) == 4 and swept == [1]


def test_a_later_graphs_compiler_failure_is_one_error_and_other_failures_pass_through():
    """A call that does not compile first can still compile a new graph (a new tree shape): its backend's failure
    is the one error line too; any other failure of such a call is raised as it is."""
    import torch._dynamo.exc as dynamo_exc

    def failing(exc: Exception):
        def call():
            raise exc
        return call

    named = {"what": "the compiled draft", "remedy": "set target.capture", "error": compiling.CompileError}
    inner = RuntimeError("C++ compile error: VecMask<unsigned char> against VecMask<float>")
    with pytest.raises(compiling.CompileError, match="the compiled draft failed .*VecMask.*set target.capture"):
        compiling.run_compiling(failing(dynamo_exc.BackendCompilerFailed(lambda: None, inner, None)),
                                compiling=False, **named)
    with pytest.raises(KeyError):
        compiling.run_compiling(failing(KeyError("a bug, not a compiler")), compiling=False, **named)


def test_a_failed_cpp_build_is_named_by_the_compilers_first_error():
    """Inductor's C++ that does not build fails as the compiler's command (the innermost exception) under an error
    holding the compiler's output: the line names the compiler's first error, not the command."""
    output = ("C++ compile error\n\nCommand:\ng++ /tmp/k.cpp -O3\n\nOutput:\n/tmp/k.cpp: In function 'void kernel()':\n"
              "/tmp/k.cpp:120:44: error: operands to '?:' have different types\n/tmp/k.cpp:293:58: error: expected "
              "primary-expression before 'float'\n")
    try:
        try:
            raise subprocess.CalledProcessError(1, ["g++", "/tmp/k.cpp", "-O3"])
        except subprocess.CalledProcessError as command:
            raise RuntimeError(output) from command
    except RuntimeError as e:
        assert compiling.compile_cause(e) == "RuntimeError: operands to '?:' have different types"
        assert compiling.compile_cause(e.__cause__).startswith("CalledProcessError: Command '['g++'")
