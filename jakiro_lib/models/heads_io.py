"""Draft heads in and out of the released layouts (:mod:`jakiro_lib.models.heads_layouts`; docs/DESIGN.md
section 13): :func:`import_head` reads a folder or a hub id into a :class:`DraftModel` for a target,
:func:`export_head` writes a draft in EAGLE's or the Jakiro authors' layout.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..files import PathError, atomic_path, file_sha256, read_json
from .draft import DraftLoadError, DraftModel
from .heads_layouts import (EAGLE3_CANNOT, EMBED, INV_FREQ, VOCAB_KEYS, detect, draft_config, export_layout, theirs,
                            vocab_from_head, vocab_to_head)

HEAD_CONFIG = "config.json"
HEAD_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # the first present is read
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
EXPORT_MARK = "jakiro_lib"  # the config.json section of our exports: the only non-empty --out export replaces
FEATURE = "the target's last hidden state after its final norm (what enters lm_head)"
EMBED_TOLERANCE = 1e-2  # of the embedding's largest magnitude: a copy in another float format, not another target's


def head_folder(source: str) -> Path:
    """A head's folder: ``source`` itself where it exists, else the hub id's download."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise DraftLoadError(f"{source} is a file: give the folder that holds {HEAD_CONFIG} and the weights")
        return path
    if not HUB_ID.match(source):
        raise DraftLoadError(f"no head folder {source} (and it is not a hub id of the form owner/name)")
    return _download(source)


def _download(repo_id: str) -> Path:
    """The hub id's config and weights, through huggingface_hub (the cache, or the network where it is reachable)."""
    try:
        from huggingface_hub import snapshot_download  # optional: only a hub id needs it (it comes with transformers)
    except ImportError:
        raise DraftLoadError(f"{repo_id} is a hub id and huggingface_hub is not installed: give a local folder") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=[HEAD_CONFIG, *HEAD_WEIGHTS]))
    except Exception as exc:  # offline, unknown or gated id: the hub raises many kinds
        reason = (str(exc).strip().splitlines() or [""])[0][:160]
        raise DraftLoadError(f"cannot download the head {repo_id} from the hub ({type(exc).__name__}: {reason}), and "
                             f"no folder of that name is in {Path.cwd()}; offline, download it elsewhere and give its "
                             "folder") from exc


def read_head(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], Path]:
    """(config, tensors, weights file) of a head folder."""
    config = read_json(folder / HEAD_CONFIG)
    if not isinstance(config, dict):
        raise DraftLoadError(f"no readable {HEAD_CONFIG} in {folder}")
    weights = next((folder / n for n in HEAD_WEIGHTS if (folder / n).is_file()), None)
    if weights is None:
        raise DraftLoadError(f"no weights in {folder} (need {' or '.join(HEAD_WEIGHTS)})")
    try:
        state = (load_file(str(weights)) if weights.suffix == ".safetensors"
                 else torch.load(weights, map_location="cpu", weights_only=True))
    except Exception as exc:  # a damaged file: safetensors and pickle raise several kinds
        raise DraftLoadError(f"cannot read {weights}: {(str(exc).strip().splitlines() or [''])[0][:160]}") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise DraftLoadError(f"{weights} does not hold a state dict of tensors")
    return config, state, weights


def _rope(config: dict[str, Any]) -> tuple[float, str]:
    """(theta, scaling kind) of a config dict, as EAGLE's code reads it (theta 10000 where absent)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    return float(theta), str(scaling.get("rope_type", scaling.get("type")) or params.get("rope_type", "default"))


def _check_config(config: dict[str, Any], tc: Any, source: str) -> None:
    """The head's config against the target's: sizes, norm epsilon, activation, RoPE, one decoder layer."""
    heads = tc.num_attention_heads
    wanted = {"hidden_size": tc.hidden_size, "vocab_size": tc.vocab_size, "num_attention_heads": heads,
              "num_key_value_heads": getattr(tc, "num_key_value_heads", None) or heads, "rms_norm_eps": tc.rms_norm_eps,
              "hidden_act": "silu", "num_hidden_layers": 1}
    for key, want in wanted.items():
        got = config.get(key, config.get("num_attention_heads") if key == "num_key_value_heads" else None)
        same = got is None or (math.isclose(got, want) if isinstance(want, float) else got == want)
        if not same:
            ours = "our draft has one decoder layer" if key == "num_hidden_layers" else f"the target has {want!r}"
            raise DraftLoadError(f"{source}: the head's {key} is {got!r}, but {ours}")
    head_rope, target_rope = _rope(config), _rope(tc.to_dict())
    if not math.isclose(head_rope[0], target_rope[0]) or head_rope[1] != target_rope[1]:
        raise DraftLoadError(f"{source}: the head's RoPE (theta {head_rope[0]:g}, {head_rope[1]}) is not the target's "
                             f"(theta {target_rope[0]:g}, {target_rope[1]}), which our draft uses")


def _no_bias(config: dict[str, Any], key: str) -> bool:
    """Whether the head's config says the layer of bias ``key`` (ours) has none (a zero bias is then exact)."""
    if key == "fc.bias":
        return config.get("bias", True) is False  # EAGLE's Model(bias=config "bias", default true)
    return key.startswith("attn.") and not (config.get("qkv_bias") or config.get("attention_bias"))


