"""Released draft heads in and out (jakiro_lib.models.heads_io, heads_layouts; docs/DESIGN.md section 13).

The heads here are written by the test itself with random tensors under the reference code's key names, and each
layout's forward is re-implemented below from that code, not from ours:

* EAGLE-1: SafeAILab/EAGLE eagle/model/cnets.py / cnets1.py (2174a790d71a41a2e7549e14fef7d277435894b9), class Model:
  fc(cat(embed_tokens(ids), feature)), layers.0 without input_layernorm, no final norm, the target's lm_head.
* Jakiro: haiduo/Jakiro jakiro/model/cnets.py (a0b6193abda6f692f1aeb34e7825848593980ad3), MixtralSparseMoeBlock
  .forward with penult_forward (both branches, its torch.where formulation as written there).
* Jakiro*: haiduo/Jakiro jakiro_star/model/cnets.py (same commit): GptNeoxMLP experts, forward_sum (greedy) and
  forward (each expert's output, the higher-gated first).
"""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from jakiro_lib.config import DraftConfig
from jakiro_lib.models.draft import DraftLoadError, DraftModel
from jakiro_lib.models.heads_io import export_head, import_head
from tests.helpers import tiny_target

H, HEADS, KV, V, INTER, EPS, THETA = 64, 4, 2, 260, 128, 1e-6, 10000.0
P = "layers.0."


# ---- the reference forwards (independent of jakiro_lib) -----------------------------------------------------------
def rms(x, w):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def rope(x, pos):  # x [heads, L, d]; LlamaRotaryEmbedding + apply_rotary_pos_emb of the references
    d = x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, d, 2).float() / d)
    ang = torch.cat([pos[:, None].float() * inv] * 2, -1)  # [L, d]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * ang.cos() + rot * ang.sin()


def attention(x, sd):  # causal self-attention of layers.0.self_attn over x [L, H]
    L, hd = x.shape[0], H // HEADS
    q = (x @ sd[P + "self_attn.q_proj.weight"].T).view(L, HEADS, hd).transpose(0, 1)
    k = (x @ sd[P + "self_attn.k_proj.weight"].T).view(L, KV, hd).transpose(0, 1)
    v = (x @ sd[P + "self_attn.v_proj.weight"].T).view(L, KV, hd).transpose(0, 1)
    pos = torch.arange(L)
    q, k = rope(q, pos), rope(k, pos)
    k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)  # repeat_kv
    s = (q @ k.transpose(1, 2)) / math.sqrt(hd)
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).transpose(0, 1).reshape(L, H) @ sd[P + "self_attn.o_proj.weight"].T


def trunk(sd, feats, ids):  # fc over cat(embedding, feature), attention with its residual; (h, normed h)
    x = torch.cat([sd["embed_tokens.weight"][ids], feats], -1) @ sd["fc.weight"].T + sd["fc.bias"]
    h = x + attention(x, sd)
    return h, rms(h, sd[P + "post_attention_layernorm.weight"])


def swiglu(u, sd, p):
    return (F.silu(u @ sd[p + "gate_proj.weight"].T) * (u @ sd[p + "up_proj.weight"].T)) @ sd[p + "down_proj.weight"].T


def eagle_forward(sd, feats, ids):
    h, u = trunk(sd, feats, ids)
    return h + swiglu(u, sd, P + "mlp.")


def jakiro_forward(sd, feats, ids):  # (branch A, branch B): MixtralSparseMoeBlock.forward, penult_forward=True
    h, u = trunk(sd, feats, ids)
    logits = u @ sd[P + "mlp_moe.gate.weight"].T  # [L, 4]
    e0, e1 = swiglu(u, sd, P + "mlp_moe.experts.0."), swiglu(u, sd, P + "mlp_moe.experts.1.")
    out = []
    for lo, sign in ((0, 1.0), (2, -1.0)):
        first = (logits[..., lo] > logits[..., lo + 1])[:, None]
        w = F.softmax(logits[..., lo:lo + 2], dim=-1)
        w0 = torch.where(first[:, 0], w[..., 0], w[..., 1])[:, None]
        w1 = torch.where(first[:, 0], w[..., 1], w[..., 0])[:, None]
        out.append(h + torch.where(first, e0, e1) * w0 + sign * torch.where(first, e1, e0) * w1)
    return out


