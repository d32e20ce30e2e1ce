"""Draft training (docs/DESIGN.md section 4; the losses: :mod:`jakiro_lib.models.loss`). One
``accelerate.Accelerator`` drives the loop, on one CPU/GPU or under ``accelerate launch``. Every epoch ends
with a held-out evaluation and an atomic checkpoint; a rerun resumes from the newest checkpoint, and a rerun
of a finished training returns its results.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

from ..data.batching import EpochSampler, LengthBucketSampler
from .checkpoints import (CHECKPOINTS, KEEP_CHECKPOINTS, STATE_FILE, list_checkpoints, readable_checkpoint, rng_state,
                          same_vocab, set_rng_state, warm_start)
from ..config import DraftConfig, TrainConfig
from ..layout import HISTORY, RESULTS
from ..data.dataset import build_draft_vocab, token_frequencies
from ..models.draft import CONFIG_FILE, WEIGHTS_FILE, DraftModel
from ..models.loss import COMPILED_STEP, evaluate, step_loss, train_collate, training_loss_options
from ..files import atomic_path, read_json, sweep_temps, write_json
from ..compiling import run_compiling
from ..machine import keep_freed_memory, run_metadata, seed_everything
from ..precision import compiles_step, favoured_dtype, resolve_precision


log = logging.getLogger(__name__)


class TrainError(RuntimeError):
    """Training cannot start or resume (incompatible checkpoint, empty data)."""


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
    """Conversations and tokens of the training and held-out data (none held out: 0 and 0)."""
    held = heldout_data if heldout_data is not None else []
    return {"train_conversations": len(train_data), "train_tokens": sum(train_data.lengths()),
            "heldout_conversations": len(held), "heldout_tokens": sum(held.lengths()) if held else 0}


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
    on_epoch_end: Callable[[dict[str, Any]], None] | None = None,
    init_from: str | Path | None = None,
) -> dict[str, Any]:
    """Train one draft head on feature datasets (:mod:`jakiro_lib.data.dataset`'s, or any with their ``lengths()``
    and ``token_arrays()``); returns the results dict (also ``out_dir/results.json``). With
    ``draft_cfg.draft_vocab_size`` set and no ``d2t``, the draft vocabulary is built from the training data;
    ``init_from``: a saved draft to start from. Writes ``checkpoints/epoch_{n}`` (the newest
    :data:`~jakiro_lib.training.checkpoints.KEEP_CHECKPOINTS`), ``history.json`` and ``draft/``;
    ``on_epoch_end(epoch_record)`` runs after each checkpoint."""
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
    fingerprint = _jsonable({"draft": draft_cfg.identity(), "train": same_math,
                             "data": stats, "target": getattr(target.config, "model", None)})
    done = read_json(out_dir / RESULTS)
    if done is not None and done.get("fingerprint") == fingerprint and (out_dir / "draft" / WEIGHTS_FILE).is_file():
        return done
    run = _Training(target, draft_cfg, train_cfg, train_data, heldout_data, out_dir, d2t=d2t, init_from=init_from)
    run.resume()
    run.epochs(progress=progress, log_every=log_every, on_epoch_end=on_epoch_end)
    return run.finish(stats, fingerprint)


def training_loader(dataset: Any, train_cfg: TrainConfig, bucketed: bool,
                    device: torch.device) -> tuple[Any, DataLoader]:
    """The epoch's sampler (shuffled batches, or shuffled length buckets where ``bucketed``) and the loader over it."""
    sampler: Any = EpochSampler(len(dataset), train_cfg.seed)
    batching: dict[str, Any] = dict(batch_size=train_cfg.batch_size, sampler=sampler)
    if bucketed:
        sampler = LengthBucketSampler(dataset.lengths(), train_cfg.batch_size, train_cfg.seed)
        batching = dict(batch_sampler=sampler)
    return sampler, DataLoader(dataset, **batching, collate_fn=train_collate, pin_memory=device.type == "cuda")


