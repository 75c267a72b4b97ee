"""``generate()``'s logits processors at the nodes of draft trees, each node on its own prefix (the row's tokens,
then the path to the node), for the draft's laws while it grows a tree and the target's at every verified node."""

from __future__ import annotations

import torch

from .logits.processing import PositionwiseLogitsProcessor


def process_at_nodes(processor: PositionwiseLogitsProcessor, sequences: torch.Tensor, lengths: torch.Tensor,
                     rows: torch.Tensor, logits: torch.Tensor, paths: torch.Tensor | None, depths: torch.Tensor
                     ) -> torch.Tensor:
    """``generate()``'s processors at ``S`` tree nodes per row, each on its own prefix: the row's tokens, then the
    path to the node. ``(B, S, V)`` float32.

    Args:
        sequences: ``(B, T)``, valid up to ``lengths`` ``(B,)``, ``T >= lengths + D``.
        rows: ``(B,)`` original batch indices.
        logits: ``(B, S, V)`` raw logits after each node.
        paths: ``(B, S, D)`` :func:`~tetris_hf.trees.path_tokens` (only read when a processor reads the prefix:
            ``None`` when ``processor.prefix_free``); depths ``(B, S)`` (0: the root).
    """
    if processor.prefix_free:  # nothing reads the prefix: every node at once
        return processor(sequences, lengths, logits, rows)
    batch_size, nodes, vocab = logits.shape
    # one row per node: the row's tokens with the node's path written after them (what follows is never read)
    expanded = sequences.repeat_interleave(nodes, dim=0).view(batch_size, nodes, -1)
    columns = lengths[:, None, None] + torch.arange(paths.shape[-1], device=lengths.device)
    expanded.scatter_(2, columns.expand_as(paths), paths)
    scores = processor(expanded.flatten(0, 1), (lengths[:, None] + depths).flatten(),
                       logits.reshape(batch_size * nodes, 1, vocab), rows.repeat_interleave(nodes))
    return scores.view(batch_size, nodes, vocab)
