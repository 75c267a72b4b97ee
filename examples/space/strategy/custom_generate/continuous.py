# Exported from tetris_hf/continuous.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""Continuous batching with speculation, shaped like transformers' own: :func:`generate_batch` for a list of
prompts, :func:`init_continuous_batching` for a live stream of requests (a manager that runs
:class:`~tetris_hf.stream.RequestStream` on a thread).

transformers' ``model.generate_batch`` and ``model.init_continuous_batching`` decode without speculation; these take
the same requests and give the same :class:`~transformers.generation.continuous_batching.GenerationOutput` results,
with a draft model or prompt lookup verifying several tokens a step and TETRIS spending the step's budget over the
live rows::

    import tetris_hf

    results = tetris_hf.generate_batch(model, [ids_a, ids_b, ids_c], assistant_model=draft, max_new_tokens=64,
                                       max_batch_size=8)
    results["req_0"].generated_tokens

    with tetris_hf.init_continuous_batching(model, prompt_lookup_num_tokens=8, max_new_tokens=64) as manager:
        request_id = manager.add_request(ids_a)
        print(manager.get_result(request_id, timeout=60).generated_tokens)
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Iterator

import torch
from transformers import GenerationConfig

from .stream import RequestStream, StreamOutput

__all__ = ["SpeculativeBatchingManager", "generate_batch", "init_continuous_batching"]

DEFAULT_MAX_BATCH_SIZE = 16


@torch.no_grad()
def generate_batch(model: torch.nn.Module, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                   *, assistant_model: torch.nn.Module | None = None, max_batch_size: int | None = None,
                   progress_bar: bool = False, **kwargs) -> dict[str, StreamOutput]:
    """Every prompt of ``inputs`` through a request stream of ``max_batch_size`` rows, on this thread: rows join as
    others finish.

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
        ``{request_id: output}`` in input order, ids ``"req_0"``, ``"req_1"`` ...; a request that could not run has
        its ``error`` set and the others are unaffected.
    """
    if max_batch_size is None:
        max_batch_size = max(1, min(DEFAULT_MAX_BATCH_SIZE, len(inputs)))
    stream = RequestStream(model, assistant_model=assistant_model, generation_config=generation_config,
                           max_batch_size=max_batch_size, **kwargs)
    ids = [stream.add(prompt, request_id=f"req_{index}") for index, prompt in enumerate(inputs)]
    results: dict[str, StreamOutput] = {}
    bar = _progress(len(ids), progress_bar)
    try:
        while stream.has_work or stream.done:
            if stream.has_work:
                stream.step()
            while stream.done:
                output = stream.done.popleft()
                if output.is_finished():
                    results[output.request_id] = output
                    if bar is not None:
                        bar.update(1)
    finally:
        stream.close()
        if bar is not None:
            bar.close()
    return {request_id: results[request_id] for request_id in ids}


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="requests", unit="req")


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
    :meth:`cancel_request`, :meth:`start`, :meth:`stop`, and ``with``.

    An exception inside a step fails the requests in flight with it (each output's ``error``); the manager goes on
    with the next requests. :attr:`last_error` keeps it.
    """

    def __init__(self, stream: RequestStream):
        self.stream = stream
        self._incoming: queue.Queue = queue.Queue()  # ("add", kwargs) | ("cancel", request_id)
        self._changed = threading.Condition()
        self._finished: dict[str, StreamOutput] = {}
        self._finished_order: deque[str] = deque()
        self._partials: dict[str, deque[StreamOutput]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.last_error: BaseException | None = None

    # -- running ---------------------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the background thread (once)."""
        if self.is_running():
            return
        self._stopping.clear()
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
        stream = self.stream
        try:
            while not self._stopping.is_set():
                self._take_incoming(block=not stream.has_work)
                if stream.has_work:
                    try:
                        stream.step()
                    except Exception as error:  # the stream failed the requests in flight; go on with the next
                        self.last_error = error
                self._publish()
        finally:
            for request in list(stream.waiting) + list(stream.live.values()):
                stream._fail(request, "the manager stopped")
            stream.waiting.clear()
            stream.live.clear()
            stream.close()
            self._take_incoming(block=False, refuse=True)
            self._publish()

    def _take_incoming(self, block: bool, refuse: bool = False) -> None:
        """Move queued requests and cancellations into the stream (waiting a little for one when idle)."""
        try:
            item = self._incoming.get(timeout=0.05) if block else self._incoming.get_nowait()
        except queue.Empty:
            return
        while item is not None or not self._incoming.empty():
            if item is not None:
                kind, value = item
                if kind == "add" and refuse:
                    self.stream.add(**value)
                    self.stream.cancel(value["request_id"], reason="the manager stopped")
                elif kind == "add":
                    self.stream.add(**value)
                else:
                    self.stream.cancel(value)
            try:
                item = self._incoming.get_nowait()
            except queue.Empty:
                break

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
        """Queue a request (a list of token ids); returns its id. Its output comes from :meth:`get_result` (or,
        with ``streaming``, partial outputs first from :meth:`request_id_iter`). ``temperature``, ``top_k``,
        ``top_p``: its own sampling settings, in a sampling stream."""
        if request_id is None:
            request_id = f"req_{next(self._ids)}"
        if isinstance(input_ids, torch.Tensor):
            input_ids = input_ids.tolist()
        self._incoming.put(("add", dict(input_ids=input_ids, request_id=request_id, max_new_tokens=max_new_tokens,
                                        eos_token_id=eos_token_id, streaming=streaming, temperature=temperature,
                                        top_k=top_k, top_p=top_p)))
        return request_id

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None) -> list[str]:
        return [self.add_request(prompt, max_new_tokens=max_new_tokens) for prompt in inputs]

    def cancel_request(self, request_id: str) -> None:
        """Stop a request: its row is freed for the next one; its output has status FAILED, error "cancelled"."""
        self._incoming.put(("cancel", request_id))

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> StreamOutput | None:
        """The next finished output (or ``request_id``'s), waiting up to ``timeout`` seconds; ``None`` if none
        came."""
        def ready() -> bool:
            return (request_id in self._finished) if request_id is not None else bool(self._finished_order)

        with self._changed:
            if not self._changed.wait_for(ready, timeout):
                return None
            if request_id is None:
                request_id = self._finished_order.popleft()
            else:
                self._finished_order.remove(request_id)
            self._partials.pop(request_id, None)
            return self._finished.pop(request_id)

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
            yield output
            if last:
                return
