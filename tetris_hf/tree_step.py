"""A step's phases when every row drafts a tree (``tetris_tree_width=w > 1``): :class:`TreeStep` runs the maths of
:mod:`tetris_hf.trees` on the loop's models and caches, in :func:`~tetris_hf.step.run_step`'s order; only drafting,
selection, verification, roll back and where the accepted tokens come from differ from a chain step. The strategy
observes a chain per row (:func:`observed_chain`). Design: docs/design.md, "Draft trees".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .batch import Batch
from .chain_step import ChainStep, StepContext, read_step
from .logits.argmax import vocab_argmax
from .step import Emission, Observation, ReadHints, StepTree, TargetBlock, Verdict
from .step_strategy import DraftPlan, StepStrategy
from .tree_logits import process_at_nodes
from .trees import (
    DraftTree, GrownTree, accept_tree_greedy, accept_tree_matching, accept_tree_sampling, block_draft_log_probs,
    conditional_log_probs, kept_slots, path_tokens, tree_block,
)


class TreeSelection(NamedTuple):
    """What a tree step selected."""

    candidates: DraftTree  # the drafted tree, nodes deeper than a row may still grow marked invalid
    nodes: torch.Tensor  # (B, N) bool, the verified nodes (an ancestor-closed subtree per row)
    depth: int  # the tree's levels, K


class TreeStep(ChainStep):
    """A step's phases when every row drafts a tree of ``width`` children per expanded node. A step that drafts
    nothing is a chain step (:attr:`plain`). Trees are not read beside joining prompts: their ancestor masks are not
    split by riding."""

    def __init__(self, context: StepContext, batch: Batch, width: int):
        super().__init__(context, batch)
        self.width = width
        self.depth = 0  # this step's K, the tree's levels (set when it drafts)

    @property
    def plain(self) -> ChainStep:
        return ChainStep(self.context, self.batch)

    def draft(self, depth: int, confidences: bool, lookup_only: bool = False) -> GrownTree:  # (no hybrid trees)
        batch, self.depth = self.batch, depth
        return self.context.drafter.propose(batch.sequences, batch.lengths, depth, batch.rows, confidences,
                                            tree_width=self.width)

    def select(self, strategy: StepStrategy, grown: GrownTree, plan: DraftPlan) -> TreeSelection:
        """The strategy's ``select_tree``; a target token always follows the accepted path, so rows near their limit
        take shallower nodes only."""
        tree, depth = grown.tree, self.depth
        max_depths = self.batch.room(depth)
        if max_depths is not None:
            tree = tree._replace(valid=tree.valid & (tree.depths <= max_depths[:, None]))
        return TreeSelection(tree, strategy.select_tree(tree, plan), depth)

    def verify(self, grown: GrownTree, selection: TreeSelection) -> tuple[Verdict, TargetBlock]:
        """One target forward over ``[root, selected nodes, filler]`` per row, each node seeing the row's cached tokens
        and its ancestors at the root's position plus its depth; then one path accepted per row."""
        context, batch = self.context, self.batch
        tree, selected, depth = selection.candidates, selection.nodes, selection.depth
        target, verified = context.target_slots, selected.sum(dim=1)
        read = read_step(context, batch, verified, grown.cached_lengths)  # the widest selection sizes the block
        block = tree_block(selected, tree.parents, tree.depths, tree.tokens, batch.last_tokens, read.block_length,
                           context.pad_value)
        slots = block.tokens.shape[1]
        visibility = block.ancestor_mask.clone()
        visibility[:, :, 0] = True  # filler sees the root too (a query that sees nothing gives NaN in some kernels)
        logits, features = target.forward(context.model, block.tokens, None, step=True, real_lengths=block.lengths,
                                          position_ids=target.next_positions[:, None] + block.position_offsets,
                                          visibility=visibility, num_real=read.num_verified + batch.num_rows,
                                          hidden_states=context.feature_layers)
        max_depth = min(depth, read.block_length)  # a host bound on the accepted path
        paths = None if context.logits_processor.prefix_free else \
            path_tokens(block.tokens, block.parents, block.position_offsets, max_depth)
        scores = process_at_nodes(context.logits_processor, batch.sequences, batch.lengths, batch.rows, logits, paths,
                                  block.position_offsets)
        if context.do_sample and grown.expanded_log_probs is None:  # a deterministic tree (suffix drafts)
            acceptance = accept_tree_matching(block.tokens, block.parents, scores.softmax(dim=-1), max_depth)
        elif context.do_sample:
            draft_probs = block_draft_log_probs(grown.expanded_log_probs, grown.expanded_of_node,
                                                block.node_index).exp()
            acceptance = accept_tree_sampling(block.tokens, block.parents, scores.softmax(dim=-1), draft_probs,
                                              max_depth, self.width)
        else:
            acceptance = accept_tree_greedy(block.tokens, block.parents, vocab_argmax(scores), max_depth)
        path = acceptance.path
        path_nodes = torch.where(path >= 0, block.node_index.gather(1, (path - 1).clamp(min=0)), -1)
        trees = StepTree(grown.tree, selected, batch.last_tokens, path_nodes, acceptance.num_accepted,
                         acceptance.next_tokens, path)
        verdict = Verdict(acceptance.num_accepted, acceptance.next_tokens, verified, trees,
                          ReadHints(max_depth, read.drafter_longest), features)
        return verdict, TargetBlock(target.length - slots, slots, read.target_longest + slots, target.tokens_read)

    def roll_back(self, grown: GrownTree, verdict: Verdict, block: TargetBlock) -> torch.Tensor | None:
        """Each cache keeps the root and the accepted path where they are (holes elsewhere)."""
        target = self.context.target_slots
        target.keep_slots(block.first_slot, kept_slots(verdict.tree.path_slots, block.width))
        target.compact(block.longest)
        return self.context.drafter.accept(verdict)

    def emit(self, verdict: Verdict) -> Emission:
        """The accepted path's tokens go after each row's end (columns past the path are scratch that the target's
        token or nothing overwrites), then the batch emits as after a chain."""
        batch, trees = self.batch, verdict.tree
        max_depth = verdict.hints.max_accepted
        path_tokens = torch.where(trees.path_nodes >= 0, trees.tree.tokens.gather(1, trees.path_nodes.clamp(min=0)),
                                  trees.roots[:, None])
        columns = batch.lengths[:, None] + torch.arange(max_depth, device=batch.lengths.device)
        batch.sequences.scatter_(1, columns, path_tokens[:, :max_depth])
        return super().emit(verdict)

    def observation(self, grown: GrownTree, selection: TreeSelection, verdict: Verdict) -> Observation:
        """The strategy observes a chain per row (:func:`observed_chain`); the nodes each row drafted (valid ones)."""
        log_probs, verified = observed_chain(selection.candidates, selection.nodes, verdict.tree.path_nodes,
                                             verdict.num_accepted, selection.depth)
        return Observation(log_probs, verified, grown.tree.valid.sum(dim=1))


def observed_chain(tree: DraftTree, selected: torch.Tensor, path_nodes: torch.Tensor,
                   num_accepted: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A chain per row for strategies that learn from chains (``adaptive``, ``dsd``): the accepted path, then from its
    last node down the best child at each depth. E.g. accepted path [0, 3], node 3's best child 5 unselected: chain
    [0, 3, 5], verified 2.

    Args:
        tree: the candidates, ``(B, N)`` fields; selected: ``(B, N)`` bool; path_nodes: ``(B, D)`` accepted nodes,
            -1 after; num_accepted: ``(B,)``; depth: ``K``.

    Returns:
        ``(B, K)`` each chain node's conditional ``log q`` (``-inf`` past the tree) and ``(B,)`` how many of the
        chain's first nodes were verified (the accepted ones, then a selected best child as the rejected cell).
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
