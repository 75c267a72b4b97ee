"""The request stream never loses a request: a bad request is refused at the door and its neighbours finish exactly,
ids are unique, ``generate_batch`` returns every input's result, a thread that ends fails what it held and refuses
what comes after, and a seed gives the same sampled tokens on a process's first call as on later ones."""

import threading
import time

import numpy as np
import pytest
import torch
from transformers.generation.continuous_batching.requests import RequestStatus

import tetris_hf
from tetris_hf import cost_model
from test_stream import alone
from tiny_models import PAD, noisy_copy, tiny_llama

VOCAB = 64


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(VOCAB, seed=0)
    return target, noisy_copy(target, 0.3)


def manager_for(models, **kwargs):
    target, draft = models
    return tetris_hf.init_continuous_batching(target, assistant_model=draft, eos_token_id=None,
                                              **{"max_batch_size": 3, **kwargs})


GOOD = [([5, 6, 7], 12), ([8, 9], 10), ([10, 11, 12, 13], 9), ([3], 11), ([20, 21], 8), ([30, 31, 32], 12)]


@pytest.mark.parametrize("bad, error, match", [
    (dict(input_ids={"a": 1}), TypeError, "input_ids must be a list"),
    (dict(input_ids={5, 6}), TypeError, "input_ids must be a list"),
    (dict(input_ids="5 6"), TypeError, "input_ids must be a list"),
    (dict(input_ids=[5, 6.0]), TypeError, "integers"),
    (dict(input_ids=[5, True]), TypeError, "integers"),
    (dict(input_ids=[[5, 6], [7, 8]]), ValueError, "not a batch"),
    (dict(input_ids=torch.tensor([[5, 6]])), ValueError, "1-D"),
    (dict(input_ids=torch.tensor([5.0, 6.0])), TypeError, "integer tensor"),
    (dict(input_ids=[5, 2**70]), ValueError, "vocabulary"),
    (dict(input_ids=[]), ValueError, "empty"),
    (dict(input_ids=[5], eos_token_id="x"), TypeError, "eos_token_id"),
    (dict(input_ids=[5], eos_token_id=1.5), TypeError, "eos_token_id"),
    (dict(input_ids=[5], eos_token_id=2**70), ValueError, "eos_token_id .* vocabulary"),
    (dict(input_ids=[5], eos_token_id=[3, -1]), ValueError, "vocabulary"),
    (dict(input_ids=[5], max_new_tokens=-3), ValueError, "max_new_tokens"),
    (dict(input_ids=[5], max_new_tokens=2.5), TypeError, "max_new_tokens"),
    (dict(input_ids=[5], max_new_tokens="8"), TypeError, "max_new_tokens"),
    (dict(input_ids=[5], streaming="yes"), TypeError, "streaming"),
    (dict(input_ids=[5], request_id=7), TypeError, "request_id"),
    (dict(input_ids=[5], temperature=0.5), ValueError, "greedily"),
])
def test_a_malformed_request_is_refused_at_add_request_and_its_neighbours_finish_exactly(models, bad, error, match):
    target, _ = models
    with manager_for(models) as manager:
        ids = {manager.add_request(prompt, max_new_tokens=max_new): (prompt, max_new) for prompt, max_new in GOOD[:3]}
        with pytest.raises(error, match=match):
            manager.add_request(**bad)
        ids.update({manager.add_request(prompt, max_new_tokens=max_new): (prompt, max_new)
                    for prompt, max_new in GOOD[3:]})
        results = {request_id: manager.get_result(request_id, timeout=60) for request_id in ids}
        assert manager.is_running() and manager.last_error is None
        assert manager.get_result(timeout=0.2) is None  # nothing else came out: the refused request left no trace
    for request_id, (prompt, max_new) in ids.items():
        assert results[request_id].status == RequestStatus.FINISHED
        assert results[request_id].generated_tokens == alone(target, prompt, max_new)


