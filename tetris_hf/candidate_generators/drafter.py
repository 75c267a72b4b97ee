"""What the loop needs of a drafter, whatever drafts: a draft model, a reduced-vocabulary draft, an EAGLE head, prompt
lookup, suffix drafts.

The loop talks to a drafter through :class:`Drafter`'s six methods alone: it starts it on the prompts
(:meth:`~Drafter.prefill`), asks for a :class:`~tetris_hf.step.Proposal` (a chain per row) or a
:class:`~tetris_hf.trees.GrownTree` (:meth:`~Drafter.propose`), hands back the target's
:class:`~tetris_hf.step.Verdict` (:meth:`~Drafter.accept`), ends each step with what it read for the drafter and the
rows that left (:meth:`~Drafter.settle`), lets rows join (:meth:`~Drafter.join`), and may have it read what it skipped
outside a step's timing (:meth:`~Drafter.catch_up`). Every drafter is also a transformers ``CandidateGenerator``
(:class:`~.transformers_api.CandidateGeneratorAPI`).

What the drafter needs of the target comes in the verdict (an EAGLE head's features: :attr:`Drafter.feature_layers`
says which hidden states the verify forward returns); what the loop needs on the host comes back as device tensors the
loop reads with its own reads (a proposal's ``cached_lengths``; what :meth:`~Drafter.accept` returns).
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
    in a step: what a drafter needs on the host it keeps as bounds or gets from the loop's reads (the proposal's
    ``cached_lengths``, what :meth:`accept` returns, the verdict's hints); :meth:`prefill`, before the first step,
    may (a packing draft counts its prompt's real tokens).

    ``feature_layers``: the target's hidden states (``output_hidden_states`` indices) the drafter reads, which every
    target forward then returns and the verdicts and prompt chunks carry (an EAGLE head's); ``None``: none.
    ``pack``: its model reads blocks with filler packed (:mod:`tetris_hf.packing`; decided at construction).
    """

    feature_layers: tuple[int, ...] | None = None
    pack: bool = False

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_real: bool = False) -> None:
        """Start on ``(B, T)`` left-padded prompts (``all_real``: no padding, known on the host)."""
        raise NotImplementedError

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, num_tokens: int, rows: torch.Tensor | None = None,
                confidences: bool = True, *, lookup_only: bool = False, tree_width: int = 1):
        """Draft ``num_tokens`` cells after each row of ``sequences`` ``(B, T)`` (valid up to ``lengths`` ``(B,)``),
        writing them into ``sequences[i, lengths[i]:]``; ``rows`` ``(B,)`` original batch indices. A
        :class:`~tetris_hf.step.Proposal`.

        ``lookup_only``: a hybrid drafter's model-free part alone drafts (its model runs no forward).
        ``tree_width > 1``: a :class:`~tetris_hf.trees.GrownTree` of ``num_tokens`` levels instead (``tree_width``
        children per expanded node), nothing written into ``sequences`` (drafters that grow trees: a draft model, an
        EAGLE head, suffix drafts alone)."""
        raise NotImplementedError

    def accept(self, verdict: Verdict) -> torch.Tensor | None:
        """What the target did with the last proposal (or with the prompt, at the first call): roll back to the
        accepted drafts and take the target's token after them. Returns a 0-d device tensor the loop reads at the
        step's end and hands to :meth:`settle` (``None``: nothing to read)."""
        raise NotImplementedError

    def settle(self, read: int | None, finished: Retired | None = None, moves: RowMoves | None = None) -> None:
        """The step's end: ``read`` what :meth:`accept` returned, read (``None``: not read this step); then the rows
        that ``finished`` (their tokens, device tensors, nothing may be read) leave, the others moving as ``moves``
        says (row ``sources[i]`` takes the place of row ``targets[i]``, ``num_rows`` remain)."""
        raise NotImplementedError

    def join(self, rows: JoiningRows | None = None, chunk: PromptChunk | None = None) -> torch.Tensor | None:
        """Rows join after the active ones (a request stream's new requests, ``rows``), and a chunk of joining rows'
        prompts the target just read (``chunk``); either or both. Returns what :meth:`accept` would return now: rows
        that join within a step (their prompts read in its forward) join after its verdict, and the loop reads this
        at the step's end instead."""
        raise NotImplementedError(f"{type(self).__name__} cannot take rows mid-stream")

    def catch_up(self) -> None:
        """Do now any one-off work the next :meth:`propose` would do first (kept out of its timing)."""
