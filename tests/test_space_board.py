"""The Space's board (examples/space/tetris_board.py): cell kinds per step, and the SVG drawn from them."""

from __future__ import annotations

import html
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
    ACCEPTED, CHAR_WIDTH, FINISHED, LABEL_WIDTH, LOOKUP, NOT_DRAFTED, NOT_SELECTED, PITCH, REJECTED, TERMS, BoardTrace,
    RowTree, board_cells, render_board, short_probability, step_summary, token_label,
)
from tetris_runs import row_trees, step_cells, step_trees  # noqa: E402
from tiny_models import left_pad, noisy_copy, random_prompts, sharpen, tiny_llama  # noqa: E402


def visible(page: str) -> str:
    """The text a reader sees of a board's HTML: tags left out (the terms' tooltips are attributes)."""
    return html.unescape(re.sub(r"<title>.*?</title>|<[^>]+>", "", page))


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


def test_board_numbers_steps_as_the_run_does_and_says_which_drafted():
    """The run's metrics count every step (the prompt's, adaptive's plain steps); the board names each of its
    drafting steps by that number, so the two never disagree."""
    stats = stats_like([0, 2, 0, 3], [0, 4, 0, 6], [[0, 0], [2, 2], [0, 0], [3, 3]], [[0, 0], [1, 2], [0, 0], [3, 0]])
    trace = BoardTrace.from_stats("adaptive", 2, stats)
    assert (trace.steps, trace.all_steps, trace.step_numbers) == (2, 4, [2, 4])
    page = render_board(trace, 2)
    assert 'data-run-step="4"' in page and 'data-total-steps="4"' in page
    assert "step 4 of 4 (drafting step 2 of 2)" in visible(page)
    hand_made = BoardTrace("TETRIS", 2, num_drafted_per_step=[2], budget_per_step=[4], verified_per_step=[[2, 2]],
                           accepted_per_step=[[1, 2]])  # no run numbering: the board's own
    assert "step 1 of 1 ·" in visible(render_board(hand_made, 1))


@pytest.mark.parametrize("budget, rows", [(1, 4), (4, 4), (2, 1), (24, 4)])
def test_budget_label_lies_inside_the_board_wherever_the_line_is(budget, rows):
    """Centred under the budget line where it fits, against an edge where it does not: never cut off."""
    stats = stats_like([6], [budget], [[1] * rows], [[0] * rows])
    page = render_board(BoardTrace.from_stats("adaptive", 4, stats), 1)
    width = float(re.search(r'<svg class="board-grid"[^>]* width="([0-9.]+)"', page).group(1))
    match = re.search(r'<text class="budget-label" x="([0-9.]+)"[^>]*>([^<]+)<', page)
    start, label = float(match.group(1)), match.group(2)
    assert label.startswith("budget C = ")
    assert 0 <= start and start + len(label) * CHAR_WIDTH <= width


def test_board_defines_its_terms_and_draws_finished_cells_unlike_undrafted_ones():
    stats = stats_like([2], [2], [[2, -1]], [[1, -1]])
    page = render_board(BoardTrace.from_stats("TETRIS", 2, stats, drafted=[[1, None]], draft=LOOKUP), 1)
    for name in ("K", "C", "VSR"):
        assert html.escape(TERMS[name]) in page, name  # a tooltip and the legend line
    assert 'class="terms"' in page and 'id="finished-hatch"' in page and 'fill="url(#finished-hatch)"' in page
    swatches = dict(re.findall(r'class="swatch ([a-z-]+)" style="([^"]+)"', page))
    assert swatches[FINISHED] != swatches[NOT_DRAFTED] and "repeating-linear-gradient" in swatches[FINISHED]


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
    assert "(prompt lookup)" in page and "4 per row at most, 6 drafted" in visible(page)
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


# ---------------------------------------------------------------------------------------------------------------
# Draft trees: each row's tree, its verified nodes and its accepted path


def test_row_trees_keep_the_valid_nodes_and_mark_what_was_verified_and_accepted():
    """trees.py's worked example (root "r"; nodes the, a, cat, dog; TETRIS verified the, cat, dog; the target took
    the -> dog, then "sat"), plus an invalid node 4 under "a" and a second row whose path is empty."""
    r, the, a, cat, dog, big, sat = 1, 2, 3, 4, 5, 6, 7
    tokens = torch.tensor([[the, a, cat, dog, big], [a, the, big, 0, 0]])
    parents = torch.tensor([[-1, -1, 0, 0, 1], [-1, -1, 0, 0, 0]])
    log_scores = torch.tensor([[-0.2, -1.9, -0.7, -1.4, -2.4], [-0.5, -0.9, -1.0, -9.0, -9.0]])
    valid = torch.tensor([[True, True, True, True, False], [True, True, True, False, False]])
    selected = torch.tensor([[True, False, True, True, False], [True, False, False, False, False]])
    path_nodes = torch.tensor([[0, 3], [-1, -1]])
    trees = row_trees(tokens, parents, log_scores, valid, selected, path_nodes, torch.tensor([2, 0]),
                      torch.tensor([r, r]), torch.tensor([sat, the]))
    first, second = trees
    assert first == RowTree(root=r, tokens=[the, a, cat, dog], parents=[-1, -1, 0, 0],
                            scores=[round(math.exp(x), 4) for x in (-0.2, -1.9, -0.7, -1.4)],
                            kinds=[ACCEPTED, NOT_SELECTED, REJECTED, ACCEPTED], next_token=sat)
    assert first.path == [0, 3] and first.verified == 3 and first.depths == [1, 1, 2, 2]
    assert second.kinds == [REJECTED, NOT_SELECTED, NOT_SELECTED] and second.path == [] and second.next_token == the


