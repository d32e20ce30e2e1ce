"""The target's forward through the package's kernel file against the file at ``--old`` (built under its own op
namespace and swapped in): a 300-token prefill, one row and an 8-token tree of depth 4 (argmaxes and logits), compared
bit for bit with the cache buffer after; then T(1) and T(8), greedy, the two files in a shuffled order each round,
paired within rounds.

    python reports/measured/2026-12-01-layers-raw-rows-cpu-zen5/layers.py --old 1a49d8e --rounds 100 \
        > reports/measured/2026-12-01-layers-raw-rows-cpu-zen5/layers.txt
"""
import argparse, subprocess, tempfile, time, statistics, random
from pathlib import Path
import torch
from torch.utils import cpp_extension
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile
from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.machine import run_metadata
ap = argparse.ArgumentParser()
ap.add_argument("--old", required=True)
ap.add_argument("--rounds", type=int, default=100)
args = ap.parse_args()
OLD = "jsg_old"
src = subprocess.run(["git", "show", f"{args.old}:jakiro_lib/models/stream_gemm.cpp"], capture_output=True, text=True, check=True).stdout.replace("jakiro_stream_gemm", OLD)
d = tempfile.mkdtemp(); (Path(d) / "old.cpp").write_text(src)
cpp_extension.load(name=OLD, sources=[str(Path(d) / "old.cpp")], is_python_module=False, build_directory=d, extra_cflags=list(kernels.STREAM_FLAGS), extra_ldflags=["-fopenmp"])
t = load_target(get_profile("default").target)
kernels.stream_gemm_available()
print(run_metadata(t.model.device))
new, old = torch.ops.jakiro_stream_gemm, getattr(torch.ops, OLD)
def use(o):
    torch.ops.__dict__["jakiro_stream_gemm"] = o; fast_paths._kernels.clear()
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 49152, (300,), generator=g)
tokens = torch.randint(0, 49152, (8,), generator=g)
depths = torch.tensor([0, 1, 1, 2, 2, 3, 3, 4]); parents = [0, 0, 0, 1, 1, 3, 3, 5]
anc = torch.eye(8, dtype=torch.bool)
for i in range(1, 8):
    j = i
    while j: j = parents[j]; anc[i, j] = True
runners = {}
outs = {}
for name, o in (("old", old), ("new", new)):
    use(o)
    r = TargetRunner(t.model, 512)
    lp, hp = r.prefill(prompt)
    a1, h1 = r.score(tokens[:1], depths[:1], None, 300, greedy=True)
    a8, h8 = r.score(tokens, depths, anc, 300, greedy=True)
    l8, _ = r.score(tokens, depths, anc, 300, greedy=False)
    outs[name] = (lp, hp, a1, h1, a8, h8, l8, r.where.stack.clone())
    runners[name] = r
for i, lab in enumerate(["prefill logits", "prefill hidden", "argmax1", "hidden1", "argmax8", "hidden8", "logits8", "stack"]):
    print(f"{lab}: equal bit for bit {torch.equal(outs['old'][i], outs['new'][i])}")
# timing, paired
def timed(r, rows):
    t0 = time.perf_counter()
    if rows == 1: r.score(tokens[:1], depths[:1], None, 300, greedy=True)
    else: r.score(tokens, depths, anc, 300, greedy=True)
    return time.perf_counter() - t0
res = {("old", 1): [], ("old", 8): [], ("new", 1): [], ("new", 8): []}
rng = random.Random(0)
for _ in range(args.rounds):
    order = ["old", "new"]; rng.shuffle(order)
    for name in order:
        use(old if name == "old" else new)
        for rows in (1, 8):
            res[name, rows].append(timed(runners[name], rows))
use(new)
for rows in (1, 8):
    ratios = [a / b for a, b in zip(res["old", rows], res["new", rows])]
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    print(f"T({rows}) (medians of {args.rounds} rounds) old {statistics.median(res['old', rows])*1e3:.2f} ms new {statistics.median(res['new', rows])*1e3:.2f} ms speed new/old {statistics.median(ratios):.3f} [{boot[50]:.3f}, {boot[1949]:.3f}]")
