"""The static-shape engine (jakiro_lib.decoding.static): the same trees as the loop engine's drafter, vanilla's greedy
output token for token, one host read per cycle (sampling: tests/test_verify.py)."""
from __future__ import annotations

import collections
import copy
import dataclasses
import json
import re

import pytest
import torch
import torch._inductor.config
from torch._inductor.utils import run_and_get_code

from helpers import DispatchedOps, RecordingGraph, random_prompts, tiny_target, trained_draft
from jakiro_lib.decoding import static, static_tree
from jakiro_lib.decoding.compiled import (CompileError, call_compiled, compiled_cache_len, engine_cycles, graphs_compiled,
                                         prepare_windows, static_cache)
from jakiro_lib.models.target import load_target, scratch, set_capture
from jakiro_lib.config import DraftConfig, TargetConfig, TreeConfig
from reference.loop import LoopRunner, speculative_generate, vanilla_generate
from jakiro_lib.models import draft_step, fast_paths, kernels
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.draft_blocks import StaticKV
from reference.drafting import FeatureDrafter, make_drafter
from jakiro_lib.decoding.runner import MAX_TREE_ROOM, KVLayer, SlidingWindowError, TargetRunner, _Where
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.decoding.static_tree import (StaticEngineError, StaticTreeDrafter, ancestor_mask, graft_chain,
                                             graft_chain_eager, greedy_path, greedy_walk)
from reference.tree import Tree
from jakiro_lib.decoding.verify import SamplingParams
from jakiro_lib.measure.clock import StepClock

MAX_NEW = 40
CASES = {  # name: (trained draft, tree options)
    "dense": ("dense", {}),
    "moe2-coupled": ("moe2", {}),
    "moe2-decoupled": ("moe2", {"decoupled": True}),
    "moe2-decoupled-best": ("moe2", {"decoupled": True, "scoring": "best"}),
    # CEPD: after ar_steps layers drafted one per forward, each forward yields two (branch A, then B)
    "moe2-coupled-cepd0": ("moe2", {"ar_steps": 0}),
    "moe2-coupled-cepd1": ("moe2", {"ar_steps": 1}),
    "moe2-decoupled-cepd1": ("moe2", {"decoupled": True, "ar_steps": 1}),
}
SHAPES = [dict(depth=4, top_k=3, total_tokens=12), dict(depth=3, top_k=4, total_tokens=8),
          dict(depth=5, top_k=2, total_tokens=40), dict(depth=1, top_k=3, total_tokens=2)]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, seed=4321, min_len=1, max_len=48)


@pytest.fixture(scope="module")
def vanilla(prompts):
    model = tiny_target("llama")
    return [vanilla_generate(model, p, max_new_tokens=MAX_NEW).output_ids for p in prompts]


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("case", list(CASES))
def test_static_trees_equal_the_loop_drafters(prompts, case, shape):
    """After the same context, the static drafter proposes the loop drafter's tree: same tokens, parents
    and depths (node order included), hence the same verification."""
    model = tiny_target("llama")
    name, opts = CASES[case]
    draft = trained_draft(model, name)
    tree = TreeConfig(**SHAPES[shape], **opts)
    loop = FeatureDrafter(draft, tree)
    static = StaticTreeDrafter(draft, tree, capacity=256)
    with torch.inference_mode():
        for p in prompts[:4]:
            hidden = model.model(input_ids=p[None]).last_hidden_state[0]
            root = int(model.lm_head(hidden[-1]).argmax())
            loop.begin(p, hidden, root)
            n = p.numel()
            static.extend(hidden, torch.cat([p[1:], torch.tensor([root])]), torch.tensor(0), torch.tensor(n - 1))
            want = loop.propose()
            tokens, parents, depths, ranks, anc = static.propose(torch.tensor(n))
            assert torch.equal(anc, ancestor_mask(parents, static.max_depth))
            assert tokens.tolist() == want.tokens.tolist(), (case, shape)
            assert parents.tolist()[1:] == want.parents[1:] and depths.tolist() == want.depths.tolist()
            assert torch.equal(anc, want.ancestor_mask()) and ranks.tolist() == want.ranks


@pytest.mark.parametrize("case", list(CASES))
def test_static_greedy_equals_vanilla(prompts, vanilla, case):
    """fp32 on CPU: every prompt's output equals vanilla's, with drafted paths accepted (tau > 1.5, some
    cycles keep 3+ drafted tokens), and the same accepted lengths as the loop engine's."""
    model = tiny_target("llama")
    name, opts = CASES[case]
    draft = trained_draft(model, name)
    tree = TreeConfig(depth=4, top_k=3, total_tokens=12, **opts)
    emitted = cycles = longest = 0
    for i, p in enumerate(prompts):
        r = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW)
        assert r.output_ids == vanilla[i], (case, i)
        assert sum(r.accepted) == MAX_NEW - 1 and len(r.tree_sizes) == r.cycles
        loop = speculative_generate(model, FeatureDrafter(draft, tree), p, max_new_tokens=MAX_NEW)
        assert r.accepted == loop.accepted and r.draft_forwards == loop.draft_forwards, (case, i)
        ranked = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, ranked=True)
        assert ranked.output_ids == r.output_ids and ranked.path_ranks == loop.path_ranks, (case, i)
        emitted, cycles, longest = emitted + sum(r.accepted), cycles + r.cycles, max(longest, max(r.accepted))
    # CEPD's two-ahead layers come from the tiny drafts' weaker branch B: 1.64 tokens a cycle, longest path 3
    # with ar_steps=0 (2026-11-27); the one-layer cases reach 4
    assert emitted / cycles > 1.5 and longest >= (3 if "cepd" in case else 4), (emitted / cycles, longest)


def test_static_eos_and_context_end(prompts):
    """EOS stops where vanilla stops; near the end of the context the root alone is verified, so the
    output runs to the last position as vanilla's does."""
    model = tiny_target("llama")
    draft = trained_draft(model, "dense")
    tree = TreeConfig(depth=4, top_k=3, total_tokens=12)
    p = prompts[1]
    ref = vanilla_generate(model, p, max_new_tokens=MAX_NEW).output_ids
    eos = ref[9]
    r = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, eos_token_ids=[eos])
    assert r.output_ids == ref[:ref.index(eos) + 1] and r.stop_reason == "eos"
    ctx = p.numel() + 15
    want = vanilla_generate(model, p, max_new_tokens=MAX_NEW, max_context=ctx)
    got = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, max_context=ctx)
    assert got.output_ids == want.output_ids and got.stop_reason == want.stop_reason == "context"


