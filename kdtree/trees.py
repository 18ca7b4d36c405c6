"""Draft trees: generators (DDTree best-first, EAGLE, chain, star, random) and tree <-> mask helpers.

A tree is a `parents` array: `parents[0] == -1` (the root, the bonus token of the last step) and
`parents[i] < i` for every other node, i.e. nodes are in topological order, as SGLang requires.
"""

from __future__ import annotations

import heapq

import numpy as np

from kdtree.errors import BadInput

TREE_KINDS = ("ddtree", "eagle", "chain", "star", "random")


def _check_parents(parents: np.ndarray) -> np.ndarray:
    parents = np.asarray(parents, dtype=np.int64)
    if parents.ndim != 1 or parents.size == 0 or parents[0] != -1:
        raise ValueError("parents must be a non-empty 1-D array with parents[0] == -1")
    idx = np.arange(parents.size)
    if np.any(parents[1:] < 0) or np.any(parents[1:] >= idx[1:]):
        raise ValueError("parents[i] must lie in [0, i) for i > 0 (topological order)")
    return parents


def depths(parents: np.ndarray) -> np.ndarray:
    """Depth of every node (root = 0)."""
    parents = _check_parents(parents)
    d = np.zeros(parents.size, dtype=np.int64)
    for i in range(1, parents.size):
        d[i] = d[parents[i]] + 1
    return d


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """[N, N] bool: row i marks i and all its ancestors (what node i may attend to)."""
    parents = _check_parents(parents)
    n = parents.size
    m = np.zeros((n, n), dtype=bool)
    m[0, 0] = True
    for i in range(1, n):
        m[i] = m[parents[i]]
        m[i, i] = True
    return m


def parents_from_mask(block: np.ndarray) -> np.ndarray:
    """Inverse of `ancestor_mask` for a well-formed block: parent = deepest proper ancestor."""
    block = np.asarray(block, dtype=bool)
    n = block.shape[0]
    off = block & ~np.eye(n, dtype=bool)
    cols = np.arange(n)
    last = np.where(off, cols[None, :], -1).max(axis=1)
    last[0] = -1
    return last


def branching(parents: np.ndarray) -> np.ndarray:
    """Number of children of every node."""
    parents = _check_parents(parents)
    return np.bincount(parents[1:], minlength=parents.size)


def chain(n: int) -> np.ndarray:
    """A DFlash block without a tree: n nodes in a line (causal)."""
    if n < 1:
        raise ValueError("a chain needs at least one node")
    return np.arange(-1, n - 1, dtype=np.int64)


def star(n: int) -> np.ndarray:
    """Every node a child of the root."""
    if n < 1:
        raise ValueError("a star needs at least one node")
    p = np.zeros(n, dtype=np.int64)
    p[0] = -1
    return p


def random_tree(n: int, rng: np.random.Generator) -> np.ndarray:
    """Uniform random recursive tree: each node picks a parent among the earlier nodes."""
    if n < 1:
        raise ValueError("a tree needs at least one node")
    p = np.empty(n, dtype=np.int64)
    p[0] = -1
    for i in range(1, n):
        p[i] = rng.integers(0, i)
    return p


def draft_logprobs(depth: int, topk: int, rng: np.random.Generator, peak: float = 2.5) -> np.ndarray:
    """Per-position top-k log-probabilities of a drafter, sorted descending, [depth, topk].

    Confidence falls with the position in the block, as it does for DFlash/EAGLE drafters.
    """
    lp = np.empty((depth, topk))
    for d in range(depth):
        logits = rng.gumbel(size=4 * topk) * (1.0 + 0.15 * d)
        logits[0] += peak / (1.0 + 0.2 * d)
        z = logits - logits.max()
        logp = z - np.log(np.exp(z).sum())
        lp[d] = np.sort(logp)[::-1][:topk]
    return lp


