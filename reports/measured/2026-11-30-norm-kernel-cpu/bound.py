"""A bound measured before building the norm kernel (at e83169a): T(1) and T(8) of the default fp32 target with its 61
RMSNorms as they ran (torch's rms_norm) and with each replaced by one product, weight * x (wrong numbers, what one
operator a norm would cost), 15 rounds interleaved; the medians and the median of the per-round differences in ms.

    python reports/measured/2026-11-30-norm-kernel-cpu/bound.py
"""
import statistics, types, torch
from contextlib import contextmanager, nullcontext
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile
from jakiro_lib.measure.costmodel import measure_target_cost_variants
from jakiro_lib.models import fast_paths
torch.set_num_threads(2)
t = load_target(get_profile("default").target)
norms = [m for m in t.model.modules() if type(m).__name__ == "LlamaRMSNorm"]
print(len(norms))
orig = {id(m): m.forward for m in norms}
@contextmanager
def cheap():
    for m in norms: m.forward = (lambda self: (lambda x: x * self.weight))(m)
    try: yield
    finally:
        for m in norms: m.forward = orig[id(m)]
r = {n: {"fused": [], "cheap": []} for n in (1, 8)}
for i in range(15):
    tab = measure_target_cost_variants(t.model, (1, 8), {"fused": nullcontext, "cheap": cheap}, context=300, repeats=1, greedy=True)
    for n in tab:
        for k in tab[n]: r[n][k].append(tab[n][k] * 1e3)
for n in r: print(n, {k: round(statistics.median(v), 2) for k, v in r[n].items()}, round(statistics.median([a - b for a, b in zip(r[n]["fused"], r[n]["cheap"])]), 3))
