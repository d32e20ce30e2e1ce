"""The packed GEMM for the frozen target and the drafts, used by every method alike (docs/DESIGN.md sections 9 and 12);
none changes the math beyond rounding (tested): :class:`PackedGemm` (the streaming GEMM's panels, MKL's packed or
oneDNN's blocked weights, as MKL's plain sgemm slows from 4 rows on; chosen by :func:`probe_gemm`)."""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import statistics
import time
import types
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

_ATTR = "_jakiro_packed_gemm"
STREAM_SOURCE = Path(__file__).with_name("stream_gemm.cpp")  # the streaming GEMM (DESIGN section 9)
STREAM_FLAGS = ("-O3", "-march=native", "-fopenmp")
log = logging.getLogger(__name__)


# Fewest rows worth the packed copy where nothing was probed (SmolLM2's shapes): MKL's packed sgemm gains
# nothing below 4 rows; a oneDNN-reordered weight and the streaming kernel win from one row.
MIN_ROWS = {torch.float32: 4, torch.bfloat16: 1}
BACKENDS = ("stream", "mkl", "onednn")  # fp32 packs through any; bf16 through oneDNN only
# the streaming GEMM over a copy rounded to bf16 (half the bytes, fp32 arithmetic): a draft's choice, never probed for
# the target (it changes the math; verification keeps the output exact whatever the draft computes)
HALF_WEIGHTS = "stream_bf16"
# the same over an int8 copy, each output column's weights scaled into [-127, 127] (a quarter of the bytes, fp32
# arithmetic, the column's scale applied to its sums): a draft's choice too
INT8_WEIGHTS = "stream_int8"
REDUCED_WEIGHTS = (HALF_WEIGHTS, INT8_WEIGHTS)
STREAM_BACKENDS = ("stream", *REDUCED_WEIGHTS)  # those through stream_gemm.cpp (its panels in fp32, bf16 or int8)
PROBE_ROWS = (1, 2, 4, 8, 16, 32)
PROBE_MARGIN = 0.97  # a packed copy serves a row count only where it beat the plain kernel by 3% or more
STREAM_ALLOWANCE = 1.05  # below its first win the streaming GEMM serves where it costs at most 5% more (_choose)
# Serving from one row, the streaming GEMM also runs a decoding step's layers in one call (fast_paths._fused_layers),
# which the linears' ratios do not see: another backend must beat its mean ratio by more than this share to be
# chosen. Measured (docs/results.md): the layers in one call took T(1) to 0.76-0.84x, and oneDNN's copies, probed
# within 1% of the streaming kernel's, decoded 1.42-1.46x slower without them
STREAM_STEP_CREDIT = 0.25
# Where the streaming GEMM prefetches weights a step reads once (a target's fp32 panels and head screen; stream_gemm.cpp's
# streamed hint, process-wide): "nta" (prefetchnta, the default), which keeps them from evicting what the step and the
# draft read again, or "l2" (prefetcht1), which :func:`probe_stream_prefetch` chooses where it streams one row's and
# eight rows' linears in at most STREAM_L2_MARGIN of nta's time. The margin leaves the cache nta keeps: on a Zen 5 nta
# decoded 1.04-1.11x faster than the ordinary hint with T(n) alone unchanged; on a Zen 4, whose non-temporal prefetches
# streamed at about half the memory's rate, l2 took one row's linears to 0.75x and decoding to 1.15-1.23x faster
# (docs/results.md)
STREAM_HINTS = {"nta": 0, "l2": 2}
STREAM_L2_MARGIN = 0.87
STREAM_HINT_ROWS = (1, 8)


def _first(model: nn.Module | torch.Tensor) -> torch.Tensor:
    return model if isinstance(model, torch.Tensor) else next(model.parameters())


def packed_gemm_available(model: nn.Module | torch.Tensor, backend: str = "mkl") -> bool:
    """Packing needs CPU weights: fp32 with the streaming kernel built (``backend="stream"``), an MKL build of
    torch (``"mkl"``) or oneDNN (``"onednn"``), or bf16 with oneDNN (any name)."""
    p = _first(model)
    if p.device.type != "cpu":
        return False
    if p.dtype == torch.float32:
        if backend in STREAM_BACKENDS:
            return stream_gemm_available()
        return bool(torch._C.has_mkl) if backend == "mkl" else _onednn_packs(torch.float32)
    if p.dtype == torch.bfloat16:
        return _onednn_packs(torch.bfloat16)
    return False


