"""The four runs the Space compares, one function each, written so a UI thread can watch them grow.

- :func:`run_plain`: plain batched ``generate()``; a :class:`BatchStreamer` collects every row's tokens as they come.
- :func:`run_speculative`: batched speculative decoding (``tetris_strategy="fixed"``, ``"tetris"`` or
  ``"adaptive"``) through the strategy's Hub folder (:data:`STRATEGY_SOURCE`: the copy in ``strategy/`` next to this
  file, or the Hub id in ``$TETRIS_SPACE_STRATEGY``), loaded by transformers as ``custom_generate=...,
  trust_remote_code=True``; ``tetris_step_callback`` copies every row's tokens and the step's board cells after
  each step. The drafts come from the draft model (``assistant_model``) or, with ``Settings(draft=LOOKUP)``, from
  each row's own prompt and output (``prompt_lookup_num_tokens=k``, no draft model). With
  ``Settings(tree_width=w > 1)`` the draft model grows trees (``tetris_tree_width=w``) and :func:`step_trees`
  keeps each step's trees (the step record's ``tree``) for the board.
- :func:`run_all`: the four in turn on one worker thread (one at a time, so each gets the whole CPU/GPU and its
  tokens/s is its own); :func:`stream_runs` runs them and yields copies of their progress, which is what the page
  calls (through ZeroGPU's decorator on a ZeroGPU Space, where it runs in another process).

Every run writes into a :class:`LiveRun` that the UI thread reads; nothing here imports Gradio or tetris_hf. A set
``stop`` event cancels the run in progress at its next token or step (:class:`RunCancelled`) and the runs after it
never start.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.generation.streamers import BaseStreamer

from tetris_board import ACCEPTED, LOOKUP, MODEL_DRAFT, NOT_SELECTED, REJECTED, BoardTrace, RowTree

PLAIN, FIXED, TETRIS, ADAPTIVE = "generate", "fixed", "tetris", "adaptive"
STRATEGIES = (PLAIN, FIXED, TETRIS, ADAPTIVE)
SPECULATIVE = (FIXED, TETRIS, ADAPTIVE)
TITLES = {PLAIN: "plain generate()", FIXED: "fixed-k speculative", TETRIS: "TETRIS", ADAPTIVE: "adaptive"}
# Where the drafts come from: the draft model, or prompt lookup (each row copies from its own prompt and output)
DRAFTS = {MODEL_DRAFT: "the draft model", LOOKUP: "prompt lookup"}
# The strategy: this Space's copy of the Hub folder, or a Hub repository id given in the Space's variables.
STRATEGY_SOURCE = os.environ.get("TETRIS_SPACE_STRATEGY") or str(Path(__file__).resolve().parent / "strategy")
MAX_TREE_WIDTH = 4


class RunCancelled(Exception):
    """Raised inside generation when the user pressed Stop."""


@dataclass(frozen=True)
class Settings:
    """The controls: ``draft`` (:data:`MODEL_DRAFT` or :data:`LOOKUP`), ``k`` draft window, ``extra`` TETRIS's
    extra proposals ``e``, ``budget`` ``C`` (0: ``k`` x active rows), ``temperature`` (0: greedy),
    ``max_new_tokens``, ``seed`` (sampling), ``tree_width`` ``w`` (1: chains; 2 to :data:`MAX_TREE_WIDTH`: draft
    trees of ``w`` children per expanded node; ignored with prompt lookup, which drafts chains only)."""

    draft: str = MODEL_DRAFT
    k: int = 4
    extra: int = 2
    budget: int = 0
    temperature: float = 0.0
    max_new_tokens: int = 48
    seed: int = 0
    tree_width: int = 1

    def __post_init__(self):
        if self.draft not in DRAFTS:
            raise ValueError(f"draft must be one of {tuple(DRAFTS)}, got {self.draft!r}")
        if isinstance(self.tree_width, bool) or not isinstance(self.tree_width, int) \
                or not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise ValueError(f"tree_width must be an int from 1 (chains) to {MAX_TREE_WIDTH}, got {self.tree_width!r}")

    @property
    def trees(self) -> bool:
        """The speculative runs draft trees: a width above 1 and a draft model (prompt lookup drafts chains)."""
        return self.tree_width > 1 and not self.lookup

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def lookup(self) -> bool:
        return self.draft == LOOKUP

    def sampling_kwargs(self) -> dict:
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": float(self.temperature), "top_k": None, "top_p": None}

    def speculative_kwargs(self, strategy: str) -> dict:
        """The strategy's ``generate()`` options for ``strategy`` (``"fixed"``, ``"tetris"`` or ``"adaptive"``).

        ``adaptive`` drafts up to ``k + e`` per row and picks ``C`` each step, with the budget as its cap. With prompt
        lookup, ``k`` is ``prompt_lookup_num_tokens`` (the strategy's window; ``generate()`` gets no draft model).
        With trees, ``tetris_tree_width``."""
        window = "prompt_lookup_num_tokens" if self.lookup else "num_assistant_tokens"
        options = {"tetris_strategy": strategy, window: self.k}
        if self.trees:
            options["tetris_tree_width"] = self.tree_width
        if strategy in (TETRIS, ADAPTIVE):
            options["tetris_extra_tokens"] = self.extra
            if self.budget > 0:
                options["tetris_budget"] = self.budget
        return options


@dataclass
class RunStats:
    """A copy of the fields of the strategy's ``TetrisStats`` that the page shows (totals and the board's per-step
    lists). Plain data, so it pickles without the strategy's module: on ZeroGPU the runs happen in another process."""

    steps: int = 0
    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    draft_seconds: float = 0.0
    num_drafted_per_step: list[int] = field(default_factory=list)
    budget_per_step: list[int] = field(default_factory=list)
    verified_per_step: list[list[int]] = field(default_factory=list)
    accepted_per_step: list[list[int]] = field(default_factory=list)

    @classmethod
    def copy_of(cls, stats) -> "RunStats":
        return cls(**{f.name: copy.deepcopy(getattr(stats, f.name)) for f in dataclasses.fields(cls)})

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted draft tokens."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def verification_success_rate(self) -> float:
        """VSR: accepted / verified draft tokens."""
        return self.accepted_tokens / self.verified_tokens if self.verified_tokens else 0.0

    @property
    def drafting_steps(self) -> int:
        """Steps that drafted (not the prompt's step, nor adaptive's plain steps)."""
        return sum(count > 0 for count in self.num_drafted_per_step)

    @property
    def first_guess_rate(self) -> float:
        """How often a row's first drafted token was right: of the rows whose first draft the target verified (at
        the steps that drafted), the share that accepted it."""
        rows = [(verified, accepted) for drafted, verified_row, accepted_row in
                zip(self.num_drafted_per_step, self.verified_per_step, self.accepted_per_step) if drafted > 0
                for verified, accepted in zip(verified_row, accepted_row) if verified > 0]
        return sum(accepted > 0 for _, accepted in rows) / len(rows) if rows else 0.0

    @property
    def row_steps(self) -> int:
        """Steps summed over the rows active at each (a finished row takes no more steps)."""
        return sum(sum(verified >= 0 for verified in step) for step in self.verified_per_step)


