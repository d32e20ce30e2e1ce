"""Draft training (docs/DESIGN.md section 4): EAGLE feature regression + soft cross-entropy, per branch.

At position t the draft sees the (noised) target feature f_t and the token x_{t+1}; branch A predicts
f_{t+1} (and through the frozen ``lm_head`` the target's next-token distribution), branch B predicts
f_{t+2}. One ``accelerate.Accelerator`` drives the loop, so the same code runs on one CPU/GPU or under
``accelerate launch`` on many GPUs. Every epoch ends with a held-out evaluation and an atomic checkpoint;
a rerun resumes from the newest checkpoint, and a rerun of a finished training returns its results.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from .batching import EpochSampler, LengthBucketSampler, dataset_lengths
from .checkpoints import (CHECKPOINTS, STATE_FILE, list_checkpoints, readable_checkpoint, rng_state, set_rng_state,
                          warm_start)
from .config import DraftConfig, TrainConfig
from .dataset import build_draft_vocab, collate, token_frequencies
from .draft import CONFIG_FILE, WEIGHTS_FILE, DraftModel, DraftOutput, Losses
from .utils import (atomic_path, compiles_step, favoured_dtype, keep_freed_memory, read_json, resolve_precision, run_metadata,
                    seed_everything, write_json)

RESULTS = "results.json"
HISTORY = "history.json"

log = logging.getLogger(__name__)


class TrainError(RuntimeError):
    """Training cannot start or resume (incompatible checkpoint, empty data)."""


# --------------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------------


def _core(draft: Any) -> DraftModel:
    """The DraftModel behind a DDP / accelerate wrapper."""
    while hasattr(draft, "module"):
        draft = draft.module
    return draft


@torch.no_grad()
def _full_top1(core: DraftModel, feats: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Target argmax over the FULL vocabulary of ``lm_head(feats)`` ([N, H] -> [N])."""
    w = core._shared[1].weight
    out = torch.empty(feats.shape[0], dtype=torch.long, device=feats.device)
    for s in range(0, feats.shape[0], chunk):
        out[s:s + chunk] = (feats[s:s + chunk].to(w.dtype) @ w.T).argmax(-1)
    return out


UNROLL_DECAY = 0.8  # weight of unroll step j's loss: 0.8**j (the decay of EAGLE-3's released trainer; not tuned here)
EVAL_DEPTHS = 4  # held-out top-1 per depth: the draft run 1..4 steps on its own features
SHAPE_MULTIPLE = 128
"""Loss rows are padded (with zero weight) to a multiple of this, so that a CPU's oneDNN sees a few GEMM shapes
instead of a new one every step: it caches a primitive per shape (up to 1024), and with a new row count each step
that cache grew by ~9 MB a step (14 GB of memory after 2,472 steps of the dense draft; 2026-11-25)."""
TIME_MULTIPLE = 16  # training batches are right-padded to a multiple of this many positions, for the same reason


