"""Shared scaffolding for the engine tests: tiny targets, seeded prompts, reference computations that do
not go through the code under test (no KV cache, no tree masks), and drafters built from the target itself.

* :class:`OracleDrafter` proposes the target's own greedy continuation as a tree: at every level the
  correct child sits at a random position among random distractor siblings (which get random subtrees
  of their own), optionally wrong at a chosen depth. Used to prove that long paths are accepted and that
  the KV gather after verification is right.
* :class:`TargetTopKDrafter` proposes, at every node, the top-k tokens of the target's own warped
  distribution (computed without a cache). Used by the sampling tests: drafts are then accepted often
  AND rejected often, so both the acceptance and the residual path of the verifier are exercised.
"""
from __future__ import annotations

import contextlib
import functools
import random
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch

from jakiro_lib.config import DraftConfig, TargetConfig
from jakiro_lib.data.conversations import Conversation
from jakiro_lib.data.dataset import collate
from jakiro_lib.data.features import target_top1
from jakiro_lib.models.draft import DraftModel
from jakiro_lib.models.target import load_target
from jakiro_lib.models.loss import draft_loss
from reference.tree import Tree
from jakiro_lib.decoding.verify import SamplingParams

FAMILIES = ("llama", "qwen2", "mistral")


@functools.lru_cache(maxsize=None)
def tiny_target(family: str = "llama", max_context: int = 512):
    """The random tiny target (hidden 64, vocab 260, lm_head sharpened), fp32 on CPU, eval mode."""
    return load_target(TargetConfig(model=f"tiny:{family}", max_context=max_context, dtype="float32",
                                    device="cpu")).model


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Tiny models are overhead-bound: one intra-op thread is much faster (and stable on a shared box)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def random_prompts(n: int, seed: int, min_len: int = 2, max_len: int = 48, vocab: int = 256) -> list[torch.Tensor]:
    """Seeded random byte-id prompts of varied lengths."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab, (L,), generator=g) for L in lens]


@torch.inference_mode()
def full_logits(model, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """Last-position logits from a plain causal forward of ``ids`` (no cache): the reference."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    return model(input_ids=ids[None]).logits[0, -1].float()