@pytest.mark.parametrize("tokens", [12, 2])
def test_compiled_cycle_equals_vanilla(prompts, vanilla, tokens):
    """With ``compile`` the whole cycle goes through torch.compile (inductor here, CUDA graphs on a GPU):
    the same outputs, the compiled step used for every cycle of the later prompts (one compilation; a
    Python value read inside the step would recompile it each cycle). Decoupled candidates, CEPD
    (ar_steps=1: one layer, then two per forward) and a lookup chain (an input of the step), so every
    drafting branch is compiled; and a two-token tree (the root's best child, no pool)."""
    model = copy.deepcopy(tiny_target("llama"))  # its own compiled state
    draft = trained_draft(model, "moe2")
    tree = TreeConfig(depth=4, top_k=3, total_tokens=tokens, decoupled=True, ar_steps=1, lookup_tokens=4,
                      lookup_min_ngram=1)
    cycles = 0
    for i, p in enumerate(prompts[:3]):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):  # compiled once, by the first prompt
            r = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, compile=True)
        assert r.output_ids == vanilla[i]
        cycles += r.cycles
    (engine,) = scratch(model)["engines"].values()
    assert engine.compiled_cycles == cycles


def test_compiled_sampling_cycle_equals_eager(prompts):
    """At T > 0 the compiled cycle reads the same uniforms (drawn into the engine's buffer outside the step)
    as the eager one, so one seed gives the same text both ways; compiled once, then reused."""
    model = tiny_target("llama")
    draft = trained_draft(model, "dense")
    tree = TreeConfig(depth=3, top_k=3, total_tokens=8)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    for i, p in enumerate(prompts[:3]):
        eager = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, params=params,
                                generator=torch.Generator().manual_seed(i))
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            compiled = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, params=params,
                                       generator=torch.Generator().manual_seed(i), compile=True)
        assert compiled.output_ids == eager.output_ids and compiled.accepted == eager.accepted
    (engine,) = [e for e in scratch(model)["engines"].values() if e.params == params]
    assert engine.compiled_cycles > 0


def test_compiled_draft_keeps_the_eager_trees(prompts, vanilla):
    """target.capture "draft": an eager cycle whose tree pool is one compiled call (decoupled candidates, CEPD's branch
    B) gives vanilla's output and the eager engine's accepted lengths greedy, the eager text sampled, on prompts of
    different lengths: compiled once (the window and the cache's length are shapes the graph keeps free)."""
    model = copy.deepcopy(tiny_target("llama"))
    draft = trained_draft(model, "moe2")
    tree = TreeConfig(depth=4, top_k=3, total_tokens=12, decoupled=True, ar_steps=1)
    params = SamplingParams(temperature=1.0)
    compiled_before = graphs_compiled()
    for i, p in enumerate(prompts[:4]):
        runs = {}
        for capture in ("none", "draft"):
            set_capture(model, capture)
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                runs[capture] = [static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, params=params,
                                                 generator=torch.Generator().manual_seed(i))
                                 for params in (SamplingParams(), params)]
            with torch._dynamo.config.patch(error_on_recompile=True):  # a clock listening: the same graph
                clocked = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, clock=StepClock(model.device))
        (greedy, sampled), (eager_greedy, eager_sampled) = runs["draft"], runs["none"]
        assert greedy.output_ids == vanilla[i] and greedy.accepted == eager_greedy.accepted == clocked.accepted, i
        assert sampled.output_ids == eager_sampled.output_ids, i
    assert graphs_compiled() == compiled_before + 1
    # another tree and draft in the process: a graph of their own, whose other shapes are not taken as dynamic
    coupled = dataclasses.replace(tree, decoupled=False, ar_steps=None)
    for other, name in ((dataclasses.replace(coupled, depth=3), "moe2"), (coupled, "dense")):
        r = static_generate(model, trained_draft(model, name), other, prompts[0], max_new_tokens=MAX_NEW)
        assert r.output_ids == vanilla[0]
    assert graphs_compiled() == compiled_before + 3


@pytest.mark.parametrize("shape", [dict(depth=5, top_k=4, total_tokens=8), dict(depth=6, top_k=4, total_tokens=16)])
def test_the_compiled_draft_compiles_deep_trees(prompts, vanilla, shape):
    """target.capture "draft" with trees deeper than the default's (the paper's depth 6): the pool compiles (inductor
    generated C++ that did not build for a frontier's own slots written into its mask by slice assignment) and gives
    vanilla's output."""
    model = copy.deepcopy(tiny_target("llama"))
    set_capture(model, "draft")
    r = static_generate(model, trained_draft(model, "dense"), TreeConfig(**shape), prompts[1], max_new_tokens=MAX_NEW)
    assert r.output_ids == vanilla[1] and max(r.accepted) > 1


def test_sampled_plain_decoding_draws_as_the_reference_loop(prompts, monkeypatch):
    """At T > 0 plain decoding on the engine (a one-node tree each cycle, its token drawn from the whole distribution
    by inverse CDF of one uniform) gives the reference loop's text for the same seed: the same law, the same draws.
    Where the head's screen draws instead (temperature alone, fast_paths.sampled_argmax: the same law by other draws,
    tests/test_fast_paths.py), it is taken off for the first comparison; with it, each token is the screen's draw
    from the row's uniform (the cycle's first), which the engine's text shows by equalling a run that draws each token
    from the full logits plus the same noise."""
    model = tiny_target("llama")
    ops = torch.ops.jakiro_stream_gemm if kernels.stream_gemm_available() else None
    drawn = fast_paths.sampled_argmax
    screened = []

    def noisy_argmax(model_, hidden, draws, temperature):  # the screen's draw, by its definition (full logits + noise)
        screened.append(drawn(model_, hidden, draws, temperature))
        noise = ops.gumbel_noise(draws, model_.lm_head.weight.shape[0], temperature)
        return (ops.linear(hidden, ops.pack(model_.lm_head.weight.detach(), False), noise.shape[1]) + noise).argmax(-1)

    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9)):
        for i, p in enumerate(prompts[:3]):
            kw = lambda: dict(max_new_tokens=MAX_NEW, params=params, generator=torch.Generator().manual_seed(i))  # noqa: E731
            with monkeypatch.context() as m:
                m.setattr(fast_paths, "sampled_argmax", lambda *a: None)
                ours = static_generate(model, None, None, p, **kw())
            assert ours.output_ids == vanilla_generate(model, p, **kw()).output_ids, (params, i)
            if ops is not None and params.top_p == 1.0:
                screen = static_generate(model, None, None, p, **kw())
                with monkeypatch.context() as m:
                    m.setattr(fast_paths, "sampled_argmax", noisy_argmax)
                    assert static_generate(model, None, None, p, **kw()).output_ids == screen.output_ids, i
    assert ops is None or screened and all(s is not None for s in screened)  # the screen drew every token


