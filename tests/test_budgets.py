"""The tree budget's tuning: prompts the benchmark never scores, recorded; timings that load moves
least; the choice checked against the fixed tree; a busy machine named."""
import json
import logging

import pytest

from helpers import single_thread
from jakiro_lib.study.context import StudyContext
from jakiro_lib.measure import budgets, costmodel
from jakiro_lib.measure.budgets import TUNE_PROMPTS, resolve_tree_budgets, tuning_prompts
from jakiro_lib.config import TargetConfig, TreeConfig
from jakiro_lib.config import EAGLE2_DRAFT, JAKIRO_DRAFT
from jakiro_lib.profiles import get_profile
from jakiro_lib.data.conversations import Question, load_conversations, load_questions
from jakiro_lib.data.dataset import split_indices
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.measure.methods import study_methods
from jakiro_lib.study import run_study
from jakiro_lib.models.target import load_target


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(model="tiny:llama", max_context=512))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, target):
    root = tmp_path_factory.mktemp("budgets")
    profile = get_profile("smoke")  # a fixed 8-token tree; the main study adds the "_auto" methods
    for name in (EAGLE2_DRAFT, JAKIRO_DRAFT):  # the main study's drafts
        DraftModel.build(profile.drafts[name], target.model).eval().save(root / "drafts" / name / "draft")
    return profile, root


def test_tuning_prompts_are_held_out_sharegpt_turns_that_no_benchmark_scores(target):
    profile = get_profile("smoke")  # 24 conversations, 20% held out of training
    prompts, info = tuning_prompts(profile, target)
    convs = load_conversations(limit=profile.data.num_conversations)
    held = set(split_indices(range(len(convs)), "heldout", profile.data.heldout_fraction))
    picked = [c["index"] for c in info["conversations"]]
    assert len(prompts) == len(picked) == TUNE_PROMPTS and set(picked) <= held  # never trained on
    assert info["source"] == "sharegpt" and info["split"] == "heldout"
    assert [c["id"] for c in info["conversations"]] == [convs[i].id for i in picked]
    mt_bench = {t.strip() for q in load_questions("mt_bench") for t in q.turns}
    assert not {convs[i].messages[0]["content"].strip() for i in picked} & mt_bench
    assert all(c["text_tokens"] <= info["max_text_tokens"] for c in info["conversations"])
    assert [len(p) for p in prompts] == [c["prompt_tokens"] for c in info["conversations"]]
    # a benchmark that holds one of them (a question file cut from ShareGPT, say): that one is passed over
    again, other = tuning_prompts(profile, target, exclude=[convs[picked[0]].messages[0]["content"]])
    assert picked[0] not in [c["index"] for c in other["conversations"]] and len(again) == TUNE_PROMPTS
    assert other["excluded_benchmark_prompts"] == 1


def test_without_a_held_out_split_the_prompts_come_after_the_training_range(target):
    profile = get_profile("smoke", **{"data.heldout_fraction": 0.0})
    _, info = tuning_prompts(profile, target)
    assert info["split"] == "after the training range"
    assert all(c["index"] >= profile.data.num_conversations for c in info["conversations"])


def test_tuner_gets_held_out_prompts_minimum_timings_and_the_fixed_tree(tiny_run, target, monkeypatch):
    profile, root = tiny_run
    methods = {k: v for k, v in study_methods(profile.tree, root / "drafts").items()
               if k in ("eagle2_auto", "jakiro_auto")}
    seen: dict[str, list] = {"costs": [], "tune": []}

    def costs(model, sizes, **kw):
        seen["costs"].append(kw)
        return {n: 0.01 * n for n in sizes}

    def tune(target, draft, tree, prompts, **kw):
        seen["tune"].append((prompts, kw))
        return {"best": 4, "depth": 2, "top_k": 4, "table": [], "estimated_best": 4, "fixed_tokens": 8}

    monkeypatch.setattr(costmodel, "measure_target_costs", costs)
    monkeypatch.setattr(costmodel, "tune_tree", tune)
    old = {"machines": [{"machine": {**budgets._machine(profile, target)}, "target_costs_s": {"1": 1.0},
                         "choices": {}}]}  # a cache from before: median timings, MT-bench prompts
    (root / "bench").mkdir(parents=True, exist_ok=True)
    (root / "bench" / "tree_budgets.json").write_text(json.dumps(old))
    with single_thread():
        resolved, info = resolve_tree_budgets(profile, root, methods, target)
    assert [kw["stat"] for kw in seen["costs"]] == ["min"]  # measured anew, each size's fastest round
    expected, tuned_on = tuning_prompts(profile, target)
    assert len(seen["tune"]) == 2
    for prompts, kw in seen["tune"]:
        assert [p.tolist() for p in prompts] == [p.tolist() for p in expected]
        ref = kw["reference"]  # the profile's fixed tree, run eagerly
        assert (ref.depth, ref.top_k, ref.total_tokens) == (profile.tree.depth, profile.tree.top_k, 8)
        assert kw["compile"] is False
    assert info["tuning_prompts"] == tuned_on
    assert {(m.tree.total_tokens, m.tree.depth, m.tree.top_k) for m in resolved.values()} == {(4, 2, 4)}
    saved = json.loads((root / "bench" / "tree_budgets.json").read_text())["machines"]
    fresh = [e for e in saved if e["machine"].get("timing") == "min"]
    assert len(saved) == 2 and len(fresh) == 1  # the old entry is left as it was, not reused
    assert all(c["prompts"] == tuned_on for c in fresh[0]["choices"].values())
    # the same prompts next time: nothing is measured again
    monkeypatch.setattr(costmodel, "tune_tree", lambda *a, **kw: pytest.fail("retuned"))
    with single_thread():
        resolve_tree_budgets(profile, root, methods, target)


