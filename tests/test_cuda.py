"""The decoding loops on a CUDA device (skipped without one: CI runs on CPU).

Written after the first GPU run (H100, 2026-11-22) found sampling broken there: a CUDA generator met a
CPU-side draw. These run the same tiny models as the CPU tests, moved to the GPU, in fp32.
"""
import pytest
import torch

from jakiro_lib.models.target import set_capture
from jakiro_lib.config import DraftConfig, TargetConfig, TreeConfig
from reference.loop import speculative_generate, vanilla_generate
from jakiro_lib.models.draft import DraftModel
from reference.drafting import FeatureDrafter
from jakiro_lib.models.target import load_target
from jakiro_lib.decoding.verify import SamplingParams

from helpers import random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def cuda_setup():
    target = load_target(TargetConfig(model="tiny:llama", dtype="float32", device="cuda", max_context=512))
    torch.manual_seed(0)
    draft = DraftModel.build(DraftConfig(num_experts=2, top_k_experts=2), target.model).eval()
    return target, draft


@pytest.mark.parametrize("tree", [TreeConfig(depth=3, top_k=2, total_tokens=6),
                                  TreeConfig(depth=4, top_k=3, total_tokens=10, decoupled=True, ar_steps=2)])
def test_greedy_speculative_equals_vanilla_on_cuda(cuda_setup, tree):
    target, draft = cuda_setup
    for p in random_prompts(3, seed=7):
        ids = p.to("cuda")
        ref = vanilla_generate(target.model, ids, max_new_tokens=24)
        out = speculative_generate(target.model, FeatureDrafter(draft, tree), ids, max_new_tokens=24)
        assert out.output_ids == ref.output_ids


def test_sampling_runs_with_a_cuda_generator(cuda_setup):
    target, draft = cuda_setup
    tree = TreeConfig(depth=3, top_k=2, total_tokens=6, decoupled=True)
    ids = random_prompts(1, seed=3)[0].to("cuda")
    params = SamplingParams(temperature=1.0)
    runs = []
    for _ in range(2):  # one seed, one output: the draws are reproducible on the device
        gen = torch.Generator(device="cuda").manual_seed(0)
        runs.append(speculative_generate(target.model, FeatureDrafter(draft, tree), ids, max_new_tokens=16,
                                         params=params, generator=gen).output_ids)
    assert runs[0] == runs[1] and len(runs[0]) == 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    assert len(vanilla_generate(target.model, ids, max_new_tokens=16, params=params, generator=gen).output_ids) == 16


CAPTURES = [False, "inductor", "graphs"]  # eager, and compiled: torch.compile's CUDA graphs, or the eager kernels'


def _capture(model, how) -> bool:
    """``compile`` for the engines, the model's capture set first."""
    if how:
        set_capture(model, how)
    return bool(how)


@pytest.mark.parametrize("how", CAPTURES)
def test_static_engine_equals_vanilla_on_cuda_with_one_sync_per_cycle(cuda_setup, how):
    """The static engine on CUDA, eager and captured (target.capture: inductor's or the eager kernels' graphs):
    vanilla's greedy output, and no device-to-host synchronisation per cycle but the one read, counted by
    CUDA's sync debug mode and placed by the line that caused it: the read's count is the cycles', and the
    others (the prompt's: its first token, a new cache's set-up) do not grow with the length. On the H200
    (2026-11-26) this found a per-cycle one in ``greedy_path`` that the CPU tests cannot see."""
    import inspect
    import warnings
    from collections import Counter
    from pathlib import Path

    from jakiro_lib.decoding.static import StaticEngine, static_generate

    lines, first = inspect.getsourcelines(StaticEngine._advance)
    read = ("static.py", first + next(i for i, line in enumerate(lines) if "out.tolist()" in line))
    target, draft = cuda_setup
    compile = _capture(target.model, how)
    tree = TreeConfig(depth=3, top_k=2, total_tokens=6, decoupled=True)

    def traced(ids: torch.Tensor, n: int) -> tuple[list[int], int, Counter]:
        static_generate(target.model, draft, tree, ids, max_new_tokens=n, compile=compile)  # warm-up / capture
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = static_generate(target.model, draft, tree, ids, max_new_tokens=n, compile=compile)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        where = Counter((Path(w.filename).name, w.lineno) for w in caught if "synchroniz" in str(w.message))
        return out.output_ids, out.cycles, where

    for p in random_prompts(3, seed=7):
        ids = p.to("cuda")
        assert traced(ids, 24)[0] == vanilla_generate(target.model, ids, max_new_tokens=24).output_ids
        (_, short_cycles, short), (_, long_cycles, long) = traced(ids, 8), traced(ids, 24)
        assert long_cycles > short_cycles
        assert (short.pop(read, 0), long.pop(read, 0)) == (short_cycles, long_cycles), (read, short, long)
        assert short == long, ("synchronisations that grow with the length", short, long)


