"""Probe (issue 22; README.md beside this file): the draft fed EAGLE-3-style fused features at step 0,
fuse([standardised low, standardised mid, f]) -> H (a bias-free linear initialised to pass f through), and its own
output at deeper steps as before. SIDE=<side dir from side.py> patches the library in this process; without SIDE it
is the plain library. Then the CLI runs: `SIDE=<side> python fused.py train --profile default ...`."""
import os, sys, torch
from pathlib import Path
from safetensors import safe_open
from torch import nn
import jakiro_lib.data.dataset as DS
import jakiro_lib.models.draft as D
from jakiro_lib.models import loss as L
from jakiro_lib import cli

side = os.environ.get("SIDE")
if side:
    side = Path(side)
    orig_get = DS.FeatureDataset.__getitem__
    def getitem(self, i, _o=orig_get):
        item = _o(self, i)
        name, s, e, _ = self.items[i]
        hs = self._handles.get("side:" + name)
        if hs is None:
            hs = self._handles["side:" + name] = safe_open(str(side / name), "pt")
        lm = hs.get_slice("lm")[s:e].to(item["hidden"].dtype)
        item["hidden"] = torch.cat([lm, item["hidden"]], -1)  # [L, 3H]: low, mid, final
        return item
    DS.FeatureDataset.__getitem__ = getitem

    orig_targets = L._targets
    def _targets(core, batch, mask, _o=orig_targets):
        H = core.target_config.hidden_size
        return _o(core, dict(batch, hidden=batch["hidden"][..., -H:]), mask)
    L._targets = _targets

    orig_build = D.DraftModel.build.__func__
    def build(cls, cfg, target_model, d2t=None, _o=orig_build):
        d = _o(cls, cfg, target_model, d2t)
        H = d.target_config.hidden_size
        st = torch.load(side / "stats.pt")
        d.register_buffer("lm_mu", st["mu"].float(), persistent=False)
        d.register_buffer("lm_sd", st["sd"].float(), persistent=False)
        d.fuse = nn.Linear(3 * H, H, bias=False)
        with torch.no_grad():
            d.fuse.weight.zero_(); d.fuse.weight[:, 2 * H:] = torch.eye(H)
        return d
    D.DraftModel.build = classmethod(build)

    orig_step = D.DraftModel._step
    def _step(self, features, input_ids, position_ids, cache, mask, _o=orig_step):
        H = self.target_config.hidden_size
        if features.shape[-1] == 3 * H:
            lm = (features[..., :2 * H] - self.lm_mu.to(features.dtype)) / self.lm_sd.to(features.dtype)
            features = self.fuse(torch.cat([lm, features[..., 2 * H:]], -1))
        return _o(self, features, input_ids, position_ids, cache, mask)
    D.DraftModel._step = _step
    print("fused features from", side, flush=True)
sys.exit(cli.main(sys.argv[1:]))
