import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from jakiro_lib.models import draft_step, fast_paths, kernels
from jakiro_lib.config import DraftConfig, TargetConfig
from jakiro_lib.models.draft import DraftLoadError, DraftModel, KVCache, soft_cross_entropy
from jakiro_lib.models.draft_blocks import StaticKV
from jakiro_lib.models.target import load_target

DENSE = DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False, contrastive=False)


@pytest.fixture(scope="module")
def target():
    return load_target(TargetConfig(model="tiny:llama"))


def _inputs(L=9, H=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, L, H, generator=g), torch.randint(0, 256, (1, L), generator=g), torch.arange(L)[None]


@pytest.mark.parametrize("cfg", [DENSE, DraftConfig(), DraftConfig(num_experts=4, top_k_experts=2, contrastive=False)])
def test_shapes_and_incremental_equals_full(target, cfg):
    d = DraftModel.build(cfg, target.model).eval()
    f, x, pos = _inputs()
    full = d(f, x, pos)
    assert full.a.shape == (1, 9, 64) and full.experts.shape == (1, 9, cfg.num_experts, 64)
    assert (full.b is None) == (not cfg.branch_b)
    cache = KVCache()
    first = d(f[:, :5], x[:, :5], pos[:, :5], cache)
    mask = torch.ones(4, 9, dtype=torch.bool).tril(5)[None, None]
    rest = d(f[:, 5:], x[:, 5:], pos[:, 5:], cache, mask)
    torch.testing.assert_close(torch.cat([first.a, rest.a], 1), full.a, atol=1e-5, rtol=1e-5)


def test_moe_branches_follow_their_definitions(target):
    d = DraftModel.build(DraftConfig(num_experts=3, top_k_experts=2), target.model).eval()
    f, x, pos = _inputs()
    out = d(f, x, pos)
    gates = out.gates
    assert torch.all((gates > 0).sum(-1) == 2) and torch.allclose(gates.sum(-1), torch.ones(1, 9))
    residual = out.experts - torch.stack([e(d.post_attention_layernorm(out.experts[..., 0, :] * 0 + _residual(d, f, x, pos)))
                                          for e in d.mlp.experts], -2)
    res = _residual(d, f, x, pos)
    torch.testing.assert_close(residual, res.unsqueeze(-2).expand_as(residual), atol=1e-5, rtol=1e-5)
    # Branch A: residual + gate-weighted expert outputs.
    torch.testing.assert_close(out.a, res + (gates.unsqueeze(-1) * (out.experts - res.unsqueeze(-2))).sum(-2),
                               atol=1e-5, rtol=1e-5)
    # Branch B (contrastive): higher-gated minus lower-gated of the two leading B gates.
    gb = d.mlp.router(d.post_attention_layernorm(res))[..., 3:].softmax(-1)
    top = gb.topk(2, -1)
    e = out.experts - res.unsqueeze(-2)
    hi = torch.gather(e, 2, top.indices[..., :1, None].expand(1, 9, 1, 64)).squeeze(2)
    lo = torch.gather(e, 2, top.indices[..., 1:, None].expand(1, 9, 1, 64)).squeeze(2)
    torch.testing.assert_close(out.b, res + top.values[..., :1] * hi - top.values[..., 1:] * lo, atol=1e-5, rtol=1e-5)


def _residual(d, f, x, pos):
    z = d.fc(torch.cat([d.embed(x), f], -1))
    cos, sin = d.rotary(z, pos)
    return z + d.attn(z, (cos, sin), None, None)


def test_frozen_target_parts_are_not_parameters_or_saved(target, tmp_path):
    d = DraftModel.build(DraftConfig(draft_vocab_size=50), target.model)
    names = set(dict(d.named_parameters()))
    assert not any("embed" in n or "lm_head" in n for n in names)
    assert d.logits(torch.randn(3, 64)).shape == (3, 50)
    d.save(tmp_path / "d")
    assert "d2t" in d.trainable_state() and not any("embed" in k for k in d.trainable_state())