def tree_trace() -> BoardTrace:
    """Two steps: trees (row 0 accepted the -> dog of 4 nodes, row 1 finished, row 2 rejected its only verified
    node), then a step drawn as chains."""
    trees = [
        None,  # the prompt step
        [RowTree(1, [2, 3, 4, 5], [-1, -1, 0, 0], [0.82, 0.15, 0.5, 0.25], [ACCEPTED, NOT_SELECTED, REJECTED, ACCEPTED],
                 7),
         None,
         RowTree(6, [8, 9], [-1, 0], [0.4, 0.1], [REJECTED, NOT_SELECTED], 10)],
        None,
    ]
    stats = stats_like([0, 2, 2], [0, 4, 4], [[0, 0, 0], [3, -1, 1], [2, -1, 1]], [[0, 0, 0], [2, -1, 0], [1, -1, 0]])
    return BoardTrace.from_stats("TETRIS", 2, stats, trees=trees, tree_width=2)


def test_tree_board_draws_every_node_its_edge_and_the_accepted_path():
    trace = tree_trace()
    assert trace.steps == 2 and trace.trees(1) is None  # the prompt step is left out; the last step has no trees
    words = {1: "r", 2: "the", 3: "a", 4: "cat", 5: "dog", 6: " so", 7: "sat", 8: "", 9: "new\nline", 10: "x"}
    page = render_board(trace, 1, lambda ids: [words[i] for i in ids])
    nodes = re.findall(r'<g class="tree-node ([a-z-]+)" data-row="(\d)" data-node="(\d)" data-parent="(-?\d)" '
                       r'data-depth="(\d)"', page)
    assert nodes == [(ACCEPTED, "0", "0", "-1", "1"), (NOT_SELECTED, "0", "1", "-1", "1"),
                     (REJECTED, "0", "2", "0", "2"), (ACCEPTED, "0", "3", "0", "2"),
                     (REJECTED, "2", "0", "-1", "1"), (NOT_SELECTED, "2", "1", "0", "2")]
    edges = re.findall(r'<line class="tree-edge( on-path)?" data-row="(\d)" data-node="(\d)"', page)
    assert [(row, node) for path, row, node in edges if path] == [("0", "0"), ("0", "3")]  # the accepted path
    assert len(edges) == 6 and page.count('<g class="tree-root"') == 2  # finished row 1: no tree
    assert "request finished" in page and ">2/3 accepted<" in page and ">0/1 accepted<" in page
    for label in (">the<", ">dog<", ">\u00b7so<", ">#8<", ">new\u23celine<"):  # spaces, newlines, empty texts shown
        assert label in page, label
    assert "target adds &#x27;sat&#x27;" in page and ">.82<" in page and "path score 0.82" in page
    shown = visible(page)
    assert "trees of width w = 2, depth K = 2" in shown and "3 nodes drafted" not in shown and "6 nodes drafted" in shown
    assert "C = 4" in shown and "verified 4 · accepted 2 (VSR 0.50) · 2 active rows" in shown
    assert "step 2 of 3 (drafting step 1 of 2)" in shown  # the run's own numbering: its first step read the prompt
    assert "accepted path" in page and "root: the row's last token" in page  # the legend
    assert "board-cell" not in page and 'class="budget-line"' not in page

    chains = render_board(trace, 2)  # a step without trees keeps the grid
    assert "tree-node" not in chains and chains.count("board-cell") == 3 * 2 and "budget-line" in chains
    assert "#2" in render_board(trace, 1)  # no tokenizer: token ids


@pytest.mark.parametrize("text, label", [("the", "the"), (" cat", "\u00b7cat"), ("\n\n", "\u23ce\u23ce"),
                                         ("antidisestablishment", "antidis\u2026"), ("", "\u2205")])
def test_token_labels_show_spaces_and_newlines_and_fit_a_node(text, label):
    assert token_label(text) == label


def test_trees_captured_from_a_real_tree_loop_add_up_to_its_stats():
    """The trees step records carry in the library's own loop (``tetris_tree_width=2``): every drafting step's trees,
    verified and accepted nodes per row as the stats count them, and greedy output equal to the target alone."""
    target = sharpen(tiny_llama(seed=0), 6.0)
    draft = noisy_copy(target, 0.15)
    input_ids, mask = left_pad(random_prompts(4, 64, seed=3))
    trees = []

    def on_step(record, loop):
        trees.append(step_trees(record, loop.batch_size))

    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                          num_assistant_tokens=3, tetris_extra_tokens=2, tetris_tree_width=2, max_new_tokens=16,
                          do_sample=False, return_dict_in_generate=True, tetris_step_callback=on_step)
    plain = target.generate(input_ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    assert torch.equal(out.sequences, plain)
    stats = out.tetris_stats
    trace = BoardTrace.from_stats("TETRIS", 3, stats, trees=trees, tree_width=2)
    assert trees[0] is None and trace.steps == stats.steps - 1 == len(trace.trees_per_step)
    verified = sum(tree.verified for step in trace.trees_per_step for tree in step if tree is not None)
    accepted = sum(len(tree.path) for step in trace.trees_per_step for tree in step if tree is not None)
    assert (verified, accepted) == (stats.verified_tokens, stats.accepted_tokens) and accepted > 0
    for step in range(trace.steps):
        assert sum(t.verified for t in trace.trees(step) if t is not None) <= trace.budget_per_step[step]
        page = render_board(trace, step + 1)
        assert page.count('<g class="tree-node') == sum(len(t.tokens) for t in trace.trees(step) if t is not None)
