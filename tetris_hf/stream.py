"""A request stream: speculative decoding over a live batch that requests join as others finish.

:class:`StreamLoop` steps a :class:`~tetris_hf.loop_core.LoopCore` over rows ("lanes") that join between steps
(:meth:`StreamLoop.admit`) and leave when they stop; :class:`RequestStream` is the single-threaded scheduler around it
(first come first served: requests in, :class:`StreamOutput` s out), which :mod:`tetris_hf.continuous` runs on a thread.
Design and guarantees: docs/design.md, sections "The request stream" and "The request stream's guarantees".
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import time
from collections import deque

import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from .batch import Retired
from .checks import check_pair
from .logits.row_sampling import RowSamplingWarper
from .loop_core import HoldsCore, LoopCore
from .options import TetrisOptions, pop_options
from .outputs import TetrisStats
from .step import JoiningPrompts, StepRecord
from .stream_requests import RequestLimits, StreamOutput, StreamRequest, check_request

# prompt tokens a joining row reads per forward: a prompt up to this long rides whole in one step (docs/benchmarks.md,
# "Repacks that copy what moves, prompts read whole")
DEFAULT_PREFILL_CHUNK = 2048
INITIAL_CACHE_LENGTH = 512  # tokens an eager stream's rows hold at first (the cache doubles as rows need)
COMPILED_CACHE_LENGTH = 128  # tokens a compiled stream's rows hold at first, plus margins (256 static slots)
FOLD_EVERY = 64  # steps whose records a stream keeps before adding them to its totals
TOTALS = ("steps", "drafted_tokens", "verified_tokens", "accepted_tokens", "emitted_tokens", "draft_seconds",
          "verify_seconds", "target_tokens", "selected_tokens", "lookup_drafted_tokens", "lookup_verified_tokens",
          "lookup_accepted_tokens")


class StreamLoop(HoldsCore):
    """The batched speculative loop (:attr:`core`) over rows that join between steps (:meth:`admit`) and leave when
    they stop, their tokens handed out as ``(lane, tokens)`` (:meth:`take_finished`). Rows are lanes
    ``0 .. max_batch_size - 1`` (``batch.rows``), each holding its prompt from column 0, unpadded.

    Args:
        model, assistant_model, logits_processor, generation_config, options: as for the batched loop (EOS and the
            length limit come per row, from :meth:`admit`).
        max_batch_size: rows at most.
        max_length: the longest a row may grow (prompt and new tokens).
        prefill_chunk: prompt tokens a joining row reads per forward.
        ride_prompts: ``False``: no prompt rides in a verification forward (:meth:`admit`).
    """

    def __init__(self, model: torch.nn.Module, assistant_model: torch.nn.Module | None,
                 logits_processor: LogitsProcessorList, generation_config, options: TetrisOptions,
                 max_batch_size: int, max_length: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 ride_prompts: bool = True):
        # the caches start small and double as rows need; a compiled step attends over the whole capacity: smaller still
        cache_length = min(max_length, COMPILED_CACHE_LENGTH if options.tetris_compile else INITIAL_CACHE_LENGTH)
        self.core = LoopCore(model, assistant_model, logits_processor, StoppingCriteriaList(), generation_config,
                             options, max_length, max_rows=max_batch_size, cache_length=cache_length)
        self.batch_size = max_batch_size
        self.prefill_chunk, self.ride_prompts = prefill_chunk, ride_prompts
        self.step_callback = options.tetris_step_callback
        self.finished: list[tuple[int, list[int]]] = []  # (lane, tokens) of rows that left since last taken
        self.joining: JoiningPrompts | None = None  # prompts the next step's forward reads (their rows join after it)
        self._riding: list[tuple] = []  # (lane, prompt, limit, end tokens) of the rows of `joining`
        self._totals = TetrisStats()

    @property
    def done(self) -> bool:
        return self.core.batch.num_rows == 0

    def admit(self, lanes: list[int], prompts: list[list[int]], limits: list[int],
              eos_token_ids: list[tuple[int, ...]]) -> None:
        """New rows join after the active ones: lane ``lanes[i]`` serves ``prompts[i]`` (at least one token), stops
        at length ``limits[i]`` or at one of ``eos_token_ids[i]``. Where rows are decoding and the target reads packed,
        a prompt of at most ``prefill_chunk`` tokens rides in the next step's verification forward (:attr:`joining`);
        other prompts are read now but their last tokens (:meth:`~tetris_hf.loop_core.LoopCore.add_rows`)."""
        rides = self.ride_prompts and self.core.batch.num_rows > 0 and self.core.prompts_can_ride
        riding = [rides and len(prompt) <= self.prefill_chunk for prompt in prompts]
        now = [index for index, ride in enumerate(riding) if not ride]
        if now:
            self.core.add_rows(*([items[index] for index in now] for items in (lanes, prompts, limits, eos_token_ids)),
                               chunk=self.prefill_chunk)
        for index in (index for index, ride in enumerate(riding) if ride):
            self._riding.append((lanes[index], prompts[index], limits[index], tuple(eos_token_ids[index])))
        if any(riding):
            self.joining = self._joining_prompts()

    def _joining_prompts(self) -> JoiningPrompts:
        """The prompts waiting to ride in the next step's forward, as the step reads them."""
        lanes, prompts, limits, eos_token_ids = zip(*self._riding)
        lengths = tuple(len(prompt) for prompt in prompts)
        rows = self.core.prompt_rows(list(prompts))
        width = max(lengths)
        device = rows.device
        return JoiningPrompts(rows[:, :width].clone(), torch.tensor(lengths, device=device), sum(lengths), width, rows,
                              torch.tensor(lanes, device=device), lengths, limits, eos_token_ids)

    def step(self) -> StepRecord:
        """One step of the core, the riding prompts read in it; the rows that stopped go to :attr:`finished`; then
        the user's step callback."""
        joining, self.joining, self._riding = self.joining, None, []
        result = self.core.step(joining)
        if joining is not None:
            self._totals.emitted_tokens += joining.count  # (each emitted its first token outside the step's record)
        if result.retired is not None:
            self._store_finished(result.retired)
        if self.step_callback is not None:
            self.step_callback(result.record, self)
        if len(self.core.records) >= FOLD_EVERY:
            self.fold_records()
        return result.record

    @property
    def stats(self) -> TetrisStats:
        """The stream's totals so far (:class:`~tetris_hf.outputs.TetrisStats` without its per-step lists)."""
        self.fold_records()
        return dataclasses.replace(self._totals)

    def fold_records(self) -> None:
        """Add the steps recorded since the last fold to the totals and drop their records (one read)."""
        records = self.core.take_records()
        if not records:
            return
        steps = TetrisStats.from_steps(records, self.batch_size)
        totals = self._totals
        for name in TOTALS:
            setattr(totals, name, getattr(totals, name) + getattr(steps, name))
        # (from_steps counts the first record as a prompt's read, which selects nothing: a stream has none)
        totals.selected_tokens += records[0].rows.numel()

    def remove(self, lanes: list[int]) -> None:
        """Take the rows of ``lanes`` (active ones) out of the batch now; their tokens go to :attr:`finished`."""
        retired = self.core.remove(lanes)
        if retired is not None:
            self._store_finished(retired)

    def _store_finished(self, retired: Retired) -> None:
        """Rows leaving: their lanes and tokens to the host (one read, only when rows stop)."""
        lanes, lengths = torch.stack([retired.rows, retired.lengths]).tolist()
        tokens = retired.sequences[:, : max(lengths)].tolist()
        self.finished.extend((lane, row[:length]) for lane, row, length in zip(lanes, tokens, lengths))

    def take_finished(self) -> list[tuple[int, list[int]]]:
        """The ``(lane, tokens)`` of the rows that left since the last call (which this loop then forgets)."""
        finished, self.finished = self.finished, []
        return finished

    def progress(self, lanes: list[int]) -> dict[int, list[int]]:
        """Each active lane of ``lanes``: its tokens so far (one read; for requests that stream)."""
        batch = self.core.batch
        return batch.tokens_of(torch.isin(batch.rows, torch.tensor(lanes, device=batch.rows.device)))

    def close(self) -> None:
        """The models' attention back to their own (the stream is over)."""
        self.core.close()


