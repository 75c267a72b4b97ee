"""The live manager under generated traffic: random mixes of valid and malformed requests (any Python object as a
prompt, tensors of every dtype and shape, ids out of range, huge ints, bad lengths and end tokens, duplicate ids),
cancels at random points and injected step faults, sent from several threads at once.

Invariants, for every generated example: a malformed request raises ``TypeError``/``ValueError`` at ``add_request``
and a valid one is accepted (of several valid requests with one explicit id, exactly one); every accepted request gets
exactly one result, within a timeout; a finished one equals the target alone (greedy), a cancelled or faulted one holds
a prefix of it; the manager keeps running; after the module, no manager thread is left.

CI runs ``TETRIS_FUZZ_EXAMPLES`` examples (default 200, derandomized); a longer hunt:
``TETRIS_FUZZ_EXAMPLES=5000 python -m pytest -q tests/test_stream_fuzz.py`` (random seeds).
"""

import functools
import os
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers.generation.continuous_batching.requests import RequestStatus

import tetris_hf
from tiny_models import PAD, noisy_copy, tiny_llama

VOCAB, MAX_LENGTH, DEFAULT_NEW = 48, 40, 4
EXAMPLES = int(os.environ.get("TETRIS_FUZZ_EXAMPLES", "200"))
RESULT_TIMEOUT = 60.0
TARGET = tiny_llama(VOCAB, seed=11, hidden_size=16)
DRAFT = noisy_copy(TARGET, 0.3)


class FaultSwitch:
    """A step callback that raises once after :meth:`arm` (a fault in the shared step)."""

    def __init__(self):
        self.armed = threading.Event()

    def arm(self):
        self.armed.set()

    def __call__(self, record, loop):
        if self.armed.is_set():
            self.armed.clear()
            raise RuntimeError("injected step fault")


FAULT = FaultSwitch()


@pytest.fixture(scope="module")
def manager():
    before = set(threading.enumerate())
    manager = tetris_hf.init_continuous_batching(TARGET, assistant_model=DRAFT, max_batch_size=3,
                                                 max_length=MAX_LENGTH, max_new_tokens=DEFAULT_NEW,
                                                 eos_token_id=None, tetris_step_callback=FAULT)
    manager.start()
    yield manager
    manager.stop(block=True, timeout=60)
    assert not manager.is_running()
    # (other tests' long-lived streams, such as the Space's shared one, may run in this process: only new threads count)
    assert not [thread for thread in set(threading.enumerate()) - before if thread.name == "tetris-hf-stream"]


@functools.lru_cache(maxsize=None)
def alone(prompt: tuple, max_new_tokens: int, eos: tuple) -> list[int]:
    ids = torch.tensor([prompt])
    out = TARGET.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=list(eos) or None, pad_token_id=PAD)
    tokens = out[0, len(prompt):].tolist()
    for index, token in enumerate(tokens):  # (generate pads after an end token; the stream stops there)
        if token in eos:
            return tokens[: index + 1]
    return tokens


# -- requests ------------------------------------------------------------------------------------------------------

token = st.integers(0, VOCAB - 1)
prompts = st.lists(token, min_size=1, max_size=10)
INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
OTHER_DTYPES = [torch.bool, torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64]


@st.composite
def valid_prompts(draw):
    """A prompt in one of the accepted forms: a list, a tuple, a 1-D integer tensor."""
    prompt = draw(prompts)
    form = draw(st.sampled_from(["list", "tuple", "tensor"]))
    if form == "tensor":
        return prompt, torch.tensor(prompt, dtype=draw(st.sampled_from(INT_DTYPES)))
    return prompt, (tuple(prompt) if form == "tuple" else prompt)


@st.composite
def bad_tensors(draw):
    """Tensors no prompt can be: a non-integer dtype, not 1-D, empty, or an id outside the vocabulary."""
    kind = draw(st.sampled_from(["dtype", "shape", "empty", "range"]))
    if kind == "dtype":
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        return torch.zeros(shape, dtype=draw(st.sampled_from(OTHER_DTYPES)))
    if kind == "shape":
        shape = draw(st.sampled_from([(), (1, 2), (2, 3), (1, 1, 2)]))
        return torch.randint(0, VOCAB, shape, dtype=draw(st.sampled_from(INT_DTYPES)))
    if kind == "empty":
        return torch.zeros(0, dtype=torch.long)
    return torch.tensor(draw(prompts) + [draw(st.sampled_from([VOCAB, 127, -1, -(2 ** 40)]))])


huge = st.one_of(st.integers(min_value=VOCAB), st.integers(max_value=-1), st.integers(2 ** 63, 2 ** 90))
junk = st.one_of(st.none(), st.floats(allow_nan=True), st.text(max_size=4), st.binary(max_size=4),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=2), st.sets(token, max_size=3))
bad_prompts = st.one_of(
    junk.filter(lambda value: value is not None), huge, bad_tensors(), st.just([]),
    st.lists(huge, min_size=1, max_size=3),
    st.tuples(prompts, st.one_of(st.floats(), st.text(max_size=2), st.booleans(), st.none(), huge, st.lists(token)))
      .map(lambda pair: pair[0] + [pair[1]]),
    st.lists(prompts, min_size=2, max_size=3),  # a batch
    st.just(list(range(MAX_LENGTH))))  # too long for any new token
