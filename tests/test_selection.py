"""TETRIS selection equals brute force and the heap greedy of the paper."""

import heapq
import itertools

import pytest
import torch

from tetris_hf.selection import cumulative_log_probs, select_fixed, select_tetris
from tetris_hf.options import TetrisOptions
from tetris_hf.strategies import TetrisSelection


def heap_greedy(scores: torch.Tensor, max_lengths: torch.Tensor, budget: int) -> list[int]:
    """The paper's greedy: repeatedly extend the row whose next cell scores highest (ties: lower row)."""
    lengths = [0] * scores.shape[0]
    heap = [(-float(scores[row, 0]), row) for row in range(scores.shape[0]) if max_lengths[row] > 0]
    heapq.heapify(heap)
    for _ in range(budget):
        if not heap:
            break
        _, row = heapq.heappop(heap)
        lengths[row] += 1
        if lengths[row] < max_lengths[row]:
            heapq.heappush(heap, (-float(scores[row, lengths[row]]), row))
    return lengths


def brute_force_best(scores: torch.Tensor, max_lengths: torch.Tensor, budget: int) -> float:
    """Best total score over every prefix-per-row selection of exactly min(budget, candidates) cells."""
    take = min(budget, int(max_lengths.sum()))
    best = float("-inf")
    for lengths in itertools.product(*[range(int(m) + 1) for m in max_lengths]):
        if sum(lengths) == take:
            total = sum(float(scores[row, :length].sum()) for row, length in enumerate(lengths))
            best = max(best, total)
    return best


def random_table(generator, rows, cells, ties):
    probs = torch.rand(rows, cells, generator=generator)
    if ties:  # few distinct values: many equal scores within and across rows
        probs = (probs * 3).ceil() / 3
    return cumulative_log_probs(probs.log())


@pytest.mark.parametrize("seed", range(30))
def test_selection_equals_brute_force_and_heap_greedy(seed):
    generator = torch.Generator().manual_seed(seed)
    rows, cells = int(torch.randint(1, 5, (1,), generator=generator)), int(torch.randint(1, 5, (1,), generator=generator))
    scores = random_table(generator, rows, cells, ties=seed % 2 == 0)
    max_lengths = torch.randint(0, cells + 1, (rows,), generator=generator)  # 0: a row with no drafts left
    for budget in range(0, rows * cells + 2):
        lengths = select_tetris(scores, max_lengths, budget)
        assert (lengths <= max_lengths).all()
        assert int(lengths.sum()) == min(budget, int(max_lengths.sum()))
        assert lengths.tolist() == heap_greedy(scores, max_lengths, budget)
        chosen = sum(float(scores[row, :length].sum()) for row, length in enumerate(lengths.tolist()))
        assert chosen == pytest.approx(brute_force_best(scores, max_lengths, budget), abs=1e-5)


def test_zero_budget_verifies_nothing():
    scores = cumulative_log_probs(torch.rand(3, 4).log())
    assert select_tetris(scores, torch.full((3,), 4), 0).tolist() == [0, 0, 0]


def test_all_equal_scores_still_give_prefixes():
    scores = torch.zeros(3, 4)  # every cell ties
    assert select_tetris(scores, torch.tensor([4, 4, 4]), 5).tolist() == [4, 1, 0]


def test_certain_drafts_with_minus_infinity_rank_above_non_candidates():
    scores = torch.tensor([[0.0, float("-inf")], [-1.0, -2.0]])
    assert select_tetris(scores, torch.tensor([2, 1]), 3).tolist() == [2, 1]


def test_negative_budget_is_refused():
    with pytest.raises(ValueError, match="budget"):
        select_tetris(torch.zeros(1, 1), torch.ones(1, dtype=torch.long), -1)


def test_fixed_window_is_capped_per_row():
    assert select_fixed(torch.tensor([0, 2, 9]), 4).tolist() == [0, 2, 4]


@pytest.mark.parametrize("ties", [False, True])
def test_one_row_verifies_its_first_cells_as_the_heap_greedy_does(ties):
    # A single row takes a shortcut (no sort): its top cells are its first ones, up to max_lengths and the budget.
    generator = torch.Generator().manual_seed(3)
    for cells in range(1, 6):
        scores = random_table(generator, 1, cells, ties)
        scores[0, cells // 2:] = float("-inf") if cells > 2 else scores[0, cells // 2:]  # -inf cells are candidates
        for max_length in range(cells + 1):
            for budget in range(cells + 2):
                lengths = select_tetris(scores, torch.tensor([max_length]), budget)
                assert lengths.tolist() == heap_greedy(scores, torch.tensor([max_length]), budget)


@pytest.mark.parametrize("budget", [None, 0, 1, 3, 5, 8, 12, 40])
@pytest.mark.parametrize("num_rows", [1, 2, 3])
def test_tetris_plans_without_confidences_only_where_ranking_cannot_matter(num_rows, budget):
    # Where its plan skips the draft's confidences (one row, or a budget covering every cell), TetrisSelection's
    # choice equals ranking by real confidences; everywhere else the plan asks for them.
    strategy = TetrisSelection(TetrisOptions(num_assistant_tokens=2, tetris_extra_tokens=2, tetris_budget=budget))
    plan = strategy.plan(num_rows)
    cells = plan.num_draft_tokens
    assert plan.needs_confidences == (num_rows > 1 and plan.budget < num_rows * cells)
    generator = torch.Generator().manual_seed(num_rows)
    for _ in range(20):
        log_probs = -torch.rand(num_rows, cells, generator=generator) * 3
        max_lengths = torch.randint(0, cells + 1, (num_rows,), generator=generator)
        ranked = select_tetris(cumulative_log_probs(log_probs), max_lengths, plan.budget)
        chosen = strategy.select(None if not plan.needs_confidences else log_probs, max_lengths, plan)
        assert chosen.tolist() == ranked.tolist()
