"""The target behind one preallocated KV cache, the runner the engine drives (gpt-fast's way): written at a host int
(the prefill, an eager cycle: attention reads what is written so far) or at a 0-dim device tensor (a captured cycle:
the first ``window`` positions under the caller's mask, nothing read on the host), an accepted path kept by moving
its entries inside the buffer (docs/DESIGN.md section 12)."""
from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin

from ..models import fast_paths
from ..models.draft_blocks import fixed_address
from ..models.target import additive_mask, cache_keyword, transformers_hidden
from .verify import SamplingParams, draw_rows

Draw = tuple[SamplingParams, torch.Tensor, bool]  # sampling's settings, each row's uniform [n], may the host be read
MAX_TREE_ROOM = 128  # cache positions kept past the text for a tree forward (a larger tree is refused)


class SlidingWindowError(ValueError):
    """The target's sliding window is shorter than the cache: its layers would attend differently from full ones."""


class _Where:
    """What a runner's layers share: where the next forward writes (a host int, or a 0-dim device tensor) and,
    with host positions, how many positions hold the text; with device positions, ``window``: how many leading
    positions attention reads (None: the whole buffer); and ``stack``, the one buffer every layer's keys and
    values live in, [L, 2, B, n_kv, capacity, head_dim] (made by the first layer's first write)."""

    def __init__(self, capacity: int) -> None:
        self.start: int | torch.Tensor = 0
        self.length = 0
        self.window: int | None = None
        self.cols: torch.Tensor | None = None  # device positions: the columns written [n], once for all layers
        self.capacity = capacity
        self.slots = 0  # layers in the stack (each KVLayer takes the next slot)
        self.stack: torch.Tensor | None = None  # one buffer: an accepted path moves with one gather and one scatter
        self.slot_ids = self.parts = None  # device positions: the writes' indices of the layers and of k and v

    def allocate(self, like: torch.Tensor) -> None:
        """``stack`` made at ``capacity`` positions for layers shaped like ``like`` [B, n_kv, n, head_dim]."""
        self.stack = fixed_address(like.new_zeros(self.slots, 2, *like.shape[:2], self.capacity, like.shape[-1]))
        self.slot_ids = torch.arange(self.slots, device=like.device)[:, None, None]  # [L, 1, 1]
        self.parts = torch.arange(2, device=like.device)[:, None]  # [2, 1]: keys, values

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's entries ``src`` copied to ``dst`` (index tensors; gathered first, so they may overlap)."""
        if self.stack is not None:
            self.stack.index_copy_(4, dst, self.stack.index_select(4, src))

    def move_path(self, start: int, path: list[int]) -> None:
        """Every layer's entries ``start + path`` (a host list of tree rows, root first) copied to ``start..``, each
        entry not already in place alone. A path's rows ascend (a parent precedes its children), so no entry is read
        after it was written."""
        if self.stack is not None:
            for i, row in enumerate(path):
                if row != i:
                    self.stack.select(4, start + i).copy_(self.stack.select(4, start + row))  # [L, 2, B, n_kv, D]


def _stack_view(part: int) -> property:
    """A KVLayer's keys (``part`` 0) or values (1): its view of the stack, None before its first write. Settable
    to None only (CacheLayerMixin's __init__ clears them; they live in the stack)."""
    def get(self: "KVLayer") -> torch.Tensor | None:
        stack = self.where.stack
        return None if stack is None or not self.is_initialized else stack[self.slot, part]

    def set(self: "KVLayer", value: None) -> None:
        if value is not None:
            raise AttributeError("a KVLayer's keys and values are its view of the runner's stack")
    return property(get, set)