def train_collate(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """:func:`jakiro_lib.dataset.collate` with lengths rounded up to :data:`TIME_MULTIPLE` (training and
    evaluation batches; padding never reaches a loss: the draft is causal and the mask zeroes it)."""
    return collate(batch, TIME_MULTIPLE)


@dataclasses.dataclass
class _Targets:
    """Targets of every masked position j >= 1, computed once: branch A at t uses j = t + 1, branch B at
    t uses j = t + 2, a subset of the same rows (the soft targets p are the costly part). Rows are padded
    to a multiple of :data:`SHAPE_MULTIPLE` with weight 0."""

    idx_a: torch.Tensor  # [N] flat index into the [B * (T-1)] positions of each row with a branch-A target
    w_a: torch.Tensor  # [N] loss-mask weights of those rows (0 on padding rows)
    t_pos: torch.Tensor  # [N] position t of each row
    t: torch.Tensor  # [N, H] f_{t+1}
    p: torch.Tensor  # [N, V'] softmax(lm_head(f_{t+1})) over the draft vocabulary
    ref: torch.Tensor  # [N] target argmax (full vocabulary)
    idx_b: torch.Tensor | None  # [N_b] flat index (as idx_a) of each row with a branch-B target
    w_b: torch.Tensor | None
    row_b: torch.Tensor | None  # [N_b] index into the branch-A rows of f_{t+2}
    t_pos_b: torch.Tensor | None


def _padded_rows(sel: torch.Tensor, *values: torch.Tensor) -> list[torch.Tensor]:
    """Flat indices of the true entries of ``sel`` and ``values`` at them, zero-padded to a multiple of
    :data:`SHAPE_MULTIPLE` (a padding row points at position 0 with weight 0)."""
    flat = sel.flatten().nonzero().squeeze(1)
    pad = -flat.numel() % SHAPE_MULTIPLE
    return [F.pad(flat, (0, pad))] + [F.pad(v.flatten()[flat], (0, pad)) for v in values]


@torch.no_grad()
def _targets(core: DraftModel, batch: dict[str, torch.Tensor], mask: torch.Tensor) -> _Targets:
    hidden = batch["hidden"]
    B, T, H = hidden.shape
    pos = torch.arange(T - 1, device=hidden.device).expand(B, -1)
    idx_a, w_a, t_pos = _padded_rows(mask[:, 1:] > 0, mask[:, 1:], pos)
    t_all = hidden[:, 1:].reshape(-1, H)[idx_a].float()
    p_all = core.train_logits(t_all).float().softmax(-1)
    top1 = batch.get("target_top1")
    ref_all = top1[:, 1:].flatten()[idx_a] if top1 is not None else _full_top1(core, t_all)
    idx_b = w_b = row_b = pos_b = None
    if T >= 3:
        row = (mask[:, 1:] > 0).flatten().cumsum(0) - 1  # [B * (T-1)] each selected position's row in idx_a
        grid = torch.arange(B * (T - 1), device=hidden.device).view(B, T - 1)
        _, idx_b, w_b, row_b, pos_b = _padded_rows(mask[:, 2:] > 0, grid[:, :T - 2], mask[:, 2:],
                                                   row.view(B, T - 1)[:, 1:], pos[:, :T - 2])
    return _Targets(idx_a, w_a, t_pos, t_all, p_all, ref_all, idx_b, w_b, row_b, pos_b)


def _rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of the [B, T-1, ...] tensor ``x`` flattened over its first two dimensions."""
    return x.flatten(0, 1)[idx]


def _step_losses(core: DraftModel, out: DraftOutput, tg: _Targets, j: int, p_weight: float,
                 experts: bool) -> dict[str, Losses]:
    """Branch A, branch B and (``experts``) per-expert losses of unroll step ``j`` (rows with t >= j)."""
    w_a = tg.w_a * (tg.t_pos >= j)
    parts = {"a": core.feature_loss(_rows(out.a, tg.idx_a), tg.t, tg.p, tg.ref, w_a, p_weight)}
    if out.b is not None and tg.idx_b is not None:
        rb, w_b = tg.row_b, tg.w_b * (tg.t_pos_b >= j)
        parts["b"] = core.feature_loss(_rows(out.b, tg.idx_b), tg.t[rb], tg.p[rb], tg.ref[rb], w_b, p_weight)
    if experts and out.experts is not None and out.experts.shape[-2] > 1:
        parts["x"] = core.expert_loss(_rows(out.experts, tg.idx_a), _rows(out.gates, tg.idx_a), tg.t, tg.p, tg.ref,
                                      w_a, p_weight)
    return parts


def training_loss_options(draft_cfg: DraftConfig, train_cfg: TrainConfig) -> dict[str, Any]:
    """The :func:`draft_loss` options a training step of ``draft_cfg`` uses (its per-expert loss,
    ``DraftConfig.expert_loss``, is read from the draft itself); :mod:`jakiro_lib.throughput` times the same."""
    return dict(noise_amplitude=train_cfg.noise_amplitude, p_weight=train_cfg.p_weight,
                branch_b_weight=train_cfg.branch_b_weight,
                unroll_steps=draft_cfg.unroll_steps or train_cfg.unroll_steps, sync=False)


def step_loss(draft: Any, options: dict[str, Any], *, compile_batch: int | None = None
              ) -> Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, dict]]:
    """``batch -> draft_loss(draft, batch, **options)``; batches of ``compile_batch`` conversations through
    :func:`torch.compile` (``TrainConfig.compile``; it keeps the ambient autocast), others (an epoch's short last
    batch) eagerly: dynamo would compile a batch of one apart, then dynamic batch sizes (slower kernels)."""
    def step(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        return draft_loss(draft, batch, **options)

    compiled = torch.compile(step) if compile_batch is not None else step
    return lambda batch: (compiled if batch["input_ids"].shape[0] == compile_batch else step)(batch)


def draft_loss(draft: Any, batch: dict[str, torch.Tensor], *, noise_amplitude: float = 0.2,
               p_weight: float = 0.1, branch_b_weight: float = 0.5, unroll_steps: int = 1,
               depths: int = 1, sync: bool = True) -> tuple[torch.Tensor, dict[str, Any]]:
    """Loss of one collated batch (see :func:`jakiro_lib.dataset.collate`) and its metrics.

    Inputs f_0..f_{L-2} (+ centred uniform noise of amplitude ``noise_amplitude * 512 / L`` per
    sequence, in training mode only), ids x_1..x_{L-1}, positions 0..L-2. Branch A: SmoothL1(o_t, f_{t+1})
    + ``p_weight`` * soft-CE(p_t, draft logits) with p_t = softmax(lm_head(f_{t+1})) over the draft
    vocabulary, masked by loss_mask[t+1]; branch B: the same against f_{t+2} (t+2 < L), masked by
    loss_mask[t+2], weight ``branch_b_weight``. With the draft's ``expert_loss`` on: each selected
    expert's own output too (:meth:`DraftModel.expert_loss`, weight ``expert_loss_weight``).
    Accuracies: draft argmax (mapped to target ids) equal to the target's full-vocabulary argmax (a
    target token outside the draft vocab is a miss).

    ``unroll_steps`` k > 1 (training-time test, :meth:`DraftModel.unroll`): the same losses at steps
    1..k-1 on the draft's own features (rows t >= j at step j), step j weighted ``UNROLL_DECAY**j``.
    ``depths`` d: also run the draft d steps (no loss beyond k) for the top-1 per depth.
    Metrics: loss, loss_a, vloss_a, ploss_a, acc_a, count_a, correct_a and the same for b (if present)
    and x (expert loss), correct_e{i} / count_e{i} per expert, all of step 0; correct_a@d / count_a@d
    for depth d >= 2 (step d-1), loss@d for the unrolled steps. ``sync=False``: 0-dim device tensors
    instead of floats (no host sync; the training loop reads them every log_every steps).
    """
    core = _core(draft)
    hidden = batch["hidden"]
    B, T, H = hidden.shape
    if T < 2:
        raise ValueError("sequences need at least 2 tokens")
    param_dtype = next(core.parameters()).dtype
    mask = batch["loss_mask"].float()
    if "attention_mask" in batch:
        mask = mask * batch["attention_mask"].to(mask.dtype)
    feats = hidden[:, :-1].to(param_dtype)
    if core.training and noise_amplitude > 0:
        lengths = batch.get("lengths")
        L = lengths.to(feats.device).float() if lengths is not None else torch.full((B,), float(T), device=feats.device)
        amp = (noise_amplitude * 512.0 / L.clamp_min(1.0)).to(param_dtype).view(B, 1, 1)
        feats = feats + (torch.rand_like(feats) - 0.5) * amp
    ids = batch["input_ids"][:, 1:]
    pos = torch.arange(T - 1, device=hidden.device).unsqueeze(0).expand(B, -1)
    n_steps = max(unroll_steps, depths)
    outs = draft(feats, ids, pos, steps=n_steps) if n_steps > 1 else [draft(feats, ids, pos)]
    tg = _targets(core, batch, mask)
    expert_on = core.cfg.expert_loss != "off"
    names: list[str] = []
    values: list[torch.Tensor] = []
    loss = hidden.new_zeros((), dtype=torch.float32)
    for j, out in enumerate(outs):
        parts = _step_losses(core, out, tg, j, p_weight, experts=expert_on or (j == 0 and not core.training))
        step = parts["a"]["loss"]
        if "b" in parts:
            step = step + branch_b_weight * parts["b"]["loss"]
        elif out.b is not None:  # keep branch B's parameters in the graph (DDP) with a zero contribution
            step = step + 0.0 * out.b.sum()
        if expert_on and "x" in parts:
            step = step + core.cfg.expert_loss_weight * parts["x"]["loss"]
        if j < unroll_steps:
            loss = loss + UNROLL_DECAY ** j * step
        if j == 0:
            _step0_metrics(parts, names, values)
        else:
            names += [f"correct_a@{j + 1}", f"count_a@{j + 1}"] + ([f"loss@{j + 1}"] if j < unroll_steps else [])
            values += [parts["a"]["correct"], parts["a"]["count"]] + ([step] if j < unroll_steps else [])
    names.insert(0, "loss")
    values.insert(0, loss)
    stacked = torch.stack([v.detach().float() for v in values])
    if not sync:
        return loss, dict(zip(names, stacked.unbind(0)))
    return loss, dict(zip(names, stacked.tolist()))  # one device sync


def _step0_metrics(parts: dict[str, Losses], names: list[str], values: list[torch.Tensor]) -> None:
    for br, d in parts.items():
        for key, v in d.items():
            names.append(f"{key}_{br}" if not key.startswith(("correct_e", "count_e")) else key)
            values.append(v)
        if "correct" in d:
            names.append(f"acc_{br}")
            values.append(d["correct"] / d["count"].clamp_min(1.0))


# --------------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------------


def _batches(data: Any, batch_size: int) -> Iterable[dict[str, torch.Tensor]]:
    if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__")
                                     and not isinstance(data, (list, tuple))):
        return DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=train_collate)
    return data


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


@torch.no_grad()
def evaluate(draft: Any, data: Any, *, batch_size: int = 8, p_weight: float = 0.1,
             branch_b_weight: float = 0.5, max_batches: int | None = None,
             depths: int = EVAL_DEPTHS) -> dict[str, Any]:
    """Held-out metrics: token-weighted ``acc_a``, ``acc_b`` (None without branch B), ``loss`` (single-step,
    whatever the training unrolled) and its parts, ``router_load`` (fraction of tokens routed to each
    expert), ``acc_depth`` (branch-A top-1 of the draft run d = 1..``depths`` steps on its own features:
    what a tree's depth d sees; ``acc_depth[0] == acc_a``) and ``acc_experts`` (each expert's own top-1
    where it is selected; None for one expert). ``data``: a dataset of items or an iterable of collated
    batches. No noise; the draft's train/eval mode is restored afterwards."""
    core = _core(draft)
    was_training = core.training
    core.eval()
    core.router_load(reset=True)
    device = next(core.parameters()).device
    sums: dict[str, float] = {}
    batches = 0
    try:
        for batch in _batches(data, batch_size):
            if max_batches is not None and batches >= max_batches:
                break
            _, m = draft_loss(core, _to(batch, device), noise_amplitude=0.0, p_weight=p_weight,
                              branch_b_weight=branch_b_weight, depths=depths)
            n = m["count_a"]
            for k, v in m.items():
                if k.startswith(("correct", "count")):
                    sums[k] = sums.get(k, 0.0) + v
                elif k.endswith("_b"):
                    sums[k] = sums.get(k, 0.0) + v * m["count_b"]
                else:
                    sums[k] = sums.get(k, 0.0) + v * n
            batches += 1
        load = core.router_load(reset=True)
    finally:
        core.train(was_training)
    na, nb = sums.get("count_a", 0.0), sums.get("count_b", 0.0)
    res: dict[str, Any] = {
        "acc_a": sums["correct_a"] / na if na else None,
        "acc_b": sums["correct_b"] / nb if nb else None,
        "loss": sums["loss"] / na if na else None,
        "router_load": load,
        "tokens_a": na, "tokens_b": nb, "batches": batches,
    }
    for k in ("loss_a", "vloss_a", "ploss_a"):
        res[k] = sums[k] / na if na else None
    for k in ("loss_x", "vloss_x", "ploss_x"):
        res[k] = sums[k] / na if na and k in sums else None

    def ratio(correct: str, count: str) -> float | None:
        return sums[correct] / sums[count] if sums.get(count) else None

    res["acc_depth"] = [res["acc_a"]] + [ratio(f"correct_a@{d}", f"count_a@{d}") for d in range(2, depths + 1)]
    n_experts = core.cfg.num_experts
    res["acc_experts"] = [ratio(f"correct_e{i}", f"count_e{i}") for i in range(n_experts)] if n_experts > 1 else None
    for k in ("loss_b", "vloss_b", "ploss_b"):
        res[k] = sums[k] / nb if nb and k in sums else None
    return res


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def train_identity(train_cfg: TrainConfig) -> dict[str, Any]:
    """The training settings as stamped; a fresh start (``init_from`` None) is left out, as in stamps older than it."""
    return {k: v for k, v in dataclasses.asdict(train_cfg).items() if k != "init_from" or v is not None}


