"""The Space's board (examples/space/tetris_board.py): cell kinds per step, and the SVG drawn from them."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "space"))

import tetris_hf  # noqa: E402,F401
from tetris_board import (  # noqa: E402
    ACCEPTED, FINISHED, LABEL_WIDTH, LOOKUP, NOT_DRAFTED, NOT_SELECTED, PITCH, REJECTED, BoardTrace, board_cells,
    render_board, short_probability, step_summary,
)
from tetris_runs import step_cells  # noqa: E402
from tiny_models import left_pad, noisy_copy, random_prompts, sharpen, tiny_llama  # noqa: E402


def stats_like(num_drafted, budget, verified, accepted):
    return SimpleNamespace(num_drafted_per_step=num_drafted, budget_per_step=budget, verified_per_step=verified,
                           accepted_per_step=accepted)


def test_cells_are_accepted_then_rejected_then_not_selected():
    stats = stats_like([5], [8], [[3, 0, -1, 5]], [[1, 0, -1, 5]])
    assert board_cells(stats, 0) == [
        [ACCEPTED, REJECTED, REJECTED, NOT_SELECTED, NOT_SELECTED],
        [NOT_SELECTED] * 5,
        [FINISHED] * 5,
        [ACCEPTED] * 5,
    ]
    assert step_summary(stats, 0) == {"active_rows": 3, "num_drafted": 5, "drafted": 15, "budget": 8, "verified": 8,
                                      "accepted": 6}


def test_cells_of_a_real_tetris_run_respect_the_budget_and_match_the_counts():
    target = sharpen(tiny_llama(seed=0), 6.0)
    draft = noisy_copy(target, 0.15)
    input_ids, mask = left_pad(random_prompts(5, 64, seed=3))
    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                          num_assistant_tokens=3, tetris_extra_tokens=2, max_new_tokens=20, do_sample=False,
                          return_dict_in_generate=True)
    stats = out.tetris_stats
    assert stats.steps > 1
    verified = accepted = 0
    for step in range(stats.steps):
        cells = board_cells(stats, step)
        selected = sum(kind in (ACCEPTED, REJECTED) for row in cells for kind in row)
        assert selected <= stats.budget_per_step[step]
        assert all(len(row) == stats.num_drafted_per_step[step] for row in cells)
        verified += selected
        accepted += sum(kind == ACCEPTED for row in cells for kind in row)
    assert (verified, accepted) == (stats.verified_tokens, stats.accepted_tokens)


def test_board_draws_every_cell_its_colour_and_the_budget_line():
    stats = stats_like([5, 5], [8, 6], [[3, 0, 5, 0], [2, -1, 4, 0]], [[1, 0, 5, 0], [2, -1, 1, 0]])
    survival = [[[0.9, 0.5, 0.2, 0.1, 0.05], [0.3] * 5, [1.0] * 5, [0.2] * 5], None]
    trace = BoardTrace.from_stats("TETRIS", 2, stats, survival)
    page = render_board(trace, 1)
    kinds = re.findall(r'class="board-cell ([a-z-]+)"', page)
    assert len(kinds) == 4 * 5
    assert kinds.count(ACCEPTED) == 6 and kinds.count(REJECTED) == 2 and kinds.count(NOT_SELECTED) == 12
    assert "C = 8" in page and 'data-step="1"' in page and 'data-steps="2"' in page
    # 8 cells over 4 active rows: the line sits after position 2
    x = float(re.search(r'class="budget-line" x1="([0-9.]+)"', page).group(1))
    assert x == pytest.approx(LABEL_WIDTH + 2 * PITCH - (PITCH - 30) / 2)
    assert ">.90<" in page and "cumulative draft probability 0.90" in page

    second = render_board(trace, 2)
    assert re.findall(r'class="board-cell ([a-z-]+)"', second).count(FINISHED) == 5
    assert "C = 6" in second and "3 active rows" in second


def test_board_clamps_the_step_and_has_a_placeholder_before_any_step():
    trace = BoardTrace.from_stats("fixed-k", 2, stats_like([2], [4], [[2, 2]], [[1, 2]]))
    assert 'data-step="1"' in render_board(trace, 0) and 'data-step="1"' in render_board(trace, 99)
    assert "board-cell" not in render_board(None, 1)
    assert "board-cell" not in render_board(BoardTrace("TETRIS", 4), 1)


def test_trace_is_a_snapshot_of_the_live_stats():
    lists = stats_like([2], [4], [[2, 2]], [[1, 2]])
    trace = BoardTrace.from_stats("TETRIS", 2, lists)
    lists.verified_per_step[0][0] = 0
    lists.verified_per_step.append([1, 1])
    assert trace.verified_per_step == [[2, 2]] and trace.steps == 1


@pytest.mark.parametrize("value, text", [(1.0, "1.0"), (0.999, "1.0"), (0.82, ".82"), (0.05, ".05"), (0.004, "<.01")])
def test_probabilities_fit_a_cell(value, text):
    assert short_probability(value) == text


def test_step_counts_ignore_finished_rows():
    stats = stats_like([3], [6], [[3, -1, 1]], [[2, -1, 0]])
    assert step_summary(stats, 0)["active_rows"] == 2
    assert board_cells(stats, 0)[1] == [FINISHED] * 3


def test_trace_leaves_out_steps_that_drafted_nothing():
    """The prompt step and adaptive's plain steps have no cells: the board shows the drafting steps only."""
    stats = stats_like([0, 2, 0, 3], [0, 4, 0, 6], [[0, 0], [2, 2], [0, 0], [3, 3]], [[0, 0], [1, 2], [0, 0], [3, 0]])
    survival = [[[], []], [[0.9, 0.5], [0.8, 0.4]], [[], []], [[0.9] * 3, [0.5] * 3]]
    trace = BoardTrace.from_stats("adaptive", 2, stats, survival)
    assert trace.num_drafted_per_step == [2, 3] and trace.budget_per_step == [4, 6]
    assert trace.accepted_per_step == [[1, 2], [3, 0]] and trace.survival_per_step[1] == [[0.9] * 3, [0.5] * 3]


