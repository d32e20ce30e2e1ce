"""Experiment: initialise the dense draft's layer from the target's last decoder layer."""
import os, sys, torch
import jakiro_lib.models.draft as D
from jakiro_lib import cli

mode = os.environ.get("INIT", "random")
orig = D.DraftModel.build.__func__

def build(cls, cfg, target_model, d2t=None):
    draft = orig(cls, cfg, target_model, d2t)
    if mode == "random":
        return draft
    layer = target_model.model.layers[-1]
    with torch.no_grad():
        g = layer.input_layernorm.weight
        for n in ("q_proj", "k_proj", "v_proj"):
            getattr(draft.attn, n).weight.copy_(getattr(layer.self_attn, n).weight * g[None, :])
        draft.attn.o_proj.weight.copy_(layer.self_attn.o_proj.weight)
        draft.post_attention_layernorm.weight.copy_(layer.post_attention_layernorm.weight)
        e = draft.mlp.experts[0]
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(e, n).weight.copy_(getattr(layer.mlp, n).weight)
        if "fc" in mode:
            H = draft.fc.out_features
            draft.fc.weight.zero_(); draft.fc.bias.zero_()
            draft.fc.weight[:, H:] = torch.eye(H)
            draft.fc.weight[:, :H].normal_(0, 0.02)
    print(f"init {mode}", flush=True)
    return draft

D.DraftModel.build = classmethod(build)
sys.exit(cli.main(sys.argv[1:]))