@pytest.mark.parametrize("case", ["cepd-lookup", "sampling", "decoder", "two-tokens"])
def test_a_captured_step_replays_the_eager_one(prompts, vanilla, monkeypatch, case):
    """target.capture="graphs" (CapturedStep: the eager step recorded as one CUDA graph) with a stand-in graph
    that replays the step over the recorded arguments and checks that each replay touches the buffers the
    first did and reads nothing on the host: warmed up by the first cycle, recorded by the second, replayed by
    every later one, across prompts; vanilla's greedy output (CEPD and a lookup chain: every branch, and
    plain decoding) and at T > 0 the eager engine's text (the uniforms are an argument)."""
    graph = RecordingGraph()
    monkeypatch.setattr(static, "graph_capture", lambda model: graph)
    monkeypatch.setattr(static, "WINDOW_STEP", 32)  # several attention windows per prompt, each its own graph
    model = copy.deepcopy(tiny_target("llama"))  # its own compiled state
    draft = None if case == "decoder" else trained_draft(model, "moe2")
    tree = None if case == "decoder" else TreeConfig(depth=4, top_k=3, total_tokens=2 if case == "two-tokens" else 12,
                                                     decoupled=True, ar_steps=1, lookup_tokens=4, lookup_min_ngram=1)
    params = SamplingParams(temperature=1.0, top_p=0.9) if case == "sampling" else SamplingParams()
    for i, p in enumerate(prompts[:3]):
        def run(compile: bool) -> list[int]:
            gen = torch.Generator().manual_seed(i)
            return static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, params=params, generator=gen,
                                   compile=compile).output_ids
        got = run(True)
        assert got == (run(False) if case == "sampling" else vanilla[i]), i
    (engine,) = scratch(model)["engines"].values()
    windows = len(engine._compiled)  # each window's step: warmed up by its first cycle, recorded by its second
    assert windows > 2 and graph.replays == engine.compiled_cycles - windows > 2 * len(prompts[:3])


def test_the_graph_stand_in_fails_a_replay_under_another_window():
    """RecordingGraph re-runs the Python step at each replay; a step whose shapes follow an attention window set
    between replays (a graph recorded for one window replayed under another, where a real graph runs the recorded
    window's kernels) fails the replay instead of passing."""
    graph, window = RecordingGraph(), {"n": 4}
    replay = graph(lambda x: x[:window["n"]].sum(), (torch.arange(8.0),))
    assert replay() == replay() == 6.0
    window["n"] = 6
    with pytest.raises(AssertionError, match="other kernels or shapes"):
        replay()


@pytest.mark.parametrize("read", [lambda x: torch.tensor(x.tolist()), lambda x: x * bool(x.any()),
                                  lambda x: x * x.sum().item()])
def test_the_graph_stand_in_fails_a_step_that_reads_the_host(read):
    """A host read inside a replay (``tolist``, ``bool``, ``item``; under inference mode, as the engine runs) fails
    it, as a CUDA graph's capture would."""
    replay = RecordingGraph()(read, (torch.arange(4.0),))
    with torch.inference_mode(), pytest.raises(AssertionError, match="reads the host"):
        replay()


@pytest.mark.parametrize("case", ["tree", "decoder"])
def test_a_captured_generation_runs_to_the_end_of_the_context(prompts, monkeypatch, case):
    """A captured generation (the graph stand-in, several attention windows) asked for more tokens than its context
    holds stops at the context's end with reason "context", its text vanilla's token for token to the last
    position: the cycles near the end, where a whole tree no longer fits, verify the root alone."""
    monkeypatch.setattr(static, "graph_capture", lambda model: RecordingGraph())
    monkeypatch.setattr(static, "WINDOW_STEP", 32)
    model = copy.deepcopy(tiny_target("llama"))  # its own compiled state
    draft = None if case == "decoder" else trained_draft(model, "moe2")
    tree = None if case == "decoder" else TreeConfig(depth=3, top_k=3, total_tokens=8, decoupled=True, lookup_tokens=3)
    p, context = prompts[1], 100
    want = vanilla_generate(model, p, max_new_tokens=500, max_context=context)
    got = static_generate(model, draft, tree, p, max_new_tokens=500, max_context=context, compile=True)
    # every position written, and the token chosen at the last one emitted (it is never written)
    assert want.stop_reason == got.stop_reason == "context" and p.numel() + len(want.output_ids) == context + 1
    assert got.output_ids == want.output_ids
    (engine,) = scratch(model)["engines"].values()
    assert engine.compiled_cycles > 0 and len(engine._compiled) > 2


@pytest.mark.parametrize("case", ["moe2-decoupled-cepd1", "dense-lookup"])
def test_a_draft_in_another_precision_keeps_greedy_exact(prompts, vanilla, case):
    """A draft whose own layers run in bf16 on the fp32 target (the target's embedding and head rows stay fp32:
    the head is given the draft's features in its precision): vanilla's greedy text on every prompt, with drafts
    accepted (seen failing before the cast: the head's GEMM refused bf16 features)."""
    model = tiny_target("llama")
    name, tree = {"moe2-decoupled-cepd1": ("moe2", TreeConfig(depth=3, top_k=3, total_tokens=8, decoupled=True,
                                                              ar_steps=1)),
                  "dense-lookup": ("dense", TreeConfig(depth=4, top_k=3, total_tokens=12, lookup_tokens=3,
                                                       lookup_min_ngram=1))}[case]
    draft = trained_draft(model, name).to(torch.bfloat16)
    assert draft.fc.weight.dtype == torch.bfloat16 and draft.head_weight().dtype == torch.float32
    accepted: list[int] = []
    for i, p in enumerate(prompts):
        r = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW)
        assert r.output_ids == vanilla[i], (case, i)
        accepted += r.accepted
    assert sum(accepted) / len(accepted) > 1.4, (case, sum(accepted) / len(accepted))


def test_a_bf16_draft_packed_by_onednn_drafts_its_compiled_tree(prompts, vanilla):
    """A bf16 draft whose linears pack through oneDNN (as on a CPU with AMX) inside the compiled tree pool
    (``target.capture`` "draft", inductor without frozen weights): vanilla's greedy text with drafts accepted, where
    inductor's lowering of oneDNN's packed linear refused a packed weight it could not hold as a constant."""
    model = copy.deepcopy(tiny_target("llama"))
    draft = trained_draft(model, "moe2").to(torch.bfloat16)
    if kernels.enable_packed_gemm(draft, max_rows=64, backend="onednn", min_rows=1) is None:
        pytest.skip("oneDNN packs no bf16 weights on this CPU")
    tree = TreeConfig(depth=3, top_k=3, total_tokens=8, decoupled=True, ar_steps=1)
    set_capture(model, "draft")
    accepted: list[int] = []
    for i, p in enumerate(prompts[:3]):
        r = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW)
        assert r.output_ids == vanilla[i], i
        accepted += r.accepted
    assert sum(accepted) / len(accepted) > 1.4, sum(accepted) / len(accepted)


@pytest.mark.skipif(not kernels.packed_gemm_available(torch.zeros(1), kernels.HALF_WEIGHTS),
                    reason="the streaming GEMM cannot be built here")