class KVLayer(CacheLayerMixin):
    """One layer's keys and values, [1, n_kv, capacity, head_dim], written at ``where.start`` (see module): views of
    its slot in the runner's one buffer (``where.stack``), taken at each use (DESIGN section 12)."""

    is_compileable = True
    is_sliding = False

    def __init__(self, where: _Where) -> None:
        super().__init__()
        self.where, self.slot = where, where.slots
        where.slots += 1

    keys = _stack_view(0)
    values = _stack_view(1)

    @property
    def capacity(self) -> int:
        return self.where.capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        stack = self.where.stack
        if stack is None:
            self.where.allocate(key_states)
        elif stack.shape[2:4] + stack.shape[5:] != key_states.shape[:2] + key_states.shape[3:] or \
                stack.dtype != key_states.dtype:
            raise ValueError(f"layer {self.slot}'s keys {tuple(key_states.shape)} {key_states.dtype} differ from "
                             f"the first layer's; the target cache needs one shape in every full-attention layer")
        if value_states.shape != key_states.shape:
            raise ValueError(f"values {tuple(value_states.shape)} and keys {tuple(key_states.shape)} differ in "
                             "shape; the target cache needs them alike")
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, start = key_states.shape[-2], self.where.start
        if isinstance(start, int):
            if start + n > self.capacity:
                raise ValueError(f"{n} positions written at {start} pass the end of the runner's "
                                 f"{self.capacity}-position cache: give it the positions the text needs")
            return fast_paths.write_kv(self.where.stack, self.slot, key_states, value_states, start)
        where = self.where  # one write into the stack itself (writes into views made inductor copy it per layer)
        index = [where.slot_ids[self.slot], where.parts, None, None, where.cols[None]]  # [1, 1], [2, 1], [1, n]
        torch.ops.aten.index_put_(where.stack, index, torch.stack([key_states, value_states]).permute(0, 3, 1, 2, 4))
        return self.keys[:, :, :self.window], self.values[:, :, :self.window]

    @property
    def window(self) -> int:
        """Positions a forward with device positions reads (:class:`_Where`)."""
        return self.where.window or self.capacity

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        start = self.where.start
        return (start + query_length, 0) if isinstance(start, int) else (self.window, 0)

    def get_seq_length(self) -> int | torch.Tensor:
        return self.where.length if isinstance(self.where.start, int) else self.where.start

    def get_max_length(self) -> int:
        return self.capacity


