"""Token trees (jakiro_lib.decoding.tree): masks, paths, leaves, children order, and the EAGLE-2 top-N selection."""
from __future__ import annotations

import random

import pytest
import torch

from reference.tree import GRAFTED_RANK, CandidatePool, Tree


def _tree(tokens, parents, depths=None) -> Tree:
    if depths is None:
        depths = []
        for p in parents:
            depths.append(0 if p < 0 else depths[p] + 1)
    return Tree(torch.tensor(tokens), list(parents), torch.tensor(depths))


#        0
#      /   \
#     1     2
#    / \     \
#   3   4     5
#       |
#       6
HAND = dict(tokens=[10, 11, 12, 13, 14, 15, 16], parents=[-1, 0, 0, 1, 1, 2, 4])


def test_hand_tree_structure():
    t = _tree(**HAND)
    assert len(t) == 7
    assert t.children == [[1, 2], [3, 4], [5], [], [6], [], []]
    assert t.leaves() == [3, 5, 6]
    assert t.path_to(0) == [0]
    assert t.path_to(6) == [0, 1, 4, 6]
    assert t.path_to(5) == [0, 2, 5]
    assert t.path_to(3) == [0, 1, 3]
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]


def test_hand_tree_ancestor_mask():
    t = _tree(**HAND)
    expected = torch.tensor([
        # 0  1  2  3  4  5  6
        [1, 0, 0, 0, 0, 0, 0],  # 0
        [1, 1, 0, 0, 0, 0, 0],  # 1
        [1, 0, 1, 0, 0, 0, 0],  # 2
        [1, 1, 0, 1, 0, 0, 0],  # 3
        [1, 1, 0, 0, 1, 0, 0],  # 4
        [1, 0, 1, 0, 0, 1, 0],  # 5
        [1, 1, 0, 0, 1, 0, 1],  # 6
    ], dtype=torch.bool)
    mask = t.ancestor_mask()
    assert mask.dtype == torch.bool
    assert torch.equal(mask, expected)


def test_single_node_tree():
    t = _tree([7], [-1])
    assert t.leaves() == [0]
    assert t.path_to(0) == [0]
    assert torch.equal(t.ancestor_mask(), torch.tensor([[True]]))


def test_chain():
    t = Tree.chain([5, 6, 7, 8])
    assert t.tokens.tolist() == [5, 6, 7, 8]
    assert t.parents == [-1, 0, 1, 2]
    assert t.depths.tolist() == [0, 1, 2, 3]
    assert t.children == [[1], [2], [3], []]
    assert t.leaves() == [3]
    assert t.path_to(3) == [0, 1, 2, 3]
    assert torch.equal(t.ancestor_mask(), torch.ones(4, 4, dtype=torch.bool).tril())


def test_children_keep_index_order():
    # Children lists follow node index (proposal) order, whatever the interleaving of parents.
    t = _tree([0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 2, 1, 2, 0])
    assert t.children[0] == [1, 2, 6]
    assert t.children[2] == [3, 5]
    assert t.children[1] == [4]


@pytest.mark.parametrize("parents", [[-1, 1], [-1, 0, 3, 0], [-1, -1], [-1, 0, 5], [-1, 0, 1, 3]])
def test_invalid_parent_raises(parents):
    with pytest.raises(ValueError):
        Tree(torch.zeros(len(parents), dtype=torch.long), parents, torch.zeros(len(parents), dtype=torch.long))


def _random_tree(rng: random.Random, m: int) -> Tree:
    parents = [-1] + [rng.randrange(i) for i in range(1, m)]
    return _tree([rng.randrange(100) for _ in range(m)], parents)


def test_random_trees_mask_matches_paths():
    rng = random.Random(0)
    for _ in range(50):
        t = _random_tree(rng, rng.randint(1, 30))
        mask = t.ancestor_mask()
        leaves = set(t.leaves())
        for i in range(len(t)):
            path = t.path_to(i)
            assert path[0] == 0 and path[-1] == i
            assert all(t.parents[b] == a for a, b in zip(path, path[1:]))
            assert int(t.depths[i]) == len(path) - 1
            assert set(mask[i].nonzero().flatten().tolist()) == set(path)
            assert (i in leaves) == (not t.children[i])