def test_an_eos_id_beyond_int64_is_refused_and_the_rows_decoding_beside_it_finish(models):
    target, _ = models
    with manager_for(models, max_batch_size=4) as manager:
        ids = [manager.add_request([5, 6, 7], max_new_tokens=30) for _ in range(3)]
        time.sleep(0.1)  # (the rows are decoding when the bad request comes)
        with pytest.raises(ValueError, match="eos_token_id"):
            manager.add_request([3, 4], max_new_tokens=5, eos_token_id=2**70)
        results = [manager.get_result(request_id, timeout=60) for request_id in ids]
    assert all(result.generated_tokens == alone(target, [5, 6, 7], 30) for result in results)


def test_accepted_tensor_and_array_prompts_equal_list_prompts(models):
    target, _ = models
    with manager_for(models) as manager:
        ids = [manager.add_request(torch.tensor([5, 6, 7]), max_new_tokens=6),
               manager.add_request(np.array([5, 6, 7], dtype=np.int32), max_new_tokens=6),
               manager.add_request([np.int64(5), 6, torch.tensor(7)], max_new_tokens=6, eos_token_id=torch.tensor(1))]
        results = [manager.get_result(request_id, timeout=60) for request_id in ids]
    assert [result.generated_tokens for result in results] == [alone(target, [5, 6, 7], 6)] * 2 + [
        alone(target, [5, 6, 7], 6, eos_token_id=1)]


def test_duplicate_ids_are_refused_and_generated_ids_never_collide_with_given_ones(models):
    target, _ = models
    with manager_for(models) as manager:
        given = manager.add_request([5, 6, 7], request_id="req_0", max_new_tokens=5)
        generated = manager.add_request([8, 9], max_new_tokens=5)
        assert generated != given
        with pytest.raises(ValueError, match="already in use"):
            manager.add_request([10, 11], request_id="req_0", max_new_tokens=5)
        mine = manager.add_request([10, 11], request_id="mine", max_new_tokens=5)
        with pytest.raises(ValueError, match="already in use"):
            manager.add_request([12], request_id="mine", max_new_tokens=5)
        results = {request_id: manager.get_result(request_id, timeout=60) for request_id in (given, generated, mine)}
        assert results[given].generated_tokens == alone(target, [5, 6, 7], 5)
        assert results[generated].generated_tokens == alone(target, [8, 9], 5)
        assert results[mine].generated_tokens == alone(target, [10, 11], 5)
        assert manager.get_result(timeout=0.2) is None
        again = manager.add_request([12], request_id="mine", max_new_tokens=3)  # its result taken: free again
        assert manager.get_result(again, timeout=60).generated_tokens == alone(target, [12], 3)


def test_a_request_the_thread_cannot_queue_fails_alone(models, monkeypatch):
    target, _ = models
    manager = manager_for(models)
    submit = manager.stream.submit

    def refuse_one(request):
        if request.request_id == "victim":
            raise RuntimeError("injected fault while queueing")
        return submit(request)

    monkeypatch.setattr(manager.stream, "submit", refuse_one)
    with manager:
        ids = [manager.add_request([5, 6, 7], max_new_tokens=6), manager.add_request([8, 9], request_id="victim"),
               manager.add_request([10, 11], max_new_tokens=6)]
        results = [manager.get_result(request_id, timeout=60) for request_id in ids]
        assert manager.is_running()
    assert results[1].status == RequestStatus.FAILED and "injected fault" in results[1].error
    assert results[0].generated_tokens == alone(target, [5, 6, 7], 6)
    assert results[2].generated_tokens == alone(target, [10, 11], 6)


def test_a_thread_that_ends_fails_what_it_held_and_refuses_what_comes_after(models, monkeypatch):
    manager = manager_for(models, max_batch_size=1)
    publish, calls = manager._publish, []

    def fail_later():  # a fault outside any step (in the manager's own bookkeeping)
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault outside a step")
        publish()

    monkeypatch.setattr(manager, "_publish", fail_later)
    manager.start()
    ids = [manager.add_request([5, 6, 7], max_new_tokens=400) for _ in range(3)]
    manager._thread.join(timeout=60)
    assert not manager.is_running()
    assert isinstance(manager.last_error, RuntimeError) and "outside a step" in str(manager.last_error)
    results = [manager.get_result(request_id, timeout=None) for request_id in ids]  # no wait: all ended
    assert all(result.status == RequestStatus.FAILED and "injected fault outside a step" in result.error
               for result in results)
    with pytest.raises(RuntimeError, match="stopped .*injected fault"):
        manager.add_request([5, 6])
    assert manager.get_result(timeout=None) is None  # nothing left, and no wait for what cannot come


