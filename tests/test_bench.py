"""The bootstrap interval behind every speedup (paired over prompts, able to exclude 1 or not), and the
per-prompt greedy agreement with vanilla that every benchmark report carries."""
import dataclasses
import math

import pytest
import torch

from jakiro_lib.measure.summary import common_prompts, greedy_agreement, ratio_interval, summarize, versus
from jakiro_lib.config import TreeConfig
from jakiro_lib.decoding.methods import MethodRunner, MethodSpec
from jakiro_lib.measure.methods import record_label, study_methods


def _recs(method, tps, bench="mt_bench", temp=0.0, kind="spec"):
    return [{"method": method, "kind": kind, "benchmark": bench, "temperature": temp, "question_id": q, "turn": 1,
             "repeat": 0, "tokens_per_second": v, "new_tokens": 10, "cycles": 5, "accepted": [2] * 5,
             "draft_forwards": 0, "wall_time": 1.0} for q, v in enumerate(tps)]


def test_a_constant_ratio_has_a_point_interval():
    base = [10.0, 20.0, 30.0, 15.0]
    lo, hi = ratio_interval(_recs("m", [1.5 * v for v in base]), _recs("v", base))
    assert lo == pytest.approx(1.5) and hi == pytest.approx(1.5)


def test_prompt_to_prompt_spread_widens_the_interval_around_the_point_estimate():
    base = [20.0] * 12
    mixed = [40.0, 20.0, 20.0, 20.0, 40.0, 20.0, 20.0, 20.0, 40.0, 20.0, 20.0, 20.0]  # ratio 1.33 overall
    lo, hi = ratio_interval(_recs("m", mixed), _recs("v", base))
    assert lo < sum(mixed) / sum(base) < hi
    assert lo < 1.2 and hi > 1.45  # three lucky prompts carry the gain: the data cannot pin it down
    lo_same, hi_same = ratio_interval(_recs("m", mixed), _recs("v", base))
    assert (lo_same, hi_same) == (lo, hi)  # seeded: reruns of a report agree


def test_only_prompts_both_methods_ran_are_paired():
    assert all(math.isnan(x) for x in ratio_interval(_recs("m", [1.0]), _recs("v", [1.0], bench="gsm8k")))
    lo, hi = ratio_interval(_recs("m", [30.0, 30.0, 999.0]), _recs("v", [10.0, 10.0]))  # third has no pair
    assert lo == pytest.approx(3.0) and hi == pytest.approx(3.0)


def _with_accepts(recs, accepts):
    """Give each record its own accepted lengths per cycle (tau = sum / cycles)."""
    return [{**r, "accepted": a, "cycles": len(a), "new_tokens": sum(a)} for r, a in zip(recs, accepts)]


def test_tau_ratio_is_pooled_over_prompts_and_bracketed_by_its_interval():
    """tau pools tokens / cycles over prompts (as summarize does); the interval pairs prompts."""
    accepts_m = [[3, 3, 1], [1, 1, 1, 1], [4, 2], [2, 2, 2], [1, 3], [5, 1, 1]]
    accepts_b = [[2, 1, 1], [1, 1, 1, 1], [2, 2, 1], [1, 2, 2], [1, 1, 1], [2, 2, 1]]
    m = _with_accepts(_recs("m", [10.0] * 6), accepts_m)
    b = _with_accepts(_recs("b", [10.0] * 6), accepts_b)
    pooled = lambda acc: sum(map(sum, acc)) / sum(map(len, acc))  # noqa: E731
    lo, hi = ratio_interval(m, b, measure="tau")
    assert lo < pooled(accepts_m) / pooled(accepts_b) < hi and lo != hi
    assert ratio_interval(m, m, measure="tau") == (1.0, 1.0)
    assert ratio_interval(m, b) == (1.0, 1.0)  # tokens/s equal on every prompt
    with pytest.raises(ValueError, match="unknown measure"):
        ratio_interval(m, b, measure="speed")


def test_versus_judges_each_drafted_method_against_the_baseline_with_paired_intervals():
    base = [10.0, 12.0, 14.0, 16.0, 11.0, 13.0]
    eagle = _with_accepts(_recs("eagle2", base), [[2, 1]] * 6)  # tau 1.5
    fast = _with_accepts(_recs("jakiro", [2 * v for v in base]), [[3, 1]] * 6)  # 2x tokens/s, tau 2.0
    slow = _with_accepts(_recs("jakiro_cepd", [0.5 * v for v in base]), [[2, 1], [1, 1], [3, 1], [1, 1], [3, 2], [1, 1]])
    rows = {r["method"]: r for r in versus(eagle + fast + slow + _recs("vanilla", base, kind="vanilla"), "eagle2")}
    assert set(rows) == {"jakiro", "jakiro_cepd"}  # only drafted methods; never the baseline itself
    j = rows["jakiro"]
    assert j["prompts"] == 6 and j["tokens_per_s_ratio"] == pytest.approx(2.0)
    assert j["tau"] == pytest.approx(2.0) and j["baseline_tau"] == pytest.approx(1.5)
    assert j["tau_ratio"] == pytest.approx(4 / 3) and j["tau_ci_low"] == pytest.approx(4 / 3)
    assert (j["tokens_per_s_verdict"], j["tau_verdict"]) == ("better", "better")
    c = rows["jakiro_cepd"]
    assert c["tokens_per_s_verdict"] == "worse" and c["tau_ratio"] == pytest.approx(1.0)
    assert c["tau_ci_low"] < 1 < c["tau_ci_high"] and c["tau_verdict"] == "unresolved"
    assert versus(fast, "eagle2") == []  # no baseline records: nothing to compare


