"""Held-out top-1 of saved drafts on one feature cache's held-out split (README.md beside this file):
`python crosseval.py <run dir whose features/ is the yardstick> <draft dir> [<draft dir> ...]` -> one CSV row each."""
import csv, sys
from pathlib import Path

import torch

from jakiro_lib.profiles import get_profile
from jakiro_lib.data.dataset import FeatureDataset
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.models.loss import evaluate

torch.set_num_threads(2)
profile = get_profile("default")
target = load_target(profile.target)
heldout = FeatureDataset(Path(sys.argv[1]) / "features", "heldout", profile.data.heldout_fraction)
out = csv.writer(sys.stdout)
out.writerow(["draft", "heldout_conversations", "top1_depth1", "top1_depth2", "top1_depth3", "top1_depth4"])
for path in sys.argv[2:]:
    draft = DraftModel.load(path, target.model)
    with torch.no_grad():
        m = evaluate(draft, heldout)
    out.writerow([Path(path).parent.name + "@" + Path(path).parents[2].name, len(heldout),
                  *(f"{x:.4f}" for x in m["acc_depth"][:4])])
