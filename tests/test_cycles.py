"""The cycle-cost table (jakiro_lib.measure.cycles) and the step clock under it (jakiro_lib.decoding.clock): each step
of a cycle counted once and in its own name, the prompt's work kept out of the cycles, and rows that add up."""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from helpers import random_prompts, tiny_target, trained_draft
from jakiro_lib.config import TargetConfig, TreeConfig
from jakiro_lib.decoding import clock as engine_clock
from jakiro_lib.measure.clock import StepClock
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.measure import costmodel, cycles
from jakiro_lib.measure.cycles import COLUMNS, PARTS, cycle_table
from jakiro_lib.decoding.methods import MethodSpec
from jakiro_lib.models.target import Target, capture_of, set_capture, tiny_tokenizer

TREE = TreeConfig(depth=4, top_k=3, total_tokens=8, decoupled=True)


def test_the_clock_counts_each_step_of_each_cycle_and_not_the_prompt():
    """Every cycle enters "cycle" and "read" once; the draft forwards the clock sees are the tree's (the engine's
    count) plus one a cycle for the accepted path, none for the prompt (its forward is the prefill's); operator
    counts repeat exactly on a second run."""
    model = tiny_target("llama")
    draft = trained_draft(model, "moe2")
    prompt = random_prompts(1, seed=3, min_len=12, max_len=12)[0]
    counts = []
    for _ in range(2):
        clock = StepClock(model.device, count_ops=True)
        with clock:
            r = static_generate(model, draft, TREE, prompt, max_new_tokens=24, clock=clock)
        assert clock.entries["prefill"] == 1
        assert clock.entries["cycle"] == clock.entries["read"] == r.cycles
        assert clock.entries["draft_forward"] == r.draft_forwards + r.cycles
        assert all(clock.ops[s] > 0 for s in ("prefill", "draft", "draft_forward", "verify", "evaluate", "update"))
        counts.append(dict(clock.ops))
    assert counts[0] == counts[1]


def test_the_clock_opens_a_profiler_range_only_while_a_profiler_runs(monkeypatch):
    """A step is a profiler range while a profiler runs (the ranges profiles read) and costs no range otherwise (the
    clock runs inside the cycles it times); nested steps keep exclusive times either way."""
    clock = StepClock(torch.device("cpu"))
    with torch.profiler.profile() as prof:
        with clock.step("draft"):
            with clock.step("draft_forward"):
                torch.ones(4).add_(1)
    names = {e.name for e in prof.events()}
    assert {"jakiro::draft", "jakiro::draft_forward"} <= names
    assert clock.entries == {"draft": 1, "draft_forward": 1}

    def no_range(name):
        raise AssertionError(f"a profiler range {name} opened with no profiler running")

    monkeypatch.setattr(engine_clock, "record_function", no_range)
    with clock.step("verify"), clock.step("evaluate"):
        pass
    assert clock.entries["verify"] == clock.entries["evaluate"] == 1 and clock.seconds["verify"] >= 0


def test_a_compiled_engine_refuses_a_clock():
    model = tiny_target("llama")
    with pytest.raises(ValueError, match="one call"):
        static_generate(model, None, None, random_prompts(1, seed=3)[0], max_new_tokens=4, compile=True,
                        clock=StepClock(model.device))


@pytest.mark.parametrize("capture", ["none", "draft"])
def test_cycle_table_rows_add_up(tmp_path, capture):
    """Plain decoding verifies one row with no draft forward; a drafted tree its 8 rows with 3 tree forwards and one
    for the accepted path (with the pool compiled too, where the clock sees one call: the engine counts them); the
    parts and the host's share make the cycle; overhead is (cycle - T(n)) / T(1); operators are counted either way."""
    model = copy.deepcopy(tiny_target("llama"))
    set_capture(model, capture)
    target = Target(model=model, tokenizer=tiny_tokenizer(), config=TargetConfig(model="tiny:llama"))
    path = trained_draft(model, "moe2").save(tmp_path / "moe2")
    methods = {"vanilla": MethodSpec("vanilla"), "jakiro": MethodSpec("spec", draft=str(path), tree=TREE)}
    rows = {r["method"]: r for r in cycle_table(target, methods, random_prompts(2, seed=5, min_len=6, max_len=16),
                                                max_new_tokens=20)}
    for r in rows.values():
        assert set(r) == set(COLUMNS)
        assert math.isclose(sum(r[f"{p}_ms"] for p in PARTS) + r["host_ms"], r["cycle_ms"], rel_tol=1e-9)
        assert math.isclose(r["overhead"], (r["cycle_ms"] - r["tn_ms"]) / r["plain_ms"], rel_tol=1e-9)
        assert r["cycle_ops"] == sum(r[f"{p}_ops"] for p in PARTS) > 0
    plain, jakiro = rows["vanilla"], rows["jakiro"]
    assert (plain["tree"], jakiro["tree"]) == ("", f"d{TREE.depth} k{TREE.top_k} n{TREE.total_tokens}")
    assert (plain["rows"], plain["draft_forwards"], plain["tau"]) == (1, 0, 1)
    assert math.isclose(plain["cycle_per_plain"], 1.0)
    assert 1 < jakiro["rows"] <= 8 and jakiro["draft_forwards"] == 4 and jakiro["tau"] > 1
    assert jakiro["draft_forward_ops"] > 0 and plain["draft_forward_ops"] == 0
    assert capture_of(model) == capture  # the operator count's eager pool leaves the capture as it was


