"""Training levers of 2026-11-26 (issue 22; README.md beside this file): LEVER (comma-separated) patches the library
in this process, then the CLI runs: `LEVER=allmask python levers.py train --profile default ...`."""
import os, sys, torch
import torch.nn.functional as F
import jakiro_lib.models.draft as D
import jakiro_lib.training.train as T
from jakiro_lib.models import loss as L
from jakiro_lib import cli
from transformers.models.llama.modeling_llama import LlamaRMSNorm

levers = [x for x in os.environ.get("LEVER", "").split(",") if x]
print("levers", levers, flush=True)
for lev in levers:
    name, _, arg = lev.partition(":")
    if name == "hard":  # + W * CE(draft logits, target argmax) where the argmax is in the draft vocabulary
        W = float(arg)
        orig_fl = D.DraftModel.feature_loss
        def feature_loss(self, pred, t, p, ref, w, p_weight, _o=orig_fl, _W=W):
            out = _o(self, pred, t, p, ref, w, p_weight)
            if not self.training:
                return out
            if getattr(self, "_t2d", None) is None:
                V = self._shared[1].weight.shape[0]
                t2d = torch.full((V,), -100, dtype=torch.long, device=ref.device)
                t2d[self.d2t.to(ref.device)] = torch.arange(self.d2t.numel(), device=ref.device)
                self._t2d = t2d
            lab = self._t2d[ref]
            q = self.train_logits(pred.float()).float()
            ce = F.cross_entropy(q, lab.clamp_min(0), reduction="none") * (lab >= 0).float()
            hard = (ce * w).sum() / w.sum().clamp_min(1.0)
            out["loss"] = out["loss"] + _W * hard
            return out
        D.DraftModel.feature_loss = feature_loss
    elif name == "allmask":  # train on every token (user turns too); held-out evaluation unchanged
        orig_dl = L.draft_loss
        def draft_loss(draft, batch, *a, _o=orig_dl, **k):
            if L._core(draft).training and "attention_mask" in batch:
                batch = dict(batch, loss_mask=batch["attention_mask"].to(batch["loss_mask"].dtype))
            return _o(draft, batch, *a, **k)
        L.draft_loss = draft_loss
    elif name == "inorm":  # RMSNorm on the fc output before attention (pre-norm, as the target's layers)
        orig_build = D.DraftModel.build.__func__
        def build(cls, cfg, target_model, d2t=None, _o=orig_build):
            d = _o(cls, cfg, target_model, d2t)
            d.input_norm = LlamaRMSNorm(d.fc.out_features, eps=d.target_config.rms_norm_eps)
            return d
        D.DraftModel.build = classmethod(build)
        def _step(self, features, input_ids, position_ids, cache, mask):
            with torch.no_grad():
                emb = self.embed(input_ids)
            z = self.fc(torch.cat([emb.to(features.dtype), features], dim=-1))
            cos, sin = self.rotary(z, position_ids)
            h = z + self.attn(self.input_norm(z), (cos, sin), cache, mask)
            return self.mlp(self.post_attention_layernorm(h), h)
        D.DraftModel._step = _step
    elif name == "muon":  # Muon (match_rms_adamw) on 2-D weights, AdamW on the rest; arg: Muon lr multiplier
        MUL = float(arg or 1)
        AdamW = torch.optim.AdamW
        class Combo(torch.optim.Optimizer):
            def __init__(self, params, lr, betas, weight_decay, **kw):
                params = [p for p in params if p.requires_grad]
                mats = [p for p in params if p.ndim == 2]
                rest = [p for p in params if p.ndim != 2]
                self.muon = torch.optim.Muon(mats, lr=lr * MUL, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
                self.adam = AdamW(rest, lr=lr, betas=betas, weight_decay=weight_decay)
                self.param_groups = self.muon.param_groups + self.adam.param_groups
                self.defaults = dict(lr=lr)
                self.state = {}
                self._optimizer_step_pre_hooks = {}; self._optimizer_step_post_hooks = {}
                self._optimizer_state_dict_pre_hooks = {}; self._optimizer_state_dict_post_hooks = {}
                self._optimizer_load_state_dict_pre_hooks = {}; self._optimizer_load_state_dict_post_hooks = {}
                print(f"muon: {len(mats)} matrices, {len(rest)} other tensors", flush=True)
            def step(self, closure=None):
                self.muon.step(); self.adam.step()
            def zero_grad(self, set_to_none=True):
                self.muon.zero_grad(set_to_none); self.adam.zero_grad(set_to_none)
            def state_dict(self):
                return {"muon": self.muon.state_dict(), "adam": self.adam.state_dict()}
            def load_state_dict(self, sd):
                self.muon.load_state_dict(sd["muon"]); self.adam.load_state_dict(sd["adam"])
        T.torch.optim.AdamW = Combo
    else:
        raise SystemExit(f"unknown lever {lev}")
sys.exit(cli.main(sys.argv[1:]))