def test_summarize_reports_the_interval_against_the_fastest_vanilla():
    base = [10.0, 12.0, 14.0, 16.0]
    rows = summarize(_recs("vanilla", base, kind="vanilla") + _recs("hf_generate", [v / 2 for v in base], kind="hf")
                     + _recs("jakiro", [2 * v for v in base]))
    jak = next(r for r in rows if r["method"] == "jakiro")
    assert jak["speedup"] == pytest.approx(2.0)
    assert jak["speedup_ci_low"] == pytest.approx(2.0) and jak["speedup_ci_high"] == pytest.approx(2.0)


def test_summarize_measures_against_hf_generate_where_it_beats_our_vanilla_loop():
    """On a GPU HF generate outran our loop (H100, 2026-11-22): speedups must then be over HF generate."""
    base = [10.0, 12.0, 14.0, 16.0]
    rows = summarize(_recs("vanilla", base, kind="vanilla") + _recs("hf_generate", [1.5 * v for v in base], kind="hf")
                     + _recs("jakiro", [3 * v for v in base]))
    speedup = {r["method"]: r["speedup"] for r in rows}
    assert speedup["jakiro"] == pytest.approx(2.0) and speedup["hf_generate"] == pytest.approx(1.0)
    assert speedup["vanilla"] == pytest.approx(1 / 1.5)
    jak = next(r for r in rows if r["method"] == "jakiro")
    assert jak["speedup_ci_low"] == pytest.approx(2.0) and jak["speedup_ci_high"] == pytest.approx(2.0)


def test_common_prompts_keeps_what_every_method_ran_per_temperature():
    full = _recs("vanilla", [10.0] * 4, kind="vanilla") + _recs("jakiro", [20.0] * 4)
    cut = _recs("vanilla", [10.0] * 4, temp=1.0, kind="vanilla") + _recs("jakiro", [20.0] * 3, temp=1.0)
    kept = common_prompts(full + cut)
    assert len([r for r in kept if r["temperature"] == 0.0]) == 8  # complete at T=0: untouched
    assert sorted((r["method"], r["question_id"]) for r in kept if r["temperature"] == 1.0) == sorted(
        (m, q) for m in ("vanilla", "jakiro") for q in range(3))  # the interrupted run's last prompt goes


def _turns(method, outputs, temp=0.0, kind="spec"):
    """One question per entry of ``outputs``: a list of per-turn output ids."""
    return [{"method": method, "kind": kind, "benchmark": "mt_bench", "temperature": temp, "question_id": q,
             "turn": t, "repeat": 0, "tokens_per_second": 10.0, "new_tokens": len(ids), "cycles": 1,
             "accepted": [len(ids)], "draft_forwards": 0, "wall_time": 1.0, "output_ids": ids}
            for q, turns in enumerate(outputs) for t, ids in enumerate(turns)]


def test_greedy_agreement_counts_prompts_and_stops_a_question_at_its_first_divergence():
    ref = _turns("vanilla", [[[1, 2], [3]], [[4, 5], [6]], [[7], [8]]], kind="vanilla")
    same = _turns("jakiro", [[[1, 2], [3]], [[4, 5], [6]], [[7], [8]]])
    assert greedy_agreement(same, ref) == (6, 6)
    # question 0 diverges in its first turn: its second turn had another prompt and is not compared;
    # question 1 diverges in its last turn (a longer output counts as a divergence too)
    other = _turns("jakiro", [[[1, 9], [3]], [[4, 5], [6, 0]], [[7], [8]]])
    assert greedy_agreement(other, ref) == (3, 5)
    assert greedy_agreement(same, ref[:2]) == (2, 2)  # prompts vanilla did not run are not compared


def test_summarize_reports_greedy_agreement_at_t0_only():
    outs = [[[1, 2]], [[3, 4]]]
    recs = (_turns("vanilla", outs, kind="vanilla") + _turns("jakiro", [[[1, 2]], [[3, 5]]])
            + _turns("vanilla", outs, temp=1.0, kind="vanilla") + _turns("jakiro", outs, temp=1.0))
    rows = {(r["method"], r["temperature"]): r for r in summarize(recs)}
    assert (rows["jakiro", 0.0]["greedy_same"], rows["jakiro", 0.0]["greedy_compared"]) == (1, 2)
    assert (rows["vanilla", 0.0]["greedy_same"], rows["vanilla", 0.0]["greedy_compared"]) == (2, 2)
    assert rows["jakiro", 1.0]["greedy_same"] is None and rows["jakiro", 1.0]["greedy_compared"] is None