# ---------------------------------------------------------------------------------------------------------------
# Prompt lookup: rows draft fewer than K cells, or none where nothing matched


def test_rows_that_drafted_fewer_cells_show_the_rest_as_not_drafted():
    stats = stats_like([4], [6], [[0, 2, 3, -1]], [[0, 2, 1, -1]])
    drafted = [0, 2, 4, None]  # no match; a match two tokens before the row's end; a full window; finished
    assert board_cells(stats, 0, drafted) == [
        [NOT_DRAFTED] * 4,
        [ACCEPTED, ACCEPTED, NOT_DRAFTED, NOT_DRAFTED],
        [ACCEPTED, REJECTED, REJECTED, NOT_SELECTED],
        [FINISHED] * 4,
    ]
    assert step_summary(stats, 0, drafted)["drafted"] == 6 and step_summary(stats, 0)["drafted"] == 12


def test_lookup_board_draws_rows_without_a_match_without_scores():
    stats = stats_like([0, 4], [0, 6], [[0, 0, 0], [0, 2, 3]], [[0, 0, 0], [0, 2, 1]])
    survival = [[[], [], []], [[], [0.5, 0.4], [0.6, 0.5, 0.4, 0.3]]]
    trace = BoardTrace.from_stats("TETRIS", 4, stats, survival, drafted=[[0, 0, 0], [0, 2, 4]], draft=LOOKUP)
    assert trace.steps == 1 and trace.drafted_per_step == [[0, 2, 4]]  # the prompt step is left out
    page = render_board(trace, 1)
    kinds = re.findall(r'class="board-cell ([a-z-]+)"', page)
    assert kinds.count(NOT_DRAFTED) == 4 + 2 and kinds.count(ACCEPTED) == 3 and kinds.count(NOT_SELECTED) == 1
    assert page.count(">no match<") == 1 and ">2/2 accepted<" in page
    assert "(prompt lookup)" in page and "4 per row at most, 6 drafted" in page
    assert "not drafted (no match in the prompt)" in page  # in the legend
    assert "estimated chance of acceptance 0.50" in page and "cumulative draft probability" not in page
    assert page.count('font-size="10"') == 6  # a score on each of the 6 drafted cells, none on the others
    model = render_board(BoardTrace.from_stats("TETRIS", 4, stats, survival), 1)
    assert "no match in the prompt" not in model and NOT_DRAFTED not in model


