import subprocess
import sys

import pytest

from jakiro_lib import cli, commands
from jakiro_lib.cli import build_parser, main


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "jakiro_lib", "--help"], capture_output=True, text=True, check=True)
    for cmd in ("profiles", "generate", "cache", "train", "bench", "divergences", "summary", "costs", "pipeline"):
        assert cmd in out.stdout


def test_profiles_command(capsys):
    assert main(["profiles"]) == 0
    assert "vicuna-7b" in capsys.readouterr().out
    assert main(["profiles", "--show", "smoke"]) == 0
    assert '"tiny:llama"' in capsys.readouterr().out


def test_generate_smoke_streams_text(capsys):
    assert main(["generate", "--profile", "smoke", "--method", "vanilla", "--max-new-tokens", "5", "hello"]) == 0
    captured = capsys.readouterr()
    assert "5 tokens" in captured.err


def test_generate_with_prompt_lookup_alone(capsys):
    with pytest.raises(SystemExit, match="lookup_tokens"):
        main(["generate", "--profile", "smoke", "--method", "spec", "hi"])  # nothing to draft with
    argv = ["generate", "--profile", "smoke", "--method", "spec", "--set", "tree.lookup_tokens=4",
            "--max-new-tokens", "6", "the the the the"]
    assert main(argv) == 0
    assert "6 tokens" in capsys.readouterr().err


def test_bad_override_is_reported_without_traceback():
    args = build_parser().parse_args(["generate", "--profile", "smoke", "--set", "train.nope=1", "hi"])
    try:
        args.func(args)
    except SystemExit as exc:
        assert "unknown config key" in str(exc)
    else:
        raise AssertionError("expected SystemExit")


