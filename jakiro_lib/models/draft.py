"""The draft head: EAGLE feature draft whose MLP is a dense block (EAGLE-2) or Jakiro's MoE (docs/DESIGN.md sections
2-3), with its training losses and multi-step forward; its blocks are in :mod:`jakiro_lib.models.draft_blocks`."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from . import draft_step, fast_paths, kernels
from .draft_blocks import EXPERT_MLPS, DraftAttention, DraftOutput, KVCache, soft_cross_entropy, unroll_mask
from ..config import DraftConfig, TargetConfig
from ..layout import CONFIG_FILE, WEIGHTS_FILE
from ..files import atomic_path

HEAD_PACK_MAX_ROWS = 64  # a tree frontier's rows; the fewest worth packing: the target's choice (kernels.follow)
Losses = dict[str, torch.Tensor]


class DraftLoadError(RuntimeError):
    """A saved draft does not match what it is loaded for (missing files, other target, bad keys)."""


class MoEBlock(nn.Module):
    """E experts (SwiGLU, or GELU: ``DraftConfig.expert_mlp``) with a router split into branch A (top-k mixture)
    and branch B (CEPD)."""

    def __init__(self, hidden: int, cfg: DraftConfig, inter: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.experts = nn.ModuleList(EXPERT_MLPS[cfg.expert_mlp](hidden, inter) for _ in range(cfg.num_experts))
        n_router = cfg.num_experts * (2 if cfg.branch_b else 1)
        self.router = nn.Linear(hidden, n_router, bias=False) if cfg.num_experts > 1 or cfg.branch_b else None
        self.register_buffer("load", torch.zeros(cfg.num_experts), persistent=False)
        self.register_buffer("load_tokens", torch.zeros(()), persistent=False)
        # routed tokens counted (router_load) only while the held-out evaluation sets it: decoding never pays
        self.count_load = False

    def _topk_weights(self, logits: torch.Tensor, k: int) -> torch.Tensor:
        gates = logits.softmax(-1)
        if k >= gates.shape[-1]:
            return gates
        top = gates.topk(k, dim=-1)
        weights = torch.zeros_like(gates).scatter(-1, top.indices, top.values)
        return weights / weights.sum(-1, keepdim=True)

    def forward(self, u: torch.Tensor, residual: torch.Tensor) -> DraftOutput:
        cfg = self.cfg
        outs = torch.stack([e(u) for e in self.experts], dim=-2)  # [B, L, E, H]
        E = cfg.num_experts
        if self.router is None:
            gates_a = torch.ones(*u.shape[:-1], 1, dtype=u.dtype, device=u.device)
            logits_b = None
        else:
            logits = self.router(u)
            gates_a = self._topk_weights(logits[..., :E], cfg.top_k_experts) if E > 1 else torch.ones_like(logits[..., :1])
            logits_b = logits[..., E:] if cfg.branch_b else None
        a = residual + (gates_a.unsqueeze(-1) * outs).sum(-2)
        b = None
        if logits_b is not None:
            gb = logits_b.softmax(-1)
            if cfg.contrastive:
                top = gb.topk(2, dim=-1)  # the higher- and lower-gated of the two leading experts
                hi = torch.gather(outs, -2, top.indices[..., :1, None].expand(*outs.shape[:-2], 1, outs.shape[-1]))
                lo = torch.gather(outs, -2, top.indices[..., 1:, None].expand(*outs.shape[:-2], 1, outs.shape[-1]))
                b = residual + top.values[..., :1] * hi.squeeze(-2) - top.values[..., 1:] * lo.squeeze(-2)
            else:
                wb = self._topk_weights(logits_b, cfg.top_k_experts) if E > 1 else gb
                b = residual + (wb.unsqueeze(-1) * outs).sum(-2)
        if not self.training and self.count_load:
            with torch.no_grad():
                self.load += (gates_a > 0).float().reshape(-1, E).sum(0)
                self.load_tokens += gates_a.reshape(-1, E).shape[0]
        return DraftOutput(a=a, b=b, experts=residual.unsqueeze(-2) + outs, gates=gates_a)


def _rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (cos, sin [B, L, D]) through :func:`~.fast_paths.rope_pair`."""
    return fast_paths.rope_pair(q, k, cos[:, None], sin[:, None])


def mlp_width(cfg: DraftConfig, target_config: Any) -> int:
    """The experts' intermediate size: the target's hidden size (None), the target's own MLP width
    ("target": EAGLE-2's draft layer) or the configured number."""
    if cfg.intermediate_size is None:
        return target_config.hidden_size
    if cfg.intermediate_size == "target":
        return target_config.intermediate_size
    return int(cfg.intermediate_size)


