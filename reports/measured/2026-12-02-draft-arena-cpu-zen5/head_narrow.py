"""A draft head's activations rounded to one signed byte (head_narrow.diff, not kept): the draft head's int8_linear
(jakiro's reduced head, its int8 copy) through the working tree's kernel file, the diff applied, against HEAD's: time at
2, 3 and 6 rows (paired, shuffled), the logits' largest error against the fp32 head relative to its largest logit, and
how often the top 3 words equal the fp32 head's, on 288 rows of the target's last hidden states (four MT-bench turns).

    git apply reports/measured/2026-12-02-draft-arena-cpu-zen5/head_narrow.diff
    python reports/measured/2026-12-02-draft-arena-cpu-zen5/head_narrow.py
    git checkout jakiro_lib/models/stream_gemm.cpp
"""
import random, statistics, subprocess, tempfile, time, sys
from pathlib import Path
import torch
import torch.nn.functional as F
from torch.utils import cpp_extension
from jakiro_lib.models import kernels
from jakiro_lib.measure.cycles import cycle_methods, cycle_prompts
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

OLD = "jsg_old"
src = subprocess.run(["git", "show", "HEAD:jakiro_lib/models/stream_gemm.cpp"], capture_output=True, text=True,
                     check=True).stdout.replace("jakiro_stream_gemm", OLD)
d = tempfile.mkdtemp()
(Path(d) / "old.cpp").write_text(src)
cpp_extension.load(name=OLD, sources=[str(Path(d) / "old.cpp")], is_python_module=False, build_directory=d,
                   extra_cflags=list(kernels.STREAM_FLAGS), extra_ldflags=["-fopenmp"])
profile_ = get_profile("default", **{"data.num_conversations": 5000, "train.epochs": 4})
target = load_target(profile_.target)
methods = cycle_methods(profile_, Path("runs/main5000"), target, ["jakiro"])
draft = methods["jakiro"].load_draft(target)
prompts = cycle_prompts(profile_, target, 10)
screen, scales, n = draft.int8_head()
W = draft.head_weight().float()
ops = {"new": torch.ops.jakiro_stream_gemm, "old": getattr(torch.ops, OLD)}
with torch.inference_mode():
    feats = torch.cat([target.model.model(input_ids=p[None]).last_hidden_state[0] for p in prompts[:4]])  # real-ish rows
    err = {}
    agree = {"new": 0, "old": 0}
    for name, op in ops.items():
        out = op.int8_linear(feats, screen, scales, n)
        ref = F.linear(feats, W)
        err[name] = float((out - ref).abs().max() / ref.abs().max())
        agree[name] = float((out.topk(3, -1).indices == ref.topk(3, -1).indices).all(-1).float().mean())
    print("rows", feats.shape[0], "max rel err", err, "top-3 equal", agree)
    times = {(k, r): [] for k in ops for r in (2, 3, 6)}
    for _ in range(200):
        for r in (2, 3, 6):
            order = list(ops); random.shuffle(order)
            x = feats[:r].contiguous()
            for k in order:
                t = time.perf_counter(); ops[k].int8_linear(x, screen, scales, n); times[k, r].append(time.perf_counter() - t)
    for r in (2, 3, 6):
        o, nw = statistics.median(times["old", r]), statistics.median(times["new", r])
        print(f"rows {r}: old {1e6*o:.1f} us, new {1e6*nw:.1f} us, old/new {o/nw:.2f}")
