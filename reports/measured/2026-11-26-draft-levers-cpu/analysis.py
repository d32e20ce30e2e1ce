"""Tables of reports/measured/2026-11-26-draft-levers-cpu from the scratch runs' records."""
import json, sys
from pathlib import Path
import pandas as pd
from jakiro_lib.measure.summary import versus
from jakiro_lib.study.tables import acceptance_by_depth

OUT, SCRATCH = Path(sys.argv[1]), sys.argv[2]  # <scratch>: the runs' directory (commands.sh)


def at(path):
    return path.replace("<scratch>", SCRATCH)

def recs(path, rename=None):
    rs = [json.loads(line) for line in open(at(path))]
    for r in rs:
        if rename and r["method"] in rename:
            r["method"] = rename[r["method"]]
    return rs

def summary(path):
    return pd.read_csv(at(path))

# tree shape
rows = []
for tag, d, k, path in [("d4k4", 4, 4, "<scratch>/e10/bench_dense"), ("d6k4", 6, 4, "<scratch>/ts/d6k4"), ("d6k2", 6, 2, "<scratch>/ts/d6k2"),
                        ("d8k2", 8, 2, "<scratch>/ts/d8k2"), ("d5k3", 5, 3, "<scratch>/ts/d5k3"), ("d7k1", 7, 1, "<scratch>/ts/d7k1")]:
    s = summary(f"{path}/summary.csv").set_index("method")
    e = s.loc["eagle2"]
    rows.append({"depth": d, "top_k": k, "total_tokens": 8, "tau": e.tau, "speedup_vs_vanilla": e.speedup,
                 "ci_low": e.speedup_ci_low, "ci_high": e.speedup_ci_high, "tokens_per_s": e.tokens_per_s,
                 "vanilla_tokens_per_s": s.loc["vanilla"].tokens_per_s, "draft_forwards_per_cycle": e.draft_forwards_per_cycle,
                 "greedy_same": f"{int(e.greedy_same)}/{int(e.greedy_compared)}", "records": path})
pd.DataFrame(rows).to_csv(OUT / "tree_shape.csv", index=False)

# fine-tunes: tau against the 1-epoch single-step control, paired over the 20 prompts
runs = {"e10": "<scratch>/e10/bench_dense", "u1": "<scratch>/ft/u1/bench", "u2": "<scratch>/ft/u2/bench", "sd": "<scratch>/sd/bench"}
allr = []
for tag, path in runs.items():
    allr += [r for r in recs(f"{path}/records.jsonl", {"eagle2": f"eagle2_{tag}"}) if r["method"] == f"eagle2_{tag}"]
vs = pd.DataFrame(versus(allr, "eagle2_u1"))
vs.to_csv(OUT / "fine_tune_versus_u1.csv", index=False)
acc = acceptance_by_depth(allr, 5)
acc.to_csv(OUT / "acceptance_by_depth.csv", index=False)
print(vs[["method", "tau", "baseline_tau", "tau_ratio", "tau_ci_low", "tau_ci_high", "tau_verdict"]].to_string())
print(acc.round(3).to_string())

# both tree sizes: every drafted method of these runs, named <method>@<draft>, tau and speed against its run's vanilla
benches = [  # tokens, records dir, draft tag per method
    (8, "<scratch>/big17/bench_both", {"eagle2": "dense_5ep", "jakiro": "moe2_5ep", "jakiro_cepd": "moe2_5ep"}),
    (8, "<scratch>/big17/bench_released", {"jakiro_coupled_cepd": "moe2_5ep"}),
    (8, "<scratch>/e10/bench_dense", {"eagle2": "dense_10ep"}),
    (8, "<scratch>/ft/u1/bench", {"eagle2": "dense_10ep+u1"}),
    (8, "<scratch>/ft/u2/bench", {"eagle2": "dense_10ep+u2"}),
    (8, "<scratch>/sd/bench", {"eagle2": "dense_10ep+sd"}),
    (8, "<scratch>/ftm/u2/bench8", {"jakiro": "moe2_5ep+u2", "jakiro_cepd": "moe2_5ep+u2"}),
    (60, "<scratch>/pt/both", {"eagle2": "dense_5ep", "jakiro": "moe2_5ep", "jakiro_cepd": "moe2_5ep"}),
    (60, "<scratch>/pt/released", {"jakiro_coupled_cepd": "moe2_5ep"}),
    (60, "<scratch>/pt/coupled", {"experts=2, coupled": "moe2_5ep", "experts=2, scoring=best": "moe2_5ep"}),
    (60, "<scratch>/pt/e10", {"eagle2": "dense_10ep"}),
    (60, "<scratch>/pt/u2", {"eagle2": "dense_10ep+u2"}),
    (60, "<scratch>/ftm/u2/bench60", {"jakiro": "moe2_5ep+u2", "jakiro_cepd": "moe2_5ep+u2"}),
]
rows, by_size = [], {8: [], 60: []}
for tokens, path, tags in benches:
    s = summary(f"{path}/summary.csv").set_index("method")
    for m, tag in tags.items():
        e = s.loc[m]
        rows.append({"total_tokens": tokens, "method": m, "draft": tag, "tau": e.tau, "speedup_vs_vanilla": e.speedup,
                     "ci_low": e.speedup_ci_low, "ci_high": e.speedup_ci_high, "tokens_per_s": e.tokens_per_s,
                     "vanilla_tokens_per_s": s.loc["vanilla"].tokens_per_s,
                     "draft_forwards_per_cycle": e.draft_forwards_per_cycle,
                     "greedy_same": f"{int(e.greedy_same)}/{int(e.greedy_compared)}",
                     "records": path})
    by_size[tokens] += [r for r in recs(f"{path}/records.jsonl", {m: f"{m}@{t}" for m, t in tags.items()})
                        if r["method"] in {f"{m}@{t}" for m, t in tags.items()}]
