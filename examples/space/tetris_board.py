"""The TETRIS board of one speculative run: for each step, a grid of rows (requests) x draft positions.

Each cell is one drafted token and is coloured by what happened to it that step:

- ``accepted``: selected for verification and accepted by the target;
- ``rejected``: selected for verification, not accepted (the first mismatch, or any cell after it);
- ``not-selected``: drafted but left out of the verification budget (TETRIS drops it);
- ``not-drafted``: the row drafted fewer than the step's ``K`` cells: with prompt lookup, a row whose last tokens
  occur nowhere earlier in its prompt and output drafts none, and a match near the row's end drafts fewer;
- ``finished``: the request had already stopped (no cell was drafted).

The budget ``C`` (draft tokens the target verifies across the batch that step) is drawn as a dashed line at
``C / active rows`` positions: the area left of it is ``C`` cells, which fixed-k fills row by row and TETRIS
redistributes to the rows whose drafts are most likely to survive.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

ACCEPTED = "accepted"
REJECTED = "rejected"
NOT_SELECTED = "not-selected"
NOT_DRAFTED = "not-drafted"
FINISHED = "finished"
MODEL_DRAFT, LOOKUP = "model", "lookup"  # where a run's drafts came from (as tetris_runs names them)

# fill, stroke, text colour, legend label
CELL_STYLE = {
    ACCEPTED: ("#2e9d4f", "#1e6b35", "#ffffff", "selected, accepted"),
    REJECTED: ("#d64541", "#8f2522", "#ffffff", "selected, rejected"),
    NOT_SELECTED: ("#eceff1", "#90a4ae", "#546e7a", "drafted, not selected"),
    NOT_DRAFTED: ("#fafafa", "#cfd8dc", "#b0bec5", "not drafted (no match in the prompt)"),
    FINISHED: ("#ffffff", "#eeeeee", "#bdbdbd", "request finished"),
}


@dataclass
class BoardTrace:
    """Per-step record of a speculative run, shaped like :class:`tetris_hf.TetrisStats`'s per-step lists.

    ``survival_per_step[s][row]`` is the row's cumulative confidence at each cell it drafted, the score TETRIS ranks
    cells by, or ``None`` for a finished row. With the draft model (``draft="model"``) it is the cumulative draft
    probability ``prod_{t<=j} max q_t`` (when greedy, the drafted tokens' own probabilities; when sampling, the
    draft's confidence at each position, whichever token it drew). With prompt lookup (``draft="lookup"``) it is the
    product of the online estimates that the target accepts each cell given the ones before it; a row that drafted
    ``d < K`` cells has ``d`` scores (none without a match). ``drafted_per_step[s][row]``: the cells the row drafted
    (``None`` for a finished row); cells past it are ``not-drafted``. Empty: every active row drafted ``K``.
    """

    strategy: str
    num_assistant_tokens: int
    draft: str = MODEL_DRAFT
    num_drafted_per_step: list[int] = field(default_factory=list)
    budget_per_step: list[int] = field(default_factory=list)
    verified_per_step: list[list[int]] = field(default_factory=list)
    accepted_per_step: list[list[int]] = field(default_factory=list)
    survival_per_step: list[list[list[float] | None]] = field(default_factory=list)
    drafted_per_step: list[list[int | None]] = field(default_factory=list)

    @classmethod
    def from_stats(cls, strategy: str, num_assistant_tokens: int, stats, survival=None, drafted=None,
                   draft: str = MODEL_DRAFT) -> "BoardTrace":
        """A snapshot (copied lists) of the drafting steps of a ``TetrisStats``-like object, with optional per-step
        survival scores and per-step, per-row drafted cells (both indexed like the stats' steps). Steps that drafted
        nothing (the first, which reads the prompt, and ``adaptive``'s plain steps) have no cells and are left
        out."""
        steps = [s for s in range(len(stats.verified_per_step)) if stats.num_drafted_per_step[s] > 0]
        return cls(
            strategy=strategy,
            num_assistant_tokens=num_assistant_tokens,
            draft=draft,
            num_drafted_per_step=[stats.num_drafted_per_step[s] for s in steps],
            budget_per_step=[stats.budget_per_step[s] for s in steps],
            verified_per_step=[list(stats.verified_per_step[s]) for s in steps],
            accepted_per_step=[list(stats.accepted_per_step[s]) for s in steps],
            survival_per_step=[survival[s] for s in steps if s < len(survival)] if survival is not None else [],
            drafted_per_step=[list(drafted[s]) for s in steps if s < len(drafted)] if drafted is not None else [],
        )

    @property
    def steps(self) -> int:
        return len(self.verified_per_step)


def board_cells(stats, step: int, drafted: list[int | None] | None = None) -> list[list[str]]:
    """Cell kinds of step ``step`` (0-based) of a ``TetrisStats``-like object: one list of ``K`` kinds per row.

    A row that verified ``l`` drafts and accepted ``a`` of them has ``a`` accepted cells, ``l - a`` rejected cells,
    then cells that were drafted but not selected up to the ``d`` cells it drafted (``drafted[row]``; ``K`` when
    ``drafted`` or its entry is ``None``), then ``K - d`` cells it did not draft. Rows that had finished (``-1``) are
    all ``finished``.
    """
    num_drafted = stats.num_drafted_per_step[step]
    cells = []
    for row, (verified, accepted) in enumerate(zip(stats.verified_per_step[step], stats.accepted_per_step[step])):
        if verified < 0:
            cells.append([FINISHED] * num_drafted)
            continue
        count = drafted[row] if drafted is not None and row < len(drafted) and drafted[row] is not None \
            else num_drafted
        cells.append([
            ACCEPTED if j < accepted else REJECTED if j < verified else NOT_SELECTED if j < count else NOT_DRAFTED
            for j in range(num_drafted)
        ])
    return cells



def step_summary(stats, step: int, drafted: list[int | None] | None = None) -> dict:
    """Counts of one step: active rows, drafted per row ``K``, cells drafted over the active rows (``K`` each unless
    ``drafted`` says fewer), budget ``C``, verified and accepted cells."""
    verified = [v for v in stats.verified_per_step[step] if v >= 0]
    accepted = [a for a in stats.accepted_per_step[step] if a >= 0]
    cells = board_cells(stats, step, drafted)
    return {
        "active_rows": len(verified),
        "num_drafted": stats.num_drafted_per_step[step],
        "drafted": sum(kind not in (NOT_DRAFTED, FINISHED) for row in cells for kind in row),
        "budget": stats.budget_per_step[step],
        "verified": sum(verified),
        "accepted": sum(accepted),
    }


# ---------------------------------------------------------------------------------------------------------------
# HTML / SVG

PITCH, CELL, LABEL_WIDTH, NOTE_WIDTH, HEADER, FOOTER = 34, 30, 62, 96, 20, 22


SCORE_NAMES = {MODEL_DRAFT: "cumulative draft probability", LOOKUP: "estimated chance of acceptance"}
NOTES = {
    MODEL_DRAFT: "Numbers: cumulative draft probability of the cell (TETRIS verifies the C highest over the batch). ",
    LOOKUP: "Prompt lookup: each row drafts the tokens that followed the latest earlier occurrence of its last words in "
            "its own prompt and output; a row without a match drafts nothing. Numbers: the estimated chance that the "
            "target accepts the cell and all before it, learnt during the run from what it accepted (TETRIS "
            "verifies the C highest over the batch). ",
}


def _cell_svg(kind: str, row: int, position: int, score: float | None, score_name: str) -> str:
    fill, stroke, ink, label = CELL_STYLE[kind]
    x, y = LABEL_WIDTH + position * PITCH, HEADER + row * PITCH
    dash = ' stroke-dasharray="3 2"' if kind == NOT_SELECTED else ' stroke-dasharray="1 3"' if kind == NOT_DRAFTED \
        else ""
    tip = f"request {row + 1}, draft token {position + 1}: {label}"
    text = ""
    if score is not None and kind not in (FINISHED, NOT_DRAFTED):
        tip += f" ({score_name} {score:.2f})"
        text = (f'<text x="{x + CELL / 2}" y="{y + CELL / 2 + 4}" text-anchor="middle" font-size="10" '
                f'fill="{ink}">{short_probability(score)}</text>')
    return (f'<g><rect class="board-cell {kind}" data-row="{row}" data-position="{position}" x="{x}" y="{y}" '
            f'width="{CELL}" height="{CELL}" rx="4" fill="{fill}" stroke="{stroke}"{dash}><title>{html.escape(tip)}'
            f"</title></rect>{text}</g>")


def render_board(trace: BoardTrace | None, step: int) -> str:
    """HTML of step ``step`` (1-based, clamped) of ``trace``: a heading with the step's counts, the grid as SVG with
    the budget line, and a legend. ``None`` or an empty trace gives a placeholder."""
    if trace is None or trace.steps == 0:
        return '<div class="tetris-board empty">The board appears here once a speculative run has taken a step.</div>'
    index = min(max(int(step), 1), trace.steps) - 1
    drafted = trace.drafted_per_step[index] if index < len(trace.drafted_per_step) else None
    cells = board_cells(trace, index, drafted)
    summary = step_summary(trace, index, drafted)
    survival = trace.survival_per_step[index] if index < len(trace.survival_per_step) else None
    num_rows, num_drafted = len(cells), summary["num_drafted"]
    columns = max(num_drafted, 1)
    width = LABEL_WIDTH + columns * PITCH + NOTE_WIDTH
    height = HEADER + num_rows * PITCH + FOOTER

    parts = [f'<svg class="board-grid" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif">']
    for position in range(num_drafted):
        parts.append(f'<text x="{LABEL_WIDTH + position * PITCH + CELL / 2}" y="{HEADER - 6}" text-anchor="middle" '
                     f'font-size="11" fill="#555">{position + 1}</text>')
    for row, kinds in enumerate(cells):
        y = HEADER + row * PITCH + CELL / 2 + 4
        parts.append(f'<text x="4" y="{y}" font-size="12" fill="#333">req {row + 1}</text>')
        row_scores = survival[row] if survival is not None and row < len(survival) else None
        for position, kind in enumerate(kinds):
            score = row_scores[position] if row_scores is not None and position < len(row_scores) else None
            parts.append(_cell_svg(kind, row, position, score, SCORE_NAMES[trace.draft]))
        verified, accepted = trace.verified_per_step[index][row], trace.accepted_per_step[index][row]
        note = "finished" if verified < 0 else "no match" if kinds and kinds[0] == NOT_DRAFTED \
            else f"{accepted}/{verified} accepted"
        parts.append(f'<text x="{LABEL_WIDTH + columns * PITCH + 6}" y="{y}" font-size="12" fill="#333">{note}</text>')
    if summary["active_rows"] > 0:
        # C cells to the left of the line: C / active rows positions per row
        per_row = summary["budget"] / summary["active_rows"]
        x = LABEL_WIDTH + min(per_row, columns) * PITCH - (PITCH - CELL) / 2
        bottom = HEADER + num_rows * PITCH
        parts.append(f'<line class="budget-line" x1="{x}" y1="{HEADER - 2}" x2="{x}" y2="{bottom}" stroke="#1a237e" '
                     f'stroke-width="2.5" stroke-dasharray="6 3"/>')
        anchor = "end" if per_row >= columns else "middle"
        parts.append(f'<text x="{x}" y="{bottom + 15}" text-anchor="{anchor}" font-size="11" fill="#1a237e">'
                     f'budget C = {summary["budget"]} ({_fmt(per_row)} per row)</text>')
    parts.append("</svg>")

    vsr = summary["accepted"] / summary["verified"] if summary["verified"] else math.nan
    lookup = trace.draft == LOOKUP
    drafted_cells = (f'K = {num_drafted} per row at most, {summary["drafted"]} drafted' if lookup
                     else f"K = {num_drafted} drafted per row")
    heading = (
        f'<div class="board-heading"><b>{html.escape(trace.strategy)}</b>{" (prompt lookup)" if lookup else ""} · '
        f'step {index + 1} of {trace.steps} · {drafted_cells} · '
        f'<b class="board-budget">C = {summary["budget"]}</b> · verified {summary["verified"]} · '
        f'accepted {summary["accepted"]}'
        + (f" (VSR {vsr:.2f})" if not math.isnan(vsr) else "")
        + f' · {summary["active_rows"]} active rows</div>'
    )
    borders = {NOT_SELECTED: "dashed", NOT_DRAFTED: "dotted"}
    legend = "".join(
        f'<span class="legend-item"><span class="swatch" style="background:{fill};border:1px '
        f'{borders.get(kind, "solid")} {stroke}"></span>{label}</span>'
        for kind, (fill, stroke, _, label) in CELL_STYLE.items() if kind != NOT_DRAFTED or lookup
    )
    legend += ('<span class="legend-item"><span class="swatch budget"></span>budget line: C cells lie to its left'
               "</span>")
    note = NOTES[trace.draft] + "Every active row also gets one token from the target each step."
    return (f'<div class="tetris-board" data-step="{index + 1}" data-steps="{trace.steps}">{heading}'
            f'<div class="board-scroll">{"".join(parts)}</div><div class="board-legend">{legend}</div>'
            f'<div class="board-note">{note}</div></div>')


def short_probability(value: float) -> str:
    """A probability in at most four characters: ``1.0``, ``.82``, ``.05``, ``<.01``."""
    if value >= 0.995:
        return "1.0"
    if value >= 0.01:
        return f"{value:.2f}"[1:]
    return "<.01"


def _fmt(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.2f}"


BOARD_CSS = """
.tetris-board { font-family: sans-serif; font-size: 13px; }
.tetris-board .board-heading { margin: 4px 0 6px 0; }
.tetris-board .board-scroll { overflow-x: auto; }
.tetris-board .board-legend { display: flex; flex-wrap: wrap; gap: 14px; margin-top: 4px; }
.tetris-board .legend-item { display: inline-flex; align-items: center; gap: 5px; }
.tetris-board .swatch { display: inline-block; width: 14px; height: 14px; border-radius: 3px; }
.tetris-board .swatch.budget { width: 0; height: 14px; border-left: 2.5px dashed #1a237e; border-radius: 0; }
.tetris-board .board-note { color: #666; font-size: 12px; margin-top: 4px; }
"""