def _mapped(draft: DraftModel, layout: str, state: dict[str, torch.Tensor], config: dict[str, Any],
            source: str) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Our state dict filled from the head's tensors (shapes checked), and the head's keys it used."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for key, mine in draft.state_dict().items():
        if key == "d2t":
            out[key] = mine
            continue
        ext = theirs(layout, key)
        if ext not in state:
            if key.endswith(".bias") and _no_bias(config, key):
                out[key] = torch.zeros_like(mine)
                continue
            raise DraftLoadError(f"{source}: key {ext} is missing (our {key}, shape {list(mine.shape)})")
        if state[ext].shape != mine.shape:
            raise DraftLoadError(f"{source}: {ext} has shape {list(state[ext].shape)}, but with the target's hidden "
                                 f"size {draft.target_config.hidden_size} it must be {list(mine.shape)}")
        out[key] = state[ext]
        used.add(ext)
    return out, used


def _checked_extras(draft: DraftModel, target_model: nn.Module, state: dict[str, torch.Tensor], source: str) -> set[str]:
    """The head's tensors our draft takes from the target (its embedding, RoPE frequencies, vocabulary map),
    each checked against the target; returns their keys."""
    if EMBED in state:
        own = target_model.get_input_embeddings().weight.detach().float().cpu()
        theirs_ = state[EMBED].float()
        if theirs_.shape != own.shape:
            raise DraftLoadError(f"{source}: {EMBED} has shape {list(theirs_.shape)}, the target's embedding "
                                 f"{list(own.shape)}")
        if (theirs_ - own).abs().max() > EMBED_TOLERANCE * own.abs().max():
            raise DraftLoadError(f"{source}: the head's {EMBED} is not the target's embedding: it was made for "
                                 "another target")
    if INV_FREQ in state and not torch.allclose(state[INV_FREQ].float().cpu(), draft.rotary.inv_freq.float().cpu()):
        raise DraftLoadError(f"{source}: {INV_FREQ} is not the target's RoPE frequencies")
    return {k for k in (EMBED, INV_FREQ, *VOCAB_KEYS) if k in state}


def import_head(source: str, target_model: nn.Module) -> tuple[DraftModel, dict[str, Any]]:
    """A released or exported head as our draft for ``target_model`` (eval mode, the target's device and
    dtype), and what was read: ``{"layout", "source", "weights", "sha256"}``. Every tensor of the head is
    consumed and checked; a missing key, a key left over, a shape, size or convention that does not fit is a
    :class:`DraftLoadError` naming it."""
    folder = head_folder(source)
    config, state, weights = read_head(folder)
    tc = target_model.config
    layout = detect(set(state))
    if layout == "eagle3":
        raise DraftLoadError(f"{source} is {EAGLE3_CANNOT}")
    _check_config(config, tc, source)
    d2t = vocab_from_head(state, tc.vocab_size)
    cfg = draft_config(layout, state, tc, None if d2t is None else int(d2t.numel()), source)
    draft = DraftModel.build(cfg, target_model, d2t=d2t)
    weights_in, used = _mapped(draft, layout, state, config, source)
    left = sorted(set(state) - used - _checked_extras(draft, target_model, state, source))
    if left:
        more = f" and {len(left) - 3} more" if len(left) > 3 else ""
        raise DraftLoadError(f"{source}: {', '.join(left[:3])}{more} left over: our draft has no place for "
                             f"{'it' if len(left) == 1 else 'them'} in the {layout} layout")
    draft.load_state_dict(weights_in, strict=True)
    return draft.eval(), {"layout": layout, "source": source, "weights": str(weights), "sha256": file_sha256(weights)}


