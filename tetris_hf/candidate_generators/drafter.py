"""What the loop needs of a drafter, whatever drafts: a draft model, a reduced-vocabulary draft, an EAGLE head, prompt
lookup.

The loop talks to a drafter through :class:`Drafter` alone: it asks for a
:class:`~tetris_hf.step.Proposal` (a chain per row) or, with draft trees (``tetris_tree_width > 1``), a
:class:`~tetris_hf.trees.GrownTree` (:class:`TreeDrafter`), and hands back the target's
:class:`~tetris_hf.step.Verdict`. Every drafter is also a transformers ``CandidateGenerator``
(:class:`~.transformers_api.CandidateGeneratorAPI`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..step import Proposal, Verdict
from .transformers_api import CandidateGeneratorAPI

__all__ = ["Drafter", "Proposal", "TreeDrafter", "Verdict"]


class Drafter(CandidateGeneratorAPI):
    """The loop's side of a drafter. Rows are the loop's active rows, in its order (finished rows leave through
    :meth:`fill_rows`). Nothing here may read the device in a step: what a drafter needs on the host it keeps as
    bounds or gets from the loop's own reads (:meth:`live_lengths`, :meth:`pending_width`, the verdict's hints);
    :meth:`prefill`, before the first step, may (a packing draft counts its prompt's real tokens).

    A drafter implements :meth:`prefill`, :meth:`propose`, :meth:`accept` and :meth:`fill_rows`; the rest do nothing
    here, for drafters that keep no cache and read nothing of the target.
    """

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_real: bool = False) -> None:
        """Start on ``(B, T)`` left-padded prompts (``all_real``: no padding, known on the host)."""
        raise NotImplementedError

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, num_tokens: int, rows: torch.Tensor | None = None,
                confidences: bool = True) -> Proposal:
        """Draft ``num_tokens`` cells after each row of ``sequences`` ``(B, T)`` (valid up to ``lengths`` ``(B,)``),
        writing them into ``sequences[i, lengths[i]:]``; ``rows`` ``(B,)`` original batch indices."""
        raise NotImplementedError

    def accept(self, verdict: Verdict) -> None:
        """What the target did with the last proposal (or with the prompt, at the first call): roll back to the
        accepted drafts and take the target's token after them."""
        raise NotImplementedError

    def fill_rows(self, targets: torch.Tensor, sources: torch.Tensor, num_rows: int) -> None:
        """Row ``sources[i]`` takes the place of row ``targets[i]``; the first ``num_rows`` rows remain."""
        raise NotImplementedError

    def add_rows(self, last_tokens: torch.Tensor, prompt_lengths: list[int]) -> None:
        """Rows join after the active ones (a request stream's new requests): ``last_tokens`` ``(M,)`` their prompts'
        last tokens (which open their first proposal), ``prompt_lengths`` their prompts' lengths. Their prompts but
        that last token follow through :meth:`read_prompts`."""
        raise NotImplementedError(f"{type(self).__name__} cannot take rows mid-stream")

    def read_prompts(self, tokens: torch.Tensor, real_lengths: torch.Tensor, num_real: int, longest: int,
                     next_tokens: torch.Tensor, first_row: int = 0) -> None:
        """A chunk of joining rows' prompts, just read by the target: ``tokens`` ``(B, L)``, row ``i``'s first
        ``real_lengths[i]`` real (0 for rows not joining), ``num_real`` their sum; ``longest`` bounds any row's
        tokens; ``next_tokens`` ``(B, L)`` each real token's successor in its prompt (what an EAGLE head pairs with
        the target's feature there). Nothing to do for a drafter that keeps no cache."""

    def remember(self, rows: torch.Tensor, sequences: torch.Tensor, lengths: torch.Tensor) -> None:
        """Rows that finished and left the batch: original indices ``rows`` ``(M,)``, tokens ``sequences`` ``(M, T)``
        holding ``lengths`` ``(M,)`` each (device tensors; nothing may be read). Nothing to do for a drafter that
        learns nothing from finished requests (a suffix cache keeps them)."""

    def catch_up(self) -> None:
        """Do now any one-off work the next :meth:`propose` would do first (kept out of its timing)."""

    def compile(self) -> None:
        """Run the drafter's fixed-shape step forwards through ``torch.compile`` (``tetris_compile``); after
        :meth:`prefill`. Refuses a model that cannot be compiled."""

    def attach(self, target: torch.nn.Module) -> None:
        """Start keeping what the drafter reads of ``target``'s forwards (an EAGLE head: hidden states, through
        hooks); :meth:`detach` removes the hooks."""

    def detach(self) -> None:
        """Remove what :meth:`attach` put on the target."""

    def live_lengths(self) -> torch.Tensor | None:
        """``(B,)`` tokens the drafter holds per row (a KV cache's fill), read with the loop's step read; ``None``
        when it keeps nothing per row."""
        return None

    def pending_width(self) -> torch.Tensor | None:
        """A 0-d tensor the loop reads with its end-of-step read and hands to :meth:`trim_pending`; ``None`` when the
        drafter needs nothing read."""
        return None

    def trim_pending(self, read: int) -> None:
        """What :meth:`pending_width` was, read."""


class TreeDrafter(Protocol):
    """A drafter that also grows draft trees (``tetris_tree_width > 1``, :mod:`tetris_hf.tree_step`): a draft model
    or an EAGLE head. Its :meth:`Drafter.accept` takes verdicts with a ``tree``."""

    def propose_tree(self, sequences: torch.Tensor, lengths: torch.Tensor, depth: int, width: int,
                     rows: torch.Tensor):
        """Grow a :class:`~tetris_hf.trees.GrownTree` of ``depth`` levels after each row (``width`` children per
        expanded node), writing nothing into ``sequences``."""