def _as_ids(value) -> tuple[int, ...]:
    """An ``eos_token_id`` setting (``None``, an int, a list or a tensor) as a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, torch.Tensor):
        return tuple(int(item) for item in value.flatten().tolist())
    if isinstance(value, int):
        return (value,)
    return tuple(int(item) for item in value)


def stream_config(model: torch.nn.Module, generation_config: GenerationConfig | None,
                  kwargs: dict) -> GenerationConfig:
    """The stream's generation settings: ``generation_config`` (default the model's) updated with the settings in
    ``kwargs`` that a :class:`~transformers.GenerationConfig` knows (taken out of ``kwargs``)."""
    config = copy.deepcopy(generation_config if generation_config is not None else model.generation_config)
    known = {name: kwargs.pop(name) for name in list(kwargs) if hasattr(config, name)}
    config.update(**known)
    if config.pad_token_id is None:
        eos = _as_ids(config.eos_token_id)
        config.pad_token_id = eos[0] if eos else 0
    return config


class RequestStream:
    """Requests in, finished outputs out: :class:`StreamLoop` with a first-come-first-served queue, on the calling
    thread. Each :meth:`step` admits waiting requests into free lanes and runs one speculative step.

    Args:
        model: the target causal LM.
        assistant_model: a draft model (same vocabulary), or ``None`` with ``prompt_lookup_num_tokens``.
        generation_config: sampling, ``max_new_tokens`` and ``eos_token_id`` defaults for every request (default
            the model's); ``kwargs`` that a ``GenerationConfig`` knows update it.
        max_batch_size: rows decoding at once.
        max_length: the most tokens a request may hold, prompt and new ones (default the model's
            ``max_position_embeddings``, else 4096).
        prefill_chunk: prompt tokens a joining row reads per forward.
        ride_prompts: ``False``: no prompt rides in a verification forward (:meth:`StreamLoop.admit`).
        **kwargs: ``custom_generate="tetris"`` options (``tetris_strategy``, ``num_assistant_tokens``,
            ``tetris_extra_tokens``, ``tetris_budget``, ``prompt_lookup_num_tokens`` ...) and generation settings.
    """

    def __init__(self, model: torch.nn.Module, *, assistant_model: torch.nn.Module | None = None,
                 generation_config: GenerationConfig | None = None, max_batch_size: int = 8,
                 max_length: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, ride_prompts: bool = True,
                 **kwargs):
        for name, value in (("max_batch_size", max_batch_size), ("prefill_chunk", prefill_chunk)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
        kwargs = dict(kwargs)
        self.options = pop_options(kwargs)
        self.config = stream_config(model, generation_config, kwargs)
        if kwargs:
            raise TypeError(f"unknown arguments for a request stream: {sorted(kwargs)}")
        check_pair(model, assistant_model, prompt_lookup=self.options.model_free_tokens is not None)
        text_config = model.config.get_text_config(decoder=True)
        if max_length is None:
            max_length = getattr(text_config, "max_position_embeddings", None) or 4096
        self.model, self.assistant_model = model, assistant_model
        self.max_batch_size, self.max_length, self.prefill_chunk = max_batch_size, int(max_length), prefill_chunk
        self.ride_prompts = bool(ride_prompts)
        self.waiting: deque[StreamRequest] = deque()
        self.live: dict[int, StreamRequest] = {}  # lane -> request
        self.done: deque[StreamOutput] = deque()  # finished (or failed) outputs not yet taken
        self._ids = itertools.count()
        self._ids_in_flight: set[str] = set()  # the requests waiting or live
        self._cancelled: set[str] = set()
        # per-request temperature, top-k and top-p: one warper with a value per lane replaces the stream's (unless
        # other warpers, which transformers applies after them, are set: then every request samples with the stream's)
        self.row_sampling: RowSamplingWarper | None = None
        self.processor_config = self.config
        other_warpers = (self.config.min_p is not None or (self.config.typical_p or 1.0) < 1.0
                         or (self.config.epsilon_cutoff or 0.0) > 0 or (self.config.eta_cutoff or 0.0) > 0
                         or getattr(self.config, "top_h", None) is not None)
        if self.config.do_sample and not other_warpers:
            device = model.get_input_embeddings().weight.device
            self.row_sampling = RowSamplingWarper(max_batch_size, self.config.temperature or 1.0, self.config.top_k,
                                                  1.0 if self.config.top_p is None else self.config.top_p, device)
            self.processor_config = copy.deepcopy(self.config)
            self.processor_config.update(temperature=1.0, top_k=None, top_p=1.0)
        why_no_sampling = ("temperature, top_k and top_p are sampling settings: this stream decodes greedily "
                           "(do_sample=False)" if not self.config.do_sample else
                           "per-request temperature, top_k and top_p need a stream without min_p, typical_p, epsilon "
                           "or eta warpers (transformers applies those after them)")
        self.limits = RequestLimits(
            vocab_size=model.get_output_embeddings().weight.shape[0], max_length=self.max_length,
            default_max_new_tokens=self.config.max_new_tokens, default_eos=_as_ids(self.config.eos_token_id),
            sampling_defaults=None if self.row_sampling is None else self.row_sampling.defaults,
            why_no_sampling=why_no_sampling)
        self.loop: StreamLoop | None = self._new_loop()  # (made now: settings it cannot serve fail here)

    def _new_loop(self) -> StreamLoop:
        device = self.model.get_input_embeddings().weight.device
        processors = self.model._get_logits_processor(generation_config=self.processor_config, device=device,
                                                      logits_processor=LogitsProcessorList(), model_kwargs={})
        if self.row_sampling is not None:
            processors.append(self.row_sampling)  # (the warpers come last in transformers' order too)
        return StreamLoop(self.model, self.assistant_model, processors, self.config, self.options,
                          self.max_batch_size, self.max_length, self.prefill_chunk, self.ride_prompts)

    # -- requests --------------------------------------------------------------------------------------------------

    def request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                eos_token_id=None, streaming: bool = False, temperature: float | None = None,
                top_k: int | None = None, top_p: float | None = None) -> StreamRequest:
        """A checked request (:func:`~tetris_hf.stream_requests.check_request`), not queued; raises ``TypeError`` or
        ``ValueError`` naming the bad argument. ``request_id`` ``None``: a new ``"req_N"`` no request in flight holds.
        Callable from any thread."""
        if request_id is None:
            request_id = next(candidate for candidate in (f"req_{index}" for index in self._ids)
                              if candidate not in self._ids_in_flight)
        return check_request(self.limits, input_ids, request_id, max_new_tokens, eos_token_id, streaming,
                             temperature, top_k, top_p)

    def submit(self, request: StreamRequest) -> str:
        """Queue a checked request (:meth:`request`); returns its id. A request whose id is in flight (waiting or
        decoding) is refused with a ``ValueError``: its output could not be told from the other's."""
        if request.request_id in self._ids_in_flight:
            raise ValueError(f"request_id {request.request_id!r} is already in flight: give each request its own id")
        self._ids_in_flight.add(request.request_id)
        self.waiting.append(request)
        return request.request_id

    def add(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
            eos_token_id=None, streaming: bool = False, temperature: float | None = None, top_k: int | None = None,
            top_p: float | None = None) -> str:
        """Queue a request; returns its id (``temperature``, ``top_k``, ``top_p``: its own sampling settings,
        ``None``: the stream's). A request :meth:`request` refuses is not queued: its output, with the error, is ready
        at once. An id already in flight raises (see :meth:`submit`)."""
        try:
            request = self.request(input_ids, request_id, max_new_tokens, eos_token_id, streaming, temperature,
                                   top_k, top_p)
        except (TypeError, ValueError) as error:
            request_id = request_id if isinstance(request_id, str) and request_id else f"req_{next(self._ids)}"
            if request_id in self._ids_in_flight:
                raise ValueError(f"request_id {request_id!r} is already in flight: give each request its own id") \
                    from error
            flat = isinstance(input_ids, (list, tuple)) and all(type(token) is int for token in input_ids)
            self._fail(StreamRequest(request_id, list(input_ids) if flat else [], 0, ()), str(error))
            return request_id
        return self.submit(request)

    def cancel(self, request_id: str, reason: str = "cancelled") -> None:
        """Stop a request now: a waiting one never runs (its output fails with ``reason``); a running one leaves its
        row at the next step (its output keeps what it generated, with status FAILED and error "cancelled")."""
        for request in list(self.waiting):
            if request.request_id == request_id:
                self.waiting.remove(request)
                self._fail(request, reason)
                return
        if any(request.request_id == request_id for request in self.live.values()):
            self._cancelled.add(request_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.live or self._cancelled)

    # -- stepping --------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        """Admit waiting requests into free lanes, run one speculative step, collect the rows that stopped. An
        exception fails every request in flight with it and is raised (the next step starts a fresh loop)."""
        try:
            self._drop_cancelled()
            self._admit()
            if self.loop is not None and not self.loop.done:
                self.loop.step()
                now = time.perf_counter()
                for request in self.live.values():
                    if request.output.first_token_time < 0:
                        request.output.first_token_time = now
                        request.output.status = RequestStatus.DECODING
                self._collect(now)
        except BaseException as error:
            self._fail_in_flight(f"{type(error).__name__}: {error}")
            raise

    def _admit(self) -> None:
        free = [lane for lane in range(self.max_batch_size) if lane not in self.live]
        if not (free and self.waiting):
            return
        if self.loop is None:
            self.loop = self._new_loop()  # (before any request leaves the queue: if this raises, none is lost)
        joining = []
        while free and self.waiting:
            request = self.waiting.popleft()
            request.lane = free.pop(0)
            joining.append(request)
        now = time.perf_counter()
        for request in joining:
            self.live[request.lane] = request
            if self.row_sampling is not None:
                self.row_sampling.set_row(request.lane, *request.sampling)
            request.output.status = RequestStatus.PREFILLING
            request.output.lifespan = (now, -1)
        limits = [min(len(request.prompt_ids) + request.max_new_tokens, self.max_length) for request in joining]
        self.loop.admit([request.lane for request in joining], [request.prompt_ids for request in joining], limits,
                        [request.eos_token_ids for request in joining])

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        lanes = [lane for lane, request in self.live.items() if request.request_id in self._cancelled]
        self._cancelled.clear()
        if lanes and self.loop is not None:
            self.loop.remove(lanes)
            self._collect(time.perf_counter(), error="cancelled")

    def _collect(self, now: float, error: str | None = None) -> None:
        """Hand out the rows that left the batch (and the streaming requests' new tokens)."""
        for lane, tokens in self.loop.take_finished():
            request = self.live.pop(lane)
            self._ids_in_flight.discard(request.request_id)
            output = request.output
            output.generated_tokens = tokens[len(request.prompt_ids) :]
            output.lifespan = (output.lifespan[0], now)
            output.status = RequestStatus.FAILED if error else RequestStatus.FINISHED
            output.error = error
            self.done.append(output)
        streaming = [lane for lane, request in self.live.items() if request.streaming]
        if streaming:
            for lane, tokens in self.loop.progress(streaming).items():
                request = self.live[lane]
                request.output.generated_tokens = tokens[len(request.prompt_ids) :]
                self.done.append(dataclasses.replace(request.output, generated_tokens=list(
                    request.output.generated_tokens)))

    def _fail(self, request: StreamRequest, error: str) -> None:
        self._ids_in_flight.discard(request.request_id)
        request.output.error = error
        request.output.status = RequestStatus.FAILED
        now = time.perf_counter()
        request.output.lifespan = (request.output.lifespan[0] if request.output.lifespan[0] > 0 else now, now)
        self.done.append(request.output)

    def _fail_in_flight(self, error: str) -> None:
        """Every request in the batch fails with ``error``; the loop (and its caches) is dropped."""
        for request in self.live.values():
            self._fail(request, error)
        self.live.clear()
        self._cancelled.clear()
        self.close()

    def reject(self, request: StreamRequest, reason: str) -> None:
        """A request that will not run (never submitted, or refused): its output fails with ``reason``."""
        self._fail(request, reason)

    def fail_all(self, reason: str) -> None:
        """Every request in flight, waiting or decoding, fails now with ``reason`` (its output in :attr:`done`); the
        loop is dropped. The stream stays usable."""
        while self.waiting:
            self._fail(self.waiting.popleft(), reason)
        self._fail_in_flight(reason)

    def close(self) -> None:
        """End the loop (the models' attention back to their own); the stream can start again (with a new loop)."""
        loop, self.loop = self.loop, None
        if loop is not None:
            loop.close()

    def run(self) -> list[StreamOutput]:
        """Step until every request finished; the outputs, in the order they finished."""
        while self.has_work:
            self.step()
        outputs = [output for output in self.done if output.is_finished()]
        self.done.clear()
        return outputs
