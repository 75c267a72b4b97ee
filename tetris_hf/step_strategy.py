"""The contract between the loop and a strategy (:class:`StepStrategy`, :class:`DraftPlan`): each step, a plan before
drafting, a selection of the cells to verify, then what happened (:func:`~tetris_hf.step.run_step`).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from .timing import StepSeconds

__all__ = ["DraftPlan", "StepSeconds", "StepStrategy"]


class DraftPlan(NamedTuple):
    """What a step drafts and may verify.

    ``num_draft_tokens``: ``K`` drafts per row (0: plain decoding). ``budget``: ``C``, cells the target may verify
    across the batch. ``probe``: a step taken to learn (one draft per row, all verified) rather than because drafting
    is expected to pay. ``needs_confidences``: this step's :meth:`StepStrategy.select` or :meth:`StepStrategy.observe`
    reads the draft's confidences (else the loop may skip computing them, a softmax per draft token, and pass
    ``None``). ``lookup_only``: hybrid drafting, prompt lookup alone drafts (the model runs no forward; rows without a
    match draft nothing, see a hybrid drafter's ``propose(..., lookup_only=True)``).
    """

    num_draft_tokens: int
    budget: int
    probe: bool = False
    needs_confidences: bool = True
    lookup_only: bool = False


class StepStrategy(Protocol):
    """What the loop needs of a strategy (``fixed``, ``tetris``, ``adaptive``, ``dsd``)."""

    def plan(self, num_rows: int) -> DraftPlan:
        """The plan for a step of ``num_rows`` active rows (called once per step, before drafting)."""

    def select(self, token_log_probs: torch.Tensor | None, max_lengths: torch.Tensor, plan: DraftPlan) -> torch.Tensor:
        """Verified drafts per row, ``(B,)``, each ``<= max_lengths``; changes nothing the strategy has learnt (it
        may keep host copies of what it read, for :meth:`observe` to learn from).

        Args:
            token_log_probs: ``(B, K)`` the draft's confidence at each drafted cell (``None`` when the plan did not
                need confidences and nothing else asked for them).
            max_lengths: ``(B,)`` cells each row may verify, at most the ``K`` drafted.
            plan: this step's plan.
        """

    def select_tree(self, tree, plan: DraftPlan) -> torch.Tensor:
        """``tetris_tree_width > 1``: the nodes each row verifies, ``(B, N)`` bool, an ancestor-closed subtree of every
        row's valid nodes (:class:`~tetris_hf.trees.DraftTree` ``tree``); changes nothing the strategy has learnt."""

    def observe(self, token_log_probs: torch.Tensor | None, verify_lengths: torch.Tensor, num_accepted: torch.Tensor,
                seconds: StepSeconds | None = None, num_drafted: int | None = None,
                lookup_rows: torch.Tensor | None = None) -> None:
        """What the step did: ``(B, K)`` confidences (``None`` when the plan did not need them), ``(B,)`` verified and
        accepted drafts, the measured time and ``K``; ``(B,)`` the rows prompt lookup drafted (hybrid drafting, else
        ``None``). Where a strategy learns."""
