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

With draft trees (``tetris_tree_width=w > 1``) a step's row is a tree, not a chain: :func:`render_board` draws each
row's tree from its root (the row's last token), depth left to right and a depth's nodes best first top to bottom,
every node a box labelled with its token, an edge to its parent, coloured with the same kinds (accepted: on the
accepted path, which is also drawn with thick edges; rejected: verified, not accepted; not-selected: drafted, not
verified), and the target's token after the path named on the right. Chains keep the grid.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
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
    FINISHED: ("url(#finished-hatch)", "#cfcfcf", "#bdbdbd", "request finished"),
}
# The finished cells' fill: grey diagonal stripes (a swatch's CSS background, an SVG pattern on the board), so that
# they are not mistaken for the white "not drafted" cells
FINISHED_SWATCH = "repeating-linear-gradient(45deg, #d5d5d5 0 2px, #ffffff 2px 5px)"
HATCH_DEFS = ('<defs><pattern id="finished-hatch" width="5" height="5" patternUnits="userSpaceOnUse" '
              'patternTransform="rotate(45)"><rect width="5" height="5" fill="#ffffff"/>'
              '<rect width="2" height="5" fill="#d5d5d5"/></pattern></defs>')
# What the board's terms mean, said where they appear (a tooltip on the term, and the board's legend line)
TERMS = {
    "K": "K = k + e: tokens each row drafts per step (k, the draft window, plus e extra for TETRIS to choose from)",
    "C": "budget C: draft tokens the target verifies per step across the whole batch (default k x active rows)",
    "VSR": "VSR, verification success rate: accepted / verified draft tokens",
    "acceptance": "acceptance: accepted / drafted draft tokens, how often a drafted token was the target's own",
    "ratio": "x plain: this run's tokens/s over plain generate()'s on the same prompts",
    "step": "step: one target forward, which verifies the drafts and adds one token of its own per row; the first "
            "step reads the prompts and drafts nothing",
}


def term(text: str, name: str) -> str:
    """``text`` with :data:`TERMS`' definition of ``name`` as its tooltip (``class="term"``)."""
    return f'<span class="term" title="{html.escape(TERMS[name])}">{text}</span>'


def terms_legend(names=("K", "C", "VSR")) -> str:
    """One line defining the terms ``names`` (``class="terms"``)."""
    return '<div class="terms">' + " · ".join(html.escape(TERMS[name]) for name in names) + "</div>"


@dataclass
class RowTree:
    """One row's draft tree at one step, as plain data (it pickles without the strategy's module).

    ``root``: the row's last token (the tree's root, not a node). Per node, in the strategy's order (depth by depth,
    best first within a depth, so a parent comes before its children): ``tokens``; ``parents`` (the parent's index,
    -1 for the root's children); ``scores``: the path score TETRIS ranks nodes by, ``exp`` of the cumulative log
    score (greedy: the product of the draft's probabilities along the path); ``kinds``: :data:`ACCEPTED` (on the
    accepted path), :data:`REJECTED` (verified, not accepted) or :data:`NOT_SELECTED`. ``next_token``: the target's
    token after the accepted path (a correction, or a bonus token after a leaf).
    """

    root: int = 0
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    next_token: int | None = None

    @property
    def depths(self) -> list[int]:
        """Each node's depth (1 for the root's children)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    @property
    def path(self) -> list[int]:
        """The accepted path's nodes, from depth 1 down."""
        return [node for node, kind in enumerate(self.kinds) if kind == ACCEPTED]

    @property
    def verified(self) -> int:
        return sum(kind in (ACCEPTED, REJECTED) for kind in self.kinds)


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
    ``trees_per_step[s][row]``: with draft trees (``tree_width > 1``), the row's :class:`RowTree` (``None`` for a
    finished row); a step whose entry is ``None``, or past the list, is drawn as chains. ``step_numbers[s]``: the
    run's own number of the board's step ``s`` (1-based, counting the prompt's step and plain steps, as the run's
    metrics do) and ``total_steps`` the run's steps in all (empty / 0: the board's own numbering and count).
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
    tree_width: int = 1
    trees_per_step: list[list[RowTree | None] | None] = field(default_factory=list)
    step_numbers: list[int] = field(default_factory=list)
    total_steps: int = 0

    @classmethod
    def from_stats(cls, strategy: str, num_assistant_tokens: int, stats, survival=None, drafted=None,
                   draft: str = MODEL_DRAFT, trees=None, tree_width: int = 1) -> "BoardTrace":
        """A snapshot (copied lists) of the drafting steps of a ``TetrisStats``-like object, with optional per-step
        survival scores, per-step, per-row drafted cells and per-step trees (all indexed like the stats' steps).
        Steps that drafted nothing (the first, which reads the prompt, and ``adaptive``'s plain steps) have no cells
        and are left out."""
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
            tree_width=tree_width,
            trees_per_step=[trees[s] for s in steps if s < len(trees)] if trees is not None else [],
            step_numbers=[s + 1 for s in steps],
            total_steps=len(stats.verified_per_step),
        )

    def trees(self, step: int) -> list[RowTree | None] | None:
        """Step ``step``'s (0-based) trees by row, ``None`` when it drafted chains."""
        return self.trees_per_step[step] if step < len(self.trees_per_step) else None

    @property
    def steps(self) -> int:
        """The board's steps: those that drafted."""
        return len(self.verified_per_step)

    @property
    def all_steps(self) -> int:
        """The run's steps in all (the prompt's and plain steps too): what its metrics count."""
        return self.total_steps or self.steps

    def step_number(self, index: int) -> int:
        """The run's own number (1-based) of the board's step ``index`` (0-based)."""
        return self.step_numbers[index] if index < len(self.step_numbers) else index + 1

    def heading_steps(self, index: int) -> str:
        """``step 5 of 38 (drafting step 4 of 37)``: the run's own step number and count, as its metrics say, and
        the board's."""
        number = self.step_number(index)
        text = term(f"step {number} of {self.all_steps}", "step")
        if self.all_steps != self.steps or number != index + 1:
            text += f" (drafting step {index + 1} of {self.steps})"
        return text


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


