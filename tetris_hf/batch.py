"""The rows a loop decodes (:class:`Batch`): their tokens, lengths and limits, and what is done to them between and
within steps: emit (the target's token after each row's accepted drafts), retire (finished rows leave, later rows take
their places) and add (a request stream's rows join). Design: docs/design.md, "The step".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .kv import rows_after_fill
from .step import Emission
from .stopping import RowStopper


class Retired(NamedTuple):
    """Rows that left the batch, as they were just before they left: ``rows`` ``(M,)`` their original indices (a
    stream's lanes), ``sequences`` ``(M, capacity)`` and ``lengths`` ``(M,)`` their tokens."""

    rows: torch.Tensor
    sequences: torch.Tensor
    lengths: torch.Tensor


class RowMoves(NamedTuple):
    """How the rows that remain after a retire are laid out: row ``sources[i]`` took the place of row ``targets[i]``
    (both ``(P,)``), and ``num_rows`` rows remain; every cache of the batch's rows applies the same moves
    (``fill_rows(targets, sources, num_rows)``)."""

    targets: torch.Tensor
    sources: torch.Tensor
    num_rows: int


class Batch:
    """The active rows: ``sequences`` ``(B, capacity)`` (each row's tokens from column 0 or after its left padding,
    then scratch where drafts are written), ``lengths`` ``(B,)`` tokens each row holds, ``rows`` ``(B,)`` their
    original indices, ``last_tokens`` ``(B,)`` each row's last token (a step's block starts with it); a stream's rows
    also have ``row_limits`` ``(B,)`` (their own length limits) and ``row_eos`` ``(B, E)`` (their own end tokens, -1
    padded); ``None`` otherwise.

    ``num_rows`` and the bounds ``shortest`` and ``longest`` on the rows' lengths are host ints the batch keeps without
    reading the device: every active row grows by at least one and at most ``max_accepted + 1`` tokens a step.
    """

    def __init__(self, sequences: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, last_tokens: torch.Tensor,
                 max_length: int, shortest: int, longest: int, row_limits: torch.Tensor | None = None,
                 row_eos: torch.Tensor | None = None):
        self.sequences, self.lengths, self.rows, self.last_tokens = sequences, lengths, rows, last_tokens
        self.row_limits, self.row_eos = row_limits, row_eos
        self.max_length = max_length
        self.num_rows = sequences.shape[0]
        self.shortest, self.longest = shortest, longest

    @classmethod
    def of_prompts(cls, input_ids: torch.Tensor, capacity: int, pad_value: int, max_length: int) -> Batch:
        """``(B, T)`` left-padded prompts, each row holding ``T`` tokens (its padding included) in a buffer of
        ``capacity`` columns."""
        batch_size, prompt_length = input_ids.shape
        sequences = input_ids.new_full((batch_size, capacity), pad_value)
        sequences[:, :prompt_length] = input_ids
        lengths = torch.full((batch_size,), prompt_length, dtype=torch.long, device=input_ids.device)
        return cls(sequences, lengths, torch.arange(batch_size, device=input_ids.device), input_ids[:, -1],
                   max_length, prompt_length, prompt_length)

    @classmethod
    def empty(cls, capacity: int, pad_value: int, max_length: int, device: torch.device) -> Batch:
        """No rows yet; rows with their own limits and end tokens join with :meth:`add` (a request stream's)."""
        none = torch.zeros(0, dtype=torch.long, device=device)
        return cls(none.new_full((0, capacity), pad_value), none, none, none, max_length, max_length, 0,
                   row_limits=none, row_eos=none.new_full((0, 1), -1))

    def room(self, depth: int) -> torch.Tensor | None:
        """``(B,)`` drafts each row may still verify, at most ``depth``: a target token always follows them, so a row
        near its length limit verifies fewer. ``None`` when no row is near it (every row may take ``depth``), known on
        the host."""
        if self.row_limits is not None:  # a stream's rows each have their own limit
            return (self.row_limits - 1 - self.lengths).clamp(min=0, max=depth)
        if self.longest + depth < self.max_length:
            return None
        return (self.max_length - 1 - self.lengths).clamp(min=0, max=depth)

    def emit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor, max_accepted: int,
             stopper: RowStopper) -> Emission:
        """Write each row's target token ``next_tokens`` ``(B,)`` after its ``num_accepted`` ``(B,)`` accepted drafts
        (those already sit in place past the row's end), apply the stopping criteria, advance ``lengths``.
        ``max_accepted + 1`` bounds the tokens any row emits (a host int from the step's read)."""
        max_new = max_accepted + 1
        lengths = self.lengths
        self.sequences.scatter_(1, (lengths + num_accepted)[:, None], next_tokens[:, None])
        self.last_tokens = next_tokens  # a row that stops here leaves the batch: its last token is not needed
        kept, stopped = stopper(self.sequences, lengths, num_accepted + 1, max_new, longest=self.longest,
                                row_limits=self.row_limits, row_eos=self.row_eos)
        self.lengths = lengths + kept
        self.shortest = min(self.shortest + 1, self.max_length)
        self.longest = min(self.longest + max_new, self.max_length)
        return Emission(kept, stopped)

    def retire(self, stopped: torch.Tensor, num_stopped: int) -> tuple[Retired, RowMoves]:
        """Move the ``num_stopped`` rows that ``stopped`` ``(B,)`` out of the batch, without reading which rows they
        are: active rows from the end of the batch take the places of finished rows before it, and the batch ends
        after ``B - num_stopped`` rows. Returns the rows that left and the moves, which every cache of the rows
        applies too.

        E.g. rows ``[a b c d e]`` with ``b`` and ``e`` stopped: 3 remain; ``b`` is the finished row among the first
        3 and ``d`` the active row after them, so ``d`` moves to 1: ``[a d c]``.
        """
        gone = torch.argsort(stopped.long(), descending=True, stable=True)[:num_stopped]
        retired = Retired(self.rows[gone], self.sequences[gone], self.lengths[gone])
        num_rows = self.num_rows - num_stopped
        # There are as many finished rows among the first num_rows as active rows after them; they pair up in
        # order. That count is not read: min(num_stopped, num_rows) pairs are formed, and those past it move nothing.
        moves = min(num_stopped, num_rows)
        targets = torch.argsort(stopped[:num_rows].long(), descending=True, stable=True)[:moves]  # finished first
        sources = num_rows + torch.argsort(stopped[num_rows:].long(), stable=True)[:moves]  # active first
        sources = torch.where(stopped[targets], sources, targets)
        self.select(rows_after_fill(targets, sources, num_rows))
        return retired, RowMoves(targets, sources, num_rows)

    def select(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` ``(B',)``, in that order."""
        self.rows, self.sequences, self.lengths = self.rows[index], self.sequences[index], self.lengths[index]
        self.last_tokens = self.last_tokens[index]
        if self.row_limits is not None:
            self.row_limits = self.row_limits[index]
        if self.row_eos is not None:
            self.row_eos = self.row_eos[index]
        self.num_rows = index.shape[0]

    def add(self, rows: torch.Tensor, sequences: torch.Tensor, lengths: list[int], last_tokens: torch.Tensor,
            limits: list[int], eos_token_ids: list[tuple[int, ...]]) -> None:
        """Rows after the active ones (a stream's): original indices ``rows`` ``(M,)``, tokens ``sequences``
        ``(M, capacity)`` holding ``lengths[i]`` each, the last of them ``last_tokens`` ``(M,)``; each stops at length
        ``limits[i]`` or at one of ``eos_token_ids[i]``."""
        device = self.lengths.device
        self.sequences = torch.cat([self.sequences, sequences])
        self.lengths = torch.cat([self.lengths, torch.tensor(lengths, device=device)])
        self.rows = torch.cat([self.rows, rows])
        self.last_tokens = torch.cat([self.last_tokens, last_tokens])
        self.row_limits = torch.cat([self.row_limits, torch.tensor(limits, device=device)])
        self.row_eos = _append_eos(self.row_eos, eos_token_ids)
        self.num_rows += len(lengths)
        self.shortest, self.longest = min(self.shortest, *lengths), max(self.longest, *lengths)

    def tokens_of(self, wanted: torch.Tensor) -> dict[int, list[int]]:
        """Each row ``wanted`` ``(B,)`` bool marks: its tokens so far, by original index (one read)."""
        rows, lengths = torch.stack([self.rows[wanted], self.lengths[wanted]]).tolist()
        tokens = self.sequences[wanted, : max(lengths, default=0)].tolist()
        return {row: row_tokens[:length] for row, row_tokens, length in zip(rows, tokens, lengths)}


def _append_eos(row_eos: torch.Tensor, eos_token_ids: list[tuple[int, ...]]) -> torch.Tensor:
    """``(B, E)`` end tokens per row (``-1`` padded) with rows for ``eos_token_ids`` added (widened if needed)."""
    width = max(row_eos.shape[1], *(len(ids) for ids in eos_token_ids), 1)
    new = torch.full((len(eos_token_ids), width), -1, dtype=torch.long)
    for index, ids in enumerate(eos_token_ids):
        new[index, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    row_eos = torch.nn.functional.pad(row_eos, (0, width - row_eos.shape[1]), value=-1)
    return torch.cat([row_eos, new.to(row_eos.device)])
