"""Where a dense draft training step's time goes on this CPU: the GEMMs' share and their FLOP rate.

    python reports/measured/2026-11-23-amd-epyc-2core/train_step_gemm.py <run_dir with the default profile's features>

Batches of 8 conversations of the default profile's feature cache, EAGLE-2's dense draft (fp32), AdamW;
two steps timed after one warm-up, then one step under torch.profiler with FLOP counting.
"""
import sys
import time
from pathlib import Path

import torch

from jakiro_lib.profiles import get_profile
from jakiro_lib.data.dataset import collate
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.study.s01_train import training_datasets
from jakiro_lib.models.target import load_target
from jakiro_lib.models.loss import draft_loss

prof = get_profile("default", **{"target.packed_gemm": 0})
target = load_target(prof.target)
train, _ = training_datasets(prof, Path(sys.argv[1]), target)
draft = DraftModel.build(prof.drafts["dense"], target.model).train()
opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
batches = [collate([train[i] for i in range(b * 8, b * 8 + 8)]) for b in range(4)]


def step(batch):
    loss, _ = draft_loss(draft, batch, sync=False)
    opt.zero_grad()
    loss.backward()
    opt.step()


step(batches[0])
t0 = time.perf_counter()
for b in batches[1:3]:
    step(b)
print(f"2 steps {time.perf_counter() - t0:.2f} s, {sum(int(b['input_ids'].numel()) for b in batches[1:3])} tokens (padded)")
with torch.profiler.profile(with_flops=True) as p:
    step(batches[3])
events = p.key_averages()
gemm = [e for e in events if e.key in ("aten::mm", "aten::addmm")]
flops, seconds = sum(e.flops for e in gemm), sum(e.self_cpu_time_total for e in gemm) / 1e6
total = sum(e.self_cpu_time_total for e in events) / 1e6
print(f"GEMM {flops / 1e9:.1f} GFLOP in {seconds:.3f} s = {flops / 1e9 / seconds:.0f} GFLOP/s; "
      f"step self CPU {total:.3f} s, GEMM share {seconds / total:.0%}")