def ddtree(budget: int, logprobs: np.ndarray) -> np.ndarray:
    """DDTree best-first growth over per-position top-K log-probabilities.

    Pop the best frontier node, add it, push its next sibling (same depth, next rank) and its
    first child (next depth, rank 0). Returns budget + 1 nodes (root included), in pop order,
    which is topological. Depth is bounded by the number of positions in `logprobs`.
    """
    logprobs = np.asarray(logprobs, dtype=np.float64)
    max_depth, topk = logprobs.shape
    if budget < 0:
        raise ValueError("budget must be >= 0")
    parents = [-1]
    # frontier entries: (-score, tie, parent_node, depth, rank, parent_score)
    tie = 0
    frontier: list[tuple[float, int, int, int, int, float]] = []
    if max_depth >= 1 and budget > 0:
        heapq.heappush(frontier, (-logprobs[0, 0], tie, 0, 1, 0, 0.0))
    while len(parents) < budget + 1:
        if not frontier:
            raise BadInput(f"budget {budget} exceeds what {max_depth} positions x top-{topk} can hold")
        neg, _, parent, depth, rank, parent_score = heapq.heappop(frontier)
        score = -neg
        node = len(parents)
        parents.append(parent)
        if rank + 1 < topk:
            tie += 1
            heapq.heappush(
                frontier, (-(parent_score + logprobs[depth - 1, rank + 1]), tie, parent, depth, rank + 1, parent_score)
            )
        if depth < max_depth:
            tie += 1
            heapq.heappush(frontier, (-(score + logprobs[depth, 0]), tie, node, depth + 1, 0, score))
    return np.asarray(parents, dtype=np.int64)


def eagle(num_draft_tokens: int, topk: int, steps: int, rng: np.random.Generator) -> np.ndarray:
    """EAGLE-2 style tree: `steps` rounds of top-k expansion of the top-k beams, then the best
    `num_draft_tokens - 1` candidates by cumulative log-probability (plus the root)."""
    if num_draft_tokens < 1:
        raise ValueError("num_draft_tokens must be >= 1")
    # candidate: (score, depth, parent_candidate or -1 for the root)
    cands: list[tuple[float, int, int]] = []
    beams = [(0.0, -1)]  # (score, candidate index or -1 = root)
    for step in range(steps):
        new = []
        for score, cidx in beams:
            lp = draft_logprobs(1, topk, rng, peak=2.0 / (1 + 0.3 * step))[0]
            for r in range(topk):
                cands.append((score + lp[r], step + 1, cidx))
                new.append((score + lp[r], len(cands) - 1))
        new.sort(key=lambda t: -t[0])
        beams = new[:topk]
    if num_draft_tokens - 1 > len(cands):
        raise BadInput(f"{num_draft_tokens} draft tokens exceed the {len(cands) + 1} that topk={topk}, steps={steps} give")
    # Scores fall along every path, so the best set is ancestor-closed; order by (depth, -score).
    order = sorted(range(len(cands)), key=lambda c: (-cands[c][0], cands[c][1]))[: num_draft_tokens - 1]
    chosen = set(order)
    for c in order:  # ties could in principle break closure: pull ancestors in explicitly
        p = cands[c][2]
        while p != -1 and p not in chosen:
            chosen.add(p)
            p = cands[p][2]
    chosen_sorted = sorted(chosen, key=lambda c: (cands[c][1], -cands[c][0]))[: num_draft_tokens - 1]
    node_of = {c: i + 1 for i, c in enumerate(chosen_sorted)}
    parents = [-1] + [0 if cands[c][2] == -1 else node_of[cands[c][2]] for c in chosen_sorted]
    return _check_parents(np.asarray(parents, dtype=np.int64))


def make_tree(kind: str, num_nodes: int, rng: np.random.Generator, *, topk: int = 8, max_depth: int = 15) -> np.ndarray:
    """One tree of `num_nodes` nodes of the given kind (see TREE_KINDS)."""
    if kind == "ddtree":
        return ddtree(num_nodes - 1, draft_logprobs(max_depth, topk, rng))
    if kind == "eagle":
        steps = max(1, min(max_depth, num_nodes - 1))
        return eagle(num_nodes, topk, steps, rng)
    if kind == "chain":
        return chain(num_nodes)
    if kind == "star":
        return star(num_nodes)
    if kind == "random":
        return random_tree(num_nodes, rng)
    raise BadInput(f"unknown tree kind {kind!r}; expected one of {', '.join(TREE_KINDS)}")
