"""Probe (issue 22; README.md beside this file): low/mid-layer target features beside an existing feature cache.
`python side.py <cache>/features <side> LOW MID` writes <side>/shard_*.safetensors with "lm" [T, 2H] fp16 =
hidden_states[LOW], hidden_states[MID] of the bf16 target at the cached tokens (8 conversations per forward),
reports the largest difference of hidden_states[-1] from the cached feature, and writes <side>/stats.pt: per-channel
mean and standard deviation of "lm" over every 12th shard (fused.py standardises with them)."""
import sys, time, json, torch
from pathlib import Path
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from jakiro_lib.models.target import builtin_smollm2_path
torch.set_num_threads(2)
cache, out = Path(sys.argv[1]), Path(sys.argv[2]); out.mkdir(parents=True, exist_ok=True)
LOW, MID = int(sys.argv[3]), int(sys.argv[4])
m = AutoModelForCausalLM.from_pretrained(builtin_smollm2_path(), dtype=torch.bfloat16).eval()
man = json.loads((cache / "manifest.json").read_text())
t0 = time.time(); ntok = 0; worst = 0.0
for k, e in enumerate(man["shards"]):
    dst = out / e["file"]
    if dst.exists() or e["conversations"] == 0:
        continue
    with safe_open(str(cache / e["file"]), "pt") as f:
        ids = f.get_tensor("input_ids").long(); offs = f.get_tensor("offsets").tolist(); hid = f.get_tensor("hidden")
    lm = torch.zeros(ids.shape[0], 2 * hid.shape[1], dtype=torch.float16)
    order = sorted(range(len(offs)), key=lambda i: -(offs[i][1] - offs[i][0]))
    with torch.inference_mode():
        for g in range(0, len(order), 8):
            grp = [offs[i] for i in order[g:g + 8]]
            T = max(b - a for a, b in grp)
            x = torch.zeros(len(grp), T, dtype=torch.long); am = torch.zeros(len(grp), T, dtype=torch.long)
            for r, (a, b) in enumerate(grp):
                x[r, :b - a] = ids[a:b]; am[r, :b - a] = 1
            hs = m.model(input_ids=x, attention_mask=am, output_hidden_states=True).hidden_states
            for r, (a, b) in enumerate(grp):
                n = b - a
                lm[a:b] = torch.cat([hs[LOW][r, :n], hs[MID][r, :n]], -1).half()
                d = (hs[-1][r, :n].float() - hid[a:b].float()).abs().max().item()
                worst = max(worst, d)
    save_file({"lm": lm}, str(dst) + ".tmp"); Path(str(dst) + ".tmp").rename(dst)
    ntok += ids.shape[0]
    if k % 10 == 0:
        print(f"shard {k}/{len(man['shards'])} {ntok} tokens {ntok / (time.time() - t0):.0f} tok/s worst final-layer diff {worst:.3f}", flush=True)
print("done", ntok, time.time() - t0, "worst", worst)
from safetensors.torch import load_file
x = torch.cat([load_file(str(out / e["file"]))["lm"].float() for e in man["shards"][::12] if e["conversations"]])
torch.save({"mu": x.mean(0), "sd": x.std(0).clamp_min(1e-3)}, out / "stats.pt")
