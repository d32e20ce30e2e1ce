"""What this record's scripts share: the package's kernel file with lines replaced, built and loaded under an op
namespace of its own (so that it sits beside the package's ops), and the default target's runner over a random
context with the `bushy_tree` rows of one and eight tokens, and two side-by-side timings of kernel variants (the
attention op alone, and whole forwards with the variant swapped in)."""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils import cpp_extension

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.measure.paired import paired_rounds
from jakiro_lib.models import fast_paths, kernels
from jakiro_lib.models.target import load_target
from jakiro_lib.profiles import get_profile


def build(namespace: str, replacements: list[tuple[str, str]] = (), source: str | None = None) -> Any:
    """``source`` (the package's kernel file by default) with each (old, new) of ``replacements`` replaced (old must
    occur once), its ops defined under ``namespace``, built for this CPU as the package builds its own; the namespace's
    ops (``torch.ops.<namespace>``)."""
    text = Path(kernels.STREAM_SOURCE).read_text() if source is None else source
    for old, new in replacements:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    folder = Path(tempfile.mkdtemp())
    (folder / f"{namespace}.cpp").write_text(text.replace("jakiro_stream_gemm", namespace))
    cpp_extension.load(name=namespace, sources=[str(folder / f"{namespace}.cpp")], is_python_module=False,
                       build_directory=str(folder), extra_cflags=list(kernels.STREAM_FLAGS), extra_ldflags=["-fopenmp"])
    return getattr(torch.ops, namespace)


def arguments() -> argparse.Namespace:
    """--context (tokens of random context, 300), --rounds (40)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=40)
    return ap.parse_args()


def runner_over_context(context: int) -> tuple[Any, TargetRunner, dict[int, tuple[torch.Tensor, ...]]]:
    """The default profile's target, its runner (1024 positions) after the prefill of ``context`` random tokens
    (seed 0), and the bushy trees of 1 and 8 tokens (tokens, depths, ancestors)."""
    torch.set_grad_enabled(False)
    target = load_target(get_profile("default").target)
    assert kernels.stream_gemm_available()
    runner = TargetRunner(target.model, 1024)
    g = torch.Generator().manual_seed(0)
    runner.prefill(torch.randint(0, target.model.config.vocab_size, (context,), generator=g))
    return target, runner, {n: bushy_tree(n, torch.device("cpu")) for n in (1, 8)}


def op_seconds(ops: dict[str, Any], keys: int, rows: int, rounds: int = 15) -> dict[str, list[float]]:
    """The attention op of each of ``ops`` (the first the reference) on one layer's shapes (9 query heads, 3 KV heads,
    D 64, ``keys`` keys, ``rows`` rows under a random boolean mask past one row), outputs checked equal bit for bit,
    then warm side by side (measure.paired): seconds a call, the mean of 200, ``rounds`` rounds."""
    q, k, v = torch.randn(1, 9, rows, 64), torch.randn(1, 3, keys, 64), torch.randn(1, 3, keys, 64)
    mask = (torch.rand(1, 1, rows, keys) < 0.9) if rows > 1 else None
    ref = next(iter(ops.values())).attend(q, k, v, mask, 0.125)
    for name, op in ops.items():
        assert torch.equal(op.attend(q, k, v, mask, 0.125), ref), (name, keys, rows)

    def call(op: Any) -> float:
        t0 = time.perf_counter()
        for _ in range(200):
            op.attend(q, k, v, mask, 0.125)
        return (time.perf_counter() - t0) / 200
    return paired_rounds({name: (lambda item, op=op: call(op)) for name, op in ops.items()}, [None], repeats=rounds)


def forward_seconds(ops: dict[str, Any], runner: TargetRunner, trees: dict[int, tuple[torch.Tensor, ...]],
                    context: int, rows: int, rounds: int) -> dict[str, list[float]]:
    """T(rows) on ``runner`` at ``context`` with each of ``ops`` swapped in as the package's kernels (the lean forward
    looks its ops up by name), side by side (measure.paired), the hidden states checked equal bit for bit across
    them; the package's ops in place again after."""
    tokens, depths, anc = trees[rows]
    package, first = torch.ops.jakiro_stream_gemm, []

    def score(name: str) -> float:
        torch.ops.__dict__["jakiro_stream_gemm"] = ops[name]
        fast_paths._kernels.clear()
        t0 = time.perf_counter()
        _, hidden = runner.score(tokens, depths, anc if rows > 1 else None, context, greedy=True)
        seconds = time.perf_counter() - t0
        if not first:
            first.append(hidden.clone())
        assert torch.equal(hidden, first[0]), f"{name} changed T({rows})'s hidden states"
        return seconds
    try:
        return paired_rounds({name: (lambda item, name=name: score(name)) for name in ops}, [None], repeats=rounds)
    finally:
        torch.ops.__dict__["jakiro_stream_gemm"] = package
        fast_paths._kernels.clear()