def test_greedy_divergences_locate_the_first_differing_token_and_the_targets_margin_there(tmp_path):
    import copy
    import json

    from jakiro_lib.measure.bench import run_benchmark
    from jakiro_lib.measure.summary import greedy_divergences, load_records
    from jakiro_lib.config import TargetConfig
    from jakiro_lib.data.conversations import Question
    from jakiro_lib.models.target import load_target

    target = load_target(TargetConfig(model="tiny:llama"))
    qs = [Question("q1", "writing", ["Say something.", "Say it again."], "mt_bench"),
          Question("q2", "writing", ["Another one.", "And again."], "mt_bench")]
    path = run_benchmark(target, {"vanilla": MethodSpec("vanilla")}, qs, max_new_tokens=12, warmup=0,
                         out_dir=tmp_path, progress=False)
    vanilla = load_records(path)
    assert len(vanilla) == 4 and all(len(r["output_ids"]) >= 6 for r in vanilla)
    wrong = copy.deepcopy(vanilla)
    for r in wrong:
        r["method"] = "wrong"
        if (r["question_id"], r["turn"]) == ("q1", 1):  # second turn: its prompt holds vanilla's first answer
            r["output_ids"][4] = (r["output_ids"][4] + 1) % 256
        if (r["question_id"], r["turn"]) == ("q2", 0):  # first turn: the second is then not compared
            r["output_ids"][2] = (r["output_ids"][2] + 1) % 256
    rows = greedy_divergences(target, vanilla + wrong, qs)
    assert [(r["question_id"], r["turn"], r["position"]) for r in rows] == [("q1", 1, 4), ("q2", 0, 2)]
    for r in rows:
        assert r["top1_token"] == r["vanilla_token"] != r["method_token"]  # the prefix was rebuilt right
        assert r["gap"] > 0 and r["gap_steps"] > 1e3  # fp32: no rounding tie, a real disagreement
    assert greedy_divergences(target, vanilla + [dict(r, method="same") for r in vanilla], qs) == []
    json.dumps(rows)  # plain values, ready for a CSV/JSON report


def test_methods_take_turns_going_first_question_by_question(tmp_path):
    """Interleaved, and no method always right after the same one: no place effect can favour one method."""
    from jakiro_lib.measure.bench import run_benchmark
    from jakiro_lib.measure.summary import load_records
    from jakiro_lib.config import TargetConfig
    from jakiro_lib.data.conversations import Question
    from jakiro_lib.models.target import load_target

    target = load_target(TargetConfig(model="tiny:llama"))
    qs = [Question(f"q{i}", "writing", [f"Say {i}."], "mt_bench") for i in range(4)]
    methods = {name: MethodSpec("vanilla") for name in ("a", "b", "c")}
    path = run_benchmark(target, methods, qs, max_new_tokens=2, warmup=0, out_dir=tmp_path, progress=False)
    ran = [(r["question_id"], r["method"]) for r in load_records(path)]
    assert ran == [(f"q{i}", m) for i, names in enumerate(["abc", "bca", "cab", "abc"]) for m in names]


def test_bench_config_names_the_draft_relative_to_itself(tmp_path):
    import json

    from jakiro_lib.measure.bench import run_benchmark
    from jakiro_lib.config import DraftConfig, TargetConfig, TreeConfig
    from jakiro_lib.data.conversations import Question
    from jakiro_lib.models.draft import DraftModel
    from jakiro_lib.models.target import load_target

    target = load_target(TargetConfig(model="tiny:llama"))
    draft = tmp_path / "run" / "drafts" / "d" / "draft"
    DraftModel.build(DraftConfig(), target.model).save(draft)
    out = tmp_path / "run" / "bench" / "main"
    spec = MethodSpec("spec", draft=str(draft), tree=TreeConfig(depth=2, top_k=2, total_tokens=3))
    run_benchmark(target, {"vanilla": MethodSpec("vanilla"), "eagle2": spec},
                  [Question("q1", "writing", ["Say something."], "mt_bench")], max_new_tokens=4, warmup=0,
                  out_dir=out, progress=False)
    config = json.loads((out / "bench_config.json").read_text())
    methods = config["methods"]
    assert config["packed_gemm"] is None and "cpu_flags" in config["environment"]  # the kernels the times are of
    assert methods["eagle2"]["draft"] == "../../drafts/d/draft"  # no machine path in a copied or committed run
    assert (out / methods["eagle2"]["draft"]).resolve() == draft.resolve()
    assert methods["vanilla"]["draft"] is None


def test_main_study_carries_compiled_hf_generate_as_a_baseline(tmp_path):
    methods = study_methods(TreeConfig(total_tokens=8), tmp_path, study="main")
    assert methods["hf_compiled"] == MethodSpec("hf", compile=True)
    assert not methods["hf_generate"].compile
    with pytest.raises(ValueError, match="compile applies to kind 'hf' only"):
        MethodSpec("pld", compile=True)
    assert "hf_compiled" not in study_methods(TreeConfig(total_tokens=8), tmp_path, study="main", compiled=False)