@dataclass
class LiveRun:
    """One strategy's run as the UI sees it; written by the worker thread, read by the UI thread.

    ``state``: ``waiting`` | ``running`` | ``done`` | ``cancelled`` | ``error``. ``rows[i]``: request ``i``'s
    generated tokens so far. ``steps``: plain ``generate()``'s forwards so far (the first reads the prompt), counted
    as the speculative runs' ``stats.steps`` are. ``stats``: a :class:`RunStats` copy of the loop's statistics (speculative runs).
    ``survival``: per step, each row's cumulative confidence at each cell it drafted (``None`` for finished rows):
    the draft model's cumulative probability, or with prompt lookup the product of the online acceptance estimates;
    a row that drafted fewer cells than the step's ``K`` (a lookup row without a match drafts none) has fewer
    scores. ``drafted``: per step, the cells each row drafted (``None`` for finished rows). ``draft``:
    :data:`MODEL_DRAFT` or :data:`LOOKUP`. ``device``: what the run ran on, in words. ``tree_width``: the run's
    ``tetris_tree_width`` (1: chains); ``trees``: per step, each row's :class:`~tetris_board.RowTree` (``None`` for
    finished rows), or ``None`` for a step without trees (chains, the prompt step, a plain step).
    """

    strategy: str
    draft: str = MODEL_DRAFT
    state: str = "waiting"
    rows: list[list[int]] = field(default_factory=list)
    started: float | None = None
    ended: float | None = None
    stats: RunStats | None = None
    survival: list = field(default_factory=list)
    drafted: list = field(default_factory=list)
    message: str = ""
    device: str = ""
    tree_width: int = 1
    trees: list = field(default_factory=list)
    steps: int = 0

    @property
    def tokens(self) -> int:
        return sum(len(row) for row in self.rows)

    @property
    def seconds(self) -> float:
        if self.started is None:
            return 0.0
        return (self.ended if self.ended is not None else time.perf_counter()) - self.started

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def snapshot(self) -> "LiveRun":
        """A copy that later progress of the run does not change (times frozen at this moment if still running)."""
        ended = self.ended if self.ended is not None or self.started is None else time.perf_counter()
        return dataclasses.replace(self, rows=[list(row) for row in self.rows], ended=ended,
                                   stats=copy.deepcopy(self.stats), survival=list(self.survival),
                                   drafted=list(self.drafted), trees=list(self.trees))

    @property
    def all_steps(self) -> int:
        """Target forwards so far: ``stats.steps`` of a speculative run, :attr:`steps` of plain generate()."""
        return self.stats.steps if self.stats is not None else self.steps

    @property
    def step_seconds(self) -> float:
        """Seconds per target forward (drafting included), or 0 before the first."""
        return self.seconds / self.all_steps if self.all_steps else 0.0

    def board(self, num_assistant_tokens: int) -> BoardTrace | None:
        """A snapshot of this run's board so far (``None`` for plain generate or before the first step)."""
        if self.stats is None:
            return None
        return BoardTrace.from_stats(TITLES[self.strategy], num_assistant_tokens, self.stats, self.survival,
                                     self.drafted, draft=self.draft, trees=self.trees if self.tree_width > 1 else None,
                                     tree_width=self.tree_width)


