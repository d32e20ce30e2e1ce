"""Plain decoding of the default target with its GEMMs on the package's streaming kernel against oneDNN's packed
copies (`target.gemm_backend` "stream" and "onednn"), both targets in one process, interleaved (the order turning
each generation), MT-bench q1-10 first turns x 3 rounds, 64 new tokens: what the load-time probe's choice costs where
the linears alone measure the two within 1% (the streaming kernel also runs a decoding step's layers in one call).

    python reports/measured/2026-12-01-gemm-probe-cpu-zen5/ab.py > reports/measured/2026-12-01-gemm-probe-cpu-zen5/run1.txt
"""
import dataclasses
import json
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile
from jakiro_lib.measure.cycles import cycle_prompts
from jakiro_lib.decoding.static import static_generate
from jakiro_lib.models import kernels
from jakiro_lib.machine import run_metadata

prof = get_profile("default")
targets = {b: load_target(dataclasses.replace(prof.target, gemm_backend=b)) for b in ("stream", "onednn")}
print(json.dumps(run_metadata(targets["stream"].device)))
for b, t in targets.items():
    print(b, kernels.gemm_choice(t.model))
prompts = cycle_prompts(prof, targets["stream"], 10)
times = {b: [] for b in targets}
for b, t in targets.items():
    static_generate(t.model, None, None, prompts[0], max_new_tokens=8, max_context=2048)
outs = {}
for rnd in range(3):
    for i, p in enumerate(prompts):
        order = list(targets) if (i + rnd) % 2 == 0 else list(targets)[::-1]
        for b in order:
            r = static_generate(targets[b].model, None, None, p, max_new_tokens=64, max_context=2048)
            times[b].append((r.wall_time - r.prefill_time) / (len(r.output_ids) - 1))
            outs.setdefault((rnd, i), set()).add(tuple(r.output_ids))
import statistics
for b, ts in times.items():
    print(b, "ms per token: median", round(1000 * statistics.median(ts), 3), "mean", round(1000 * statistics.fmean(ts), 3))
ratios = sorted(a / b for a, b in zip(times["onednn"], times["stream"]))
print("onednn/stream per generation: median", round(statistics.median(ratios), 3), "min", round(ratios[0], 3), "max", round(ratios[-1], 3))
print("same outputs:", all(len(v) == 1 for v in outs.values()))