def test_the_lookup_methods_graft_their_chain_on_the_auto_methods_tree(tmp_path):
    """eagle2_lookup and jakiro_lookup draft the tree of eagle2_auto and jakiro_auto, the chain added: tuned, the
    same "auto" settings (so one tuning serves both: the tuner's key leaves the chain out); untuned, the study's tree."""
    tree = TreeConfig(depth=3, top_k=5, total_tokens=12)
    tuned = study_methods(tree, tmp_path, study="main")
    for base in ("eagle2", "jakiro"):
        auto, lookup = tuned[f"{base}_auto"].tree, tuned[f"{base}_lookup"].tree
        assert lookup.tuned and lookup == dataclasses.replace(auto, lookup_tokens=10)
    fixed = study_methods(tree, tmp_path, study="main", tuned=False)
    assert "eagle2_auto" not in fixed
    assert (fixed["eagle2_lookup"].tree.depth, fixed["eagle2_lookup"].tree.top_k,
            fixed["eagle2_lookup"].tree.total_tokens) == (3, 5, 12)


def test_compile_is_hf_compiled_alone_and_our_methods_run_as_the_target_captures(tmp_path, monkeypatch):
    """One meaning of compile in a spec: HF generate over a static cache (hf_compiled). Our methods (plain decoding,
    drafted trees, lookup chains) run on the one engine, eager or captured as target.capture says, never per method:
    a spec of ours asked to compile is refused, and the runner compiles exactly where the target's capture is not
    "none"."""
    from jakiro_lib.decoding import methods as methods_module
    from jakiro_lib.config import TargetConfig
    from jakiro_lib.decoding.verify import SamplingParams
    from jakiro_lib.models.target import load_target, set_capture

    tree = TreeConfig(total_tokens=8)
    for kind in ("vanilla", "spec"):
        with pytest.raises(ValueError, match="target.capture"):
            MethodSpec(kind, draft="d", tree=tree, compile=True)
    main = study_methods(tree, tmp_path, study="main")
    assert not any(m.compile for k, m in main.items() if k != "hf_compiled")
    assert {m.runs_on for k, m in main.items() if m.kind in ("vanilla", "spec")} == {"static"}
    target = load_target(TargetConfig(model="tiny:llama"))
    seen = []
    monkeypatch.setattr(methods_module, "static_generate", lambda *a, compile, **kw: seen.append(compile))
    runner = MethodRunner(target, MethodSpec("vanilla"))
    for capture, compiles in (("none", False), ("inductor", True)):
        set_capture(target.model, capture)
        runner(torch.tensor([1, 2, 3]), max_new_tokens=2, params=SamplingParams(), seed=0)
        assert seen[-1] is compiles and runner.spec.capture(target) == capture
    with pytest.raises(ValueError, match="CUDA graphs"):
        set_capture(target.model, "graphs")  # the tiny target is on the CPU


def test_every_record_names_its_method_and_how_it_ran(tmp_path):
    """A run at T=0 and T=1 records each method under its own name with its engine and capture, vanilla's greedy
    output at T=0 from every drafted and lookup method, and sampled text at T=1 reproducible from the record's seed."""
    from jakiro_lib.measure.bench import run_benchmark
    from jakiro_lib.measure.summary import load_records
    from jakiro_lib.config import DraftConfig, TargetConfig
    from jakiro_lib.data.conversations import Question
    from jakiro_lib.models.draft import DraftModel
    from jakiro_lib.models.target import load_target

    target = load_target(TargetConfig(model="tiny:llama"))
    draft = tmp_path / "d" / "draft"
    DraftModel.build(DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False, contrastive=False),
                     target.model).save(draft)
    moe = tmp_path / "m" / "draft"
    DraftModel.build(DraftConfig(num_experts=2), target.model).save(moe)
    spec = MethodSpec("spec", draft=str(draft), tree=TreeConfig(depth=3, top_k=2, total_tokens=4))
    ours = {"eagle2": spec,
            "jakiro_cepd": MethodSpec("spec", draft=str(moe), tree=TreeConfig(
                depth=3, top_k=2, total_tokens=6, decoupled=True, ar_steps=1)),
            "lookup_only": MethodSpec("spec", tree=TreeConfig(lookup_tokens=4))}
    path = run_benchmark(target, {"vanilla": MethodSpec("vanilla"), "hf_generate": MethodSpec("hf"), **ours},
                         [Question("q1", "writing", ["Say something."], "mt_bench")], temperatures=(0.0, 1.0),
                         max_new_tokens=8, warmup=1, out_dir=tmp_path / "bench", progress=False)
    recs = {(record_label(r), r["temperature"]): r for r in load_records(path)}
    assert set(recs) == {(m, t) for m in ("vanilla", "hf_generate", *ours) for t in (0.0, 1.0)}
    for name in ours:
        assert recs[name, 0.0]["output_ids"] == recs["vanilla", 0.0]["output_ids"], name
    assert {(r["method"], r["engine"], r["capture"]) for r in recs.values()} == {
        ("vanilla", "static", "none"), ("hf_generate", "hf", "none"), *((m, "static", "none") for m in ours)}
    again = run_benchmark(target, {"eagle2": spec}, [Question("q1", "writing", ["Say something."], "mt_bench")],
                          temperatures=(1.0,), max_new_tokens=8, warmup=0, out_dir=tmp_path / "again", progress=False)
    assert load_records(again)[0]["output_ids"] == recs["eagle2", 1.0]["output_ids"]