def backend_for(weight: torch.Tensor, backend: str) -> str:
    """The backend that packs ``weight``: bf16 weights always go through oneDNN."""
    if backend not in (*BACKENDS, *REDUCED_WEIGHTS):
        raise ValueError(f"unknown GEMM backend {backend!r}: use {' or '.join((*BACKENDS, *REDUCED_WEIGHTS))}")
    return "onednn" if weight.dtype == torch.bfloat16 else backend


def min_rows_for(weight: torch.Tensor, backend: str) -> int:
    """The first row count a packed copy serves where nothing was probed (:data:`MIN_ROWS`)."""
    return 1 if backend_for(weight, backend) != "mkl" else MIN_ROWS[weight.dtype]


def stream_build_name() -> str:
    """One build per source, torch version and CPU: a build for one CPU's flags may not run on another's."""
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:  # not precision.cpu_flags: kernels stays the bottom layer
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    key = f"{platform.machine()} {platform.processor()} {flags} {torch.__version__}".encode() + STREAM_SOURCE.read_bytes()
    return f"jakiro_stream_gemm_{hashlib.sha1(key).hexdigest()[:12]}"


STREAM_LOADED = False  # stream_gemm_available()'s last answer: a plain value that a compiled graph reads


@lru_cache(maxsize=1)
def stream_gemm_available() -> bool:
    """Whether the streaming GEMM (``stream_gemm.cpp``: a few rows times a weight packed in panels of 16 output
    columns, the weight read once for all rows, a row's result independent of the rows beside it) is loaded here.
    Built for this CPU on first use (``-march=native``; half a minute, once per machine and torch version, in
    torch's extensions folder); False, with one warning, where it cannot be. ``JAKIRO_STREAM_GEMM=0`` leaves it out."""
    global STREAM_LOADED
    STREAM_LOADED = _load_stream_gemm()
    return STREAM_LOADED


def _load_stream_gemm() -> bool:
    """The build and load behind :func:`stream_gemm_available`."""
    if os.environ.get("JAKIRO_STREAM_GEMM", "1") == "0":
        return False
    try:
        from torch.utils import cpp_extension  # needs setuptools and a C++ compiler: optional

        name = stream_build_name()
        folder = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root(), name)
        if not (folder / f"{name}.so").exists():
            log.info("compiling the streaming GEMM for this CPU (once per machine: about half a minute)")
        folder.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[str(STREAM_SOURCE)], is_python_module=False, build_directory=str(folder),
                           extra_cflags=list(STREAM_FLAGS), extra_ldflags=["-fopenmp"])
    except Exception as exc:  # noqa: BLE001 - any failure to build or load means: not here
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("the streaming GEMM could not be built here (%s); packed weights use MKL or oneDNN", first[:200])
        return False
    return True


@lru_cache(maxsize=2)
def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN can reorder a weight of ``dtype`` on THIS CPU (bf16 needs AVX-512 or AVX-NE-CONVERT, not
    just a build with oneDNN); probed once on a tiny weight instead of guessed from flags."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
    except RuntimeError:
        return False
    return True


def pack_int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An int8 copy of an fp32 CPU weight [N, K] and each row's scale, for ``torch.ops.jakiro_stream_gemm.int8_linear``
    (x W^T to within the weights' rounding, and on the integer screen the activations', a quarter of the bytes): a
    draft's reduced head, whose precision is ours to choose. In the integer screen's layout where the kernel has one
    (AMX's tiles granted by the operating system, or AVX-512 VNNI), else in the streaming GEMM's panels (fp32
    arithmetic); None where the kernels are not built."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not stream_gemm_available():
        return None
    ops = torch.ops.jakiro_stream_gemm
    return ops.pack_int8(weight.detach(), ops.tile_screen())


def pack_weight(weight: torch.Tensor, max_rows: int, backend: str = "mkl") -> torch.Tensor:
    """A packed copy of a ``[out, in]`` weight for inputs of up to ``max_rows`` rows: the streaming kernel's
    panels (fp32, ``backend="stream"``, rounded to bf16 or int8 with :data:`REDUCED_WEIGHTS`; any row count), MKL's
    packed format (fp32, ``"mkl"``) or oneDNN's blocked layout (bf16, or fp32 with ``"onednn"``; any row count)."""
    kind = backend_for(weight, backend)
    if kind == INT8_WEIGHTS:  # [ceil(out / L) + the scales' panels, in, L]
        return torch.ops.jakiro_stream_gemm.pack_scaled(weight.detach())
    if kind in STREAM_BACKENDS:  # [ceil(out / L), in, L], zero-padded
        return torch.ops.jakiro_stream_gemm.pack(weight.detach(), kind == HALF_WEIGHTS)
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    return torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), max_rows)