BAD_FIELDS = {
    "input_ids": bad_prompts,
    "max_new_tokens": st.one_of(st.integers(max_value=0), st.floats(), st.text(max_size=3), st.booleans(),
                                st.lists(st.integers(1, 5), max_size=2)),
    "eos_token_id": st.one_of(huge, st.floats(), st.text(max_size=3), st.booleans(),
                              st.lists(huge, min_size=1, max_size=2), st.dictionaries(st.text(max_size=1), token)),
    "request_id": st.one_of(st.integers(), st.just(""), st.floats(), st.lists(st.text(max_size=2), max_size=2)),
    "streaming": st.one_of(st.integers(), st.text(max_size=2), st.none()),
    "temperature": st.floats(0.1, 2.0),  # a greedy stream takes no sampling settings
}
EXPLICIT_IDS = ["a", "b", "req_1", "req_2"]


@st.composite
def valid_requests(draw):
    prompt, input_ids = draw(valid_prompts())
    max_new = draw(st.one_of(st.none(), st.integers(1, 6), st.integers(2 ** 40, 2 ** 70)))
    eos = draw(st.one_of(st.none(), token, st.lists(token, max_size=2)))
    kwargs = dict(input_ids=input_ids, max_new_tokens=max_new, eos_token_id=eos,
                  request_id=draw(st.one_of(st.none(), st.sampled_from(EXPLICIT_IDS))),
                  streaming=draw(st.booleans()))
    room = MAX_LENGTH - len(prompt)
    max_new = DEFAULT_NEW if max_new is None else min(max_new, room)
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    return "valid", kwargs, (tuple(prompt), max_new, eos)


@st.composite
def invalid_requests(draw):
    _, kwargs, _ = draw(valid_requests())
    field = draw(st.sampled_from(sorted(BAD_FIELDS)))
    kwargs[field] = draw(BAD_FIELDS[field])
    return "invalid", kwargs, field


operations = st.one_of(valid_requests(), valid_requests(), invalid_requests(), invalid_requests(),
                       st.tuples(st.just("cancel"), st.integers(0, 20), st.none()),
                       st.tuples(st.just("fault"), st.none(), st.none()))


class Ledger:
    """What the senders saw, shared by their threads."""

    def __init__(self):
        self.lock = threading.Lock()
        self.accepted: dict[str, tuple] = {}  # request id -> (prompt, max_new, eos)
        self.explicit: dict[str, list[bool]] = {}  # explicit id -> accepted?, one per valid request that gave it
        self.cancelled: set[str] = set()
        self.problems: list[str] = []


def send(manager, ops, ledger: Ledger, barrier: threading.Barrier):
    mine = []
    barrier.wait()
    for kind, payload, expected in ops:
        if kind == "cancel":
            target_id = mine[payload % len(mine)] if mine else "no-such-request"
            with ledger.lock:
                ledger.cancelled.add(target_id)
            manager.cancel_request(target_id)
        elif kind == "fault":
            FAULT.arm()
        elif kind == "invalid":
            try:
                request_id = manager.add_request(**payload)
            except (TypeError, ValueError):
                continue
            with ledger.lock:
                ledger.problems.append(f"accepted a request with a bad {expected}: {payload!r:.200} as {request_id}")
        else:
            explicit = payload["request_id"]
            try:
                request_id = manager.add_request(**payload)
            except ValueError as error:
                accepted = False
                if explicit is None or "already in use" not in str(error):
                    with ledger.lock:
                        ledger.problems.append(f"refused a valid request {payload!r:.200}: {error}")
            else:
                accepted = True
                mine.append(request_id)
                with ledger.lock:
                    if request_id in ledger.accepted:
                        ledger.problems.append(f"id {request_id} given twice")
                    ledger.accepted[request_id] = expected
            if explicit is not None:
                with ledger.lock:
                    ledger.explicit.setdefault(explicit, []).append(accepted)


@settings(max_examples=EXAMPLES, deadline=None, derandomize="TETRIS_FUZZ_EXAMPLES" not in os.environ,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(batches=st.lists(st.lists(operations, min_size=1, max_size=5), min_size=1, max_size=3))
def test_every_request_gets_one_result_and_valid_ones_are_exact(manager, batches):
    FAULT.armed.clear()
    ledger = Ledger()
    barrier = threading.Barrier(len(batches))
    senders = [threading.Thread(target=send, args=(manager, ops, ledger, barrier)) for ops in batches]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(timeout=RESULT_TIMEOUT)
        assert not sender.is_alive(), "add_request hung"
    assert ledger.problems == []
    for explicit, outcomes in ledger.explicit.items():
        assert outcomes.count(True) == 1, (explicit, outcomes)  # exactly one request holds an explicit id
    faulted = any(kind == "fault" for ops in batches for kind, _, _ in ops)
    for request_id, (prompt, max_new, eos) in ledger.accepted.items():
        result = manager.get_result(request_id, timeout=RESULT_TIMEOUT)
        assert result is not None, f"no result for {request_id}"
        expected = alone(prompt, max_new, eos)
        if result.status == RequestStatus.FINISHED:
            assert result.error is None and result.generated_tokens == expected, (request_id, prompt, max_new, eos)
        else:
            assert result.status == RequestStatus.FAILED
            allowed = (request_id in ledger.cancelled and result.error == "cancelled") or (
                faulted and "injected step fault" in result.error)
            assert allowed, (request_id, result.error)
            assert result.generated_tokens == expected[: len(result.generated_tokens)]
    assert manager.get_result(timeout=0.05) is None  # no request got a second result
    FAULT.armed.clear()
    assert manager.is_running()
