"""TETRIS over draft trees: expansion, selection, block layout, acceptance and roll back equal brute force, greedy
trees emit the target's greedy text, and sampled trees emit the target's law exactly (chi-square)."""

import importlib.util
import itertools
import math
from pathlib import Path

import pytest
import torch
from scipy.stats import chisquare

from tetris_hf import trees
from tetris_hf.logits.verification import sample_tokens
from tetris_hf.selection import cumulative_log_probs, select_tetris

_spec = importlib.util.spec_from_file_location(
    "host_reads", Path(__file__).resolve().parents[1] / "examples" / "host_reads.py")
host_reads = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(host_reads)

# ------------------------------------------------------------------------------------------------------------------
# Toy models: next-token logits are a table of the last two tokens, for the draft (Q) and the target (P)
# ------------------------------------------------------------------------------------------------------------------


class TableModel:
    """``logits(prev, last) = table[prev, last]``: a prefix's next-token law depends on its last two tokens."""

    def __init__(self, vocab: int, seed: int, scale: float = 1.5):
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, vocab, generator=generator, dtype=torch.float64) * scale

    def log_probs(self, prev: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return self.table[prev, last].log_softmax(dim=-1)


def node_context(tree: trees.DraftTree, roots: torch.Tensor, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prev, last)`` tokens of the prefix ending at tree nodes ``nodes`` ``(B, F)``; ``roots`` ``(B, 2)`` holds
    each row's (token before the root, root)."""
    last = tree.tokens.gather(1, nodes)
    parent = tree.parents.gather(1, nodes)
    prev = torch.where(parent >= 0, tree.tokens.gather(1, parent.clamp(min=0)), roots[:, 1:2])
    return prev, last


def slot_context(block: trees.TreeBlock, roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prev, last)`` of the prefix ending at every block slot, ``(B, S)`` each (filler: anything)."""
    parent_token = block.tokens.gather(1, block.parents.clamp(min=0))
    prev = torch.where(block.parents >= 0, parent_token, roots[:, :1])
    return prev, block.tokens


def grow(draft: TableModel, roots, depth, width, keep, expand):
    """A tree grown with the pure steps (``expand``: an expansion step), as :func:`trees.grow_tree` does."""
    batch_size = roots.shape[0]
    tree = trees.empty_tree(batch_size, dtype=torch.float64)
    root_log_probs = draft.log_probs(roots[:, 0], roots[:, 1])
    tree = trees.append_nodes(tree, expand(root_log_probs.new_zeros(batch_size, 1), root_log_probs[:, None],
                                           width, width), -1)
    start, size = 0, width
    for _ in range(depth - 1):
        frontier = slice(start, start + min(width, size))
        nodes = torch.arange(frontier.start, frontier.stop).expand(batch_size, -1)
        log_probs = draft.log_probs(*node_context(tree, roots, nodes))
        expansion = expand(trees.frontier_log_scores(tree, frontier), log_probs, width, keep)
        tree = trees.append_nodes(tree, expansion, frontier.start)
        start, size = start + size, expansion.tokens.shape[1]
    return tree


def draft_callback(draft: TableModel, roots):
    def next_log_probs(tree, frontier):
        nodes = torch.arange(frontier.start, frontier.stop).expand(tree.tokens.shape[0], -1)
        return draft.log_probs(*node_context(tree, roots, nodes))
    return next_log_probs


# ------------------------------------------------------------------------------------------------------------------
# Random trees for property tests
# ------------------------------------------------------------------------------------------------------------------


def randint(generator, low, high):
    return int(torch.randint(low, high, (), generator=generator))


def random_trees(generator, rows, nodes, vocab=4, ties=True, invalid=0.1):
    """Rows of random trees in node order (a parent's index below its child's; depth-sorted), scores falling along
    paths (quantised, so equal scores and zero steps occur), a few invalid nodes."""
    parents = torch.full((rows, nodes), -1, dtype=torch.long)
    depths = torch.ones(rows, nodes, dtype=torch.long)
    scores = torch.zeros(rows, nodes, dtype=torch.float64)
    for row in range(rows):
        for node in range(nodes):
            if node > 0 and torch.rand((), generator=generator) < 0.8:
                # a parent among the nodes of the deepest or second deepest depth so far (keeps depth order)
                deepest = int(depths[row, :node].max())
                pool = [n for n in range(node) if depths[row, n] >= deepest - 1]
                parents[row, node] = pool[int(torch.randint(len(pool), (), generator=generator))]
                depths[row, node] = depths[row, parents[row, node]] + 1
            else:
                depths[row, node] = 1
            if node > 0 and depths[row, node] < depths[row, node - 1]:  # keep depth order: attach deeper instead
                parents[row, node] = node - 1
                depths[row, node] = depths[row, node - 1] + 1
            step = torch.rand((), generator=generator, dtype=torch.float64)
            step = torch.floor(step * 4) / 2 if ties else step * 3
            base = scores[row, parents[row, node]] if parents[row, node] >= 0 else 0.0
            scores[row, node] = base - step
    tokens = torch.randint(vocab, (rows, nodes), generator=generator)
    valid = torch.rand(rows, nodes, generator=generator) >= invalid
    return trees.DraftTree(tokens, parents, depths, scores, valid)


def path_valid(tree, row, node):
    while node >= 0:
        if not tree.valid[row, node]:
            return False
        node = int(tree.parents[row, node])
    return True


def is_ancestor_closed(selected, parents):
    for row, node in zip(*torch.where(selected)):
        parent = int(parents[row, node])
        if parent >= 0 and not selected[row, parent]:
            return False
    return True


def brute_force_top(tree, budget, per_row=None):
    """Every candidate ``(row, node)`` sorted by (score desc, row, node), the first ``budget`` taken, skipping rows
    that hold ``per_row`` already (``budget=None``: no overall limit)."""
    rows, nodes = tree.tokens.shape
    cells = [(-float(tree.log_scores[r, n]), r, n) for r in range(rows) for n in range(nodes) if path_valid(tree, r, n)]
    cells.sort()
    chosen = torch.zeros(rows, nodes, dtype=torch.bool)
    taken = [0] * rows
    for _, r, n in cells:
        if (budget is None or sum(taken) < budget) and (per_row is None or taken[r] < per_row):
            chosen[r, n], taken[r] = True, taken[r] + 1
    return chosen


# ------------------------------------------------------------------------------------------------------------------
# 1. Expansion
# ------------------------------------------------------------------------------------------------------------------


def test_width_one_greedy_tree_is_the_greedy_chain():
    draft = TableModel(7, seed=1)
    roots = torch.tensor([[0, 1], [3, 3], [6, 2]])
    depth = 5
    grown = trees.grow_tree(draft.log_probs(roots[:, 0], roots[:, 1]), draft_callback(draft, roots), depth, width=1)
    tree = grown.tree
    # the chain, drafted token by token
    prev, last, chain, confidences = roots[:, 0], roots[:, 1], [], []
    for _ in range(depth):
        log_probs = draft.log_probs(prev, last)
        token = log_probs.argmax(dim=-1)
        chain.append(token)
        confidences.append(log_probs.amax(dim=-1))
        prev, last = last, token
    assert torch.equal(tree.tokens, torch.stack(chain, dim=1))
    assert torch.equal(tree.parents, torch.arange(-1, depth - 1).expand(3, -1))
    assert torch.equal(tree.depths, torch.arange(1, depth + 1).expand(3, -1))
    torch.testing.assert_close(tree.log_scores, cumulative_log_probs(torch.stack(confidences, dim=1)))
    # and TETRIS over chain trees is chain TETRIS
    for budget in range(0, 3 * depth + 1):
        selected = trees.select_tree_nodes(tree.log_scores, tree.valid, tree.parents, budget)
        lengths = select_tetris(tree.log_scores, torch.full((3,), depth), budget)
        assert torch.equal(selected.sum(dim=1), lengths)


def test_width_one_sampled_tree_is_the_sampled_chain_with_chain_confidences():
    draft = TableModel(7, seed=2)
    roots = torch.tensor([[0, 1], [3, 3]])
    generator = torch.Generator().manual_seed(0)
    grown = trees.grow_tree(draft.log_probs(roots[:, 0], roots[:, 1]), draft_callback(draft, roots), 4, width=1,
                            sample=True, generator=generator)
    tree = grown.tree
    prev, last, confidences = roots[:, 0], roots[:, 1], []
    for depth in range(4):  # each token's confidence is log max q at its parent, whichever token was drawn
        confidences.append(draft.log_probs(prev, last).amax(dim=-1))
        prev, last = last, tree.tokens[:, depth]
    torch.testing.assert_close(tree.log_scores, cumulative_log_probs(torch.stack(confidences, dim=1)))
    assert torch.equal(tree.parents, torch.arange(-1, 3).expand(2, -1))


def test_expansion_keeps_the_best_candidates_as_brute_force():
    generator = torch.Generator().manual_seed(3)
    for trial in range(30):
        rows, frontier, vocab = 3, int(torch.randint(1, 4, (), generator=generator)), 6
        width = int(torch.randint(1, 4, (), generator=generator))
        keep = int(torch.randint(1, frontier * width + 1, (), generator=generator))
        # quantised scores: ties between candidates of different parents
        frontier_scores = -torch.randint(0, 3, (rows, frontier), generator=generator).double()
        frontier_scores[0, 0] = float("-inf") if trial % 3 == 0 else frontier_scores[0, 0]
        logits = torch.randint(0, 3, (rows, frontier, vocab), generator=generator).double()
        log_probs = logits.log_softmax(-1)
        out = trees.expand_frontier(frontier_scores, log_probs, width, keep)
        for row in range(rows):
            candidates = []
            for f in range(frontier):
                top = log_probs[row, f].topk(width)
                for rank in range(width):
                    score = float(frontier_scores[row, f] + top.values[rank])
                    candidates.append((score, f, rank, int(top.indices[rank])))
            valid_first = sorted(candidates, key=lambda c: (c[0] == -math.inf, -c[0]))[:keep]  # stable: f, rank
            assert out.parents[row].tolist() == [c[1] for c in valid_first]
            assert out.tokens[row].tolist() == [c[3] for c in valid_first]
            assert out.log_scores[row].tolist() == [c[0] for c in valid_first]
            assert out.valid[row].tolist() == [c[0] > -math.inf for c in valid_first]


def test_sampled_siblings_are_distinct_in_draw_order_and_kept_as_prefixes():
    generator = torch.Generator().manual_seed(4)
    log_probs = torch.randn(500, 3, 6, generator=generator, dtype=torch.float64).log_softmax(-1)
    log_probs[:, 1, 2:] = float("-inf")  # frontier node 1 has only two tokens: its third draw is invalid
    frontier_scores = torch.tensor([0.0, -0.5, -1.0], dtype=torch.float64).expand(500, -1)
    out = trees.expand_frontier_sampled(frontier_scores, log_probs, 3, keep=7, generator=generator)
    for row in range(500):
        by_parent = {}
        for parent, token, score, valid in zip(out.parents[row].tolist(), out.tokens[row].tolist(),
                                               out.log_scores[row].tolist(), out.valid[row].tolist()):
            by_parent.setdefault(parent, []).append((token, score, valid))
        for parent, children in by_parent.items():
            tokens = [c[0] for c in children if c[2]]
            assert len(set(tokens)) == len(tokens)  # without replacement
            # the r-th kept child scores the parent's score plus the r-th largest log q
            expected = (frontier_scores[row, parent] + log_probs[row, parent].topk(len(children)).values).tolist()
            assert [c[1] for c in children] == pytest.approx(expected)
        assert [v for p, v in zip(out.parents[row].tolist(), out.valid[row].tolist()) if p == 1].count(False) <= 1


def test_gumbel_top_k_draws_in_order_without_replacement():
    q = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05], dtype=torch.float64)
    draws = 40000
    generator = torch.Generator().manual_seed(5)
    pairs = trees.gumbel_top_k(q.log().expand(draws, -1), 2, generator)
    counts = torch.zeros(5, 5)
    counts.index_put_((pairs[:, 0], pairs[:, 1]), torch.ones(draws), accumulate=True)
    expected = torch.tensor([[q[a] * q[b] / (1 - q[a]) if a != b else 0.0 for b in range(5)] for a in range(5)])
    off_diagonal = ~torch.eye(5, dtype=torch.bool)
    assert counts[~off_diagonal].sum() == 0
    assert chisquare(counts[off_diagonal].numpy(), (expected[off_diagonal] * draws).numpy()).pvalue > 1e-3


def test_grown_tree_layout_invariants():
    draft = TableModel(9, seed=6)
    roots = torch.tensor([[0, 1], [4, 2], [8, 8], [5, 1]])
    for sample in (False, True):
        grown = trees.grow_tree(draft.log_probs(roots[:, 0], roots[:, 1]), draft_callback(draft, roots), 4,
                                width=3, keep=5, sample=sample, generator=torch.Generator().manual_seed(7))
        tree = grown.tree
        assert tree.tokens.shape == (4, 3 + 3 * 5)
        has_parent = tree.parents >= 0
        assert (tree.parents < torch.arange(tree.tokens.shape[1])).all()  # parents come first
        parent_depth = tree.depths.gather(1, tree.parents.clamp(min=0))
        assert torch.equal(tree.depths, torch.where(has_parent, parent_depth + 1, 1))
        assert (tree.depths[:, 1:] >= tree.depths[:, :-1]).all()  # depth order
        parent_score = tree.log_scores.gather(1, tree.parents.clamp(min=0))
        assert (tree.log_scores <= torch.where(has_parent, parent_score, 0.0)).all()
        # frontiers are each depth's best `width` nodes, and their laws are where expanded_of_node says
        assert grown.expanded_of_node.tolist() == [1, 2, 3, 4, 5, 6, -1, -1, 7, 8, 9] + [-1] * 7
        nodes = torch.arange(3, 6).expand(4, -1)
        torch.testing.assert_close(grown.expanded_log_probs[:, 4:7],
                                   draft.log_probs(*node_context(tree, roots, nodes)))


# ------------------------------------------------------------------------------------------------------------------
# 2. Selection
# ------------------------------------------------------------------------------------------------------------------


def test_tree_selection_is_ancestor_closed_exact_and_equals_brute_force_top_c():
    generator = torch.Generator().manual_seed(8)
    for trial in range(40):
        rows, nodes = randint(generator, 1, 5), randint(generator, 1, 12)
        tree = random_trees(generator, rows, nodes, ties=trial % 2 == 0)
        candidates = sum(path_valid(tree, r, n) for r in range(rows) for n in range(nodes))
        for budget in range(0, rows * nodes + 2):
            selected = trees.select_tree_nodes(tree.log_scores, tree.valid, tree.parents, budget)
            assert int(selected.sum()) == min(budget, candidates)
            assert is_ancestor_closed(selected, tree.parents)
            # plain top-C of all candidates, no closure step: it is closed because a score never exceeds its
            # parent's and the tie rule (lower row, lower index) puts ancestors first
            assert torch.equal(selected, brute_force_top(tree, budget))
            cap = int(torch.randint(0, nodes + 1, (), generator=generator))
            capped = trees.select_tree_nodes(tree.log_scores, tree.valid, tree.parents, budget, max_per_row=cap)
            assert is_ancestor_closed(capped, tree.parents) and (capped.sum(dim=1) <= cap).all()
            assert torch.equal(capped, brute_force_top(tree, budget, per_row=cap))


def test_fixed_tree_selection_takes_each_rows_best_nodes():
    generator = torch.Generator().manual_seed(9)
    for trial in range(40):
        rows, nodes = randint(generator, 1, 5), randint(generator, 1, 12)
        tree = random_trees(generator, rows, nodes, ties=trial % 2 == 0)
        for per_row in range(0, nodes + 2):
            selected = trees.select_tree_fixed(tree.log_scores, tree.valid, tree.parents, per_row)
            assert is_ancestor_closed(selected, tree.parents)
            assert torch.equal(selected, brute_force_top(tree, None, per_row=per_row))


def test_selection_stays_a_subtree_when_scores_rise_or_ancestors_are_invalid():
    parents = torch.tensor([[-1, 0, 1, -1, 3]])
    scores = torch.tensor([[-3.0, -1.0, -0.5, -2.0, -0.1]])  # children above their parents
    valid = torch.tensor([[True, True, True, False, True]])  # node 4 sits under an invalid node
    for budget in range(6):
        selected = trees.select_tree_nodes(scores, valid, parents, budget)
        assert is_ancestor_closed(selected, parents) and not selected[0, 3:].any()
        assert int(selected.sum()) == min(budget, 3)
    assert trees.select_tree_fixed(scores, valid, parents, 2).tolist() == [[True, True, False, False, False]]


def test_bad_arguments_are_refused_with_their_name():
    scores, valid, parents = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool), torch.tensor([[-1, 0]])
    with pytest.raises(ValueError, match="budget"):
        trees.select_tree_nodes(scores, valid, parents, -1)
    with pytest.raises(ValueError, match="nodes_per_row"):
        trees.select_tree_fixed(scores, valid, parents, 1.5)
    with pytest.raises(ValueError, match="keep"):
        trees.expand_frontier(torch.zeros(1, 2), torch.zeros(1, 2, 5).log_softmax(-1), 2, keep=5)
    with pytest.raises(ValueError, match="width"):
        trees.expand_frontier(torch.zeros(1, 1), torch.zeros(1, 1, 5).log_softmax(-1), 6)


# ------------------------------------------------------------------------------------------------------------------
# 3. Block layout
# ------------------------------------------------------------------------------------------------------------------


def brute_force_block(tree, selected, roots, max_nodes, row):
    nodes = [n for n in range(tree.tokens.shape[1]) if selected[row, n]][:max_nodes]
    slot_of = {node: 1 + i for i, node in enumerate(nodes)}
    slots = 1 + max_nodes
    tokens = [int(roots[row])] + [int(tree.tokens[row, n]) for n in nodes] + [0] * (max_nodes - len(nodes))
    offsets = [0] + [int(tree.depths[row, n]) for n in nodes] + [0] * (max_nodes - len(nodes))
    parents = [-1] + [slot_of.get(int(tree.parents[row, n]), 0) for n in nodes] + [-1] * (max_nodes - len(nodes))
    mask = [[i == j for j in range(slots)] for i in range(slots)]
    for i, node in enumerate(nodes, start=1):
        mask[i][0] = True
        while node >= 0:
            mask[i][slot_of[node]] = True
            node = int(tree.parents[row, node])
    return tokens, offsets, parents, mask, nodes + [-1] * (max_nodes - len(nodes)), 1 + len(nodes)


def brute_force_path(tree, row, node):
    """Tokens from depth 1 down to ``node`` (walking up the parents)."""
    path = []
    while node >= 0:
        path.append(int(tree.tokens[row, node]))
        node = int(tree.parents[row, node])
    return path[::-1]


def test_path_tokens_and_path_products_equal_walking_up_the_tree():
    generator = torch.Generator().manual_seed(12)
    for _ in range(20):
        rows, nodes = randint(generator, 1, 5), randint(generator, 1, 12)
        tree = random_trees(generator, rows, nodes)
        max_depth = int(tree.depths.max())
        paths = trees.path_tokens(tree.tokens, tree.parents, tree.depths, max_depth, filler=-7)
        values = torch.rand(rows, nodes, generator=generator, dtype=torch.float64)
        products = trees.path_products(values, tree.parents)
        for row in range(rows):
            for node in range(nodes):
                path = brute_force_path(tree, row, node)
                assert paths[row, node].tolist() == path + [-7] * (max_depth - len(path))
                expected, at = 1.0, node
                while at >= 0:
                    expected, at = expected * float(values[row, at]), int(tree.parents[row, at])
                assert math.isclose(float(products[row, node]), expected)
        # on a block, the root (depth 0) is on no path
        selected = trees.select_tree_nodes(tree.log_scores, tree.valid, tree.parents, rows * nodes)
        block = trees.tree_block(selected, tree.parents, tree.depths, tree.tokens, torch.full((rows,), 99), nodes)
        block_paths = trees.path_tokens(block.tokens, block.parents, block.position_offsets, max_depth, filler=-7)
        assert (block_paths[:, 0] == -7).all()
        for row in range(rows):
            for slot, node in enumerate(block.node_index[row].tolist(), start=1):
                if node >= 0:
                    assert block_paths[row, slot].tolist()[: int(tree.depths[row, node])] == \
                        brute_force_path(tree, row, node)


def test_conditional_log_probs_add_up_to_the_path_scores():
    generator = torch.Generator().manual_seed(13)
    tree = random_trees(generator, 4, 10, invalid=0.0)
    conditional = trees.conditional_log_probs(tree)
    torch.testing.assert_close(trees.path_products(conditional.exp(), tree.parents).log(), tree.log_scores)
    invalid = tree._replace(valid=torch.zeros_like(tree.valid))
    assert (trees.conditional_log_probs(invalid) == float("-inf")).all()


def test_tree_block_matches_brute_force_layout():
    generator = torch.Generator().manual_seed(10)
    for trial in range(40):
        rows, nodes = randint(generator, 1, 5), randint(generator, 1, 12)
        tree = random_trees(generator, rows, nodes)
        budget = int(torch.randint(0, rows * nodes + 1, (), generator=generator))
        selected = trees.select_tree_nodes(tree.log_scores, tree.valid, tree.parents, budget)
        roots = torch.randint(4, (rows,), generator=generator)
        max_nodes = int(torch.randint(0, nodes + 1, (), generator=generator))  # below the count: truncation
        block = trees.tree_block(selected, tree.parents, tree.depths, tree.tokens, roots, max_nodes)
        for row in range(rows):
            tokens, offsets, parents, mask, node_index, length = brute_force_block(tree, selected, roots, max_nodes,
                                                                                   row)
            assert block.tokens[row].tolist() == tokens
            assert block.position_offsets[row].tolist() == offsets
            assert block.parents[row].tolist() == parents
            assert block.ancestor_mask[row].tolist() == mask
            assert block.node_index[row].tolist() == node_index
            assert int(block.lengths[row]) == length


# ------------------------------------------------------------------------------------------------------------------
# 4. Greedy acceptance
# ------------------------------------------------------------------------------------------------------------------


def brute_force_greedy(block, target_argmax, row):
    """Deepest slot whose whole path matches the target's argmax (ties: the lower slot), by walking every path."""
    tokens, parents = block.tokens[row].tolist(), block.parents[row].tolist()
    best = (0, 0, [])  # depth, -slot, path

    def walk(slot, path):
        nonlocal best
        if (len(path), -slot) > best[:2]:
            best = (len(path), -slot, path)
        for child in range(len(tokens)):
            if parents[child] == slot and tokens[child] == int(target_argmax[row, slot]):
                walk(child, path + [child])

    walk(0, [])
    depth, negative_slot, path = best
    return path, int(target_argmax[row, -negative_slot])


def test_greedy_tree_acceptance_equals_brute_force_search():
    generator = torch.Generator().manual_seed(11)
    for trial in range(60):
        rows, nodes = randint(generator, 1, 5), randint(generator, 1, 14)
        tree = random_trees(generator, rows, nodes, vocab=3, invalid=0.0)  # vocab 3: sibling duplicates happen
        selected = trees.select_tree_nodes(tree.log_scores, tree.valid, tree.parents,
                                           int(torch.randint(0, rows * nodes + 1, (), generator=generator)))
        block = trees.tree_block(selected, tree.parents, tree.depths, tree.tokens, torch.zeros(rows, dtype=torch.long),
                                 nodes)
        # the target's argmax often equals a child's token, so paths get long
        target_argmax = torch.randint(3, block.tokens.shape, generator=generator)
        for row in range(rows):
            for slot in range(block.tokens.shape[1]):
                children = [c for c in range(block.tokens.shape[1]) if block.parents[row, c] == slot]
                if children and torch.rand((), generator=generator) < 0.7:
                    target_argmax[row, slot] = block.tokens[row, children[-1]]
        out = trees.accept_tree_greedy(block.tokens, block.parents, target_argmax)
        for row in range(rows):
            path, next_token = brute_force_greedy(block, target_argmax, row)
            assert out.path[row].tolist() == path + [-1] * (nodes - len(path))
            assert int(out.num_accepted[row]) == len(path)
            assert int(out.next_tokens[row]) == next_token


def decode(target, draft, roots, steps, width, depth, keep, budget, sample=False, generator=None, select="tetris",
           expand=None, cap=None):
    """Tree speculative decoding on table models, ``steps`` steps: returns every row's emitted tokens (a list per row)
    and the accepted counts per step. ``cap``: TETRIS's ``max_per_row`` (the block's width)."""
    rows = roots.shape[0]
    emitted = [[] for _ in range(rows)]
    accepted = []
    for _ in range(steps):
        if expand is None:
            grown = trees.grow_tree(draft.log_probs(roots[:, 0], roots[:, 1]), draft_callback(draft, roots), depth,
                                    width, keep, sample=sample, generator=generator)
            tree = grown.tree
        else:
            tree = grow(draft, roots, depth, width, keep, expand)
        nodes = tree.tokens.shape[1]
        if select == "tetris":
            selected = trees.select_tree_nodes(tree.log_scores, tree.valid, tree.parents, budget, max_per_row=cap)
            max_nodes = min(budget, nodes) if cap is None else cap
        else:
            selected = trees.select_tree_fixed(tree.log_scores, tree.valid, tree.parents, budget)
            max_nodes = min(budget, nodes)
        block = trees.tree_block(selected, tree.parents, tree.depths, tree.tokens, roots[:, 1], max_nodes)
        target_log_probs = target.log_probs(*slot_context(block, roots))  # (B, S, V)
        if sample:
            if expand is None:
                draft_log_probs = trees.block_draft_log_probs(grown.expanded_log_probs, grown.expanded_of_node,
                                                              block.node_index)
            else:
                draft_log_probs = draft.log_probs(*slot_context(block, roots))
            out = trees.accept_tree_sampling(block.tokens, block.parents, target_log_probs.exp(),
                                             draft_log_probs.exp(), depth, width, generator)
        else:
            out = trees.accept_tree_greedy(block.tokens, block.parents, target_log_probs.argmax(-1), depth)
        path_tokens = block.tokens.gather(1, out.path.clamp(min=0))
        new = torch.cat([roots, path_tokens, out.next_tokens[:, None]], dim=1)
        lengths = 2 + out.num_accepted + 1
        roots = torch.stack([new.gather(1, (lengths - 2)[:, None])[:, 0], out.next_tokens], dim=1)
        for row, (tokens, count) in enumerate(zip(path_tokens.tolist(), out.num_accepted.tolist())):
            emitted[row] += tokens[:count] + [int(out.next_tokens[row])]
        accepted.append(out.num_accepted)
    return emitted, torch.stack(accepted)


def test_greedy_trees_emit_the_targets_greedy_text():
    vocab = 8
    target = TableModel(vocab, seed=12, scale=2.0)
    draft = TableModel(vocab, seed=12, scale=2.0)
    draft.table = draft.table + 1.2 * torch.randn(draft.table.shape, generator=torch.Generator().manual_seed(13),
                                                  dtype=torch.float64)  # a noisy copy
    roots = torch.tensor([[0, 1], [2, 3], [7, 7], [4, 0], [5, 6], [1, 1]])
    for width, keep, budget, select in [(1, 1, 8, "tetris"), (2, 4, 10, "tetris"), (3, 9, 9, "tetris"),
                                        (3, 3, 4, "fixed")]:
        emitted, accepted = decode(target, draft, roots, 6, width, 4, keep, budget, select=select)
        for row, tokens in enumerate(emitted):
            prev, last, expected = int(roots[row, 0]), int(roots[row, 1]), []
            for _ in range(len(tokens)):
                token = int(target.table[prev, last].argmax())
                expected.append(token)
                prev, last = last, token
            assert tokens == expected
        assert accepted.sum() > 0


# ------------------------------------------------------------------------------------------------------------------
# 5. Sampling acceptance: lossless
# ------------------------------------------------------------------------------------------------------------------


def test_sampling_accepts_the_first_child_when_target_equals_draft_and_none_when_target_avoids_them():
    vocab = 6
    block_tokens = torch.tensor([[9 % vocab, 2, 3, 4, 1, 0]])
    parents = torch.tensor([[-1, 0, 0, 1, 1, -1]])  # slot 5 is filler
    q = torch.softmax(torch.randn(1, 6, vocab, generator=torch.Generator().manual_seed(14)), -1)
    out = trees.accept_tree_sampling(block_tokens, parents, q, q, max_depth=3, max_children=2)
    assert out.path.tolist() == [[1, 3, -1]] and out.num_accepted.tolist() == [2]
    # a target with no mass on the root's children: both rejected, the token comes from p's residual
    p = torch.zeros(1, 6, vocab)
    p[..., 5] = 1.0
    out = trees.accept_tree_sampling(block_tokens, parents, p, q, max_depth=3, max_children=2)
    assert out.path.tolist() == [[-1, -1, -1]] and out.num_accepted.tolist() == [0] and out.next_tokens.tolist() == [5]


def test_matching_acceptance_follows_the_targets_draws_down_the_tree():
    """A deterministic tree (no ``q``): the path goes where the target's token lands on a child (the lower slot when
    siblings repeat a token), and the token after it is the target's at the last node."""
    vocab = 6
    block_tokens = torch.tensor([[0, 2, 3, 4, 3, 3, 0]])
    parents = torch.tensor([[-1, 0, 0, 1, 2, 2, -1]])  # root -> 2 (slot 1), 3 (slot 2); 2 -> 4; 3 -> 3, 3 again
    p = torch.zeros(1, 7, vocab)
    p[0, 0, 3] = p[0, 2, 3] = p[0, 4, 5] = 1.0  # root: 3, then 3 (slots 4 and 5 hold it: slot 4), then 5
    p[0, [1, 3, 5, 6], 0] = 1.0
    out = trees.accept_tree_matching(block_tokens, parents, p, max_depth=2)
    assert out.path.tolist() == [[2, 4]] and out.num_accepted.tolist() == [2] and out.next_tokens.tolist() == [5]
    p[0, 0] = torch.tensor([0.0, 0, 0, 0, 0, 1])  # a token no child holds: nothing accepted, that token next
    out = trees.accept_tree_matching(block_tokens, parents, p, max_depth=2)
    assert out.path.tolist() == [[-1, -1]] and out.num_accepted.tolist() == [0] and out.next_tokens.tolist() == [5]


def test_matching_acceptance_emits_the_targets_law():
    """Rows of one block: the first emitted token has the root's law, the second (when the first landed on a child)
    that child's law; chi-square against the exact joint. Teeth: trying each child with probability ``p(child)`` in
    turn (the chain's one-hot rule per sibling, not conditioned on the earlier ones' rejection) is detected."""
    vocab, rows = 4, 20000
    block_tokens = torch.tensor([[0, 1, 2, 3]]).expand(rows, 4)
    parents = torch.tensor([[-1, 0, 0, 1]]).expand(rows, 4)  # root -> 1, 2; 1 -> 3
    law = torch.softmax(torch.randn(4, vocab, generator=torch.Generator().manual_seed(3)) * 1.5, dim=-1)
    expected = torch.zeros(vocab, vocab + 1)  # (first token, second token or "none": column vocab)
    for first in range(vocab):
        slot = {1: 1, 2: 2}.get(first)
        if slot is None:
            expected[first, vocab] = law[0, first]
        else:
            expected[first, :vocab] = law[0, first] * law[slot]

    def counts_of(acceptance):
        second = torch.where(acceptance.num_accepted > 0, acceptance.next_tokens, vocab)
        first = torch.where(acceptance.num_accepted > 0, block_tokens[:, 1:].gather(1, (acceptance.path[:, :1] - 1)
                                                                                    .clamp(min=0))[:, 0],
                            acceptance.next_tokens)
        return torch.zeros(vocab, vocab + 1).index_put_((first, second), torch.ones(rows), accumulate=True)

    def pvalue_of(counts):
        keep = expected.flatten() > 0
        return chisquare(counts.flatten()[keep].numpy(), (expected.flatten()[keep] * rows).numpy()).pvalue

    generator = torch.Generator().manual_seed(0)
    probs = law[None].expand(rows, 4, vocab)
    acceptance = trees.accept_tree_matching(block_tokens, parents, probs, max_depth=1, generator=generator)
    assert pvalue_of(counts_of(acceptance)) > 1e-3

    def each_child_by_its_own_odds(block_tokens, parents, target_probs, generator):
        """The broken rule: child 1 accepted with probability p(1), else child 2 with probability p(2)."""
        u = torch.rand(rows, 2, generator=generator)
        p = target_probs[:, 0]
        to_one, to_two = u[:, 0] < p[:, 1], u[:, 1] < p[:, 2]
        rest = sample_tokens(p.index_fill(1, torch.tensor([1, 2]), 0.0), generator)
        accepted = to_one | to_two
        slot = torch.where(to_one, 1, 2)
        path = torch.where(accepted, slot, -1)[:, None]
        nexts = torch.where(accepted, sample_tokens(target_probs[torch.arange(rows), slot], generator), rest)
        return trees.TreeAcceptance(path, accepted.long(), nexts)

    broken = each_child_by_its_own_odds(block_tokens, parents, probs, generator)
    assert pvalue_of(counts_of(broken)) < 1e-6


CONTEXTS = torch.tensor([[0, 1], [2, 4], [3, 3], [4, 0]])  # (token before the root, root)


def first_two_tokens(width, keep, budget_per_row, select="tetris", samples=5000, seed=0, expand=None, cap=None):
    """Counts of the first two emitted tokens per context, tree sampling on 5-token table models, rows of all
    contexts in one batch (so they compete for the budget)."""
    vocab = 5
    target, draft = TableModel(vocab, seed=20), TableModel(vocab, seed=21)
    roots = CONTEXTS.repeat_interleave(samples, dim=0)
    rows = roots.shape[0]
    budget = budget_per_row if select == "fixed" else budget_per_row * rows
    emitted, _ = decode(target, draft, roots, 2, width, 3, keep, budget, sample=True,
                        generator=torch.Generator().manual_seed(seed), select=select, expand=expand, cap=cap)
    pairs = torch.tensor([tokens[:2] for tokens in emitted])
    counts = torch.zeros(len(CONTEXTS), vocab, vocab)
    context = torch.arange(len(CONTEXTS)).repeat_interleave(samples)
    counts.index_put_((context, pairs[:, 0], pairs[:, 1]), torch.ones(rows), accumulate=True)
    exact = torch.stack([
        target.log_probs(prev, last).exp()[:, None] * target.log_probs(last.expand(vocab), torch.arange(vocab)).exp()
        for prev, last in CONTEXTS
    ])  # (contexts, y1, y2)
    return counts, exact * samples


def pvalue(counts, expected):
    """One chi-square over every context's joint law (each context's counts sum to its samples: one constraint
    each)."""
    return chisquare(counts.flatten().numpy(), expected.flatten().numpy(), ddof=len(counts) - 1).pvalue


@pytest.mark.parametrize("width, keep, budget_per_row, select, cap", [
    (2, 4, 3, "tetris", None),  # EAGLE-2's pool (every candidate a node): 10 drafted per row, 3 verified on average
    (3, 6, 5, "tetris", None),  # 15 drafted
    (3, 6, 3, "tetris", 4),  # and rows capped at 4 verified nodes
    (3, 3, 4, "fixed", None),
])
def test_sampled_trees_emit_the_targets_law(width, keep, budget_per_row, select, cap):
    counts, expected = first_two_tokens(width, keep, budget_per_row, select, cap=cap)
    assert pvalue(counts, expected) > 1e-3


def test_sampling_without_the_residual_update_is_biased(monkeypatch):
    """Teeth: trying a sibling against ``p`` itself after a rejection (no ``norm(max(p - q, 0))``) is detected."""
    monkeypatch.setattr(trees, "residual_distribution", lambda p, q: (p, None))
    counts, expected = first_two_tokens(2, 4, 3, "tetris", samples=2000)
    assert pvalue(counts, expected) < 1e-6


def test_scores_by_the_drawn_tokens_probability_bias_sampling():
    """Teeth for the token-independent confidences: EAGLE-2's score (the drawn child's own ``log q``) verifies the
    likelier of two draws first and drops the other under a tight budget, which biases the output."""
    def by_drawn_probability(frontier_scores, child_log_probs, width, keep, generator=torch.Generator().manual_seed(1)):
        tokens = trees.gumbel_top_k(child_log_probs, width, generator)
        child_scores = child_log_probs.gather(-1, tokens)
        scores = frontier_scores[..., None] + child_scores
        return trees._best_candidates(scores, tokens, child_scores > float("-inf"), keep)

    counts, expected = first_two_tokens(2, 4, 2, "tetris", samples=2000, expand=by_drawn_probability)
    assert pvalue(counts, expected) < 1e-6


# ------------------------------------------------------------------------------------------------------------------
# 6. Roll back
# ------------------------------------------------------------------------------------------------------------------


def test_kept_slots_hold_the_root_and_the_accepted_path_in_position_order():
    generator = torch.Generator().manual_seed(15)
    vocab, rows = 4, 5
    tree = random_trees(generator, rows, 10, vocab=vocab, invalid=0.0)
    selected = trees.select_tree_nodes(tree.log_scores, tree.valid, tree.parents, 25)
    roots = torch.randint(vocab, (rows,), generator=generator)
    block = trees.tree_block(selected, tree.parents, tree.depths, tree.tokens, roots, 10)
    target_argmax = torch.randint(vocab, block.tokens.shape, generator=generator)
    for row in range(rows):  # follow the first child often
        for slot in range(block.tokens.shape[1]):
            children = [c for c in range(block.tokens.shape[1]) if block.parents[row, c] == slot]
            if children:
                target_argmax[row, slot] = block.tokens[row, children[0]]
    out = trees.accept_tree_greedy(block.tokens, block.parents, target_argmax)
    assert out.num_accepted.max() >= 2
    slots = block.tokens.shape[1]
    keep = trees.kept_slots(out.path, slots)
    assert keep.sum(dim=1).tolist() == (1 + out.num_accepted).tolist()
    for row in range(rows):
        count = int(out.num_accepted[row])
        chain = [int(roots[row])] + block.tokens[row, out.path[row, :count]].tolist()
        assert block.tokens[row][keep[row]].tolist() == chain  # the tokens a chain would have kept
        kept_positions = block.position_offsets[row][keep[row]]
        assert kept_positions.tolist() == list(range(1 + count))  # in place, kept slots are in position order


# ------------------------------------------------------------------------------------------------------------------
# 7. Analysis, and the whole path without host reads
# ------------------------------------------------------------------------------------------------------------------


def conditional_acceptances(generator, tree):
    """Random acceptance of each node given its parent's, ``(1, N)``; siblings (exclusive events) sum to at most 1."""
    nodes = tree.tokens.shape[1]
    accept = torch.rand(1, nodes, generator=generator, dtype=torch.float64)
    for parent in range(-1, nodes):
        children = (tree.parents[0] == parent).nonzero()[:, 0]
        if len(children):
            accept[0, children] *= 0.95 / max(1.0, float(accept[0, children].sum()))
    return accept


def expected_accepted(accept_probs, parents, selected):
    """``(B,)`` expected accepted drafts per row of a selected subtree, given each node's acceptance given its
    parent's: the sum over its nodes of the probability that the whole path to the node is accepted."""
    return (trees.path_products(accept_probs, parents) * selected).sum(dim=1)


def test_top_c_by_path_probability_maximises_expected_accepted_over_subtrees():
    generator = torch.Generator().manual_seed(16)
    for _ in range(20):
        tree = random_trees(generator, 1, 8, invalid=0.0)
        # conditional acceptances; siblings share at most probability 1
        accept = conditional_acceptances(generator, tree)
        path = trees._path_reduce(accept, tree.parents, torch.mul)
        for budget in range(9):
            selected = trees.select_tree_nodes(path.log(), tree.valid, tree.parents, budget)
            value = float(expected_accepted(accept, tree.parents, selected))
            best = 0.0
            for subset in itertools.combinations(range(8), budget):
                chosen = torch.zeros(1, 8, dtype=torch.bool)
                chosen[0, list(subset)] = True
                if is_ancestor_closed(chosen, tree.parents):
                    best = max(best, float(expected_accepted(accept, tree.parents, chosen)))
            assert value == pytest.approx(best)


def test_expected_accepted_matches_simulated_greedy_acceptance():
    generator = torch.Generator().manual_seed(17)
    vocab, rows = 10, 20000
    tree = random_trees(generator, 1, 9, vocab=vocab, invalid=0.0)
    tokens = tree.tokens.clone()
    for parent in range(-1, 9):  # siblings distinct, so their acceptances are exclusive events
        children = (tree.parents[0] == parent).nonzero()[:, 0]
        tokens[0, children] = torch.randperm(vocab, generator=generator)[: len(children)]
    accept = conditional_acceptances(generator, tree)
    selected = trees.select_tree_nodes(tree.log_scores, tree.valid, tree.parents, 6)
    block = trees.tree_block(selected, tree.parents, tree.depths, tokens, torch.zeros(1, dtype=torch.long), 6)
    # the target's argmax at each slot: child c's token with probability accept[c], else a token no child has
    law = torch.zeros(1, 7, vocab, dtype=torch.float64)
    for slot in range(7):
        children = [c for c in range(1, 7) if block.parents[0, c] == slot]
        others = [t for t in range(vocab) if t not in [int(block.tokens[0, c]) for c in children]]
        for c in children:
            law[0, slot, block.tokens[0, c]] = accept[0, block.node_index[0, c - 1]]
        law[0, slot, others] = (1 - law[0, slot].sum()) / len(others)
    target_argmax = sample_tokens(law.expand(rows, -1, -1), generator)
    out = trees.accept_tree_greedy(block.tokens.expand(rows, -1), block.parents.expand(rows, -1), target_argmax)
    expected = float(expected_accepted(accept, tree.parents, selected))
    assert float(out.num_accepted.double().mean()) == pytest.approx(expected, abs=4 * 1.5 / math.sqrt(rows))


def test_a_tree_step_reads_nothing_from_the_device():
    vocab = 6
    target, draft = TableModel(vocab, seed=18), TableModel(vocab, seed=19)
    roots = CONTEXTS
    generator = torch.Generator().manual_seed(0)
    with host_reads.HostReads() as reads:
        for sample in (False, True):
            grown = trees.grow_tree(draft.log_probs(roots[:, 0], roots[:, 1]), draft_callback(draft, roots), 3, 2, 4,
                                    sample=sample, generator=generator)
            tree = grown.tree
            for selected in (trees.select_tree_nodes(tree.log_scores, tree.valid, tree.parents, 9),
                             trees.select_tree_fixed(tree.log_scores, tree.valid, tree.parents, 3)):
                block = trees.tree_block(selected, tree.parents, tree.depths, tree.tokens, roots[:, 1], 9)
                target_probs = target.log_probs(*slot_context(block, roots)).exp()
                q = trees.block_draft_log_probs(grown.expanded_log_probs, grown.expanded_of_node, block.node_index)
                out = trees.accept_tree_sampling(block.tokens, block.parents, target_probs, q.exp(), 3, 2, generator)
                out = trees.accept_tree_greedy(block.tokens, block.parents, target_probs.argmax(-1), 3)
                trees.kept_slots(out.path, block.tokens.shape[1])
    assert reads.count == 0
