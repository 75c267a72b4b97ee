"""One request stream for every visitor of the Space: requests from separate browser sessions join the same live batch.

:func:`shared_stream` gives this process's one :class:`SharedStream` for a target/draft pair, made and started on its
first call and the same for every session after. It runs the request stream of the Space's strategy copy
(``init_continuous_batching`` from ``strategy/custom_generate/continuous.py``, imported by
:func:`space_models.strategy_module`): a ``SpeculativeBatchingManager`` on its own thread, TETRIS over whichever rows
are live at each step, a row joining between two steps as soon as a lane is free.

- :meth:`SharedStream.submit`: one visitor's prompt (token ids) as a streaming request; yields a copy of its
  :class:`StreamEntry` as its tokens come (at most every ``every`` seconds, and once at the end). A visitor who goes
  away (the generator is closed) cancels the request, which frees its row.
- :meth:`SharedStream.board`: a :class:`StreamBoard` snapshot, what the page's board draws: the recent requests, which
  of them are in the batch at the last step, their tokens so far, time to first token and tokens/s, and the rows of
  each recent step.

Two threads write: the manager's, whose step callback records who was in each step's batch, and each visitor's, which
records its own request's tokens; one lock guards both. Nothing here imports Gradio or tetris_hf.
"""

from __future__ import annotations

import copy
import html
import itertools
import re
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from space_models import strategy_module

MAX_ROWS = 8  # rows in the shared batch at once; more requests wait for a free row
KEEP_FINISHED = 12  # finished requests the board still shows
KEEP_STEPS = 120  # steps whose row count the board's occupancy strip shows
CANCEL_SECONDS = 30  # how long a visitor who went away waits for the stream to hand back its cancelled request
# The stream's TETRIS settings: draft k + e per row, verify the C = k x live rows best cells of the batch, greedy
STREAM_OPTIONS = {"tetris_strategy": "tetris", "tetris_extra_tokens": 2, "do_sample": False}
WINDOW = 4  # k: num_assistant_tokens with a draft model, prompt_lookup_num_tokens with prompt lookup


@dataclass
class StreamEntry:
    """One request of the shared stream as the page shows it. Times are ``time.perf_counter()`` values.

    ``state``: ``waiting`` (queued, no row yet) | ``decoding`` | ``done`` | ``cancelled`` | ``failed``. ``in_batch``:
    the request held a row at the stream's last step. ``most_rows``: the most rows of any step it was in (2 or more:
    it shared a step with another request). ``tokens``: its generated token ids so far.
    """

    request_id: str
    visitor: str
    prompt: str
    submitted: float
    state: str = "waiting"
    joined: float | None = None
    first_token: float | None = None
    ended: float | None = None
    tokens: list[int] = field(default_factory=list)
    in_batch: bool = False
    most_rows: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.state in ("done", "cancelled", "failed")

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from submitting to the first token (waiting for a row and reading the prompt included)."""
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens over the seconds since the request took its row."""
        if self.joined is None or not self.tokens:
            return 0.0
        seconds = (self.ended if self.ended is not None else time.perf_counter()) - self.joined
        return len(self.tokens) / seconds if seconds > 0 else 0.0


@dataclass
class StreamBoard:
    """A snapshot of the shared stream: ``entries`` (live and waiting requests first, then the latest finished ones,
    each a copy), ``steps`` taken, ``rows_per_step`` (the last :data:`KEEP_STEPS` steps' row counts), ``most_rows``
    (the most rows of any step since the stream started), ``max_rows`` (its lanes), ``served`` (requests done)
    and ``drafting`` (where its drafts come from, in words). Over the same recent steps, those that followed a busy
    step (the time since it was all decoding, no idle wait; ``busy_steps`` of them): ``busy_tokens`` emitted by all rows together in
    ``busy_seconds``, and ``drafted`` / ``accepted`` draft tokens."""

    entries: list[StreamEntry]
    steps: int
    rows_per_step: list[int]
    most_rows: int
    max_rows: int
    served: int
    drafting: str
    busy_steps: int = 0
    busy_tokens: int = 0
    busy_seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0

    @property
    def tokens_per_second(self) -> float:
        """The whole batch's output: all rows' tokens per second of decoding, over the recent steps."""
        return self.busy_tokens / self.busy_seconds if self.busy_seconds > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def in_batch(self) -> list[StreamEntry]:
        return [entry for entry in self.entries if entry.in_batch]