@pytest.mark.parametrize("backend", kernels.REDUCED_WEIGHTS)
def test_a_draft_streaming_its_panels_steps_in_two_kernel_calls(prompts, vanilla, monkeypatch, backend):
    """A draft whose linears stream bf16 or int8 panels beside an fp32 target takes its steps of a few rows through the
    package's kernels (models/draft_step.py): eagerly, once the engine's cache has its buffers, in one call (the
    accepted path's forward and the tree's), else in two (the prompt's; the compiled tree's, extern calls in
    inductor's graph): vanilla's greedy text both ways with drafts accepted, and eagerly the reference loop's accepted
    lengths (its cache another, its steps the two calls)."""
    model = copy.deepcopy(tiny_target("llama"))
    draft = copy.deepcopy(trained_draft(model, "moe2"))
    kernels.enable_packed_gemm(draft, max_rows=64, backend=backend, min_rows=1)
    served = collections.Counter()

    def counting(name, call):
        def counted(*args):
            out = call(*args)
            if not torch.compiler.is_compiling():  # traced, the count would be a guard that fails every call
                served[name, out is not None] += 1
            return out
        return counted
    monkeypatch.setattr(draft_step, "fused_step", counting("two calls", draft_step.fused_step))
    monkeypatch.setattr(draft_step, "one_call", counting("one call", draft_step.one_call))
    tree = TreeConfig(depth=3, top_k=3, total_tokens=8, decoupled=True, ar_steps=1)
    for capture in ("none", "draft"):
        set_capture(model, capture)
        accepted: list[int] = []
        for i, p in enumerate(prompts[:3]):
            r = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW)
            assert r.output_ids == vanilla[i], (capture, i)
            accepted += r.accepted
            if capture == "none":
                assert r.accepted == speculative_generate(model, FeatureDrafter(draft, tree), p,
                                                          max_new_tokens=MAX_NEW).accepted, i
        assert sum(accepted) / len(accepted) > 1.4, (capture, sum(accepted) / len(accepted))
        # every step here (a prompt too, under the engine's causal mask, at most ATTEND_ROWS rows) takes the calls:
        # the eager steps of the cycles in one call (each prompt's, its cache not yet made, and the loop's in two)
        assert served["two calls", True] > 0 and served["two calls", False] == 0, (capture, served)
        assert served["one call", True] > 0 and served["one call", False] == 3, (capture, served)  # 3 prompts
        served.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:  # capture "draft"
        r = static_generate(model, draft, tree, prompts[0], max_new_tokens=MAX_NEW)
    mixes = sum(e.count for e in prof.key_averages() if e.key == "jakiro_stream_gemm::draft_mix")
    assert r.draft_forwards > 0 and mixes > r.cycles, (mixes, r.cycles)  # the tree's forwards too, not only the paths'


def _reduced_vocab_copy(model, name: str, backend: str):
    """Trained draft ``name`` as a reduced-vocabulary draft over the whole vocabulary in a shuffled order (its head the
    lm_head's rows through ``d2t``, so the int8 head and the id map are both exercised), streaming ``backend``'s
    panels: the same draft in target ids."""
    base = trained_draft(model, name)
    V = model.config.vocab_size
    d2t = torch.randperm(V, generator=torch.Generator().manual_seed(3))
    draft = DraftModel.build(dataclasses.replace(base.cfg, draft_vocab_size=V), model, d2t=d2t)
    draft.load_state_dict({**base.state_dict(), "d2t": d2t})
    kernels.enable_packed_gemm(draft.eval(), max_rows=64, backend=backend, min_rows=1)
    return draft


@pytest.mark.skipif(not kernels.packed_gemm_available(torch.zeros(1), kernels.HALF_WEIGHTS),
                    reason="the streaming GEMM cannot be built here")
@pytest.mark.parametrize("backend", kernels.REDUCED_WEIGHTS)
@pytest.mark.parametrize("case", list(CASES))
def test_an_eager_tree_in_one_kernel_call_is_the_python_pools_bit_for_bit(prompts, vanilla, monkeypatch, case,
                                                                          backend):
    """The eager tree of a draft streaming reduced panels with an int8 head, drafted and selected in one kernel call
    (``draft_tree``, models/draft_step.py's one_tree), is the Python pool's and select_tree's: tokens, parents, depths,
    ranks, the ancestor mask and the draft cache it wrote, equal, for three tree shapes; greedy generation with it is
    vanilla's, with the reference loop's accepted lengths (drafts accepted); sampled, one seed gives the Python pool's
    text."""
    model = tiny_target("llama")
    name, opts = CASES[case]
    draft = _reduced_vocab_copy(model, name, backend)
    served = collections.Counter()
    one_tree = static_tree.one_tree

    def counted(*args):
        out = one_tree(*args)
        served[out is not None] += 1
        return out
    with torch.inference_mode():
        for shape in SHAPES[:3]:
            tree = TreeConfig(**shape, **opts)
            trees = []
            for native in (True, False):
                monkeypatch.setattr(static_tree, "one_tree", counted if native else lambda *args: None)
                drafter = StaticTreeDrafter(draft, tree, capacity=256)
                for p in prompts[:3]:
                    hidden = model.model(input_ids=p[None]).last_hidden_state[0]
                    n = p.numel()
                    drafter.cache.window = n + MAX_TREE_ROOM
                    drafter.extend(hidden, torch.cat([p[1:], model.lm_head(hidden[-1:]).argmax(-1)]), 0, n - 1)
                    trees.append([*drafter.propose(n), drafter.cache.k[:, :, :n + drafter.n_slots].clone()])
            half = len(trees) // 2
            for got, want in zip(trees[:half], trees[half:]):
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (case, shape)
    assert served[True] == 9 and served[False] == 0, served
    monkeypatch.setattr(static_tree, "one_tree", counted)
    tree = TreeConfig(depth=4, top_k=3, total_tokens=12, **opts)
    accepted = []
    for i, p in enumerate(prompts[:3]):
        r = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW)
        assert r.output_ids == vanilla[i], (case, i)
        assert r.accepted == speculative_generate(model, FeatureDrafter(draft, tree), p,
                                                  max_new_tokens=MAX_NEW).accepted, (case, i)
        accepted += r.accepted
    assert served[True] > 9 and served[False] == 0, served
    assert sum(accepted) / len(accepted) > 1.4, sum(accepted) / len(accepted)
    params = SamplingParams(temperature=1.0, top_p=0.9)  # sampling (tests/test_verify.py) on the same trees: one seed,
    sampled = []  # one text, either way
    for native in (True, False):
        monkeypatch.setattr(static_tree, "one_tree", counted if native else lambda *args: None)
        sampled.append([static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, params=params,
                                        generator=torch.Generator().manual_seed(i)).output_ids
                        for i, p in enumerate(prompts[:2])])
    assert sampled[0] == sampled[1]


