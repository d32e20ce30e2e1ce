"""What the compiled decoding paths share: cache lengths, inductor settings, per-model state. HF's ``generate`` with a
static cache compiles (``hf_compiled``), and the engine's whole cycle as ``target.capture`` says: "graphs"
(:class:`CapturedStep`) or "inductor" (``torch.compile``; "draft" compiles only the draft's tree, in
:mod:`~jakiro_lib.decoding.static_tree`; docs/DESIGN.md section 12)."""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from transformers import PreTrainedModel, StaticCache

from ..compiling import RECOMPILE_LIMIT, CompileError, run_compiling
from ..models.target import kept, scratch
from .runner import MAX_TREE_ROOM

def compiled_cache_len(max_context: int) -> int:
    """Positions of a compiled path's KV cache: the whole context and a tree's room past it, rounded up to 256
    (one length per context: a compiled step binds to its cache's shape, so a warm-up compiles for every prompt)."""
    return -(-(max_context + MAX_TREE_ROOM) // 256) * 256


def graphs_compiled() -> int:
    """Graphs compiled or recorded in this process so far: ``torch.compile``'s (dynamo's count) and
    :class:`CapturedStep`'s CUDA graphs (one per step and attention window)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) + CapturedStep.recorded


def inductor_settings(device: torch.device) -> contextlib.AbstractContextManager:
    """Inductor settings while the target compiles: on CPU ``freezing`` (weights become constants inductor packs;
    a frozen graph binds to its KV buffers, hence :func:`static_cache` and the engine's shared runners)."""
    if device.type == "cuda":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config  # heavy (loads inductor): only when compiling

    return inductor_config.patch(freezing=True)


def call_compiled(step: Callable[..., Any], *args: Any, device: torch.device, first: bool) -> Any:
    """``step(*args)``, the ``first`` call (the one that compiles) under :func:`inductor_settings` with room for
    :data:`RECOMPILE_LIMIT` compilations (patched settings cost every call: DESIGN section 12); a failed compilation
    (the ``first`` call of an inductor step, or a later graph's) is repaired and retried or raised as one
    :class:`CompileError` (:func:`~jakiro_lib.compiling.run_compiling`; a :class:`CapturedStep` sweeps nothing)."""
    def call() -> Any:
        if not first:
            return step(*args)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), inductor_settings(device):
            return step(*args)
    inductor = not isinstance(step, CapturedStep)
    return run_compiling(call, compiling=first and inductor, what="torch.compile" if inductor else "the captured step",
                         remedy="run the method without compile", error=CompileError)


Capture = Callable[[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]], Callable[[], torch.Tensor]]


def cuda_graph(step: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...]) -> Callable[[], torch.Tensor]:
    """``step(*args)`` recorded as one CUDA graph (nothing runs while it records); the replay runs it over
    ``args``' current values and returns the recorded output tensor, overwritten by the next replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(*args)

    def replay() -> torch.Tensor:
        graph.replay()
        return out
    return replay


class CapturedStep:
    """``step`` replayed as one CUDA graph of its eager kernels, warmed up by its first call and recorded by its second
    (docs/DESIGN.md section 12, "Capture"). The step keeps its shapes, reads what changes only from its arguments or
    buffers updated in place, and never the host; a failed recording is one :class:`CompileError`. ``capture``: how to
    record (:func:`cuda_graph`, or the CPU tests' checking stand-in). A replay's output lives until the next."""

    recorded = 0  # steps recorded in this process (graphs_compiled)

    def __init__(self, step: Callable[..., torch.Tensor], capture: Capture = cuda_graph) -> None:
        self.step, self.capture = step, capture
        self.calls = 0
        self.args: tuple[torch.Tensor, ...] = ()
        self.replay: Callable[[], torch.Tensor] | None = None

    def __call__(self, *args: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 1:
            return _warm_up(self.step, args)
        if self.replay is None:
            self.args = tuple(a.clone() for a in args)
            try:
                self.replay = self.capture(self.step, self.args)
            except Exception as e:
                raise CompileError(f"recording the step as a CUDA graph failed ({type(e).__name__}: "
                                   f"{str(e).splitlines()[0] if str(e) else ''}); set target.capture=inductor") from e
            CapturedStep.recorded += 1
        else:
            for mine, new in zip(self.args, args, strict=True):
                mine.copy_(new)
        return self.replay()


def _warm_up(step: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...]) -> torch.Tensor:
    if not (args and args[0].is_cuda):
        return step(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = step(*args)
    torch.cuda.current_stream().wait_stream(side)
    return out


def static_cache(model: PreTrainedModel, cache_len: int) -> StaticCache:
    """HF's static KV cache of ``cache_len`` positions for ``hf_compiled``, one per model and length (a compiled
    step binds to its cache's buffers)."""
    return kept(model, "static_caches", cache_len, lambda: StaticCache(config=model.config, max_cache_len=cache_len))


def compiled_step(model: PreTrainedModel, step: Callable[..., torch.Tensor],
                  capture: Capture | None) -> Callable[..., torch.Tensor]:
    """``step`` compiled for ``model``'s device: recorded by ``capture`` as a CUDA graph of its eager kernels
    (:class:`CapturedStep`), else by inductor (on CUDA with its own CUDA graphs, ``reduce-overhead``)."""
    if capture is not None:
        return CapturedStep(step, capture)
    mode = "reduce-overhead" if model.device.type == "cuda" else "default"
    return torch.compile(step, mode=mode, fullgraph=True, dynamic=False)


def engine_cycles(model: PreTrainedModel) -> dict[int, int]:
    """Compiled cycles run so far by each engine kept on ``model`` (by id): what :func:`prepare_windows` compares."""
    return {id(e): e.compiled_cycles for e in scratch(model).get("engines", {}).values()}


@torch.inference_mode()  # as static_generate: the buffers are inference tensors
def prepare_windows(model: PreTrainedModel, length: int, before: dict[int, int] | None = None) -> None:
    """:meth:`~jakiro_lib.decoding.static.StaticEngine.prepare` for every compiled engine kept on ``model`` that has
    run since ``before`` (:func:`engine_cycles`; None: all), as a benchmark's warm-up ends, so that no timed prompt
    records a CUDA graph."""
    for engine in scratch(model).get("engines", {}).values():
        if before is None or before.get(id(engine)) != engine.compiled_cycles:
            engine.prepare(length)
