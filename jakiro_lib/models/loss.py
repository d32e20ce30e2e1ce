"""The draft's training loss (docs/DESIGN.md section 4) and its held-out evaluation: :func:`step_loss` is the
training step's forward (compiled on request), :func:`evaluate` the held-out accuracy per depth and expert.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ..config import DraftConfig, TrainConfig
from ..data.dataset import collate
from .draft import DraftModel, DraftOutput, Losses


def _core(draft: Any) -> DraftModel:
    """The DraftModel behind a DDP / accelerate wrapper."""
    while hasattr(draft, "module"):
        draft = draft.module
    return draft


UNROLL_DECAY = 0.8  # weight of unroll step j's loss: 0.8**j (the decay of EAGLE-3's released trainer; not tuned here)
EVAL_DEPTHS = 4  # held-out top-1 per depth: the draft run 1..4 steps on its own features
SHAPE_MULTIPLE = 128
"""Loss rows are padded (with zero weight) to a multiple of this, so that oneDNN's cache of one GEMM primitive per
shape stays small (docs/DESIGN.md section 4)."""
TIME_MULTIPLE = 16  # training batches are right-padded to a multiple of this many positions, for the same reason


def train_collate(batch: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """:func:`jakiro_lib.data.dataset.collate` with lengths rounded up to :data:`TIME_MULTIPLE` (training and
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
    ref_all = batch["target_top1"][:, 1:].flatten()[idx_a]
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
    ``DraftConfig.expert_loss``, is read from the draft itself); :mod:`jakiro_lib.training.throughput` times the same."""
    return dict(noise_amplitude=train_cfg.noise_amplitude, p_weight=train_cfg.p_weight,
                branch_b_weight=train_cfg.branch_b_weight,
                unroll_steps=draft_cfg.unroll_steps or train_cfg.unroll_steps, sync=False)


# what a failed compile of step_loss says (compiling.run_compiling's what and remedy), in train and throughput alike
COMPILED_STEP = {"what": "torch.compile of the training step", "remedy": "run it eagerly with --set train.compile=no"}


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
    """Loss of one collated batch (:func:`train_collate`) and its metrics, as docs/DESIGN.md section 4 defines them
    (noise ``noise_amplitude * 512 / L`` in training mode; unrolled step j weighted ``UNROLL_DECAY**j``); a token
    outside the draft vocabulary is a miss. ``depths`` d: the top-1 per depth of d draft steps. Metrics of step 0: loss,
    loss_a, vloss_a, ploss_a, acc_a, count_a, correct_a (and _b, _x), correct_e{i} / count_e{i}; correct_a@d / count_a@d
    for d >= 2, loss@d per unrolled step. ``sync=False``: 0-dim device tensors."""
    core = _core(draft)
    hidden = batch["hidden"]
    if hidden.shape[1] < 2:
        raise ValueError("sequences need at least 2 tokens")
    mask = batch["loss_mask"].float()
    if "attention_mask" in batch:
        mask = mask * batch["attention_mask"].to(mask.dtype)
    feats, ids, pos = _draft_inputs(core, batch, noise_amplitude)
    n_steps = max(unroll_steps, depths)
    outs = draft(feats, ids, pos, steps=n_steps) if n_steps > 1 else [draft(feats, ids, pos)]
    tg = _targets(core, batch, mask)
    expert_on = core.cfg.expert_loss != "off"
    names: list[str] = []
    values: list[torch.Tensor] = []
    loss = hidden.new_zeros((), dtype=torch.float32)
    for j, out in enumerate(outs):
        parts = _step_losses(core, out, tg, j, p_weight, experts=expert_on or (j == 0 and not core.training))
        step = _step_total(core, out, parts, branch_b_weight)
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


def _draft_inputs(core: DraftModel, batch: dict[str, torch.Tensor], noise_amplitude: float
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The draft's inputs: features f_0..f_{T-2} [B, T-1, H] (noised in training mode), ids x_1..x_{T-1} and
    positions 0..T-2 [B, T-1]."""
    hidden = batch["hidden"]
    B, T, _ = hidden.shape
    feats = hidden[:, :-1].to(next(core.parameters()).dtype)
    if core.training and noise_amplitude > 0:
        lengths = batch.get("lengths")
        L = lengths.to(feats.device).float() if lengths is not None else torch.full((B,), float(T), device=feats.device)
        amp = (noise_amplitude * 512.0 / L.clamp_min(1.0)).to(feats.dtype).view(B, 1, 1)
        feats = feats + (torch.rand_like(feats) - 0.5) * amp
    pos = torch.arange(T - 1, device=hidden.device).unsqueeze(0).expand(B, -1)
    return feats, batch["input_ids"][:, 1:], pos


def _step_total(core: DraftModel, out: DraftOutput, parts: dict[str, Losses], branch_b_weight: float) -> torch.Tensor:
    """One unroll step's loss: branch A, branch B weighted, the per-expert loss (where the draft trains it)."""
    step = parts["a"]["loss"]
    if "b" in parts:
        step = step + branch_b_weight * parts["b"]["loss"]
    elif out.b is not None:  # keep branch B's parameters in the graph (DDP) with a zero contribution
        step = step + 0.0 * out.b.sum()
    if core.cfg.expert_loss != "off" and "x" in parts:
        step = step + core.cfg.expert_loss_weight * parts["x"]["loss"]
    return step