def render_board(trace: BoardTrace | None, step: int, token_text: Callable[[list[int]], list[str]] | None = None
                 ) -> str:
    """HTML of step ``step`` (1-based, clamped) of ``trace``: a heading with the step's counts, the grid as SVG with
    the budget line, and a legend; for a step with draft trees, each row's tree (:func:`render_trees`, its tokens
    written by ``token_text``: ids -> texts, default ``#id``). ``None`` or an empty trace gives a placeholder."""
    if trace is None or trace.steps == 0:
        return '<div class="tetris-board empty">The board appears here once a speculative run has taken a step.</div>'
    index = min(max(int(step), 1), trace.steps) - 1
    trees = trace.trees(index)
    if trees is not None and any(tree is not None for tree in trees):
        return render_trees(trace, index, trees, token_text)
    drafted = trace.drafted_per_step[index] if index < len(trace.drafted_per_step) else None
    cells = board_cells(trace, index, drafted)
    summary = step_summary(trace, index, drafted)
    survival = trace.survival_per_step[index] if index < len(trace.survival_per_step) else None
    num_rows, num_drafted = len(cells), summary["num_drafted"]
    columns = max(num_drafted, 1)
    width = LABEL_WIDTH + columns * PITCH + NOTE_WIDTH
    height = HEADER + num_rows * PITCH + FOOTER

    parts = [""]  # the <svg> tag, once its width is known (the budget label may widen it)
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
        label = f'budget C = {summary["budget"]} ({_fmt(per_row)} per row)'
        start, width = budget_label_place(x, label, width)
        parts.append(f'<text class="budget-label" x="{start:.1f}" y="{bottom + 15}" font-size="11" fill="#1a237e">'
                     f'{label}<title>{html.escape(TERMS["C"])}</title></text>')
    parts[0] = (f'<svg class="board-grid" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                f'viewBox="0 0 {width} {height}" font-family="sans-serif">{HATCH_DEFS}')
    parts.append("</svg>")

    vsr = summary["accepted"] / summary["verified"] if summary["verified"] else math.nan
    lookup = trace.draft == LOOKUP
    drafted_cells = (f'{term(f"K = {num_drafted}", "K")} per row at most, {summary["drafted"]} drafted' if lookup
                     else f'{term(f"K = {num_drafted}", "K")} drafted per row')
    heading = (
        f'<div class="board-heading"><b>{html.escape(trace.strategy)}</b>{" (prompt lookup)" if lookup else ""} · '
        f'{trace.heading_steps(index)} · {drafted_cells} · '
        f'<b class="board-budget">{term("C = " + str(summary["budget"]), "C")}</b> · '
        f'verified {summary["verified"]} · accepted {summary["accepted"]}'
        + (f" ({term(f'VSR {vsr:.2f}', 'VSR')})" if not math.isnan(vsr) else "")
        + f' · {summary["active_rows"]} active rows</div>'
    )
    legend = "".join(_swatch(kind) for kind in CELL_STYLE if kind != NOT_DRAFTED or lookup)
    legend += ('<span class="legend-item"><span class="swatch budget"></span>budget line: C cells lie to its left'
               "</span>")
    note = NOTES[trace.draft] + "Every active row also gets one token from the target each step."
    return (f'<div class="tetris-board" {_step_data(trace, index)}>{heading}'
            f'<div class="board-scroll">{"".join(parts)}</div><div class="board-legend">{legend}</div>'
            f'{terms_legend()}<div class="board-note">{note}</div></div>')


def _step_data(trace: BoardTrace, index: int) -> str:
    """The board's data attributes: its step and steps (``data-step``, ``data-steps``: drafting steps), and the
    run's own step number and count (``data-run-step``, ``data-total-steps``: as the run's metrics count)."""
    return (f'data-step="{index + 1}" data-steps="{trace.steps}" data-run-step="{trace.step_number(index)}" '
            f'data-total-steps="{trace.all_steps}"')


def _swatch(kind: str) -> str:
    """A legend item: the kind's swatch (its fill, border style and colour) and label."""
    fill, stroke, _, label = CELL_STYLE[kind]
    border = {NOT_SELECTED: "dashed", NOT_DRAFTED: "dotted"}.get(kind, "solid")
    background = FINISHED_SWATCH if kind == FINISHED else fill
    return (f'<span class="legend-item"><span class="swatch {kind}" style="background:{background};border:1px '
            f'{border} {stroke}"></span>{label}</span>')


CHAR_WIDTH = 7.0  # an 11px sans-serif character at its widest on average (DejaVu Sans: about 6.9)


def budget_label_place(x: float, label: str, width: int) -> tuple[float, int]:
    """Where the budget label starts (centred under the line at ``x`` where it fits, else against the grid's
    left or right edge) and the SVG's width, widened when the label is wider than the grid."""
    text_width = len(label) * CHAR_WIDTH
    width = max(width, int(math.ceil(text_width + 8)))
    return min(max(x - text_width / 2, 4.0), width - text_width - 4), width


# Trees: a node is a box NODE_WIDTH x NODE_HEIGHT, depths DEPTH_PITCH apart, a depth's nodes SLOT apart
NODE_WIDTH, NODE_HEIGHT, DEPTH_PITCH, SLOT, ROW_GAP = 62, 30, 84, 36, 12
ROOT_STYLE = ("#fff8e1", "#8d6e63", "#4e342e", "root: the row's last token")
EDGE_STYLE = {ACCEPTED: ("#1e6b35", 3.5), REJECTED: ("#c62828", 1.4), NOT_SELECTED: ("#b0bec5", 1.2)}
TREE_NOTE = ("Draft trees: each row's tree grows from its last token (the root, left) to depth K = k + e, the w "
             "best children of each of a depth's w best nodes; a depth's nodes run top to bottom, best first. "
             "Numbers: the node's path score, the product of the draft's probabilities along its path (the score "
             "TETRIS ranks by: it verifies the C best nodes of the batch; fixed-k each row's k best). The target "
             "accepts one path (thick green) and adds its own token after it (right).")


def token_label(text: str, limit: int = 8) -> str:
    """A token's text as a node label: spaces as ``·``, newlines as ``⏎``, at most ``limit`` characters."""
    shown = text.replace(" ", "\u00b7").replace("\n", "\u23ce").replace("\t", "\u21e5") or "\u2205"
    return shown if len(shown) <= limit else shown[: limit - 1] + "\u2026"


def _default_token_text(ids: list[int]) -> list[str]:
    return [f"#{token}" for token in ids]


def _tree_slots(tree: RowTree) -> dict[int, int]:
    """Each node's place within its depth (0: the depth's best)."""
    seen: dict[int, int] = {}
    slots = {}
    for node, depth in enumerate(tree.depths):
        slots[node] = seen.get(depth, 0)
        seen[depth] = slots[node] + 1
    return slots


def _box_svg(css: str, x: float, y: float, style: tuple, label: str, score: float | None, tip: str, data: str,
             dash: str = "", stroke_width: float = 1.0) -> str:
    fill, stroke, ink = style[:3]
    text_y = y + (NODE_HEIGHT / 2 + 4 if score is None else 13)
    parts = [f'<g class="{css}"{data}><title>{html.escape(tip)}</title>',
             f'<rect x="{x}" y="{y}" width="{NODE_WIDTH}" height="{NODE_HEIGHT}" rx="5" fill="{fill}" '
             f'stroke="{stroke}" stroke-width="{stroke_width}"{dash}/>',
             f'<text x="{x + NODE_WIDTH / 2}" y="{text_y}" text-anchor="middle" font-size="11" fill="{ink}">'
             f"{html.escape(label)}</text>"]
    if score is not None:
        parts.append(f'<text x="{x + NODE_WIDTH / 2}" y="{y + 25}" text-anchor="middle" font-size="9" '
                     f'fill="{ink}">{short_probability(score)}</text>')
    parts.append("</g>")
    return "".join(parts)


def render_trees(trace: BoardTrace, index: int, trees: list[RowTree | None],
                 token_text: Callable[[list[int]], list[str]] | None = None) -> str:
    """HTML of step ``index`` (0-based) of a run with draft trees: per row its tree as SVG (nodes as boxes labelled
    with their tokens, ``class="tree-node KIND"`` and ``data-node``/``data-parent``/``data-depth``; edges to their
    parents, ``class="tree-edge on-path"`` along the accepted path), the target's token after the path, the step's
    counts and a legend."""
    decode = token_text or _default_token_text
    num_drafted = trace.num_drafted_per_step[index]
    budget = trace.budget_per_step[index]
    active = [tree for tree in trees if tree is not None]
    verified = sum(tree.verified for tree in active)
    accepted = sum(len(tree.path) for tree in active)
    drafted = sum(len(tree.tokens) for tree in active)
    depth_columns = max([num_drafted] + [max(tree.depths, default=0) for tree in active])
    note_x = LABEL_WIDTH + (depth_columns + 1) * DEPTH_PITCH
    width = note_x + 150
    bands = []
    for tree in trees:
        per_depth = 1
        if tree is not None:
            counts: dict[int, int] = {}
            for depth in tree.depths:
                counts[depth] = counts.get(depth, 0) + 1
            per_depth = max(counts.values(), default=1)
        bands.append(per_depth * SLOT)
    height = HEADER + sum(bands) + ROW_GAP * len(bands)

    parts = [f'<svg class="board-trees" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" font-family="sans-serif">']
    parts.append(f'<text x="{LABEL_WIDTH + NODE_WIDTH / 2}" y="{HEADER - 6}" text-anchor="middle" font-size="11" '
                 f'fill="#555">root</text>')
    for depth in range(1, depth_columns + 1):
        parts.append(f'<text x="{LABEL_WIDTH + depth * DEPTH_PITCH + NODE_WIDTH / 2}" y="{HEADER - 6}" '
                     f'text-anchor="middle" font-size="11" fill="#555">depth {depth}</text>')
    top = HEADER
    for row, (tree, band) in enumerate(zip(trees, bands)):
        middle = top + band / 2
        parts.append(f'<text x="4" y="{middle + 4}" font-size="12" fill="#333">req {row + 1}</text>')
        if tree is None:
            parts.append(f'<text x="{LABEL_WIDTH}" y="{middle + 4}" font-size="12" fill="#bdbdbd">request finished'
                         "</text>")
            top += band + ROW_GAP
            continue
        ids = [tree.root, *tree.tokens, *([tree.next_token] if tree.next_token is not None else [])]
        texts = [text or f"#{token}" for token, text in zip(ids, decode(ids))]  # e.g. special tokens decode to ""
        slots = _tree_slots(tree)
        depths = tree.depths

        def place(node: int) -> tuple[float, float]:  # the node's box, top left (node -1: the root)
            if node < 0:
                return LABEL_WIDTH, middle - NODE_HEIGHT / 2
            return LABEL_WIDTH + depths[node] * DEPTH_PITCH, top + slots[node] * SLOT + (SLOT - NODE_HEIGHT) / 2

        for node, (parent, kind) in enumerate(zip(tree.parents, tree.kinds)):  # edges first, under the boxes
            (x0, y0), (x1, y1) = place(parent), place(node)
            colour, stroke_width = EDGE_STYLE[kind]
            on_path = " on-path" if kind == ACCEPTED else ""
            parts.append(f'<line class="tree-edge{on_path}" data-row="{row}" data-node="{node}" '
                         f'x1="{x0 + NODE_WIDTH}" y1="{y0 + NODE_HEIGHT / 2}" x2="{x1}" y2="{y1 + NODE_HEIGHT / 2}" '
                         f'stroke="{colour}" stroke-width="{stroke_width}"/>')
        x, y = place(-1)
        parts.append(_box_svg("tree-root", x, y, ROOT_STYLE, token_label(texts[0]), None,
                              f"request {row + 1}: the row's last token {texts[0]!r} (the root)",
                              f' data-row="{row}"', stroke_width=1.5))
        for node, (parent, kind, score) in enumerate(zip(tree.parents, tree.kinds, tree.scores)):
            x, y = place(node)
            fill, stroke, ink, label = CELL_STYLE[kind]
            dash = ' stroke-dasharray="3 2"' if kind == NOT_SELECTED else ""
            tip = (f"request {row + 1}, depth {depths[node]}: {texts[node + 1]!r}, {label} (path score {score:.2f})")
            data = (f' data-row="{row}" data-node="{node}" data-parent="{parent}" data-depth="{depths[node]}" '
                    f'data-token="{tree.tokens[node]}"')
            parts.append(_box_svg(f"tree-node {kind}", x, y, (fill, stroke, ink), token_label(texts[node + 1]), score,
                                  tip, data, dash, 2.5 if kind == ACCEPTED else 1.0))
        target = ""
        if tree.next_token is not None:
            target = f" \u2192 target adds {html.escape(repr(texts[-1]))}"
        parts.append(f'<text class="tree-note" x="{note_x}" y="{middle + 4}" font-size="12" fill="#333">'
                     f'{len(tree.path)}/{tree.verified} accepted</text>')
        parts.append(f'<text class="target-token" data-row="{row}" x="{note_x}" y="{middle + 18}" font-size="11" '
                     f'fill="#1a237e">{target.strip()}</text>')
        top += band + ROW_GAP
    parts.append("</svg>")

    vsr = accepted / verified if verified else math.nan
    heading = (
        f'<div class="board-heading"><b>{html.escape(trace.strategy)}</b> · {trace.heading_steps(index)} · '
        f"trees of width w = {trace.tree_width}, depth {term(f'K = {num_drafted}', 'K')} · {drafted} nodes drafted · "
        f'<b class="board-budget">{term(f"C = {budget}", "C")}</b> · verified {verified} · accepted {accepted}'
        + (f" ({term(f'VSR {vsr:.2f}', 'VSR')})" if not math.isnan(vsr) else "")
        + f" · {len(active)} active rows</div>"
    )
    legend = "".join(
        f'<span class="legend-item"><span class="swatch" style="background:{fill};border:1px '
        f'{"dashed" if kind == NOT_SELECTED else "solid"} {stroke}"></span>{label}</span>'
        for kind, (fill, stroke, _, label) in CELL_STYLE.items() if kind in EDGE_STYLE
    )
    legend += (f'<span class="legend-item"><span class="swatch" style="background:{ROOT_STYLE[0]};border:1px solid '
               f'{ROOT_STYLE[1]}"></span>{ROOT_STYLE[3]}</span>'
               '<span class="legend-item"><span class="swatch path"></span>accepted path</span>')
    return (f'<div class="tetris-board trees" {_step_data(trace, index)}>{heading}'
            f'<div class="board-scroll">{"".join(parts)}</div><div class="board-legend">{legend}</div>'
            f'{terms_legend()}<div class="board-note">{TREE_NOTE}</div></div>')


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
.tetris-board .swatch.path { width: 22px; height: 0; border-top: 3.5px solid #1e6b35; border-radius: 0; }
.tetris-board .swatch.budget { width: 0; height: 14px; border-left: 2.5px dashed #1a237e; border-radius: 0; }
.tetris-board .board-note { color: #666; font-size: 12px; margin-top: 4px; }
.tetris-board .terms { color: #444; font-size: 12px; margin-top: 4px; }
.term { border-bottom: 1px dotted #888; cursor: help; }
"""