def test_static_forwards_read_only_their_window(prompts, vanilla, monkeypatch):
    """Every target and draft forward of the static engine reads the first attention_window(length) positions
    of its cache, not the whole context's buffer (2,304 positions compiled), and the text stays vanilla's."""
    monkeypatch.setattr(static, "graph_capture", lambda model: RecordingGraph())
    monkeypatch.setattr(static, "WINDOW_STEP", 32)
    model = copy.deepcopy(tiny_target("llama"))
    draft = trained_draft(model, "moe2")
    tree = TreeConfig(depth=3, top_k=3, total_tokens=8, decoupled=True)
    widths: list[int] = []
    update, append = KVLayer.update, StaticKV.append
    monkeypatch.setattr(KVLayer, "update", lambda self, *a, **k: _width(update(self, *a, **k), widths))
    monkeypatch.setattr(StaticKV, "append", lambda self, *a: _width(append(self, *a), widths))
    lengths: list[int] = []
    window = static.attention_window
    monkeypatch.setattr(static, "attention_window", lambda n, cap: lengths.append(n) or window(n, cap))
    p = prompts[0]
    r = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, compile=True)
    assert r.output_ids == vanilla[0]
    expected = {window(n, compiled_cache_len(2048)) for n in lengths}
    assert len(expected) > 1 and set(widths) - {p.numel()} == expected  # the prefill writes and reads its own rows
    assert max(widths) < compiled_cache_len(2048)


def test_prepared_windows_leave_nothing_to_record(prompts, vanilla, monkeypatch):
    """After one generation (the benchmark's warm-up), prepare_windows records every attention window up to the
    context, so later prompts record no graph (graphs_compiled, which the records' compiled_graphs read) and
    still give vanilla's text: what the recording steps wrote is rewritten by the next prefill. An engine that
    did not run since ``before`` (a tuner's other budget) records nothing."""
    monkeypatch.setattr(static, "graph_capture", lambda model: RecordingGraph())
    monkeypatch.setattr(static, "WINDOW_STEP", 32)
    model = copy.deepcopy(tiny_target("llama"))
    draft = trained_draft(model, "moe2")
    tree = TreeConfig(depth=3, top_k=3, total_tokens=8, decoupled=True, lookup_tokens=3)
    other = dataclasses.replace(tree, total_tokens=4)
    static_generate(model, draft, other, prompts[0][:4], max_new_tokens=2, compile=True, max_context=256)
    snapshot = engine_cycles(model)
    static_generate(model, draft, tree, prompts[0][:4], max_new_tokens=2, compile=True, max_context=256)
    before = graphs_compiled()  # one cycle so far: its window's step warmed up, nothing recorded
    prepare_windows(model, 256, snapshot)
    windows = {static.attention_window(n, compiled_cache_len(256)) for n in range(257)}  # 128, 160, ..., 384
    assert graphs_compiled() - before == len(windows) > 5
    before = graphs_compiled()
    for i, p in enumerate(prompts[:3]):
        assert static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, compile=True,
                               max_context=256).output_ids == vanilla[i]
    assert graphs_compiled() == before


def test_prepare_records_only_from_lengths_inside_the_cache(prompts, monkeypatch):
    """prepare(length) with a length far past the engine's cache runs its recording steps only from lengths a cycle
    can start at (at most the capacity less a tree's room) and records each window of the cache once."""
    monkeypatch.setattr(static, "graph_capture", lambda model: RecordingGraph())
    monkeypatch.setattr(static, "WINDOW_STEP", 32)
    model = copy.deepcopy(tiny_target("llama"))
    draft = trained_draft(model, "moe2")
    tree = TreeConfig(depth=3, top_k=3, total_tokens=8, decoupled=True)
    static_generate(model, draft, tree, prompts[0][:4], max_new_tokens=2, compile=True, max_context=256)
    (engine,) = scratch(model)["engines"].values()
    starts: list[int] = []
    run_step = engine._run_step
    monkeypatch.setattr(engine, "_run_step", lambda start, length: starts.append(int(start)) or run_step(start, length))
    with torch.inference_mode():
        engine.prepare(10 * engine.target.capacity)
    capacity = engine.target.capacity
    assert starts and max(starts) <= capacity - MAX_TREE_ROOM
    assert set(engine._compiled) == {static.attention_window(n, capacity) for n in range(capacity - MAX_TREE_ROOM + 1)}