def test_save_load_is_exact_and_strict(target, tmp_path):
    d = DraftModel.build(DraftConfig(num_experts=2, draft_vocab_size=40), target.model).eval()
    d.d2t.copy_(torch.arange(40) * 3)
    d.save(tmp_path / "d")
    e = DraftModel.load(tmp_path / "d", target.model)
    f, x, pos = _inputs()
    torch.testing.assert_close(e(f, x, pos).a, d(f, x, pos).a, rtol=0, atol=0)
    assert torch.equal(e.to_target_ids(torch.tensor([1, 2])), torch.tensor([3, 6]))
    other = load_target(TargetConfig(model="tiny:qwen2"))
    with pytest.raises(DraftLoadError, match="model_type"):
        DraftModel.load(tmp_path / "d", other.model)
    with pytest.raises(DraftLoadError, match="no saved draft"):
        DraftModel.load(tmp_path / "missing", target.model)
    (tmp_path / "d" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(DraftLoadError, match="corrupt"):
        DraftModel.load(tmp_path / "d", target.model)


def test_head_rows_follow_d2t_even_for_a_draft_loaded_under_inference_mode(target, tmp_path):
    d = DraftModel.build(DraftConfig(num_experts=2, draft_vocab_size=40), target.model).eval()
    d.d2t.copy_(torch.arange(40) * 3)
    d.save(tmp_path / "d")
    w = target.model.get_output_embeddings().weight
    feats = torch.randn(2, 64)
    with torch.inference_mode():  # d2t becomes an inference tensor: it has no version counter
        e = DraftModel.load(tmp_path / "d", target.model)
        torch.testing.assert_close(e.logits(feats), feats @ w[torch.arange(40) * 3].T)
        e.load_state_dict({**e.trainable_state(), "d2t": torch.arange(40) * 5})  # same storage, new ids
        torch.testing.assert_close(e.logits(feats), feats @ w[torch.arange(40) * 5].T)
    d.d2t.copy_(torch.arange(40) * 2)  # an in-place edit outside inference mode is seen too
    torch.testing.assert_close(d.logits(feats), feats @ w[torch.arange(40) * 2].T)


@pytest.mark.skipif(not torch._C.has_mkl, reason="MKL-packed GEMM needs an MKL build of torch")
def test_packed_head_serves_frontier_rows_and_follows_d2t(target, monkeypatch):
    calls = []
    real = torch.ops.mkl._mkl_linear
    monkeypatch.setattr(torch.ops.mkl, "_mkl_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    d = DraftModel.build(DraftConfig(num_experts=2, draft_vocab_size=40), target.model).eval()
    w = target.model.get_output_embeddings().weight
    with torch.inference_mode():
        for rows in (1, 3, 4, 8, 64, 65):
            feats = torch.randn(rows, 64)
            torch.testing.assert_close(d.logits(feats), feats @ w[:40].T)
        feats = torch.randn(2, 3, 64)  # any leading shape: rows are counted over all of them
        torch.testing.assert_close(d.logits(feats), feats @ w[:40].T)
        assert calls == [4, 8, 64, 6]
        d.d2t.copy_(torch.arange(40) * 3)  # new head rows: repacked, not served stale
        torch.testing.assert_close(d.logits(feats), feats @ w[torch.arange(40) * 3].T)
        d.packed_head = False  # the plain kernel, for measuring what packing buys
        assert torch.equal(d.logits(feats), torch.nn.functional.linear(feats, d.head_weight()))
    assert calls == [4, 8, 64, 6, 6]
    feats = torch.randn(8, 64, requires_grad=True)
    d.packed_head = True
    d.logits(feats).sum().backward()  # with a gradient needed: the plain kernel (the MKL op has no backward)
    assert calls == [4, 8, 64, 6, 6] and feats.grad is not None


def test_router_load_counts_routed_tokens_only_when_asked(target):
    """The held-out evaluation counts routed tokens; decoding's forwards do not (no bookkeeping kernels)."""
    d = DraftModel.build(DraftConfig(num_experts=4, top_k_experts=1), target.model).eval()
    d(*_inputs(L=10))
    assert d.router_load() == [0.0] * 4 and float(d.mlp.load_tokens) == 0
    d.mlp.count_load = True
    d(*_inputs(L=10))
    load = d.router_load(reset=True)
    assert len(load) == 4 and abs(sum(load) - 1.0) < 1e-6
    assert d.router_load() == [0.0] * 4


@pytest.mark.skipif(not kernels.packed_gemm_available(torch.zeros(1, dtype=torch.bfloat16)),
                    reason="bf16 packing needs torch with oneDNN")
def test_a_bf16_draft_loads_with_packed_gemms_and_unchanged_outputs(tmp_path):
    # the backend named, not probed: the probe's choice of rows follows this machine's timings (from 4 or 8 rows
    # on a Sapphire Rapids with AMX, 2026-11-25); a named oneDNN backend serves from one row
    target = load_target(TargetConfig(model="tiny:llama", dtype="bfloat16", packed_gemm=16, gemm_backend="onednn"))
    assert kernels.packed_gemm(target.model).min_rows == 1
    d = DraftModel.build(DraftConfig(num_experts=2, draft_vocab_size=40), target.model).eval()
    d.save(tmp_path / "d")
    e = DraftModel.load(tmp_path / "d", target.model)
    assert kernels.packed_gemm(d) is None and kernels.packed_gemm(e) is not None  # loading packs; build does not
    f, x, pos = _inputs()
    with torch.inference_mode():
        out_e, out_d = e(f.bfloat16(), x, pos), d(f.bfloat16(), x, pos)
        torch.testing.assert_close(out_e.a, out_d.a)
        torch.testing.assert_close(e.logits(out_e.a[0, :3]), d.logits(out_d.a[0, :3]))


def _int8_rounded(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] as its int8 copy holds it: each row scaled by max |w| / 127 into [-127, 127] and rounded."""
    top = w.abs().amax(1, keepdim=True)
    scale = torch.where(top > 0, top / 127.0, torch.ones_like(top))
    return (w / scale).round().clamp(-127, 127) * scale


@pytest.mark.skipif(not kernels.packed_gemm_available(torch.zeros(1), kernels.HALF_WEIGHTS),
                    reason="the streaming GEMM cannot be built here")
@pytest.mark.parametrize("dtype, backend, rounded_weight", [
    (torch.bfloat16, kernels.HALF_WEIGHTS, lambda w: w.bfloat16().float()),
    (torch.int8, kernels.INT8_WEIGHTS, _int8_rounded)])
def test_a_reduced_precision_draft_streams_its_weights_copies_in_fp32_arithmetic(dtype, backend, rounded_weight,
                                                                               tmp_path):
    """On a CPU with the streaming GEMM a bf16 or int8 draft keeps fp32 layers and reads bf16 or int8 copies of its
    linears' weights (int8: each output column scaled into [-127, 127], its scale applied to the sums) and an int8 copy
    of its reduced head's: each output is the fp32 draft's with its weights so rounded (fp32 sums); the head's logits
    the copy's (where the CPU has AMX tiles, within the activations' rounding)."""
    target = load_target(TargetConfig(model="tiny:llama"))
    d = DraftModel.build(DraftConfig(num_experts=2, draft_vocab_size=40), target.model).eval()
    d.save(tmp_path / "d")
    e = DraftModel.load(tmp_path / "d", target.model, dtype=dtype)
    assert e.reduced_weights and e.fc.weight.dtype == torch.float32
    assert kernels.gemm_choice(e) == {"backend": backend, "min_rows": 1, "max_rows": 64, "prefetch": None}
    rounded = copy.deepcopy(d)
    with torch.no_grad():
        for lin in (m for m in rounded.modules() if isinstance(m, nn.Linear)):
            lin.weight.copy_(rounded_weight(lin.weight))
    f, x, pos = _inputs()
    with torch.inference_mode():
        out_e, out_r = e(f, x, pos), rounded(f, x, pos)
        torch.testing.assert_close(out_e.a, out_r.a, atol=1e-5, rtol=1e-5)
        feats = out_e.a[0, :3]
        logits, head, atol = e.logits(feats), d.head_weight(), 1e-5
        screen, scales = e._head_int8  # the head's int8 copy: on AMX's tiles, the activations rounded to int16
        V, K = head.shape
        if screen.dim() == 4:
            head = screen.permute(0, 2, 1, 3).reshape(-1, screen.shape[1] * 4)[:V, :K].float() * scales[:V, None]
            atol = float(feats.abs().max()) / 16383 * float(head.abs().sum(1).max())
        else:  # the streaming GEMM's panels, fp32 sums times each word's scale
            head = screen.permute(0, 2, 1).reshape(-1, K)[:V].float() * scales[:V, None]
        torch.testing.assert_close(logits, F.linear(feats, head), atol=atol, rtol=1e-5)
    assert e._head_gemm == (kernels.HALF_WEIGHTS, 1)
    assert (screen.dim() == 4) == torch.ops.jakiro_stream_gemm.tile_screen()


@pytest.mark.skipif(not kernels.packed_gemm_available(torch.zeros(1), kernels.HALF_WEIGHTS),
                    reason="the streaming GEMM cannot be built here")
@pytest.mark.parametrize("cfg", [DENSE, DraftConfig(), DraftConfig(num_experts=4, top_k_experts=2, contrastive=False)])
def test_a_decoding_step_in_two_kernel_calls_is_the_python_step(cfg, tmp_path, monkeypatch):
    """A draft that streams its linears' panels runs a decoding step's few rows (one over the cache, or a tree's under
    its mask) through the package's draft_qkv and draft_mix, the cache written between them: every output is the
    Python step's to the attention kernel's rounding against SDPA (dense; Jakiro's contrastive branch B; four experts,
    top 2, a mixture branch B), and bit for bit where each row attends to itself alone. A causal block, more rows than
    the kernel takes, autograd and GELU experts keep the Python step."""
    target = load_target(TargetConfig(model="tiny:llama"))
    DraftModel.build(cfg, target.model).save(tmp_path / "d")
    e = DraftModel.load(tmp_path / "d", target.model, dtype=torch.bfloat16)
    assert draft_step.step_panels(e, fast_paths.ATTEND_HEAD_SIZES) is not None
    f, x, pos = _inputs(L=14)
    fused, served = draft_step.fused_step, []

    def counted(*args):
        out = fused(*args)
        served.append(out is not None)
        return out
    with torch.inference_mode():
        for rows in (1, 4):
            outs = []
            for step in (counted, lambda *args: None):
                monkeypatch.setattr(draft_step, "fused_step", step)
                cache = KVCache()
                e(f[:, :10], x[:, :10], pos[:, :10], cache)  # the prompt: causal, the Python step either way
                mask = torch.ones(rows, 10 + rows, dtype=torch.bool).tril(10)[None, None] if rows > 1 else None
                outs.append(e(f[:, 10:10 + rows], x[:, 10:10 + rows], pos[:, 10:10 + rows], cache, mask))
            assert served[-2:] == [False, True]  # the prompt's step, then the two calls
            for name in ("a", "b", "experts", "gates"):
                got, want = getattr(outs[0], name), getattr(outs[1], name)
                assert (got is None) == (want is None) == (name == "b" and not cfg.branch_b), name
                if got is not None:
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for rows in (1, 3):  # rows that see only themselves: attention gives each its own value exactly either way, so
            outs = []  # what follows it (projection, norm, experts, router, branch B) is the Python step's bit for bit
            for step in (counted, lambda *args: None):
                monkeypatch.setattr(draft_step, "fused_step", step)
                outs.append(e(f[:, :rows], x[:, :rows], pos[:, :rows], KVCache(),
                              torch.eye(rows, dtype=torch.bool)[None, None]))
            assert served[-1] is True
            for name in ("a", "b", "experts", "gates"):
                got, want = getattr(outs[0], name), getattr(outs[1], name)
                assert (got is None) == (want is None) and (got is None or torch.equal(got, want)), (name, rows)
        both = torch.cat([e.embed(x), f], -1)
        limits = fast_paths.ATTEND_ROWS, fast_paths.ATTEND_HEAD_SIZES
        assert fused(e, both[:, :4], pos[:, :4], None, None, *limits) is None  # causal
        rows = fast_paths.ATTEND_ROWS + 1  # more rows than the attention kernel takes
        many = torch.ones(1, 1, rows, rows, dtype=torch.bool)
        past = both.repeat(1, -(-rows // both.shape[1]), 1)[:, :rows]
        assert fused(e, past, torch.arange(rows)[None], None, many, *limits) is None
    assert fused(e.train(), both[:, :1], pos[:, :1], None, None, *limits) is None
    gelu = DraftModel.build(dataclasses.replace(cfg, expert_mlp="gelu"), target.model)
    gelu.save(tmp_path / "g")
    gelu = DraftModel.load(tmp_path / "g", target.model, dtype=torch.bfloat16)
    assert draft_step.step_panels(gelu, fast_paths.ATTEND_HEAD_SIZES) is None


@pytest.mark.skipif(not kernels.packed_gemm_available(torch.zeros(1), kernels.HALF_WEIGHTS),
                    reason="the streaming GEMM cannot be built here")
@pytest.mark.parametrize("cfg", [DENSE, DraftConfig(), DraftConfig(num_experts=4, top_k_experts=2, contrastive=False)])
def test_a_decoding_step_in_one_kernel_call_is_the_two_call_step_bit_for_bit(cfg, tmp_path):
    """The engine's draft step in one call (``draft_step``: the embedding, RoPE's rows from the draft's tables, the two
    calls and the cache write between them) gives the two-call step's outputs and cache bit for bit, at 1, 3 and 8
    rows under a tree's mask, written at slots past the text; RoPE's tables are the rotary's rows at every position.
    A cache without buffers yet, a draft in training and more rows than the attention kernel takes keep the other
    path."""
    target = load_target(TargetConfig(model="tiny:llama"))
    DraftModel.build(cfg, target.model).save(tmp_path / "d")
    e = DraftModel.load(tmp_path / "d", target.model, dtype=torch.bfloat16)
    limits = fast_paths.ATTEND_ROWS, fast_paths.ATTEND_HEAD_SIZES
    cos, sin = draft_step.rope_tables(e, 48)
    for n in (1, 3, 8):
        at = torch.randint(0, 48, (1, n), generator=torch.Generator().manual_seed(n))
        want = e.rotary(torch.zeros(1, n, 8), at)
        assert torch.equal(cos[at[0]], want[0][0]) and torch.equal(sin[at[0]], want[1][0]), n
    f, x, pos = _inputs(L=20)
    with torch.inference_mode():
        for rows in (1, 3, 8):
            outs, caches = [], []
            for one in (True, False):
                cache = StaticKV(48)
                cache.slots = pos[0, :10]
                e(f[:, :10], x[:, :10], pos[:, :10], cache, torch.ones(10, 48, dtype=torch.bool).tril()[None, None])
                slots = 20 + torch.arange(rows)  # a tree's rows written past the text, at positions 10..
                allowed = (torch.arange(48)[None, :] < 10) | (torch.arange(48)[None, :] == slots[:, None])
                cache.slots = slots
                at = pos[0, 10:10 + rows]
                if one:
                    out = draft_step.one_call(e, f[0, 10:10 + rows], x[0, 10:10 + rows], at, cache, allowed, *limits)
                    assert out is not None
                else:
                    step = e(f[:, 10:10 + rows], x[:, 10:10 + rows], at[None], cache, allowed[None, None])
                    out = tuple(None if t is None else t[0] for t in (step.a, step.b, step.experts, step.gates))
                outs.append(out)
                caches.append((cache.k.clone(), cache.v.clone()))
            for got, want in zip(*outs):
                assert (got is None) == (want is None) and (got is None or torch.equal(got, want)), rows
            assert all(torch.equal(a, b) for a, b in zip(*caches)), rows
        assert draft_step.one_call(e, f[0, :1], x[0, :1], pos[0, :1], StaticKV(48), allowed[:1], *limits) is None
        rows = fast_paths.ATTEND_ROWS + 1
        many = torch.ones(rows, 48, dtype=torch.bool)
        wide = f[0, :1].expand(rows, -1)
        assert draft_step.one_call(e, wide, x[0, :1].expand(rows), pos[0, :1].expand(rows), cache, many,
                                   *limits) is None
    assert draft_step.one_call(e.train(), f[0, :1], x[0, :1], pos[0, :1], cache, allowed[:1], *limits) is None


@pytest.mark.skipif(not kernels.packed_gemm_available(torch.zeros(1), "onednn"),
                    reason="fp32 reordering needs torch with oneDNN")
def test_an_fp32_draft_follows_its_targets_packed_gemm_choice(tmp_path):
    """A loaded draft packs its linears and head like its target (oneDNN from one row here); beside a target
    without a packed GEMM an fp32 draft stays plain; outputs equal the unpacked draft's up to rounding."""
    target = load_target(TargetConfig(model="tiny:llama", packed_gemm=16, gemm_backend="onednn"))
    d = DraftModel.build(DraftConfig(num_experts=2, draft_vocab_size=40), target.model).eval()
    d.save(tmp_path / "d")
    e = DraftModel.load(tmp_path / "d", target.model)
    gemm = kernels.packed_gemm(e)
    assert gemm is not None and (gemm.backend, gemm.min_rows) == ("onednn", 1)
    f, x, pos = _inputs()
    with torch.inference_mode():
        out_e, out_d = e(f, x, pos), d(f, x, pos)
        torch.testing.assert_close(out_e.a, out_d.a, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(e.logits(out_e.a[0, :3]), d.logits(out_d.a[0, :3]), atol=1e-5, rtol=1e-5)
    assert e._head_gemm == ("onednn", 1)
    plain = load_target(TargetConfig(model="tiny:llama"))
    assert kernels.packed_gemm(DraftModel.load(tmp_path / "d", plain.model)) is None


def test_soft_cross_entropy_matches_its_definition_and_gradient():
    """The fused soft-CE (value and gradient softmax(z) - p) equals -(p * log_softmax(z)).sum(-1), also with
    bf16 logits, broadcast targets ([N, E, V] logits against one p per row) and no gradient into p."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 3, 50, generator=g, dtype=torch.float64, requires_grad=True)
    p = torch.randn(6, 1, 50, generator=g, dtype=torch.float64).softmax(-1).expand(-1, 3, -1).requires_grad_()
    w = torch.rand(6, 3, generator=g, dtype=torch.float64)
    (soft_cross_entropy(z, p) * w).sum().backward()
    assert p.grad is None  # the target is a constant
    z2 = z.detach().clone().requires_grad_()
    (-(p.detach() * z2.log_softmax(-1)).sum(-1) * w).sum().backward()
    assert torch.allclose(z.grad, z2.grad) and torch.allclose(soft_cross_entropy(z, p), -(p * z.log_softmax(-1)).sum(-1))
    assert torch.autograd.gradcheck(lambda x: soft_cross_entropy(x, p[:, 0]), (z[:, 0].detach().requires_grad_(),))
    zb = z.detach().bfloat16().requires_grad_()
    out = soft_cross_entropy(zb, p)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert zb.grad.dtype == torch.bfloat16
    ref = (zb.detach().float().softmax(-1) - p.detach().float())
    assert torch.allclose(zb.grad.float(), ref, atol=1e-2)


def test_the_draft_precision_auto_is_int8_weights_only_where_they_stream(monkeypatch):
    """bench.draft_dtype "auto" (the default): int8 beside an fp32 CPU target where the streaming GEMM is built
    (int8 copies of the weights, fp32 arithmetic; with AMX too), the target's precision anywhere else."""
    from jakiro_lib.config import BenchConfig
    from jakiro_lib.models.draft import resolve_draft_dtype

    assert BenchConfig().draft_dtype == "auto"
    monkeypatch.setattr(kernels, "stream_gemm_available", lambda: True)
    fp32 = TargetConfig(model="tiny:llama")
    assert resolve_draft_dtype("auto", fp32) == "int8"
    assert resolve_draft_dtype("auto", dataclasses.replace(fp32, dtype="bfloat16")) is None
    assert resolve_draft_dtype("auto", dataclasses.replace(fp32, device="cuda")) is None
    assert resolve_draft_dtype("target", fp32) is None and resolve_draft_dtype("float16", fp32) == "float16"
    monkeypatch.setattr(kernels, "stream_gemm_available", lambda: False)
    assert resolve_draft_dtype("auto", fp32) is None