def test_ablations_carry_the_authors_released_configuration(tmp_path):
    """jakiro_coupled_cepd: the coupled mixture with CEPD on the last layer, on the 2-expert draft."""
    from jakiro_lib.layout import draft_path

    tree = TreeConfig(depth=5, total_tokens=8)
    abl = study_methods(tree, tmp_path, study="ablations")
    released = abl["jakiro_coupled_cepd"]
    assert released.kind == "spec" and released.draft == str(draft_path(tmp_path, "moe2"))
    assert released.tree == dataclasses.replace(tree, decoupled=False, ar_steps=3)  # depth - 2
    assert released.tree == dataclasses.replace(abl["cepd ar_steps=3"].tree, decoupled=False)
    assert "jakiro_coupled_cepd" not in study_methods(tree, tmp_path, study="main")
    with pytest.raises(ValueError, match="unknown study"):
        study_methods(tree, tmp_path, study="nope")


def test_ablations_carry_the_multi_step_trained_drafts_on_the_same_trees(tmp_path):
    """eagle2_u2 / eagle2_h_u2 / jakiro_u2 / jakiro_coupled_u2 / jakiro_xgate_u2 / jakiro_coupled_cepd_u2: the
    trees of their one-step twins on the drafts trained with two unrolled steps; the default profile trains
    dense_u2 and moe2_u2, and FAITHFUL_DRAFTS (opt-in) every u2 twin."""
    from jakiro_lib.profiles import DEFAULT_DRAFTS, FAITHFUL_DRAFTS, get_profile
    from jakiro_lib.layout import draft_name, draft_path

    tree = TreeConfig(depth=4, total_tokens=8)
    abl = study_methods(tree, tmp_path, study="ablations")
    twins = (("eagle2_u2", "experts=1 (eagle2)", "dense_u2"), ("eagle2_h_u2", "eagle2_h", "dense_h_u2"),
             ("jakiro_u2", "experts=2", "moe2_u2"), ("jakiro_coupled_u2", "experts=2, coupled", "moe2_u2"),
             ("jakiro_xgate_u2", "jakiro_xgate", "moe2_xgate_u2"), ("jakiro_coupled_cepd_u2", "jakiro_coupled_cepd", "moe2_u2"))
    for name, twin, draft in twins:
        assert abl[name] == dataclasses.replace(abl[twin], draft=str(draft_path(tmp_path, draft)))
    default = get_profile("default")
    assert tuple(default.drafts) == DEFAULT_DRAFTS
    assert {k: v.unroll_steps for k, v in default.drafts.items() if v.unroll_steps} == {"dense_u2": 2, "moe2_u2": 2}
    # the complete comparison: each u2 draft is its one-step twin but for the unrolled steps
    faithful = get_profile("default", drafts=",".join(FAITHFUL_DRAFTS)).drafts
    assert set(DEFAULT_DRAFTS) < set(faithful) and tuple(faithful) == FAITHFUL_DRAFTS
    for u2 in (d for d in faithful if d.endswith("_u2")):
        assert faithful[u2].unroll_steps == 2
        assert dataclasses.replace(faithful[u2], unroll_steps=None) == faithful[u2.removesuffix("_u2")]
    assert {m for m, spec in study_methods(tree, tmp_path, study="ablations", drafts=FAITHFUL_DRAFTS).items()
            if spec.draft and draft_name(spec.draft).endswith("_u2")} == {t[0] for t in twins}


def test_ablations_carry_the_equal_parameter_control_and_the_per_expert_loss_drafts(tmp_path):
    """eagle2_h: EAGLE-2 trees on the H-wide dense_h; jakiro_xgate / jakiro_xequal: Jakiro decoupled on the
    drafts trained with a per-expert loss; none of them in the main study."""
    from jakiro_lib.layout import draft_path

    tree = TreeConfig(depth=4, total_tokens=8)
    abl = study_methods(tree, tmp_path, study="ablations")
    assert abl["eagle2_h"] == MethodSpec("spec", draft=str(draft_path(tmp_path, "dense_h")), tree=tree)
    assert abl["eagle2_h"].tree == abl["experts=1 (eagle2)"].tree
    for name, draft in (("jakiro_xgate", "moe2_xgate"), ("jakiro_xequal", "moe2_xequal")):
        assert abl[name] == MethodSpec("spec", draft=str(draft_path(tmp_path, draft)),
                                       tree=dataclasses.replace(tree, decoupled=True))
        assert abl[name].tree == abl["experts=2"].tree
    main = study_methods(tree, tmp_path, study="main")
    assert not {"eagle2_h", "jakiro_xgate", "jakiro_xequal"} & set(main)