def test_step_cells_cut_each_rows_scores_at_the_cells_it_drafted():
    """A lookup step record: row 2 matched nothing (confidences -inf), row 0 drafted 2 of K = 3, row 1 is done."""
    record = SimpleNamespace(
        rows=torch.tensor([0, 2]), num_drafted=3, drafted_lengths=torch.tensor([2, 0]),
        token_log_probs=torch.tensor([[math.log(0.5), math.log(0.8), math.log(0.9)], [-math.inf] * 3]),
    )
    survival, drafted = step_cells(record, 3)
    assert drafted == [2, None, 0]
    assert survival == [[0.5, 0.4], None, []]
    # a draft model's record (no per-row counts in older strategy exports): every row drafted K
    model = SimpleNamespace(rows=torch.tensor([1]), num_drafted=2, token_log_probs=torch.tensor([[0.0, 0.0]]))
    assert step_cells(model, 2) == ([None, [1.0, 1.0]], [None, 2])


def test_cells_of_a_real_lookup_run_count_what_was_drafted_and_respect_the_budget():
    """Prompt lookup through the library on tiny models: rows 0-2 repeat themselves (matches), row 3 never repeats a
    token (no match until it generates one it had): the board's drafted cells add up to ``drafted_tokens``."""
    target = sharpen(tiny_llama(seed=0), 6.0)
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 9, 10, 9, 10, 9], [11, 12, 13, 11, 12, 13, 11],
               [20, 21, 22, 23, 24, 25]]
    input_ids, mask = left_pad(prompts)
    cells_per_step = []
    out = target.generate(input_ids, attention_mask=mask, custom_generate="tetris", prompt_lookup_num_tokens=3,
                          tetris_extra_tokens=2, max_new_tokens=16, do_sample=False, return_dict_in_generate=True,
                          tetris_step_callback=lambda record, loop: cells_per_step.append(step_cells(record, 4)))
    stats = out.tetris_stats
    survival = [step[0] for step in cells_per_step]
    drafted = [step[1] for step in cells_per_step]
    trace = BoardTrace.from_stats("TETRIS", 3, stats, survival, drafted, draft=LOOKUP)
    assert trace.steps > 1
    total = verified = accepted = 0
    for step in range(trace.steps):
        cells = board_cells(trace, step, trace.drafted_per_step[step])
        selected = sum(kind in (ACCEPTED, REJECTED) for row in cells for kind in row)
        assert selected <= trace.budget_per_step[step]
        total += sum(kind not in (NOT_DRAFTED, FINISHED) for row in cells for kind in row)
        verified += selected
        accepted += sum(kind == ACCEPTED for row in cells for kind in row)
        scores = trace.survival_per_step[step]
        assert all(row is None or len(row) == count for row, count in zip(scores, trace.drafted_per_step[step]))
        assert all(0 < score <= 1 for row in scores if row for score in row)  # -inf (no match) never shown
    assert (total, verified, accepted) == (stats.drafted_tokens, stats.verified_tokens, stats.accepted_tokens)
    assert any(kind == NOT_DRAFTED for step in range(trace.steps)
               for row in board_cells(trace, step, trace.drafted_per_step[step]) for kind in row)
    assert "board-cell not-drafted" in render_board(trace, 1)
