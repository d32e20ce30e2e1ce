"""The verify forward at 1 and 8 rows and greedy_argmax alone at 1 and 8 rows, each after a 256 MB write, interleaved.

    python reports/measured/2026-12-02-verify-phases-cpu-zen5/head_parts.py 40 > head_parts.txt
"""
import statistics, time, torch, sys
from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models import fast_paths
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile
torch.set_grad_enabled(False)
target = load_target(get_profile("default").target)
model = target.model
g = torch.Generator().manual_seed(0)
CONTEXT=300
prompt = torch.randint(0, model.config.vocab_size, (CONTEXT,), generator=g)
runner = TargetRunner(model, 512); runner.prefill(prompt)
trees = {n: bushy_tree(n, model.device) for n in (1, 8)}
big = torch.empty(64 * 2**20)  # 256 MB
hid = {}
for n in (1,8):
    tokens, depths, anc = trees[n]
    out = runner.score(tokens, depths, anc if n > 1 else None, CONTEXT, greedy=True)
# hidden rows for the head: real last hidden states
h8 = torch.randn(8, model.config.hidden_size)
lg = model.lm_head.weight
# use a forward's hidden: run lean forward through runner internals is complex; take embeddings of likely tokens
h = model.model.norm(model.model.embed_tokens(prompt[:8])[None])[0].contiguous()
res = {k: [] for k in ("T1","T8","H1","H8")}
rounds = int(sys.argv[1]) if len(sys.argv)>1 else 40
for r in range(rounds+1):
    for key in ("T1","T8","H1","H8"):
        big.add_(1.0)  # cold
        n = int(key[1])
        t0 = time.perf_counter()
        if key[0]=="T":
            tokens, depths, anc = trees[n]
            runner.score(tokens, depths, anc if n > 1 else None, CONTEXT, greedy=True)
        else:
            fast_paths.greedy_argmax(model, h[:n].contiguous())
        if r: res[key].append(1e3*(time.perf_counter()-t0))
for k,v in res.items(): print(k, f"median {statistics.median(v):.3f} mean {statistics.mean(v):.3f}")
t1=statistics.median(res["T1"]); print("T8/T1", statistics.median(a/b for a,b in zip(res["T8"],res["T1"])))