def _width(kv: tuple[torch.Tensor, torch.Tensor], widths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    widths.append(kv[0].shape[2])
    return kv


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts what copies a device value to the host: ``.item()`` / ``int()`` / ``float()`` / a 0-dim tensor
    used as an index (the operators below) and ``.tolist()`` (not an operator: counted by a wrapper)."""

    READS = ("aten.item.default", "aten._local_scalar_dense.default")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.scalars = self.lists = 0
        tolist = torch.Tensor.tolist

        def counted(t: torch.Tensor):
            self.lists += 1
            return tolist(t)

        monkeypatch.setattr(torch.Tensor, "tolist", counted)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.scalars += str(func) in self.READS
        return func(*args, **(kwargs or {}))


def test_a_layer_only_writes_its_entries_and_a_move_is_one_gather_and_one_scatter(prompts, vanilla, monkeypatch):
    """In a captured cycle (device positions) each layer's cache runs only its own writes (its keys and values
    stacked and put into the one buffer: two kernels), and keeping the accepted path moves every layer's entries
    with one index_select and one index_copy_ (one buffer for all layers): the columns and positions are computed
    once per forward, not once per layer. A captured GPU
    step replays every kernel; per layer they were 2 of a SmolLM2 step's ~40 operators, and the per-layer move 120
    of a 4-token Jakiro cycle's. The text stays vanilla's. (The CPU stand-in for CUDA graphs replays the eager
    step over device positions.)"""
    monkeypatch.setattr(static, "graph_capture", lambda model: RecordingGraph())
    model = copy.deepcopy(tiny_target("llama"))  # its own compiled state
    draft = trained_draft(model, "moe2")
    mode = DispatchedOps(inside=False)

    calls = {"update": 0, "move": 0}

    def watched(name, method):
        def run(self, *a, **k):  # the writes at device positions (the prefill's, at host ones, are slices)
            mode.inside = name == "move" or isinstance(self.where.start, torch.Tensor)
            calls[name] += mode.inside
            try:
                return method(self, *a, **k)
            finally:
                mode.inside = False
        return run

    monkeypatch.setattr(KVLayer, "update", watched("update", KVLayer.update))
    monkeypatch.setattr(_Where, "move", watched("move", _Where.move))
    with mode:
        r = static_generate(model, draft, TreeConfig(depth=3, top_k=3, total_tokens=8), prompts[0],
                            max_new_tokens=MAX_NEW, compile=True)
    assert r.output_ids == vanilla[0]
    assert calls["update"] >= r.cycles * model.config.num_hidden_layers > 0
    assert 0 < calls["move"] <= r.cycles
    assert sorted(set(mode.ops)) == ["index_copy_", "index_put_", "index_select", "stack"], set(mode.ops)
    assert mode.ops.count("index_put_") == mode.ops.count("stack") == calls["update"]
    assert mode.ops.count("index_copy_") == mode.ops.count("index_select") == calls["move"]


@pytest.mark.parametrize("attention", ["ours", "transformers"])
def test_a_captured_step_runs_the_lean_forward(prompts, vanilla, monkeypatch, attention):
    """A captured cycle (device positions; the CPU stand-in for CUDA graphs) runs the target's layers through the
    lean forward, on our SDPA (a CPU's) and on transformers' (a GPU's), the text vanilla's. Without the package's C++
    kernels, as on a GPU, its RoPE turns queries and keys as one tensor with the sine's half negated once a forward,
    where transformers' forward negates twice a layer (5 kernels a layer instead of 10)."""
    monkeypatch.setattr(static, "graph_capture", lambda model: RecordingGraph())
    monkeypatch.setattr(fast_paths, "_kernel", lambda name, x: None)
    model = load_target(TargetConfig(model="tiny:llama", max_context=512, dtype="float32", device="cpu",
                                     gqa_attention=attention == "ours")).model
    assert model.config._attn_implementation == ("sdpa_gqa" if attention == "ours" else "sdpa")
    lean, mode = fast_paths.lean_forward, DispatchedOps(inside=False)
    steps = []

    def counted(*args):
        mode.inside = args[3] is not None  # a step's mask: a captured step's forward
        steps.append(mode.inside)
        try:
            return lean(*args)
        finally:
            mode.inside = False
    monkeypatch.setattr(fast_paths, "lean_forward", counted)
    with mode:
        r = static_generate(model, None, None, prompts[0], max_new_tokens=MAX_NEW, compile=True)
    assert r.output_ids == vanilla[0]
    assert sum(steps) >= r.cycles > 0
    assert mode.ops.count("neg") == sum(steps), collections.Counter(mode.ops)


def test_a_compiled_step_writes_the_cache_in_place(prompts, vanilla):
    """target.capture "inductor": the layers' keys and values are written into the one buffer in place, so the
    compiled step allocates no copy of it nor of a layer's part (writes into views of the buffer made inductor copy
    all of it once per layer: 30x slower steps at SmolLM2's 2,304 positions on a CPU)."""
    model = copy.deepcopy(tiny_target("llama"))  # its own compiled state
    set_capture(model, "inductor")
    with torch._inductor.config.patch(force_disable_caches=True):  # compiled here, its code seen
        r, code = run_and_get_code(lambda: static_generate(model, None, None, prompts[0], max_new_tokens=MAX_NEW,
                                                           compile=True))
    assert r.output_ids == vanilla[0]
    (runner,) = scratch(model)["static_runners"].values()
    stack = tuple(runner.where.stack.shape)  # [L, 2, B, kv, positions, D]
    allocations = re.findall(r"empty_strided_cpu\((\([0-9, ]*\))", "\n".join(code))
    assert allocations and not {str(stack), str(stack[2:])} & set(allocations), (stack, sorted(set(allocations)))


def test_every_layer_lives_in_one_buffer():
    """The runner's layers are views of one buffer, which keeps their entries as the text is written to its end
    and refuses a write past it in one line, and a move at the runner moves every layer's."""
    model = tiny_target("llama")
    runner = LoopRunner(model, 11)
    runner.prefill(torch.arange(6))
    before = [layer.keys[:, :, :6].clone() for layer in runner.cache.layers]
    stack = runner.where.stack
    for token in range(5):  # to the last of the 11 positions
        runner.step(token)
    assert runner.where.stack is stack and stack.shape[0] == model.config.num_hidden_layers and stack.shape[4] == 11
    for layer, old in zip(runner.cache.layers, before):
        assert layer.keys.data_ptr() == stack[layer.slot, 0].data_ptr() != stack[layer.slot, 1].data_ptr()
        assert torch.equal(layer.keys[:, :, :6], old)
    with pytest.raises(ValueError, match=r"^1 positions written at 11 pass the end of the runner's 11-position cache"):
        runner.step(0)
    runner.where.move(torch.tensor([4, 5]), torch.tensor([0, 1]))
    for layer, old in zip(runner.cache.layers, before):
        assert torch.equal(layer.keys[:, :, :2], old[:, :, 4:6])


@pytest.mark.parametrize("params,first,per_cycle", [(SamplingParams(), 1, 1), (SamplingParams(temperature=0.8), 3, 1)],
                         ids=["greedy", "sampling"])
def test_host_reads_per_cycle(prompts, monkeypatch, params, first, per_cycle):
    """Drafting and the cache updates never read a value on the host: per eager cycle the host reads once, the
    verified tree and its rows' chosen tokens (argmaxes, or draws) to walk its path (greedy_walk, the loop engine's
    way, which gives the cycle's result, the accepted tokens, on the host); plus the first token after the prefill
    (greedy: its argmax; sampling: a uniform, the distribution's total and the token). A captured step reads nothing
    (the graph stand-in fails on a read). The loop engine reads many times per cycle (which shows that the counter sees reads)."""
    model = tiny_target("llama")
    draft = trained_draft(model, "moe2")
    tree = TreeConfig(depth=4, top_k=3, total_tokens=12, decoupled=True)
    p = prompts[0]
    with _HostReads(monkeypatch) as static:
        r = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW, params=params,
                            generator=torch.Generator().manual_seed(0))
    assert (static.scalars, static.lists) == (first, per_cycle * r.cycles)
    with _HostReads(monkeypatch) as loop:
        speculative_generate(model, FeatureDrafter(draft, tree), p, max_new_tokens=MAX_NEW, params=params,
                             generator=torch.Generator().manual_seed(0))
    assert loop.scalars + loop.lists > 3 * r.cycles, (loop.scalars, loop.lists)


def test_greedy_path_on_a_hand_built_tree():
    """Root 0 with children 1 (token 5), 2 (token 6); 1 has child 3 (token 7). The target's argmax at the
    root is 5 and at node 1 is 7: path 0-1-3, 2 accepted, bonus = argmax at node 3."""
    tree = Tree(torch.tensor([9, 5, 6, 7]), [-1, 0, 0, 1], torch.tensor([0, 1, 1, 2]))
    logits = torch.full((4, 10), -1.0)
    logits[0, 5] = logits[1, 7] = logits[2, 1] = logits[3, 8] = 1.0
    parents = torch.tensor([0, 0, 0, 1])
    anc = ancestor_mask(parents, 2)
    assert torch.equal(anc, tree.ancestor_mask())
    path, n, bonus = greedy_path(tree.tokens, parents, tree.depths, anc, logits.argmax(-1), 3)
    assert path.tolist()[:3] == [0, 1, 3] and int(n) == 2 and int(bonus) == 8
    walked = greedy_walk(tree.tokens, parents, logits.argmax(-1))  # eager: the path alone, walked on the host
    assert walked == ([0, 1, 3], [5, 7, 8])  # the path's nodes; the accepted tokens, then the bonus
    logits[0, 5], logits[0, 6] = -1.0, 2.0  # now the root's argmax is 6: node 2, then node 2's argmax 1
    path, n, bonus = greedy_path(tree.tokens, parents, tree.depths, anc, logits.argmax(-1), 3)
    assert path.tolist()[:2] == [0, 2] and int(n) == 1 and int(bonus) == 1
    walked = greedy_walk(tree.tokens, parents, logits.argmax(-1))
    assert walked == ([0, 2], [6, 1])


def test_a_sliding_window_the_cache_fits_in_attends_as_full_and_a_shorter_one_is_refused():
    """Sliding-window layers (Mistral) attend like full ones while the cache holds no more positions than the window:
    then plain decoding gives HF's own greedy tokens; a shorter window is refused in one line."""
    mistral = copy.deepcopy(tiny_target("mistral"))
    mistral.config.sliding_window = 16
    with pytest.raises(SlidingWindowError, match="shorter than"):
        TargetRunner(mistral, 256)
    with pytest.raises(SlidingWindowError, match="sliding window"):
        static_generate(mistral, None, None, torch.tensor([1, 2, 3]), max_new_tokens=4)
    mistral.config.sliding_window = 4096
    p = torch.tensor([5, 17, 40, 3, 99, 12])
    with torch.inference_mode():
        want = mistral.generate(p[None], attention_mask=torch.ones_like(p)[None], max_new_tokens=12,
                                min_new_tokens=12, do_sample=False, pad_token_id=0)[0, p.numel():].tolist()
    assert static_generate(mistral, None, None, p, max_new_tokens=12).output_ids == want


def test_settings_the_static_engine_does_not_run():
    model = tiny_target("llama")
    torch.manual_seed(0)
    dense = DraftModel.build(DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False,
                                         contrastive=False), model).eval()
    for draft, tree, words in [(dense, TreeConfig(ar_steps=1), "branch B"),
                               (dense, TreeConfig(total_tokens="auto"), "auto"),
                               (dense, TreeConfig(decoupled=True), "2 experts"),
                               (dense, TreeConfig(depth=3, top_k=8, total_tokens=200), "does not fit")]:
        with pytest.raises(StaticEngineError, match=words):
            StaticTreeDrafter(draft, tree, 256)
    # the lookup chain's rows count too: 120 drafted + 10 chained tokens pass the 128 positions kept past the text
    with pytest.raises(StaticEngineError, match="130 tokens does not fit"):
        static_generate(model, dense, TreeConfig(depth=3, top_k=8, total_tokens=120, lookup_tokens=10),
                        torch.tensor([1, 2, 3]), max_new_tokens=4)


