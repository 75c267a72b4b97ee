"""Which drafted tokens the target verifies this step: every function returns ``verify_lengths`` ``(B,)``, row ``i``
verifying its first ``verify_lengths[i]`` drafts (0: one plain target token). Design: docs/design.md, "Selection".
"""

from __future__ import annotations

import torch


def cumulative_log_probs(draft_token_log_probs: torch.Tensor) -> torch.Tensor:
    """TETRIS cell scores: the log of the draft probability that tokens ``1..j`` of a row are all what it drafted.

    Args:
        draft_token_log_probs: ``(B, K)``, row ``i``'s draft log-probability at position ``j``: the drafted token's
            ``log q`` when greedy; when sampling, the confidence ``log max q`` (never the drawn token's, or sampling
            stops being lossless).

    Returns:
        ``(B, K)`` scores, non-increasing along each row.
    """
    return draft_token_log_probs.cumsum(dim=-1)


def select_tetris(scores: torch.Tensor, max_lengths: torch.Tensor, budget: int) -> torch.Tensor:
    """Verify the ``budget`` highest-scoring cells over the whole batch (TETRIS, arXiv 2502.15197); ties go to the
    lower row, then the earlier position, so every row's chosen cells form a prefix.

    Args:
        scores: ``(B, K)`` cell scores, non-increasing along each row (see :func:`cumulative_log_probs`).
        max_lengths: ``(B,)`` how many of a row's cells may be verified at most (the row may be finished, or close
            to its length limit).
        budget: total cells to verify across the batch, ``>= 0``.

    Returns:
        ``(B,)`` long tensor of verified lengths; ``verify_lengths.sum() == min(budget, candidate cells)``.
    """
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    batch_size, num_cells = scores.shape
    take = min(budget, batch_size * num_cells)  # how many cells are candidates is not read from the device
    if take == 0:
        return torch.zeros(batch_size, dtype=torch.long, device=scores.device)
    if batch_size == 1:  # one row's top cells are its first ones (ties go to the earlier position): no sort
        return max_lengths.clamp(min=0, max=take)
    positions = torch.arange(num_cells, device=scores.device)
    candidate = positions[None, :] < max_lengths[:, None]
    # A candidate ranks by its score (a -inf score still above every non-candidate); non-candidates last, and a
    # non-candidate among the top ``take`` (fewer candidates than the budget) is not chosen.
    ranked = scores.float().clamp(min=torch.finfo(torch.float).min).masked_fill(~candidate, float("-inf"))
    order = torch.sort(ranked.flatten(), descending=True, stable=True).indices[:take]
    chosen = torch.zeros(batch_size * num_cells, dtype=torch.long, device=scores.device)
    chosen[order] = candidate.flatten()[order].long()
    return chosen.view(batch_size, num_cells).sum(dim=-1)


def select_fixed(max_lengths: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Standard batched speculative decoding: every row verifies its first ``num_tokens`` drafts (fewer near its end).

    Args:
        max_lengths: ``(B,)`` how many cells each row may verify at most.
        num_tokens: the fixed window ``k``.

    Returns:
        ``(B,)`` verified lengths, ``min(k, max_lengths)``.
    """
    return max_lengths.clamp(max=num_tokens)


def select_fixed_budget(lengths: torch.Tensor, budget: int, longest: int) -> torch.Tensor:
    """Trim ``lengths`` ``(B,)`` (each at most ``longest``) so they sum to at most ``budget``, longest rows first (of
    equal rows, the earlier row first), without reading the device: every row is cut to the largest level ``t`` that
    fits, and the last rows longer than ``t`` keep ``t + 1`` while the budget lasts. E.g. ``[3, 3, 3]``, budget 7 ->
    ``[2, 2, 3]``.

    Returns:
        ``(B,)`` trimmed lengths.
    """
    levels = torch.arange(longest + 1, device=lengths.device)
    cut = torch.minimum(lengths[:, None], levels[None, :]).sum(dim=0)  # (levels,) total at each level
    level = (cut <= budget).sum() - 1  # cut is non-decreasing and 0 at level 0
    trimmed = torch.minimum(lengths, level)
    left = budget - trimmed.sum()
    longer = lengths > level
    from_end = longer.flip(0).cumsum(dim=0).flip(0)  # longer rows at or after each row
    return torch.where(longer & (from_end <= left), level + 1, trimmed)
