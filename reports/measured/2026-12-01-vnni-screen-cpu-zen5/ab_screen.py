"""Greedy decoding's head screen through the package's kernel file against the file at ``--old`` (built under its own
op namespace and swapped in, each side with the head's int8 copy its own ``pack_int8`` and ``tile_screen`` make): the
argmaxes of a 300-token prefill's rows and of one row and an 8-token tree after it compared, then the screen alone
(``greedy_argmax`` on the prefill's last hidden rows, 1 to 8 of them) and T(1) and T(8) (the verify forward, greedy),
the two files in a shuffled order each round, paired within rounds.

    python reports/measured/2026-12-01-vnni-screen-cpu-zen5/ab_screen.py --old 9c230e4 --rounds 60 \
        > reports/measured/2026-12-01-vnni-screen-cpu-zen5/ab_screen.txt
"""
import argparse
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.machine import run_metadata
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile

ap = argparse.ArgumentParser()
ap.add_argument("--old", required=True)
ap.add_argument("--rounds", type=int, default=60)
args = ap.parse_args()
OLD = "jsg_old"
src = subprocess.run(["git", "show", f"{args.old}:jakiro_lib/models/stream_gemm.cpp"], capture_output=True, text=True,
                     check=True).stdout.replace("jakiro_stream_gemm", OLD)
d = tempfile.mkdtemp()
(Path(d) / "old.cpp").write_text(src)
cpp_extension.load(name=OLD, sources=[str(Path(d) / "old.cpp")], is_python_module=False, build_directory=d,
                   extra_cflags=list(kernels.STREAM_FLAGS), extra_ldflags=["-fopenmp"])
t = load_target(get_profile("default").target)
kernels.stream_gemm_available()
print(run_metadata(t.model.device))
ops = {"new": torch.ops.jakiro_stream_gemm, "old": getattr(torch.ops, OLD)}
screens = {}


def use(name: str) -> None:
    torch.ops.__dict__["jakiro_stream_gemm"] = ops[name]
    fast_paths._kernels.clear()
    if name not in screens:
        screens[name] = fast_paths.head_screen(t.model)
    t.model.__dict__[fast_paths.SCREEN] = screens[name]


g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 49152, (300,), generator=g)
tokens = torch.randint(0, 49152, (8,), generator=g)
depths = torch.tensor([0, 1, 1, 2, 2, 3, 3, 4])
parents = [0, 0, 0, 1, 1, 3, 3, 5]
anc = torch.eye(8, dtype=torch.bool)
for i in range(1, 8):
    j = i
    while j:
        j = parents[j]
        anc[i, j] = True
runners, outs = {}, {}
with torch.inference_mode():
    for name in ("old", "new"):
        use(name)
        print(f"{name}: the head's int8 copy {tuple(screens[name][0].shape)}, tile_screen() {ops[name].tile_screen()}")
        r = TargetRunner(t.model, 512)
        _, hidden = r.prefill(prompt)
        rows = hidden.reshape(-1, hidden.shape[-1])  # [300, H] the prefill's last hidden states (normed)
        a1, _ = r.score(tokens[:1], depths[:1], None, 300, greedy=True)
        a8, _ = r.score(tokens, depths, anc, 300, greedy=True)
        heads = [fast_paths.greedy_argmax(t.model, t.model.model.norm(rows[i:i + 8])) for i in range(0, 296, 8)]
        outs[name] = (a1, a8, torch.cat(heads))
        runners[name] = (r, rows)
    for i, label in enumerate(["argmax, one row", "argmax, 8-token tree", "argmax of 296 prefill rows, 8 at a time"]):
        print(f"{label}: equal {torch.equal(outs['old'][i], outs['new'][i])}")
    exact = torch.equal(outs["new"][2], t.model.lm_head(t.model.model.norm(runners["new"][1][:296])).argmax(-1))
    print(f"the 296 rows' argmaxes equal torch's argmax of the fp32 logits: {exact}")

    def timed(name: str, what: str, n: int) -> float:
        r, rows = runners[name]
        x = t.model.model.norm(rows[:n])
        t0 = time.perf_counter()
        if what == "head":
            fast_paths.greedy_argmax(t.model, x)
        elif n == 1:
            r.score(tokens[:1], depths[:1], None, 300, greedy=True)
        else:
            r.score(tokens, depths, anc, 300, greedy=True)
        return time.perf_counter() - t0

    cases = [("head", 1), ("head", 2), ("head", 4), ("head", 6), ("head", 8), ("T", 1), ("T", 8)]
    res = {(name, c): [] for name in ops for c in cases}
    rng = random.Random(0)
    for _ in range(args.rounds):
        order = ["old", "new"]
        rng.shuffle(order)
        for name in order:
            use(name)
            for c in cases:
                res[name, c].append(timed(name, *c))
    use("new")
    for what, n in cases:
        ratios = [a / b for a, b in zip(res["old", (what, n)], res["new", (what, n)])]
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        label = f"the screen alone, {n} row{'s' if n > 1 else ''}" if what == "head" else f"T({n})"
        print(f"{label} (medians of {args.rounds} rounds): old {statistics.median(res['old', (what, n)]) * 1e3:.3f} ms, "
              f"new {statistics.median(res['new', (what, n)]) * 1e3:.3f} ms, speed new/old {statistics.median(ratios):.3f} "
              f"[{boot[50]:.3f}, {boot[1949]:.3f}]")