@pytest.mark.parametrize("argv, message", [
    (["cache", "--run-dir", "{f}"], "--run-dir {f}: {f} is a file, not a directory"),
    (["train", "--run-dir", "{f}/sub"], "--run-dir {f}/sub: {f} is a file, not a directory"),
    (["bench", "--out", "{f}"], "--out {f}: {f} is a file, not a directory"),
    (["throughput", "--out", "{f}/x"], "--out {f}/x: {f} is a file, not a directory"),
    (["costs", "--out", "{d}"], "--out {d} is a directory; give a file name"),
    (["costs", "--out", "{f}/costs.json"], "--out {f}/costs.json: {f} is a file, not a directory"),
    (["pipeline", "--report-dir", "{f}"], "--report-dir {f}: {f} is a file, not a directory"),
])
def test_an_output_path_that_cannot_be_used_is_refused_before_anything_runs(tmp_path, capsys, argv, message):
    blocker, folder = tmp_path / "notes.txt", tmp_path / "out"
    blocker.write_text("a user's file")
    folder.mkdir()
    fill = lambda a: a.format(f=blocker, d=folder)  # noqa: E731
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main([argv[0], "--profile", "smoke", *map(fill, argv[1:])]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "error: " + fill(message) and not any("Traceback" in line for line in err)
    assert blocker.read_text() == "a user's file" and sorted(p.name for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("argv", [
    ["generate", "--max-new-tokens", "0", "hi"], ["generate", "--max-new-tokens", "-3", "hi"],
    ["bench", "--limit", "0"], ["costs", "--sizes", "0,1"], ["costs", "--sizes", "a"], ["costs", "--context", "0"],
    ["throughput", "--steps", "0"], ["gpucheck", "--profiled-prompts", "-1"],
    ["generate", "--temperature", "-1", "hi"], ["generate", "--temperature", "nan", "hi"],
    ["generate", "--top-p", "0", "hi"], ["generate", "--top-p", "1.5", "hi"], ["generate", "--ar-steps", "-2", "hi"],
])
def test_a_number_out_of_range_is_refused_by_the_parser(tmp_path, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main([argv[0], "--profile", "smoke", *argv[1:]])
    option = next(a for a in argv if a.startswith("--"))
    assert exc.value.code == 2 and f"argument {option}: expected" in capsys.readouterr().err.splitlines()[-1]


def test_no_questions_left_is_one_error_line(tmp_path):
    with pytest.raises(SystemExit, match=r"^error: no benchmark questions to run for mt_bench \(bench.skip=0, "
                                         r"bench.limit=0; not loaded: none\)$"):
        main(["bench", "--profile", "smoke", "--run-dir", str(tmp_path), "--methods", "vanilla", "--set", "bench.limit=0"])


def test_costs_command_writes_a_results_file(tmp_path):
    out = tmp_path / "costs.json"
    assert main(["costs", "--profile", "smoke", "--sizes", "1,2,4", "--context", "16", "--out", str(out)]) == 0
    import json

    data = json.loads(out.read_text())
    assert set(data["target_tree_ms"]) == {"1", "2", "4"} and data["environment"]["torch"]


def test_costs_command_with_a_draft_tunes_and_times_drafting_per_cycle(tmp_path):
    import json

    from jakiro_lib.config import DraftConfig
    from jakiro_lib.profiles import get_profile
    from jakiro_lib.models.draft import DraftModel
    from jakiro_lib.models.target import load_target

    target = load_target(get_profile("smoke").target)
    DraftModel.build(DraftConfig(num_experts=2), target.model).save(tmp_path / "draft")
    out = tmp_path / "costs.json"
    argv = ["costs", "--profile", "smoke", "--sizes", "1,2,4", "--context", "16", "--draft", str(tmp_path / "draft"),
            "--tune-prompts", "1", "--set", "tree.decoupled=true", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    tuning, tree = data["tuning"], get_profile("smoke").tree
    fixed = f"d{tree.depth} k{tree.top_k} n{tree.total_tokens}"
    # the tuned tree (the profile's depth and width: they are not "auto") and the profile's tree
    assert set(data["draft_cycle_ms"]) == {f"d{min(tree.depth, tuning['best'] - 1)} k3 n{tuning['best']}", fixed}
    # tuned as the benchmark tunes: one held-out training conversation, checked against the fixed tree
    assert tuning["fixed"] == fixed and len(data["tuning_prompts"]["conversations"]) == 1
    assert data["tuning_prompts"]["split"] and data["tuning_prompts"]["source"] == get_profile("smoke").data.source
    assert all(ms > 0 for ms in data["draft_cycle_ms"].values())


def test_bench_command_subset_of_methods_benchmarks_and_out_dir(tmp_path, capsys):
    import json

    out = tmp_path / "out"
    argv = ["bench", "--profile", "smoke", "--methods", "vanilla,hf_generate", "--bench", "gsm8k",
            "--temperature", "0", "--limit", "2", "--set", "bench.max_new_tokens=4", "--set", "bench.warmup=0",
            "--run-dir", str(tmp_path / "runs"), "--out", str(out)]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {(r["method"], r["benchmark"], r["temperature"]) for r in records} == {
        ("vanilla", "gsm8k", 0.0), ("hf_generate", "gsm8k", 0.0)}
    assert len(records) == 4 and (out / "summary.csv").is_file()
    assert "hf_generate" in capsys.readouterr().out
    # the position-by-position check against vanilla, on the target the records name (fp32: identical)
    assert main(["divergences", "--profile", "default", "--records", str(out / "records.jsonl")]) == 0
    printed = capsys.readouterr().out
    assert "tiny:llama in float32" in printed and "hf_generate          2/2" in printed and "no divergences" in printed
    # the same tables from the records alone (a run copied back from another machine)
    assert main(["summary", "--records", str(out / "records.jsonl"), "--out", str(tmp_path / "tables")]) == 0
    printed = capsys.readouterr().out
    assert "hf_generate" in printed and "no speed goals to judge" in printed
    assert (tmp_path / "tables" / "summary.csv").is_file()
    with pytest.raises(SystemExit, match="no records file"):
        main(["summary", "--records", str(tmp_path / "nope.jsonl")])
    lone = tmp_path / "lone" / "records.jsonl"
    lone.parent.mkdir()
    lone.write_text("".join(json.dumps(r) + "\n" for r in records if r["method"] != "vanilla"))
    with pytest.raises(SystemExit, match="no greedy .* 'vanilla'"):
        main(["divergences", "--profile", "smoke", "--records", str(lone)])
    first = [r["question_id"] for r in records if r["method"] == "vanilla"]
    held_out = tmp_path / "held_out"  # --skip: the questions after the first N (prompts no study used)
    argv = [a if a != str(out) else str(held_out) for a in argv] + ["--skip", "1"]
    argv[argv.index("--methods") + 1] = "vanilla"
    assert main(argv) == 0
    later = [json.loads(line)["question_id"] for line in (held_out / "records.jsonl").read_text().splitlines()]
    assert later[0] == first[1] and len(later) == 2 and later[1] not in first


def test_bench_command_unknown_method_is_a_clear_error(tmp_path):
    try:
        main(["bench", "--profile", "smoke", "--methods", "vanilla,medusa", "--run-dir", str(tmp_path)])
    except SystemExit as exc:
        assert "medusa" in str(exc) and "jakiro_cepd" in str(exc)
    else:
        raise AssertionError("expected SystemExit")
    # an ablation's name may hold a comma: it is one name in the list, and only the unknown one is named
    with pytest.raises(SystemExit, match=r"unknown method\(s\) \['nope'\]"):
        main(["bench", "--profile", "smoke", "--study", "ablations", "--methods", "vanilla,experts=2, coupled,nope",
              "--run-dir", str(tmp_path)])


def test_summary_command_judges_the_speed_goals_of_pooled_records(tmp_path, capsys):
    import json

    def recs(method, kind, tps, temp):
        return [{"method": method, "kind": kind, "benchmark": "mt_bench", "temperature": temp, "question_id": q,
                 "turn": 0, "repeat": 0, "tokens_per_second": tps, "new_tokens": 10, "cycles": 5,
                 "accepted": [2] * 5, "draft_forwards": 0, "wall_time": 1.0} for q in range(3)]

    for temp in (0.0, 1.0):
        rows = (recs("vanilla", "vanilla", 10.0, temp) + recs("hf_generate", "hf", 15.0, temp)
                + recs("hf_prompt_lookup", "pld", 20.0, temp) + recs("eagle2", "spec", 24.0, temp)
                + recs("jakiro", "spec", 30.0, temp)[: 2 if temp else 3])  # T=1 was cut short
        (tmp_path / f"t{temp:g}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["summary", "--records", str(tmp_path / "t0.jsonl"), str(tmp_path / "t1.jsonl"), "--common-prompts",
            "--out", str(tmp_path / "tables")]
    assert main(argv) == 0
    goals = json.loads((tmp_path / "tables" / "performance_targets.json").read_text())
    ratio = {(g["goal"], g["temperature"]): g["ratio"] for g in goals}
    assert ratio[("Jakiro >= 1.5x HF generate (greedy)", 0.0)] == pytest.approx(2.0)  # 30 / 15 tokens/s
    assert ratio[("our vanilla loop within 5% of HF generate", 0.0)] == pytest.approx(10 / 15)
    assert ratio[("Jakiro >= EAGLE-2 (tokens/s)", 1.0)] == pytest.approx(1.25)
    summary = json.loads((tmp_path / "tables" / "summary.json").read_text())
    assert {r["questions"] for r in summary if r["temperature"] == 1.0} == {2}  # prompts all methods ran
    assert "Jakiro >= 1.3x HF sampling" in capsys.readouterr().out
    # --versus: each drafted method against EAGLE-2 with paired intervals, one table per run
    assert main(argv + ["--versus", "eagle2"]) == 0
    assert "against eagle2" in capsys.readouterr().out
    vs = json.loads((tmp_path / "tables" / "versus_eagle2.json").read_text())
    assert {(r["method"], r["temperature"]) for r in vs} == {("jakiro", 0.0), ("jakiro", 1.0)}
    assert all(r["tokens_per_s_ratio"] == pytest.approx(1.25) and r["tau_ratio"] == pytest.approx(1.0) for r in vs)
    for r in rows:  # a baseline named like the ablations' EAGLE-2 row gets a plain file name
        r["method"] = {"eagle2": "experts=1 (eagle2)"}.get(r["method"], r["method"])
    (tmp_path / "abl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["summary", "--records", str(tmp_path / "abl.jsonl"), "--versus", "experts=1 (eagle2)",
                 "--out", str(tmp_path / "abl")]) == 0
    assert (tmp_path / "abl" / "versus_experts_1_eagle2.csv").is_file()
    with pytest.raises(SystemExit, match="no drafted method to compare with 'nope'"):
        main(argv + ["--versus", "nope"])


def test_bench_help_shows_the_question_file_option():
    out = subprocess.run([sys.executable, "-m", "jakiro_lib", "bench", "--help"], capture_output=True, text=True,
                         check=True)
    assert "--questions" in out.stdout and "--name" in out.stdout


def test_bench_command_runs_a_question_file_with_per_category_rows(tmp_path, capsys):
    import json

    import pandas as pd

    questions = tmp_path / "spec_bench" / "question.jsonl"  # Spec-Bench's layout: data/spec_bench/question.jsonl
    questions.parent.mkdir()
    rows = [{"question_id": 1, "category": "writing", "turns": ["Write a line.", "Another one."]},
            {"question_id": 2, "category": "math_reasoning", "turns": ["What is 2 + 3?"]},
            {"question_id": 3, "category": "writing", "turns": ["Write a word."]}]
    questions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    argv = ["bench", "--profile", "smoke", "--methods", "vanilla,hf_generate", "--questions", str(questions),
            "--temperature", "0", "--set", "bench.max_new_tokens=4", "--set", "bench.warmup=0",
            "--run-dir", str(tmp_path / "runs"), "--out", str(out)]
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert {r["benchmark"] for r in records} == {"spec_bench"}  # named after the file's folder
    assert len(records) == 2 * 4 and {r["category"] for r in records} == {"writing", "math_reasoning"}
    printed = capsys.readouterr().out
    assert "per question category" in printed and "math_reasoning" in printed
    by_cat = pd.read_csv(out / "summary_by_category.csv")
    assert sorted(zip(by_cat["method"], by_cat["category"])) == [
        ("hf_generate", "math_reasoning"), ("hf_generate", "writing"),
        ("vanilla", "math_reasoning"), ("vanilla", "writing")]
    # each category's row is computed from its own records: 3 prompts (2 + 1 turns) in writing, 1 in math
    questions_per = dict(zip(by_cat["category"], by_cat["questions"]))
    assert questions_per == {"writing": 3, "math_reasoning": 1}
    assert (by_cat["benchmark"] == "spec_bench").all() and (by_cat["greedy_same"] == by_cat["greedy_compared"]).all()
    named = ["bench", "--profile", "smoke", "--methods", "vanilla", "--questions", str(questions), "--name", "mine",
             "--limit", "1", "--temperature", "0", "--set", "bench.max_new_tokens=2", "--set", "bench.warmup=0",
             "--run-dir", str(tmp_path / "runs")]
    assert main(named) == 0  # one question, one category: no per-category table
    folder = tmp_path / "runs" / "bench" / "main-mine"  # beside the main study's folder, not in it
    assert not (folder / "summary_by_category.csv").exists() and (folder / "summary.csv").is_file()
    assert {json.loads(line)["benchmark"] for line in (folder / "records.jsonl").read_text().splitlines()} == {"mine"}
    assert not (tmp_path / "runs" / "bench" / "main").exists()
    with pytest.raises(SystemExit, match="no question file"):
        main(["bench", "--profile", "smoke", "--questions", str(tmp_path / "nope.jsonl"), "--run-dir", str(tmp_path)])


# --- issue 26: one-line errors, Ctrl-C, the train table, the busy-machine warning ---------------------------

SMALL_SETS = ["--set", "data.num_conversations=6", "--set", "data.shard_size=3", "--set", "data.max_length=96",
              "--set", "data.heldout_fraction=0.34", "--set", "train.epochs=1", "--set", "train.max_steps=2"]


def test_unknown_errors_keep_their_traceback_and_ctrl_c_is_status_130(monkeypatch, capsys):
    monkeypatch.setenv("JAKIRO_NO_BUSY_CHECK", "1")

    def boom(*args, **kwargs):
        raise RuntimeError("a bug, not a user error")

    monkeypatch.setattr(commands, "train_all", boom)
    with pytest.raises(RuntimeError, match="a bug"):  # propagates: Python prints the traceback
        main(["train", "--profile", "smoke"])

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(commands, "train_all", interrupted)
    assert main(["train", "--profile", "smoke"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: interrupted")


def test_train_prints_a_short_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAKIRO_NO_BUSY_CHECK", "1")
    run = ["--profile", "smoke", "--run-dir", str(tmp_path), *SMALL_SETS]
    assert main(["cache", *run]) == 0
    assert "conversations" in capsys.readouterr().out
    assert main(["train", *run, "--drafts", "dense", "moe2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and out[0].split()[:3] == ["draft", "status", "steps"], out  # header, 2 drafts, where
    assert [line.split()[:2] for line in out[1:3]] == [["dense", "trained"], ["moe2", "trained"]]
    assert main(["train", *run, "--drafts", "dense"]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == ["dense", "skipped"]
    assert main(["train", *run, "--drafts", "moe2,dense"]) == 0  # comma-separated too
    assert [line.split()[:2] for line in capsys.readouterr().out.splitlines()[1:3]] == [["moe2", "skipped"],
                                                                                       ["dense", "skipped"]]
    assert main(["train", *run, "--drafts", "dense,mo2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown draft(s) ['mo2']") and "\n" not in err and "Traceback" not in err


def test_a_busy_torch_process_is_warned_about_once(tmp_path, monkeypatch, capsys):
    from jakiro_lib.busy import busy_torch_processes

    monkeypatch.delenv("JAKIRO_NO_BUSY_CHECK", raising=False)
    code = "import torch, sys, time\nsys.stdout.write('ready\\n'); sys.stdout.flush()\n"
    busy = subprocess.Popen([sys.executable, "-c", code + "while True: torch.ones(64).sum()"], stdout=subprocess.PIPE)
    idle = subprocess.Popen([sys.executable, "-c", code + "time.sleep(120)"], stdout=subprocess.PIPE)
    try:
        busy.stdout.readline(), idle.stdout.readline()
        found = {pid for pid, _ in busy_torch_processes(sample_s=0.5)}
        assert busy.pid in found and idle.pid not in found
        with pytest.raises(SystemExit, match="train.lr"):  # the check runs before the command
            main(["train", "--profile", "smoke", "--set", "train.lr=fast"])
        warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
        assert len(warnings) == 1 and "timings will be unreliable" in warnings[0]
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()


@pytest.mark.parametrize("command", ["bench", "pipeline", "gpucheck", "costs", "papercost", "throughput"])
def test_one_process_commands_refuse_a_multi_process_launch(tmp_path, monkeypatch, capsys, command):
    """Under `accelerate launch` (WORLD_SIZE > 1) the commands that time things or write one report say so in one
    line, from the main process only, which exits 1, before anything runs; the other processes exit 0, since a
    launcher stops the rest once one fails, which could stop the main process before its line (a real two-process
    launch of `bench`: tests/test_multiprocess.py)."""
    run = ["--profile", "smoke", "--run-dir", str(tmp_path / "run")]
    out = ["--out", str(tmp_path / "o")]
    args = {"bench": [*run, "--methods", "vanilla"], "pipeline": run, "gpucheck": run, "costs": ["--profile", "smoke", *out],
            "throughput": ["--profile", "smoke", *out],
            "papercost": ["--shape", "tiny", "--device", "cpu", "--dtype", "float32", *out]}
    argv = [command, *args[command]]
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank, code, said in (("1", 0, ""), ("0", 1, cli.one_process_refusal(command) + "\n")):
        monkeypatch.setenv("RANK", rank)
        assert main(argv) == code
        assert capsys.readouterr().err == said
    assert not (tmp_path / "run").exists() and not (tmp_path / "o").exists()