def test_a_busy_machine_is_recorded_and_named_while_the_tuner_times(tiny_run, target, monkeypatch, caplog):
    profile, root = tiny_run
    methods = {"eagle2_auto": study_methods(profile.tree, root / "drafts")["eagle2_auto"]}
    monkeypatch.setattr(costmodel, "measure_target_costs", lambda model, sizes, **kw: {n: 0.01 * n for n in sizes})
    monkeypatch.setattr(costmodel, "tune_tree", lambda *a, **kw: {"best": 4, "depth": 3, "top_k": 3, "table": []})
    clock = iter([(0.0, 0, 0), (2.0, 100 * budgets.CLOCK_TICKS, 0)] * 2)  # others: 50 cores' worth for 2 s
    monkeypatch.setattr(budgets, "_cpu_snapshot", lambda: next(clock))
    with caplog.at_level(logging.WARNING, logger="jakiro_lib.measure.budgets"), single_thread():
        _, info = resolve_tree_budgets(profile, root, methods, target, force=True)
    assert info["choices"]["eagle2_auto"]["others_cpu_cores"] == pytest.approx(50.0)
    assert "other processes used 50.0 cores" in caplog.text
    entry = json.loads((root / "bench" / "tree_budgets.json").read_text())["machines"][-1]
    assert entry["others_cpu_cores"] == pytest.approx(50.0)
    # JAKIRO_NO_BUSY_CHECK (the CLI's switch for shared machines) silences the warning; the record stays
    monkeypatch.setenv("JAKIRO_NO_BUSY_CHECK", "1")
    clock = iter([(0.0, 0, 0), (2.0, 100 * budgets.CLOCK_TICKS, 0)] * 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jakiro_lib.measure.budgets"), single_thread():
        _, info = resolve_tree_budgets(profile, root, methods, target, force=True)
    assert "other processes" not in caplog.text and info["choices"]["eagle2_auto"]["others_cpu_cores"] == 50.0


def test_the_processes_the_tuner_started_count_as_its_own_load(tmp_path):
    """A compiled tree's C++ compiler (a child this process waited for: its time in the parent's cutime and cstime)
    and worker pools (children and grandchildren still running) are the tuner's own CPU use, not another process's:
    a tuning that compiles must not warn of a busy machine (it did, 0.47 cores, 2026-12-01)."""
    from jakiro_lib.busy import family_ticks

    tree = {10: (1, 5), 11: (10, 7), 12: (11, 11), 13: (1, 100), 14: (13, 1000)}  # pid: (parent, ticks)
    for pid, (parent, ticks) in tree.items():  # utime, stime, then the waited children's cutime, cstime
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} (py (worker)) S {parent} 0 0 0 0 0 0 0 0 0 {ticks - 4} 1 2 1 0")
    assert family_ticks(10, tmp_path) == 5 + 7 + 11  # itself, its child and grandchild; not 13's family
    assert family_ticks(13, tmp_path) == 1100


def test_bench_config_records_the_tuning_prompts_apart_from_the_benchmarks(tiny_run, target, monkeypatch):
    """What the issue asks to see: the prompts the budget was tuned on, in bench_config.json, none of them a
    prompt the benchmark scores."""
    profile, root = tiny_run
    monkeypatch.setattr(costmodel, "measure_target_costs", lambda model, sizes, **kw: {n: 0.01 * n for n in sizes})
    monkeypatch.setattr(costmodel, "tune_tree", lambda *a, **kw: {"best": 4, "depth": 3, "top_k": 3, "table": []})
    questions = [Question("q1", "writing", ["Say something.", "Say more."], "mt_bench")]
    with single_thread():
        run_study(StudyContext.at(profile, root), "main", target=target, only="vanilla,eagle2_auto", questions=questions,
                  progress=False, force=True)
    config = json.loads((root / "bench" / "main" / "bench_config.json").read_text())
    tuning = config["tree_budget_tuning"]
    assert tuning["source"] == "sharegpt" and len(tuning["conversations"]) == TUNE_PROMPTS
    assert tuning["excluded_benchmark_prompts"] == 2
    convs = load_conversations(limit=max(c["index"] for c in tuning["conversations"]) + 1)
    texts = {convs[c["index"]].messages[0]["content"] for c in tuning["conversations"]}
    assert not texts & {t for q in questions for t in q.turns}
    assert config["methods"]["eagle2_auto"]["tree"]["total_tokens"] == 4