# -- CandidatePool ------------------------------------------------------------------------------------

def test_pool_add_clamps_to_parent_score():
    pool = CandidatePool.with_root(1)
    a = pool.add(2, 0, -0.5)
    b = pool.add(3, a, +0.7)  # a positive "log-prob" must not lift a child above its parent
    c = pool.add(4, b, -0.1 - 0.5)
    assert pool.scores == [0.0, -0.5, -0.5, -0.6]
    assert pool.depths == [0, 1, 2, 3]
    assert pool.parents == [-1, 0, a, b]
    assert c == 3


@pytest.mark.parametrize("parent", [1, 5, -1, -2])
def test_pool_add_invalid_parent_raises(parent):
    pool = CandidatePool.with_root(1)
    with pytest.raises((ValueError, IndexError)):
        pool.add(2, parent, -0.1)
    assert pool.tokens == [1]  # nothing half-added


def test_select_ties_keep_parents():
    # A chain of zero log-prob children has the same score as the root path: ties go to the shallower node.
    pool = CandidatePool.with_root(100)
    a = pool.add(1, 0, 0.0)
    b = pool.add(2, a, 0.0)
    pool.add(3, b, 0.0)
    pool.add(4, 0, -0.1)  # a sibling of a, slightly worse
    t = pool.select(3)
    assert t.tokens.tolist() == [100, 1, 2]
    assert t.parents == [-1, 0, 1]
    t = pool.select(4)
    assert t.tokens.tolist() == [100, 1, 2, 3]
    t = pool.select(5)
    assert sorted(t.tokens.tolist()) == [1, 2, 3, 4, 100]
    assert t.children[0] == [1, 2] and t.tokens[t.children[0]].tolist() == [1, 4]  # best first


def test_select_ties_added_deep_first():
    # Ties broken by depth even when the deeper node has the smaller index in a sibling's subtree.
    pool = CandidatePool.with_root(0)
    x = pool.add(1, 0, -1.0)
    y = pool.add(2, x, -1.0)  # depth 2, tie with z
    pool.add(3, 0, -1.0)  # z: depth 1, added later
    pool.add(4, y, -1.0)  # depth 3, tie
    t = pool.select(3)
    assert sorted(t.tokens.tolist()) == [0, 1, 3]
    t = pool.select(4)
    assert sorted(t.tokens.tolist()) == [0, 1, 2, 3]


def test_select_children_best_first_and_sizes():
    pool = CandidatePool.with_root(9)
    for tok, s in [(1, -2.0), (2, -0.5), (3, -1.0)]:
        pool.add(tok, 0, s)
    t = pool.select(10)  # more than available: everything is kept
    assert len(t) == 4
    assert t.tokens[t.children[0]].tolist() == [2, 3, 1]
    t = pool.select(3)
    assert len(t) == 3 and t.tokens[t.children[0]].tolist() == [2, 3]
    t = pool.select(2)
    assert t.tokens.tolist() == [9, 2]
    t = pool.select(1)
    assert t.tokens.tolist() == [9] and t.leaves() == [0]


def test_select_chain():
    pool = CandidatePool.with_root(5)
    node = 0
    for tok in [6, 7, 8, 9, 10]:
        node = pool.add(tok, node, pool.scores[node] - 0.3)
    t = pool.select(60)
    ref = Tree.chain([5, 6, 7, 8, 9, 10])
    assert t.tokens.tolist() == ref.tokens.tolist()
    assert t.parents == ref.parents and t.depths.tolist() == ref.depths.tolist()
    t = pool.select(3)
    assert t.tokens.tolist() == [5, 6, 7] and t.parents == [-1, 0, 1]