def reference_warp(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    """Temperature, then top-k, then top-p (smallest set of most likely tokens with mass >= top_p), in float64.

    Written independently of ``jakiro_lib.decoding.verify.warp_probs``; the expected distributions of the
    sampling tests come from here.
    """
    z = logits.double().numpy() / params.temperature
    keep = np.ones(z.shape[0], dtype=bool)
    if params.top_k:
        kth = np.sort(z)[::-1][min(params.top_k, z.shape[0]) - 1]
        keep &= z >= kth
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass, kept = 0.0, np.zeros_like(keep)
        for i in order:
            if mass >= params.top_p:
                break
            kept[i] = True
            mass += p[i]
        p = np.where(kept, p, 0.0)
        p /= p.sum()
    return p


class _Builder:
    """Accumulates nodes depth by depth, then emits a valid :class:`Tree` with shuffled in-level indices."""

    def __init__(self, root: int) -> None:
        self.levels: list[list[tuple[int, int]]] = [[(root, -1)]]  # per depth: (token, parent slot in level above)

    def add(self, depth: int, token: int, parent_slot: int) -> int:
        while len(self.levels) <= depth:
            self.levels.append([])
        self.levels[depth].append((token, parent_slot))
        return len(self.levels[depth]) - 1

    def build(self, rng: random.Random) -> tuple[Tree, dict[tuple[int, int], int]]:
        """Returns the tree and the map (depth, slot) -> node index. Siblings keep their insertion order."""
        index: dict[tuple[int, int], int] = {}
        tokens, parents, depths = [], [], []
        for d, level in enumerate(self.levels):
            order = list(range(len(level)))
            if d > 0:
                # Interleave nodes of different parents at random, but keep each parent's children in
                # the order they were added (that order is the proposal order the verifier tries).
                keys = {s: rng.random() for s in order}
                by_parent: dict[int, list[int]] = {}
                for s in order:
                    by_parent.setdefault(level[s][1], []).append(s)
                ranked = sorted(order, key=lambda s: keys[s])
                queues = {p: list(v) for p, v in by_parent.items()}
                order = [queues[level[s][1]].pop(0) for s in ranked]
            for s in order:
                token, parent_slot = level[s]
                index[(d, s)] = len(tokens)
                tokens.append(token)
                parents.append(-1 if d == 0 else index[(d - 1, parent_slot)])
                depths.append(d)
        return Tree(torch.tensor(tokens, dtype=torch.long), parents, torch.tensor(depths)), index


class OracleDrafter:
    """Drafts the target's greedy continuation, hidden among random distractors.

    ``depth`` levels; every node on the correct path gets ``width`` children: the correct token (at a
    random position among its siblings) and ``width - 1`` distinct wrong ones; each distractor gets a
    random subtree (``distractor_children`` children per level) down to ``depth``. With
    ``wrong_depth = d`` the correct token is left out at depth d, so exactly d tokens (d - 1 accepted +
    the bonus) come out of each cycle.
    """

    def __init__(self, model, depth: int, width: int = 3, *, wrong_depth: int | None = None,
                 distractor_children: int = 1, vocab: int = 256, seed: int = 0) -> None:
        self.model = model
        self.depth = depth
        self.width = width
        self.wrong_depth = wrong_depth
        self.distractor_children = distractor_children
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.seq: list[int] = []
        self.line: list[int] = []  # the greedy trajectory through ``seq``, extended on demand
        self.cycles = 0
        self.trees: list[Tree] = []

    # -- Drafter protocol ---------------------------------------------------------------------------
    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor, root: int) -> None:
        assert hidden.shape[0] == prompt_ids.shape[0]
        self.seq = prompt_ids.tolist() + [root]

    def accept(self, hidden: torch.Tensor, new_tokens: list[int]) -> None:
        assert hidden.shape[0] == len(new_tokens)  # one feature per kept position (root + accepted)
        self.seq += list(new_tokens)

    def propose(self) -> Tree:
        self.cycles += 1
        truth = self._truth(self.depth)
        b = _Builder(self.seq[-1])
        slot = 0  # slot of the current correct node in its level
        for d in range(1, self.depth + 1):
            correct = truth[d - 1]
            n_wrong = self.width - 1 + (1 if d == self.wrong_depth else 0)
            wrong = self._distinct(correct, n_wrong)
            kids: list[int | None] = list(wrong)
            if d != self.wrong_depth:
                kids.insert(self.rng.randrange(len(kids) + 1), None)  # None marks the correct child
            next_slot = None
            for tok in kids:
                s = b.add(d, correct if tok is None else tok, slot)
                if tok is None:
                    next_slot = s
                else:
                    self._subtree(b, d, s)
            if next_slot is None:
                break
            slot = next_slot
        tree, _ = b.build(self.rng)
        self.trees.append(tree)
        return tree

    # -- internals ------------------------------------------------------------------------------------
    def _truth(self, n: int) -> list[int]:
        """The next ``n`` greedy tokens after ``seq`` (cache-free forwards, one per new token overall)."""
        if self.line[: len(self.seq)] != self.seq:
            self.line = list(self.seq)
        while len(self.line) < len(self.seq) + n:
            self.line.append(int(full_logits(self.model, self.line).argmax()))
        return self.line[len(self.seq): len(self.seq) + n]

    def _distinct(self, avoid: int, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            t = self.rng.randrange(self.vocab)
            if t != avoid and t not in out:
                out.append(t)
        return out

    def _subtree(self, b: _Builder, d: int, slot: int) -> None:
        if d >= self.depth:
            return
        for _ in range(self.distractor_children):
            s = b.add(d + 1, self.rng.randrange(self.vocab), slot)
            self._subtree(b, d + 1, s)


class TargetTopKDrafter:
    """At every node, the top-``k`` tokens of the target's own warped distribution; a full ``k``-ary tree.

    Target probabilities come from cache-free forwards, memoised by context (sampling tests reuse the
    same short prompt thousands of times).
    """

    def __init__(self, model, params: SamplingParams, k: int = 3, depth: int = 2) -> None:
        self.model = model
        self.params = params
        self.k = k
        self.depth = depth
        self.seq: list[int] = []
        self._memo: dict[tuple[int, ...], list[int]] = {}

    def begin(self, prompt_ids: torch.Tensor, hidden: torch.Tensor, root: int) -> None:
        self.seq = prompt_ids.tolist() + [root]

    def accept(self, hidden: torch.Tensor, new_tokens: list[int]) -> None:
        self.seq += list(new_tokens)

    def _fill(self, contexts: list[tuple[int, ...]]) -> None:
        """Top-k of every context not seen yet, in one batched forward (contexts of one level share a length)."""
        todo = sorted({c for c in contexts if c not in self._memo})
        if not todo:
            return
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor(todo, dtype=torch.long)).logits[:, -1].float()
        for c, lg in zip(todo, logits):
            p = reference_warp(lg, self.params)
            self._memo[c] = np.argsort(-p, kind="stable")[: self.k].tolist()

    def propose(self) -> Tree:
        tokens, parents, depths = [self.seq[-1]], [-1], [0]
        frontier = [(0, tuple(self.seq))]
        for d in range(1, self.depth + 1):
            self._fill([ctx for _, ctx in frontier])
            nxt = []
            for node, ctx in frontier:
                for t in self._memo[ctx]:
                    tokens.append(t)
                    parents.append(node)
                    depths.append(d)
                    nxt.append((len(tokens) - 1, ctx + (t,)))
            frontier = nxt
        return Tree(torch.tensor(tokens), parents, torch.tensor(depths))