class BatchStreamer(BaseStreamer):
    """Collects a batched plain ``generate()``'s new tokens per row.

    ``generate()`` calls ``put`` with the ``(B, T)`` prompt first, then with ``(B,)`` (or ``(B, 1)``) tokens each
    step. A row stops collecting after its first EOS (later tokens are padding). Raises :class:`RunCancelled` from
    ``put`` once ``stop`` is set, which ends ``generate()``.
    """

    def __init__(self, live: LiveRun, batch_size: int, eos_token_ids: set[int], stop: threading.Event):
        self.live, self.eos_token_ids, self.stop = live, eos_token_ids, stop
        self.rows: list[list[int]] = [[] for _ in range(batch_size)]
        self.finished = [False] * batch_size
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.stop.is_set():
            raise RunCancelled
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.live.steps += 1
        for row, token in enumerate(value.reshape(len(self.rows), -1)[:, -1].tolist()):
            if not self.finished[row]:
                self.rows[row].append(token)
                self.finished[row] = token in self.eos_token_ids
        self.live.rows = [list(row) for row in self.rows]

    def end(self) -> None:
        pass


def eos_token_ids(model) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        return set()
    return set(eos) if isinstance(eos, (list, tuple)) else {int(eos)}


def device_name(device: torch.device | str) -> str:
    """The device in words: ``NVIDIA H200 (cuda:0)``, ``CPU (2 threads)``."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} ({device})"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return f"CPU ({threads} thread{'s' if threads != 1 else ''})"
    return str(device)


def encode_prompts(tokenizer, prompts: list[str], device) -> dict:
    """Each prompt as a one-turn chat through the tokenizer's chat template (the prompt itself without one),
    left-padded into one batch. The rendered chat already holds the template's special tokens."""
    if getattr(tokenizer, "chat_template", None) is not None:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                               add_generation_prompt=True) for text in prompts]
    else:
        texts = list(prompts)
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return {key: batch[key].to(device) for key in ("input_ids", "attention_mask")}