def _random_pool(rng: random.Random, n: int) -> CandidatePool:
    pool = CandidatePool.with_root(10_000)
    for i in range(n):
        parent = rng.randrange(len(pool.tokens))
        r = rng.random()
        logp = 0.0 if r < 0.3 else (-rng.choice([0.5, 1.0]) if r < 0.5 else -rng.expovariate(1.0))
        pool.add(i, parent, pool.scores[parent] + logp)  # unique tokens: i
    return pool


def test_select_random_pools_are_top_n_trees():
    rng = random.Random(1)
    for trial in range(200):
        pool = _random_pool(rng, rng.randint(1, 40))
        total = rng.randint(1, 45)
        t = pool.select(total)
        n = len(pool.tokens)
        assert len(t) == min(total, n)
        # Map back through the unique tokens.
        idx = [0] + [pool.tokens.index(tok) for tok in t.tokens.tolist()[1:]]
        assert t.tokens[0] == 10_000
        for i in range(1, len(t)):
            # the tree's parent is the pool's parent, depths agree, parents precede children
            assert idx[t.parents[i]] == pool.parents[idx[i]]
            assert int(t.depths[i]) == pool.depths[idx[i]]
            assert t.parents[i] < i
        kept, dropped = set(idx[1:]), set(range(1, n)) - set(idx[1:])
        if kept and dropped:
            assert min(pool.scores[i] for i in kept) >= max(pool.scores[i] for i in dropped)
        for c in t.children:
            scores = [pool.scores[idx[j]] for j in c]
            assert scores == sorted(scores, reverse=True)


def _walk(tree: Tree, chain: list[int]) -> list[int]:
    """Nodes reached from the root by following ``chain`` token by token (stops where it cannot)."""
    node, path = 0, []
    for t in chain:
        node = next((c for c in tree.children[node] if int(tree.tokens[c]) == t), None)
        if node is None:
            break
        path.append(node)
    return path


def test_graft_follows_existing_nodes_then_adds_the_rest_as_a_chain():
    tree = Tree(torch.tensor(HAND["tokens"]), HAND["parents"],
                torch.tensor([0, 1, 1, 2, 2, 2, 3]), ranks=[-1, 0, 1, 2, 3, 4, 5])
    g = tree.graft([11, 14, 20, 21])  # 11 -> 14 exist (nodes 1, 4); 20, 21 are new under node 4
    assert g.tokens.tolist() == HAND["tokens"] + [20, 21] and g.parents == HAND["parents"] + [4, 7]
    assert g.depths.tolist()[-2:] == [3, 4] and g.children[4] == [6, 7] and g.children[7] == [8]
    assert g.ranks[-2:] == [GRAFTED_RANK] * 2 and g.ranks[:7] == tree.ranks
    assert tree.graft([12, 15]) is tree and tree.graft([]) is tree  # already a path: nothing to add
    assert Tree(torch.tensor([5]), [-1], torch.tensor([0])).graft([6, 7]).parents == [-1, 0, 1]
    assert _tree([1, 2], [-1, 0]).graft([3]).ranks == []  # trees without ranks stay without


def test_graft_random_trees_keep_the_tree_and_hold_the_chain():
    rng = random.Random(7)
    for _ in range(200):
        m = rng.randint(1, 12)
        tree = _random_tree(rng, m)
        tree.tokens = torch.tensor([rng.randrange(4) for _ in range(m)])  # small alphabet: frequent overlaps
        chain = [rng.randrange(4) for _ in range(rng.randint(1, 6))]
        g = tree.graft(chain)
        assert g.parents[:m] == tree.parents and g.tokens[:m].tolist() == tree.tokens.tolist()
        assert len(_walk(g, chain)) == len(chain)  # the chain is a root path of the grafted tree
        assert len(g) - m == len(chain) - len(_walk(tree, chain))  # only the missing part was added
        assert torch.equal(g.ancestor_mask()[:m, :m], tree.ancestor_mask())