def star_forward(sd, feats, ids):  # (forward_sum: the weighted sum; forward: both experts, higher-gated first)
    h, u = trunk(sd, feats, ids)
    logits = u @ sd[P + "mlp_moe.gate.weight"].T  # [L, 2]
    outs = torch.stack([(F.gelu(u @ sd[P + f"mlp_moe.experts.{i}.fc.weight"].T)) @ sd[P + f"mlp_moe.experts.{i}.proj.weight"].T
                        for i in range(2)])  # [2, L, H]
    weighted = h + (outs * F.softmax(logits, -1).T[..., None]).sum(0)
    first = (logits[..., 0] > logits[..., 1])[None, :, None]
    return weighted, h + torch.where(first, outs, outs.flip(0))


# ---- heads written in the external layouts ------------------------------------------------------------------------
def _config(**extra):
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": INTER,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": 1, "hidden_act": "silu",
            "rms_norm_eps": EPS, "vocab_size": V, "tie_word_embeddings": False, **extra}


def _head(layout: str, seed: int = 0) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    t = tiny_target()
    sd = {"embed_tokens.weight": t.get_input_embeddings().weight.detach().clone(), "fc.weight": r(H, 2 * H),
          "fc.bias": r(H), P + "post_attention_layernorm.weight": 1 + r(H),
          P + "self_attn.q_proj.weight": r(H, H), P + "self_attn.k_proj.weight": r(H // 2, H),
          P + "self_attn.v_proj.weight": r(H // 2, H), P + "self_attn.o_proj.weight": r(H, H)}
    if layout == "eagle":
        sd.update({P + "mlp.gate_proj.weight": r(INTER, H), P + "mlp.up_proj.weight": r(INTER, H),
                   P + "mlp.down_proj.weight": r(H, INTER)})
        return _config(), sd
    if layout == "jakiro":
        sd[P + "mlp_moe.gate.weight"] = r(4, H, scale=1.0)
        for i in range(2):
            sd.update({P + f"mlp_moe.experts.{i}.gate_proj.weight": r(H, H), P + f"mlp_moe.experts.{i}.up_proj.weight": r(H, H),
                       P + f"mlp_moe.experts.{i}.down_proj.weight": r(H, H)})
        return _config(num_local_experts=2, num_experts_per_tok=2), sd
    sd[P + "mlp_moe.gate.weight"] = r(2, H, scale=1.0)
    for i in range(2):
        sd.update({P + f"mlp_moe.experts.{i}.fc.weight": r(INTER, H), P + f"mlp_moe.experts.{i}.proj.weight": r(H, INTER)})
    return _config(num_local_experts=2, num_experts_per_tok=2), sd


def _write(folder, config, sd, bin_file=False):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if bin_file:
        torch.save(sd, folder / "pytorch_model.bin")
    else:
        save_file(sd, str(folder / "model.safetensors"))
    return folder


def _inputs(seed=1, L=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, H, generator=g), torch.randint(0, V, (L,), generator=g)


@torch.no_grad()
def _ours(draft, feats, ids):
    return draft(feats[None], ids[None], torch.arange(len(ids))[None])


CLOSE = dict(atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("bin_file", [False, True])
@torch.no_grad()
def test_eagle_head_imports_and_forwards_as_eagles_code(tmp_path, bin_file):
    config, sd = _head("eagle")
    draft, info = import_head(str(_write(tmp_path / "h", config, sd, bin_file)), tiny_target())
    assert info["layout"] == "eagle" and draft.cfg.mlp == "dense" and draft.cfg.intermediate_size == "target"
    feats, ids = _inputs()
    out = _ours(draft, feats, ids)
    ref = eagle_forward(sd, feats, ids)
    torch.testing.assert_close(out.a[0], ref, **CLOSE)
    lm_head = tiny_target().get_output_embeddings().weight
    torch.testing.assert_close(draft.logits(out.a)[0], ref @ lm_head.T, **CLOSE)


@torch.no_grad()
def test_jakiro_head_imports_with_both_branches_as_the_authors_code(tmp_path):
    config, sd = _head("jakiro")
    draft, info = import_head(str(_write(tmp_path / "h", config, sd)), tiny_target())
    assert info["layout"] == "jakiro" and (draft.cfg.num_experts, draft.cfg.branch_b, draft.cfg.contrastive) == (2, True, True)
    feats, ids = _inputs(L=9)
    out = _ours(draft, feats, ids)
    a, b = jakiro_forward(sd, feats, ids)
    torch.testing.assert_close(out.a[0], a, **CLOSE)
    torch.testing.assert_close(out.b[0], b, **CLOSE)
    lm_head = tiny_target().get_output_embeddings().weight
    torch.testing.assert_close(draft.logits(out.b)[0], b @ lm_head.T, **CLOSE)


@torch.no_grad()
def test_jakiro_star_head_imports_with_gelu_experts_and_per_expert_features(tmp_path):
    config, sd = _head("jakiro_star")
    draft, info = import_head(str(_write(tmp_path / "h", config, sd)), tiny_target())
    assert info["layout"] == "jakiro_star" and draft.cfg.expert_mlp == "gelu" and not draft.cfg.branch_b
    feats, ids = _inputs(L=5)
    out = _ours(draft, feats, ids)
    weighted, ordered = star_forward(sd, feats, ids)
    torch.testing.assert_close(out.a[0], weighted, **CLOSE)
    hi = out.gates[0].argmax(-1)  # our per-expert features, the higher-gated first as the authors' forward orders them
    ours_ordered = torch.stack([out.experts[0, torch.arange(5), hi], out.experts[0, torch.arange(5), 1 - hi]])
    torch.testing.assert_close(ours_ordered, ordered, **CLOSE)


def _drafts():
    t = tiny_target()
    dense = DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False, contrastive=False,
                        intermediate_size="target")
    star = DraftConfig(num_experts=2, top_k_experts=2, branch_b=False, contrastive=False, expert_mlp="gelu",
                       intermediate_size="target")
    out = []
    for fmt, cfg, vocab in (("eagle", dense, None), ("eagle", dense, 100), ("jakiro", DraftConfig(), None),
                            ("jakiro", DraftConfig(draft_vocab_size=50), 50), ("jakiro", star, None)):
        torch.manual_seed(len(out))
        d2t = None if vocab is None else torch.randperm(V)[:vocab]
        cfg = dataclasses.replace(cfg, draft_vocab_size=vocab)
        draft = DraftModel.build(cfg, t, d2t=d2t).eval()
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        out.append((fmt, draft))
    return out


@pytest.mark.parametrize("case", range(5))
@torch.no_grad()
def test_export_then_import_is_identical_bit_for_bit(tmp_path, case):
    fmt, draft = _drafts()[case]
    t = tiny_target()
    export_head(draft, t, fmt, tmp_path / "out", origin="test")
    back, info = import_head(str(tmp_path / "out"), t)
    assert info["layout"] in (fmt, "jakiro_star")
    mine, theirs = draft.state_dict(), back.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    feats, ids = _inputs()
    a, b = _ours(draft, feats, ids), _ours(back, feats, ids)
    assert torch.equal(a.a, b.a) and torch.equal(draft.logits(a.a), back.logits(b.a))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["jakiro_lib"]["feature_layers"] == [2]
    assert ("d2t" in load_file(str(tmp_path / "out" / "model.safetensors"))) == (draft.d2t is not None)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text and text
    return text


def _broken(kind: str):
    config, sd = _head("eagle")
    if kind == "missing":
        del sd[P + "mlp.up_proj.weight"]
    elif kind == "extra":
        sd[P + "input_layernorm.weight"] = torch.ones(H)
    elif kind == "hidden":
        config["hidden_size"] = 32
    elif kind == "hidden_shape":
        del config["hidden_size"]
        sd["fc.weight"] = torch.zeros(H, 3 * H)
    elif kind == "vocab":
        config["vocab_size"] = 300
    elif kind == "vocab_embed":
        sd["embed_tokens.weight"] = torch.zeros(300, H)
    elif kind == "other_embed":
        sd["embed_tokens.weight"] = torch.randn(V, H)
    elif kind == "vocab_map":
        sd["d2t"], sd["t2d"] = torch.tensor([0, 400]), torch.zeros(V, dtype=torch.bool)
    elif kind == "layers":
        sd.update({k.replace("layers.0.", "layers.1."): v.clone() for k, v in list(sd.items()) if k.startswith(P)})
    elif kind == "layer_count":
        config["num_hidden_layers"] = 2
    elif kind == "eagle3":
        sd = {"fc.weight": torch.zeros(H, 3 * H), "midlayer.self_attn.q_proj.weight": torch.zeros(H, 2 * H),
              "norm.weight": torch.ones(H), "lm_head.weight": torch.zeros(100, H), "d2t": torch.zeros(100, dtype=torch.long),
              "t2d": torch.zeros(V, dtype=torch.bool)}
    elif kind == "rope":
        config["rope_theta"] = 500000.0
    return config, sd


MALFORMED = {"missing": "layers.0.mlp.up_proj.weight is missing", "extra": "layers.0.input_layernorm.weight left over",
             "hidden": "hidden_size is 32, but the target has 64", "hidden_shape": "fc.weight has shape [64, 192]",
             "vocab": "vocab_size is 300, but the target has 260", "vocab_embed": "embed_tokens.weight has shape [300, 64]",
             "other_embed": "not the target's embedding", "vocab_map": "d2t and t2d do not describe",
             "layers": "2 decoder layers", "layer_count": "num_hidden_layers is 2",
             "eagle3": "cannot express EAGLE-3's fused three-layer input", "rope": "RoPE (theta 500000"}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_head_that_does_not_fit_is_one_line_naming_it(tmp_path, kind):
    config, sd = _broken(kind)
    with pytest.raises(DraftLoadError) as exc:
        import_head(str(_write(tmp_path / "h", config, sd)), tiny_target())
    assert MALFORMED[kind] in _one_line(exc)


def test_jakiro_heads_with_other_expert_counts_are_refused(tmp_path):
    config, sd = _head("jakiro")
    sd[P + "mlp_moe.gate.weight"] = torch.zeros(6, H)
    for i in (2, 3):
        for n in ("gate_proj", "up_proj", "down_proj"):
            sd[P + f"mlp_moe.experts.{i}.{n}.weight"] = torch.zeros(H, H)
    with pytest.raises(DraftLoadError) as exc:
        import_head(str(_write(tmp_path / "h", config, sd)), tiny_target())
    assert "with 4 experts" in _one_line(exc) and "only 2 experts map" in str(exc.value)


def test_a_missing_folder_and_an_unreachable_hub_id_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DraftLoadError) as exc:
        import_head(str(tmp_path / "nothing"), tiny_target())
    assert "no head folder" in _one_line(exc)
    with pytest.raises(DraftLoadError) as exc:
        import_head("nobody-here/no-such-head", tiny_target())
    assert "cannot download the head nobody-here/no-such-head" in _one_line(exc)


@pytest.mark.parametrize("fmt, case, said", [("eagle3", 0, "cannot express EAGLE-3"), ("eagle", 2, "one SwiGLU MLP"),
                                             ("jakiro", 0, "2 experts, both active"), ("onnx", 0, "unknown head format")])
def test_export_refuses_what_the_format_cannot_hold_and_writes_nothing(tmp_path, fmt, case, said):
    _, draft = _drafts()[case]
    with pytest.raises(DraftLoadError) as exc:
        export_head(draft, tiny_target(), fmt, tmp_path / "out")
    assert said in _one_line(exc) and not (tmp_path / "out").exists()


def test_export_replaces_only_a_previous_export_of_ours(tmp_path):
    from jakiro_lib.files import PathError

    _, draft = _drafts()[0]
    t = tiny_target()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(PathError) as exc:
        export_head(draft, t, "eagle", tmp_path / "mine")
    assert "holds no export of ours" in _one_line(exc) and (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    export_head(draft, t, "eagle", tmp_path / "out")
    export_head(draft, t, "eagle", tmp_path / "out")  # a previous export of ours is replaced
    (tmp_path / "out" / "notes.txt").write_text("keep")
    with pytest.raises(PathError) as exc:
        export_head(draft, t, "eagle", tmp_path / "out")
    assert "also holds notes.txt" in _one_line(exc)


def test_stamps_written_before_the_later_draft_fields_still_match():
    """expert_mlp and import_from at their defaults are left out of stamps and fingerprints: drafts trained before
    them are not retrained."""
    cfg = DraftConfig()
    before = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("expert_mlp", "import_from")}
    assert cfg.identity() == before and DraftConfig.stamped(dataclasses.asdict(cfg)) == before
    assert dataclasses.replace(cfg, expert_mlp="gelu").identity() != before
    assert dataclasses.replace(cfg, import_from="somewhere").identity()["import_from"] == "somewhere"