@pytest.mark.parametrize("how", CAPTURES[1:])
def test_static_engine_samples_the_same_text_captured_and_eager_on_cuda(cuda_setup, how):
    """At T=1 the captured cycle (CUDA graphs) reads the same draws as the eager one: one seed, one text."""
    from jakiro_lib.decoding.static import static_generate

    target, draft = cuda_setup
    _capture(target.model, how)
    tree = TreeConfig(depth=3, top_k=2, total_tokens=6, decoupled=True)
    params = SamplingParams(temperature=1.0, top_p=0.9)
    for i, p in enumerate(random_prompts(3, seed=8)):
        ids = p.to("cuda")
        runs = [static_generate(target.model, draft, tree, ids, max_new_tokens=24, params=params, compile=compile,
                                generator=torch.Generator(device="cuda").manual_seed(i)).output_ids
                for compile in (False, True, True)]  # the second captured run replays the graphs
        assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 24


@pytest.mark.parametrize("how", CAPTURES)
def test_static_decoder_equals_vanilla_on_cuda(cuda_setup, how):
    """Plain decoding on the static engine, eager and captured: vanilla's greedy output on the GPU, and at
    T=1 one seed gives one text whether the step is captured or not."""
    from jakiro_lib.decoding.static import static_generate

    target, _ = cuda_setup
    compile = _capture(target.model, how)
    for i, p in enumerate(random_prompts(3, seed=9)):
        ids = p.to("cuda")
        ref = vanilla_generate(target.model, ids, max_new_tokens=24).output_ids
        assert static_generate(target.model, None, None, ids, max_new_tokens=24, compile=compile).output_ids == ref
        params = SamplingParams(temperature=1.0)
        runs = [static_generate(target.model, None, None, ids, max_new_tokens=24, params=params, compile=c,
                                generator=torch.Generator(device="cuda").manual_seed(i)).output_ids
                for c in (False, compile, compile)]
        assert runs[0] == runs[1] == runs[2] and len(runs[0]) == 24


def test_captured_attention_windows_on_cuda(cuda_setup, monkeypatch):
    """The captured engine across attention windows (docs/DESIGN.md section 12), real CUDA graphs: windows of 32
    positions, so every prompt crosses several, each recorded once; vanilla's greedy text; after
    prepare_windows (the benchmark's warm-up) a generation records nothing."""
    from jakiro_lib.decoding import static
    from jakiro_lib.decoding.compiled import graphs_compiled, prepare_windows

    target, draft = cuda_setup
    set_capture(target.model, "graphs")
    monkeypatch.setattr(static, "WINDOW_STEP", 32)
    tree = TreeConfig(depth=3, top_k=2, total_tokens=6, decoupled=True, lookup_tokens=3)
    prompts = [p.to("cuda") for p in random_prompts(3, seed=11)]
    for ids in prompts:
        ref = vanilla_generate(target.model, ids, max_new_tokens=40).output_ids
        for d in (draft, None):  # Jakiro with a chain, and plain decoding
            out = (static.static_generate(target.model, d, tree, ids, max_new_tokens=40, compile=True) if d else
                   static.static_generate(target.model, None, None, ids, max_new_tokens=40, compile=True))
            assert out.output_ids == ref
    prepare_windows(target.model, 512)
    before = graphs_compiled()
    for ids in prompts:
        static.static_generate(target.model, draft, tree, ids, max_new_tokens=40, compile=True)
    assert graphs_compiled() == before


def test_lean_forward_and_the_draft_s_masked_grouped_attention_on_cuda(cuda_setup):
    """On CUDA the target decodes through the lean forward (transformers' SDPA; its load-time check passed), and
    the draft's attention under a mask with grouped KV heads (the heads repeated for CUDA's fused kernels, which
    take a mask or grouped heads but not both) gives what grouped SDPA gives on the CPU."""
    from jakiro_lib.models import fast_paths
    from jakiro_lib.models.draft_blocks import DraftAttention
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    target, _ = cuda_setup
    config = target.model.config
    assert config._attn_implementation == "sdpa" and target.model.__dict__[fast_paths.LEAN] is True
    assert config.num_key_value_heads < config.num_attention_heads
    torch.manual_seed(0)
    attn = DraftAttention(config, apply_rotary_pos_emb).eval()
    head_dim = attn.head_dim
    x, cos, sin = torch.randn(1, 5, config.hidden_size), torch.randn(1, 5, head_dim), torch.randn(1, 5, head_dim)
    allowed = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 1, 0, 1]])
    mask = torch.zeros(1, 1, 5, 5).masked_fill(allowed == 0, float("-inf"))
    with torch.inference_mode():
        cpu = attn(x, (cos, sin), None, mask)
        gpu = attn.cuda()(x.cuda(), (cos.cuda(), sin.cuda()), None, mask.cuda())
    assert torch.allclose(cpu, gpu.cpu(), atol=1e-4, rtol=1e-4)
