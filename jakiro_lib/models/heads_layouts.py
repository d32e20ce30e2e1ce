"""Released draft-head layouts: which one a checkpoint holds, its tensors mapped onto :class:`DraftModel`'s and back,
and the draft config its shapes describe (docs/DESIGN.md section 13, with the reference code each layout was read from).
Pure functions over state dicts; reading and writing folders is :mod:`jakiro_lib.models.heads_io`."""
from __future__ import annotations

import re
from typing import Any

import torch

from ..config import DraftConfig
from .draft import DraftLoadError

LAYOUTS = ("eagle", "jakiro", "jakiro_star", "eagle3")
LAYER = "layers.0."
# Where a layout's keys live, ours -> theirs, first match wins (the tail of the key is kept)
PREFIXES: dict[str, tuple[tuple[str, str], ...]] = {
    "eagle": (("attn.", LAYER + "self_attn."), ("mlp.experts.0.", LAYER + "mlp.")),
    "jakiro": (("attn.", LAYER + "self_attn."), ("mlp.router.", LAYER + "mlp_moe.gate."),
               ("mlp.experts.", LAYER + "mlp_moe.experts.")),
}
PREFIXES["jakiro_star"] = PREFIXES["jakiro"]
COMMON = {"fc.weight": "fc.weight", "fc.bias": "fc.bias",
          "post_attention_layernorm.weight": LAYER + "post_attention_layernorm.weight"}
EMBED, INV_FREQ = "embed_tokens.weight", LAYER + "self_attn.rotary_emb.inv_freq"  # consumed, checked, not loaded
VOCAB_KEYS = ("d2t", "t2d")
EAGLE3_CANNOT = ("an EAGLE-3 head (fc [H, 3H] over three target layers, midlayer.* whose q/k/v read the normed "
                 "embedding and the normed fused feature side by side (2H), a final norm and its own lm_head): our "
                 "draft reads the target's last hidden state alone, attends over fc(cat(embedding, feature)) (H "
                 "inputs) and has no final norm, so it cannot express EAGLE-3's fused three-layer input, its 2H "
                 "attention input or its final norm")


def detect(keys: set[str]) -> str:
    """The layout of a head's state-dict keys (:data:`LAYOUTS`); a second decoder layer or an unknown layout is
    a :class:`DraftLoadError` naming it."""
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    layers = sorted({int(m.group(1)) for k in keys if (m := re.match(r"layers\.(\d+)\.", k))})
    if layers and layers != [0]:
        raise DraftLoadError(f"the head has {len(layers)} decoder layers (layers.{', layers.'.join(map(str, layers))}"
                             "); our draft has one (layers.0)")
    if LAYER + "mlp_moe.experts.0.fc.weight" in keys:
        return "jakiro_star"
    if LAYER + "mlp_moe.gate.weight" in keys:
        return "jakiro"
    if LAYER + "mlp.gate_proj.weight" in keys:
        return "eagle"
    shown = ", ".join(sorted(keys)[:4])
    raise DraftLoadError(f"not a head layout we read (no layers.0.mlp.* as in EAGLE, layers.0.mlp_moe.* as in Jakiro, "
                         f"or midlayer.* as in EAGLE-3); its keys begin {shown}")


def theirs(layout: str, ours: str) -> str:
    """The key of our parameter ``ours`` in ``layout``."""
    if ours in COMMON:
        return COMMON[ours]
    for mine, other in PREFIXES[layout]:
        if ours.startswith(mine):
            return other + ours[len(mine):]
    raise DraftLoadError(f"our draft's {ours} has no place in the {layout} layout")


def _width(state: dict[str, torch.Tensor], key: str, H: int) -> int:
    """An expert's width from its first projection [width, H] (a wrong hidden size is named)."""
    w = state[key]
    if w.dim() != 2 or w.shape[1] != H:
        raise DraftLoadError(f"{key} has shape {list(w.shape)}; with the target's hidden size {H} it must be [width, {H}]")
    return int(w.shape[0])


def _experts(state: dict[str, torch.Tensor], layout: str) -> int:
    """The number of experts a head's gate has (both of Jakiro's layouts map two only)."""
    gate = state[LAYER + "mlp_moe.gate.weight"]
    n = int(gate.shape[0]) - (2 if layout == "jakiro" else 0)
    keyed = len({m.group(1) for k in state if (m := re.match(r"layers\.0\.mlp_moe\.experts\.(\d+)\.", k))})
    if n != keyed:
        raise DraftLoadError(f"{LAYER}mlp_moe.gate.weight has {gate.shape[0]} outputs, which in the {layout} layout "
                             f"means {n} experts, but the head holds {keyed}")
    if n != 2:
        raise DraftLoadError(f"a {layout} head with {n} experts: the authors' code weights any top-k experts by the "
                             "softmax of the gate's first two outputs (forward_moe), which our router cannot express; "
                             "only 2 experts map")
    return n