def generated_tokens(sequences: torch.Tensor, prompt_width: int, eos_token_ids: set[int]) -> list[list[int]]:
    """Each row's new tokens, up to and including its first EOS (what follows is padding)."""
    rows = []
    for row in sequences[:, prompt_width:].tolist():
        ends = [index for index, token in enumerate(row) if token in eos_token_ids]
        rows.append(row[: ends[0] + 1] if ends else row)
    return rows


def _common_kwargs(tokenizer, settings: Settings) -> dict:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return {"max_new_tokens": settings.max_new_tokens, "pad_token_id": pad, **settings.sampling_kwargs()}


def run_plain(target, tokenizer, batch: dict, settings: Settings, live: LiveRun, stop: threading.Event) -> None:
    """Plain batched ``generate()``, streamed into ``live`` token by token."""
    eos = eos_token_ids(target)
    streamer = BatchStreamer(live, batch["input_ids"].shape[0], eos, stop)
    torch.manual_seed(settings.seed)
    live.state, live.started = "running", time.perf_counter()
    sequences = target.generate(**batch, **_common_kwargs(tokenizer, settings), streamer=streamer)
    live.ended = time.perf_counter()
    live.rows = generated_tokens(sequences, batch["input_ids"].shape[1], eos)


def step_cells(record, batch_size: int) -> tuple[list[list[float] | None], list[int | None]]:
    """What the board needs of one step record, per original row (``None`` for rows no longer active):

    - the cumulative confidence of each cell the row drafted (``exp`` of the running sum of ``token_log_probs``),
      cut at the cells it drafted (no scores where the record has no confidences);
    - the cells it drafted: ``K`` with a draft model; with prompt lookup fewer where the match was short, and none
      where nothing matched (its confidences are ``-inf``).
    """
    rows = record.rows.tolist()
    lengths = getattr(record, "drafted_lengths", None)  # the strategy's per-row counts (older exports: all K)
    lengths = lengths.tolist() if lengths is not None else [record.num_drafted] * len(rows)
    if record.token_log_probs is None:
        scores = [[] for _ in rows]
    else:
        scores = record.token_log_probs.float().cumsum(dim=-1).exp().tolist()
    survival: list[list[float] | None] = [None] * batch_size
    drafted: list[int | None] = [None] * batch_size
    for row, row_scores, count in zip(rows, scores, lengths):
        survival[row], drafted[row] = [round(score, 4) for score in row_scores[:count]], count
    return survival, drafted


def row_trees(tokens: torch.Tensor, parents: torch.Tensor, log_scores: torch.Tensor, valid: torch.Tensor,
              selected: torch.Tensor, path_nodes: torch.Tensor, num_accepted: torch.Tensor, roots: torch.Tensor,
              next_tokens: torch.Tensor) -> list[RowTree]:
    """One tree step as plain data, a :class:`~tetris_board.RowTree` per active row.

    Args (the strategy's tensors, one row per active row): ``tokens``, ``parents``, ``log_scores``, ``valid``
    ``(B, N)``: the drafted tree (``parents`` -1 for the root's children; ``log_scores`` each node's path score);
    ``selected`` ``(B, N)`` bool: the nodes the target verified; ``path_nodes`` ``(B, D)``: the accepted path's
    nodes from depth 1 down (-1 after it); ``num_accepted`` ``(B,)``; ``roots`` ``(B,)``: each row's last token (the
    tree's root); ``next_tokens`` ``(B,)``: the target's token after the accepted path.

    Invalid nodes (nothing drafted there, or deeper than the row may grow) are left out and the rest renumbered;
    every kept node's parent is kept too (a node's parent has a smaller index). E.g. valid ``[T, F, T]`` with parents
    ``[-1, -1, 0]``: nodes ``[0, 2]`` become ``[0, 1]`` with parents ``[-1, 0]``.
    """
    rows = []
    host = [t.tolist() for t in (tokens, parents, log_scores.float().exp(), valid, selected, path_nodes, num_accepted,
                                 roots, next_tokens)]
    for row_tokens, row_parents, row_scores, row_valid, row_selected, row_path, accepted, root, next_token in \
            zip(*host):
        path = set(row_path[:accepted])
        kept: dict[int, int] = {}  # old node index -> new
        tree = RowTree(root=root, next_token=next_token)
        for node, (token, parent, score, is_valid, is_selected) in enumerate(
                zip(row_tokens, row_parents, row_scores, row_valid, row_selected)):
            if not is_valid or (parent >= 0 and parent not in kept):
                continue
            kept[node] = len(tree.tokens)
            tree.tokens.append(token)
            tree.parents.append(kept[parent] if parent >= 0 else -1)
            tree.scores.append(round(score, 4))
            tree.kinds.append(ACCEPTED if node in path else REJECTED if is_selected else NOT_SELECTED)
        rows.append(tree)
    return rows