def _random_tree(g: torch.Generator, vocab: int = 5) -> Tree:
    """A random tree over a small vocabulary, siblings distinct (as drafted trees are)."""
    tokens, parents, depths = [int(torch.randint(vocab, (1,), generator=g))], [-1], [0]
    for _ in range(1, int(torch.randint(1, 14, (1,), generator=g))):
        p = int(torch.randint(len(tokens), (1,), generator=g))
        used = {tokens[c] for c in range(1, len(tokens)) if parents[c] == p}
        free = [t for t in range(vocab) if t not in used]
        if not free:
            continue
        tokens.append(free[int(torch.randint(len(free), (1,), generator=g))])
        parents.append(p)
        depths.append(depths[p] + 1)
    return Tree(torch.tensor(tokens), parents, torch.tensor(depths))


def test_graft_chain_equals_the_loop_graft():
    """graft_chain (fixed shapes) merges a chain as Tree.graft does: the same nodes with the same tokens and
    depths, on the same root paths, and the ancestor mask of the whole tree; rows the chain did not need are
    invalid. graft_chain_eager makes the valid rows alone, with the sampling draws those rows have in the fixed
    shape (a sampled eager cycle decides as the compiled one)."""
    g = torch.Generator().manual_seed(0)
    grafted_somewhere = followed_somewhere = 0
    for _ in range(300):
        tree = _random_tree(g)
        L = int(torch.randint(1, 6, (1,), generator=g))
        c = int(torch.randint(0, L + 1, (1,), generator=g))
        chain = torch.randint(5, (c,), generator=g).tolist()
        want = tree.graft(chain) if chain else tree
        parents = torch.tensor([0] + tree.parents[1:])
        anc = ancestor_mask(parents, int(tree.depths.max()))
        tokens, got_parents, depths, got_anc, valid = graft_chain(tree.tokens, parents, tree.depths, anc,
                                                                  torch.tensor([c, *chain, *[0] * (L - c)]))
        assert tokens.shape[0] == len(tree) + L and valid[:len(tree)].all()
        assert torch.equal(got_anc, ancestor_mask(got_parents, int(depths.max())))  # every row, the invalid ones too
        keep = valid.nonzero()[:, 0].tolist()  # the real nodes, in index order (parents first)
        assert tokens[keep].tolist() == want.tokens.tolist() and depths[keep].tolist() == want.depths.tolist()
        index = {old: new for new, old in enumerate(keep)}
        assert [index[int(got_parents[i])] for i in keep[1:]] == want.parents[1:]
        assert torch.equal(got_anc[keep][:, keep], want.ancestor_mask())
        # eager: the rows the chain needs alone, each keeping the draws it has in the whole fixed-shape tree
        draws = torch.rand(len(tree) + L, generator=g, dtype=torch.float64)  # a row's draw
        e_tokens, e_parents, e_depths, e_anc, e_draws = graft_chain_eager(tree.tokens, parents, tree.depths, anc,
                                                                          chain, draws)
        assert e_tokens.tolist() == want.tokens.tolist() and e_depths.tolist() == want.depths.tolist()
        assert e_parents[1:].tolist() == want.parents[1:] and torch.equal(e_anc, want.ancestor_mask())
        assert torch.equal(e_draws, draws[keep])
        grafted_somewhere += len(want) > len(tree)
        followed_somewhere += bool(chain) and len(want) - len(tree) < len(chain)
    assert grafted_somewhere > 50 and followed_somewhere > 50, (grafted_somewhere, followed_somewhere)


LOOKUP_CASES = {  # the main study's lookup methods: EAGLE-2 and Jakiro trees with a chain, and the chain alone
    "eagle2_lookup": ("dense", {}),
    "jakiro_lookup": ("moe2", {"decoupled": True}),
    "lookup_only": (None, {}),
}


@pytest.mark.parametrize("case", list(LOOKUP_CASES))
def test_static_lookup_chains_equal_vanilla_and_the_loop(case):
    """Prompts that repeat themselves (so the chain is accepted): vanilla's greedy output and the loop engine's
    accepted lengths and tree sizes, cycle by cycle. Tokens a cycle (2026-11-27): the chain alone 1.73; dense 1.90 without
    the chain, 2.48 with it; moe2 decoupled 1.77 and 2.40: floors 1.5 and 2."""
    model = tiny_target("llama")
    name, opts = LOOKUP_CASES[case]
    draft = None if name is None else trained_draft(model, name)
    tree = TreeConfig(depth=3, top_k=3, total_tokens=8, lookup_tokens=6, lookup_min_ngram=1, **opts)
    emitted = cycles = 0
    for i, p in enumerate(random_prompts(4, seed=77, min_len=4, max_len=12)):
        ref = vanilla_generate(model, p, max_new_tokens=MAX_NEW).output_ids
        p = torch.cat([p, torch.tensor(ref[:20]), p])  # the continuation is in the context
        want = vanilla_generate(model, p, max_new_tokens=MAX_NEW).output_ids
        r = static_generate(model, draft, tree, p, max_new_tokens=MAX_NEW)
        assert r.output_ids == want, (case, i)
        loop = speculative_generate(model, make_drafter(draft, tree), p, max_new_tokens=MAX_NEW)
        assert r.accepted == loop.accepted, (case, i)
        assert r.tree_sizes == loop.tree_sizes, (case, i)  # eager: only the chain's new nodes verified, no padding
        emitted, cycles = emitted + sum(r.accepted), cycles + r.cycles
    assert emitted / cycles > (1.5 if draft is None else 2.0), emitted / cycles


