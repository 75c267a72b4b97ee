"""The three runs the Space compares, one function each, written so a UI thread can watch them grow.

- :func:`run_plain`: plain batched ``generate()``; a :class:`BatchStreamer` collects every row's tokens as they come.
- :func:`run_speculative`: batched speculative decoding (``tetris_strategy="fixed"`` or ``"tetris"``);
  ``tetris_step_callback`` copies every row's tokens and the step's board cells after each step.
- :func:`run_all`: the three in turn on one worker thread (one at a time, so each gets the whole CPU/GPU and its
  tokens/s is its own).

Every run writes into a :class:`LiveRun` that the UI thread reads; nothing here imports Gradio. A set ``stop`` event
cancels the run in progress at its next token or step (:class:`RunCancelled`) and the runs after it never start.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
from transformers.generation.streamers import BaseStreamer

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf.bench import encode, generated_tokens
from tetris_hf.data import Prompt, render_prompts

from tetris_board import BoardTrace

PLAIN, FIXED, TETRIS = "generate", "fixed", "tetris"
STRATEGIES = (PLAIN, FIXED, TETRIS)
TITLES = {PLAIN: "plain generate()", FIXED: "fixed-k speculative", TETRIS: "TETRIS"}


class RunCancelled(Exception):
    """Raised inside generation when the user pressed Stop."""


@dataclass(frozen=True)
class Settings:
    """The controls: ``k`` draft window, ``extra`` TETRIS's extra proposals ``e``, ``budget`` ``C`` (0: ``k`` x
    active rows), ``temperature`` (0: greedy), ``max_new_tokens``, ``seed`` (sampling)."""

    k: int = 4
    extra: int = 2
    budget: int = 0
    temperature: float = 0.0
    max_new_tokens: int = 48
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    def sampling_kwargs(self) -> dict:
        if self.greedy:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": float(self.temperature), "top_k": None, "top_p": None}

    def speculative_kwargs(self, strategy: str) -> dict:
        """``generate()`` options of tetris_hf for ``strategy`` (``"fixed"`` or ``"tetris"``)."""
        options = {"tetris_strategy": strategy, "num_assistant_tokens": self.k}
        if strategy == TETRIS:
            options["tetris_extra_tokens"] = self.extra
            if self.budget > 0:
                options["tetris_budget"] = self.budget
        return options


@dataclass
class LiveRun:
    """One strategy's run as the UI sees it; written by the worker thread, read by the UI thread.

    ``state``: ``waiting`` | ``running`` | ``done`` | ``cancelled`` | ``error``. ``rows[i]``: request ``i``'s
    generated tokens so far. ``stats``: the loop's live ``TetrisStats`` (speculative runs). ``survival``: per step,
    each row's cumulative draft probabilities (``None`` for finished rows).
    """

    strategy: str
    state: str = "waiting"
    rows: list[list[int]] = field(default_factory=list)
    started: float | None = None
    ended: float | None = None
    stats: object | None = None
    survival: list = field(default_factory=list)
    message: str = ""

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

    def board(self, num_assistant_tokens: int) -> BoardTrace | None:
        """A snapshot of this run's board so far (``None`` for plain generate or before the first step)."""
        if self.stats is None:
            return None
        return BoardTrace.from_stats(TITLES[self.strategy], num_assistant_tokens, self.stats, self.survival)


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


def encode_prompts(tokenizer, prompts: list[str], device) -> dict:
    """Each prompt as a one-turn chat through the tokenizer's chat template, left-padded into one batch."""
    chats = [Prompt(id=str(i), messages=({"role": "user", "content": text},)) for i, text in enumerate(prompts)]
    tokenizer.padding_side = "left"
    return encode(tokenizer, render_prompts(chats, tokenizer), device)


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


def run_speculative(target, draft, tokenizer, batch: dict, settings: Settings, strategy: str, live: LiveRun,
                    stop: threading.Event) -> None:
    """Batched speculative decoding with ``tetris_strategy=strategy``, streamed into ``live`` step by step."""
    eos = eos_token_ids(target)
    width = batch["input_ids"].shape[1]

    def on_step(record, loop) -> None:
        survival = [None] * loop.batch_size
        for row, scores in zip(record.rows.tolist(), record.token_log_probs.float().cumsum(dim=-1).exp().tolist()):
            survival[row] = [round(score, 4) for score in scores]
        live.survival.append(survival)
        live.stats = loop.stats
        live.rows = [tokens[width:] for tokens in loop.partial_outputs()]
        if stop.is_set():
            raise RunCancelled

    torch.manual_seed(settings.seed)
    live.state, live.started = "running", time.perf_counter()
    result = target.generate(
        **batch, **_common_kwargs(tokenizer, settings), assistant_model=draft, custom_generate="tetris",
        return_dict_in_generate=True, tetris_step_callback=on_step, **settings.speculative_kwargs(strategy),
    )
    live.ended = time.perf_counter()
    live.stats = result.tetris_stats
    live.rows = generated_tokens(result.sequences, width, eos)


_warm: set[int] = set()


def warm_up(target, draft, batch: dict) -> None:
    """One short forward of each model, once per model, so the first timed run does not pay one-time start-up."""
    for model in (target, draft):
        if id(model) not in _warm:
            with torch.inference_mode():
                model(input_ids=batch["input_ids"][:, -2:], attention_mask=batch["attention_mask"][:, -2:])
            _warm.add(id(model))


def run_all(target, draft, tokenizer, prompts: list[str], settings: Settings, runs: dict[str, LiveRun],
            stop: threading.Event) -> None:
    """Plain, fixed-k and TETRIS in turn on the same batch; each outcome lands in its ``LiveRun``'s state.

    A cancelled run keeps what it had produced; the runs after it stay ``waiting``. An error in one run is recorded
    in its ``message`` and the next run still starts.
    """
    batch = encode_prompts(tokenizer, prompts, target.device)
    warm_up(target, draft, batch)
    for strategy in STRATEGIES:
        live = runs[strategy]
        if stop.is_set():  # stopped between two runs: this one is cancelled before it starts
            live.started = live.ended = time.perf_counter()
            live.state = "cancelled"
            break
        try:
            with torch.inference_mode():
                if strategy == PLAIN:
                    run_plain(target, tokenizer, batch, settings, live, stop)
                else:
                    run_speculative(target, draft, tokenizer, batch, settings, strategy, live, stop)
            live.state = "done"
        except RunCancelled:
            live.ended, live.state = time.perf_counter(), "cancelled"
            break
        except Exception as error:  # shown in the UI; the next strategy still runs
            live.ended, live.state, live.message = time.perf_counter(), "error", f"{type(error).__name__}: {error}"


def greedy_agreement(runs: dict[str, LiveRun]) -> list[int] | None:
    """Requests (0-based) whose outputs differ between the three runs; ``None`` unless all three finished."""
    if any(runs[strategy].state != "done" for strategy in STRATEGIES):
        return None
    reference = runs[PLAIN].rows
    return [
        row for row in range(len(reference))
        if any(runs[strategy].rows[row] != reference[row] for strategy in (FIXED, TETRIS))
    ]