def step_trees(record, batch_size: int) -> list[RowTree | None] | None:
    """The trees of the step ``record`` reports (``record.tree``: the drafted tree, the selection and the accepted
    paths, filled by the strategy's tree step), by original row (``None`` for rows no longer active); ``None`` when
    the step grew no tree (the prompt step, a plain step)."""
    step = getattr(record, "tree", None)
    if step is None:
        return None
    tree = step.tree
    trees = row_trees(tree.tokens, tree.parents, tree.log_scores, tree.valid, step.selected, step.path_nodes,
                      step.num_accepted, step.roots, step.next_tokens)
    by_row: list[RowTree | None] = [None] * batch_size
    for row, row_tree in zip(record.rows.tolist(), trees):
        by_row[row] = row_tree
    return by_row


def run_speculative(target, draft, tokenizer, batch: dict, settings: Settings, strategy: str, live: LiveRun,
                    stop: threading.Event, strategy_source: str = STRATEGY_SOURCE) -> None:
    """Batched speculative decoding with ``tetris_strategy=strategy``, streamed into ``live`` step by step; the
    drafts from ``draft`` (the draft model), or with ``settings.draft == LOOKUP`` by prompt lookup (``draft`` unused,
    may be ``None``).

    ``strategy_source``: the Hub folder (local path or repository id) transformers loads the strategy from. With
    ``settings.trees`` the draft model grows trees (``tetris_tree_width``), kept per step in ``live.trees``."""
    eos = eos_token_ids(target)
    width = batch["input_ids"].shape[1]
    live.draft = settings.draft
    live.tree_width = settings.tree_width if settings.trees else 1

    def on_step(record, loop) -> None:
        survival, drafted = step_cells(record, loop.batch_size)
        live.survival.append(survival)
        live.drafted.append(drafted)
        if settings.trees:
            live.trees.append(step_trees(record, loop.batch_size))
        live.stats = RunStats.copy_of(loop.stats)
        live.rows = [tokens[width:] for tokens in loop.partial_outputs()]
        if stop.is_set():
            raise RunCancelled

    torch.manual_seed(settings.seed)
    live.state, live.started = "running", time.perf_counter()
    drafter = {} if settings.lookup else {"assistant_model": draft}
    result = target.generate(
        **batch, **_common_kwargs(tokenizer, settings), **drafter, custom_generate=strategy_source,
        trust_remote_code=True, return_dict_in_generate=True, tetris_step_callback=on_step,
        **settings.speculative_kwargs(strategy),
    )
    live.ended = time.perf_counter()
    live.stats = RunStats.copy_of(result.tetris_stats)
    live.rows = generated_tokens(result.sequences, width, eos)


_warm: set[int] = set()


def warm_up(target, draft, batch: dict) -> None:
    """One short forward of each model, once per model, so the first timed run does not pay one-time start-up.
    ``draft`` ``None``: the target only (prompt lookup)."""
    for model in (target, draft):
        if model is not None and id(model) not in _warm:
            input_ids = batch["input_ids"][:, -2:]
            extra = {}
            if getattr(model, "feature_kind", None) is not None:  # an EAGLE head reads features too: its own, zeros
                extra["draft_features"] = torch.zeros(*input_ids.shape, model.config.hidden_size, dtype=model.dtype,
                                                      device=input_ids.device)
            with torch.inference_mode():
                model(input_ids=input_ids, attention_mask=batch["attention_mask"][:, -2:], **extra)
            _warm.add(id(model))


