import itertools

import numpy as np
import pytest

from kdtree import trees


def _all_nodes(lp, max_depth):
    """Every rank path of length 1..max_depth with its score (brute force)."""
    depth, k = lp.shape
    out = {}
    for d in range(1, max_depth + 1):
        for path in itertools.product(range(k), repeat=d):
            out[path] = sum(lp[i, r] for i, r in enumerate(path))
    return out


@pytest.mark.parametrize("budget", [1, 5, 20, 40])
def test_ddtree_is_the_top_budget_nodes_by_score(budget):
    rng = np.random.default_rng(budget)
    lp = trees.draft_logprobs(4, 3, rng)
    parents = trees.ddtree(budget, lp)
    assert len(parents) == budget + 1
    # rebuild each node's rank path from the tree: children of a node are added in rank order
    paths = {0: ()}
    for i in range(1, len(parents)):
        sib = [j for j in range(1, i) if parents[j] == parents[i]]
        paths[i] = paths[parents[i]] + (len(sib),)
    chosen = {paths[i] for i in range(1, len(parents))}
    scores = _all_nodes(lp, 4)
    best = set(sorted(scores, key=lambda p: -scores[p])[:budget])
    assert chosen == best


def test_ddtree_respects_depth_and_order():
    rng = np.random.default_rng(0)
    p = trees.ddtree(256, trees.draft_logprobs(15, 8, rng))
    assert len(p) == 257 and p[0] == -1
    assert np.all(p[1:] < np.arange(1, 257))
    assert trees.depths(p).max() <= 15


def test_ddtree_budget_too_large_is_refused():
    with pytest.raises(ValueError, match="exceeds"):
        trees.ddtree(10, trees.draft_logprobs(1, 3, np.random.default_rng(0)))


@pytest.mark.parametrize("kind", trees.TREE_KINDS)
@pytest.mark.parametrize("n", [1, 2, 8, 65])
def test_every_kind_gives_a_topological_tree_of_n_nodes(kind, n):
    p = trees.make_tree(kind, n, np.random.default_rng(n), topk=4 if kind == "eagle" else 8)
    assert len(p) == n and p[0] == -1
    assert np.all(p[1:] >= 0) and np.all(p[1:] < np.arange(1, n))


def test_chain_and_star_shapes():
    assert trees.depths(trees.chain(16)).tolist() == list(range(16))
    assert trees.depths(trees.star(5)).tolist() == [0, 1, 1, 1, 1]


def test_mask_round_trip_on_random_trees():
    rng = np.random.default_rng(3)
    for n in (1, 2, 7, 64, 300):
        p = trees.random_tree(n, rng)
        m = trees.ancestor_mask(p)
        assert np.array_equal(trees.parents_from_mask(m), p)
        # row i sees exactly its path to the root
        for i in rng.integers(0, n, 5):
            path, j = {int(i)}, int(i)
            while p[j] >= 0:
                j = int(p[j])
                path.add(j)
            assert set(np.flatnonzero(m[i]).tolist()) == path


def test_bad_parents_are_refused():
    with pytest.raises(ValueError):
        trees.depths(np.array([-1, 2, 0]))