@pytest.mark.parametrize("study", ["main", "ablations"])
def test_methods_on_drafts_a_profile_does_not_train_are_left_out(tmp_path, study):
    from jakiro_lib.profiles import get_profile
    from jakiro_lib.layout import draft_name
    from jakiro_lib.study import profile_methods

    tree = TreeConfig(depth=4, total_tokens=8)
    every = study_methods(tree, tmp_path, study=study)
    kept = study_methods(tree, tmp_path, study=study, drafts=["dense"])
    left_out = {k for k, m in every.items() if m.draft and draft_name(m.draft) != "dense"}
    assert left_out and set(every) - set(kept) == left_out
    assert all(kept[k] == every[k] for k in kept)
    assert "lookup_only" not in left_out and "vanilla" in kept  # no draft: never left out
    for name in ("smoke", "default"):
        prof = get_profile(name)
        methods = profile_methods(prof, tmp_path, study)
        assert {draft_name(m.draft) for m in methods.values() if m.draft} <= set(prof.drafts)
        fewer = dataclasses.replace(prof, drafts={k: v for k, v in prof.drafts.items() if k != "moe2_xgate"})
        assert set(methods) - set(profile_methods(fewer, tmp_path, study)) == (  # the headline Jakiro draft
            {"jakiro_xgate"} if study == "ablations" else {"jakiro", "jakiro_cepd", "jakiro_auto", "jakiro_lookup"})


def test_one_serializer_names_a_draft_by_folder_or_relative_to_a_file(tmp_path):
    from jakiro_lib.measure.methods import portable

    spec = MethodSpec("spec", draft=str(tmp_path / "drafts" / "moe2" / "draft"), tree=TreeConfig(total_tokens=4))
    assert portable(spec)["draft"] == "moe2"  # the study stamp: the weights' digest says which draft
    assert portable(spec, relative_to=tmp_path / "bench" / "main")["draft"] == "../../drafts/moe2/draft"
    assert portable(spec)["tree"]["total_tokens"] == 4 and portable(MethodSpec("hf"))["draft"] is None


def test_perf_goal_groups_come_from_the_registry():
    from jakiro_lib.measure import perf
    from jakiro_lib.measure.methods import MAIN

    names = {m.name for m in MAIN}
    assert set(perf.JAKIRO_METHODS) <= names and set(perf.EAGLE_METHODS) <= names and set(perf.HF_METHODS) <= names
    assert perf.JAKIRO_METHODS == ("jakiro", "jakiro_cepd", "jakiro_auto")
    assert perf.OUR_VANILLA == ("vanilla",)
    assert perf.HF_METHODS == ("hf_generate", "hf_compiled")
    assert perf.LOOKUP_METHODS == ("jakiro_lookup",)
    assert perf.LOOKUP_METHOD == "jakiro_lookup"


def test_summary_per_category_splits_a_benchmark_and_skips_records_without_categories():
    from jakiro_lib.measure.summary import summarize_by_category

    recs = _recs("vanilla", [10.0, 10.0, 10.0], kind="vanilla") + _recs("jakiro", [20.0, 30.0, 40.0])
    assert summarize_by_category(recs) == []  # records written before categories were recorded
    for r in recs:
        r["category"] = "math" if r["question_id"] == 0 else "writing"
    rows = {(r["method"], r["category"]): r for r in summarize_by_category(recs)}
    assert set(rows) == {(m, c) for m in ("vanilla", "jakiro") for c in ("math", "writing")}
    assert rows[("jakiro", "math")]["speedup"] == pytest.approx(2.0)  # against vanilla's math prompts only
    assert rows[("jakiro", "writing")]["speedup"] == pytest.approx(3.5)
    assert {r["benchmark"] for r in rows.values()} == {"mt_bench"} and rows[("jakiro", "writing")]["questions"] == 2
    assert [r["method"] for r in summarize(recs)] == ["jakiro", "vanilla"]  # the benchmark rows are unchanged