def _step0_metrics(parts: dict[str, Losses], names: list[str], values: list[torch.Tensor]) -> None:
    for br, d in parts.items():
        for key, v in d.items():
            names.append(f"{key}_{br}" if not key.startswith(("correct_e", "count_e")) else key)
            values.append(v)
        if "correct" in d:
            names.append(f"acc_{br}")
            values.append(d["correct"] / d["count"].clamp_min(1.0))


# Evaluation


def _batches(data: Any, batch_size: int) -> Iterable[dict[str, torch.Tensor]]:
    if isinstance(data, Dataset) or (hasattr(data, "__getitem__") and hasattr(data, "__len__")
                                     and not isinstance(data, (list, tuple))):
        return DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=train_collate)
    return data


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


Sums = dict[str, float]  # held-out counts and token-weighted loss sums, additive across data shards


@torch.no_grad()
def evaluate(draft: Any, data: Any, *, batch_size: int = 8, p_weight: float = 0.1,
             branch_b_weight: float = 0.5, max_batches: int | None = None, depths: int = EVAL_DEPTHS,
             combine: Callable[[Sums], Sums] | None = None) -> dict[str, Any]:
    """Held-out metrics (no noise): token-weighted ``acc_a``, ``acc_b`` (None without branch B), single-step
    ``loss`` and its parts, ``router_load`` (fraction of tokens per expert), ``acc_depth`` (branch-A top-1 of
    the draft run d = 1..``depths`` steps on its own features) and ``acc_experts`` (each expert's own top-1
    where selected; None for one expert). ``data``: a dataset or an iterable of collated batches.
    ``combine``: adds up the sums of processes that each evaluate a shard of the held-out set."""
    sums = eval_sums(draft, data, batch_size=batch_size, p_weight=p_weight, branch_b_weight=branch_b_weight,
                     max_batches=max_batches, depths=depths)
    return eval_metrics(combine(sums) if combine is not None else sums, depths=depths,
                        num_experts=_core(draft).cfg.num_experts)


@torch.no_grad()
def eval_sums(draft: Any, data: Any, *, batch_size: int = 8, p_weight: float = 0.1, branch_b_weight: float = 0.5,
              max_batches: int | None = None, depths: int = EVAL_DEPTHS) -> Sums:
    """:func:`evaluate`'s additive part: correct and counted tokens, token-weighted losses, batches, and the
    router's per-expert counts (``load_e<i>``, ``load_tokens``), over ``data``."""
    core = _core(draft)
    was_training, counting = core.training, core.mlp.count_load
    core.eval()
    core.mlp.count_load = True
    core.router_load(reset=True)
    device = next(core.parameters()).device
    sums: Sums = {"batches": 0.0}
    try:
        for batch in _batches(data, batch_size):
            if max_batches is not None and sums["batches"] >= max_batches:
                break
            _, m = draft_loss(core, _to(batch, device), noise_amplitude=0.0, p_weight=p_weight,
                              branch_b_weight=branch_b_weight, depths=depths)
            for k, v in m.items():
                weight = 1.0 if k.startswith(("correct", "count")) else m["count_b" if k.endswith("_b") else "count_a"]
                sums[k] = sums.get(k, 0.0) + v * weight
            sums["batches"] += 1
        mlp = core.mlp
        sums.update({f"load_e{i}": float(c) for i, c in enumerate(mlp.load.tolist())},
                    load_tokens=float(mlp.load_tokens))
        core.router_load(reset=True)
    finally:
        core.train(was_training)
        core.mlp.count_load = counting
    return sums


def eval_metrics(sums: Sums, *, depths: int = EVAL_DEPTHS, num_experts: int = 1) -> dict[str, Any]:
    """:func:`evaluate`'s metrics from (combined) :func:`eval_sums`."""
    na, nb = sums.get("count_a", 0.0), sums.get("count_b", 0.0)

    def per(key: str, count: float) -> float | None:
        return sums[key] / count if count and key in sums else None

    def ratio(correct: str, count: str) -> float | None:
        return sums[correct] / sums[count] if sums.get(count) else None

    res: dict[str, Any] = {"acc_a": per("correct_a", na), "acc_b": per("correct_b", nb), "loss": per("loss", na)}
    tokens = max(sums.get("load_tokens", 0.0), 1.0)
    res["router_load"] = [sums.get(f"load_e{i}", 0.0) / tokens for i in range(num_experts)]
    res.update(tokens_a=na, tokens_b=nb, batches=int(sums.get("batches", 0)))
    res.update({k: per(k, na) for k in ("loss_a", "vloss_a", "ploss_a", "loss_x", "vloss_x", "ploss_x")})
    res["acc_depth"] = [res["acc_a"]] + [ratio(f"correct_a@{d}", f"count_a@{d}") for d in range(2, depths + 1)]
    res["acc_experts"] = ([ratio(f"correct_e{i}", f"count_e{i}") for i in range(num_experts)]
                          if num_experts > 1 else None)
    res.update({k: per(k, nb) for k in ("loss_b", "vloss_b", "ploss_b")})
    return res
