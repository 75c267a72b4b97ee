"""What a request of the stream is, and the checks it passes at the door (:func:`check_request`): every argument, by
type and by range, before anything is queued, so that what passes cannot fail later for what it brought. Refusals raise
``TypeError`` (a wrong kind) or ``ValueError`` (out of range) naming the argument.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.generation.continuous_batching.requests import GenerationOutput

from .logits.row_sampling import check_sampling

__all__ = ["RequestLimits", "StreamOutput", "StreamRequest", "check_request", "token_ids"]


@dataclass
class StreamOutput(GenerationOutput):
    """transformers' ``GenerationOutput`` (``request_id``, ``prompt_ids``, ``generated_tokens``, ``error``,
    ``status``, ``created_time``, ``lifespan``), plus when the request's first token came out (``perf_counter``
    time, -1 before)."""

    first_token_time: float = -1.0


@dataclass
class StreamRequest:
    """One request's settings (checked: :func:`check_request`) and progress (the scheduler's record)."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_ids: tuple[int, ...]
    streaming: bool = False
    sampling: tuple = (None, None, None)  # its own temperature, top_k, top_p (None: the stream's)
    output: StreamOutput = field(init=False)
    lane: int = -1

    def __post_init__(self):
        self.output = StreamOutput(request_id=self.request_id, prompt_ids=list(self.prompt_ids))


@dataclass(frozen=True)
class RequestLimits:
    """What a stream can serve, against which :func:`check_request` checks a request.

    ``vocab_size``: token ids and end tokens lie in ``0 .. vocab_size - 1``; ``max_length``: prompt and new tokens of
    one request at most; ``default_max_new_tokens`` (``None``: up to ``max_length``) and ``default_eos``: the stream's;
    ``sampling_defaults``: the stream's ``(temperature, top_k, top_p)``, ``None`` where a request may not set its own
    (``why_no_sampling`` says why)."""

    vocab_size: int
    max_length: int
    default_max_new_tokens: int | None
    default_eos: tuple[int, ...]
    sampling_defaults: tuple | None = None
    why_no_sampling: str = ""


def check_request(limits: RequestLimits, input_ids, request_id: str, max_new_tokens=None, eos_token_id=None,
                  streaming=False, temperature=None, top_k=None, top_p=None) -> StreamRequest:
    """The request these arguments describe, checked against ``limits``; raises ``TypeError`` or ``ValueError``
    naming the first bad argument.

    Args:
        input_ids: the prompt: a list (or tuple) of ints, or a 1-D integer tensor or array, at least one token.
        request_id: a non-empty string.
        max_new_tokens: a positive int, or ``None`` for the stream's default.
        eos_token_id: ``None`` (the stream's), an int, or a list / 1-D tensor of ints; ``[]`` for none.
        streaming: a bool.
        temperature, top_k, top_p: this request's sampling settings (``None``: the stream's).
    """
    if not isinstance(request_id, str) or not request_id:
        raise TypeError(f"request_id must be a non-empty string, got {request_id!r}")
    prompt = token_ids(input_ids, limits.vocab_size, "input_ids")
    if not prompt:
        raise ValueError("the request's prompt (input_ids) is empty: give at least one token")
    if len(prompt) + 1 > limits.max_length:
        raise ValueError(f"the prompt has {len(prompt)} tokens: the stream holds {limits.max_length} a request "
                         "(max_length), prompt and new tokens")
    if max_new_tokens is None:
        max_new_tokens = limits.default_max_new_tokens
    if max_new_tokens is None:
        max_new_tokens = limits.max_length - len(prompt)
    else:
        max_new_tokens = _index(max_new_tokens, "max_new_tokens")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    eos = limits.default_eos if eos_token_id is None else _eos_ids(eos_token_id, limits.vocab_size)
    if not isinstance(streaming, bool):
        raise TypeError(f"streaming must be True or False, got {streaming!r}")
    sampling = (temperature, top_k, top_p)
    _check_sampling(limits, sampling)
    return StreamRequest(request_id, prompt, max_new_tokens, eos, streaming, sampling)


def token_ids(value, vocab_size: int, name: str) -> list[int]:
    """``value`` (a list or tuple of ints, or a 1-D integer tensor / array) as a list of ints in
    ``0 .. vocab_size - 1``."""
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool or value.dtype.is_floating_point or value.dtype.is_complex:
            raise TypeError(f"{name} must hold token ids (an integer tensor), got a tensor of {value.dtype}")
        if value.dim() != 1:
            raise ValueError(f"{name} must be one prompt: a 1-D tensor, got shape {tuple(value.shape)} (add one "
                             "request per prompt)")
        value = value.tolist()
    elif hasattr(value, "tolist") and hasattr(value, "ndim") and not isinstance(value, (list, tuple)):  # numpy
        if value.ndim != 1:
            raise ValueError(f"{name} must be one prompt: a 1-D array, got {value.ndim} dimensions")
        value = value.tolist()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of token ids (ints) or a 1-D integer tensor, got "
                        f"{type(value).__name__}")
    ids = []
    for token in value:
        if isinstance(token, (list, tuple)) or isinstance(token, torch.Tensor) and token.dim() > 0:
            raise ValueError(f"{name} must be one list of token ids, not a batch (add one request per prompt)")
        ids.append(_index(token, f"{name}'s tokens"))
    bad = next((token for token in ids if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} in {name} is outside the model's vocabulary (0 .. {vocab_size - 1})")
    return ids


def _index(value, name: str) -> int:
    """``value`` as a Python int (ints, integer numpy / torch scalars), never a bool or a float."""
    if isinstance(value, bool) or isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        raise TypeError(f"{name} must be integers, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be integers, got {type(value).__name__} {value!r:.40}") from None


def _eos_ids(value, vocab_size: int) -> tuple[int, ...]:
    """A request's ``eos_token_id`` (an int, or a list / tensor of them) as a tuple of vocabulary ids."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        value = value.reshape(1)
    if isinstance(value, (list, tuple, torch.Tensor)) or hasattr(value, "ndim"):
        return tuple(token_ids(value, vocab_size, "eos_token_id"))
    token = _index(value, "eos_token_id")
    if not 0 <= token < vocab_size:
        raise ValueError(f"eos_token_id {token} is outside the model's vocabulary (0 .. {vocab_size - 1})")
    return (token,)


def _check_sampling(limits: RequestLimits, sampling: tuple) -> None:
    """Raise if a request's own ``(temperature, top_k, top_p)`` cannot be served."""
    if all(value is None for value in sampling):
        return
    if limits.sampling_defaults is None:
        raise ValueError(limits.why_no_sampling or "this stream cannot take per-request sampling settings")
    check_sampling(*(default if value is None else value for value, default in zip(sampling,
                                                                                    limits.sampling_defaults)))