def lr_lambda(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1 over ``warmup`` steps, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / (total - warmup))
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str))


def _data_stats(train_data: Any, heldout_data: Any) -> dict[str, Any]:
    def one(ds: Any) -> dict[str, Any]:
        if ds is None:
            return {"conversations": 0, "tokens": 0}
        lengths = ds.lengths() if hasattr(ds, "lengths") else None
        return {"conversations": len(ds), "tokens": None if lengths is None else int(sum(lengths))}

    tr, he = one(train_data), one(heldout_data)
    return {"train_conversations": tr["conversations"], "train_tokens": tr["tokens"],
            "heldout_conversations": he["conversations"], "heldout_tokens": he["tokens"]}


def train_draft(
    target: Any,
    draft_cfg: DraftConfig,
    train_data: Any,
    heldout_data: Any,
    out_dir: str | Path,
    train_cfg: TrainConfig,
    *,
    d2t: torch.Tensor | None = None,
    progress: bool = True,
    log_every: int = 10,
    eval_batch_size: int | None = None,
    keep_checkpoints: int = 2,
    num_workers: int = 0,
    on_epoch_end: Callable[[dict[str, Any]], None] | None = None,
    init_from: str | Path | None = None,
) -> dict[str, Any]:
    """Train one draft head; returns the results dict (also written to ``out_dir/results.json``).

    ``train_data`` / ``heldout_data``: datasets of per-conversation items (:class:`FeatureDataset` or
    :class:`OnlineFeatureDataset`). With ``draft_cfg.draft_vocab_size`` set and no ``d2t``, the draft
    vocabulary is built from the training data (most frequent assistant tokens, EOS ids forced in). ``init_from``: a
    saved draft whose weights a fresh training starts from. Output: ``checkpoints/epoch_{n}`` (draft + optimizer/
    scheduler/RNG state; the newest ``keep_checkpoints`` kept), ``history.json``, ``draft/`` (final,
    :meth:`DraftModel.save`) and ``results.json``. ``on_epoch_end(epoch_record)`` runs after each epoch's checkpoint.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    out_dir = Path(out_dir)
    if len(train_data) == 0:
        raise TrainError("no training data")
    if train_cfg.unroll_steps < 1:
        raise TrainError(f"train.unroll_steps must be >= 1, got {train_cfg.unroll_steps}")
    if d2t is not None:
        d2t = torch.as_tensor(d2t, dtype=torch.long).cpu()
        draft_cfg = dataclasses.replace(draft_cfg, draft_vocab_size=int(d2t.numel()))
    stats = _data_stats(train_data, heldout_data)
    same_math = {k: v for k, v in train_identity(train_cfg).items() if k != "compile"}  # compiled or not
    fingerprint = _jsonable({"draft": dataclasses.asdict(draft_cfg), "train": same_math,
                             "data": stats, "target": getattr(target.config, "model", None)})

    done = read_json(out_dir / RESULTS)
    if done is not None and done.get("fingerprint") == fingerprint and (out_dir / "draft" / WEIGHTS_FILE).is_file():
        return done

    precision = resolve_precision(train_cfg.mixed_precision, favoured_dtype(target.device))  # "auto": bf16 on bf16 units
    if AcceleratorState._shared_state.get("_mixed_precision", precision) != precision:
        # accelerate keeps one precision per process and refuses another (a notebook training one draft in fp32,
        # then one in bf16); the distributed state (PartialState) is kept
        AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision=precision, cpu=target.device.type == "cpu")
    if target.device.type == "cpu":
        keep_freed_memory()  # the [rows, vocabulary] logits are freshly page-faulted otherwise (1.37x)
    if target.device != accelerator.device:
        target.model.to(accelerator.device)
    target.model.requires_grad_(False)

    checkpoints = list_checkpoints(out_dir)
    if d2t is None and draft_cfg.draft_vocab_size is not None and not checkpoints:
        freqs = token_frequencies(train_data, target.model.config.vocab_size)
        d2t = build_draft_vocab(freqs, draft_cfg.draft_vocab_size, always=target.eos_token_ids)

    seed_everything(train_cfg.seed)
    core = DraftModel.build(draft_cfg, target.model, d2t).float()
    if init_from is not None and not checkpoints:
        warm_start(core, Path(init_from))
    core.train()
    optimizer = torch.optim.AdamW(core.parameters(), lr=train_cfg.lr, betas=tuple(train_cfg.betas),
                                  weight_decay=train_cfg.weight_decay)
    sampler = EpochSampler(len(train_data), train_cfg.seed)
    batching: dict[str, Any] = dict(batch_size=train_cfg.batch_size, sampler=sampler)
    if train_cfg.bucket_by_length:
        sampler = LengthBucketSampler(dataset_lengths(train_data), train_cfg.batch_size, train_cfg.seed)
        batching = dict(batch_sampler=sampler)
    loader = DataLoader(train_data, **batching, collate_fn=train_collate,
                        num_workers=num_workers, pin_memory=accelerator.device.type == "cuda")
    model, optimizer, loader = accelerator.prepare(core, optimizer, loader)
    steps_per_epoch = len(loader)
    total_steps = train_cfg.epochs * steps_per_epoch
    if train_cfg.max_steps is not None:
        total_steps = min(total_steps, train_cfg.max_steps)
    warmup = train_cfg.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, warmup, total_steps))

    history: dict[str, list] = {"steps": [], "epochs": []}
    global_step = epoch = batches_in_epoch = 0
    elapsed_before = 0.0
    if checkpoints:
        ckpt, weights, state = readable_checkpoint(checkpoints)
        saved_cfg = (read_json(ckpt / "draft" / CONFIG_FILE) or {}).get("draft")
        if saved_cfg != _jsonable(dataclasses.asdict(draft_cfg)):
            raise TrainError(f"{ckpt} holds a draft with another architecture ({saved_cfg}); use another "
                             f"out_dir or delete {out_dir / CHECKPOINTS}")
        if d2t is not None and ("d2t" not in weights or not torch.equal(weights["d2t"].cpu(), d2t)):
            raise TrainError(f"{ckpt} was trained with another draft vocabulary (d2t); use another out_dir")
        core.load_state_dict(weights, strict=True)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        global_step, epoch, batches_in_epoch = state["step"], state["epoch"], state["batches_in_epoch"]
        history = state["history"]
        elapsed_before = state["elapsed_s"]
        if state.get("steps_per_epoch") not in (None, steps_per_epoch):
            raise TrainError(f"{ckpt} was made with {state['steps_per_epoch']} steps per epoch, now "
                             f"{steps_per_epoch}: the data or batch size changed; use another out_dir")

    eval_bs = eval_batch_size or train_cfg.batch_size
    loss_kw = dict(p_weight=train_cfg.p_weight, branch_b_weight=train_cfg.branch_b_weight)
    step_kw = training_loss_options(draft_cfg, train_cfg)
    unroll = step_kw["unroll_steps"]
    compiled = compiles_step(train_cfg.compile, precision)
    loss_of, first_step = step_loss(model, step_kw, compile_batch=train_cfg.batch_size if compiled else None), global_step
    bar = None
    if progress and accelerator.is_main_process:
        from tqdm.auto import tqdm

        bar = tqdm(total=total_steps, initial=global_step, desc="training draft", unit="step")

    def save_checkpoint(name: str, last_eval: dict[str, Any]) -> None:
        if accelerator.is_main_process:
            ckpt_dir = out_dir / CHECKPOINTS / name
            with atomic_path(ckpt_dir) as tmp:
                tmp.mkdir()
                core.save(tmp / "draft", target_name=getattr(target.config, "model", ""), step=global_step)
                torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                            "rng": rng_state(), "step": global_step, "epoch": epoch,
                            "batches_in_epoch": batches_in_epoch, "steps_per_epoch": steps_per_epoch,
                            "history": history, "elapsed_s": elapsed_before + time.perf_counter() - t0,
                            "eval": last_eval}, tmp / STATE_FILE)
                (tmp / "step.json").write_text(json.dumps({"step": global_step, "epoch": epoch}))
            for _, old in list_checkpoints(out_dir)[:-keep_checkpoints] if keep_checkpoints > 0 else []:
                shutil.rmtree(old, ignore_errors=True)
            write_json(out_dir / HISTORY, history)
        accelerator.wait_for_everyone()

    def held_out() -> dict[str, Any]:
        none = heldout_data is None or not len(heldout_data)
        return {} if none else evaluate(core, heldout_data, batch_size=eval_bs, **loss_kw)

    t0 = time.perf_counter()
    tokens_seen: Any = 0  # a device tensor once counting: read at the end (no per-step host sync)
    train_time = 0.0
    last_eval: dict[str, Any] = {}
    window = _Running()
    model.train()
    try:
        while epoch < train_cfg.epochs and global_step < total_steps:
            sampler.set_epoch(epoch)
            if hasattr(loader, "set_epoch"):  # accelerate's loader re-sets the sampler's epoch itself
                loader.set_epoch(epoch)
            epoch_loader = accelerator.skip_first_batches(loader, batches_in_epoch) if batches_in_epoch else loader
            epoch_metrics = _Running()
            t_epoch = time.perf_counter()
            for batch in epoch_loader:
                try:
                    with accelerator.autocast():
                        loss, m = loss_of(batch)
                except Exception as e:
                    if not compiled or global_step > first_step:
                        raise
                    raise TrainError(f"torch.compile of the training step failed ({type(e).__name__}; it needs a C++ "
                                     "compiler on a CPU, triton on a GPU): --set train.compile=no") from e
                accelerator.backward(loss)
                accelerator.clip_grad_value_(model.parameters(), train_cfg.grad_clip_value)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                global_step += 1
                batches_in_epoch += 1
                tokens_seen = tokens_seen + batch["lengths"].sum()
                m["lr"] = scheduler.get_last_lr()[0]
                window.add(m)
                epoch_metrics.add(m)
                if global_step % log_every == 0 or global_step == total_steps:
                    logged = window.mean()  # the only host sync of these steps
                    history["steps"].append({"step": global_step, "epoch": epoch, **logged})
                    window = _Running()
                    if bar is not None:
                        bar.set_postfix(loss=f"{logged['loss']:.4f}", acc_a=f"{logged['acc_a']:.3f}", refresh=False)
                if bar is not None:
                    bar.update(1)
                if global_step >= total_steps:
                    break
            train_time += time.perf_counter() - t_epoch
            complete = batches_in_epoch >= steps_per_epoch
            last_eval = held_out()
            model.train()
            record = {"epoch": epoch + 1 if complete else epoch + batches_in_epoch / steps_per_epoch,
                      "step": global_step, "train": epoch_metrics.mean(), "heldout": last_eval,
                      "elapsed_s": elapsed_before + time.perf_counter() - t0}
            history["epochs"].append(record)
            if complete:
                epoch, batches_in_epoch = epoch + 1, 0
            save_checkpoint(f"epoch_{epoch}" if complete else f"step_{global_step}", last_eval)
            if on_epoch_end is not None:
                on_epoch_end(record)
    finally:
        if bar is not None:
            bar.close()

    last_eval = last_eval or held_out()
    wall = elapsed_before + time.perf_counter() - t0
    results = {
        "acc_a": last_eval.get("acc_a"), "acc_b": last_eval.get("acc_b"), "heldout_loss": last_eval.get("loss"),
        "router_load": last_eval.get("router_load"), "heldout": last_eval,
        "steps": global_step, "epochs_completed": epoch, "wall_time_s": wall,
        "train_tokens_per_s": int(tokens_seen) / train_time if train_time > 0 else None,
        "n_params": core.n_params(), "unroll_steps": unroll,
        "intermediate_size": core.mlp.experts[0].up_proj.out_features,  # each expert's MLP width, as built
        "acc_depth": last_eval.get("acc_depth"), "acc_experts": last_eval.get("acc_experts"),
        "draft_config": dataclasses.asdict(draft_cfg), "train_config": dataclasses.asdict(train_cfg),
        "data": stats, "fingerprint": fingerprint,
        "run_metadata": run_metadata(accelerator.device, num_processes=accelerator.num_processes,
                                     mixed_precision=precision, compiled_step=compiled),
    }
    if accelerator.is_main_process:
        core.eval()
        core.save(out_dir / "draft", target_name=getattr(target.config, "model", ""),
                  train_config=dataclasses.asdict(train_cfg), data=stats,
                  heldout={"acc_a": results["acc_a"], "acc_b": results["acc_b"]}, steps=global_step)
        write_json(out_dir / HISTORY, history)
        write_json(out_dir / RESULTS, results)
    accelerator.wait_for_everyone()
    return _jsonable(results)


class _Running:
    """Per-step metrics summed where they live (0-dim device tensors, or floats): :meth:`mean` reads them
    with one host sync, so the training loop syncs every ``log_every`` steps instead of every step."""

    def __init__(self) -> None:
        self.sums: dict[str, Any] = {}
        self.counts: dict[str, int] = {}

    def add(self, metrics: dict[str, Any]) -> None:
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
            self.counts[k] = self.counts.get(k, 0) + 1

    def mean(self) -> dict[str, float]:
        keys = sorted(self.sums)
        tensors = [k for k in keys if torch.is_tensor(self.sums[k])]
        read = dict(zip(tensors, torch.stack([self.sums[k].float() for k in tensors]).tolist())) if tensors else {}
        return {k: read.get(k, self.sums[k]) / self.counts[k] for k in keys}