class SharedStream:
    """The Space's shared request stream over ``target`` and ``draft`` (a draft model or an EAGLE head; ``None``:
    prompt lookup). Not started: :meth:`start` (:func:`shared_stream` does)."""

    def __init__(self, target, draft=None, max_rows: int = MAX_ROWS):
        continuous = strategy_module("continuous")
        if draft is not None:
            drafter = {"assistant_model": draft, "num_assistant_tokens": WINDOW}
            kind = "the EAGLE head" if getattr(draft, "feature_kind", None) is not None else "the draft model"
            self.drafting = f"{kind}, k = {WINDOW}, e = {STREAM_OPTIONS['tetris_extra_tokens']}"
        else:
            drafter = {"prompt_lookup_num_tokens": WINDOW}
            self.drafting = f"prompt lookup, k = {WINDOW}, e = {STREAM_OPTIONS['tetris_extra_tokens']}"
        self.max_rows = max_rows
        self.lock = threading.Lock()
        self.entries: dict[str, StreamEntry] = {}  # request id -> entry, oldest first
        self.steps = 0
        self.rows_per_step: deque[int] = deque(maxlen=KEEP_STEPS)
        # per recent step: (seconds since the step before, or None after an idle wait; tokens emitted; drafted;
        # accepted)
        self.step_work: deque[tuple[float | None, int, int, int]] = deque(maxlen=KEEP_STEPS)
        self._last_step: float | None = None  # when the last step ended, while rows were still live after it
        self.most_rows = 0
        self.served = 0
        self._ids = itertools.count(1)
        self.manager = continuous.init_continuous_batching(target, max_batch_size=max_rows,
                                                           tetris_step_callback=self._on_step, **drafter,
                                                           **STREAM_OPTIONS)

    def start(self) -> None:
        self.manager.start()

    def stop(self) -> None:
        self.manager.stop(block=True, timeout=60)

    @property
    def running(self) -> bool:
        return self.manager.is_running()

    def _on_step(self, record, loop) -> None:
        """The manager's step callback (its thread): the requests holding a row this step are the stream's live ones
        (rows that stopped this step are handed out after it)."""
        live = [request.request_id for request in self.manager.stream.live.values()]
        now = time.perf_counter()
        emitted, accepted = int(record.emitted.sum()), int(record.num_accepted.sum())
        drafted = int(record.drafted_lengths.sum()) if record.num_drafted > 0 else 0
        with self.lock:
            seconds = None if self._last_step is None else now - self._last_step
            self.step_work.append((seconds, emitted, drafted, accepted))
            self._last_step = now if live else None  # no row live after it: the next step follows an idle wait
            self.steps += 1
            self.rows_per_step.append(len(live))
            self.most_rows = max(self.most_rows, len(live))
            for request_id, entry in self.entries.items():
                entry.in_batch = request_id in live
                if entry.in_batch:
                    entry.most_rows = max(entry.most_rows, len(live))
                    entry.state = "decoding" if entry.state == "waiting" else entry.state

    def submit(self, prompt_ids: list[int], max_new_tokens: int, visitor: str, prompt: str = "",
               every: float = 0.2) -> Iterator[StreamEntry]:
        """Queue ``prompt_ids`` for ``visitor``; yield copies of its entry as its tokens come (at most every
        ``every`` seconds) and when it ends. Closing the generator before the end cancels the request."""
        request_id = f"stream_{next(self._ids)}"
        with self.lock:
            entry = self.entries[request_id] = StreamEntry(request_id, visitor, prompt, time.perf_counter())
            self._forget_old()
        self.manager.add_request(prompt_ids, request_id=request_id, max_new_tokens=max_new_tokens, streaming=True)
        shown = 0.0
        try:
            for output in self.manager.request_id_iter(request_id):
                with self.lock:
                    self._update(entry, output)
                    snapshot = copy.deepcopy(entry)
                if snapshot.finished or time.perf_counter() - shown >= every:
                    shown = time.perf_counter()
                    yield snapshot
                if snapshot.finished:
                    return
            with self.lock:  # the manager stopped before the request ended
                entry.state, entry.error, entry.in_batch = "failed", "the shared stream stopped", False
                entry.ended = time.perf_counter()
                snapshot = copy.deepcopy(entry)
            yield snapshot
        finally:
            if not entry.finished:  # the visitor went away: free the row, and take the cancelled output
                self.manager.cancel_request(request_id)
                output = self.manager.get_result(request_id, timeout=CANCEL_SECONDS)
                with self.lock:
                    if output is not None:
                        self._update(entry, output)
                    else:
                        entry.state, entry.in_batch, entry.ended = "cancelled", False, time.perf_counter()

    def _update(self, entry: StreamEntry, output) -> None:
        """``entry`` from one of its stream outputs (partial or final); the lock is held."""
        entry.tokens = list(output.generated_tokens)
        if output.lifespan[0] > 0:
            entry.joined = output.lifespan[0]
        if output.first_token_time > 0:
            entry.first_token = output.first_token_time
        if entry.state == "waiting" and entry.joined is not None:
            entry.state = "decoding"
        if output.is_finished():
            entry.ended = output.lifespan[1] if output.lifespan[1] > 0 else time.perf_counter()
            entry.in_batch = False
            entry.error = output.error
            entry.state = "done" if output.error is None else "cancelled" if output.error == "cancelled" else "failed"
            self.served += entry.state == "done"

    def _forget_old(self) -> None:
        """Keep the unfinished entries and the :data:`KEEP_FINISHED` latest finished ones; the lock is held."""
        finished = [request_id for request_id, entry in self.entries.items() if entry.finished]
        for request_id in finished[: max(len(finished) - KEEP_FINISHED, 0)]:
            del self.entries[request_id]

    def board(self) -> StreamBoard:
        """A snapshot for the page: unfinished requests (oldest first), then finished ones (latest first)."""
        with self.lock:
            entries = list(self.entries.values())
            ordered = [entry for entry in entries if not entry.finished] + \
                [entry for entry in reversed(entries) if entry.finished]
            busy = [work for work in self.step_work if work[0] is not None]
            return StreamBoard(copy.deepcopy(ordered), self.steps, list(self.rows_per_step), self.most_rows,
                               self.max_rows, self.served, self.drafting,
                               busy_steps=len(busy), busy_tokens=sum(work[1] for work in busy),
                               busy_seconds=sum(work[0] for work in busy),
                               drafted=sum(work[2] for work in self.step_work),
                               accepted=sum(work[3] for work in self.step_work))