# -- statistics ---------------------------------------------------------------------------------------

def chi2_test(samples: list[tuple], probs: dict[tuple, float], min_expected: float = 5.0) -> tuple[float, float, int]:
    """Pearson chi-square of observed ``samples`` against exact cell probabilities ``probs``.

    Cells whose expected count is below ``min_expected`` (and every cell not listed in ``probs``) are
    merged into one "rest" cell with the remaining probability; if that cell is still too small it is
    merged with the smallest listed cells. Returns (statistic, p-value, number of cells).
    """
    from collections import Counter

    from scipy.stats import chisquare

    n = len(samples)
    counts = Counter(samples)
    cells = sorted((c for c, p in probs.items() if p * n >= min_expected), key=lambda c: -probs[c])
    obs = [counts[c] for c in cells]
    exp = [probs[c] * n for c in cells]
    rest_obs, rest_exp = n - sum(obs), max(n - sum(exp), 0.0)
    while rest_exp < min_expected and obs:
        rest_obs += obs.pop()
        rest_exp += exp.pop()
    obs.append(rest_obs)
    exp.append(rest_exp)
    exp = [e * n / sum(exp) for e in exp]  # exact sums for scipy (float rounding only)
    if len(obs) < 2:
        raise AssertionError("degenerate chi-square: a single cell")
    stat, p = chisquare(obs, exp)
    return float(stat), float(p), len(obs)


# The one rule every statistical test of the suite goes through. Seeds are fixed, but the samples are not
# the same on every machine: the drafts under test are trained inside the tests and their weights follow the
# machine's kernels (bf16 units or not), so each kind of CPU draws its own samples, and with some twenty
# chi-square tests at 1e-3 a new kind of machine failed the suite now and then (p = 2.1e-4 on an AMD EPYC
# with avx512_bf16, 2026-11-26; p = 0.16-0.47 with three other seeds). A first p-value below ALPHA_FIRST
# therefore triggers a second, independent sample, SECOND_FACTOR times larger, that decides at ALPHA_SECOND:
# a correct sampler fails with probability at most ALPHA_FIRST * ALPHA_SECOND = 1e-7 per test on any
# machine, and a broken one must fail both stages (the power checks go through the same rule).
ALPHA_FIRST = 1e-3
ALPHA_SECOND = 1e-4
SECOND_FACTOR = 2
SECOND_SEED = 7919  # added to the first stage's seed: the second sample shares no draws with the first


@dataclass(frozen=True)
class Chi2Stage:
    n: int
    stat: float
    p: float
    cells: int


@dataclass(frozen=True)
class Chi2Verdict:
    """The outcome of :func:`two_stage_chi2`: one stage, or two when the first rejected."""

    stages: tuple[Chi2Stage, ...]
    passed: bool

    @property
    def first(self) -> Chi2Stage:
        return self.stages[0]

    def __str__(self) -> str:
        parts = [f"n={s.n}: chi2 {s.stat:.1f}, {s.cells} cells, p {s.p:.3g}" for s in self.stages]
        return f"{'pass' if self.passed else 'reject'} ({'; then '.join(parts)})"


def two_stage_chi2(draw: Callable[[int, int], list[tuple]], probs: dict[tuple, float], n: int, seed: int, *,
                   alpha_first: float = ALPHA_FIRST) -> Chi2Verdict:
    """Does ``draw(n, seed)`` (a list of n sampled tuples) follow ``probs``? :func:`chi2_test` on a first
    sample; where its p falls below ``alpha_first``, a second, independent sample of ``SECOND_FACTOR * n``
    decides at :data:`ALPHA_SECOND`. ``alpha_first=1.0`` forces the second stage (the rule's own test)."""
    def stage(size: int, s: int) -> Chi2Stage:
        return Chi2Stage(size, *chi2_test(draw(size, s), probs))

    first = stage(n, seed)
    if first.p > alpha_first:
        return Chi2Verdict((first,), True)
    second = stage(SECOND_FACTOR * n, seed + SECOND_SEED)
    return Chi2Verdict((first, second), second.p > ALPHA_SECOND)