def linear_maybe_packed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        packed: torch.Tensor | None, min_rows: int, max_rows: int,
                        backend: str = "mkl") -> torch.Tensor:
    """``F.linear``, through the packed copy (made by :func:`pack_weight` with the same ``backend``) where there is
    one and it :func:`_serves` ``x``."""
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if packed is None or not _serves(x, rows, min_rows, max_rows):
        return F.linear(x, weight, bias)
    return _through_packed(backend_for(weight, backend), x, rows, weight, bias, packed)


def _serves(x: torch.Tensor, rows: int, min_rows: int, max_rows: int) -> bool:
    """Whether a packed copy serves ``x`` of ``rows`` rows: the count in its range and no gradient needed (the packed
    ops have no backward)."""
    return min_rows <= rows <= max_rows and not (x.requires_grad and torch.is_grad_enabled())


def _through_packed(kind: str, x: torch.Tensor, rows: int, weight: torch.Tensor, bias: torch.Tensor | None,
                    packed: torch.Tensor) -> torch.Tensor:
    """``x`` [..., in] (``rows`` of them) times ``weight``'s copy packed for ``kind`` (a resolved backend)."""
    if kind == "onednn":  # compiled, the plain linear: inductor packs it where it freezes and lowers no packed input
        if torch.compiler.is_compiling():
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if kind == "mkl":
        return torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), packed, weight, bias, rows).view(
            *x.shape[:-1], weight.shape[0])
    y = torch.ops.jakiro_stream_gemm.linear(x, packed, weight.shape[0])  # [..., out]
    return y if bias is None else y + bias


def _packed_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """A packed linear's forward: :func:`linear_maybe_packed` with the backend resolved once and the parameters read
    from their dict, not through ``nn.Module.__getattr__`` (every linear of every forward runs it; DESIGN section 9)."""
    gemm, params = self._jakiro_gemm, self._parameters
    rows = x.numel() // self.in_features
    if gemm.active and _serves(x, rows, gemm.min_rows, gemm.max_rows):
        return _through_packed(gemm.backend, x, rows, params["weight"], params["bias"], self._jakiro_packed)
    return F.linear(x, params["weight"], params["bias"])


class PackedGemm:
    """One packed copy of every ``nn.Linear`` weight of a model (about the weights' memory once more), used for
    ``min_rows..max_rows`` rows; ``active = False`` routes everything to the plain kernel. ``probe``: the
    :class:`GemmProbe` that chose these settings, if any."""

    def __init__(self, model: nn.Module, *, max_rows: int = 64, min_rows: int | None = None,
                 backend: str = "mkl") -> None:
        if not packed_gemm_available(model, backend):
            raise ValueError(f"packed GEMM ({backend}) needs CPU weights: fp32 with the streaming kernel built, an "
                             "MKL build of torch or oneDNN, or bf16 with oneDNN")
        weight = _first(model)
        self.backend = backend_for(weight, backend)
        self.streams = self.backend in STREAM_BACKENDS  # panels of the package's streaming GEMM
        min_rows = min_rows_for(weight, backend) if min_rows is None else min_rows
        if not 1 <= min_rows <= max_rows:
            raise ValueError(f"PackedGemm needs 1 <= min_rows <= max_rows, got {min_rows}..{max_rows}")
        self.max_rows, self.min_rows = max_rows, min_rows
        self.active = True
        self.probe: GemmProbe | None = None
        self.linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        with torch.no_grad():
            for lin in self.linears:
                lin._jakiro_packed = pack_weight(lin.weight, max_rows, self.backend)
                lin._jakiro_gemm = self
                lin.forward = types.MethodType(_packed_linear_forward, lin)

    def remove(self) -> None:
        """Restore the plain ``nn.Linear.forward`` and free the packed copies."""
        for lin in self.linears:
            del lin._jakiro_packed, lin._jakiro_gemm, lin.forward
        self.linears = []


@dataclass
class GemmProbe:
    """What :func:`probe_gemm` measured: per backend and row count, the time of all the model's linears
    through the packed copy over the time through the plain kernel (median of rounds timed back to back),
    and the choice made from it (``backend`` None: no packed copy paid)."""
    backend: str | None
    min_rows: int
    ratios: dict[str, dict[int, float]] = field(default_factory=dict)
    # the streamed hint chosen where the streaming GEMM serves (probe_stream_prefetch), and l2's time over nta's by rows
    prefetch: str | None = None
    prefetch_ratios: dict[int, float] = field(default_factory=dict)


