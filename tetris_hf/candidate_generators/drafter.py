"""What the loop needs of a drafter, whatever drafts (:class:`Drafter`, six methods). Every drafter is also a
transformers ``CandidateGenerator``. Design: docs/design.md, section "The drafter protocol".
"""

from __future__ import annotations

import torch

from ..batch import Retired, RowMoves
from ..step import JoiningRows, PromptChunk, Proposal, Verdict
from .transformers_api import CandidateGeneratorAPI

__all__ = ["Drafter", "JoiningRows", "PromptChunk", "Proposal", "Retired", "RowMoves", "Verdict", "check_chains"]


def check_chains(drafter: "Drafter", tree_width: int) -> None:
    """Refuse a tree (``tree_width > 1``) from a drafter that drafts chains only."""
    if tree_width > 1:
        raise ValueError(f"{type(drafter).__name__} drafts chains only, not trees (tetris_tree_width > 1 needs a "
                         f"draft model, an EAGLE head or suffix drafts alone)")


class Drafter(CandidateGeneratorAPI):
    """The loop's side of a drafter. Rows are the loop's active rows, in its order. Nothing here may read the device
    in a step (:meth:`prefill`, before the first step, may).

    ``feature_layers``: the target's hidden states (``output_hidden_states`` indices) the drafter reads, which the
    verdicts and prompt chunks then carry (an EAGLE head's); ``None``: none.
    ``pack``: its model reads blocks with filler packed (:mod:`tetris_hf.packing`).
    """

    feature_layers: tuple[int, ...] | None = None
    pack: bool = False

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_real: bool = False) -> None:
        """Start on ``(B, T)`` left-padded prompts (``all_real``: no padding, known on the host)."""
        raise NotImplementedError

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, num_tokens: int, rows: torch.Tensor | None = None,
                confidences: bool = True, *, lookup_only: bool = False, tree_width: int = 1):
        """Draft ``num_tokens`` cells after each row of ``sequences`` ``(B, T)`` (valid up to ``lengths`` ``(B,)``),
        written into ``sequences[i, lengths[i]:]``; ``rows`` ``(B,)`` original batch indices. A
        :class:`~tetris_hf.step.Proposal`; with ``tree_width > 1`` a :class:`~tetris_hf.trees.GrownTree` of
        ``num_tokens`` levels, nothing written. ``lookup_only``: a hybrid's model-free part alone drafts."""
        raise NotImplementedError

    def accept(self, verdict: Verdict) -> torch.Tensor | None:
        """What the target did with the last proposal (or the prompt, at the first call). Returns a 0-d device tensor
        the loop reads at the step's end and hands to :meth:`settle` (``None``: nothing to read)."""
        raise NotImplementedError

    def settle(self, read: int | None, finished: Retired | None = None, moves: RowMoves | None = None) -> None:
        """The step's end: ``read`` what :meth:`accept` returned, read (``None``: not read); the rows that
        ``finished`` (device tensors) leave, the others moving as ``moves`` says."""
        raise NotImplementedError

    def join(self, rows: JoiningRows | None = None, chunk: PromptChunk | None = None) -> torch.Tensor | None:
        """Rows join after the active ones (``rows``), and/or a chunk of joining rows' prompts the target just read
        (``chunk``). Returns what :meth:`accept` would return now (the loop reads it at the step's end)."""
        raise NotImplementedError(f"{type(self).__name__} cannot take rows mid-stream")

    def catch_up(self) -> None:
        """Do now any one-off work the next :meth:`propose` would do first (kept out of its timing)."""
