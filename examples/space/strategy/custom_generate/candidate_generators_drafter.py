# Exported from tetris_hf/candidate_generators/drafter.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""What the loop needs of a drafter, whatever drafts: a draft model, a reduced-vocabulary draft, prompt lookup.

The loop talks to a drafter through :class:`Drafter` alone and reads what it proposed from a :class:`Proposal`; with
draft trees (``tetris_tree_width > 1``) through :class:`TreeDrafter`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class Proposal(NamedTuple):
    """What a drafter proposed for every active row (``B`` rows, ``K`` cells).

    ``tokens``: ``(B, K)`` drafted tokens; they are also written into the loop's ``sequences`` past each row's end.
    ``log_probs``: ``(B, K)`` confidences TETRIS ranks cells by (``None`` when not asked for): the log of how likely
    the drafter thinks the cell is right, a number that must not depend on a random draw at that cell.
    ``probs``: ``(B, K, V)`` the distributions sampled drafts were drawn from (``None``: the drafts are deterministic,
    ``q`` is one-hot at the drafted token, or the loop is greedy).
    ``lengths``: ``(B,)`` cells each row really drafted (``None``: all ``K``); cells past it are filler.
    """

    tokens: torch.Tensor
    log_probs: torch.Tensor | None
    probs: torch.Tensor | None
    lengths: torch.Tensor | None = None


class Drafter(Protocol):
    """The loop's side of a drafter. Rows are the loop's active rows, in its order (finished rows leave through
    :meth:`fill_rows`). Nothing here may read the device: what a drafter needs on the host it keeps as bounds or
    gets from the loop's own reads (:meth:`live_lengths`, :meth:`pending_width`)."""

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, all_real: bool = False) -> None:
        """Start on ``(B, T)`` left-padded prompts (``all_real``: no padding, known on the host)."""

    def catch_up(self) -> None:
        """Do now any one-off work the next :meth:`propose` would do first (kept out of its timing)."""

    def propose(self, sequences: torch.Tensor, lengths: torch.Tensor, num_tokens: int, rows: torch.Tensor,
                confidences: bool) -> Proposal:
        """Draft ``num_tokens`` cells after each row of ``sequences`` ``(B, T)`` (valid up to ``lengths`` ``(B,)``),
        writing them into ``sequences[i, lengths[i]:]``; ``rows`` ``(B,)`` original batch indices."""

    def feature_tap(self, target: torch.nn.Module):
        """Hooks on ``target`` that keep what the drafter reads of the target's forwards (an EAGLE head: hidden
        states), with a ``features`` attribute and ``remove()``; ``None`` when it reads nothing of them."""

    def accept(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor, verify_lengths: torch.Tensor,
               max_accepted: int | None = None, cached_longest: int | None = None,
               features: torch.Tensor | None = None) -> None:
        """What the target did with the last proposal (or with the prompt, at the first call): ``(B,)`` accepted
        drafts, the target's token after them, and the cells it verified. ``max_accepted``: a host bound on
        ``num_accepted``; ``cached_longest``: the maximum of :meth:`live_lengths` as the loop read it this step;
        ``features``: ``(B, W, F)`` what :meth:`feature_tap` kept of the target's forward that verified them (``W``
        its block's width; the prompt's at the first call), when the drafter has a tap."""

    def fill_rows(self, targets: torch.Tensor, sources: torch.Tensor, num_rows: int) -> None:
        """Row ``sources[i]`` takes the place of row ``targets[i]``; the first ``num_rows`` rows remain."""

    def live_lengths(self) -> torch.Tensor | None:
        """``(B,)`` tokens the drafter holds per row (a KV cache's fill), read with the loop's step read; ``None``
        when it keeps nothing per row."""

    def pending_width(self) -> torch.Tensor | None:
        """A 0-d tensor the loop reads with its end-of-step read and hands to :meth:`trim_pending`; ``None`` when the
        drafter needs nothing read."""

    def trim_pending(self, width: int) -> None:
        """What :meth:`pending_width` was, read."""


class TreeDrafter(Drafter, Protocol):
    """A drafter that also grows draft trees (``tetris_tree_width > 1``, :mod:`tetris_hf.tree_step`): a draft model
    or an EAGLE head."""

    def propose_tree(self, sequences: torch.Tensor, lengths: torch.Tensor, depth: int, width: int,
                     rows: torch.Tensor):
        """Grow a :class:`~tetris_hf.trees.GrownTree` of ``depth`` levels after each row (``width`` children per
        expanded node), writing nothing into ``sequences``."""

    def accept_tree(self, path_nodes: torch.Tensor, path_slots: torch.Tensor, num_accepted: torch.Tensor,
                    next_tokens: torch.Tensor, max_accepted: int, cached_longest: int | None = None,
                    features: torch.Tensor | None = None) -> None:
        """What the target did with the last tree: ``(B, D)`` the accepted path's nodes and their slots in the
        target's block (-1 after it), ``(B,)`` its length and the target's token after it; the rest as in
        :meth:`Drafter.accept`."""