def _choose(ratios: dict[str, dict[int, float]]) -> tuple[str | None, int]:
    """Per backend, the first probed row count from which every larger probed count beat the plain kernel
    by :data:`PROBE_MARGIN` (the streaming GEMM also the counts below it where it costs at most
    :data:`STREAM_ALLOWANCE` of the plain kernel's time: one kernel for every row count gives a plain step's row and
    a tree's the same bits, and from one row a decoding step's layers run in one call, which saves far more than the
    linears' few percent); of those, the backend with the lowest mean time ratio over all probed counts (1 where it
    does not serve), the streaming GEMM's lowered by :data:`STREAM_STEP_CREDIT` where it serves from one row."""
    best: tuple[float, str | None, int] = (1.0, None, 0)
    for backend, by_rows in ratios.items():
        start = None
        for rows in sorted(by_rows, reverse=True):
            below = start is not None and backend == "stream"
            if by_rows[rows] > STREAM_ALLOWANCE if below else by_rows[rows] >= PROBE_MARGIN:
                break
            start = rows
        if start is None:
            continue
        score = statistics.fmean(r if rows >= start else 1.0 for rows, r in by_rows.items())
        if backend == "stream" and start == min(by_rows):  # and a decoding step's layers in one call
            score *= 1 - STREAM_STEP_CREDIT
        if score < best[0]:
            best = (score, backend, start)
    return best[1], best[2]


@torch.inference_mode()
def probe_gemm(model: nn.Module, *, max_rows: int = 64, rows: Sequence[int] = PROBE_ROWS,
               repeats: int = 3) -> GemmProbe:
    """Time every ``nn.Linear`` of ``model`` in order (as a forward streams them) at each probed row count,
    plain and through each available backend's packed copy, and choose (:func:`_choose`)."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    weight = _first(model)
    counts = [r for r in rows if r <= max_rows]
    backends = [b for b in dict.fromkeys(backend_for(weight, b) for b in BACKENDS)
                if packed_gemm_available(model, b)]
    inputs = {r: {lin.in_features: torch.randn(r, lin.in_features, dtype=weight.dtype) for lin in linears}
              for r in counts}
    ratios: dict[str, dict[int, float]] = {}
    for backend in backends:
        packed = [pack_weight(lin.weight, max_rows, backend) for lin in linears]

        def run(r: int, through: bool) -> float:
            t0 = time.perf_counter()
            for lin, p in zip(linears, packed):
                linear_maybe_packed(inputs[r][lin.in_features], lin.weight, lin.bias, p if through else None,
                                    1, max_rows, backend)
            return time.perf_counter() - t0

        times = {r: ([], []) for r in counts}
        for round_ in range(repeats + 1):  # the first round warms up
            for r in counts:
                plain, fast = run(r, False), run(r, True)
                if round_:
                    times[r][0].append(plain)
                    times[r][1].append(fast)
        ratios[backend] = {r: min(f) / min(p) for r, (p, f) in times.items()}  # noise only adds time
        del packed
    backend, start = _choose(ratios)
    return GemmProbe(backend, start, ratios)


def stream_prefetch(hint: str | None = None) -> str:
    """The streaming GEMM's hint for weights a step reads once (:data:`STREAM_HINTS`), set to ``hint`` where given;
    process-wide, as it is the machine's memory path that decides it. Needs the kernel built."""
    if hint is not None and hint not in STREAM_HINTS:
        raise ValueError(f"stream_prefetch takes one of {', '.join(STREAM_HINTS)}, got {hint!r}")
    code = torch.ops.jakiro_stream_gemm.stream_prefetch(-1 if hint is None else STREAM_HINTS[hint])
    return next(name for name, c in STREAM_HINTS.items() if c == code)


def _choose_prefetch(ratios: dict[int, float]) -> str:
    """"l2" where its time over nta's is at most :data:`STREAM_L2_MARGIN` at every probed row count, else "nta"."""
    return "l2" if ratios and max(ratios.values()) <= STREAM_L2_MARGIN else "nta"