def test_add_request_after_stop_raises_and_nothing_waits_forever(models):
    before = set(threading.enumerate())
    manager = manager_for(models)
    with manager:
        pending = manager.add_request([5, 6, 7], max_new_tokens=500)
    assert manager.get_result(pending, timeout=None).status == RequestStatus.FAILED
    with pytest.raises(RuntimeError, match="stopped"):
        manager.add_request([5, 6])
    assert manager.get_result("never-given", timeout=None) is None
    assert not [thread for thread in set(threading.enumerate()) - before if thread.name == "tetris-hf-stream"]


def test_generate_batch_gives_a_malformed_input_its_own_failed_output(models):
    target, draft = models
    inputs = [[5, 6, 7], {"a": 1}, [8, 9], [3, 2**70], [10, 11, 12]]
    results = tetris_hf.generate_batch(target, inputs, assistant_model=draft, max_new_tokens=6, max_batch_size=2,
                                       eos_token_id=None)
    assert list(results) == [f"req_{index}" for index in range(5)]
    for index in (1, 3):
        assert results[f"req_{index}"].status == RequestStatus.FAILED
    assert "list of token ids" in results["req_1"].error and "vocabulary" in results["req_3"].error
    for index in (0, 2, 4):
        assert results[f"req_{index}"].generated_tokens == alone(target, inputs[index], 6)


def test_generate_batch_keeps_finished_results_when_a_step_fails_mid_call(models):
    target, draft = models
    steps = []

    def fail_on_sixth_step(record, loop):
        steps.append(record)
        if len(steps) == 6:
            raise RuntimeError("injected step fault")

    inputs = [[5, 6, 7], [8, 9], [10, 11], [12, 13, 14], [15], [16, 17]]
    results = tetris_hf.generate_batch(target, inputs, assistant_model=draft, max_new_tokens=4, max_batch_size=2,
                                       eos_token_id=None, tetris_step_callback=fail_on_sixth_step)
    assert list(results) == [f"req_{index}" for index in range(len(inputs))]
    assert all(result.is_finished() for result in results.values())
    failed = [request_id for request_id, result in results.items() if result.status == RequestStatus.FAILED]
    assert failed and all("injected step fault" in results[request_id].error for request_id in failed)
    assert results["req_0"].status == RequestStatus.FINISHED  # finished before the fault, and kept
    for index in range(len(inputs)):
        if results[f"req_{index}"].status == RequestStatus.FINISHED:
            assert results[f"req_{index}"].generated_tokens == alone(target, inputs[index], 4)


SEEDED_CALLS = 4


@pytest.mark.parametrize("strategy", ["tetris", "fixed", "adaptive", "dsd"])
@pytest.mark.parametrize("source", ["draft", "lookup"])
def test_the_same_seed_gives_the_same_sampled_tokens_first_call_or_not(strategy, source, tmp_path, monkeypatch):
    monkeypatch.setenv("TETRIS_HF_CACHE", str(tmp_path))  # no profile cached: the first call measures one
    cost_model.clear_memory_cache()
    target = tiny_llama(VOCAB, seed=5)  # new model objects: nothing learnt about this pair yet, as in a new process
    draft = noisy_copy(target, 0.3) if source == "draft" else None
    extra = {"prompt_lookup_num_tokens": 3} if source == "lookup" else {"assistant_model": draft}
    ids = torch.tensor([[5, 6, 7, 5, 6, 7], [9, 10, 11, 12, 9, 10]])
    outputs = []
    for _ in range(SEEDED_CALLS):
        torch.manual_seed(1234)
        out = target.generate(ids, attention_mask=torch.ones_like(ids), custom_generate="tetris", do_sample=True,
                              max_new_tokens=24, tetris_strategy=strategy, pad_token_id=PAD, eos_token_id=None,
                              **extra)
        outputs.append(out.tolist())
    assert outputs == [outputs[0]] * SEEDED_CALLS