_streams: dict[tuple[int, int], SharedStream] = {}
_streams_lock = threading.Lock()


def shared_stream(target, draft=None) -> SharedStream:
    """This process's one :class:`SharedStream` for ``target`` and ``draft``, made and started on the first call
    (from any thread); a stream whose thread has ended is replaced."""
    key = (id(target), id(draft))
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None or not stream.running:
            stream = _streams[key] = SharedStream(target, draft)
            stream.start()
        return stream


# ---------------------------------------------------------------------------------------------------------------
# HTML

STATE_LABELS = {"waiting": "waiting for a row", "decoding": "decoding", "done": "done", "cancelled": "cancelled",
                "failed": "failed"}
STRIP_HEIGHT, BAR_PITCH = 40, 4


FENCE = re.compile(r"```[^\n`]*\n?(.*?)(?:```|\Z)", re.DOTALL)  # a fenced block; unclosed: to the end (streaming)
INLINE_CODE = re.compile(r"`([^`\n]+)`")


def render_text(text: str) -> str:
    """A model's output as HTML, rendered as Markdown where it is code: fenced blocks (an unclosed one, still being
    written, to the end) as ``<pre><code>`` and inline `code` as ``<code>``; everything else escaped as it is."""
    parts, end = [], 0
    for match in FENCE.finditer(text):
        parts.append(_inline(text[end:match.start()]))
        parts.append(f'<pre class="code"><code>{html.escape(match.group(1).rstrip(chr(10)))}</code></pre>')
        end = match.end()
    parts.append(_inline(text[end:]))
    return "".join(parts)


def _inline(text: str) -> str:
    """``text`` escaped, its inline `code` spans as ``<code>``."""
    parts, end = [], 0
    for match in INLINE_CODE.finditer(text):
        parts += [html.escape(text[end:match.start()]), f"<code>{html.escape(match.group(1))}</code>"]
        end = match.end()
    parts.append(html.escape(text[end:]))
    return "".join(parts)


