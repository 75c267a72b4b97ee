# Exported from tetris_hf/stopping.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""``generate()``'s stopping criteria, applied to rows that each emitted a different number of tokens this step.

A row stops at the first of its new tokens after which any criterion holds; the tokens after that one are dropped.
The two criteria ``generate()`` always builds, :class:`MaxLengthCriteria` and :class:`EosTokenCriteria`, are checked
for the whole batch and every new token in a few tensor operations (no per-row Python, no device sync per row). Any
other criterion (stop strings, max time, a user's own) is called as ``generate()`` would call it: on each row's
sequence after each new token, one at a time, up to where the fast check already stopped the row.
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList


def rows_that_stop(
    stopping_criteria: StoppingCriteriaList,
    sequences: torch.Tensor,
    lengths: torch.Tensor,
    new_counts: torch.Tensor,
    max_new: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each row stops among its new tokens.

    Args:
        stopping_criteria: as ``generate()`` prepared them.
        sequences: ``(B, T)``; row ``i``'s new tokens are ``sequences[i, lengths[i]:lengths[i] + new_counts[i]]``.
        lengths: ``(B,)`` each row's length before this step's tokens.
        new_counts: ``(B,)`` tokens each row emitted this step, ``1 <= new_counts[i] <= max_new``.
        max_new: an upper bound on ``new_counts`` known without a device sync.

    Returns:
        ``kept`` ``(B,)`` new tokens kept (up to and including the one that stopped the row) and ``stopped``
        ``(B,)`` bool.
    """
    offsets = torch.arange(max_new, device=lengths.device)  # (W,) 0-based position among the new tokens
    indices = lengths[:, None] + offsets  # (B, W) where that token sits (a row's length once it is added, minus 1)
    stops = None
    others = []
    for criterion in stopping_criteria:
        if type(criterion) is MaxLengthCriteria:
            hits = indices >= criterion.max_length - 1
        elif type(criterion) is EosTokenCriteria:
            tokens = sequences.gather(1, indices.clamp(max=sequences.shape[1] - 1))
            hits = torch.isin(tokens, criterion.eos_token_id.to(tokens.device))
        else:
            others.append(criterion)
            continue
        stops = hits if stops is None else stops | hits
    if stops is None:
        kept, stopped = new_counts, torch.zeros(new_counts.shape, dtype=torch.bool, device=new_counts.device)
    elif max_new == 1:  # one new token per row: kept whether or not it stops the row
        kept, stopped = new_counts, stops[:, 0]
    else:
        stops &= offsets < new_counts[:, None]
        stopped = stops.any(dim=1)
        kept = torch.where(stopped, stops.long().argmax(dim=1) + 1, new_counts)
    if not others:
        return kept, stopped
    return _apply_one_by_one(StoppingCriteriaList(others), sequences, lengths, kept, stopped)


def _apply_one_by_one(
    criteria: StoppingCriteriaList, sequences: torch.Tensor, lengths: torch.Tensor, kept: torch.Tensor,
    stopped: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Call ``criteria`` on each row after each of its first ``kept`` new tokens; stop a row at the first hit."""
    kept, stopped = kept.clone(), stopped.clone()
    for row, (length, count) in enumerate(zip(lengths.tolist(), kept.tolist())):
        for offset in range(1, count + 1):
            if bool(criteria(sequences[row : row + 1, : length + offset], None).any()):
                kept[row], stopped[row] = offset, True
                break
    return kept, stopped
