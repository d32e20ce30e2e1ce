"""What this record's scripts share: the package's kernel file with lines replaced, built and loaded under an op
namespace of its own (so that it sits beside the package's ops), and the default target's runner over a random
context with the `bushy_tree` rows of one and eight tokens."""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils import cpp_extension

from jakiro_lib.decoding.runner import TargetRunner
from jakiro_lib.measure.costmodel import bushy_tree
from jakiro_lib.models import kernels
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
