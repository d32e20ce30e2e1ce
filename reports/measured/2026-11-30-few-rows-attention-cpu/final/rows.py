"""Whether SmolLM2 (the default profile's target) scores a tree's rows exactly as plain steps score each row's path one
token at a time: a 9-node tree after a 200-token random prompt, its four root-to-leaf paths replayed as plain steps;
logits (and greedy argmaxes) and features compared bit for bit, with the attention kernel (ATTEND_ROWS 16) and with
SDPA (0).

    python reports/measured/2026-11-30-few-rows-attention-cpu/final/rows.py > reports/measured/2026-11-30-few-rows-attention-cpu/final/rows.txt
"""
import torch

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.decoding.static_tree import ancestor_mask
from jakiro_lib.machine import run_metadata
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

target = load_target(get_profile("default").target)
model = target.model
print("gemm", kernels.gemm_choice(model), "lean forward", model.__dict__[fast_paths.LEAN])
print("environment", run_metadata("cpu"))
g = torch.Generator().manual_seed(0)
prompt, tokens = torch.randint(0, 49152, (200,), generator=g), torch.randint(0, 49152, (9,), generator=g)
parents, depths = [0, 0, 0, 1, 1, 2, 4, 4, 6], [0, 1, 1, 2, 2, 2, 3, 3, 4]
anc = ancestor_mask(torch.tensor(parents), max(depths))  # [9, 9]
for rows in (fast_paths.ATTEND_ROWS, 0):
    fast_paths.ATTEND_ROWS = rows
    for greedy in (False, True):
        with torch.inference_mode():
            tree = TargetRunner(model, 512)
            tree.prefill(prompt)
            tree_out, tree_feats = tree.score(tokens, torch.tensor(depths), anc, 200, greedy=greedy)
            same = total = 0
            for leaf in (3, 5, 7, 8):
                plain = TargetRunner(model, 512)
                plain.prefill(prompt)
                for depth, row in enumerate(anc[leaf].nonzero()[:, 0].tolist()):
                    out, feats = plain.score(tokens[row:row + 1], torch.tensor([0]), None, 200 + depth, greedy=greedy)
                    total += 1
                    same += bool(torch.equal(out[0], tree_out[row])) and bool(torch.equal(feats[0], tree_feats[row]))
        print(f"ATTEND_ROWS {rows}, {'greedy argmaxes' if greedy else 'logits'} and features: {same} of {total} rows "
              "equal bit for bit")