def run_all(target, draft, tokenizer, prompts: list[str], settings: Settings, runs: dict[str, LiveRun],
            stop: threading.Event, strategy_source: str = STRATEGY_SOURCE) -> None:
    """Plain, fixed-k, TETRIS and adaptive in turn on the same batch; each outcome lands in its ``LiveRun``'s state.
    The speculative runs draft with ``draft``, or by prompt lookup when ``settings.draft == LOOKUP``.

    A cancelled run keeps what it had produced; the runs after it stay ``waiting``. An error in one run is recorded
    in its ``message`` and the next run still starts.
    """
    batch = encode_prompts(tokenizer, prompts, target.device)
    warm_up(target, None if settings.lookup else draft, batch)
    for strategy in STRATEGIES:
        live = runs[strategy]
        live.device = device_name(target.device)
        if stop.is_set():  # stopped between two runs: this one is cancelled before it starts
            live.started = live.ended = time.perf_counter()
            live.state = "cancelled"
            break
        try:
            with torch.inference_mode():
                if strategy == PLAIN:
                    run_plain(target, tokenizer, batch, settings, live, stop)
                else:
                    run_speculative(target, draft, tokenizer, batch, settings, strategy, live, stop,
                                    strategy_source)
            live.state = "done"
        except RunCancelled:
            live.ended, live.state = time.perf_counter(), "cancelled"
            break
        except Exception as error:  # shown in the UI; the next strategy still runs
            live.ended, live.state, live.message = time.perf_counter(), "error", f"{type(error).__name__}: {error}"


def stream_runs(target, draft, tokenizer, prompts: list[str], settings: Settings, stop: threading.Event,
                strategy_source: str = STRATEGY_SOURCE, every: float = 0.3) -> Iterator[dict[str, LiveRun]]:
    """:func:`run_all` on a worker thread; yields snapshots of the four runs every ``every`` seconds and once at
    the end. Closing the generator (the page went away, or ZeroGPU's caller stopped reading) stops the runs.

    The last snapshot is taken after the worker has ended: whether it has is read *before* each snapshot (read
    after it, a worker that ended in between would leave its runs "running" in the page's last update)."""
    runs = {strategy: LiveRun(strategy) for strategy in STRATEGIES}
    worker = threading.Thread(target=run_all, args=(target, draft, tokenizer, prompts, settings, runs, stop,
                                                    strategy_source), name="tetris-space-run", daemon=True)
    worker.start()
    try:
        while True:
            worker.join(timeout=every)
            ended = not worker.is_alive()
            yield {strategy: live.snapshot() for strategy, live in runs.items()}
            if ended:
                break
    finally:
        stop.set()  # the worker stops at its next token or step
        worker.join()


def greedy_agreement(runs: dict[str, LiveRun]) -> list[int] | None:
    """Requests (0-based) whose outputs differ between the runs; ``None`` unless all of them finished."""
    if any(runs[strategy].state != "done" for strategy in STRATEGIES):
        return None
    reference = runs[PLAIN].rows
    return [
        row for row in range(len(reference))
        if any(runs[strategy].rows[row] != reference[row] for strategy in SPECULATIVE)
    ]


# ---------------------------------------------------------------------------------------------------------------
# What the numbers say: each run against plain generate(), and one line on why


def speed_ratio(live: LiveRun, plain: LiveRun) -> float | None:
    """``live``'s tokens/s over plain ``generate()``'s, once plain has finished (``None`` before)."""
    if plain.state != "done" or plain.tokens_per_second <= 0 or live.state not in ("running", "done") or \
            live.tokens == 0:
        return None
    return live.tokens_per_second / plain.tokens_per_second


@dataclass(frozen=True)
class StepEconomy:
    """Why a speculative run was as fast as it was, against plain ``generate()``: ``tokens_per_row_step`` (each
    active row's tokens per target forward: 1 from the target plus the accepted drafts; plain's is 1),
    ``step_cost`` (seconds per step over plain's), ``draft_share`` (of the run's time, drafting), ``acceptance``
    (accepted / drafted), ``first_guess`` (:attr:`RunStats.first_guess_rate`), ``ratio`` (tokens/s over plain's), ``drafting_steps`` and ``steps``."""

    tokens_per_row_step: float
    step_cost: float
    draft_share: float
    acceptance: float
    first_guess: float
    ratio: float
    drafting_steps: int
    steps: int