def test_the_tree_column_names_depth_width_budget_and_chain():
    from jakiro_lib.measure.cycles import tree_label

    chained = TreeConfig(depth=4, top_k=3, total_tokens=8, lookup_tokens=10)
    assert tree_label(MethodSpec("spec", draft="d", tree=chained)) == "d4 k3 n8+10"
    assert tree_label(MethodSpec("spec", tree=chained)) == "+10"  # the chain alone
    assert tree_label(MethodSpec("spec", draft="d", tree=TreeConfig(depth=4, top_k=6, total_tokens=3))) == "d2 k6 n3"
    assert tree_label(MethodSpec("vanilla")) == ""


def test_the_methods_are_timed_interleaved_prompt_by_prompt(tmp_path, monkeypatch):
    """Each prompt runs every method once, the order turning by one each prompt, then T(n) once for every n a method
    may verify (the machine's drift reaches them alike), after one warm-up each; T(n) is the mean of every round;
    operators are counted after the timed generations."""
    model = tiny_target("llama")
    target = Target(model=model, tokenizer=tiny_tokenizer(), config=TargetConfig(model="tiny:llama"))
    path = trained_draft(model, "moe2").save(tmp_path / "moe2")
    methods = {"vanilla": MethodSpec("vanilla"), "jakiro": MethodSpec("spec", draft=str(path), tree=TREE),
               "jakiro_2": MethodSpec("spec", draft=str(path), tree=TreeConfig(total_tokens=2))}
    prompts = random_prompts(3, seed=5, min_len=6, max_len=16)
    calls, real = [], cycles._generate

    def recording(target, draft, spec, ids, max_new_tokens, clock):
        name = next(n for n, m in methods.items() if m is spec)
        calls.append((name, next(i for i, p in enumerate(prompts) if p is ids), clock is None))
        return real(target, draft, spec, ids, max_new_tokens, clock)

    def rounds(model, sizes, **kw):  # rounds k = 0, 1, ... of prompt i take n + 10 i + k ** 3 ms (skewed up)
        calls.append(("T(n)", tuple(sizes), kw["repeats"]))
        i = sum(c[0] == "T(n)" for c in calls) - 1
        return {n: {costmodel.AS_IS: [1e-3 * (n + 10 * i + k ** 3) for k in range(kw["repeats"])]}
                for n in sizes}

    monkeypatch.setattr(cycles, "_generate", recording)
    monkeypatch.setattr(cycles, "target_cost_rounds", rounds)
    rows = {r["method"]: r for r in cycle_table(target, methods, prompts, max_new_tokens=6)}
    assert calls[:3] == [(n, 0, True) for n in methods]  # the warm-ups
    order, sizes = ["vanilla", "jakiro", "jakiro_2"], ("T(n)", tuple(range(1, 9)), cycles.TN_REPEATS)
    assert calls[3:15] == [c for i in range(3) for c in [(n, i, False) for n in order[i:] + order[:i]] + [sizes]]
    assert calls[15:] == [(n, 0, False) for n in methods]  # the operator counts
    R = cycles.TN_REPEATS  # T(1): the mean of every round of the three prompts, as a cycle's time is a mean
    assert rows["vanilla"]["tn_ms"] == pytest.approx(1 + 10 + sum(k ** 3 for k in range(R)) / R)
    assert rows["vanilla"]["tn_median_ms"] == pytest.approx(sorted(1 + 10 * i + k ** 3 for i in range(3)
                                                                   for k in range(R))[3 * R // 2])


def test_the_report_section_times_the_methods_the_study_runs(tmp_path):
    """Notebook 02's cycle-cost section (study.cycle_cost_table): the cycle methods of the profile's main study only
    (a profile without the Jakiro draft has no Jakiro rows), written as the report's cycles.csv, and drawn."""
    from jakiro_lib.models.draft import DraftModel
    from jakiro_lib.models.target import load_target
    from jakiro_lib.profiles import get_profile
    from jakiro_lib.report import plots as P
    from jakiro_lib.study import cycle_cost_table
    from jakiro_lib.study.context import StudyContext

    profile = get_profile("smoke", **{"drafts": "dense", "bench.tuned": False, "bench.limit": 1,
                                      "bench.max_new_tokens": 6})
    target = load_target(profile.target)
    ctx = StudyContext(profile=profile, run_dir=tmp_path / "run", report_dir=tmp_path / "report")
    DraftModel.build(profile.drafts["dense"], target.model).eval().save(ctx.layout.drafts / "dense" / "draft")
    table = cycle_cost_table(ctx, target=target)
    assert table["method"].tolist() == ["vanilla", "eagle2"] and list(table.columns) == list(COLUMNS)
    assert (tmp_path / "report" / "cycles.csv").is_file() and math.isclose(table["cycle_per_plain"][0], 1.0)
    config = json.loads((tmp_path / "report" / "cycles_config.json").read_text())
    assert config["run_dir"] == "../run"  # no machine's directories in a committed record
    P.save_figure(P.plot_cycle_costs(table), tmp_path / "cycles.png")
    assert (tmp_path / "cycles.png").read_bytes().startswith(b"\x89PNG")


def test_the_command_adds_plain_decoding_and_refuses_an_unknown_method_in_one_line(tmp_path, capsys):
    """`cycles --methods jakiro` times plain decoding too (the table's unit); an unknown method is one error line."""
    from jakiro_lib.cli import main
    from jakiro_lib.measure.cycles import cycle_methods
    from jakiro_lib.models.target import load_target
    from jakiro_lib.profiles import get_profile

    profile = get_profile("smoke", **{"drafts": "dense", "bench.tuned": False})
    target = load_target(profile.target)
    assert list(cycle_methods(profile, tmp_path, target, ["eagle2"])) == ["vanilla", "eagle2"]
    with pytest.raises(SystemExit, match=r"^error: no cycle to time for nope: choose from vanilla"):
        main(["cycles", "--profile", "smoke", "--run-dir", str(tmp_path), "--methods", "nope"])
    assert "Traceback" not in capsys.readouterr().err
