"""The compiled target runner (jakiro_lib.compiled): same scores and caches as the eager runner, padded
trees, greedy losslessness of our loops through it, and its limits. Tiny llama, fp32, CPU (each compiled
row count costs a few seconds here)."""
from __future__ import annotations

import copy

import pytest
import torch

from jakiro_lib import compiled
from jakiro_lib.compiled import CompiledTargetRunner, padded_size, static_cache_len
from jakiro_lib.config import DraftConfig, TreeConfig
from jakiro_lib.decoding import TargetRunner, speculative_generate, vanilla_generate
from jakiro_lib.draft import DraftModel
from jakiro_lib.drafting import FeatureDrafter, LookupDrafter, PromptLookup
from jakiro_lib.tree import Tree

from helpers import random_prompts, single_thread, tiny_target


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with single_thread():
        yield


@pytest.fixture(scope="module")
def model():
    """A private copy: compiled graphs and static caches are kept on the model."""
    return copy.deepcopy(tiny_target("llama"))


def test_padding_and_cache_lengths():
    assert [padded_size(m) for m in (1, 2, 3, 5, 9, 13, 32, 33)] == [1, 2, 4, 8, 12, 16, 32, None]
    assert static_cache_len(100) == 1024 and static_cache_len(1025) == 2048


@torch.inference_mode()
def test_runner_scores_and_keeps_like_the_eager_runner(model):
    """Prefill, a step, a padded 5-node tree, keeping a path, then more steps: logits, hidden states and
    lengths agree with the eager runner; a 40-node tree (above every compiled size) runs eagerly."""
    ids = torch.randint(0, 256, (30,), generator=torch.Generator().manual_seed(0))
    eager, comp = TargetRunner(model), CompiledTargetRunner(model, 1024)
    for r in (eager, comp):
        r.prefill(ids)
    torch.testing.assert_close(comp.step(5), eager.step(5), atol=1e-4, rtol=1e-4)
    tree = Tree(torch.tensor([7, 8, 9, 10, 11]), [-1, 0, 0, 1, 1], torch.tensor([0, 1, 1, 2, 2]))
    start = eager.length
    (le, he), (lc, hc) = eager.tree(tree), comp.tree(tree)
    assert lc.shape == le.shape and hc.shape == he.shape  # the padding rows are not returned
    torch.testing.assert_close(lc, le, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hc, he, atol=1e-4, rtol=1e-4)
    for r in (eager, comp):
        r.keep(start, [0, 2])
    assert comp.length == eager.length == start + 2
    for token in (3, 4):
        torch.testing.assert_close(comp.step(token), eager.step(token), atol=1e-4, rtol=1e-4)
    big = Tree.chain(list(range(40)))
    torch.testing.assert_close(comp.tree(big)[0], eager.tree(big)[0], atol=1e-4, rtol=1e-4)
    assert {n for n, _ in compiled._state(model).compiled_shapes} == {1, 8}


def test_greedy_through_the_compiled_runner_equals_eager_vanilla(model):
    """Our plain loop and speculative decoding (a random draft with a lookup chain: tree sizes vary from
    cycle to cycle) on the compiled target give eager vanilla's tokens, prompt after prompt on the one
    reused static cache."""
    prompts = random_prompts(3, seed=7, min_len=4, max_len=40)
    torch.manual_seed(0)
    draft = DraftModel.build(DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False,
                                         contrastive=False), model).eval()
    drafter = LookupDrafter(FeatureDrafter(draft, TreeConfig(depth=2, top_k=2, total_tokens=4)),
                            PromptLookup(4, max_ngram=3, min_ngram=1))
    for i in (0, 1, 2, 1):
        ref = vanilla_generate(model, prompts[i], max_new_tokens=20).output_ids
        assert vanilla_generate(model, prompts[i], max_new_tokens=20, static_compile=True).output_ids == ref, i
        spec = speculative_generate(model, drafter, prompts[i], max_new_tokens=20, static_compile=True)
        assert spec.output_ids == ref, i
    assert all(size <= 8 for size, _ in compiled._state(model).compiled_shapes)


def test_sliding_window_targets_are_refused():
    mistral = tiny_target("mistral")
    if not getattr(mistral.config, "sliding_window", None):
        mistral = copy.deepcopy(mistral)
        mistral.config.sliding_window = 16
    with pytest.raises(ValueError, match="sliding-window"):
        CompiledTargetRunner(mistral, 1024)


def test_a_failed_compile_names_itself(monkeypatch):
    runner = CompiledTargetRunner(copy.deepcopy(tiny_target("llama")), 1024)

    def broken(*args, **kwargs):
        raise OSError("no C++ compiler")

    monkeypatch.setattr(runner._state, "compiled", broken)
    runner.prefill(torch.tensor([1, 2, 3]))
    with pytest.raises(compiled.CompileError, match="without static_compile"):
        runner.step(4)


@torch.inference_mode()
def test_a_copy_of_a_model_does_not_run_the_original(model):
    """The per-model state (forward closure, static caches) is left behind by ``copy.deepcopy``: a copy whose
    head is then changed scores with its own head. Kept on the model as it was, the copied closure ran the
    original model (the static engine's sampling test failed after another test had used the tiny target)."""
    ids = torch.tensor([[5, 6, 7]])
    runner = CompiledTargetRunner(model, static_cache_len(16))
    runner.prefill(ids[0])  # the state exists on the original now
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(3.0)
    logits, _ = compiled._state(twin).eager(ids, torch.arange(3)[None], None, compiled.static_cache(twin, 16))
    assert torch.allclose(logits, twin(input_ids=ids).logits, atol=1e-5)
    assert compiled.scratch(twin) is not compiled.scratch(model)
    assert compiled.static_cache(twin, 16) is not compiled.static_cache(model, 16)