def test_every_kind_dispatches_to_its_generator_and_greedy_matches_vanilla(monkeypatch):
    import jakiro_lib.decoding.methods as methods
    from jakiro_lib.data.chat import format_prompt_ids
    from jakiro_lib.config import TargetConfig
    from jakiro_lib.config import KINDS
    from jakiro_lib.models.target import load_target
    from jakiro_lib.decoding.verify import SamplingParams

    calls = []
    for name in ("static_generate", "hf_generate"):
        def logged(*args, _real=getattr(methods, name), _name=name, **kwargs):
            calls.append((_name, kwargs.get("prompt_lookup_num_tokens", args[1] is None if len(args) > 1 else None)))
            return _real(*args, **kwargs)
        monkeypatch.setattr(methods, name, logged)
    target = load_target(TargetConfig(model="tiny:llama"))
    ids = format_prompt_ids(target, [{"role": "user", "content": "the cat the cat the cat"}])
    specs = {"vanilla": MethodSpec("vanilla"), "hf": MethodSpec("hf"), "pld": MethodSpec("pld", prompt_lookup_tokens=3),
             "spec": MethodSpec("spec", tree=TreeConfig(depth=2, top_k=2, total_tokens=4, lookup_tokens=4))}
    assert set(specs) == set(KINDS)
    outs = {}
    for kind, spec in specs.items():
        streamed = []
        res = MethodRunner(target, spec)(ids, max_new_tokens=12, params=SamplingParams(), seed=0,
                                         on_tokens=streamed.extend)
        outs[kind] = res.output_ids
        assert streamed == res.output_ids, kind
    # our kinds on the one engine (plain decoding: no draft), HF's on its generate (prompt lookup for pld)
    assert calls == [("static_generate", True), ("hf_generate", None), ("hf_generate", 3), ("static_generate", True)]
    assert len(outs["vanilla"]) == 12 and all(o == outs["vanilla"] for o in outs.values()), outs


def test_warm_up_runs_at_every_temperature(tmp_path, monkeypatch):
    """A compiled engine samples through a step of its own, compiled on its first sampling call: warming up
    at T=0 only left that compilation in the first measured T=1 prompt (the H200 run of 2026-11-26)."""
    from jakiro_lib.measure.bench import run_benchmark
    from jakiro_lib.config import TargetConfig
    from jakiro_lib.data.conversations import Question
    from jakiro_lib.models.target import load_target

    seen: list[float] = []
    call = MethodRunner.__call__
    monkeypatch.setattr(MethodRunner, "__call__",
                        lambda self, ids, **kw: seen.append(kw["params"].temperature) or call(self, ids, **kw))
    target = load_target(TargetConfig(model="tiny:llama"))
    run_benchmark(target, {"vanilla": MethodSpec("vanilla")}, [Question("q1", "writing", ["Hi."], "mt_bench")],
                  temperatures=(0.0, 1.0), max_new_tokens=4, warmup=1, out_dir=tmp_path, progress=False)
    assert seen == [0.0, 1.0, 0.0, 1.0]  # warm-up at both, then the measured prompt at both


def test_method_lists_split_on_commas_but_keep_names_that_hold_one():
    from jakiro_lib.measure.methods import parse_names

    known = ["vanilla", "experts=2", "experts=2, coupled", "experts=2, scoring=best", "eagle2"]
    assert parse_names("vanilla,experts=2, coupled, eagle2", known) == ["vanilla", "experts=2, coupled", "eagle2"]
    assert parse_names("experts=2,eagle2,experts=2, scoring=best", known) == [
        "experts=2", "eagle2", "experts=2, scoring=best"]
    assert parse_names(" vanilla,, nope ,", known) == ["vanilla", "nope"]


def test_no_compilation_inside_a_timed_prompt(tmp_path):
    """The warm-up compiles what the timed prompts run: every compiled path's cache is one length per context
    (compiled.compiled_cache_len), so a 16-token warm-up covers a prompt allowed 1000 new tokens. With caches
    sized to prompt + max_new_tokens the engine's captured step compiled again in the timed prompt (its record's
    compiled_graphs was 1), as HF's compiled generate did. The answer ends at an EOS chosen from its own greedy
    text, so the long budget costs no decoding."""
    from jakiro_lib.data.chat import format_prompt_ids
    from jakiro_lib.measure.bench import run_benchmark
    from jakiro_lib.measure.summary import load_records
    from jakiro_lib.config import TargetConfig
    from jakiro_lib.data.conversations import Question
    from reference.loop import vanilla_generate
    from jakiro_lib.models.target import load_target, set_capture

    target = load_target(TargetConfig(model="tiny:llama", max_context=2048))
    set_capture(target.model, "inductor")  # our plain decoding compiled
    text = "Say something about the sea."
    ids = format_prompt_ids(target, [{"role": "user", "content": text}])
    target.model.generation_config.eos_token_id = vanilla_generate(target.model, ids, max_new_tokens=4).output_ids[3]
    methods = {"vanilla": MethodSpec("vanilla"), "hf_compiled": MethodSpec("hf", compile=True)}
    path = run_benchmark(target, methods, [Question("q1", "writing", [text], "mt_bench")], temperatures=(0.0,),
                         max_new_tokens=1000, warmup=1, out_dir=tmp_path / "bench", progress=False)
    records = load_records(path)
    assert [record_label(r) for r in records] == list(methods)
    assert [(r["method"], r["engine"], r["capture"]) for r in records] == [("vanilla", "static", "inductor"),
                                                                           ("hf_compiled", "hf", "inductor")]
    for r in records:
        assert r["stop_reason"] == "eos" and r["new_tokens"] <= 4, r
        assert r["compiled_graphs"] == 0, r


