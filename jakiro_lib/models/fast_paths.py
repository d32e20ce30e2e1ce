"""The target's attention, RMSNorm and layer fast paths (docs/DESIGN.md section 9); none changes the math beyond
rounding (tested): ``sdpa_gqa`` (SDPA's own grouped KV heads, where transformers copies the cache per layer under a
custom mask), :func:`use_fused_norm` (one call where transformers' RMSNorm makes six: the package's kernel on the CPU)
and :func:`lean_forward` (the decoder's layers without transformers' per-call machinery, equal bit for bit)."""
from __future__ import annotations

import types
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward

GQA_ATTENTION = "sdpa_gqa"
# transformers' RMSNorm of each supported family: weight * (x / rms(x)), the norm in fp32, eps variance_epsilon
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
# the families whose decoder layers lean_forward runs: pre-norm attention with RoPE, then a SwiGLU MLP
LEAN_FAMILIES = ("llama", "mistral", "qwen2")
LEAN = "_jakiro_lean"  # the model attribute that says decoding forwards run lean_forward (checked at load)
PANELS = "_jakiro_layer_panels"  # the model attribute caching what decoder_layers runs the layers with (_layer_panels)
SCREEN = "_jakiro_head_screen"  # the model attribute holding greedy_argmax's screen (head_screen), None for none
SCREENED = "_jakiro_head_screened"  # the head weight's version counter when its screen was made (set_head_screen)
# the most query rows attend_rows serves (a tree's): the packed GEMM's most, so that every tree it serves scores
# each row as a plain step would; SDPA beyond, and for prefills
ATTEND_ROWS = 64
ATTEND_HEAD_SIZES = (16, 32, 64, 128)  # head sizes the kernel serves with 8- or 16-lane registers


def _sdpa_gqa(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, with grouped KV heads handled by SDPA itself under any mask; a decoding step's
    few rows (one, or a tree's under its additive mask) through the package's kernel where it serves
    (:func:`attend_rows`)."""
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = q_len > 1 and attention_mask is None and causal
    if not causal and not dropout:
        out = attend_rows(query, key, value, attention_mask, scaling)
        if out is not None:
            return out, None
    if causal and key.shape[2] > q_len:  # empty static cache at prefill: SDPA's causal mask is top-left
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def attend_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                scale: float | None = None) -> torch.Tensor | None:
    """Attention [1, n, heads, D] of a decoding step's ``query`` [1, heads, n, D] over ``key`` and ``value`` [1, KV
    heads, S, D], under an additive fp32 ``mask``, a boolean one (True: seen) or none, by the package's kernel
    (``stream_gemm.cpp``): a tree row's output equal bit for bit to the same row's over its path alone, as a plain
    step computes it; None where the kernel does not serve (more than :data:`ATTEND_ROWS` rows, batches, autograd,
    other head sizes or dtypes)."""
    n, D = query.shape[2], query.shape[3]
    if (n > ATTEND_ROWS or query.shape[0] != 1 or D not in ATTEND_HEAD_SIZES or key.shape[1] == 0
            or query.shape[1] % key.shape[1] or key.dtype != query.dtype
            or (mask is not None and mask.dtype not in (query.dtype, torch.bool))):
        return None
    kernel = _kernel_without_grad("attend", query, key, value)
    if kernel is None:
        return None
    return kernel(query, key, value, mask, D ** -0.5 if scale is None else scale)


def write_kv(stack: torch.Tensor, slot: int, keys: torch.Tensor, values: torch.Tensor,
             start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's ``keys`` and ``values`` [B, KV heads, n, D] written into its ``slot`` of the cache buffer ``stack``
    [layers, 2, B, KV heads, capacity, D] at positions ``start``.., and the slot's keys and values up to there
    returned (views): in one call of the package's kernel where it serves, else by views and copies (autograd, other
    dtypes or devices)."""
    kernel = _kernel_without_grad("kv_write", keys, values)
    if kernel is not None:
        return kernel(stack, slot, keys, values, start)
    end = start + keys.shape[-2]
    stack[slot, 0, :, :, start:end], stack[slot, 1, :, :, start:end] = keys, values
    return stack[slot, 0, :, :, :end], stack[slot, 1, :, :, :end]


def _register_gqa_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_ATTENTION, _sdpa_gqa)
    AttentionMaskInterface.register(GQA_ATTENTION, sdpa_mask)