def _accelerator(target: Any, train_cfg: TrainConfig) -> tuple[Any, str]:
    """The ``Accelerator`` for this training and its mixed precision; the frozen target moved to its device."""
    from accelerate import Accelerator  # accelerate's import is slow and only training needs it
    from accelerate.state import AcceleratorState

    precision = resolve_precision(train_cfg.mixed_precision, favoured_dtype(target.device))  # "auto": bf16 on bf16 units
    if AcceleratorState._shared_state.get("_mixed_precision", precision) != precision:
        # accelerate keeps one precision per process and refuses another (a notebook training one draft in fp32,
        # then one in bf16); the distributed state (PartialState) is kept
        AcceleratorState._reset_state()
    accelerator = Accelerator(mixed_precision=precision, cpu=target.device.type == "cpu")
    if target.device.type == "cpu":
        keep_freed_memory()  # the [rows, vocabulary] logits are freshly page-faulted otherwise (DESIGN section 11)
    if target.device != accelerator.device:
        target.model.to(accelerator.device)
    target.model.requires_grad_(False)
    return accelerator, precision


def _sum_over_processes(sums: dict[str, float]) -> dict[str, float]:
    """Held-out sums added up over the processes (each evaluated a shard), in every process."""
    total: dict[str, float] = {}
    for part in gather_object([sums]):
        for k, v in part.items():
            total[k] = total.get(k, 0.0) + v
    return total