def draft_config(layout: str, state: dict[str, torch.Tensor], target_config: Any, vocab: int | None,
                 source: str) -> DraftConfig:
    """The draft config a head's shapes describe (expert widths as ``"target"`` / None / a number, as in ours);
    ``layout`` one of ``eagle``, ``jakiro``, ``jakiro_star`` (EAGLE-3's is refused before)."""
    H = target_config.hidden_size
    first = {"eagle": LAYER + "mlp.gate_proj.weight", "jakiro": LAYER + "mlp_moe.experts.0.gate_proj.weight",
             "jakiro_star": LAYER + "mlp_moe.experts.0.fc.weight"}[layout]
    width = _width(state, first, H)
    inter: int | str | None = ("target" if width == getattr(target_config, "intermediate_size", None)
                               else None if width == H else width)
    if layout == "eagle":
        return DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, intermediate_size=inter, branch_b=False,
                           contrastive=False, draft_vocab_size=vocab, import_from=source)
    n = _experts(state, layout)
    star = layout == "jakiro_star"
    return DraftConfig(mlp="moe", num_experts=n, top_k_experts=n, intermediate_size=inter, branch_b=not star,
                       contrastive=not star, draft_vocab_size=vocab, expert_mlp="gelu" if star else "swiglu",
                       import_from=source)


def export_layout(cfg: DraftConfig, hidden: int, width: int, fmt: str) -> str:
    """The layout a draft is written in for ``--format fmt`` (``eagle``, ``eagle3`` or ``jakiro``: Jakiro's or
    Jakiro*'s), or a :class:`DraftLoadError` saying which of its conventions the format has no place for."""
    if fmt == "eagle3":
        raise DraftLoadError(f"our draft cannot be written as {EAGLE3_CANNOT}; use --format eagle (EAGLE-1 layout, "
                             "which EAGLE-2, vLLM's method 'eagle' and SGLang's EAGLE load)")
    if fmt == "eagle":
        if cfg.num_experts != 1 or cfg.branch_b or cfg.expert_mlp != "swiglu":
            raise DraftLoadError(f"the EAGLE layout has one SwiGLU MLP and no branch B; this draft has "
                                 f"{cfg.num_experts} {cfg.expert_mlp} expert(s){' and a branch B' if cfg.branch_b else ''}"
                                 " (--format jakiro writes 2-expert drafts)")
        return "eagle"
    if fmt != "jakiro":
        raise DraftLoadError(f"unknown head format {fmt!r}: use eagle, eagle3 or jakiro")
    if cfg.num_experts != 2 or cfg.top_k_experts != 2:
        raise DraftLoadError(f"the authors' Jakiro layouts have 2 experts, both active; this draft has "
                             f"{cfg.num_experts}, top-{cfg.top_k_experts}")
    if cfg.expert_mlp == "swiglu" and cfg.branch_b and cfg.contrastive:
        if width != hidden:
            raise DraftLoadError(f"the authors' Jakiro code builds experts of width hidden_size ({hidden}); this "
                                 f"draft's are {width} wide")
        return "jakiro"
    if cfg.expert_mlp == "gelu" and not cfg.branch_b:
        return "jakiro_star"
    branch = ("a contrastive branch B" if cfg.contrastive else "a weighted-sum branch B") if cfg.branch_b else "no branch B"
    raise DraftLoadError("the authors' layouts are Jakiro's (SwiGLU experts with the contrastive branch B) and "
                         f"Jakiro*'s (GELU experts, no branch B); this draft has {cfg.expert_mlp} experts and {branch}")


def vocab_from_head(state: dict[str, torch.Tensor], vocab_size: int) -> torch.Tensor | None:
    """The draft vocabulary (draft index -> target id) from a head's ``d2t`` offsets and ``t2d`` mask (EAGLE-3's
    convention), checked; None where the head drafts over the whole target vocabulary."""
    present = [k for k in VOCAB_KEYS if k in state]
    if not present:
        return None
    if len(present) == 1:
        raise DraftLoadError(f"the head has {present[0]} but not {({'d2t', 't2d'} - set(present)).pop()}: a draft "
                             "vocabulary needs both")
    offsets, mask = state["d2t"], state["t2d"]
    if offsets.dim() != 1 or mask.shape != (vocab_size,):
        raise DraftLoadError(f"t2d has shape {list(mask.shape)} and d2t {list(offsets.shape)}; for the target's "
                             f"vocabulary of {vocab_size} t2d must be [{vocab_size}] and d2t one-dimensional")
    ids = torch.arange(offsets.numel()) + offsets.long()  # EAGLE-3: target id = draft index + d2t[index]
    if ids.min() < 0 or ids.max() >= vocab_size or ids.unique().numel() != ids.numel() \
            or int(mask.bool().sum()) != ids.numel() or not bool(mask.bool()[ids].all()):
        raise DraftLoadError(f"d2t and t2d do not describe one draft vocabulary of distinct target ids below "
                             f"{vocab_size}")
    return ids


def vocab_to_head(d2t: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """Our draft vocabulary (draft index -> target id) as EAGLE-3's ``d2t`` offsets and ``t2d`` mask."""
    ids = d2t.long().cpu()
    mask = torch.zeros(vocab_size, dtype=torch.bool)
    mask[ids] = True
    return {"d2t": ids - torch.arange(ids.numel()), "t2d": mask}