def test_a_source_shorter_than_num_conversations_is_split_as_training_splits_it(target, tmp_path):
    """The drafts' held-out split is taken over the conversations there are (10 here), not over
    ``data.num_conversations``: the tuning conversation must be the one training held out."""
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question number {i}?"}, {"from": "gpt", "value": "An answer."}]}) + "\n"
        for i in range(10)))
    profile = get_profile("smoke", **{"data.path": str(path), "data.num_conversations": 600,
                                      "data.heldout_fraction": 0.1})
    _, info = tuning_prompts(profile, target)
    assert [c["index"] for c in info["conversations"]] == split_indices(range(10), "heldout", 0.1)
    assert info["conversations_loaded"] == 10 and info["num_conversations"] == 600  # a short source shows


def test_a_captured_method_runs_its_budgets_outright(target):
    """Where the engine records its cycles as CUDA graphs the check also runs budgets.CAPTURED_SIZES (the estimate's
    eager timings describe another engine there); inductor's capture (a compilation per budget) and eager runs none."""
    assert budgets.measured_sizes("graphs") == budgets.CAPTURED_SIZES
    assert budgets.measured_sizes("inductor") == budgets.measured_sizes("none") == ()


def test_the_check_keeps_the_fastest_measured_tree_and_the_reference_on_ties(target, monkeypatch):
    draft = DraftModel.build(get_profile("smoke").drafts["dense"], target.model).eval()
    speeds = {"d1 k2 n2": 10.0, "d3 k2 n4": 30.0, "d3 k2 n8": 20.0}
    ran: list[tuple[str, ...]] = []

    def measured(target, draft, trees, prompts, **kw):
        ran.append(tuple(trees))
        return {k: speeds[k] for k in trees}

    monkeypatch.setattr(costmodel, "measure_tree_speeds", measured)
    common = dict(candidates=(2, 4, 8), max_new_tokens=8, context=16, target_costs={1: 0.01, 2: 0.01, 4: 0.01, 8: 0.01})
    prompts = [target.tokenizer("hello there", return_tensors="pt").input_ids[0]]
    fixed = TreeConfig(depth=3, top_k=2, total_tokens=8)
    out = costmodel.tune_tree(target, draft, TreeConfig(depth=3, top_k=2), prompts, reference=fixed,
                              measure_sizes=(4, 16), **common)  # 16 is no candidate: not run
    assert set(ran[-1]) == {out["estimated"], "d3 k2 n4", "d3 k2 n8"} and out["best"] == 4
    assert out["fixed"] == "d3 k2 n8" and out["measured_tokens_per_s"]["d3 k2 n4"] == 30.0
    speeds["d3 k2 n8"] = 30.0  # a tie with the reference keeps the reference
    out = costmodel.tune_tree(target, draft, TreeConfig(depth=3, top_k=2), prompts, reference=fixed,
                              measure_sizes=(4,), **common)
    assert (out["best"], out["depth"], out["top_k"]) == (8, 3, 2)


def test_the_machine_key_names_the_gemm_kernel_the_probe_chose(target, monkeypatch):
    """T(n), and so a tuned budget, depends on the kernel: another kernel, the first row count it serves, or another
    build of the package's kernels (their source, torch, the CPU), is another machine entry."""
    from jakiro_lib.models import kernels

    profile = get_profile("smoke")
    plain = budgets._machine_key(budgets._machine(profile, target))
    assert plain["gemm"] is None
    assert plain["kernels"] == (kernels.stream_build_name() if kernels.stream_gemm_available() else None)
    with monkeypatch.context() as patch:
        patch.setattr(kernels, "stream_gemm_available", lambda: True)
        patch.setattr(kernels, "stream_build_name", lambda: "jakiro_stream_gemm_another")
        assert budgets._machine_key(budgets._machine(profile, target))["kernels"] == "jakiro_stream_gemm_another"
    backend = next((b for b in kernels.BACKENDS if kernels.packed_gemm_available(target.model, b)), None)
    if backend is None:
        pytest.skip("no packed GEMM kernel in this torch build")
    keys = {}
    for first in (1, 2):  # the first row count it serves, too: from one row a plain step may run another path
        kernels.enable_packed_gemm(target.model, max_rows=8, backend=backend, min_rows=first)
        try:
            keys[first] = budgets._machine_key(budgets._machine(profile, target))
        finally:
            kernels.disable_packed_gemm(target.model)
    assert keys[2]["gemm"] == backend and keys[2] != plain and keys[1] != keys[2]