def test_the_main_studys_drafts_are_named_by_the_profile(tmp_path):
    """bench.jakiro_draft / bench.eagle2_draft say which trained drafts the main study's Jakiro and EAGLE-2 rows
    draft from (default: moe2_xgate, chosen side by side; docs/DESIGN.md section 11); the ablations keep theirs."""
    from jakiro_lib.config import ConfigError
    from jakiro_lib.layout import draft_name
    from jakiro_lib.profiles import get_profile
    from jakiro_lib.study import profile_methods

    def drafts_of(prof, study="main"):
        return {k: draft_name(m.draft) for k, m in profile_methods(prof, tmp_path, study).items() if m.draft}

    default = drafts_of(get_profile("smoke"))
    assert {default[k] for k in ("jakiro", "jakiro_cepd", "jakiro_auto", "jakiro_lookup")} == {"moe2_xgate"}
    assert {default[k] for k in ("eagle2", "eagle2_auto", "eagle2_lookup")} == {"dense"}
    paper_loss = drafts_of(get_profile("smoke", **{"bench.jakiro_draft": "moe2", "bench.eagle2_draft": "dense_h"}))
    assert {paper_loss[k] for k in ("jakiro", "jakiro_cepd", "jakiro_auto", "jakiro_lookup")} == {"moe2"}
    assert {paper_loss[k] for k in ("eagle2", "eagle2_auto", "eagle2_lookup")} == {"dense_h"}
    ablations = drafts_of(get_profile("smoke", **{"bench.jakiro_draft": "moe2"}), "ablations")
    assert ablations == drafts_of(get_profile("smoke"), "ablations")  # the ablations name their drafts themselves
    with pytest.raises((ConfigError, ValueError), match="jakiro_draft"):
        get_profile("smoke", **{"bench.jakiro_draft": ""})


def test_the_draft_precision_is_a_setting_that_keeps_greedy_exact(tmp_path):
    """bench.draft_dtype: every drafted method of the study decodes with its draft's own layers in that precision
    (the borrowed head stays the target's), greedy output stays vanilla's, the stamp says so only when set (older
    stamps stay valid), and a precision the engine does not know is one clear error."""
    from jakiro_lib.config import ConfigError, TargetConfig
    from jakiro_lib.decoding.verify import SamplingParams
    from jakiro_lib.measure.methods import portable, profile_methods
    from jakiro_lib.models import kernels
    from jakiro_lib.models.target import load_target
    from jakiro_lib.profiles import get_profile

    target = load_target(TargetConfig(model="tiny:llama"))
    from helpers import random_prompts, trained_draft

    path = trained_draft(target.model, "moe2").save(tmp_path / "d" / "draft")
    tree = TreeConfig(depth=3, top_k=2, total_tokens=6, decoupled=True)
    ids = random_prompts(1, seed=3, min_len=12, max_len=12)[0]
    vanilla = MethodRunner(target, MethodSpec("vanilla"))(ids, max_new_tokens=12, params=SamplingParams(), seed=0)
    runner = MethodRunner(target, MethodSpec("spec", draft=str(path), tree=tree, draft_dtype="bfloat16"))
    if runner.draft.reduced_weights:  # a CPU with the streaming GEMM: bf16 copies of the weights, fp32 arithmetic
        assert kernels.packed_gemm(runner.draft).backend == kernels.HALF_WEIGHTS
    else:
        assert runner.draft.fc.weight.dtype == torch.bfloat16
    assert runner.draft.head_weight().dtype == torch.float32
    out = runner(ids, max_new_tokens=12, params=SamplingParams(), seed=0)
    assert out.output_ids == vanilla.output_ids and sum(out.accepted) > out.cycles  # drafted tokens accepted
    methods = profile_methods(get_profile("smoke", **{"bench.draft_dtype": "bfloat16"}), tmp_path, "main")
    assert {m.draft_dtype for m in methods.values() if m.draft} == {"bfloat16"}
    assert {m.draft_dtype for m in methods.values() if not m.draft} == {None}
    assert "draft_dtype" not in portable(MethodSpec("spec", draft=str(path), tree=tree))
    assert portable(methods["jakiro"])["draft_dtype"] == "bfloat16"
    with pytest.raises(ConfigError, match="draft_dtype"):
        get_profile("smoke", **{"bench.draft_dtype": "int4"})
    with pytest.raises(ValueError, match="unknown draft dtype"):
        MethodSpec("spec", draft=str(path), tree=tree, draft_dtype="int4")
    if kernels.packed_gemm_available(target.model, kernels.INT8_WEIGHTS):  # int8 copies of the weights, fp32 sums
        runner = MethodRunner(target, MethodSpec("spec", draft=str(path), tree=tree, draft_dtype="int8"))
        assert kernels.packed_gemm(runner.draft).backend == kernels.INT8_WEIGHTS
        out = runner(ids, max_new_tokens=12, params=SamplingParams(), seed=0)
        assert out.output_ids == vanilla.output_ids and sum(out.accepted) > out.cycles
    bf16_target = load_target(TargetConfig(model="tiny:llama", dtype="bfloat16"))
    with pytest.raises(ValueError, match="int8 through the package's CPU kernels only"):
        MethodRunner(bf16_target, MethodSpec("spec", draft=str(path), tree=tree, draft_dtype="int8"))