class TargetRunner:
    """The target over one :class:`KVLayer` cache of ``capacity`` positions: the prefill (host positions), a tree
    scored and an accepted path kept with positions in device tensors (:meth:`score`, :meth:`move`). ``share``:
    another runner, to share its buffers (a compiled step binds to its buffers, and a 7B target's cache is large)."""

    def __init__(self, model: PreTrainedModel, capacity: int, *, share: "TargetRunner | None" = None) -> None:
        self.model, self.device, self.dtype = model, model.device, model.dtype
        if share is not None:
            self.where, self.cache = share.where, share.cache
        else:
            window = getattr(model.config, "sliding_window", None)
            if window is not None and getattr(model.config, "use_sliding_window", True) and capacity > window:
                raise SlidingWindowError(f"the target's sliding window ({window} positions) is shorter than the "
                                         f"{capacity}-position cache: lower target.max_context to fit the window")
            self.where = _Where(capacity)
            self.cache = Cache(layers=[KVLayer(self.where) for _ in range(model.config.num_hidden_layers)])
        self.capacity = capacity
        self.cols = torch.arange(capacity, device=self.device)
        self.cache_keyword = cache_keyword(model)

    @property
    def window(self) -> int:
        """Positions a forward with device positions reads (:class:`_Where`; the whole cache when unset)."""
        return self.where.window or self.capacity

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor | None, start: int | torch.Tensor,
                 greedy: bool = False, last: bool = False,
                 draw: Draw | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (``greedy``: each row's argmax, :func:`~jakiro_lib.models.fast_paths.greedy_argmax`; ``draw``: each
        row's draw, :func:`_draw`; ``last``: the last row's alone) and features [n] of ``ids`` [n] at positions
        ``pos`` [n], written from ``start``."""
        self.where.start = start
        host = not isinstance(start, torch.Tensor)
        self.where.cols = None if host else start + self.cols[:ids.shape[0]]
        lean = self.model.__dict__.get(fast_paths.LEAN)
        if lean and (mask is not None or host and (ids.shape[0] == 1 or start == 0)):
            stack = self.where.stack if host and start + ids.shape[0] <= self.capacity and all(
                layer.is_initialized for layer in self.cache.layers) else None  # every layer in one call
            hidden = fast_paths.lean_forward(self.model, ids, pos, mask, self.cache.layers, stack, start)
        else:  # transformers' forward: a causal block after the text, or a model the lean forward does not fit
            hidden = transformers_hidden(self.model, ids, pos, mask, self.cache, self.cache_keyword)
        rows = hidden[-1:] if last else hidden
        if draw is not None:
            return self._draw(rows, *draw), hidden
        return fast_paths.greedy_argmax(self.model, rows) if greedy else self.model.lm_head(rows), hidden

    def _draw(self, rows: torch.Tensor, params: SamplingParams, draws: torch.Tensor, sync: bool) -> torch.Tensor:
        """Each row's token [n] drawn from its distribution with its own uniform of ``draws`` [n]: through the head's
        screen where the kernel serves and only the temperature shapes the distribution
        (:func:`~jakiro_lib.models.fast_paths.sampled_argmax`), else by inverse CDF of the full logits (``sync``:
        the host may be read, :func:`~.verify.warp_probs`)."""
        temperature_only = params.top_k == 0 and params.top_p == 1.0
        chosen = fast_paths.sampled_argmax(self.model, rows, draws, params.temperature) if temperature_only else None
        return chosen if chosen is not None else draw_rows(self.model.lm_head(rows), params, draws, sync=sync)

    def prefill(self, ids: torch.Tensor, *, last: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (``last``: the last position's alone, [1, V]: the head's cost for one row, not the prompt's) and
        last hidden states (the lm_head input: the draft's features) of the prompt."""
        n = ids.shape[0]
        out = self._forward(ids, torch.arange(n, device=self.device), None, 0, last=last)
        self.where.length = n
        return out

    def score(self, tokens: torch.Tensor, depths: torch.Tensor, anc: torch.Tensor | None,
              start: int | torch.Tensor, greedy: bool = False,
              draw: Draw | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (``greedy``: each row's argmax; ``draw``: each row's draw) and features [m] of a tree (``anc`` [m, m])
        whose root sits at position ``start``: a 0-dim device tensor (attention over the first :attr:`window`
        positions), or a host int (eager: over the text and the tree, written where the text ends). ``anc`` None: one
        row that sees them all."""
        host = not isinstance(start, torch.Tensor)
        if host:
            self.where.length = start
        mask = None
        if anc is not None:
            cols = self.cols[:start + tokens.shape[0] if host else self.window]  # [W]
            mask = additive_mask(tree_rows(cols[None, :] < start, start, anc), self.dtype)[None, None]  # [1, 1, m, W]
        return self._forward(tokens, start + depths, mask, start, greedy, draw=draw)

    def move(self, start: torch.Tensor, path: torch.Tensor) -> None:
        """Entries ``start + path`` (tree rows, padded) moved to ``start..``."""
        self.where.move(start + path, start + self.cols[:path.shape[0]])

    def move_path(self, start: int, path: list[int]) -> None:
        """Eager: entries ``start + path`` (a host list of tree rows, root first) moved to ``start..``
        (:meth:`_Where.move_path`)."""
        self.where.move_path(start, path)


def tree_rows(allowed_prefix: torch.Tensor, start: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """[n, S] rows that see the first ``start`` positions, plus ``block`` [n, b] placed at start..start+b."""
    n, b = block.shape
    rows = allowed_prefix.expand(n, -1).clone()
    cols = start + torch.arange(b, device=block.device)  # [b]
    return rows.scatter_(1, cols.expand(n, -1), block)