def _export_config(draft: DraftModel, target_model: nn.Module, layout: str, fmt: str, origin: str) -> dict[str, Any]:
    """config.json of an export: the target's shapes as EAGLE's and the authors' code read them, the features'
    source, and our own section (:data:`EXPORT_MARK`)."""
    tc, cfg = target_model.config, draft.cfg
    theta, kind = _rope(tc.to_dict())
    scaling = tc.to_dict().get("rope_parameters") or tc.to_dict().get("rope_scaling") or {}
    width = draft.mlp.experts[0].width
    out = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": tc.hidden_size,
           # Jakiro's config carries the target's width; its code builds H-wide experts whatever it says
           "intermediate_size": tc.intermediate_size if layout == "jakiro" else width,
           "num_attention_heads": tc.num_attention_heads,
           "num_key_value_heads": getattr(tc, "num_key_value_heads", None) or tc.num_attention_heads,
           "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": tc.rms_norm_eps, "rope_theta": theta,
           "rope_scaling": None if kind == "default" else {k: v for k, v in scaling.items() if k != "rope_theta"},
           "max_position_embeddings": tc.max_position_embeddings, "vocab_size": tc.vocab_size,
           "bos_token_id": tc.bos_token_id, "eos_token_id": tc.eos_token_id, "pad_token_id": tc.pad_token_id,
           # the head carries no lm_head: the target's gives the logits (EAGLE's and Jakiro's configs say false)
           "tie_word_embeddings": False, "torch_dtype": str(draft.fc.weight.dtype).removeprefix("torch."),
           "bias": True, "eagle_fc_bias": True}  # fc has a bias: EAGLE's code reads "bias", older vLLM "eagle_fc_bias"
    if draft.attn.q_proj.bias is not None:
        out["qkv_bias"] = True
    if layout != "eagle":
        out.update(num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.top_k_experts)
    if draft.d2t is not None:
        out["draft_vocab_size"] = int(draft.d2t.numel())
    out[EXPORT_MARK] = {"format": fmt, "layout": layout, "draft_config": dataclasses.asdict(cfg),
                        "target": getattr(tc, "_name_or_path", ""), "feature": FEATURE,
                        "feature_layers": [tc.num_hidden_layers], "exported_from": origin}
    return out


def _check_out(out: Path) -> None:
    """``out`` may be written: missing, empty, or a previous export of ours holding only its own files."""
    if out.exists() and not out.is_dir():
        raise PathError(f"--out {out} is a file; give a folder")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    ours = EXPORT_MARK in (read_json(out / HEAD_CONFIG) or {})
    foreign = [n for n in entries if n not in (HEAD_CONFIG, HEAD_WEIGHTS[0])]
    if not ours or foreign:
        what = f"also holds {', '.join(foreign[:3])}" if ours else "holds no export of ours"
        raise PathError(f"--out {out} is not empty and {what}: give a new or empty folder (a previous export is "
                        "replaced, nothing else)")


def export_head(draft: DraftModel, target_model: nn.Module, fmt: str, out: str | Path, origin: str = "") -> Path:
    """``draft`` written to ``out`` in ``fmt`` (``eagle``, ``eagle3``, ``jakiro``): config.json and
    model.safetensors with the target's embedding and, for a reduced vocabulary, ``d2t`` / ``t2d``. Refused in
    one line before anything is written where the format cannot hold the draft or ``out`` holds other files."""
    out = Path(out)
    tc = target_model.config
    layout = export_layout(draft.cfg, tc.hidden_size, draft.mlp.experts[0].width, fmt)
    _check_out(out)
    state = {theirs(layout, k): v.detach().cpu().contiguous() for k, v in draft.state_dict().items() if k != "d2t"}
    state[EMBED] = target_model.get_input_embeddings().weight.detach().cpu().contiguous()
    if draft.d2t is not None:
        state.update(vocab_to_head(draft.d2t, tc.vocab_size))
    config = _export_config(draft, target_model, layout, fmt, origin)
    with atomic_path(out) as tmp:
        tmp.mkdir()
        save_file(state, str(tmp / HEAD_WEIGHTS[0]))
        (tmp / HEAD_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out

