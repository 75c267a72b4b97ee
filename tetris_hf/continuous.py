"""Continuous batching with speculation, in transformers' call shapes and with its ``GenerationOutput`` results:
:func:`generate_batch` for a list of prompts, :func:`init_continuous_batching` for a live stream of requests (a manager
that runs :class:`~tetris_hf.stream.RequestStream` on a thread). Guarantees: docs/design.md, "The request stream's
guarantees".
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Iterator

import torch
from transformers import GenerationConfig
from transformers.utils import logging

from .stream import RequestStream
from .stream_requests import StreamOutput, StreamRequest

__all__ = ["SpeculativeBatchingManager", "generate_batch", "init_continuous_batching"]

logger = logging.get_logger(__name__)

DEFAULT_MAX_BATCH_SIZE = 16


@torch.no_grad()
def generate_batch(model: torch.nn.Module, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                   *, assistant_model: torch.nn.Module | None = None, max_batch_size: int | None = None,
                   progress_bar: bool = False, **kwargs) -> dict[str, StreamOutput]:
    """Every prompt of ``inputs`` through a request stream of ``max_batch_size`` rows, on this thread.

    Args:
        model: the target causal LM.
        inputs: prompts, each a list of token ids (unpadded).
        generation_config: defaults for every request (``max_new_tokens``, ``eos_token_id``, sampling), else the
            model's; ``kwargs`` a ``GenerationConfig`` knows update it.
        assistant_model: a draft model, or ``None`` with ``prompt_lookup_num_tokens=``.
        max_batch_size: rows decoding at once (default 16, at most the number of prompts).
        progress_bar: a tqdm bar over the finished requests.
        **kwargs: the ``custom_generate="tetris"`` options and generation settings, and ``max_length``,
            ``prefill_chunk`` and ``ride_prompts`` of :class:`~tetris_hf.stream.RequestStream`.

    Returns:
        ``{request_id: output}`` in input order, ids ``"req_0"``, ``"req_1"`` ...: one output for every input. A
        request that could not run, or was decoding in a step that raised, has its ``error`` set; the others run on.
    """
    if max_batch_size is None:
        max_batch_size = max(1, min(DEFAULT_MAX_BATCH_SIZE, len(inputs)))
    stream = RequestStream(model, assistant_model=assistant_model, generation_config=generation_config,
                           max_batch_size=max_batch_size, **kwargs)
    ids = [stream.add(prompt, request_id=f"req_{index}") for index, prompt in enumerate(inputs)]
    results: dict[str, StreamOutput] = {}
    from tqdm.auto import tqdm

    bar = tqdm(total=len(ids), desc="requests", unit="req", disable=not progress_bar)
    try:
        while stream.has_work or stream.done:
            if stream.has_work:
                try:
                    stream.step()
                except Exception as error:  # the stream failed the requests in that step; go on with the rest
                    logger.warning(f"a step failed, and with it the requests decoding in it: {error!r}")
            while stream.done:
                output = stream.done.popleft()
                if output.is_finished():
                    results[output.request_id] = output
                    bar.update(1)
    finally:
        stream.close()
        bar.close()
    return {request_id: results[request_id] for request_id in ids}


def init_continuous_batching(model: torch.nn.Module, generation_config: GenerationConfig | None = None, *,
                             assistant_model: torch.nn.Module | None = None,
                             max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, **kwargs) -> SpeculativeBatchingManager:
    """A manager for a live stream of requests (not started: call :meth:`~SpeculativeBatchingManager.start`, or use
    it as a context manager). Arguments as for :func:`generate_batch`."""
    stream = RequestStream(model, assistant_model=assistant_model, generation_config=generation_config,
                           max_batch_size=max_batch_size, **kwargs)
    return SpeculativeBatchingManager(stream)


class SpeculativeBatchingManager:
    """Runs a :class:`~tetris_hf.stream.RequestStream` on a background thread; the methods of transformers'
    ``ContinuousBatchingManager``: :meth:`add_request`, :meth:`get_result`, iteration, :meth:`request_id_iter`,
    :meth:`cancel_request`, :meth:`start`, :meth:`stop`, and ``with``. Every request :meth:`add_request` accepted gets
    exactly one final output (docs/design.md, "The request stream's guarantees").
    """

    def __init__(self, stream: RequestStream):
        self.stream = stream
        self._incoming: queue.Queue = queue.Queue()  # StreamRequest | ("cancel", request_id) | None (a wake-up)
        self._changed = threading.Condition()  # guards the outputs below and _ended
        self._finished: dict[str, StreamOutput] = {}
        self._finished_order: deque[str] = deque()
        self._partials: dict[str, deque[StreamOutput]] = {}
        self._ended = False  # the thread ran and ended: no output will come any more
        self._door = threading.Lock()  # guards _reserved and _closed
        self._reserved: set[str] = set()  # ids accepted whose final output has not been taken
        self._closed = False  # the thread ended: add_request refuses
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.last_error: BaseException | None = None

    # -- running ---------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background thread (again, after it stopped)."""
        if self.is_running():
            return
        self._stopping.clear()
        with self._door:
            self._closed = False
        with self._changed:
            self._ended = False
        self._thread = threading.Thread(target=self._run, name="tetris-hf-stream", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the thread; requests not finished by then fail with the error "the manager stopped"."""
        self._stopping.set()
        self._incoming.put(None)  # wakes a thread waiting for work
        if block and self._thread is not None:
            self._thread.join(timeout)

    def __enter__(self) -> SpeculativeBatchingManager:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop(block=True)

    @torch.no_grad()
    def _run(self) -> None:
        stream, reason = self.stream, "the manager stopped"
        try:
            while not self._stopping.is_set():
                self._take_incoming(block=not stream.has_work)
                if stream.has_work:
                    try:
                        stream.step()
                    except Exception as error:  # the stream failed the requests in flight; go on with the next
                        self.last_error = error
                self._publish()
        except BaseException as error:  # (a fault outside any step: nothing can be trusted to go on)
            self.last_error = error
            reason = f"the manager stopped: {type(error).__name__}: {error}"
            logger.error(f"the request stream's thread stopped: {error!r}")
        finally:
            with self._door:  # from here on add_request refuses, so what is queued now is all there will be
                self._closed = True
            self._take_incoming(block=False, refuse=reason)
            stream.fail_all(reason)
            self._publish()
            with self._changed:
                self._ended = True
                self._changed.notify_all()

    def _take_incoming(self, block: bool, refuse: str | None = None) -> None:
        """Move queued requests and cancellations into the stream (waiting a little for one when idle); ``refuse``:
        queued requests fail with this reason instead."""
        try:
            item = self._incoming.get(timeout=0.05) if block else self._incoming.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(item, StreamRequest):
                if refuse is not None:
                    self.stream.reject(item, refuse)
                else:
                    try:
                        self.stream.submit(item)
                    except Exception as error:  # (only this request: it never entered the stream)
                        self.stream.reject(item, f"{type(error).__name__}: {error}")
            elif item is not None and refuse is None:
                self.stream.cancel(item[1])
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                return

    def _publish(self) -> None:
        stream = self.stream
        if not stream.done:
            return
        with self._changed:
            while stream.done:
                output = stream.done.popleft()
                if output.is_finished():
                    self._finished[output.request_id] = output
                    self._finished_order.append(output.request_id)
                else:
                    self._partials.setdefault(output.request_id, deque()).append(output)
            self._changed.notify_all()

    # -- requests --------------------------------------------------------------------------------------------------

    def add_request(self, input_ids, request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, eos_token_id=None, temperature: float | None = None,
                    top_k: int | None = None, top_p: float | None = None) -> str:
        """Queue a request (a list of token ids, or a 1-D integer tensor); returns its id. Its output comes from
        :meth:`get_result` (or, with ``streaming``, partial outputs first from :meth:`request_id_iter`).
        ``temperature``, ``top_k``, ``top_p``: its own sampling settings, in a sampling stream.

        Raises ``TypeError`` or ``ValueError`` naming the argument (:func:`~tetris_hf.stream_requests.check_request`,
        or a ``request_id`` whose result has not been taken), ``RuntimeError`` once the thread has ended; nothing is
        queued then."""
        with self._door:
            if self._closed:
                cause = f" ({type(self.last_error).__name__}: {self.last_error})" if self.last_error else ""
                raise RuntimeError(f"the manager has stopped{cause}: start() it again, or make a new one")
            if request_id is None:
                request_id = next(candidate for candidate in (f"req_{index}" for index in self._ids)
                                  if candidate not in self._reserved)
            request = self.stream.request(input_ids, request_id, max_new_tokens, eos_token_id, streaming,
                                          temperature, top_k, top_p)
            if request.request_id in self._reserved:
                raise ValueError(f"request_id {request_id!r} is already in use (its result has not been taken): "
                                 "give each request its own id")
            self._reserved.add(request.request_id)
            self._incoming.put(request)
        return request.request_id

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None) -> list[str]:
        return [self.add_request(prompt, max_new_tokens=max_new_tokens) for prompt in inputs]

    def cancel_request(self, request_id: str) -> None:
        """Stop a request: its row is freed for the next one; its output has status FAILED, error "cancelled"."""
        self._incoming.put(("cancel", request_id))

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> StreamOutput | None:
        """The next finished output (or ``request_id``'s), waiting up to ``timeout`` seconds; ``None`` if none
        came, at once for an id no request holds (never given, or its result already taken) and once the thread
        has ended with nothing left."""
        if request_id is not None:
            with self._door:
                if request_id not in self._reserved:
                    return None

        def ready() -> bool:
            return (request_id in self._finished) if request_id is not None else bool(self._finished_order)

        with self._changed:
            if not self._changed.wait_for(lambda: ready() or self._ended, timeout) or not ready():
                return None
            if request_id is None:
                request_id = self._finished_order.popleft()
            else:
                self._finished_order.remove(request_id)
            self._partials.pop(request_id, None)
            output = self._finished.pop(request_id)
        self._release(request_id)
        return output

    def _release(self, request_id: str) -> None:
        """``request_id``'s final output was taken: the id may be given again."""
        with self._door:
            self._reserved.discard(request_id)

    def __iter__(self) -> Iterator[StreamOutput]:
        """Finished outputs as they come, while the manager runs."""
        while self.is_running() or self._finished_order:
            output = self.get_result(timeout=0.1)
            if output is not None:
                yield output

    def request_id_iter(self, request_id: str) -> Iterator[StreamOutput]:
        """``request_id``'s outputs as it runs: partial ones (streaming requests, after each step), then the
        finished one."""
        while True:
            with self._changed:
                self._changed.wait_for(lambda: request_id in self._finished or self._partials.get(request_id)
                                       or not self.is_running(), timeout=0.5)
                partials = self._partials.get(request_id)
                if partials:
                    output, last = partials.popleft(), False
                elif request_id in self._finished:
                    self._finished_order.remove(request_id)
                    output, last = self._finished.pop(request_id), True
                elif not self.is_running():
                    return
                else:
                    continue
            if last:
                self._release(request_id)
            yield output
            if last:
                return