def step_economy(live: LiveRun, plain: LiveRun) -> StepEconomy | None:
    """:class:`StepEconomy` of a finished speculative run against a finished plain run (``None`` otherwise)."""
    stats, ratio = live.stats, speed_ratio(live, plain)
    if live.state != "done" or stats is None or ratio is None or not stats.row_steps or not plain.step_seconds:
        return None
    return StepEconomy(
        tokens_per_row_step=live.tokens / stats.row_steps,
        step_cost=live.step_seconds / plain.step_seconds,
        draft_share=stats.draft_seconds / live.seconds if live.seconds > 0 else 0.0,
        acceptance=stats.acceptance_rate,
        first_guess=stats.first_guess_rate,
        ratio=ratio,
        drafting_steps=stats.drafting_steps,
        steps=stats.steps,
    )


EVEN = 0.05  # within 5% of plain's speed: "about as fast"


def explain_batch(runs: dict[str, LiveRun], settings: Settings) -> str | None:
    """One line, in words, on what this batch showed and why, from its own numbers: whether drafting paid against
    plain ``generate()`` (the faster of fixed-k and TETRIS, which draft at every step), what a TETRIS step gave each
    row and what it cost, and what adaptive, which drafts only when it measures that it pays, made of it. ``None``
    until plain and fixed-k or TETRIS have finished."""
    plain = runs[PLAIN]
    economies = {strategy: step_economy(runs[strategy], plain) for strategy in SPECULATIVE}
    done = {strategy: economy for strategy, economy in economies.items() if economy is not None}
    drafting = [strategy for strategy in (FIXED, TETRIS) if strategy in done]
    if not drafting:
        return None
    best = max(drafting, key=lambda strategy: done[strategy].ratio)
    # the step numbers of TETRIS (the product), else fixed-k: what a drafting step gives and costs
    shown = TETRIS if TETRIS in done else FIXED
    economy = done[shown]
    source = "prompt lookup's drafts" if settings.lookup else "drafted tokens"
    where = " on this CPU" if plain.device.startswith("CPU") else ""
    why = (f"in {TITLES[shown]} the target accepted {economy.acceptance:.0%} of {source} (a row's first guess "
           f"{economy.first_guess:.0%} of the time), so a step gave each row "
           f"{economy.tokens_per_row_step:.2f} tokens (plain: 1) for {economy.step_cost:.1f}x the time of a plain "
           f"step{where}")
    if not settings.lookup and economy.draft_share > 0:
        why += f", {economy.draft_share:.0%} of it drafting"
    ratio = done[best].ratio
    faster = TITLES[best] if len(drafting) == 1 else f"{TITLES[best]}, the faster of fixed-k and TETRIS,"
    if ratio >= 1 + EVEN:
        line = f"Speculation paid on this batch: {faster} ran at {ratio:.2f}x plain's speed, because {why}."
        if settings.lookup:
            line += " Prompt lookup drafts by copying from the prompt, at almost no cost, and these answers repeat it."
    elif ratio > 1 - EVEN:
        line = f"About even on this batch: {faster} ran at {ratio:.2f}x plain's speed: {why}."
    else:
        line = f"Drafting did not pay on this batch: {faster} ran at {ratio:.2f}x plain's speed, because {why}."
    adaptive = done.get(ADAPTIVE)
    if adaptive is not None:
        drafted = f"drafted in {adaptive.drafting_steps} of its {adaptive.steps} steps"
        if adaptive.drafting_steps < (adaptive.steps - 1) / 2:
            line += (f" Adaptive measured that and {drafted}, taking plain steps otherwise "
                     f"({adaptive.ratio:.2f}x plain).")
        else:
            line += f" Adaptive {drafted} ({adaptive.ratio:.2f}x plain)."
    if ratio < 1 + EVEN and not settings.lookup:
        line += (" Drafting pays when a step's extra tokens outweigh its extra cost: a draft that agrees more often, "
                 "answers that repeat the prompt (prompt lookup on Code edit), or a GPU, where verifying a few more "
                 "tokens per row costs little.")
    elif ratio < 1 + EVEN:
        line += " Lookup pays where answers copy the prompt (Code edit, Summarize); these did too little of it."
    return line
