"""TETRIS over draft trees (EAGLE-2 expansion, one budget for the batch), as batched tensor functions that read nothing
from the device: every shape comes from host integers the caller knows.

Draft (:func:`grow_tree`), select (:func:`select_tree_nodes`, :func:`select_tree_fixed`), verify (:func:`tree_block`),
accept (:func:`accept_tree_greedy`, :func:`accept_tree_sampling`, :func:`accept_tree_matching`), roll back
(:func:`kept_slots`). The representation, a worked example and the losslessness proof: docs/design.md, "Draft trees".
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from .logits.verification import residual_distribution, sample_tokens

__all__ = [
    "DraftTree", "Expansion", "TreeBlock", "TreeAcceptance", "GrownTree", "empty_tree", "expand_frontier",
    "expand_frontier_sampled", "gumbel_top_k", "append_nodes", "frontier_log_scores", "grow_tree", "select_tree_nodes",
    "select_tree_fixed", "tree_block", "ancestor_mask", "block_draft_log_probs", "accept_tree_greedy",
    "accept_tree_sampling", "accept_tree_matching", "kept_slots", "path_products", "conditional_log_probs",
    "path_tokens",
]


class DraftTree(NamedTuple):
    """``B`` trees of ``N`` nodes, every field ``(B, N)``. The root (the row's last emitted token) is no node; nodes
    come depth by depth, best first within a depth, so a parent's index is lower than its children's."""

    tokens: Tensor  # long
    parents: Tensor  # long, -1 for the root's children
    depths: Tensor  # long, 1-based
    log_scores: Tensor  # float, cumulative path score, never above the parent's
    valid: Tensor  # bool; False: a reserved slot nothing was drafted into, or a draw past the support of q


class Expansion(NamedTuple):
    """One depth's new nodes, ``K`` per row, best first (ties in candidate order), every field ``(B, K)``."""

    parents: Tensor  # the parent's position within the frontier, 0..F-1
    tokens: Tensor
    log_scores: Tensor  # cumulative, descending along each row
    valid: Tensor  # False: a child of an invalid frontier node, or a token of draft probability 0


class TreeBlock(NamedTuple):
    """The target's input for one verification forward, ``S = 1 + M`` slots per row, real slots first. The caller's
    4D mask adds the row's cached prefix to ``ancestor_mask``."""

    tokens: Tensor  # (B, S) [root, selected nodes in node order, filler]
    position_offsets: Tensor  # (B, S) depth (root and filler 0), added to the row's length
    ancestor_mask: Tensor  # (B, S, S) bool, [b, i, j]: j is i or an ancestor of i (filler: only itself)
    parents: Tensor  # (B, S) the parent's slot (0 for the root's children), -1 for the root and filler
    node_index: Tensor  # (B, M) the tree node in slot 1 + m, -1 for filler
    lengths: Tensor  # (B,) real slots, 1 + selected nodes


class TreeAcceptance(NamedTuple):
    """What the target did with a verified block: a row emits ``block.tokens[path[:num_accepted]]``, then
    ``next_tokens``."""

    path: Tensor  # (B, D) block slots of the accepted nodes from depth 1 down, -1 after the last
    num_accepted: Tensor  # (B,) accepted drafts (the path's length)
    next_tokens: Tensor  # (B,) the target's token after them (a correction, or a bonus token after a leaf)


class GrownTree(NamedTuple):
    """:func:`grow_tree`'s result: the :class:`DraftTree` and what sampling verification needs as ``q``.

    ``expanded_log_probs`` ``(B, E, V)``: the draft law each expanded node's children came from (position 0: the
    root's; then each depth's frontier in node order); ``None`` for a deterministic tree (suffix drafts, verified by
    :func:`accept_tree_matching`). ``expanded_of_node`` ``(N,)`` long, the same for every row: each node's position
    in ``expanded_log_probs``, -1 for a node never expanded; ``None`` with it. ``cached_lengths`` ``(B,)``: the
    drafter's cache fill per row, as a chain :class:`~tetris_hf.step.Proposal`'s.
    """

    tree: DraftTree
    expanded_log_probs: Tensor | None
    expanded_of_node: Tensor | None
    cached_lengths: Tensor | None = None


# ---------------------------------------------------------------------------------------------------------------
# Helpers


def _check_count(name: str, value: int, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _jump_rounds(length: int) -> int:
    """Pointer-jumping rounds that cover every path of up to ``length`` nodes: ``2^k >= length``."""
    return max(length - 1, 0).bit_length()


def _path_reduce(values: Tensor, parents: Tensor, combine: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Each node's value combined with all its ancestors' (``combine`` associative), ``(B, N)`` -> ``(B, N)``, by
    pointer jumping (``ceil(log2 N)`` rounds, no host read); ``parents``: -1 above the top."""
    jump = parents
    for _ in range(_jump_rounds(values.shape[-1])):
        has_jump = jump >= 0
        above = jump.clamp(min=0)
        values = torch.where(has_jump, combine(values, values.gather(-1, above)), values)
        jump = torch.where(has_jump, jump.gather(-1, above), jump)
    return values


def _ranking_key(log_scores: Tensor, valid: Tensor) -> Tensor:
    """Scores to sort by, descending: valid nodes (even at ``-inf``) above invalid ones."""
    key = log_scores.to(torch.promote_types(log_scores.dtype, torch.float32))
    return key.clamp(min=torch.finfo(key.dtype).min).masked_fill(~valid, float("-inf"))


def _closed(log_scores: Tensor, valid: Tensor, parents: Tensor) -> tuple[Tensor, Tensor]:
    """Scores clamped to the minimum along the path and validity anded along it: a no-op on a well-formed tree, and
    what keeps any top-k of them ancestor-closed on one that is not (a score above its parent's, an invalid
    ancestor)."""
    scores = _path_reduce(log_scores, parents, torch.minimum)
    valid = _path_reduce(valid, parents, torch.logical_and)
    return scores, valid


def _self_loops(parents: Tensor) -> Tensor:
    """Block parents with -1 (root, filler) replaced by the slot itself: pointer jumping then stays put there."""
    slots = torch.arange(parents.shape[-1], device=parents.device).expand_as(parents)
    return torch.where(parents >= 0, parents, slots)


# ---------------------------------------------------------------------------------------------------------------
# 1. Draft: expansion


def empty_tree(batch_size: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
               ) -> DraftTree:
    """A tree of no nodes per row, to :func:`append_nodes` depths to."""
    long = torch.empty(batch_size, 0, dtype=torch.long, device=device)
    return DraftTree(long, long, long, torch.empty(batch_size, 0, dtype=dtype, device=device),
                     torch.empty(batch_size, 0, dtype=torch.bool, device=device))


def _best_candidates(scores: Tensor, tokens: Tensor, valid: Tensor, keep: int) -> Expansion:
    """The ``keep`` best of ``F * w`` candidates per row, best first, ties in candidate order (parent, then rank).

    Args:
        scores, tokens, valid: ``(B, F, w)`` candidate ``r`` of frontier node ``f``.
    """
    batch_size, frontier, width = scores.shape
    flat_scores = scores.reshape(batch_size, frontier * width)
    flat_valid = valid.reshape(batch_size, frontier * width)
    # E.g. frontier scores [-0.2, -1.9], children [[-0.5, -1.2], [-0.3, -0.5]] -> candidates [-0.7, -1.4, -2.2, -2.4]
    # (parent-major): keep 2 -> order [0, 1], parents [0, 0].
    order = torch.sort(_ranking_key(flat_scores, flat_valid), dim=-1, descending=True, stable=True).indices[:, :keep]
    return Expansion(
        parents=torch.div(order, width, rounding_mode="floor"),
        tokens=tokens.reshape(batch_size, frontier * width).gather(1, order),
        log_scores=flat_scores.gather(1, order),
        valid=flat_valid.gather(1, order),
    )


def _check_expansion(frontier_scores: Tensor, child_log_probs: Tensor, width: int, keep: int | None) -> int:
    if frontier_scores.ndim != 2 or child_log_probs.ndim != 3 or child_log_probs.shape[:2] != frontier_scores.shape:
        raise ValueError(f"frontier_scores must be (B, F) and child_log_probs (B, F, V), got "
                         f"{tuple(frontier_scores.shape)} and {tuple(child_log_probs.shape)}")
    _check_count("width", width, 1)
    if width > child_log_probs.shape[-1]:
        raise ValueError(f"width must be at most the vocabulary ({child_log_probs.shape[-1]}), got {width}")
    candidates = frontier_scores.shape[1] * width
    keep = width if keep is None else keep
    _check_count("keep", keep, 1)
    if keep > candidates:
        raise ValueError(f"keep must be at most frontier size * width = {candidates}, got {keep}")
    return keep


def expand_frontier(frontier_scores: Tensor, child_log_probs: Tensor, width: int, keep: int | None = None
                    ) -> Expansion:
    """Greedy tree drafting's step (EAGLE-2): the ``width`` most likely children of every frontier node, scored by
    cumulative ``log q``, and the ``keep`` best of those ``F * width`` candidates (``width = 1``: the greedy chain).

    Args:
        frontier_scores: ``(B, F)`` cumulative scores of the nodes being expanded (``-inf`` for an invalid one); the
            root is a frontier of one node of score 0.
        child_log_probs: ``(B, F, V)`` log-softmax of the draft at each frontier node.
        width: children per frontier node.
        keep: candidates kept, ``1..F * width`` (default ``width``: only the next frontier; ``F * width``: every
            candidate, EAGLE-2's pool of leaves).

    Returns:
        :class:`Expansion` of ``keep`` nodes per row.
    """
    keep = _check_expansion(frontier_scores, child_log_probs, width, keep)
    child_scores, tokens = child_log_probs.topk(width, dim=-1)  # (B, F, w) each
    scores = frontier_scores[..., None] + child_scores
    valid = child_scores > float("-inf")
    valid &= frontier_scores[..., None] > float("-inf")
    return _best_candidates(scores, tokens, valid, keep)


def gumbel_top_k(log_probs: Tensor, k: int, generator: torch.Generator | None = None) -> Tensor:
    """``k`` draws without replacement from ``softmax(log_probs)`` over the last dimension, in draw order:
    ``(..., V) -> (..., k)`` long: the ``k`` largest ``log q + G``, ``G`` i.i.d. standard Gumbel (the Gumbel-top-k
    trick). Draws past the support of ``q`` are arbitrary tokens of ``q = 0``.
    """
    noise = torch.empty_like(log_probs).exponential_(1, generator=generator)  # G = -log E, E ~ Exp(1)
    perturbed = log_probs - noise.clamp(min=torch.finfo(noise.dtype).tiny).log()
    return perturbed.topk(k, dim=-1).indices


def expand_frontier_sampled(frontier_scores: Tensor, child_log_probs: Tensor, width: int, keep: int | None = None,
                            generator: torch.Generator | None = None) -> Expansion:
    """Sampling tree drafting's step: every frontier node draws ``width`` distinct children from its ``q`` (without
    replacement, in draw order), and the ``keep`` best candidates are kept.

    A child of draw rank ``r`` scores its parent's score plus the log of the ``r``-th largest ``q``, which does not
    depend on the token drawn (what lossless verification needs: docs/design.md, "Draft trees").

    Args:
        frontier_scores, child_log_probs, width, keep: as in :func:`expand_frontier`.
        generator: random generator (on ``child_log_probs``' device).

    Returns:
        :class:`Expansion` of ``keep`` nodes per row; draws past the support of ``q`` are invalid.
    """
    keep = _check_expansion(frontier_scores, child_log_probs, width, keep)
    tokens = gumbel_top_k(child_log_probs, width, generator)  # (B, F, w) in draw order
    confidences = child_log_probs.topk(width, dim=-1).values  # (B, F, w) the r-th largest log q
    scores = frontier_scores[..., None] + confidences
    valid = confidences > float("-inf")
    valid &= frontier_scores[..., None] > float("-inf")
    return _best_candidates(scores, tokens, valid, keep)


def append_nodes(tree: DraftTree, expansion: Expansion, frontier_start: int) -> DraftTree:
    """``tree`` with one depth's new nodes appended (they take node indices ``N .. N + K - 1``).

    Args:
        tree: ``(B, N)`` fields.
        expansion: ``(B, K)`` new nodes, ``parents`` relative to the frontier.
        frontier_start: node index of the frontier's first node; ``-1`` when the frontier is the root (then
            ``expansion.parents`` are all 0 and become -1).
    """
    parents = expansion.parents + frontier_start
    if frontier_start < 0:
        depths = torch.ones_like(parents)
    else:
        depths = tree.depths.gather(1, parents) + 1
    return DraftTree(
        tokens=torch.cat([tree.tokens, expansion.tokens], dim=1),
        parents=torch.cat([tree.parents, parents], dim=1),
        depths=torch.cat([tree.depths, depths], dim=1),
        log_scores=torch.cat([tree.log_scores, expansion.log_scores.to(tree.log_scores.dtype)], dim=1),
        valid=torch.cat([tree.valid, expansion.valid], dim=1),
    )


def frontier_log_scores(tree: DraftTree, frontier: slice) -> Tensor:
    """``(B, F)`` scores of the nodes in ``frontier`` (a slice of node indices), ``-inf`` where invalid."""
    return tree.log_scores[:, frontier].masked_fill(~tree.valid[:, frontier], float("-inf"))


def grow_tree(root_log_probs: Tensor, next_log_probs: Callable[[DraftTree, slice], Tensor], depth: int,
              width: int, keep: int | None = None, sample: bool = False,
              generator: torch.Generator | None = None) -> GrownTree:
    """Draft a tree of ``depth`` levels (EAGLE-2's expansion), one draft call per level below the first: each depth
    expands the previous one's best ``width`` nodes into ``width`` children each and keeps ``keep``. Depth 1 is at
    nodes ``0 .. width - 1``, depth ``d >= 2`` at ``width + (d - 2) * keep ..``, so ``N = width + (depth - 1) * keep``.

    Args:
        root_log_probs: ``(B, V)`` the draft's log-softmax after the root token.
        next_log_probs: ``(tree, frontier) -> (B, F, V)`` the draft's log-softmax after each node of ``frontier`` (a
            slice of node indices), each seeing its ancestors only, at position length + depth.
        depth: levels, ``>= 1``.
        width, keep: as in :func:`expand_frontier` (``keep <= width * width``).
        sample: draw children (:func:`expand_frontier_sampled`) instead of taking the top ones.
        generator: for sampling.

    Returns:
        :class:`GrownTree`.
    """
    _check_count("depth", depth, 1)
    expand = expand_frontier_sampled if sample else expand_frontier
    extra = {"generator": generator} if sample else {}
    batch_size = root_log_probs.shape[0]
    tree = empty_tree(batch_size, root_log_probs.device, root_log_probs.dtype)
    root_scores = root_log_probs.new_zeros(batch_size, 1)
    tree = append_nodes(tree, expand(root_scores, root_log_probs[:, None], width, width, **extra), -1)
    expanded, frontiers = [root_log_probs[:, None]], []  # position 0 of `expanded`: the root's law
    start, size = 0, width
    for _ in range(depth - 1):
        frontier = slice(start, start + min(width, size))
        log_probs = next_log_probs(tree, frontier)
        expansion = expand(frontier_log_scores(tree, frontier), log_probs, width, keep, **extra)
        frontiers.append(frontier)
        expanded.append(log_probs)
        tree = append_nodes(tree, expansion, frontier.start)
        start, size = start + size, expansion.tokens.shape[1]
    # E.g. width 2, keep 3, depth 3: nodes 0-1 (depth 1), 2-4, 5-7; frontiers 0-1 and 2-3 -> [1, 2, 3, 4, -1, ...]
    device = root_log_probs.device
    expanded_of_node = torch.full((tree.tokens.shape[1],), -1, dtype=torch.long, device=device)
    position = 1
    for frontier in frontiers:  # built on the device: no host tensor to copy over
        count = frontier.stop - frontier.start
        expanded_of_node[frontier] = torch.arange(position, position + count, device=device)
        position += count
    return GrownTree(tree, torch.cat(expanded, dim=1), expanded_of_node)


# ---------------------------------------------------------------------------------------------------------------
# 2. Select


def select_tree_nodes(log_scores: Tensor, valid: Tensor, parents: Tensor, budget: int,
                      max_per_row: int | None = None) -> Tensor:
    """TETRIS over trees: verify the ``budget`` best nodes of the whole batch, score descending, ties to the lower row,
    then the lower node index; every row's selection is a subtree. With ``max_per_row`` a full row takes no more and
    the budget goes on down the order (the greedy stays optimal: the two limits form a laminar matroid).

    Args:
        log_scores: ``(B, N)`` cumulative path scores.
        valid: ``(B, N)`` candidate nodes (a node under an invalid one is not a candidate either).
        parents: ``(B, N)`` parent indices, -1 for the root's children.
        budget: nodes to verify across the batch, ``>= 0``.
        max_per_row: a cap on a row's nodes (the block width :func:`tree_block` is given), ``None`` for none.

    Returns:
        ``(B, N)`` bool; ``selected.sum() == min(budget, candidate nodes)`` (candidates: within their row's cap).
    """
    _check_count("budget", budget, 0)
    batch_size, num_nodes = log_scores.shape
    take = min(budget, batch_size * num_nodes)  # the candidate count is not read from the device
    if take == 0 or max_per_row == 0:
        return torch.zeros_like(valid)
    scores, valid = _closed(log_scores, valid, parents)
    if max_per_row is not None and _check_count("max_per_row", max_per_row, 0) < num_nodes:
        valid = valid & (_row_ranks(scores, valid) < max_per_row)  # a row's order is the batch order within it
    flat_valid = valid.flatten()
    order = torch.sort(_ranking_key(scores, valid).flatten(), descending=True, stable=True).indices[:take]
    # A non-candidate among the first `take` (fewer candidates than the budget) is not selected.
    chosen = torch.zeros_like(flat_valid).scatter(0, order, flat_valid.gather(0, order))
    return chosen.view(batch_size, num_nodes)


def _row_ranks(scores: Tensor, valid: Tensor) -> Tensor:
    """``(B, N)`` each node's place in its row's order (score descending, lower index first; invalid nodes last)."""
    order = torch.sort(_ranking_key(scores, valid), dim=-1, descending=True, stable=True).indices
    positions = torch.arange(order.shape[1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, positions)


def select_tree_fixed(log_scores: Tensor, valid: Tensor, parents: Tensor, nodes_per_row: int) -> Tensor:
    """Standard tree speculative decoding: each row verifies its own ``nodes_per_row`` best nodes (EAGLE-2's
    ``total_tokens - 1``), in the order of :func:`select_tree_nodes`; a subtree of every row.

    Args:
        log_scores, valid, parents: ``(B, N)`` as in :func:`select_tree_nodes`.
        nodes_per_row: ``>= 0``.

    Returns:
        ``(B, N)`` bool, ``min(nodes_per_row, candidates)`` nodes per row.
    """
    _check_count("nodes_per_row", nodes_per_row, 0)
    if nodes_per_row == 0:
        return torch.zeros_like(valid)
    scores, valid = _closed(log_scores, valid, parents)
    return (_row_ranks(scores, valid) < nodes_per_row) & valid


# ---------------------------------------------------------------------------------------------------------------
# 3. Verify: the block


def tree_block(selected: Tensor, parents: Tensor, depths: Tensor, tokens: Tensor, root_tokens: Tensor,
               max_nodes: int, filler_token: int = 0) -> TreeBlock:
    """Lay out every row's selected subtree for one target forward: ``[root, selected nodes in node order, filler]``.

    A row with more than ``max_nodes`` keeps its first ``M``, still a subtree, but when sampling that cut is not blind
    to the drawn tokens: cap rows in selection instead (``max_per_row``).

    Args:
        selected: ``(B, N)`` bool, ancestor-closed (from :func:`select_tree_nodes` or :func:`select_tree_fixed`).
        parents, depths, tokens: ``(B, N)`` the tree.
        root_tokens: ``(B,)`` each row's last emitted token.
        max_nodes: ``M >= 0``, a host bound on the selected nodes per row.
        filler_token: the token in filler slots (never seen by a real slot).

    Returns:
        :class:`TreeBlock` with ``S = 1 + M`` slots.
    """
    _check_count("max_nodes", max_nodes, 0)
    batch_size, num_nodes = selected.shape
    device = selected.device
    slots = 1 + max_nodes
    rank = selected.long().cumsum(dim=1)  # 1-based slot of each selected node
    selected = selected & (rank <= max_nodes)
    node_slot = torch.where(selected, rank, -1)  # (B, N)
    # E.g. selected [T, F, T, T] -> node_slot [1, -1, 2, 3]; node_index [0, 2, 3] (slots 1..3).
    dump = torch.where(selected, rank, slots)  # unselected nodes write into a column that is dropped
    nodes = torch.arange(num_nodes, device=device).expand(batch_size, num_nodes)
    slot_node = torch.full((batch_size, slots + 1), -1, dtype=torch.long, device=device).scatter(1, dump, nodes)
    node_index = slot_node[:, 1:slots]  # (B, M)
    real = node_index >= 0
    at = node_index.clamp(min=0)
    node_tokens = torch.where(real, tokens.gather(1, at), filler_token)
    offsets = torch.where(real, depths.gather(1, at), 0)
    parent_node = parents.gather(1, at)
    parent_slot = torch.where(parent_node >= 0, node_slot.gather(1, parent_node.clamp(min=0)), 0)
    parent_slot = torch.where(real, parent_slot, -1)
    first = torch.full((batch_size, 1), -1, dtype=torch.long, device=device)
    block_parents = torch.cat([first, parent_slot], dim=1)
    return TreeBlock(
        tokens=torch.cat([root_tokens[:, None].to(tokens.dtype), node_tokens], dim=1),
        position_offsets=torch.cat([torch.zeros_like(first), offsets], dim=1),
        ancestor_mask=ancestor_mask(block_parents),
        parents=block_parents,
        node_index=node_index,
        lengths=1 + selected.sum(dim=1),
    )


def path_tokens(tokens: Tensor, parents: Tensor, depths: Tensor, max_depth: int, filler: int = 0) -> Tensor:
    """The tokens on the path to every node, from depth 1 down to the node itself: ``(B, S, max_depth)``, column
    ``d - 1`` the ancestor at depth ``d``, ``filler`` past the node's depth; for a tree's nodes or a
    :class:`TreeBlock`'s slots (the root, at depth 0, is on no path). E.g. block tokens [r, the, cat, dog], parents
    [-1, 0, 1, 1], depths [0, 1, 2, 2] -> [[f, f], [the, f], [the, cat], [the, dog]].

    Args:
        tokens, parents, depths: ``(B, S)``.
        max_depth: a host bound on ``depths``.
    """
    batch_size, slots = tokens.shape
    out = torch.full((batch_size, slots, max_depth + 1), filler, dtype=tokens.dtype, device=tokens.device)
    current = torch.arange(slots, device=tokens.device).expand(batch_size, slots)
    for _ in range(max_depth):  # one level up per round; column max_depth catches what is above depth 1
        at = current.clamp(min=0)
        depth = torch.where(current >= 0, depths.gather(1, at), 0)
        column = torch.where(depth >= 1, depth - 1, max_depth)
        out.scatter_(2, column[..., None], tokens.gather(1, at)[..., None])
        current = torch.where(current >= 0, parents.gather(1, at), -1)
    return out[..., :max_depth]


def ancestor_mask(block_parents: Tensor) -> Tensor:
    """``(B, S)`` block parents -> ``(B, S, S)`` bool, ``[b, i, j]``: slot ``j`` is slot ``i`` or an ancestor of it
    (pointer jumping, ``ceil(log2 S)`` rounds)."""
    batch_size, slots = block_parents.shape
    mask = torch.eye(slots, dtype=torch.bool, device=block_parents.device).expand(batch_size, slots, slots)
    jump = _self_loops(block_parents)
    for _ in range(_jump_rounds(slots)):
        mask = mask | mask.gather(1, jump[:, :, None].expand(batch_size, slots, slots))
        jump = jump.gather(1, jump)
    return mask


def block_draft_log_probs(expanded_log_probs: Tensor, expanded_of_node: Tensor, node_index: Tensor) -> Tensor:
    """The draft law ``q`` each block slot's children were drawn from: ``(B, S, V)``, slot 0 the root's (also given,
    unread, to slots never expanded).

    Args:
        expanded_log_probs: ``(B, E, V)`` and expanded_of_node ``(N,)`` from :func:`grow_tree`.
        node_index: ``(B, M)`` from :func:`tree_block`.
    """
    batch_size = node_index.shape[0]
    position = torch.where(node_index >= 0, expanded_of_node[node_index.clamp(min=0)], -1).clamp(min=0)
    position = torch.cat([position.new_zeros(batch_size, 1), position], dim=1)
    vocab = expanded_log_probs.shape[-1]
    return expanded_log_probs.gather(1, position[..., None].expand(-1, -1, vocab))


# ---------------------------------------------------------------------------------------------------------------
# 4. Accept


def _path_to(last: Tensor, depth: Tensor, block_parents: Tensor, max_depth: int) -> Tensor:
    """``(B, max_depth)`` slots from depth 1 down to ``last`` (at depth ``depth``), -1 after: a walk up."""
    batch_size = last.shape[0]
    path = torch.full((batch_size, max_depth + 1), -1, dtype=torch.long, device=last.device)
    slot = last
    for step in range(max_depth):
        place = depth - 1 - step  # where this ancestor goes; < 0 once above depth 1
        path.scatter_(1, torch.where(place >= 0, place, max_depth)[:, None], slot[:, None])
        slot = block_parents.gather(1, slot.clamp(min=0)[:, None]).squeeze(1)
    return path[:, :max_depth]


def accept_tree_greedy(block_tokens: Tensor, block_parents: Tensor, target_argmax: Tensor,
                       max_depth: int | None = None) -> TreeAcceptance:
    """Greedy tree verification: the deepest path of the block whose every node is the target's argmax at its
    parent, then the target's argmax after its last node (ties between equally deep paths: the lower slot).

    Args:
        block_tokens: ``(B, S)`` :attr:`TreeBlock.tokens`.
        block_parents: ``(B, S)`` :attr:`TreeBlock.parents`.
        target_argmax: ``(B, S)`` the target's argmax at every slot (the token it predicts after it).
        max_depth: host bound on the tree's depth (the path's width ``D``); default ``S - 1``.

    Returns:
        :class:`TreeAcceptance`.
    """
    batch_size, slots = block_tokens.shape
    max_depth = slots - 1 if max_depth is None else _check_count("max_depth", max_depth, 0)
    real = block_parents >= 0
    at_parent = target_argmax.gather(1, block_parents.clamp(min=0))
    matched = (block_tokens == at_parent) | ~real  # the root (and filler, dropped below) count as matched
    depth = real.long()
    jump = _self_loops(block_parents)
    for _ in range(_jump_rounds(slots)):  # and matched and sum depth over every slot's ancestors
        matched = matched & matched.gather(1, jump)
        depth = depth + depth.gather(1, jump)
        jump = jump.gather(1, jump)
    accepted = matched & real
    # The deepest accepted slot, the lower slot on ties; the root (key S - 1) when none.
    slot_ids = torch.arange(slots, device=block_tokens.device)
    key = torch.where(accepted, depth * slots + (slots - 1 - slot_ids), -1)
    key = torch.where(slot_ids == 0, slots - 1, key)
    last = key.argmax(dim=1)
    num_accepted = depth.gather(1, last[:, None]).squeeze(1)
    next_tokens = target_argmax.gather(1, last[:, None]).squeeze(1)
    return TreeAcceptance(_path_to(last, num_accepted, block_parents, max_depth), num_accepted, next_tokens)


def _without(proposal: Tensor, token: Tensor) -> Tensor:
    """``(B, V)`` draft laws with ``token`` ``(B,)`` removed and renormalised (the next sibling's law)."""
    proposal = proposal.scatter(1, token[:, None], 0.0)
    return proposal / proposal.sum(dim=1, keepdim=True).clamp(min=torch.finfo(proposal.dtype).tiny)


def accept_tree_sampling(block_tokens: Tensor, block_parents: Tensor, target_probs: Tensor, draft_probs: Tensor,
                         max_depth: int, max_children: int, generator: torch.Generator | None = None
                         ) -> TreeAcceptance:
    """Lossless tree verification: recursive rejection sampling without replacement over each node's verified
    children, from the root down. Child ``c_j`` is accepted with probability ``min(1, p_j(c_j) / q_j(c_j))``, ``q_j``
    being ``q`` without the earlier siblings, renormalised; a rejection leaves ``p_{j+1} = norm(max(p_j - q_j, 0))``;
    with no child accepted the next token is drawn from the last ``p_j``. Needs children drawn without replacement
    and verified blind to their tokens (:func:`expand_frontier_sampled`, then this module's selection and
    :func:`tree_block`); the proof: docs/design.md, "Draft trees".

    Args:
        block_tokens, block_parents: ``(B, S)`` from :func:`tree_block`.
        target_probs: ``(B, S, V)`` the target's (processed) distribution after each slot.
        draft_probs: ``(B, S, V)`` the law each slot's children were drawn from (:func:`block_draft_log_probs`,
            exponentiated); rows of slots without children are not read.
        max_depth: host bound on the tree's depth (the path's width).
        max_children: host bound on a node's verified children (the drafting width).
        generator: random generator.

    Returns:
        :class:`TreeAcceptance`.
    """
    _check_count("max_depth", max_depth, 0)
    _check_count("max_children", max_children, 0)
    batch_size, slots = block_tokens.shape
    device = block_tokens.device
    rows = torch.arange(batch_size, device=device)
    current = torch.zeros(batch_size, dtype=torch.long, device=device)  # the root slot
    done = torch.zeros(batch_size, dtype=torch.bool, device=device)
    num_accepted = torch.zeros(batch_size, dtype=torch.long, device=device)
    final = target_probs[:, 0].clone()  # the law the next token is drawn from, set when a row stops
    path = torch.full((batch_size, max_depth), -1, dtype=torch.long, device=device)
    for level in range(max_depth + 1):
        target, proposal = target_probs[rows, current], draft_probs[rows, current]  # (B, V)
        children = block_parents == current[:, None]  # (B, S); the root and filler have parent -1
        ranks = max_children if level < max_depth else 0
        current, target, moved = _try_children(block_tokens, children, current, target, proposal, done, ranks,
                                               generator)
        stop = ~done & ~moved
        final = torch.where(stop[:, None], target, final)
        done |= stop
        if level < max_depth:
            path[:, level] = torch.where(moved, current, -1)
            num_accepted += moved.long()
    return TreeAcceptance(path, num_accepted, sample_tokens(final, generator))


def accept_tree_matching(block_tokens: Tensor, block_parents: Tensor, target_probs: Tensor, max_depth: int,
                         generator: torch.Generator | None = None) -> TreeAcceptance:
    """Lossless sampling verification of a deterministic tree (drafted from no law: suffix drafts): at each node of
    the path, from the root down, draw ``x ~ p`` (the target's processed law there); move to the verified child whose
    token is ``x`` (the lowest slot, should siblings repeat a token), else stop and emit ``x``. Every emitted token is
    a fresh draw from ``p``; the tree, fixed before any draw, only decides how far one forward's draws reach.

    Args:
        block_tokens, block_parents: ``(B, S)`` from :func:`tree_block`.
        target_probs: ``(B, S, V)`` the target's (processed) distribution after each slot.
        max_depth: host bound on the tree's depth (the path's width).
        generator: random generator.

    Returns:
        :class:`TreeAcceptance`.
    """
    _check_count("max_depth", max_depth, 0)
    batch_size = block_tokens.shape[0]
    device = block_tokens.device
    rows = torch.arange(batch_size, device=device)
    current = torch.zeros(batch_size, dtype=torch.long, device=device)  # the root slot
    moving = torch.ones(batch_size, dtype=torch.bool, device=device)
    path = torch.full((batch_size, max_depth), -1, dtype=torch.long, device=device)
    draws = sample_tokens(target_probs[rows, current], generator)  # (B,) x ~ p at the root
    for level in range(max_depth):
        children = (block_parents == current[:, None]) & (block_tokens == draws[:, None])  # (B, S)
        moving = moving & children.any(dim=1)
        current = torch.where(moving, children.long().argmax(dim=1), current)
        path[:, level] = torch.where(moving, current, -1)
        fresh = sample_tokens(target_probs[rows, current], generator)  # x ~ p at the new node
        draws = torch.where(moving, fresh, draws)  # a row that stopped keeps the draw it emits
    return TreeAcceptance(path, (path >= 0).sum(dim=1), draws)


def _try_children(block_tokens: Tensor, children: Tensor, current: Tensor, target: Tensor, proposal: Tensor,
                  done: Tensor, ranks: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor]:
    """One depth of :func:`accept_tree_sampling`: each row not ``done`` tries the verified ``children`` ``(B, S)`` of
    its ``current`` node ``(B,)`` in slot order, up to ``ranks`` of them, with the laws ``target`` and ``proposal``
    ``(B, V)`` at that node, each rejection leaving the residual and removing the child from ``q``. Returns the new
    current nodes, the law the next token is drawn from where no child was accepted, and ``(B,)`` which rows moved."""
    batch_size, device = block_tokens.shape[0], block_tokens.device
    rows = torch.arange(batch_size, device=device)
    sibling_rank = children.long().cumsum(dim=1) - 1
    moved = torch.zeros_like(done)
    for rank in range(ranks):
        here = children & (sibling_rank == rank)
        trying = here.any(dim=1) & ~done & ~moved
        child = here.long().argmax(dim=1)
        token = block_tokens[rows, child]
        p_x = target.gather(1, token[:, None]).squeeze(1)
        q_x = proposal.gather(1, token[:, None]).squeeze(1)
        uniform = torch.rand(batch_size, dtype=target.dtype, generator=generator, device=device)
        accept = trying & (uniform * q_x < p_x)  # probability min(1, p/q) without dividing by q
        reject = trying & ~accept
        moved |= accept
        current = torch.where(accept, child, current)
        target = torch.where(reject[:, None], residual_distribution(target, proposal)[0], target)
        proposal = torch.where(reject[:, None], _without(proposal, token), proposal)
    return current, target, moved


# ---------------------------------------------------------------------------------------------------------------
# 5. Roll back


def kept_slots(path: Tensor, slots: int) -> Tensor:
    """The block slots a KV cache keeps after acceptance, ``(B, S)`` bool: the root and the accepted nodes, in
    position order but not contiguous (path [1, 3] of a 4-slot block -> [T, T, F, T]).

    Args:
        path: ``(B, D)`` :attr:`TreeAcceptance.path` (-1 padded).
        slots: ``S``.
    """
    batch_size = path.shape[0]
    keep = torch.zeros(batch_size, slots + 1, dtype=torch.bool, device=path.device)
    keep[:, 0] = True
    keep.scatter_(1, torch.where(path >= 0, path, slots), True)
    return keep[:, :slots]


# ---------------------------------------------------------------------------------------------------------------
# Analysis


def path_products(values: Tensor, parents: Tensor) -> Tensor:
    """``(B, N)`` each node's value times all its ancestors' (e.g. conditional acceptances -> the probability that the
    whole path to the node is accepted)."""
    return _path_reduce(values, parents, torch.mul)


def conditional_log_probs(tree: DraftTree) -> Tensor:
    """``(B, N)`` each node's own confidence, its score minus its parent's (the root's children: their score);
    ``-inf`` for an invalid node."""
    parent_scores = torch.where(tree.parents >= 0, tree.log_scores.gather(1, tree.parents.clamp(min=0)), 0.0)
    return torch.where(tree.valid, tree.log_scores - parent_scores, float("-inf"))