class DraftModel(nn.Module):
    """EAGLE-style draft head. The target's embedding and ``lm_head`` are borrowed, frozen, never saved."""

    def __init__(self, cfg: DraftConfig, target_config: Any, embed: nn.Module, lm_head: nn.Module,
                 d2t: torch.Tensor | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.target_config = target_config
        H = target_config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=True)
        self.attn = DraftAttention(target_config, _rotate)  # one kernel call on the CPU, as the target's lean forward
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=target_config.rms_norm_eps)
        fast_paths.use_fused_norm(self.post_attention_layernorm)  # one kernel on CUDA, as the target's
        self.mlp = MoEBlock(H, cfg, mlp_width(cfg, target_config))
        rope_cfg = copy.deepcopy(target_config)
        self.rotary = LlamaRotaryEmbedding(rope_cfg)
        if cfg.draft_vocab_size is not None and d2t is None:  # placeholder until trained or loaded
            d2t = torch.arange(cfg.draft_vocab_size)
        self.register_buffer("d2t", d2t.long() if d2t is not None else None, persistent=d2t is not None)
        self._shared = (embed, lm_head)  # plain tuple: not registered, so not saved or trained
        self._head_weight: torch.Tensor | None = None
        self._head_key: tuple = ()
        self._head_packed: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (rows it packs, copy)
        self._head_gemm: tuple[str, int] | None = None  # (backend, min_rows) of the packed head: the target's
        self._head_int8: tuple[torch.Tensor, torch.Tensor] | None = None  # bf16-weight drafts: the head in int8
        self.packed_head = True  # False: plain GEMM for the head (to measure what packing buys)
        self.register_load_state_dict_post_hook(DraftModel._drop_head_cache)

    @property
    def reduced_weights(self) -> bool:
        """Whether the linears read bf16 or int8 copies of their weights (kernels.REDUCED_WEIGHTS, chosen by
        :meth:`for_decoding`), and so the reduced head its int8 copy."""
        gemm = kernels.packed_gemm(self)
        return gemm is not None and gemm.backend in kernels.REDUCED_WEIGHTS

    @staticmethod
    def _drop_head_cache(module: "DraftModel", incompatible_keys: Any) -> None:
        module._head_weight = None

    # Frozen target parts
    @property
    def embed(self) -> nn.Module:
        return self._shared[0]

    def head_weight(self) -> torch.Tensor:
        """Rows of the target's lm_head for the draft vocabulary (all rows when it is the full vocab)."""
        w = self._shared[1].weight
        if self.d2t is None:
            return w
        if torch.compiler.is_compiling() and self._head_weight is not None:
            return self._head_weight  # prepared before compiling (jakiro_lib.decoding.static: StaticEngine)
        # Inference tensors (a draft loaded under torch.inference_mode) keep no version counter; the
        # load_state_dict hook in __init__ drops the cache whichever kind d2t is.
        version = None if self.d2t.is_inference() else self.d2t._version
        key = (w.data_ptr(), w.dtype, self.d2t.data_ptr(), version)
        stale = self._head_weight is None or self._head_key != key  # d2t may be edited in place
        if stale or (self._head_weight.is_inference() and not torch.is_inference_mode_enabled()):  # autograd use
            self._head_weight = w.detach()[self.d2t.to(w.device)].contiguous()
            self._head_key = key
        return self._head_weight

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of predicted features (cast to the head's dtype). A reduced head goes through
        a packed copy of its rows on the CPU (:mod:`~jakiro_lib.models.kernels`; for a draft that streams bf16
        weights an int8 copy, through AMX's tiles where the CPU has them); the full-vocabulary head is the target's
        ``lm_head``, with the target's own fast path."""
        features = features.to(self._shared[1].weight.dtype)
        if self.d2t is None:
            head = self._shared[1]
            return head(features) if self.packed_head else F.linear(features, head.weight, head.bias)
        w = self.head_weight()
        if not self.packed_head:
            return F.linear(features, w)
        self._pack_head(w)
        if self._head_int8 is not None and features.device.type == "cpu":
            return torch.ops.jakiro_stream_gemm.int8_linear(features, *self._head_int8, w.shape[0])
        packed = self._head_packed[1] if self.packed_head else None
        backend, min_rows = self._head_gemm or ("mkl", 1)
        return kernels.linear_maybe_packed(features, w, None, packed, min_rows, HEAD_PACK_MAX_ROWS, backend)

    def _pack_head(self, w: torch.Tensor) -> None:
        """The reduced head ``w``'s packed copy, or its int8 copy for a draft that streams reduced weights, made once
        per head weight."""
        if self._head_packed is None or self._head_packed[0] is not w:
            reduced = self.reduced_weights
            self._head_gemm = (kernels.HALF_WEIGHTS, 1) if reduced else kernels.follow(self._shared[1], w)
            self._head_int8 = kernels.pack_int8_rows(w) if reduced else None
            # the packed copy, where no int8 copy serves instead
            self._head_packed = (w, kernels.pack_weight(w, HEAD_PACK_MAX_ROWS, self._head_gemm[0])
                                 if self._head_gemm and self._head_int8 is None else None)

    def int8_head(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The reduced head's int8 copy (screen and scales) and its rows, which :meth:`logits` reads for fp32 features
        on a CPU; None where it reads another head (the full vocabulary's, fp32 or unpacked rows)."""
        if self.d2t is None or not self.packed_head:
            return None
        w = self.head_weight()
        if w.dtype != torch.float32 or w.device.type != "cpu":
            return None
        self._pack_head(w)
        return None if self._head_int8 is None else (*self._head_int8, w.shape[0])

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else self.d2t[draft_ids]

    def n_params(self) -> int:
        """Trainable parameters (the borrowed embedding and lm_head excluded)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    # Forward
    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None,
                steps: int = 1) -> DraftOutput | list[DraftOutput]:
        """features [B, L, H] (f_t), input_ids [B, L] (x_{t+1}), position_ids [B, L] (t). ``mask``: additive or
        boolean [B, 1, L, S] over cache + new positions; None = causal. ``steps`` > 1: :meth:`unroll` (a list
        of outputs; here so that a DDP wrapper sees one forward)."""
        if steps > 1:
            return self.unroll(features, input_ids, position_ids, steps)
        return self._step(features, input_ids, position_ids, cache, mask)

    def _step(self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
              cache: KVCache | None, mask: torch.Tensor | None) -> DraftOutput:
        """One forward. :meth:`unroll` calls it rather than ``self(...)``: accelerate replaces ``forward`` with
        an autocast-wrapped one, and re-entering that one autocast object left autocast on for the process."""
        with torch.no_grad():
            emb = self.embed(input_ids)
        x = torch.cat([emb.to(features.dtype), features], dim=-1)
        fused = draft_step.fused_step(self, x, position_ids, cache, mask, fast_paths.ATTEND_ROWS,
                                      fast_paths.ATTEND_HEAD_SIZES)  # a decoding step's few rows on a CPU
        if fused is not None:
            return DraftOutput(*fused)
        z = self.fc(x)
        cos, sin = self.rotary(z, position_ids)
        h = z + self.attn(z, (cos, sin), cache, mask)
        return self.mlp(self.post_attention_layernorm(h), h)

    def unroll(self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
               steps: int) -> list[DraftOutput]:
        """The draft run ``steps`` steps on its own predicted features over a whole sequence (training-time
        test, docs/DESIGN.md section 4). At step j the input at t is step j-1's branch-A prediction at t-1; it
        attends to step 0's keys at positions <= t-j and to step i's key at t-(j-i) for i = 1..j, as the j-th
        drafted token after the prefix ending at t-j does in a tree. Callers mask out outputs at t < j.
        """
        L = features.shape[1]
        cache = KVCache()
        outs = [self._step(features, input_ids, position_ids, cache, None)]
        counting, self.mlp.count_load = self.mlp.count_load, False
        try:
            for j in range(1, steps):
                prev = outs[-1].a  # [B, L, H]: step j-1's prediction of f_{t+1} at t
                feats = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], 1)  # position t gets it at t+1
                mask = unroll_mask(L, j, prev.device)[None, None]  # [1, 1, L, (j + 1) L]
                outs.append(self._step(feats, input_ids, position_ids, cache, mask))
        finally:
            self.mlp.count_load = counting
        return outs

    # Training losses
    def train_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits with autograd (the packed inference head has no backward)."""
        w = self.head_weight()
        if x.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
            w = w.to(x.dtype)
        return x @ w.T

    def feature_loss(self, pred: torch.Tensor, t: torch.Tensor, p: torch.Tensor, ref: torch.Tensor,
                     w: torch.Tensor, p_weight: float) -> Losses:
        """SmoothL1(pred, t) + p_weight * soft-CE(p, draft logits of pred) over rows [N, H], weighted by ``w``
        [N]; ``correct``: draft argmax (mapped to target ids) equal to the target's argmax ``ref`` [N]."""
        o = pred.float()
        denom = w.sum().clamp_min(1.0)
        vloss = (F.smooth_l1_loss(o, t, reduction="none").mean(-1) * w).sum() / denom
        q_logits = self.train_logits(o)  # [N, V'] (bf16 under autocast)
        ploss = (soft_cross_entropy(q_logits, p) * w).sum() / denom
        with torch.no_grad():
            # max(-1).indices: argmax's first-of-ties, at about half its cost on a CPU
            correct = ((self.to_target_ids(q_logits.max(-1).indices) == ref).float() * w).sum()
        return {"vloss": vloss, "ploss": ploss, "loss": vloss + p_weight * ploss, "correct": correct,
                "count": w.sum()}

    def expert_loss(self, experts: torch.Tensor, gates: torch.Tensor, t: torch.Tensor, p: torch.Tensor,
                    ref: torch.Tensor, w: torch.Tensor, p_weight: float) -> Losses:
        """The :meth:`feature_loss` terms of each selected expert's own output o_i = r + e_i(u) (experts [N, E, H],
        gates [N, E]), weighted per row by its branch-A gate taken as a constant (``expert_loss="gate"``) or
        equally (``"equal"``); docs/DESIGN.md section 3. Also ``correct_e{i}`` / ``count_e{i}``: expert i's
        top-1 over the rows where it is selected."""
        N, E, H = experts.shape
        sel = (gates > 0).float()  # [N, E]
        mix = gates.detach().float() if self.cfg.expert_loss == "gate" else sel / sel.sum(-1, keepdim=True)
        o = experts.float()
        vl = F.smooth_l1_loss(o, t[:, None].expand_as(o), reduction="none").mean(-1)  # [N, E]
        q_logits = self.train_logits(o)  # [N, E, V]
        pl = soft_cross_entropy(q_logits, p[:, None].expand(-1, E, -1))  # [N, E]
        denom = w.sum().clamp_min(1.0)
        vloss = ((vl * mix).sum(-1) * w).sum() / denom
        ploss = ((pl * mix).sum(-1) * w).sum() / denom
        out = {"vloss": vloss, "ploss": ploss, "loss": vloss + p_weight * ploss}
        with torch.no_grad():
            hit = (self.to_target_ids(q_logits.max(-1).indices) == ref[:, None]).float() * sel * w[:, None]  # [N, E]
            for i in range(E):
                out[f"correct_e{i}"], out[f"count_e{i}"] = hit[:, i].sum(), (sel[:, i] * w).sum()
        return out

    # Router statistics
    def router_load(self, reset: bool = False) -> list[float]:
        """Fraction of tokens routed to each expert (branch A top-k) since the last reset, counted by forwards in
        eval mode while ``mlp.count_load`` is set (the held-out evaluation sets it)."""
        tokens = float(self.mlp.load_tokens)
        load = (self.mlp.load / max(tokens, 1.0)).tolist()
        if reset:
            self.mlp.load.zero_()
            self.mlp.load_tokens.zero_()
        return load

    # Save / load
    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}

    def save(self, path: str | Path, **meta: Any) -> Path:
        """One directory: ``draft_config.json`` (architecture + target identity) and safetensors weights."""
        path = Path(path)
        tc = self.target_config
        info = {
            "draft": dataclasses.asdict(self.cfg),
            "target": {"model_type": tc.model_type, "hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size,
                       "num_attention_heads": tc.num_attention_heads,
                       "num_key_value_heads": getattr(tc, "num_key_value_heads", None),
                       "name_or_path": meta.pop("target_name", getattr(tc, "_name_or_path", ""))},
            "meta": meta,
        }
        with atomic_path(path) as tmp:
            tmp.mkdir()
            save_file(self.trainable_state(), str(tmp / WEIGHTS_FILE))
            (tmp / CONFIG_FILE).write_text(json.dumps(info, indent=2, default=str))
        return path

    @classmethod
    def build(cls, cfg: DraftConfig, target_model: nn.Module, d2t: torch.Tensor | None = None) -> "DraftModel":
        """A fresh draft for ``target_model`` on the target's device and dtype."""
        draft = cls(cfg, target_model.config, target_model.get_input_embeddings(), target_model.get_output_embeddings(), d2t)
        p = next(target_model.parameters())
        return draft.to(device=p.device, dtype=p.dtype)

    @classmethod
    def load(cls, path: str | Path, target_model: nn.Module, dtype: torch.dtype | str | None = None) -> "DraftModel":
        """Strict load: the target must match the one the draft was trained for and every key must fit; set up to
        decode in ``dtype`` (:meth:`for_decoding`). The borrowed embedding and head stay the target's; verification
        keeps the output exact whatever the draft computes in."""
        path = Path(path)
        if not (path / CONFIG_FILE).is_file() or not (path / WEIGHTS_FILE).is_file():
            raise DraftLoadError(f"no saved draft at {path} (need {CONFIG_FILE} and {WEIGHTS_FILE})")
        try:
            info = json.loads((path / CONFIG_FILE).read_text())
            cfg = DraftConfig(**info["draft"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise DraftLoadError(f"corrupt draft config {path / CONFIG_FILE}: {exc}") from exc
        tc = target_model.config
        saved = info["target"]
        for key in ("hidden_size", "vocab_size", "num_attention_heads", "model_type"):
            if saved.get(key) != getattr(tc, key, None):
                raise DraftLoadError(
                    f"draft at {path} was trained for a target with {key}={saved.get(key)!r}, "
                    f"but this target has {key}={getattr(tc, key, None)!r}"
                )
        try:
            state = load_file(str(path / WEIGHTS_FILE))
        except Exception as exc:  # safetensors raises several types for a damaged file
            raise DraftLoadError(f"corrupt draft weights {path / WEIGHTS_FILE}: {exc}") from exc
        draft = cls.build(cfg, target_model, d2t=state.get("d2t"))
        missing, unexpected = draft.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise DraftLoadError(f"draft weights at {path} do not match the config: missing {missing}, "
                                 f"unexpected {unexpected}")
        return draft.for_decoding(target_model, dtype)

    def for_decoding(self, target_model: nn.Module, dtype: torch.dtype | str | None = None) -> "DraftModel":
        """This draft (eval mode) set up to decode beside ``target_model``: its own layers in ``dtype`` (or its name;
        default the target's; bf16 or int8 where :func:`streams_reduced_weights`: copies of the linears' weights in
        that precision and the reduced head's in int8, fp32 arithmetic; int8 nowhere else), its linears on the packed
        GEMM that suits a frontier's few rows."""
        own = next(self.parameters())
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        reduced = {torch.bfloat16: kernels.HALF_WEIGHTS, torch.int8: kernels.INT8_WEIGHTS}.get(dtype)
        if reduced is not None and streams_reduced_weights(own.device, own.dtype):
            kernels.enable_packed_gemm(self, max_rows=HEAD_PACK_MAX_ROWS, backend=reduced, min_rows=1)
            return self.eval()
        if dtype == torch.int8:
            raise ValueError("a draft decodes in int8 through the package's CPU kernels only: beside an fp32 target "
                             "on a CPU where the streaming GEMM is built")
        if dtype is not None:
            self.to(dtype)
        # A draft's forwards take a frontier's few rows: its linears follow the target's packed GEMM; without
        # one, bf16 drafts pack through oneDNN (plain bf16 GEMMs are slow at few rows) and fp32 drafts stay plain
        p = next(self.parameters())
        choice = kernels.follow(target_model, p)
        if choice is not None and (kernels.packed_gemm(target_model) is not None or p.dtype == torch.bfloat16):
            kernels.enable_packed_gemm(self, max_rows=HEAD_PACK_MAX_ROWS, backend=choice[0], min_rows=choice[1])
        return self.eval()


def streams_reduced_weights(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a draft beside a target of ``dtype`` on ``device`` can stream bf16 or int8 copies of its weights with
    fp32 arithmetic: fp32 on a CPU, the streaming GEMM built (with AMX or without; docs/DESIGN.md section 12)."""
    return dtype == torch.float32 and torch.device(device).type == "cpu" and kernels.stream_gemm_available()


def resolve_draft_dtype(setting: str, target: TargetConfig) -> str | None:
    """``bench.draft_dtype`` for ``target``: None for the target's precision, else a dtype's name. "auto": int8 where
    its weights stream (:func:`streams_reduced_weights`: a quarter of the fp32 bytes read, faster there than bf16's
    half, tau unchanged: docs/DESIGN.md section 12), else the target's."""
    if setting == "auto":
        return "int8" if streams_reduced_weights(target.device, getattr(torch, target.dtype)) else None
    return None if setting == "target" else setting