@torch.inference_mode()
def probe_stream_prefetch(gemm: "PackedGemm", *, rows: Sequence[int] = STREAM_HINT_ROWS,
                          repeats: int = 3) -> tuple[str, dict[int, float]]:
    """Time every linear of ``gemm`` (streaming panels in fp32) in order at each of ``rows`` under each streamed hint,
    the hints interleaved round by round, and set the one :func:`_choose_prefetch` picks from the fastest rounds' ratios
    (noise only adds time); (the hint, l2's time over nta's by rows)."""
    linears = [lin for lin in gemm.linears if lin._jakiro_packed.dtype == torch.float32]
    inputs = {r: {lin.in_features: torch.randn(r, lin.in_features) for lin in linears} for r in rows}
    op = torch.ops.jakiro_stream_gemm.linear

    def run(r: int, hint: str) -> float:
        stream_prefetch(hint)
        t0 = time.perf_counter()
        for lin in linears:
            op(inputs[r][lin.in_features], lin._jakiro_packed, lin.out_features)
        return time.perf_counter() - t0

    times: dict[tuple[int, str], list[float]] = {(r, h): [] for r in rows for h in STREAM_HINTS}
    for round_ in range(repeats + 1):  # the first round warms up
        for r in rows:
            for h in (STREAM_HINTS if round_ % 2 else reversed(STREAM_HINTS)):
                seconds = run(r, h)
                if round_:
                    times[(r, h)].append(seconds)
    ratios = {r: min(times[(r, "l2")]) / min(times[(r, "nta")]) for r in rows} if linears else {}
    return stream_prefetch(_choose_prefetch(ratios)), ratios


def enable_packed_gemm(model: nn.Module, *, max_rows: int = 64, min_rows: int | None = None,
                       backend: str = "mkl") -> PackedGemm | None:
    """Attach a :class:`PackedGemm` to ``model`` (repacked if the settings changed); None where unavailable.
    ``backend="auto"``: :func:`probe_gemm` chooses (None when no packed copy paid; the probe is then kept as
    ``model._jakiro_gemm_probe``), and where it chose the streaming GEMM's fp32 panels :func:`probe_stream_prefetch`
    sets the streamed hint."""
    probe = None
    if backend == "auto":
        if not any(packed_gemm_available(model, b) for b in BACKENDS):
            return None
        probe = probe_gemm(model, max_rows=max_rows)
        if probe.backend is None:
            disable_packed_gemm(model)
            for module in (model, *(m for m in model.modules() if isinstance(m, nn.Linear))):
                module._jakiro_gemm_probe = probe  # read by follow() for modules that share these weights
            return None
        backend, min_rows = probe.backend, probe.min_rows
    if not packed_gemm_available(model, backend):
        return None
    weight = _first(model)
    wanted = (max_rows, min_rows_for(weight, backend) if min_rows is None else min_rows, backend_for(weight, backend))
    gemm = getattr(model, _ATTR, None)
    if gemm is not None and (gemm.max_rows, gemm.min_rows, gemm.backend) != wanted:
        disable_packed_gemm(model)
        gemm = None
    if gemm is None:
        gemm = PackedGemm(model, max_rows=max_rows, min_rows=min_rows, backend=backend)
        setattr(model, _ATTR, gemm)
    if probe is not None and gemm.backend == "stream":
        probe.prefetch, probe.prefetch_ratios = probe_stream_prefetch(gemm)
    gemm.probe = probe or gemm.probe
    return gemm


def follow(module: nn.Module, weight: torch.Tensor) -> tuple[str, int] | None:
    """(backend, min_rows) for packing ``weight`` of a module that runs beside ``module`` (a model, or one of
    its linears): the model's own choice, None where its probe found none paid or ``weight`` cannot be
    packed, else the defaults for ``weight``."""
    gemm = getattr(module, "_jakiro_gemm", None) or packed_gemm(module)
    if gemm is not None:
        choice = (gemm.backend, gemm.min_rows)
    elif getattr(module, "_jakiro_gemm_probe", None) is not None:
        return None
    else:
        choice = ("mkl", min_rows_for(weight, "mkl"))
    return choice if packed_gemm_available(weight, choice[0]) else None


def gemm_probe(model: nn.Module) -> GemmProbe | None:
    """The probe behind the model's packed GEMM choice (also when it chose none), if one ran."""
    gemm = packed_gemm(model)
    return gemm.probe if gemm is not None else getattr(model, "_jakiro_gemm_probe", None)


def disable_packed_gemm(model: nn.Module) -> None:
    gemm = getattr(model, _ATTR, None)
    if gemm is not None:
        gemm.remove()
        delattr(model, _ATTR)


def packed_gemm(model: nn.Module) -> PackedGemm | None:
    return getattr(model, _ATTR, None)


def gemm_choice(model: nn.Module) -> dict[str, Any] | None:
    """What a record says of the model's packed GEMM: the backend, the rows it serves and, for the streaming GEMM's
    fp32 panels, the streamed hint in force (None: plain kernels)."""
    gemm = packed_gemm(model)
    if gemm is None:
        return None
    return {"backend": gemm.backend, "min_rows": gemm.min_rows, "max_rows": gemm.max_rows,
            "prefetch": stream_prefetch() if gemm.backend == "stream" else None}
