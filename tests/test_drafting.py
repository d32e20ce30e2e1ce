"""Prompt lookup and the lookup-branch drafter (jakiro_lib.decoding.drafting): proposals against a brute-force
reference, and the drafter protocol around a feature drafter."""
from __future__ import annotations

import copy
import math
import random
from dataclasses import dataclass

import pytest
import torch

from jakiro_lib.config import DraftConfig, TreeConfig
from jakiro_lib.models.draft import DraftModel, DraftOutput
from jakiro_lib.decoding.drafting import PromptLookup, children
from jakiro_lib.models import kernels
from reference.drafting import FeatureDrafter, LookupDrafter, make_drafter

from helpers import tiny_target


def _brute_force(history: list[int], num: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Latest earlier occurrence of the longest suffix n-gram; continuation repeated with its period."""
    for n in range(min(max_ngram, len(history)), min_ngram - 1, -1):
        suffix = history[len(history) - n:]
        for start in range(len(history) - 1, n - 1, -1):  # start: position right after the occurrence
            if history[start - n:start] == suffix:
                period = len(history) - start
                return [history[start + i % period] for i in range(num)]
    return []


def test_prompt_lookup_matches_brute_force_as_tokens_arrive():
    rng = random.Random(0)
    for trial in range(60):
        lookup = PromptLookup(5, max_ngram=rng.randint(1, 4), min_ngram=1)
        lookup.min_ngram = rng.randint(1, lookup.max_ngram)
        alphabet = rng.randint(2, 8)
        history = [rng.randrange(alphabet) for _ in range(rng.randint(1, 6))]
        lookup.reset(history)
        for _ in range(12):
            assert lookup.propose() == _brute_force(history, 5, lookup.max_ngram, lookup.min_ngram), (trial, history)
            new = [rng.randrange(alphabet) for _ in range(rng.randint(1, 3))]
            history += new
            lookup.extend(new)


def test_prompt_lookup_cases():
    lookup = PromptLookup(4, max_ngram=2, min_ngram=2)
    lookup.reset([1, 2, 3, 9, 1, 2])
    assert lookup.propose() == [3, 9, 1, 2]  # continuation of the earlier "1 2", wrapping around
    lookup.reset([5, 6, 7])
    assert lookup.propose() == []  # nothing recurs
    lookup.reset([4, 4, 4])
    assert lookup.propose() == [4, 4, 4, 4]
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookup(4, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="num_tokens"):
        PromptLookup(0)
    with pytest.raises(ValueError, match="lookup"):
        TreeConfig(lookup_tokens=-1)


def test_lookup_drafter_grafts_the_chain_and_forwards_the_protocol():
    model = tiny_target("llama")
    torch.manual_seed(0)
    draft = DraftModel.build(DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False,
                                         contrastive=False), model).eval()
    tree = TreeConfig(depth=2, top_k=2, total_tokens=3)
    assert isinstance(make_drafter(draft, tree), FeatureDrafter)
    with pytest.raises(ValueError, match="lookup_tokens"):
        make_drafter(None, tree)  # nothing would propose tokens
    alone = make_drafter(None, TreeConfig(lookup_tokens=3))
    assert isinstance(alone, LookupDrafter) and alone.inner is None and alone.stats.forwards == 0
    drafter = make_drafter(draft, TreeConfig(depth=2, top_k=2, total_tokens=3, lookup_tokens=4, lookup_min_ngram=1))
    assert isinstance(drafter, LookupDrafter) and drafter.stats is drafter.inner.stats
    prompt = torch.tensor([7, 8, 9, 7, 8])
    with torch.inference_mode():
        hidden = model.model(input_ids=prompt[None]).last_hidden_state[0]
        drafter.begin(prompt, hidden, root=9)  # history 7 8 9 7 8 9: "8 9" recurs, followed by 7 8 9 ...
        t = drafter.propose()
    assert int(t.tokens[0]) == 9 and len(t) >= 3 and drafter.grafted == len(t) - 3
    node = 0
    for token in (7, 8, 9, 7):  # the chain is a root path of the tree
        node = next(c for c in t.children[node] if int(t.tokens[c]) == token)
    pos = drafter.inner.pos
    with torch.inference_mode():
        drafter.accept(hidden[:2], [7, 5])
    assert drafter.lookup.history[-3:] == [9, 7, 5] and drafter.inner.pos == pos + 2 and drafter.inner.root == 5


def _reference_candidates(draft: DraftModel, tree: TreeConfig, out: DraftOutput) -> dict[int, tuple[float, int]]:
    """One node, token by token: {target token: (score, expert backing it most)} over the union of each
    selected expert's top children."""
    sel = [int(e) for e in (out.gates > 0).nonzero().flatten()]
    gates = {e: float(out.gates[e]) / float(out.gates[sel].sum()) for e in sel}
    logp = {e: draft.logits(out.experts[e]).log_softmax(-1) for e in sel}
    per_expert = tree.children_per_expert or tree.top_k
    union = {int(t) for e in sel for t in logp[e].topk(per_expert).indices}
    result = {}
    for t in union:
        terms = {e: float(logp[e][t]) + (math.log(gates[e]) if tree.scoring == "mixture" else 0.0) for e in sel}
        score = math.log(sum(math.exp(v) for v in terms.values())) if tree.scoring == "mixture" else max(terms.values())
        result[int(draft.to_target_ids(torch.tensor(t)))] = (score, max(terms, key=terms.get))
    return result


@pytest.mark.parametrize("experts,top_k,per_expert,scoring", [(2, 4, None, "mixture"), (4, 4, None, "best"),
                                                              (4, 3, 1, "mixture"), (2, 5, 2, "best")])
def test_decoupled_candidates_match_a_per_node_reference(experts, top_k, per_expert, scoring):
    """The frontier-wide scoring keeps, for every node, the top_k best-scored tokens of the union (fewer
    when the union is smaller), with the reference's scores, each carrying its backing expert's feature."""
    model = tiny_target("llama")
    torch.manual_seed(experts + top_k)
    draft = DraftModel.build(DraftConfig(num_experts=experts, top_k_experts=2, branch_b=False, contrastive=False),
                             model).eval()
    tree = TreeConfig(depth=2, top_k=top_k, total_tokens=8, decoupled=True, children_per_expert=per_expert,
                      scoring=scoring)
    drafter = FeatureDrafter(draft, tree)
    H = model.config.hidden_size
    with torch.inference_mode():
        outs = draft(torch.randn(1, 6, H), torch.randint(0, 200, (1, 6)), torch.arange(6)[None])
        rows = [outs.map(lambda x, i=i: x[0, i]) for i in range(6)]
        got = drafter._candidates(rows)
        for row, cands in zip(rows, got):
            ref = _reference_candidates(draft, tree, row)
            assert len(cands) == min(top_k, len(ref)) and len({t for t, _, _ in cands}) == len(cands)
            kth = sorted((s for s, _ in ref.values()), reverse=True)[len(cands) - 1]
            for token, score, feat in cands:
                assert score == pytest.approx(ref[token][0], abs=1e-5) and score >= kth - 1e-5
                assert torch.equal(feat, row.experts[ref[token][1]])
    if per_expert == 1:  # 2 selected experts x 1 child each: the union is smaller than top_k somewhere
        assert all(len(c) <= 2 for c in got)


@pytest.mark.parametrize("rows,per_expert,k,weighted", [(1, 4, 4, False), (2, 4, 4, True), (2, 3, 4, False),
                                                         (3, 1, 5, True), (2, 2, 3, False), (1, 2, 5, False)])
def test_children_in_one_kernel_call_are_torchs(monkeypatch, rows, per_expert, k, weighted):
    """``children`` on a CPU (one call of stream_gemm.cpp's draft_children) chooses the words, scores and backing rows
    that torch's operators do, with words shared between rows (the union's duplicates) and unions smaller than k."""
    if not kernels.stream_gemm_available():
        pytest.skip("the streaming GEMM's extension is not built here")
    torch.manual_seed(rows * 10 + k)
    logits = 3 * torch.randn(5, rows, 300)
    logits[:, 1:, :150] = logits[:, :1, :150]  # the rows agree on half the words
    weights = torch.rand(5, rows) + 0.1 if weighted else None
    calls = []
    op = torch.ops.jakiro_stream_gemm.draft_children
    monkeypatch.setattr(torch.ops.jakiro_stream_gemm, "draft_children", lambda *a: calls.append(1) or op(*a),
                        raising=False)
    fused = children(logits, weights, k, per_expert)
    monkeypatch.setattr(kernels, "stream_gemm_available", lambda: False)
    ops = children(logits, weights, k, per_expert)
    assert calls == [1]
    found = ops[1].isfinite()  # -inf: fewer distinct words than k (their order among equals is torch's to choose)
    distinct = [len(set(t.tolist())) for t in logits.topk(per_expert, dim=-1).indices.flatten(1)]
    assert found.sum(1).tolist() == [min(k, d) for d in distinct]
    assert torch.equal(fused[0][found], ops[0][found]) and torch.equal(fused[2][found], ops[2][found])
    torch.testing.assert_close(fused[1], ops[1], rtol=0, atol=1e-5)


def test_children_off_the_cpu_never_ask_for_the_cpu_kernels(monkeypatch):
    """A GPU run's children go through torch's operators without building the CPU kernels (half a minute)."""
    monkeypatch.setattr(kernels, "stream_gemm_available", lambda: pytest.fail("asked for the CPU kernels"))
    ids, vals, rows = children(torch.randn(2, 2, 50, device="meta"), torch.rand(2, 2, device="meta"), 3, 3)
    assert ids.shape == vals.shape == rows.shape == (2, 3) and ids.device.type == "meta"


def test_rewind_lets_every_timed_cycle_draft_from_the_same_context():
    model = tiny_target("llama")
    torch.manual_seed(0)
    draft = DraftModel.build(DraftConfig(num_experts=2), model).eval()
    drafter = FeatureDrafter(draft, TreeConfig(depth=3, top_k=2, total_tokens=6, decoupled=True))
    ids = torch.arange(10, 30)
    hidden = torch.randn(20, model.config.hidden_size)
    trees = []
    with torch.inference_mode():
        drafter.begin(ids, hidden, 7)
        for _ in range(2):
            drafter.accept(hidden[:2], [3, 4])
            drafter.rewind(20)
            assert drafter.pos == 20 and drafter.cache.k.shape[2] == 20
            trees.append(drafter.propose().tokens.tolist())
    assert trees[0] == trees[1]
    for bad in (0, 21):
        with pytest.raises(ValueError, match="rewind"):
            drafter.rewind(bad)


# -- the draft's tree attention and CEPD's branch-B parents, against references without a cache -----------

TREE_CASES = {  # name: (draft architecture, tree)
    "dense": (DraftConfig(mlp="dense", num_experts=1, top_k_experts=1, branch_b=False, contrastive=False),
              TreeConfig(depth=4, top_k=3, total_tokens=40)),
    "moe2-coupled": (DraftConfig(num_experts=2), TreeConfig(depth=4, top_k=3, total_tokens=40)),
    "moe2-decoupled": (DraftConfig(num_experts=2), TreeConfig(depth=4, top_k=3, total_tokens=40, decoupled=True)),
    "moe2-cepd-ar1": (DraftConfig(num_experts=2), TreeConfig(depth=5, top_k=3, total_tokens=40, ar_steps=1)),
    "moe4-decoupled-cepd-ar0": (DraftConfig(num_experts=4, top_k_experts=2),
                                TreeConfig(depth=5, top_k=3, total_tokens=40, ar_steps=0, decoupled=True)),
}


@dataclass
class _Forwarded:
    """What one tree node fed the draft, and what came out."""

    pool_index: int
    slot: int
    ancestors: list[int]
    feature: torch.Tensor
    token: int
    position: int
    out: DraftOutput


def _spy_forwards(drafter: FeatureDrafter) -> list[_Forwarded]:
    """Record every node of every tree-layer draft forward (pool index, draft-cache slot, inputs, output)."""
    seen: list[_Forwarded] = []
    real = drafter._forward_layer

    def spy(frontier, base, n_slots):
        real(frontier, base, n_slots)
        pool = drafter._pool
        for node in frontier:
            seen.append(_Forwarded(node.pool_index, node.slot, list(node.ancestors), node.feature.clone(),
                                   pool.tokens[node.pool_index], base - 1 + pool.depths[node.pool_index], node.out))

    drafter._forward_layer = spy
    return seen


def _cycle(drafter, seen, prefix_feats, prefix_tokens):
    """Propose one tree; check every forwarded node against a cache-free forward of the prefix, its
    forwarded ancestors and itself (their own features, tokens and positions)."""
    seen.clear()
    root_out = drafter.root_out
    drafter.propose()
    assert seen, "no tree layer was forwarded"
    by_slot = {f.slot: f for f in seen}
    P = prefix_feats.shape[0]
    for f in seen:
        chain = [by_slot[s] for s in f.ancestors] + [f]
        assert [c.position for c in chain] == sorted(c.position for c in chain) and chain[0].position >= P
        feats = torch.cat([prefix_feats, torch.stack([c.feature for c in chain])])
        toks = torch.cat([prefix_tokens, torch.tensor([c.token for c in chain])])
        pos = torch.cat([torch.arange(P), torch.tensor([c.position for c in chain])])
        ref = drafter.draft(feats[None], toks[None], pos[None])
        torch.testing.assert_close(f.out.a, ref.a[0, -1], atol=2e-5, rtol=1e-5)
        if ref.b is not None:
            torch.testing.assert_close(f.out.b, ref.b[0, -1], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(f.out.experts, ref.experts[0, -1], atol=2e-5, rtol=1e-5)
    return root_out


@pytest.mark.parametrize("case", list(TREE_CASES))
def test_tree_nodes_see_the_prefix_and_their_ancestors_at_their_positions(case):
    """The tree mask and position ids of every draft forward: each node's output equals a cache-free draft
    forward over the accepted prefix, then the node's forwarded ancestors, then itself (CEPD's skipped
    tokens are not forwarded and so not in the chain; their positions still count). Two cycles: after
    ``begin`` and after ``accept``."""
    model = tiny_target("llama")
    dcfg, tree = TREE_CASES[case]
    torch.manual_seed(11)
    draft = DraftModel.build(dcfg, model).eval()
    drafter = FeatureDrafter(draft, tree)
    seen = _spy_forwards(drafter)
    H = model.config.hidden_size
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (9,), generator=g)
    hidden = torch.randn(9, H, generator=g)
    with torch.inference_mode():
        drafter.begin(prompt, hidden, root=17)
        prefix_tokens = torch.cat([prompt[1:], torch.tensor([17])])
        _cycle(drafter, seen, hidden, prefix_tokens)
        more = torch.randn(3, H, generator=g)
        drafter.accept(more, [40, 41, 42])
        _cycle(drafter, seen, torch.cat([hidden, more]), torch.cat([prefix_tokens, torch.tensor([40, 41, 42])]))
    assert max(f.position for f in seen) == 11 + sum(drafter.steps[:-1])  # the deepest forwarded layer was checked


def _b_depths(steps: list[int]) -> set[int]:
    """Tree depths drafted by branch B (the second layer of each two-layer step)."""
    out, done = set(), 0
    for n in steps:
        done += n
        if n == 2:
            out.add(done)
    return out


@pytest.mark.parametrize("case", ["moe2-cepd-ar1", "moe4-decoupled-cepd-ar0"])
def test_branch_b_children_come_from_their_real_grandparent(case):
    """Every node drafted by branch B is a child of a frontier node n, scored by n's PARENT's branch-B
    distribution: n's B-children are exactly that grandparent's top-k, with cumulative scores, and they
    carry the grandparent's branch-B feature into the next forward. (The reference pairs branch-B row r
    with the r-th selected node instead: DESIGN.md section 3.) The target's lm_head is unsharpened here so
    that a layer's best nodes come from several parents, where a row mix-up shows."""
    model = copy.deepcopy(tiny_target("llama"))
    with torch.no_grad():
        model.lm_head.weight.div_(8.0)
    dcfg, tree = TREE_CASES[case]
    torch.manual_seed(2)
    draft = DraftModel.build(dcfg, model).eval()
    drafter = FeatureDrafter(draft, tree)
    seen = _spy_forwards(drafter)
    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(0, 256, (7,), generator=g)
    with torch.inference_mode():
        drafter.begin(prompt, torch.randn(7, model.config.hidden_size, generator=g), root=3)
        outs = {0: drafter.root_out}
        drafter.propose()
    pool = drafter._pool
    outs.update({f.pool_index: f.out for f in seen})
    carried = {f.pool_index: f.feature for f in seen}
    b_depths = _b_depths(drafter.steps)
    assert b_depths
    checked, grandparents = 0, {d: set() for d in b_depths}
    for n in range(len(pool.tokens)):
        kids = [c for c in range(len(pool.tokens)) if pool.parents[c] == n and pool.depths[c] in b_depths]
        if not kids:
            continue
        gp = pool.parents[n]
        grandparents[pool.depths[n] + 1].add(gp)
        top = draft.logits(outs[gp].b).float().log_softmax(-1).topk(tree.top_k)
        assert [pool.tokens[c] for c in kids] == draft.to_target_ids(top.indices).tolist(), (n, gp)
        for c, lp in zip(kids, top.values.tolist()):
            assert pool.scores[c] == pytest.approx(min(pool.scores[n] + lp, pool.scores[n]), abs=1e-5)
            if c in carried:
                assert torch.equal(carried[c], outs[gp].b)
        checked += 1
    assert checked == tree.top_k * len(b_depths)  # every B layer expands the top-k frontier
    # The reference's pairing (the i-th node of the layer with the i-th forwarded row) would be wrong here:
    mixed = 0
    for d in b_depths - {2}:
        rows = [f.pool_index for f in seen if pool.depths[f.pool_index] == d - 2]  # forwarded, in row order
        layer = sorted({pool.parents[c] for c in range(len(pool.tokens)) if pool.depths[c] == d},
                       key=lambda n: (-pool.scores[n], n))
        mixed += sum(pool.parents[n] != rows[min(i, len(rows) - 1)] for i, n in enumerate(layer))
    assert mixed > 0
