"""The target's verify forward (``TargetRunner.score``, greedy) of one row or an 8-token tree of depth 4 after a
300-token prompt, in a loop for ``SECONDS`` after printing "ready", then the mean time a call: the process a profiler
attaches to.

    python forward_loop.py ROWS SECONDS > out.txt &  # then, once out.txt says ready:
    perf record -g -p $! -o forward.data -- sleep 15
"""
import sys, time, torch
from jakiro_lib.models import kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile
from jakiro_lib.decoding.runner import TargetRunner
rows = int(sys.argv[1]); secs = float(sys.argv[2])
t = load_target(get_profile("default").target)
kernels.stream_gemm_available()
g = torch.Generator().manual_seed(0)
prompt = torch.randint(0, 49152, (300,), generator=g)
tokens = torch.randint(0, 49152, (8,), generator=g)
depths = torch.tensor([0, 1, 1, 2, 2, 3, 3, 4]); parents = [0, 0, 0, 1, 1, 3, 3, 5]
anc = torch.eye(8, dtype=torch.bool)
for i in range(1, 8):
    j = i
    while j: j = parents[j]; anc[i, j] = True
with torch.inference_mode():
    r = TargetRunner(t.model, 512)
    r.prefill(prompt)
    print("ready", flush=True)
    t0 = time.perf_counter(); n = 0
    while time.perf_counter() - t0 < secs:
        if rows == 1: r.score(tokens[:1], depths[:1], None, 300, greedy=True)
        else: r.score(tokens, depths, anc, 300, greedy=True)
        n += 1
    print("per call ms", 1e3 * (time.perf_counter() - t0) / n)
