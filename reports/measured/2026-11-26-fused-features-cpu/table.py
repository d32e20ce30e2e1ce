"""levers.csv and warm.csv of this record from its run directories (README.md beside this file): `python table.py
<scratch>` with <scratch>/{base,fused,base_u2,fused_u2}/drafts/<draft>/results.json and <scratch>/ft/{u1,all1}/drafts/dense/
(u1: the control of ../2026-11-26-draft-levers-cpu/)."""
import csv, json, sys
from pathlib import Path

root = Path(sys.argv[1])
rows = [("base", "dense", "EAGLE-2's dense draft, the default's settings, single-step"),
        ("fused", "dense", "as base, fed fuse([low, mid, f]) at step 0 (layers 2 and 15, standardised)"),
        ("base_u2", "dense_u2", "as base, 2 unrolled steps (training-time test)"),
        ("fused_u2", "dense_u2", "as fused, 2 unrolled steps")]
with open(Path(__file__).with_name("levers.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["variant", "draft", "how", "steps", "heldout_top1", "top1_depth2", "top1_depth3", "top1_depth4",
                "train_s", "tokens_per_s", "n_params"])
    for name, draft, how in rows:
        r = json.loads((root / name / "drafts" / draft / "results.json").read_text())
        d = r["acc_depth"]
        w.writerow([name, draft, how, r["steps"], *(f"{x:.4f}" for x in d[:4]), round(r["wall_time_s"]),
                    round(r["train_tokens_per_s"]), r["n_params"]])
warm = [("u1", "one more epoch on the answers (the draft levers' control)"),
        ("all1", "one more epoch with the loss on every token, user turns too (LEVER=allmask)")]
with open(Path(__file__).with_name("warm.csv"), "w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["variant", "how", "steps", "heldout_top1", "top1_depth2", "top1_depth3", "top1_depth4", "train_s"])
    for name, how in warm:
        r = json.loads((root / "ft" / name / "drafts" / "dense" / "results.json").read_text())
        w.writerow([name, how, r["steps"], *(f"{x:.4f}" for x in r["acc_depth"][:4]), round(r["wall_time_s"])])
for name in ("levers.csv", "warm.csv"):
    print(open(Path(__file__).with_name(name)).read())
