"""Where feature caching spends its time (issue 42: 43.8k tokens/s on the H100, the goal 300k): one call of a lent GPU.

    python .device/cache_profile.py --profile gpu --conversations 512 --batch-size 32 --out DIR

Caches the first ``--conversations`` of the profile's data five times into throw-away folders: once to warm up
(kernels, allocator, the tokenizing workers), once timed as it runs (``data.tokenize_workers``, or
``--tokenize-workers``), once timed with tokenizing in the caching process (``tokenize_workers=1``: the path before
the pipeline, side by side), once under cProfile (Python-level: tokenizing, padding, the forward, copies to the
host, writing shards) and once under torch.profiler (operators and kernels, host and device time). Writes into DIR:
``summary.json`` (tokens, seconds, tokens/s of each run), ``python_profile.txt`` (the 40 costliest functions by
cumulative time) and ``torch_profile.txt`` (the 30 costliest operators by host time, then by device time). A probe,
not part of the package; dry-run it on the CPU with ``--profile smoke``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch

from jakiro_lib.data.conversations import load_conversations
from jakiro_lib.data.features import cache_features, estimate_cache
from jakiro_lib.machine import synchronize
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="gpu")
    ap.add_argument("--conversations", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=None, help="conversations per forward (default: the profile's)")
    ap.add_argument("--tokenize-workers", type=int, default=None, help="default: the profile's (0: auto)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    profile = get_profile(args.profile)
    d = profile.data
    batch = args.batch_size or d.cache_batch_size
    args.out.mkdir(parents=True, exist_ok=True)
    target = load_target(profile.target)
    convs = load_conversations(d.source, path=d.path, limit=args.conversations)
    tokens = estimate_cache(target, convs, max_length=d.max_length, template=profile.target.template)["tokens"]

    workers = d.tokenize_workers if args.tokenize_workers is None else args.tokenize_workers

    def run(tokenize_workers: int = workers) -> float:
        with tempfile.TemporaryDirectory(dir=args.out, prefix=".features.") as tmp:
            synchronize(target.device)
            t0 = time.perf_counter()
            cache_features(target, convs, tmp, max_length=d.max_length, shard_size=d.shard_size,
                           feature_dtype=d.feature_dtype, template=profile.target.template, progress=False,
                           batch_size=batch, tokenize_workers=tokenize_workers)
            synchronize(target.device)
            return time.perf_counter() - t0

    seconds = {"warm-up": run()}
    seconds["timed"] = run()
    seconds["in-process"] = run(1)
    prof = cProfile.Profile()
    prof.enable()
    seconds["cProfile"] = run()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    (args.out / "python_profile.txt").write_text(text.getvalue())
    activities = [torch.profiler.ProfilerActivity.CPU]
    if target.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as tp:
        seconds["torch.profiler"] = run()
    table = tp.key_averages()
    report = table.table(sort_by="self_cpu_time_total", row_limit=30)
    if target.device.type == "cuda":
        report += "\n\n" + table.table(sort_by="self_cuda_time_total", row_limit=30)
    (args.out / "torch_profile.txt").write_text(report)
    summary = {"profile": args.profile, "device": str(target.device), "conversations": len(convs),
               "batch_size": batch, "tokenize_workers": workers, "tokens": tokens, "seconds": seconds,
               "tokens_per_s": {k: tokens / s for k, s in seconds.items()}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