def test_static_decoder_equals_vanilla_with_one_read_per_token(prompts, vanilla, monkeypatch):
    """Plain decoding on the static engine (no draft, no chain: the baseline a GPU captures as one graph per token):
    vanilla's greedy output, eagerly and compiled (compiled once, by the first prompt), and the host reads one
    tensor per token after the first (the prefill's argmax)."""
    model = tiny_target("llama")
    for i, p in enumerate(prompts[:3]):
        assert static_generate(model, None, None, p, max_new_tokens=MAX_NEW).output_ids == vanilla[i]
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            assert static_generate(model, None, None, p, max_new_tokens=MAX_NEW, compile=True).output_ids == vanilla[i]
    with _HostReads(monkeypatch) as reads:
        r = static_generate(model, None, None, prompts[0], max_new_tokens=MAX_NEW)
    assert (reads.scalars, reads.lists) == (1, len(r.output_ids) - 1)


def test_compiled_cache_lengths_and_a_failed_compile_names_itself():
    """Compiled steps see one cache shape per context (the context and a tree's room, rounded up to 256); a
    first compiled call that fails (no C++ compiler on a CPU, no triton on CUDA) is one CompileError saying
    what compiling needs."""
    assert compiled_cache_len(2048) == 2304 and compiled_cache_len(512) == 768

    def broken(*args):
        raise OSError("no C++ compiler")

    with pytest.raises(CompileError, match="without compile"):
        call_compiled(broken, torch.zeros(1), device=torch.device("cpu"), first=True)
    with pytest.raises(OSError):  # later calls: whatever went wrong, as it is
        call_compiled(broken, torch.zeros(1), device=torch.device("cpu"), first=False)


@torch.inference_mode()
def test_a_copy_of_a_model_does_not_share_its_compiled_state():
    """What compiled paths keep per model (HF's static caches, the static engine's shared runners and engines)
    is left behind by ``copy.deepcopy``: a copy whose head is then changed scores with its own head. Kept on the
    model as it was, a copied closure ran the original model (the static engine's sampling test failed after
    another test had used the tiny target)."""
    model = copy.deepcopy(tiny_target("llama"))
    p = torch.tensor([5, 6, 7])
    static_generate(model, None, None, p, max_new_tokens=2, compile=True)  # the state exists on the original now
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(-1.0)
    assert scratch(twin) is not scratch(model) and static_cache(twin, 16) is not static_cache(model, 16)
    want = vanilla_generate(twin, p, max_new_tokens=4).output_ids
    assert want != vanilla_generate(model, p, max_new_tokens=4).output_ids
    assert static_generate(twin, None, None, p, max_new_tokens=4, compile=True).output_ids == want


def test_every_registered_method_runs_on_the_engine_as_on_the_reference(prompts, vanilla, tmp_path):
    """Each main and ablation method's tree settings (the profile's default tree; 'auto' ones as its fixed tree),
    on a tiny draft of its kind (trained dense or moe2; moe4 random), on the engine and the reference loop:
    vanilla's greedy tokens, and the same tokens per cycle on both. Settings shared by several methods run once."""
    from jakiro_lib.profiles import get_profile
    from jakiro_lib.measure.budgets import fixed_tree
    from jakiro_lib.measure.methods import study_methods

    model = tiny_target("llama")
    tree = get_profile("default").tree
    specs = {**study_methods(tree, tmp_path, study="main"), **study_methods(tree, tmp_path, study="ablations")}
    moe4 = DraftModel.build(DraftConfig(num_experts=4, top_k_experts=2), model).eval()
    seen = set()
    for name, spec in specs.items():
        if spec.kind != "spec":
            continue
        kind = None if spec.draft is None else spec.draft.split("/")[-2]
        kind = kind and ("moe4" if kind == "moe4" else "dense" if kind.startswith("dense") else "moe2")
        t = fixed_tree(spec.tree, tree)  # 'auto' settings as the fixed tree the tuner checks against
        key = (kind, json.dumps(dataclasses.asdict(t), sort_keys=True))
        if key in seen:
            continue
        seen.add(key)
        draft = None if kind is None else moe4 if kind == "moe4" else trained_draft(model, kind)
        for i, p in enumerate(prompts[:2]):
            r = static_generate(model, draft, t, p, max_new_tokens=24)
            loop = speculative_generate(model, make_drafter(draft, t), p, max_new_tokens=24)
            assert r.output_ids == loop.output_ids == vanilla[i][:24], (name, i)
            assert r.accepted == loop.accepted, (name, i)
    assert len(seen) >= 10, len(seen)


@pytest.mark.parametrize("vals", [[-0.5, -0.1, -0.1], [0.3, 0.7, -0.2], [-1.0, -1.0, -1.0]])
def test_a_two_token_tree_is_the_pools_choice_without_the_pool(vals, monkeypatch):
    """A two-token tree (the budget the tuner often picks on a CPU) skips building the candidate pool: the root's
    best child, ties to the first and scores capped at the root's as the pool caps them (positive values tie at 0),
    with the pool's parents, depths and ranks."""
    model = tiny_target("llama")
    draft = trained_draft(model, "moe2")
    drafter = StaticTreeDrafter(draft, TreeConfig(depth=3, top_k=3, total_tokens=2), capacity=64)
    with torch.inference_mode():
        p = random_prompts(1, seed=9, min_len=6, max_len=6)[0]
        hidden = model.model(input_ids=p[None]).last_hidden_state[0]
        drafter.extend(hidden, torch.cat([p[1:], torch.tensor([7])]), torch.tensor(0), torch.tensor(5))
        ids = torch.tensor([[11, 12, 13]])
        monkeypatch.setattr(static_tree, "candidate_tensors", lambda *_: (ids, torch.tensor([vals]),
                                                                            torch.zeros(1, 3, model.config.hidden_size)))
        fast, pool = drafter._best_child(), drafter._pool(torch.tensor(6))
    assert all(torch.equal(a, b) for a, b in zip(fast, pool)), (fast, pool)
    assert fast[0].tolist() == [7, 11 + next(i for i, v in enumerate(vals) if min(v, 0) == max(min(x, 0) for x in vals))]
