# Exported from tetris_hf/stream.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""A request stream: speculative decoding over a live batch that requests join as others finish.

:class:`StreamLoop` is the batched loop (:class:`~tetris_hf.decoding.BatchedSpeculativeLoop`) with rows that come and
go: up to ``max_batch_size`` rows ("lanes"), each serving one request with its own prompt length, length limit and
end tokens. Between steps, waiting requests take the free lanes (:meth:`StreamLoop.admit`). Where rows are decoding
and the target reads packed, a prompt of at most ``prefill_chunk`` tokens rides in the next step's target forward: the
target reads it after the decoding rows' blocks (attention runs on the two groups of rows apart,
:class:`~tetris_hf.packing.BlockSplit`), its logits at the prompt's last token give the row's first token, and the row
joins at the end of that step, its drafter reading the prompt then. Other prompts (an empty stream's, longer ones, a
padded target's) are read at once, but their last tokens, in chunks, in forwards of their own; the last token then
opens the row's first verified block. The budget of each step is spread over whichever rows are live then.

:class:`RequestStream` is the single-threaded scheduler around it: requests in (checked, a bad one gets its error in
its own result), first come first served, finished :class:`StreamOutput` s out. The manager and
``generate_batch`` (:mod:`tetris_hf.continuous`) run it on a thread.

E.g. lanes 0-1 decoding requests ``a`` and ``b``; ``a`` stops; ``c`` takes lane 0: the next step's one target forward
verifies ``b``'s drafts and reads ``c``'s prompt, whose first token comes out with ``b``'s; the step after verifies
both rows' drafts.
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

from .checks import check_pair
from .decoding import BatchedSpeculativeLoop
from .logits_row_sampling import RowSamplingWarper
from .options import TetrisOptions
from .outputs import TetrisStats
from .batch import Batch, Retired
from .step import JoiningPrompts
from .stream_requests import RequestLimits, StreamOutput, StreamRequest, check_request
from .timing import StepClock

DEFAULT_PREFILL_CHUNK = 256  # prompt tokens a joining row reads per forward
FOLD_EVERY = 64  # steps whose records a stream keeps before adding them to its totals
TOTALS = ("steps", "drafted_tokens", "verified_tokens", "accepted_tokens", "emitted_tokens", "draft_seconds",
          "verify_seconds", "target_tokens", "selected_tokens", "lookup_drafted_tokens", "lookup_verified_tokens",
          "lookup_accepted_tokens")


class StreamLoop(BatchedSpeculativeLoop):
    """The batched speculative loop over rows that join between steps (:meth:`admit`) and leave when they stop,
    their tokens handed to :attr:`finished` as ``(lane, tokens)``. Rows are lanes ``0 .. max_batch_size - 1``
    (:attr:`rows`), each row holding its prompt from column 0, unpadded.

    Args:
        model, assistant_model, logits_processor, generation_config, options: as for the batched loop (EOS and the
            length limit come per row, from :meth:`admit`).
        max_batch_size: rows at most.
        max_length: the longest a row may grow (prompt and new tokens).
        prefill_chunk: prompt tokens a joining row reads per forward.
        ride_prompts: a prompt that fits one chunk rides in a verification forward (:meth:`admit`); ``False``: every
            prompt is read in forwards of its own.
    """

    def __init__(self, model: torch.nn.Module, assistant_model: torch.nn.Module | None,
                 logits_processor: LogitsProcessorList, generation_config, options: TetrisOptions,
                 max_batch_size: int, max_length: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 ride_prompts: bool = True):
        if options.tetris_compile:
            raise ValueError("a request stream runs eager: `tetris_compile=True` needs static shapes, which rows "
                             "joining mid-stream do not have")
        device = model.get_input_embeddings().weight.device
        # the caches start small and grow by doubling as rows need (a row's capacity can be far above typical use)
        cache_length = min(max_length, 2 * DEFAULT_PREFILL_CHUNK)
        self._setup(model, assistant_model, logits_processor, StoppingCriteriaList(), generation_config, options,
                    device, 0, cache_length, max_length, cache_length=cache_length)
        self.target_slots.max_rows = max_batch_size
        self.batch_size = max_batch_size
        self.prefill_chunk, self.ride_prompts = prefill_chunk, ride_prompts
        empty = torch.zeros(0, 1, dtype=torch.long, device=device)
        self.drafter.prefill(empty, empty, all_real=True)
        self._compile_and_attach()
        self.prompt_read = True  # rows come with their prompts read (admit)
        self.input_ids = empty
        self.batch = Batch.empty(self.sequence_capacity, self.pad_value, max_length, device)
        self.finished: list[tuple[int, list[int]]] = []  # (lane, tokens) of rows that left since last taken
        self._riding: list[tuple] = []  # (lane, prompt, limit, end tokens) of the rows of `joining`
        self._records = []
        self._totals = TetrisStats()
        self.clock = StepClock(device)

    def admit(self, lanes: list[int], prompts: list[list[int]], limits: list[int],
              eos_token_ids: list[tuple[int, ...]]) -> None:
        """New rows join after the active ones: lane ``lanes[i]`` serves ``prompts[i]`` (at least one token), stops
        at length ``limits[i]`` or at one of ``eos_token_ids[i]``.

        Where rows are decoding and the target reads packed, a prompt of at most ``prefill_chunk`` tokens is read in
        the next step's target forward, after the decoding rows' blocks (no forward of its own), the target's logits
        at its last token giving the row's first token, and its row joins at the end of that step (:attr:`joining`).
        Other prompts are read now, but their last tokens, in chunks, in forwards of their own; each last token opens
        its row's first verified block at the next step."""
        # (a tree step's verification reads ancestor masks: prompts ride in chain steps only)
        rides = self.ride_prompts and self.batch.num_rows > 0 and self.target_slots.packs and self.tree_width == 1
        riding = [rides and len(prompt) <= self.prefill_chunk for prompt in prompts]
        now = [index for index, ride in enumerate(riding) if not ride]
        if now:
            self._join_now(*([items[index] for index in now] for items in (lanes, prompts, limits, eos_token_ids)))
        for index in (index for index, ride in enumerate(riding) if ride):
            self._riding.append((lanes[index], prompts[index], limits[index], eos_token_ids[index]))
        if any(riding):
            lengths = [len(prompt) for _, prompt, _, _ in self._riding]
            rows = self._prompt_rows([prompt for _, prompt, _, _ in self._riding])
            width = max(lengths)
            lanes = torch.tensor([lane for lane, _, _, _ in self._riding], device=rows.device)
            self.joining = JoiningPrompts(rows[:, :width].clone(), torch.tensor(lengths, device=rows.device),
                                          sum(lengths), width, rows, lanes)

    def _finish(self, record, stopped: torch.Tensor, block=None):
        """The rows whose prompts this step's forward read join the batch with their first tokens (a row may stop
        there), then as for every loop (:meth:`~tetris_hf.decoding.BatchedSpeculativeLoop._finish`)."""
        if self.joining is not None:
            stopped = torch.cat([stopped, self._join_read(block.joining_tokens)])
        return super()._finish(record, stopped)

    def _join_read(self, first_tokens: torch.Tensor) -> torch.Tensor:
        """The rows of :attr:`joining`, whose prompts the target just read, join with their first tokens
        ``first_tokens`` ``(M,)``: the drafter reads the prompts too. Returns ``(M,)`` which of them stopped at that
        token."""
        joining, riding, batch = self.joining, self._riding, self.batch
        self.joining, self._riding = None, []
        old_rows, rows = batch.num_rows, joining.sequences
        lengths = [len(prompt) + 1 for _, prompt, _, _ in riding]  # each prompt and its first token
        batch.add(joining.lanes, rows, lengths, first_tokens, [limit for _, _, limit, _ in riding],
                  [eos for _, _, _, eos in riding])
        stopped = ((batch.row_eos[old_rows:] == first_tokens[:, None]).any(dim=1)
                   | (batch.lengths[old_rows:] >= batch.row_limits[old_rows:]))
        self.drafter.add_rows(first_tokens, lengths)
        # the block as the target read it (the decoding rows' part empty), and each token's successor in its row (an
        # EAGLE head's pairs): the prompt's next token, the first token after the last
        successors = rows[:, 1 : joining.width + 1]
        old = joining.tokens.new_full((old_rows, joining.width), self.pad_value)
        real_lengths = torch.cat([joining.lengths.new_zeros(old_rows), joining.lengths])
        self.drafter.read_prompts(torch.cat([old, joining.tokens]), real_lengths, joining.num_tokens, batch.longest,
                                  torch.cat([old, successors]), old_rows)
        self._totals.emitted_tokens += joining.count  # (each emitted its first token outside the step's record)
        return stopped

    def _join_now(self, lanes: list[int], prompts: list[list[int]], limits: list[int],
                  eos_token_ids: list[tuple[int, ...]]) -> None:
        """Rows join now: both caches read their prompts but the last tokens, in forwards of their own."""
        old_rows = self.batch.num_rows
        rows = self._prompt_rows(prompts)
        lengths = [len(prompt) for prompt in prompts]
        last_tokens = rows.gather(1, torch.tensor(lengths, device=rows.device)[:, None] - 1)[:, 0]
        self.batch.add(torch.tensor(lanes, device=rows.device), rows, lengths, last_tokens, limits, eos_token_ids)
        self.target_slots.add_rows(len(prompts))
        self.drafter.add_rows(last_tokens, lengths)
        self._read_prompts(old_rows, prompts)

    def _prompt_rows(self, prompts: list[list[int]]) -> torch.Tensor:
        """``(M, capacity)`` the prompts from column 0, pad after them."""
        rows = torch.full((len(prompts), self.sequence_capacity), self.pad_value, dtype=torch.long)
        for index, prompt in enumerate(prompts):
            rows[index, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        return rows.to(self.batch.lengths.device)

    def _read_prompts(self, old_rows: int, prompts: list[list[int]]) -> None:
        """Both caches read the joining rows' prompts but their last tokens, ``prefill_chunk`` tokens a forward; the
        other rows' blocks are empty (packed, they cost nothing; padded, they compute filler)."""
        device, batch = self.batch.lengths.device, self.batch
        to_read = [len(prompt) - 1 for prompt in prompts]
        for start in range(0, max(to_read), self.prefill_chunk):
            chunk = [min(max(length - start, 0), self.prefill_chunk) for length in to_read]
            width = max(chunk)
            block = torch.full((batch.num_rows, width), self.pad_value, dtype=torch.long)
            successors = block.clone()  # each real token's successor in its prompt (an EAGLE head's pairs)
            for index, (prompt, size) in enumerate(zip(prompts, chunk)):
                if size:
                    block[old_rows + index, :size] = torch.tensor(prompt[start : start + size])
                    successors[old_rows + index, :size] = torch.tensor(prompt[start + 1 : start + size + 1])
            block, successors = block.to(device), successors.to(device)
            real_lengths = torch.tensor([0] * old_rows + chunk, device=device)
            num_real = sum(chunk)
            self.target_slots.forward(self.model, block, None, real_lengths=real_lengths, num_real=num_real,
                                      discard_logits=True, first_row=old_rows)
            # no row holds more real tokens than the longest row's length (a row's last token is never cached)
            self.target_slots.compact(batch.longest)
            self.drafter.read_prompts(block, real_lengths, num_real, batch.longest, successors, old_rows)

    def step(self):
        """One step (:meth:`~tetris_hf.decoding.BatchedSpeculativeLoop.step`); every :data:`FOLD_EVERY` steps the
        records go into the totals."""
        record = super().step()
        if len(self._records) >= FOLD_EVERY:
            self.fold_records()
        return record

    @property
    def stats(self) -> TetrisStats:
        """The stream's totals so far (:class:`~tetris_hf.outputs.TetrisStats` without its per-step lists, which
        would grow for as long as the stream runs)."""
        self.fold_records()
        return dataclasses.replace(self._totals)

    def fold_records(self) -> None:
        """Add the steps recorded since the last fold to the totals and drop their records (one read)."""
        if not self._records:
            return
        steps = TetrisStats.from_steps(self._records, self.batch_size)
        totals = self._totals
        for name in TOTALS:
            setattr(totals, name, getattr(totals, name) + getattr(steps, name))
        # (from_steps counts the first record as a prompt's read, which selects nothing: a stream has none)
        totals.selected_tokens += self._records[0].rows.numel()
        self._records.clear()

    def remove(self, lanes: list[int]) -> None:
        """Take the rows of ``lanes`` (active ones) out of the batch now; their tokens go to :attr:`finished`."""
        if not lanes:
            return
        stopped = torch.isin(self.batch.rows, torch.tensor(lanes, device=self.batch.rows.device))
        self._retire(stopped, len(lanes))

    def _store_finished(self, retired: Retired) -> None:
        """Rows leaving: their lanes and tokens to the host (one read, only when rows stop)."""
        lanes, lengths = torch.stack([retired.rows, retired.lengths]).tolist()
        tokens = retired.sequences[:, : max(lengths)].tolist()
        self.finished.extend((lane, row[:length]) for lane, row, length in zip(lanes, tokens, lengths))

    def progress(self, lanes: list[int]) -> dict[int, list[int]]:
        """Each active lane of ``lanes``: its tokens so far (one read; for requests that stream)."""
        return self.batch.tokens_of(torch.isin(self.batch.rows, torch.tensor(lanes, device=self.batch.rows.device)))


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
        assistant_model: a draft model (same vocabulary), or ``None`` for prompt lookup
            (``prompt_lookup_num_tokens``).
        generation_config: sampling, ``max_new_tokens`` and ``eos_token_id`` defaults for every request (default
            the model's); ``kwargs`` that a ``GenerationConfig`` knows update it.
        max_batch_size: rows decoding at once.
        max_length: the most tokens a request may hold, prompt and new ones (default the model's
            ``max_position_embeddings``, else 4096).
        prefill_chunk: prompt tokens a joining row reads per forward.
        ride_prompts: a joining prompt of at most ``prefill_chunk`` tokens is read in the next step's verification
            forward, after the decoding rows' blocks, its first token coming out with theirs (where rows are decoding
            and the target reads packed); ``False``: in forwards of its own.
        **kwargs: ``custom_generate="tetris"`` options (``tetris_strategy``, ``num_assistant_tokens``,
            ``tetris_extra_tokens``, ``tetris_budget``, ``prompt_lookup_num_tokens`` ...) and generation settings.
    """

    def __init__(self, model: torch.nn.Module, *, assistant_model: torch.nn.Module | None = None,
                 generation_config: GenerationConfig | None = None, max_batch_size: int = 8,
                 max_length: int | None = None, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, ride_prompts: bool = True,
                 **kwargs):
        from .generation import _pop_options  # (generation imports the loop; the loop does not import this)

        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"`max_batch_size` must be a positive integer, got {max_batch_size!r}")
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
            raise ValueError(f"`prefill_chunk` must be a positive integer, got {prefill_chunk!r}")
        kwargs = dict(kwargs)
        self.options = _pop_options(kwargs)
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
        # Sampling settings per request: temperature, top-k and top-p leave the stream's processors for one warper
        # with a value per lane, the stream's values by default (unless other warpers, which come after them in
        # transformers' order, are set: then every request samples with the stream's).
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
        """A checked request (:func:`~tetris_hf.stream_requests.check_request`), not queued: raises ``TypeError`` or
        ``ValueError`` naming the bad argument. ``request_id`` ``None``: a new ``"req_N"`` that no request in flight
        holds. Reads only what the stream fixed at construction: callable from any thread."""
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
        """Queue a request; returns its id. ``temperature``, ``top_k`` and ``top_p``: its own sampling settings (a
        sampling stream's; ``None``: the stream's). A request that cannot run (empty, too long, a token outside the
        vocabulary, an argument of the wrong type, bad settings: whatever :meth:`request` refuses) is not queued:
        its output, with the error, is ready at once. An id already in flight raises (see :meth:`submit`)."""
        try:
            request = self.request(input_ids, request_id, max_new_tokens, eos_token_id, streaming, temperature,
                                   top_k, top_p)
        except (TypeError, ValueError) as error:
            request_id = request_id if isinstance(request_id, str) and request_id else f"req_{next(self._ids)}"
            if request_id in self._ids_in_flight:
                raise ValueError(f"request_id {request_id!r} is already in flight: give each request its own id") \
                    from error
            self._fail(StreamRequest(request_id, _printable_prompt(input_ids), 0, ()), str(error))
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
        exception fails every request in flight with it (the stream stays usable: the next step starts afresh) and
        is raised."""
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
        for lane, tokens in self.loop.finished:
            request = self.live.pop(lane)
            self._ids_in_flight.discard(request.request_id)
            output = request.output
            output.generated_tokens = tokens[len(request.prompt_ids) :]
            output.lifespan = (output.lifespan[0], now)
            output.status = RequestStatus.FAILED if error else RequestStatus.FINISHED
            output.error = error
            self.done.append(output)
        self.loop.finished.clear()
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
        """Remove what the drafter put on the target; the stream can start again (with a new loop)."""
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


def _printable_prompt(input_ids) -> list:
    """As much of a refused request's prompt as its output can show: its items if it is a flat list or tuple of ints,
    else nothing."""
    if isinstance(input_ids, (list, tuple)) and all(type(token) is int for token in input_ids):
        return list(input_ids)
    return []

