"""The loop's side of a draft-tree step (``tetris_tree_width=w > 1``): every row drafts a tree, the strategy selects
nodes, the target verifies every selected node in one forward, each row accepts one path, both caches roll back.

The maths is :mod:`tetris_hf.trees`; this module runs it on the loop's models and caches, in
:func:`~tetris_hf.step_strategy.run_step`'s order (plan -> draft -> select -> verify -> observe):

1. **Draft:** the draft model grows ``w K`` nodes per row, ``K`` the plan's drafts
   (:meth:`~tetris_hf.candidate_generators.BatchedDraftCandidateGenerator.propose_tree`; an EAGLE head's nodes
   read its own output at their parents).
2. **Select:** the strategy's ``select_tree`` (TETRIS: the batch's ``C`` best nodes by path score; ``fixed``: each
   row's ``k`` best; ``adaptive``: ``C`` from the cost model); nodes deeper than a row may still grow are no
   candidates.
3. **Verify:** one target forward over ``[root, selected nodes, filler]`` per row (:func:`~tetris_hf.trees.tree_block`),
   a node seeing the row's cached tokens and its ancestors, at the root's position plus its depth; the processors run
   at every node on its own prefix. The step's one device read sizes the block (the most nodes a row selected), with
   the caches' fill levels, as a chain step's does.
4. **Accept:** greedy, the deepest selected path the target's argmax follows; sampling, recursive rejection sampling
   over siblings (lossless, :mod:`tetris_hf.trees`).
5. **Roll back:** both caches keep the root and the accepted path where they are (holes elsewhere), the accepted tokens
   go into the rows, and the loop emits as after a chain.

The strategy observes a chain per row (:func:`observed_chain`): the accepted path, then down the best children.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .trees import (
    DraftTree, accept_tree_greedy, accept_tree_sampling, block_draft_log_probs, conditional_log_probs, kept_slots,
    path_tokens, tree_block,
)
from .logits.argmax import vocab_argmax
from .step_strategy import StepSeconds
from .tree_logits import process_at_nodes


class StepTree(NamedTuple):
    """One tree step's trees, for step callbacks that show them (``StepRecord.tree``; the Space's board). Rows are the
    step's active rows (``StepRecord.rows``).

    ``tree``: the drafted :class:`~tetris_hf.trees.DraftTree` (``(B, N)`` per node); ``selected``: ``(B, N)`` bool,
    the verified nodes; ``roots``: ``(B,)`` each row's last token before the step; ``path_nodes``: ``(B, D)`` the
    accepted path's node indices (``-1`` past it); ``num_accepted``: ``(B,)``; ``next_tokens``: ``(B,)`` the target's
    token after the path.
    """

    tree: DraftTree
    selected: torch.Tensor
    roots: torch.Tensor
    path_nodes: torch.Tensor
    num_accepted: torch.Tensor
    next_tokens: torch.Tensor


class TreeOutcome(NamedTuple):
    """What a tree step did (``(B_active,)`` tensors), for the loop's :class:`~tetris_hf.decoding.StepRecord`.

    ``num_drafted``: ``K``, the tree's depth (0: a plain step). ``token_log_probs``: ``(B, K)`` the observed chain's
    confidences (:func:`observed_chain`). ``verify_lengths``: nodes verified. ``proposed``: nodes drafted (valid ones).
    """

    num_drafted: int
    budget: int
    token_log_probs: torch.Tensor | None
    verify_lengths: torch.Tensor
    num_accepted: torch.Tensor
    emitted: torch.Tensor
    stopped: torch.Tensor
    seconds: StepSeconds | None
    proposed: torch.Tensor | None
    trees: StepTree | None = None  # (None: a plain step)


def tree_step(loop, width: int) -> TreeOutcome:
    """One step of :class:`~tetris_hf.decoding.BatchedSpeculativeLoop` with draft trees of ``width`` children."""
    strategy, clock = loop.strategy, loop.clock
    room = max(loop.max_length - loop.shortest - 1, 0)  # no row may verify deeper than this
    plan = strategy.plan(loop.num_rows)
    depth = min(plan.num_draft_tokens, room, loop.max_draft) if plan.budget > 0 else 0
    if depth == 0:  # a plain step, as a chain loop takes it
        proposal, max_lengths = loop._draft(0, False)
        verify_lengths = torch.zeros_like(max_lengths)
        verdict = loop._verify(proposal, verify_lengths)
        strategy.observe(proposal.log_probs, verify_lengths, verdict.num_accepted, verdict.seconds, 0)
        return TreeOutcome(0, plan.budget, proposal.log_probs, verify_lengths, verdict.num_accepted, verdict.emitted,
                           verdict.stopped, verdict.seconds, None)

    # 1. draft
    drafter, lengths = loop.drafter, loop.lengths
    clock.mark("catch_up_start")
    drafter.catch_up()  # a one-off, kept out of the timings
    clock.mark("catch_up_end")
    clock.mark("draft_start")
    grown = drafter.propose_tree(loop.sequences, lengths, depth, width, loop.rows)
    clock.mark("draft_end")
    tree = grown.tree

    roots = loop.last_tokens.clone()  # (for StepTree: the loop overwrites them when it emits)

    # 2. select (a target token always follows the accepted path: rows near their limit take shallower nodes only)
    if loop.longest + depth >= loop.max_length:
        max_depths = (loop.max_length - 1 - lengths).clamp(min=0, max=depth)
        tree = tree._replace(valid=tree.valid & (tree.depths <= max_depths[:, None]))
    selected = strategy.select_tree(tree, plan)

    # 3. verify. The step's one read: the widest selection sizes the block; the caches' fill levels come along.
    target, verified = loop.target_slots, selected.sum(dim=1)
    read = [verified, target.live_lengths(), lengths, drafter.live_lengths()]
    max_nodes, target_longest, loop.longest, drafter_longest = torch.stack(read).amax(dim=1).tolist()
    block = tree_block(selected, tree.parents, tree.depths, tree.tokens, loop.last_tokens, max_nodes,
                             loop.pad_value)
    slots = block.tokens.shape[1]
    visibility = block.ancestor_mask.clone()
    visibility[:, :, 0] = True  # filler sees the root too (a query that sees nothing gives NaN in some kernels)
    logits = target.forward(loop.model, block.tokens, None, step=True, real_lengths=block.lengths,
                            position_ids=target.next_positions[:, None] + block.position_offsets,
                            visibility=visibility)
    max_depth = min(depth, max_nodes)  # a host bound on the accepted path
    paths = None if loop.logits_processor.prefix_free else \
        path_tokens(block.tokens, block.parents, block.position_offsets, max_depth)
    scores = process_at_nodes(loop.logits_processor, loop.sequences, lengths, loop.rows, logits, paths,
                              block.position_offsets)

    # 4. accept
    if loop.do_sample:
        draft_probs = block_draft_log_probs(grown.expanded_log_probs, grown.expanded_of_node,
                                                  block.node_index).exp()
        acceptance = accept_tree_sampling(block.tokens, block.parents, scores.softmax(dim=-1), draft_probs,
                                                max_depth, width)
    else:
        acceptance = accept_tree_greedy(block.tokens, block.parents, vocab_argmax(scores), max_depth)

    # 5. roll back: each cache keeps the root and the accepted path
    target.keep_slots(target.length - slots, kept_slots(acceptance.path, slots))
    target.compact(target_longest + slots)
    path = acceptance.path
    path_nodes = torch.where(path >= 0, block.node_index.gather(1, (path - 1).clamp(min=0)), -1)
    drafter.accept_tree(path_nodes, path, acceptance.num_accepted, acceptance.next_tokens, max_depth, drafter_longest,
                        features=loop._target_features())
    clock.mark("verify_end")

    # the accepted tokens go after each row's end (columns past the path are scratch the target token or nothing
    # overwrites), then the loop emits as after a chain
    columns = lengths[:, None] + torch.arange(max_depth, device=lengths.device)
    loop.sequences.scatter_(1, columns, block.tokens.gather(1, path.clamp(min=0)))
    emitted, stopped = loop._emit(acceptance.num_accepted, acceptance.next_tokens, max_depth + 1)
    clock.mark("end")
    seconds = clock.finish_step()

    chain_log_probs, chain_verified = observed_chain(tree, selected, path_nodes, acceptance.num_accepted, depth)
    strategy.observe(chain_log_probs, chain_verified, acceptance.num_accepted, seconds, depth)
    return TreeOutcome(depth, plan.budget, chain_log_probs, verified, acceptance.num_accepted, emitted, stopped,
                       seconds, grown.tree.valid.sum(dim=1),
                       StepTree(grown.tree, selected, roots, path_nodes, acceptance.num_accepted,
                                acceptance.next_tokens))


def observed_chain(tree: DraftTree, selected: torch.Tensor, path_nodes: torch.Tensor,
                   num_accepted: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain per row for strategies that learn from chains (``adaptive``, ``dsd``): the accepted path, then from its
    last node down the best child at each depth (the first child tried, then the best continuation).

    Returns:
        ``(B, K)`` each chain node's conditional ``log q`` (its score minus its parent's; ``-inf`` past the tree) and
        ``(B,)`` how many of the chain's first nodes were verified (the accepted ones, then a selected best child counts
        as the rejected cell).

    E.g. accepted path [0, 3] in a depth-3 tree whose node 3 has best child 5, unselected: chain [0, 3, 5],
    verified 2, accepted 2.
    """
    batch_size, num_nodes = tree.tokens.shape
    device = tree.tokens.device
    conditional = conditional_log_probs(tree)
    # first (best) child of every node in column node + 1 (column 0: the root's), num_nodes where there is none
    first_child = torch.full((batch_size, num_nodes + 2), num_nodes, dtype=torch.long, device=device)
    first_child.scatter_reduce_(1, tree.parents + 1, torch.arange(num_nodes, device=device).expand_as(tree.parents),
                                reduce="amin")
    current = torch.full((batch_size,), -1, dtype=torch.long, device=device)
    cells, verified = [], []
    for level in range(depth):
        on_path = path_nodes[:, level] if level < path_nodes.shape[1] else torch.full_like(current, -1)
        child = first_child.gather(1, (current + 1)[:, None]).squeeze(1)
        node = torch.where(level < num_accepted, on_path, child)
        exists = (node >= 0) & (node < num_nodes)
        at = node.clamp(min=0, max=num_nodes - 1)[:, None]
        cells.append(torch.where(exists, conditional.gather(1, at).squeeze(1), float("-inf")))
        verified.append(exists & selected.gather(1, at).squeeze(1))
        current = torch.where(exists, node, num_nodes)  # past the tree: the last column, no child
    chain_verified = torch.stack(verified, dim=1).long().cumprod(dim=1).sum(dim=1)
    return torch.stack(cells, dim=1), chain_verified
