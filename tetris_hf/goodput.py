"""Goodput: the draft length ``K`` and verify budget ``C`` that maximise expected emitted tokens per second, for the
``adaptive`` and ``dsd`` strategies: :func:`best_budget`, :func:`best_tree_budget`, :func:`plan_step`,
:func:`dsd_window`. Design: docs/design.md, "The cost model and the budget".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .cost_model import StepCostModel


class BudgetChoice(NamedTuple):
    """What :func:`best_budget` picked for each batch: ``budget`` ``(N,)`` cells to verify, ``tokens`` ``(N,)``
    expected emitted tokens, ``seconds`` ``(N,)`` predicted step time."""

    budget: torch.Tensor
    tokens: torch.Tensor
    seconds: torch.Tensor


def best_budget(survival: torch.Tensor, max_lengths: torch.Tensor, fixed_seconds: float,
                verify_seconds: torch.Tensor, max_budget: int | None = None, packed: bool = False) -> BudgetChoice:
    """The TETRIS budget ``C`` that maximises expected emitted tokens per second, for one or more batches: the first
    ``c`` cells in :func:`~tetris_hf.selection.select_tetris`' order emit ``B`` plus their survivals.

    Args:
        survival: ``(B, K)`` or ``(N, B, K)``: probability that cells ``1..j`` of a row are all accepted
            (non-increasing along rows).
        max_lengths: ``(B,)`` or ``(N, B)``: cells of a row that may be verified.
        fixed_seconds: seconds of the step whatever ``C`` is (drafting, overhead).
        verify_seconds: padded, ``(K + 1,)``: entry ``l`` is a verification forward whose longest row checks ``l``
            drafts; ``packed``, ``(B K + 1,)``: entry ``c`` one that checks ``c`` cells in all
            (:meth:`~tetris_hf.cost_model.StepCostModel.verify_prices`).
        max_budget: cap on ``C`` (``None``: every candidate cell).
        packed: how ``verify_seconds`` is indexed.

    Returns:
        :class:`BudgetChoice` with ``(N,)`` tensors (``N = 1`` for a single batch); ties go to the smaller ``C``.
    """
    if survival.dim() == 2:
        survival, max_lengths = survival[None], max_lengths[None]
    num_batches, num_rows, num_cells = survival.shape
    positions = torch.arange(num_cells, device=survival.device)
    candidate = positions[None, None, :] < max_lengths[..., None]
    ranked = torch.where(candidate, survival.double(), torch.full_like(survival, -1.0, dtype=torch.float64))
    values, order = torch.sort(ranked.flatten(1), dim=1, descending=True, stable=True)
    values = values.clamp(min=0)  # non-candidates sort last and add nothing
    zeros = values.new_zeros(num_batches, 1)
    tokens = num_rows + torch.cat([zeros, values.cumsum(dim=1)], dim=1)
    if packed:  # c cells cost what c cells cost, wherever they are
        price_index = torch.arange(tokens.shape[1], device=survival.device).expand(num_batches, -1)
    else:  # the deepest cell so far sets every row's block
        price_index = torch.cat([zeros.long(), ((order % num_cells) + 1).cummax(dim=1).values], dim=1)
    seconds = fixed_seconds + verify_seconds.to(survival.device, torch.float64)[price_index]
    rate = tokens / seconds
    allowed = torch.arange(rate.shape[1], device=rate.device)[None, :] <= candidate.flatten(1).sum(dim=1, keepdim=True)
    if max_budget is not None:
        allowed &= torch.arange(rate.shape[1], device=rate.device)[None, :] <= max_budget
    rate = torch.where(allowed, rate, torch.full_like(rate, -1.0))
    budget = rate.argmax(dim=1)  # first maximum: the smallest budget among ties
    index = budget[:, None]
    return BudgetChoice(budget, tokens.gather(1, index)[:, 0], seconds.gather(1, index)[:, 0])


def best_tree_budget(survival: torch.Tensor, candidate: torch.Tensor, fixed_seconds: float,
                     verify_seconds: torch.Tensor, max_budget: int | None = None, packed: bool = False) -> int:
    """:func:`best_budget` over draft trees: the ``C`` maximising expected emitted tokens per second when the ``C``
    best nodes of the batch (:func:`~tetris_hf.trees.select_tree_nodes`' order) are verified.

    Args:
        survival: ``(B, N)`` probability that the whole path to a node is accepted (never above its parent's).
        candidate: ``(B, N)`` bool, ancestor-closed.
        fixed_seconds: the step's seconds whatever ``C`` is.
        verify_seconds: padded, ``(N + 1,)`` entry ``n``: a verification forward whose widest row checks ``n``
            nodes; ``packed``, ``(B N + 1,)`` entry ``c``: one that checks ``c`` nodes in all.
        max_budget: cap on ``C``.
        packed: how ``verify_seconds`` is indexed.

    Returns:
        ``C`` (ties go to the smaller).
    """
    num_rows, num_nodes = survival.shape
    ranked = torch.where(candidate, survival.double(), torch.full_like(survival, -1.0, dtype=torch.float64))
    values, order = torch.sort(ranked.flatten(), descending=True, stable=True)
    zero = values.new_zeros(1)
    tokens = num_rows + torch.cat([zero, values.clamp(min=0).cumsum(dim=0)])
    # E.g. rows of the ordered nodes [0, 1, 0] -> per-row counts [[1 0], [1 1], [2 1]] -> widest [0, 1, 1, 2]
    counts = torch.nn.functional.one_hot(order // num_nodes, num_rows).cumsum(dim=0)
    price_index = torch.arange(tokens.numel()) if packed else torch.cat([zero.long(), counts.amax(dim=1)])
    rate = tokens / (fixed_seconds + verify_seconds.double()[price_index])
    allowed = torch.arange(rate.numel()) <= int(candidate.sum())
    if max_budget is not None:
        allowed &= torch.arange(rate.numel()) <= max_budget
    return int(torch.where(allowed, rate, torch.full_like(rate, -1.0)).argmax())


class GoodputPlan(NamedTuple):
    """What :func:`plan_step` expects of a plan: draft ``num_draft_tokens`` per row (0 = plain decoding), verify about
    ``budget`` cells, expecting ``tokens`` emitted in ``seconds``."""

    num_draft_tokens: int
    budget: int
    tokens: float
    seconds: float

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def plan_step(acceptance: torch.Tensor, num_rows: int, max_draft: int, cost: StepCostModel,
              max_budget: int | None = None, draft_seconds: float | None = None) -> GoodputPlan:
    """Choose ``K`` (0 = no drafting) and ``C`` for a batch of ``num_rows`` before drafting.

    Args:
        acceptance: ``(P, max_draft)`` conditional acceptance probabilities of recently drafted rows (``P >= 0``),
            standing in for the rows about to be drafted.
        num_rows: ``B``.
        max_draft: largest ``K`` considered.
        cost: the step cost model.
        max_budget: cap on ``C``.
        draft_seconds: one draft step's seconds (default the cost model's; 0 for prompt lookup alone).

    Returns:
        The best :class:`GoodputPlan`; plain decoding unless drafting is expected to be faster.
    """
    plain_seconds = cost.verify_seconds(num_rows, 1) + cost.step_overhead
    best = GoodputPlan(0, 0, float(num_rows), plain_seconds)
    pool_rows = acceptance.shape[0]
    if pool_rows == 0 or max_draft == 0 or max_budget == 0:
        return best
    num_batches = max(1, pool_rows // num_rows)
    index = torch.arange(num_batches * num_rows) % pool_rows
    batches = acceptance[index].view(num_batches, num_rows, -1).double()
    verify = cost.verify_prices(num_rows, max_draft)
    draft_seconds = cost.draft_seconds(num_rows) if draft_seconds is None else draft_seconds
    for num_draft in range(1, max_draft + 1):
        survival = batches[..., :num_draft].cumprod(dim=-1)
        lengths = torch.full((num_batches, num_rows), num_draft, dtype=torch.long)
        prices = verify[: num_rows * num_draft + 1] if cost.packed else verify[: num_draft + 1]
        choice = best_budget(survival, lengths, num_draft * draft_seconds + cost.step_overhead, prices, max_budget,
                             cost.packed)
        plan = GoodputPlan(num_draft, max(1, round(float(choice.budget.double().mean()))),
                        float(choice.tokens.mean()), float(choice.seconds.mean()))
        if plan.rate > best.rate:
            best = plan
    return best


def expected_tokens_geometric(acceptance: float, num_draft: int) -> float:
    """Expected tokens a row emits verifying ``k`` drafts, each accepted with probability ``a`` independently
    (prefix semantics): ``(1 - a^(k+1)) / (1 - a)``."""
    if acceptance >= 1.0:
        return float(num_draft + 1)
    return (1.0 - acceptance ** (num_draft + 1)) / (1.0 - acceptance)


def dsd_window(acceptance: float, num_rows: int, max_draft: int, cost: StepCostModel) -> int:
    """DSD: the one ``k`` in ``0..max_draft`` for the whole batch maximising
    ``B (1 - a^(k+1)) / (1 - a)`` over the step's seconds (``k = 0``: plain decoding)."""
    best_k, best_rate = 0, num_rows / (cost.verify_seconds(num_rows, 1) + cost.step_overhead)
    for k in range(1, max_draft + 1):
        rate = num_rows * expected_tokens_geometric(acceptance, k) / cost.step_seconds(num_rows, k, k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
