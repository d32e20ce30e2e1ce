"""The layers' time with their weights in cache: a SmolLM2-shaped random target of one layer (18 MB of fp32 weights,
inside the 32 MB L3) and a 256-word head, T(1) and T(8) (a bushy tree over a 300-token context) back to back and after
a 256 MB write, with the package's ``decoder_layers`` op timed alone inside them; beside the real target's (30 layers,
540 MB streamed from memory):

    python reports/measured/2026-12-02-cycle-after-sampling-cpu-zen5/floor.py > reports/measured/2026-12-02-cycle-after-sampling-cpu-zen5/floor.txt
"""
import statistics, sys, time, torch
from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.measure import random_models
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target, _lean_matches
from jakiro_lib.machine import run_metadata
from jakiro_lib.profiles import get_profile
torch.set_grad_enabled(False)
print(run_metadata(torch.device("cpu")))

def prepare(model):
    model.__dict__[fast_paths.LEAN] = fast_paths.lean_fits(model) and _lean_matches(model)
    fast_paths.set_head_screen(model, kernels.stream_gemm_available())
    kernels.enable_packed_gemm(model, max_rows=64, backend="auto")
    return model

big = torch.empty(64 * 2**20)
layer_t = []
_orig = fast_paths._kernel_without_grad
def _spy(name, h, *rest):
    op = _orig(name, h, *rest)
    if name != "decoder_layers" or op is None:
        return op
    def timed(*a):
        t0 = time.perf_counter(); out = op(*a); layer_t.append(time.perf_counter() - t0); return out
    return timed
fast_paths._kernel_without_grad = _spy
def times(model, rounds=40, context=300):
    runner = TargetRunner(model, 1024)
    g = torch.Generator().manual_seed(0)
    runner.prefill(torch.randint(0, model.config.vocab_size, (context,), generator=g))
    trees = {n: bushy_tree(n, torch.device("cpu")) for n in (1, 8)}
    out = {}
    for cold in (False, True):
        ts = {1: [], 8: []}
        for _ in range(rounds):
            for n in (1, 8):
                tokens, depths, anc = trees[n]
                runner.score(tokens, depths, anc if n > 1 else None, context, greedy=True)  # lead-in
                if cold: big.add_(1.0)
                t0 = time.perf_counter()
                runner.score(tokens, depths, anc if n > 1 else None, context, greedy=True)
                ts[n].append(time.perf_counter() - t0)
                ts.setdefault(("layers", n), []).append(layer_t[-1])
        out["cold" if cold else "warm"] = {n: statistics.median(v) for n, v in ts.items()}
    return out

for layers in (1,):
    random_models.SHAPES["floor"] = dict(random_models.SHAPES["smollm2-135m"], num_hidden_layers=layers, vocab_size=256)
    m = prepare(random_models.random_target("floor"))
    r = times(m)
    print(f"random SmolLM2 shape, {layers} layer(s), 256-word head: " + "; ".join(
        f"{k} T(1) {1e3*v[1]:.3f} ms T(8) {1e3*v[8]:.3f} ms (+{1e3*(v[8]-v[1]):.3f}), the layers' op alone {1e3*v[('layers', 1)]:.3f} and {1e3*v[('layers', 8)]:.3f} ms" for k, v in r.items()), flush=True)
    del m
target = load_target(get_profile("default").target)
r = times(target.model, rounds=20)
print("the real target (30 layers, 49152 words): " + "; ".join(
    f"{k} T(1) {1e3*v[1]:.3f} ms T(8) {1e3*v[8]:.3f} ms (+{1e3*(v[8]-v[1]):.3f}, x{v[8]/v[1]:.3f}), the layers' op alone {1e3*v[('layers', 1)]:.3f} and {1e3*v[('layers', 8)]:.3f} ms" for k, v in r.items()), flush=True)