def use_gqa_attention(model: nn.Module) -> bool:
    """Switch an SDPA model on the CPU to :func:`_sdpa_gqa`; True when switched (or already)."""
    cfg = model.config
    if cfg._attn_implementation == GQA_ATTENTION:
        return True
    if cfg._attn_implementation != "sdpa" or next(model.parameters()).device.type != "cpu":
        return False  # on CUDA a masked GQA call would leave the flash kernels
    _register_gqa_attention()
    model.set_attn_implementation(GQA_ATTENTION)
    return cfg._attn_implementation == GQA_ATTENTION


def _fused_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm forward in one call: without autograd, where :func:`_kernel` serves, the package's kernel
    (``stream_gemm.cpp``, each row alone; equal to transformers' to rounding); else torch's ``rms_norm``, the norm in
    fp32, then the weight in the input's dtype, as transformers rounds (fp32: the weight inside; equal to it bit for
    bit on the CPU, on CUDA up to the fused reduction's rounding). Tested."""
    weight = self._parameters["weight"]  # not through nn.Module.__getattr__: 61 calls a SmolLM2 forward
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        kernel = _kernel_without_grad("rms_norm", x, weight)
        if kernel is not None:
            return kernel(x, weight, self.variance_epsilon)
        return F.rms_norm(x, weight.shape, weight, self.variance_epsilon)
    return weight * F.rms_norm(x.float(), weight.shape, None, self.variance_epsilon).to(x.dtype)


def use_fused_norm(model: nn.Module) -> int:
    """Every transformers RMSNorm of ``model`` (:data:`RMS_NORMS`) run by :func:`_fused_norm_forward`; how many."""
    norms = [m for m in model.modules() if type(m).__name__ in RMS_NORMS and hasattr(m, "variance_epsilon")]
    for norm in norms:
        norm.forward = types.MethodType(_fused_norm_forward, norm)
    return len(norms)


def lean_fits(model: nn.Module) -> bool:
    """Whether ``model``'s layers are the kind :func:`lean_forward` runs (a :data:`LEAN_FAMILIES` decoder on SDPA,
    ours or transformers', SiLU MLPs, no hooks); :func:`jakiro_lib.models.target.load_target` then checks it."""
    cfg = model.config
    return (cfg.model_type in LEAN_FAMILIES and getattr(cfg, "hidden_act", None) == "silu"
            and getattr(cfg, "pretraining_tp", 1) == 1 and cfg._attn_implementation in (GQA_ATTENTION, "sdpa")
            and not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it: x cos + rotate_half(x) sin."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def turned_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with its first half negated: rotate_half(x) sin = [x2, x1] turned_sin (a negation is exact), made once
    for all of a forward's layers."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), -1)


def rope_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              turned: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_rope` of queries and keys [B, heads, n, D] under cos and sin [B, 1, n, D]: without autograd, where
    :func:`_kernel` serves, one call of the package's kernel (``stream_gemm.cpp``, the same roundings: equal bit for bit);
    else torch's operators over queries and keys as one tensor (elementwise, so equal bit for bit too): 6 kernels a
    layer where two calls of :func:`_rope` are 10, 5 given ``turned`` (:func:`turned_sin` of ``sin``), on a GPU where
    a step's time follows its kernels."""
    kernel = _kernel_without_grad("rope", q, k)
    if kernel is not None:
        return kernel(q, k, cos, sin)
    # [B, q heads + k heads, n, D], laid out as [B, n, heads, D] as the projections' views are (elementwise operators
    # keep the layout, and SDPA's output follows the queries': a contiguous tree would copy it back, once a layer)
    x = torch.cat((q.transpose(1, 2), k.transpose(1, 2)), 2).transpose(1, 2)
    if turned is None:
        both = _rope(x, cos, sin)
    else:
        half = x.shape[-1] // 2
        both = x * cos + torch.cat((x[..., half:], x[..., :half]), -1) * turned
    return both[:, :q.shape[1]], both[:, q.shape[1]:]


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of [m, V] logits: where :func:`_kernel` serves, the package's kernel (the same index:
    the first of equal maxima, the first NaN); else torch's."""
    kernel = _kernel("argmax", logits) if logits.dim() == 2 else None
    return kernel(logits) if kernel is not None else logits.argmax(-1)


def head_screen(model: nn.Module) -> tuple[torch.Tensor, ...] | None:
    """What :func:`greedy_argmax` screens ``model``'s head with: its weight [V, K] in the streaming GEMM's int8 panels
    (laid out for the integer screen where the kernel has one, AMX's tiles or AVX-512 VNNI: activations rounded to
    int16, exact integer sums), each word's scale (max_k |w_ck| / 127), each word's bound factor [V]: the largest
    rounding of its weights in the copy, max_k |scale_c q_ck - w_ck| (measured: at most half a step), plus both fp32
    dot products' accumulation error (2.02 K 2^-24 max_k |w_ck|), with 1% to spare for the screen's own roundings, plus
    2^-100; and each word's l1 [V], sum_k |scale_c q_ck| (rounded up), which the integer screen's bound takes times the
    activations' rounding (DESIGN section 9); a quarter of the head's memory once more. None where the package's
    kernel is not loaded or the head is not a bias-free, finite fp32 CPU linear."""
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear or head.bias is not None or _kernel("greedy_head", head.weight) is None:
        return None
    w = head.weight.detach()  # [V, K]
    if not bool(torch.isfinite(w).all()):
        return None
    ops = torch.ops.jakiro_stream_gemm
    screen, scales = ops.pack_int8(w, ops.tile_screen())  # int8 panels, their scales [ceil(V / L) L]
    V, K = w.shape
    rows = screen.transpose(1, 2) if screen.dim() == 3 else screen.permute(0, 2, 1, 3)  # [P, L, K] or [P, L, Kt/4, 4]
    words = rows.reshape(rows.shape[0] * rows.shape[1], -1)[:V, :K]  # [V, K] int8, word by word
    rounding, l1 = torch.empty(V, dtype=torch.float64), torch.empty(V, dtype=torch.float64)
    for i in range(0, V, 4096):  # each word's copy in fp64: exact
        copy = words[i:i + 4096].double() * scales[i:min(i + 4096, V), None].double()
        rounding[i:i + 4096] = (copy - w[i:i + 4096].double()).abs().amax(1)
        l1[i:i + 4096] = copy.abs().sum(1)
    bound = 1.01 * (rounding + 2.02 * K * 2.0 ** -24 * w.abs().amax(1).double()) + 2.0 ** -100
    return screen, scales, bound.float(), (l1 * (1 + 2.0 ** -20)).float()


def _version(weight: torch.Tensor) -> int | None:
    """The tensor's version counter (in-place changes move it); None for an inference tensor, which keeps none."""
    try:
        return weight._version
    except RuntimeError:
        return None


def set_head_screen(model: nn.Module, on: bool = True) -> None:
    """``model``'s head screen (:func:`head_screen`; ``on`` False: none), with the version of the weights it stands
    for."""
    model.__dict__[SCREEN] = head_screen(model) if on else None
    model.__dict__[SCREENED] = _version(model.lm_head.weight) if on else None


def current_screen(model: nn.Module) -> tuple[torch.Tensor, ...] | None:
    """``model``'s head screen, made again where the head's weight has changed in place since (its version counter
    moved): a screen of other weights would rule out the true argmax."""
    screen = model.__dict__.get(SCREEN)
    if screen is not None and model.__dict__.get(SCREENED) != _version(model.lm_head.weight):
        set_head_screen(model)
        screen = model.__dict__[SCREEN]
    return screen


def greedy_argmax(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Each row's argmax [n] of ``model``'s logits for its last hidden states ``hidden`` [n, K]: where the model
    holds a :func:`head_screen` and :func:`_kernel` serves, the package's kernel, which reads the head's int8 copy and
    then only the few words the screen cannot rule out (each logit in fp32, one FMA per k in k's order, the first of
    equal maxima: the argmax of the logits as the streaming GEMM computes them); else :func:`argmax_rows` of the
    head's logits."""
    kernel = _kernel("greedy_head", hidden)  # None inside a compiled graph: the screen is not looked at there
    screen = None if kernel is None else current_screen(model)
    if screen is None:
        return argmax_rows(model.lm_head(hidden))
    return kernel(hidden, *screen, model.lm_head.weight)  # screen: the int8 panels, their scales, bounds, l1


def sampled_argmax(model: nn.Module, hidden: torch.Tensor, draws: torch.Tensor,
                   temperature: float) -> torch.Tensor | None:
    """Each row's draw [n] from softmax(logits / ``temperature``) of ``model``'s logits for ``hidden`` [n, K], one
    row's from its ``draws`` [n] (float64 uniforms) alone: the package's kernel, argmax_c (l_c + T g_c) with g_c Gumbel
    noise of the row's draw (the Gumbel-max identity) and l_c the logits as :func:`greedy_argmax` computes them,
    found through the same screen (DESIGN section 9); None where the kernel or the screen does not serve."""
    kernel = _kernel("sampled_head", hidden) if temperature > 0 else None
    screen = None if kernel is None else current_screen(model)
    return None if screen is None else kernel(hidden, *screen, model.lm_head.weight, draws, temperature)


_kernels: dict[str, tuple[int, Any]] = {}  # op name -> (libraries loaded when last looked up, the op or None)


def _kernel(name: str, x: torch.Tensor) -> Any:
    """The package's C++ op ``name`` for ``x``: where ``x`` is fp32 on the CPU outside a compiled graph and
    ``kernels.stream_gemm_available`` has loaded the op, else None (looked up again only when torch has loaded
    another library; this module imports nothing of the package)."""
    if torch.compiler.is_compiling() or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    loaded = len(torch.ops.loaded_libraries)
    seen, op = _kernels.get(name, (-1, None))
    if seen != loaded:
        op = getattr(torch.ops.jakiro_stream_gemm, name, None)
        _kernels[name] = (loaded, op)
    return op


def _kernel_without_grad(name: str, x: torch.Tensor, *others: torch.Tensor) -> Any:
    """:func:`_kernel` ``name`` for ``x``, or None where autograd would need a gradient through ``x`` or ``others`` (the
    package's ops have no backward)."""
    if torch.is_grad_enabled() and (x.requires_grad or any(t.requires_grad for t in others)):
        return None
    return _kernel(name, x)


def _layer_panels(model: nn.Module, gemm: Any) -> tuple[list[torch.Tensor], list[int], float] | None:
    """What the package's ``decoder_layers`` runs ``model``'s layers with, as the Python loop of :func:`lean_forward`
    would run them: each layer's input norm weight, q, k, v and o panels, post-attention norm weight, gate, up and
    down panels, then q, k and v's biases where they have them; the projections' output sizes; the norms' eps. None
    where a projection is not on the streaming GEMM, or has a bias other than those, or a norm is not
    :func:`_fused_norm_forward` over an fp32 weight. Cached with ``gemm``, the packed GEMM it is read from
    (``kernels.PackedGemm``, which marks each linear it packs with itself and its packed copy)."""
    cached = model.__dict__.get(PANELS)
    if cached is not None and cached[0] is gemm:
        return cached[1]
    panels = None
    if gemm.streams:
        weights, eps, biased = [], set(), set()
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            linears = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            biases = [x.bias for x in linears[:3] if x.bias is not None]
            if (any(getattr(x.forward, "__func__", None) is not _fused_norm_forward
                    or x.weight.dtype != torch.float32 for x in norms) or len(biases) % 3
                    or any(x.bias is not None for x in linears[3:])
                    or any(x.__dict__.get("_jakiro_gemm") is not gemm for x in linears)):
                break
            weights += [norms[0].weight, *(x._jakiro_packed for x in linears[:4]), norms[1].weight,
                        *(x._jakiro_packed for x in linears[4:]), *biases]
            eps |= {x.variance_epsilon for x in norms}
            biased.add(bool(biases))
        else:
            if len(eps) == 1 and len(biased) == 1:
                panels = (weights, [x.out_features for x in linears], eps.pop())
    model.__dict__[PANELS] = (gemm, panels)
    return panels


def _packed_gemm(model: nn.Module) -> Any:
    """The ``kernels.PackedGemm`` that packed ``model``'s first decoder layer's q projection, or None."""
    return model.model.layers[0].self_attn.q_proj.__dict__.get("_jakiro_gemm")


def _fused_layers(model: nn.Module, h: torch.Tensor, mask: torch.Tensor | None,
                  stack: torch.Tensor | None) -> Any:
    """The package's ``decoder_layers`` op with what it runs ``model``'s layers with, where it serves ``h`` [1, n,
    H] and ``mask`` over ``stack``; else None."""
    n = h.shape[1]
    if (stack is None or model.config._attn_implementation != GQA_ATTENTION
            or (mask.dtype != torch.float32 if mask is not None else n > 1)):  # maskless rows past one: causal
        return None
    op, gemm = _kernel_without_grad("decoder_layers", h), _packed_gemm(model)
    if op is None or gemm is None or not (gemm.active and gemm.min_rows <= n <= gemm.max_rows):
        return None
    panels = _layer_panels(model, gemm)
    return None if panels is None else (op, panels)


def lean_forward(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None,
                 layers: Sequence[Any], stack: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
    """The decoder's last hidden states [n, H] of ``ids`` [n] at positions ``pos`` [n]: the operators of
    transformers' forward of a :data:`LEAN_FAMILIES` model in the same order, without its module calls, keyword
    plumbing and mask building (DESIGN section 9). ``mask``: additive [1, 1, n, S], or None for one row
    or a prefill from position 0 (causal); ``layers``: the cache's, each
    ``update(k, v)`` returning the keys and values to attend; ``stack``: where given, their one buffer [layers, 2, 1,
    KV heads, capacity, D], written from ``start``, so that a decoding step's layers run in one call of the package's
    ``decoder_layers`` where it serves (the same hidden states bit for bit)."""
    decoder, n = model.model, ids.shape[0]
    attend = _sdpa_gqa if model.config._attn_implementation == GQA_ATTENTION else sdpa_attention_forward
    h = decoder.embed_tokens(ids[None])  # [1, n, H]
    cos, sin = decoder.rotary_emb(h, pos[None])  # [1, n, D]
    cos, sin = cos[:, None], sin[:, None]
    fused = _fused_layers(model, h, mask, stack)
    if fused is not None:
        (op, (weights, outs, eps)), attn = fused, decoder.layers[0].self_attn
        rows = ATTEND_ROWS if attn.head_dim in ATTEND_HEAD_SIZES else 0  # the kernel's rows, as _sdpa_gqa's
        return decoder.norm.forward(op(h, weights, outs, stack, start, cos, sin, mask, attn.head_dim, eps,
                                       attn.scaling, rows))[0]
    turned = turned_sin(sin) if _kernel("rope", h) is None else None  # the negation once, not once a layer
    for layer, kv in zip(decoder.layers, layers):
        attn, mlp = layer.self_attn, layer.mlp
        x = layer.input_layernorm.forward(h)
        q, k, v = (p.forward(x).view(1, n, -1, attn.head_dim).transpose(1, 2)  # [1, heads, n, D]
                   for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = rope_pair(q, k, cos, sin, turned)
        k, v = kv.update(k, v)
        out, _ = attend(attn, q, k, v, mask, scaling=attn.scaling)  # [1, n, heads, D]
        h = h + attn.o_proj.forward(out.reshape(1, n, -1))
        x = layer.post_attention_layernorm.forward(h)
        h = h + mlp.down_proj.forward(F.silu(mlp.gate_proj.forward(x)) * mlp.up_proj.forward(x))
    return decoder.norm.forward(h)[0]
