# Exported from tetris_hf/step_strategy.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""The contract between the loop and a strategy, and the one place that runs it in order.

Each step the loop asks once for a :class:`DraftPlan` (``K`` drafts per row, a budget of ``C`` cells), drafts,
asks which cells to verify (a pure function of the drafts, the plan and what the strategy has learnt), verifies, then
tells the strategy what happened. :func:`run_step` is that sequence; the loop and the simulator's replay both call it,
with their own ways of drafting and verifying.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch


class StepSeconds(NamedTuple):
    """Time of one loop step, as the loop measured it: the ``K`` draft forwards, the target side (selection,
    verification forward, acceptance, roll back), and the rest (planning, emitting, stopping)."""

    draft: float
    verify: float
    other: float


class DraftPlan(NamedTuple):
    """What a step drafts and may verify.

    ``num_draft_tokens``: ``K`` drafts per row (0: plain decoding). ``budget``: ``C``, cells the target may verify
    across the batch. ``probe``: a step taken to learn (one draft per row, all verified) rather than because drafting
    is expected to pay. ``needs_confidences``: this step's :meth:`StepStrategy.select` or :meth:`StepStrategy.observe`
    reads the draft's confidences (else the loop may skip computing them, a softmax per draft token, and pass
    ``None``).
    """

    num_draft_tokens: int
    budget: int
    probe: bool = False
    needs_confidences: bool = True


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
                seconds: StepSeconds | None = None, num_drafted: int | None = None) -> None:
        """What the step did: ``(B, K)`` confidences (``None`` when the plan did not need them), ``(B,)`` verified and
        accepted drafts, the measured time and ``K``. Where a strategy learns."""


class StepOutcome(NamedTuple):
    """What :func:`run_step` did: the plan, ``K`` drafted, and ``(B,)`` verified and accepted drafts per row."""

    plan: DraftPlan
    num_drafted: int
    verify_lengths: torch.Tensor
    num_accepted: torch.Tensor


def run_step(
    strategy: StepStrategy,
    num_rows: int,
    max_draft: int,
    draft: Callable[[int, bool], tuple[torch.Tensor | None, torch.Tensor]],
    verify: Callable[[torch.Tensor], tuple[torch.Tensor, StepSeconds | None]],
) -> StepOutcome:
    """plan -> draft -> select -> verify -> observe, once.

    Args:
        strategy: the step strategy.
        num_rows: ``B`` active rows.
        max_draft: at most this many drafts per row this step (length limits, recorded traces).
        draft: ``draft(K, needs_confidences) -> (token_log_probs (B, K) or None, max_lengths (B,))``: drafts ``K``
            tokens per row (with the draft's confidences when the plan needs them) and says how many of them each row
            may verify (at most ``K``).
        verify: ``verify(verify_lengths (B,)) -> (num_accepted (B,), seconds)``: the target's side.

    Returns:
        :class:`StepOutcome`.
    """
    plan = strategy.plan(num_rows)
    num_drafted = min(plan.num_draft_tokens, max_draft) if plan.budget > 0 else 0
    token_log_probs, max_lengths = draft(num_drafted, plan.needs_confidences)
    if num_drafted > 0:
        verify_lengths = strategy.select(token_log_probs, max_lengths, plan)
    else:
        verify_lengths = torch.zeros(num_rows, dtype=torch.long, device=max_lengths.device)
    num_accepted, seconds = verify(verify_lengths)
    strategy.observe(token_log_probs, verify_lengths, num_accepted, seconds, num_drafted)
    return StepOutcome(plan, num_drafted, verify_lengths, num_accepted)