class _Training:
    """One draft's training, as named steps: build (draft, optimiser, loader, schedule), :meth:`resume` from
    the newest readable checkpoint, :meth:`epochs` (steps, held-out evaluation, a checkpoint per epoch),
    :meth:`finish` (the final draft and ``results.json``)."""

    def __init__(self, target: Any, draft_cfg: DraftConfig, train_cfg: TrainConfig, train_data: Any,
                 heldout_data: Any, out_dir: Path, *, d2t: torch.Tensor | None, init_from: str | Path | None) -> None:
        self.target, self.draft_cfg, self.cfg, self.out_dir = target, draft_cfg, train_cfg, out_dir
        self.heldout_data = heldout_data
        self.accelerator, self.precision = _accelerator(target, train_cfg)
        self.checkpoints = list_checkpoints(out_dir)
        if d2t is None and draft_cfg.draft_vocab_size is not None and not self.checkpoints:
            freqs = token_frequencies(train_data, target.model.config.vocab_size)
            d2t = build_draft_vocab(freqs, draft_cfg.draft_vocab_size, always=target.eos_token_ids)
        self.d2t = d2t
        seed_everything(train_cfg.seed)
        self.core = DraftModel.build(draft_cfg, target.model, d2t).float()
        if init_from is not None and not self.checkpoints:
            warm_start(self.core, Path(init_from))
        self.core.train()
        optimizer = torch.optim.AdamW(self.core.parameters(), lr=train_cfg.lr, betas=tuple(train_cfg.betas),
                                      weight_decay=train_cfg.weight_decay)
        self.sampler, loader = training_loader(train_data, train_cfg, train_cfg.bucket_by_length,
                                               self.accelerator.device)
        self.model, self.optimizer, self.loader = self.accelerator.prepare(self.core, optimizer, loader)
        self.steps_per_epoch = len(self.loader)
        self.total_steps = train_cfg.epochs * self.steps_per_epoch
        if train_cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, train_cfg.max_steps)
        warmup, total = train_cfg.warmup_steps, self.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_lambda(s, warmup, total))
        self.step_kw = training_loss_options(draft_cfg, train_cfg)
        self.eval_kw = dict(batch_size=train_cfg.batch_size, p_weight=train_cfg.p_weight,
                            branch_b_weight=train_cfg.branch_b_weight)
        self.compiled = compiles_step(train_cfg.compile, self.precision)
        self.history: dict[str, list] = {"steps": [], "epochs": []}
        self.global_step = self.epoch = self.batches_in_epoch = 0
        self.elapsed_before = self.train_time = 0.0
        self.tokens_seen: Any = 0  # a device tensor once counting: read at the end (no per-step host sync)
        self.last_eval: dict[str, Any] = {}
        self.t0 = time.perf_counter()

    def resume(self) -> None:
        """Continue from the newest readable checkpoint, refusing one made for another draft or data."""
        if self.accelerator.is_main_process:
            sweep_temps(self.out_dir / CHECKPOINTS)  # checkpoints whose writer was killed mid-write
        if not self.checkpoints:
            return
        ckpt, weights, state = readable_checkpoint(self.checkpoints)
        saved_cfg = (read_json(ckpt / "draft" / CONFIG_FILE) or {}).get("draft")
        if DraftConfig.stamped(saved_cfg or {}) != _jsonable(self.draft_cfg.identity()):
            raise TrainError(f"{ckpt} holds a draft with another architecture ({saved_cfg}); use another "
                             f"out_dir or delete {self.out_dir / CHECKPOINTS}")
        if self.d2t is not None and not same_vocab(weights, self.d2t):
            raise TrainError(f"{ckpt} was trained with another draft vocabulary (d2t); use another out_dir")
        self.core.load_state_dict(weights, strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        self.global_step, self.epoch, self.batches_in_epoch = state["step"], state["epoch"], state["batches_in_epoch"]
        self.history, self.elapsed_before = state["history"], state["elapsed_s"]
        if state.get("steps_per_epoch") not in (None, self.steps_per_epoch):
            raise TrainError(f"{ckpt} was made with {state['steps_per_epoch']} steps per epoch, now "
                             f"{self.steps_per_epoch}: the data or batch size changed; use another out_dir")

    def epochs(self, *, progress: bool, log_every: int,
               on_epoch_end: Callable[[dict[str, Any]], None] | None) -> None:
        """Train until the configured epochs (or ``train.max_steps``); after each (part of an) epoch, the
        held-out evaluation, an epoch record in the history and a checkpoint."""
        bar = None
        if progress and self.accelerator.is_main_process:
            bar = tqdm(total=self.total_steps, initial=self.global_step, desc="training draft", unit="step")
        loss_of = step_loss(self.model, self.step_kw, compile_batch=self.cfg.batch_size if self.compiled else None)
        self.t0, self.first_step = time.perf_counter(), self.global_step  # a compile fails in the first step
        self.model.train()
        try:
            while self.epoch < self.cfg.epochs and self.global_step < self.total_steps:
                t_epoch = time.perf_counter()
                metrics = self._epoch_steps(loss_of, bar, log_every)
                self.train_time += time.perf_counter() - t_epoch
                complete = self.batches_in_epoch >= self.steps_per_epoch
                self.last_eval = self.held_out()
                self.model.train()
                fraction = self.epoch + 1 if complete else self.epoch + self.batches_in_epoch / self.steps_per_epoch
                record = {"epoch": fraction, "step": self.global_step, "train": metrics, "heldout": self.last_eval,
                          "elapsed_s": self.elapsed_before + time.perf_counter() - self.t0}
                self.history["epochs"].append(record)
                if complete:
                    self.epoch, self.batches_in_epoch = self.epoch + 1, 0
                self.save_checkpoint(f"epoch_{self.epoch}" if complete else f"step_{self.global_step}")
                if on_epoch_end is not None:
                    on_epoch_end(record)
        finally:
            if bar is not None:
                bar.close()

    def _epoch_steps(self, loss_of: Callable, bar: Any, log_every: int) -> dict[str, float]:
        """One epoch's steps (the rest of it after a resume); returns the epoch's mean training metrics."""
        self.sampler.set_epoch(self.epoch)
        if hasattr(self.loader, "set_epoch"):  # accelerate's loader re-sets the sampler's epoch itself
            self.loader.set_epoch(self.epoch)
        skip = self.batches_in_epoch
        loader = self.accelerator.skip_first_batches(self.loader, skip) if skip else self.loader
        epoch_metrics, window = _Running(), _Running()
        for batch in loader:
            m = run_compiling(lambda: self._gradients(loss_of, batch), error=TrainError, **COMPILED_STEP,
                              compiling=self.compiled and self.global_step == self.first_step)
            self.accelerator.clip_grad_value_(self.model.parameters(), self.cfg.grad_clip_value)
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_step += 1
            self.batches_in_epoch += 1
            self.tokens_seen = self.tokens_seen + batch["lengths"].sum()
            m["lr"] = self.scheduler.get_last_lr()[0]
            window.add(m)
            epoch_metrics.add(m)
            if self.global_step % log_every == 0 or self.global_step == self.total_steps:
                logged = window.mean()  # the only host sync of these steps
                self.history["steps"].append({"step": self.global_step, "epoch": self.epoch, **logged})
                window = _Running()
                if bar is not None:
                    bar.set_postfix(loss=f"{logged['loss']:.4f}", acc_a=f"{logged['acc_a']:.3f}", refresh=False)
            if bar is not None:
                bar.update(1)
            if self.global_step >= self.total_steps:
                break
        return epoch_metrics.mean()

    def _gradients(self, loss_of: Callable, batch: dict[str, torch.Tensor]) -> dict:
        """One batch's forward and backward, from no gradients (a retried first step too); returns its metrics.
        A compiled step compiles its forward, then its backward, at the first call of each."""
        self.optimizer.zero_grad(set_to_none=True)
        with self.accelerator.autocast():
            loss, m = loss_of(batch)
        self.accelerator.backward(loss)
        return m

    def held_out(self) -> dict[str, Any]:
        """The held-out metrics of the whole set; under several processes each evaluates every n-th item and
        their sums are added up (every process then holds the whole set's metrics)."""
        data = self.heldout_data
        if data is None or not len(data):
            return {}
        acc = self.accelerator
        if acc.num_processes == 1:
            return evaluate(self.core, data, **self.eval_kw)
        shard = Subset(data, range(acc.process_index, len(data), acc.num_processes))
        return {**evaluate(self.core, shard, combine=_sum_over_processes, **self.eval_kw),
                "processes": acc.num_processes}

    def tokens_trained(self) -> int:
        """Training tokens seen by every process together (each counts its own batches)."""
        seen = torch.as_tensor(self.tokens_seen, device=self.accelerator.device, dtype=torch.float64)
        return int(self.accelerator.reduce(seen, reduction="sum")) if self.accelerator.num_processes > 1 else int(seen)

    def save_checkpoint(self, name: str) -> None:
        """The draft and the optimiser, scheduler and RNG state, atomically; the oldest beyond
        :data:`~jakiro_lib.training.checkpoints.KEEP_CHECKPOINTS` removed; the history written."""
        if self.accelerator.is_main_process:
            with atomic_path(self.out_dir / CHECKPOINTS / name) as tmp:
                tmp.mkdir()
                self.core.save(tmp / "draft", target_name=getattr(self.target.config, "model", ""),
                               step=self.global_step)
                torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                            "rng": rng_state(), "step": self.global_step, "epoch": self.epoch,
                            "batches_in_epoch": self.batches_in_epoch, "steps_per_epoch": self.steps_per_epoch,
                            "history": self.history,
                            "elapsed_s": self.elapsed_before + time.perf_counter() - self.t0,
                            "eval": self.last_eval}, tmp / STATE_FILE)
                (tmp / "step.json").write_text(json.dumps({"step": self.global_step, "epoch": self.epoch}))
            for _, old in list_checkpoints(self.out_dir)[:-KEEP_CHECKPOINTS]:
                shutil.rmtree(old, ignore_errors=True)
            write_json(self.out_dir / HISTORY, self.history)
        self.accelerator.wait_for_everyone()

    def finish(self, stats: dict[str, Any], fingerprint: Any) -> dict[str, Any]:
        """The final draft (``draft/``), the history and ``results.json``; returns the results."""
        last_eval = self.last_eval or self.held_out()
        core, acc = self.core, self.accelerator
        tokens = self.tokens_trained()  # every process's, over the main process's training time
        results = {
            "acc_a": last_eval.get("acc_a"), "acc_b": last_eval.get("acc_b"), "heldout_loss": last_eval.get("loss"),
            "router_load": last_eval.get("router_load"), "heldout": last_eval,
            "steps": self.global_step, "epochs_completed": self.epoch,
            "wall_time_s": self.elapsed_before + time.perf_counter() - self.t0,
            "train_tokens": tokens, "train_tokens_per_s": tokens / self.train_time if self.train_time > 0 else None,
            "n_params": core.n_params(), "unroll_steps": self.step_kw["unroll_steps"],
            "intermediate_size": core.mlp.experts[0].width,  # each expert's MLP width, as built
            "acc_depth": last_eval.get("acc_depth"), "acc_experts": last_eval.get("acc_experts"),
            "draft_config": dataclasses.asdict(self.draft_cfg), "train_config": dataclasses.asdict(self.cfg),
            "data": stats, "fingerprint": fingerprint,
            "run_metadata": run_metadata(acc.device, num_processes=acc.num_processes,
                                         mixed_precision=self.precision, compiled_step=self.compiled),
        }
        if acc.is_main_process:
            core.eval()
            core.save(self.out_dir / "draft", target_name=getattr(self.target.config, "model", ""),
                      train_config=dataclasses.asdict(self.cfg), data=stats,
                      heldout={"acc_a": results["acc_a"], "acc_b": results["acc_b"]}, steps=self.global_step)
            write_json(self.out_dir / HISTORY, self.history)
            write_json(self.out_dir / RESULTS, results)
        acc.wait_for_everyone()
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