def head_text(text: str, limit: int) -> str:
    """``text``'s start, at most ``limit`` characters, cut between words with an ellipsis when cut."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rstrip().rfind(" ")
    return (cut[:space] if space > limit // 2 else cut).rstrip() + "\u2026"


def tail_text(text: str, limit: int) -> str:
    """``text``'s end, at most ``limit`` characters, cut between words with an ellipsis when cut."""
    if len(text) <= limit:
        return text
    cut = text[len(text) - limit + 1:]
    space = cut.find(" ")
    return "\u2026" + (cut[space + 1:] if 0 <= space < limit // 2 else cut).lstrip()


def entry_numbers(entry: StreamEntry) -> str:
    """``12 tokens · first token after 0.31 s · 85.0 tok/s``."""
    parts = [f"{len(entry.tokens)} tokens"]
    if entry.time_to_first_token is not None:
        parts.append(f"first token after {entry.time_to_first_token:.2f} s")
    if entry.tokens:
        parts.append(f"{entry.tokens_per_second:.1f} tok/s")
    return " · ".join(parts)


def render_output(entry: StreamEntry, decode) -> str:
    """A visitor's own request: its text so far (``decode``: token ids -> text; a cursor while it runs) and its
    numbers."""
    cursor = "" if entry.finished else "▌"
    error = f" ({html.escape(entry.error)})" if entry.error and entry.state == "failed" else ""
    return (f'<div class="stream-output" data-request="{entry.request_id}" data-state="{entry.state}" '
            f'data-tokens="{len(entry.tokens)}" data-most-rows="{entry.most_rows}">'
            f'<div class="stream-text">{render_text(decode(entry.tokens))}{cursor}</div>'
            f'<div class="stream-numbers">{STATE_LABELS[entry.state]}{error} · {entry_numbers(entry)} · '
            f"in a batch of up to {entry.most_rows} rows</div></div>")


STREAM_SPEED_NOTE = (
    "A visitor's tok/s is their own request's tokens over the time it held a row. The batch decodes all its rows at "
    "once, so its output is the sum over the rows: that total is the number to compare with the first tab's tok/s, "
    "which are totals over a whole batch too. Per request, a step gives one token of the target's own plus the "
    "accepted drafts, and a step of a fuller batch takes a little longer.")


def speed_line(board: StreamBoard) -> str:
    """The batch's total tokens/s over its recent steps, the rows it held and its acceptance, in words."""
    if board.busy_seconds <= 0:
        return "The batch's total speed appears once it has taken a few steps."
    rows = sum(board.rows_per_step) / len(board.rows_per_step)
    line = (f"Whole batch: <b>{board.tokens_per_second:.1f} tok/s</b> in all over its last {board.busy_steps} steps "
            f"of decoding, {rows:.1f} rows a step on average (each request's tok/s is its share)")
    if board.drafted:
        line += f"; acceptance {board.acceptance:.2f} of its drafted tokens"
    return line + "."


def _occupancy_svg(board: StreamBoard) -> str:
    """The rows of each recent step as bars (one per step, oldest left), against the stream's lanes."""
    width = max(len(board.rows_per_step), 1) * BAR_PITCH
    bars = "".join(
        f'<rect x="{index * BAR_PITCH}" y="{STRIP_HEIGHT - STRIP_HEIGHT * rows / board.max_rows:.1f}" '
        f'width="{BAR_PITCH - 1}" height="{STRIP_HEIGHT * rows / board.max_rows:.1f}" fill="#2e9d4f"/>'
        for index, rows in enumerate(board.rows_per_step)
    )
    return (f'<svg class="stream-occupancy" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{STRIP_HEIGHT}" '
            f'viewBox="0 0 {width} {STRIP_HEIGHT}"><rect width="{width}" height="{STRIP_HEIGHT}" fill="#f5f5f5"/>'
            f"{bars}<title>rows in the batch at each of the last {len(board.rows_per_step)} steps "
            f"(full height: {board.max_rows})</title></svg>")


def render_stream_board(board: StreamBoard | None, you: str | None = None, decode=None) -> str:
    """The shared batch: a heading (step, rows live now, the most at once, requests served), the rows of the recent
    steps, and one card per request side by side (``class="stream-row"``; ``data-in-batch``: it held a row at the
    last step). ``you``: this visitor's label, its cards marked. ``decode``: token ids -> text (default: counts
    only)."""
    if board is None:
        return '<div class="stream-board empty">The shared stream starts with the first request.</div>'
    live = len(board.in_batch)
    heading = (f'<div class="stream-heading">Step {board.steps} · <b>{live} of {board.max_rows} rows in the batch '
               f"now</b> · the most at once: {board.most_rows} · {board.served} requests served · drafts: "
               f"{html.escape(board.drafting)}</div>")
    cards = []
    for entry in board.entries:
        mine = " yours" if entry.visitor == you else ""
        text = html.escape(tail_text(decode(entry.tokens), 240)) if decode is not None and entry.tokens else ""
        badge = "in the batch" if entry.in_batch else STATE_LABELS[entry.state]
        cards.append(
            f'<div class="stream-row {entry.state}{" in-batch" if entry.in_batch else ""}{mine}" '
            f'data-request="{entry.request_id}" data-visitor="{html.escape(entry.visitor)}" '
            f'data-state="{entry.state}" data-in-batch="{str(entry.in_batch).lower()}" '
            f'data-most-rows="{entry.most_rows}" data-tokens="{len(entry.tokens)}">'
            f'<div class="who"><b>{html.escape(entry.visitor)}</b>{" (you)" if mine else ""} · '
            f'<span class="badge">{badge}</span></div>'
            f'<div class="prompt">{html.escape(head_text(entry.prompt, 120))}</div>'
            f'<div class="text">{text}</div>'
            f'<div class="numbers">{entry_numbers(entry)} · batch of up to {entry.most_rows}</div></div>')
    rows = "".join(cards) or '<div class="stream-none">No requests yet.</div>'
    chart = (f'<div class="stream-chart-label">Rows in the batch at each of its last {len(board.rows_per_step)} '
             f"steps (one bar per step, oldest on the left; full height: {board.max_rows} rows)</div>")
    return (f'<div class="stream-board" data-steps="{board.steps}" data-live-rows="{live}" '
            f'data-most-rows="{board.most_rows}" data-served="{board.served}" '
            f'data-batch-tps="{board.tokens_per_second:.2f}">{heading}'
            f'<div class="stream-speed">{speed_line(board)}</div>{chart}{_occupancy_svg(board)}'
            f'<div class="stream-rows">{rows}</div><div class="stream-note">{STREAM_SPEED_NOTE}</div></div>')


STREAM_CSS = """
.stream-board .stream-heading { margin: 4px 0 6px 0; font-size: 14px; }
.stream-board .stream-rows { display: flex; flex-wrap: wrap; gap: 10px; margin-top: 8px; }
.stream-board .stream-row { width: 230px; border: 1px solid #cfd8dc; border-radius: 6px; padding: 6px 8px;
    font-size: 12px; background: #fafafa; }
.stream-board .stream-row.in-batch { border: 2px solid #2e9d4f; background: #f1f8f2; }
.stream-board .stream-row.yours .who { color: #1a237e; }
.stream-board .stream-row .badge { color: #555; }
.stream-board .stream-row.in-batch .badge { color: #1e6b35; font-weight: bold; }
.stream-board .stream-row .prompt { color: #666; font-style: italic; margin: 3px 0; }
.stream-board .stream-row .text { white-space: pre-wrap; min-height: 2.5em; }
.stream-board .stream-row .numbers { color: #333; margin-top: 3px; }
.stream-output .stream-text { white-space: pre-wrap; font-size: 14px; }
.stream-board .stream-speed { font-size: 14px; margin: 4px 0; }
.stream-board .stream-chart-label { color: #555; font-size: 12px; margin: 6px 0 2px 0; }
.stream-board .stream-note { color: #666; font-size: 12px; margin-top: 8px; }
pre.code { white-space: pre-wrap; overflow-wrap: anywhere; background: #f6f8fa; border: 1px solid #e1e4e8; border-radius: 4px; padding: 6px 8px;
    margin: 4px 0; font-size: 12px; overflow-x: auto; }
pre.code code, .run-outputs code, .stream-text code { font-family: "DejaVu Sans Mono", monospace; }
.stream-output .stream-numbers { color: #555; font-size: 13px; margin-top: 4px; }
"""
