import subprocess
import sys

from jakiro_lib.cli import build_parser, main


def test_help_lists_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "jakiro_lib", "--help"], capture_output=True, text=True, check=True)
    for cmd in ("profiles", "generate", "cache", "train", "bench", "pipeline"):
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


def test_bad_override_is_reported_without_traceback():
    args = build_parser().parse_args(["generate", "--profile", "smoke", "--set", "train.nope=1", "hi"])
    try:
        args.func(args)
    except SystemExit as exc:
        assert "unknown config key" in str(exc)
    else:
        raise AssertionError("expected SystemExit")


def test_costs_command_writes_a_results_file(tmp_path):
    out = tmp_path / "costs.json"
    assert main(["costs", "--profile", "smoke", "--sizes", "1,2,4", "--context", "16", "--out", str(out)]) == 0
    import json

    data = json.loads(out.read_text())
    assert set(data["target_tree_ms"]) == {"1", "2", "4"} and data["environment"]["torch"]
