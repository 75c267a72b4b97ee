"""``generate()``'s stopping criteria on rows that each emitted a different number of tokens this step
(:class:`RowStopper`): a row stops at the first new token after which any criterion holds, the tokens after it dropped.
The length limit and end tokens are checked for the whole batch in a few tensor operations; any other criterion is
called as ``generate()`` would call it, row by row and token by token.
"""

from __future__ import annotations

import torch
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList


class RowStopper:
    """Where each row stops among its new tokens, for one ``generate()`` call (what the criteria check is worked out
    once, at the start).

    Args:
        stopping_criteria: as ``generate()`` prepared them.
        device: where the rows' tensors live.
        max_length: a length limit of the caller's own, applied as a :class:`MaxLengthCriteria` would be (the
            tighter of it and the criteria's).
    """

    def __init__(self, stopping_criteria: StoppingCriteriaList, device: torch.device, max_length: int | None = None):
        limits = [criterion.max_length for criterion in stopping_criteria if type(criterion) is MaxLengthCriteria]
        limits += [max_length] if max_length is not None else []
        self.max_length: int | None = min(limits) if limits else None
        eos_ids = [criterion.eos_token_id.flatten() for criterion in stopping_criteria
                   if type(criterion) is EosTokenCriteria]
        self.eos_ids = torch.cat(eos_ids).to(device) if eos_ids else None  # (E,)
        self.others = StoppingCriteriaList(
            [criterion for criterion in stopping_criteria if type(criterion) not in (MaxLengthCriteria, EosTokenCriteria)])
        self.only_length = self.eos_ids is None and not self.others  # then rows stop where the host knows they do
        self.device = device
        self._offsets: dict[int, torch.Tensor] = {}  # max_new -> arange(max_new)

    def __call__(self, sequences: torch.Tensor, lengths: torch.Tensor, new_counts: torch.Tensor, max_new: int,
                 longest: int | None = None, row_limits: torch.Tensor | None = None,
                 row_eos: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each row stops among its new tokens.

        Args:
            sequences: ``(B, T)``; row ``i``'s new tokens are ``sequences[i, lengths[i]:lengths[i] + new_counts[i]]``,
                and ``T >= lengths.max() + max_new``.
            lengths: ``(B,)`` each row's length before this step's tokens.
            new_counts: ``(B,)`` tokens each row emitted this step, ``1 <= new_counts[i] <= max_new``.
            max_new: an upper bound on ``new_counts`` known without a device sync.
            longest: an upper bound on ``lengths`` known without a device sync, if any: the length limit is not
                checked on the device when no row can reach it.
            row_limits: ``(B,)`` each row's own length limit (a request stream's rows), checked with the common one.
            row_eos: ``(B, E)`` each row's own end tokens, ``-1`` where a row has fewer (a request stream's rows).

        Returns:
            ``kept`` ``(B,)`` new tokens kept (up to and including the one that stopped the row) and ``stopped``
            ``(B,)`` bool.
        """
        if max_new not in self._offsets:
            self._offsets[max_new] = torch.arange(max_new, device=self.device)
        offsets = self._offsets[max_new]  # (W,) 0-based position among the new tokens
        indices = lengths[:, None] + offsets  # (B, W) where that token sits (its row's length once it is added, - 1)
        stops = None
        if self.max_length is not None and (longest is None or longest + max_new >= self.max_length):
            stops = indices >= self.max_length - 1
        if row_limits is not None:
            hits = indices >= (row_limits - 1)[:, None]
            stops = hits if stops is None else stops | hits
        if self.eos_ids is not None or row_eos is not None:
            tokens = sequences.gather(1, indices)
        if self.eos_ids is not None:
            hits = tokens == self.eos_ids if self.eos_ids.numel() == 1 else torch.isin(tokens, self.eos_ids)
            stops = hits if stops is None else stops | hits
        if row_eos is not None:
            hits = (tokens[:, :, None] == row_eos[:, None, :]).any(dim=-1)
            stops = hits if stops is None else stops | hits
        if stops is None:
            kept, stopped = new_counts, torch.zeros(new_counts.shape, dtype=torch.bool, device=new_counts.device)
        elif max_new == 1:  # one new token per row: kept whether or not it stops the row
            kept, stopped = new_counts, stops[:, 0]
        else:
            stops &= offsets < new_counts[:, None]
            stopped = stops.any(dim=1)
            kept = torch.where(stopped, stops.long().argmax(dim=1) + 1, new_counts)
        if not self.others:
            return kept, stopped
        return _apply_one_by_one(self.others, sequences, lengths, kept, stopped)


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