@torch.inference_mode()
def exact_prefix_distribution(model, prompt: list[int], params: SamplingParams, n_tokens: int,
                              min_prob: float) -> dict[tuple, float]:
    """Exact probabilities of the first ``n_tokens`` sampled tokens, from cache-free target forwards.

    p(x1) p(x2 | x1) ... with :func:`reference_warp`; prefixes with probability below ``min_prob`` are not
    expanded (their mass ends up in the chi-square's "rest" cell).
    """
    frontier: dict[tuple, float] = {(): 1.0}
    for _ in range(n_tokens):
        prefixes = [c for c, p in frontier.items() if p >= min_prob]
        batch = torch.tensor([list(prompt) + list(c) for c in prefixes], dtype=torch.long)
        logits = model(input_ids=batch).logits[:, -1].float()
        nxt: dict[tuple, float] = {}
        for c, lg in zip(prefixes, logits):
            p = reference_warp(lg, params)
            for t in np.flatnonzero(p * frontier[c] >= min_prob):
                nxt[c + (int(t),)] = frontier[c] * float(p[t])
        frontier = nxt
    return frontier


def peaked_target(family: str = "llama", factor: float = 3.0):
    """The tiny target with its lm_head sharpened ``factor`` more (a random init is still high-entropy at
    T=1: top-1 ~0.2). Sampling tests want peaked distributions, where drafts are accepted AND rejected often.
    """
    import copy

    model = copy.deepcopy(tiny_target(family))
    with torch.no_grad():
        model.lm_head.weight.mul_(factor)
    return model


# -- drafts trained on the tiny target (so that FeatureDrafter's drafted tokens are accepted) --------------

TRAINED_DRAFTS = {  # name: architecture; each trained once per session by :func:`trained_draft`
    "dense": DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False, contrastive=False,
                         intermediate_size="target"),
    # Jakiro's draft with per-expert training: its experts' own outputs (decoupled candidates) predict too
    "moe2": DraftConfig(num_experts=2, top_k_experts=2, expert_loss="gate"),
}
TRAIN_STEPS = 300
TRAIN_WINDOW = 40  # tokens per training row: random windows of the corpus (cheaper steps than whole rows)


