"""What this record's scripts share: the engine a 64-token generation of the first MT-bench prompt leaves (the cycle
record's ``after_generation``) for method ``name`` of the main5000 drafts, ready to draft its next tree again and again
(the drafter's ``propose``), the kernel file at a commit built beside the package's (the attention record's
``kernel_build``), and trees drafted side by side with each of several kernels."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent / "2026-12-02-cycle-after-sampling-cpu-zen5"))
sys.path.insert(0, str(HERE.parent / "2026-12-02-attention-cold-cpu-zen5"))
from after_generation import engine_after, load  # noqa: E402
from kernel_build import build  # noqa: E402

from jakiro_lib.measure.cycles import cycle_prompts  # noqa: E402
from jakiro_lib.measure.paired import paired_rounds  # noqa: E402
from jakiro_lib.models import fast_paths, kernels  # noqa: E402

SETS = {"data.num_conversations": 5000, "train.epochs": 4}


def drafter_after_generation(name: str) -> tuple[Any, Any, Any, int]:
    """Method ``name``'s target, engine and drafter after a 64-token generation, and the base its next tree drafts
    from (call under inference mode)."""
    profile, target, spec, draft = load(Path("runs/main5000"), SETS, name)
    engine, base = engine_after(target, draft, spec, cycle_prompts(profile, target, 1)[0])
    engine._set_window(base)
    return target, engine, engine.drafter, base


def kernel_at(commit: str, namespace: str) -> Any:
    """The package's kernel file at ``commit``, built under ``namespace`` (its ops)."""
    source = subprocess.run(["git", "show", f"{commit}:jakiro_lib/models/stream_gemm.cpp"], capture_output=True,
                            text=True, check=True).stdout
    return build(namespace, source=source)


def side_by_side(commit: str, label: str = "package") -> dict[str, Any]:
    """The kernel file at ``commit`` built beside the package's loaded one: {"base": its ops, ``label``: the package's},
    autograd off."""
    torch.set_grad_enabled(False)
    ops = {"base": kernel_at(commit, "base_gemm")}
    assert kernels.stream_gemm_available()
    ops[label] = torch.ops.jakiro_stream_gemm
    return ops


def trees_side_by_side(drafter: Any, base: int, ops: dict[str, Any], cold: bool, rounds: int) -> dict[str, list[float]]:
    """Seconds of one tree (``drafter.propose(base)``) with each of ``ops`` (op namespaces) swapped in as the package's
    kernels, side by side (measure.paired, ``rounds`` rounds): warm, 20 trees a timing, or ``cold``, one tree after a
    256 MB write; every way's tree checked equal to the first's; the package's ops in place again after. Call under
    inference mode."""
    package, big, first = torch.ops.jakiro_stream_gemm, torch.empty(64 * 2**20), []

    def tree(way: str) -> float:
        torch.ops.__dict__["jakiro_stream_gemm"] = ops[way]
        fast_paths._kernels.clear()
        n = 1 if cold else 20
        if cold:
            big.add_(1.0)
        t0 = time.perf_counter()
        for _ in range(n):
            out = drafter.propose(base)
        seconds = (time.perf_counter() - t0) / n
        flat = [x.clone() for x in out if isinstance(x, torch.Tensor)]
        if not first:
            first.append(flat)
        assert all(torch.equal(a, b) for a, b in zip(flat, first[0])), way
        return seconds
    try:
        return paired_rounds({way: (lambda _, way=way: tree(way)) for way in ops}, [None], repeats=rounds)
    finally:
        torch.ops.__dict__["jakiro_stream_gemm"] = package
        fast_paths._kernels.clear()