pd.DataFrame(rows).to_csv(OUT / "methods.csv", index=False)
vs = pd.concat([pd.DataFrame(versus(by_size[n], "eagle2@dense_5ep")).assign(total_tokens=n) for n in (8, 60)])
vs.to_csv(OUT / "versus_eagle2_dense_5ep.csv", index=False)
print(vs[["total_tokens", "method", "tau", "baseline_tau", "tau_ratio", "tau_ci_low", "tau_ci_high", "tau_verdict"]].to_string())
acceptance_by_depth(by_size[60], 6).assign(total_tokens=60).to_csv(OUT / "acceptance_by_depth_60.csv", index=False)

# top-1 of every draft on two held-out sets: the 17k ShareGPT split (from each training's results.json, and
# evaluated here for the self-distilled fine-tune) and the self-distilled split (the target's own answers)
import torch
from jakiro_lib.models import loss as L
from jakiro_lib.profiles import get_profile
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.study.context import get_target
from jakiro_lib.study.s01_train import training_datasets
torch.set_num_threads(2)
sd_prof = get_profile("default", **{"data.self_distill": "true", "data.num_conversations": "1000"})
target = get_target(sd_prof)
_, held_sd = training_datasets(sd_prof, Path(at("<scratch>/sd")), target)
_, held_sg = training_datasets(get_profile("default", **{"data.num_conversations": "17671"}), Path(at("<scratch>/big17")), target)
drafts = [  # tag, run dir, draft, start, data, unroll, epochs
    ("dense_5ep", "<scratch>/big17", "dense", "fresh", "ShareGPT 17k", 1, 5),
    ("moe2_5ep", "<scratch>/big17", "moe2", "fresh", "ShareGPT 17k", 1, 5),
    ("dense_10ep", "<scratch>/e10", "dense", "fresh", "ShareGPT 17k", 1, 10),
    ("dense_10ep+u1", "<scratch>/ft/u1", "dense", "dense_10ep", "ShareGPT 17k", 1, 1),
    ("dense_10ep+u2", "<scratch>/ft/u2", "dense", "dense_10ep", "ShareGPT 17k", 2, 1),
    ("dense_10ep+sd", "<scratch>/sd", "dense", "dense_10ep", "756 self-distilled", 1, 2),
    ("moe2_5ep+u2", "<scratch>/ftm/u2", "moe2", "moe2_5ep", "ShareGPT 17k", 2, 1),
]
rows = []
for tag, rdir, name, start, data, unroll, epochs in drafts:
    res = json.load(open(at(f"{rdir}/drafts/{name}/results.json")))
    d = DraftModel.load(at(f"{rdir}/drafts/{name}/draft"), target.model).float()
    sg = L.evaluate(d, held_sg, batch_size=8) if tag.endswith("+sd") else res["heldout"]
    sd = L.evaluate(d, held_sd, batch_size=8)
    rows.append({"draft": tag, "architecture": name, "starts_from": start, "data": data, "unroll_steps": unroll,
                 "epochs": epochs, "steps": res["steps"], "train_s": round(res["wall_time_s"], 1),
                 "train_tokens_per_s": round(res["train_tokens_per_s"] or 0),
                 **{f"sharegpt_top1_d{i + 1}": round(x, 4) for i, x in enumerate(sg["acc_depth"])},
                 "sharegpt_top1_b": sg.get("acc_b"),
                 **{f"own_text_top1_d{i + 1}": round(x, 4) for i, x in enumerate(sd["acc_depth"])},
                 "own_text_top1_b": sd.get("acc_b")})
    print(rows[-1], flush=True)
pd.DataFrame(rows).to_csv(OUT / "drafts.csv", index=False)