@functools.lru_cache(maxsize=None)
@torch.inference_mode()
def greedy_corpus(model, n_per_length: int = 12, lengths: tuple[int, ...] = (4, 20, 36, 52), new: int = 48,
                  seed: int = 99) -> list[torch.Tensor]:
    """Seeded random prompts continued greedily by ``model`` (cache-free batched forwards, one length per
    batch): the tiny target's own text, which a draft can learn to predict."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for L in lengths:
        seq = torch.randint(0, 256, (n_per_length, L), generator=g)
        for _ in range(new):
            seq = torch.cat([seq, model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
        out += list(seq)
    return out


@functools.lru_cache(maxsize=None)
def _trained_state(name: str, family: str = "llama") -> dict[str, torch.Tensor]:
    """Weights of draft ``name`` trained TRAIN_STEPS steps (batch 16, no noise) on :func:`greedy_corpus`."""
    model = tiny_target(family)
    with single_thread():
        seqs = greedy_corpus(model)
    with torch.inference_mode():
        hiddens = [model.model(input_ids=s[None]).last_hidden_state[0] for s in seqs]
        items = [{"input_ids": s, "hidden": h, "loss_mask": torch.ones(len(s)), "target_top1": target_top1(model, h)}
                 for s, h in zip(seqs, hiddens)]
    with single_thread():
        torch.manual_seed(0)
        draft = DraftModel.build(TRAINED_DRAFTS[name], model).train()
        opt = torch.optim.AdamW(draft.parameters(), lr=3e-3)
        g = torch.Generator().manual_seed(0)
        for _ in range(TRAIN_STEPS):
            picks = torch.randint(0, len(items), (16,), generator=g).tolist()
            starts = torch.randint(0, 1 + len(seqs[0]) // 2, (16,), generator=g).tolist()
            batch = collate([_window(items[i], s, TRAIN_WINDOW) for i, s in zip(picks, starts)])
            loss, _ = draft_loss(draft, batch, noise_amplitude=0.0, p_weight=1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return {k: v.detach().clone() for k, v in draft.state_dict().items()}


def _window(item: dict[str, torch.Tensor], start: int, n: int) -> dict[str, torch.Tensor]:
    return {k: v[start:start + n] for k, v in item.items()}


def trained_draft(model, name: str):
    """Draft ``name`` of :data:`TRAINED_DRAFTS`, trained on the tiny llama's features, borrowing ``model``'s
    embedding and lm_head (e.g. a :func:`peaked_target` copy: same features, sharper head); eval mode."""
    draft = DraftModel.build(TRAINED_DRAFTS[name], model)
    draft.load_state_dict(_trained_state(name))
    return draft.eval()


def drafted_per_cycle(result) -> float:
    """Mean drafted tokens accepted per verification cycle (the bonus token not counted)."""
    return (sum(result.accepted) - len(result.accepted)) / max(len(result.accepted), 1)


class _Storages(torch.utils._python_dispatch.TorchDispatchMode):
    """The storages a function's operators read or write that it did not make itself (its buffers and
    arguments, as a CUDA graph sees them), and its host reads (a CUDA graph's capture fails on one)."""

    HOST_READS = ("aten.item.default", "aten._local_scalar_dense.default", "aten.is_nonzero.default")  # bool(t)

    def __init__(self) -> None:
        super().__init__()
        self.made: set[int] = set()
        self.outside: set[int] = set()
        self.host_reads = 0
        self.kernels: list[tuple[str, tuple]] = []  # each operator with its tensors' shapes, in order

    def __enter__(self):
        """Also counts ``tolist``, which reaches no operator under inference mode."""
        self._tolist, mode = torch.Tensor.tolist, self

        def tolist(t: torch.Tensor):
            mode.host_reads += 1
            return mode._tolist(t)
        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.host_reads += str(func) in self.HOST_READS
        self.kernels.append((str(func), tuple(tuple(t.shape) for t in torch.utils._pytree.tree_leaves((args, kwargs))
                                              if isinstance(t, torch.Tensor))))
        for t in torch.utils._pytree.tree_leaves((args, kwargs or {})):
            if isinstance(t, torch.Tensor) and t.numel():
                ptr = t.untyped_storage().data_ptr()
                if ptr not in self.made:
                    self.outside.add(ptr)
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel():
                self.made.add(t.untyped_storage().data_ptr())
        return out


class DispatchedOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The operators dispatched while :attr:`inside` is set (from the start unless ``inside`` is False), views left
    out: what a GPU runs as kernels, one each."""

    VIEWS = ("view", "slice", "select", "unsqueeze", "expand", "alias", "as_strided", "permute", "transpose")

    def __init__(self, inside: bool = True) -> None:
        super().__init__()
        self.inside, self.ops = inside, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func).split(".")[1]
        if self.inside and name not in self.VIEWS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class RecordingGraph:
    """A stand-in for :func:`jakiro_lib.decoding.compiled.cuda_graph` on a CPU. Recording runs nothing (as CUDA's);
    each replay runs the step over the recorded arguments and fails where it reads the host (a capture would
    fail), touches other outside storages than the first replay did (a tensor attribute set anew between
    cycles: a real graph would go on reading the old one) or runs other kernels or shapes than the first replay
    (a graph replayed under another attention window than it was recorded for: a real one would run the recorded
    window's). ``replays`` counts them."""

    def __init__(self) -> None:
        self.replays = 0

    def __call__(self, step: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...]) -> Callable[[], torch.Tensor]:
        recorded: list[_Storages] = []

        def replay() -> torch.Tensor:
            with _Storages() as seen:
                out = step(*args)
            assert seen.host_reads == 0, "the step reads the host"
            if not recorded:
                recorded.append(seen)
            assert seen.outside == recorded[0].outside, "the replayed step touched buffers the first replay did not"
            assert seen.kernels == recorded[0].kernels, "the replayed step ran other kernels or shapes than recorded"
            self.replays += 1
            return out
        return replay


WORDS = "the cat sat on a mat while dogs ran far away and birds sang in tall green trees".split()


def word_conversations(n: int = 12, n_long_prompt: int = 2, long_chars: int = 200) -> list[Conversation]:
    """``n`` short conversations of common words, plus ``n_long_prompt`` (inserted from the sixth on, so a shard
    of a few holds one) whose prompt of ``long_chars`` characters fills a ``max_length`` of up to that many tokens
    (the tiny tokenizer's are bytes): an empty loss mask, skipped."""
    convs = []
    for i in range(n):
        q = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(3 + i % 4))
        a = " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(4 + i % 5))
        convs.append(Conversation(f"c{i}", [{"role": "user", "content": q}, {"role": "assistant", "content": a}]))
    for j in range(n_long_prompt):
        convs.insert(5 + j, Conversation(f"long{j}", [{"role": "user", "content": "x" * long_chars},
                                                       {"role": "assistant", "content": "ok"}]))
    return convs
