"""The request stream (tetris_hf.stream, tetris_hf.continuous): every request's output equals the target alone, rows
joining mid-stream; bad requests, cancellation and failures stay with their own requests; nothing hangs or leaks."""

import gc
import threading
import time
import warnings

import pytest
import torch
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

import tetris_hf
import tetris_hf.logits.verification as verification
from tetris_hf.stream import RequestStream
from test_sampling_distribution import PROMPT, VOCAB, chi_square_p_value, exact_joint
from tiny_models import EOS, PAD, noisy_copy, random_prompts, sharpen, tiny_llama

STRATEGIES = ("tetris", "fixed", "adaptive", "dsd")


@pytest.fixture(scope="module")
def models():
    target = tiny_llama(seed=0)
    return target, noisy_copy(target, 0.3)


def alone(target, prompt, max_new_tokens, eos_token_id=None):
    """The target by itself on one unpadded prompt, greedy: its new tokens."""
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=eos_token_id, pad_token_id=PAD)
    return out[0, len(prompt):].tolist()


def requests(target, count, seed, max_prompt=40):
    """Prompts of 1 .. max_prompt tokens, each with its own max_new_tokens and, for every third, an end token the
    target emits on its way (so that row stops early)."""
    prompts = random_prompts(count, target.config.vocab_size, seed=seed, min_length=1, max_length=max_prompt)
    settings = []
    for index, prompt in enumerate(prompts):
        max_new = 3 + (index * 5) % 11
        eos = None
        if index % 3 == 0:
            eos = alone(target, prompt, max_new)[max_new // 2]  # the row ends there (or where it first occurs)
        settings.append((prompt, max_new, eos))
    return settings


def check_exact(target, stream, settings):
    ids = [stream.add(prompt, max_new_tokens=max_new, eos_token_id=eos) for prompt, max_new, eos in settings]
    outputs = {output.request_id: output for output in stream.run()}
    for request_id, (prompt, max_new, eos) in zip(ids, settings):
        output = outputs[request_id]
        assert output.error is None and output.status == RequestStatus.FINISHED
        assert output.generated_tokens == alone(target, prompt, max_new, eos), (request_id, prompt, max_new, eos)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("max_batch_size", [1, 3, 8])
def test_stream_rows_equal_target_alone_draft_model(models, strategy, max_batch_size):
    target, draft = models
    stream = RequestStream(target, assistant_model=draft, max_batch_size=max_batch_size, prefill_chunk=7,
                           eos_token_id=None, tetris_strategy=strategy, num_assistant_tokens=3)
    check_exact(target, stream, requests(target, 12, seed=max_batch_size))


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("max_batch_size", [1, 3, 8])
def test_stream_rows_equal_target_alone_lookup(models, strategy, max_batch_size):
    target, _ = models
    stream = RequestStream(target, max_batch_size=max_batch_size, prefill_chunk=5, eos_token_id=None,
                           tetris_strategy=strategy, prompt_lookup_num_tokens=4)
    check_exact(target, stream, requests(target, 12, seed=10 + max_batch_size))


@pytest.mark.parametrize("strategy", ["tetris", "fixed", "adaptive"])
@pytest.mark.parametrize("max_batch_size", [1, 3, 8])
def test_stream_rows_equal_target_alone_trees(models, strategy, max_batch_size):
    """Every row drafts a tree (two children per expanded node): rows joining mid-stream, prompts read in forwards
    of their own (a tree step's verification reads ancestor masks), exact."""
    target, draft = models
    stream = RequestStream(target, assistant_model=draft, max_batch_size=max_batch_size, prefill_chunk=7,
                           eos_token_id=None, tetris_strategy=strategy, num_assistant_tokens=3, tetris_tree_width=2)
    check_exact(target, stream, requests(target, 10, seed=30 + max_batch_size))


def test_stream_rows_equal_target_alone_reduced_draft_vocabulary(models):
    """The draft scoring 30 of the vocabulary's tokens (``tetris_draft_vocab``), rows joining mid-stream: exact."""
    target, draft = models
    stream = RequestStream(target, assistant_model=draft, max_batch_size=3, prefill_chunk=7, eos_token_id=None,
                           num_assistant_tokens=3, tetris_draft_vocab=torch.arange(2, 32))
    check_exact(target, stream, requests(target, 10, seed=50))


@pytest.mark.parametrize("pack", [True, False])
def test_packed_and_padded_prompt_reads_are_exact(models, pack):
    """Joining prompts are read packed where the model can be, padded otherwise: both exact, long prompts in several
    chunks."""
    target, draft = models
    stream = RequestStream(target, assistant_model=draft, max_batch_size=4, prefill_chunk=16, eos_token_id=None,
                           tetris_pack=pack)
    assert stream.loop.target_slots.pack is pack
    check_exact(target, stream, requests(target, 9, seed=5, max_prompt=120))


def test_long_joining_prompts_are_read_packed(models):
    """A joining prompt longer than a chunk is read at once, in forwards of its own that cost the target its own
    tokens only: the rows already decoding add no filler."""
    target, draft = models
    read = []
    handle = target.model.embed_tokens.register_forward_hook(lambda module, args, out: read.append(args[0].numel()))
    try:
        stream = RequestStream(target, assistant_model=draft, max_batch_size=2, prefill_chunk=32, eos_token_id=None)
        stream.add([5] * 3, max_new_tokens=30)
        stream.step()  # the first row decodes
        read.clear()
        stream.add(list(range(3, 53)), max_new_tokens=5)
        stream._admit()
    finally:
        handle.remove()
    assert read == [32, 17]  # the new prompt but its last token, in chunks, and nothing for the row already there


def test_a_joining_prompt_rides_in_the_verification_forward(models):
    """A prompt that fits a chunk costs no forward of its own: the step's one target forward verifies the decoding
    row's drafts and reads the whole prompt after them, and the new row joins at the end of that step with its first
    token; both finish exactly."""
    target, draft = models
    read = []
    stream = RequestStream(target, assistant_model=draft, max_batch_size=2, prefill_chunk=64, eos_token_id=None,
                           num_assistant_tokens=3, tetris_strategy="fixed")
    first = stream.add([5, 6, 7], max_new_tokens=30)
    stream.step()  # the first row decodes
    second = stream.add(list(range(3, 53)), max_new_tokens=12)
    handle = target.model.embed_tokens.register_forward_hook(lambda module, args, out: read.append(args[0].numel()))
    try:
        stream.step()
    finally:
        handle.remove()
    record = stream.loop.core.records[-1]
    assert read == [record.target_tokens + 50]  # one forward: the row's block, then the prompt
    assert stream.loop.batch.num_rows == 2 and stream.loop.progress([1])[1] == list(range(3, 53)) + [
        alone(target, list(range(3, 53)), 1)[0]]
    assert stream.live[1].output.first_token_time > 0
    outputs = {output.request_id: output for output in stream.run()}
    for request_id, prompt, new in ((first, [5, 6, 7], 30), (second, list(range(3, 53)), 12)):
        expected = target.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
        assert outputs[request_id].generated_tokens == expected


@pytest.mark.parametrize("prompt_length", [12, 50])
def test_a_riding_prompt_is_written_into_its_own_rows_first_slots(models, prompt_length):
    """A prompt riding in a verification forward goes to its new row's first slots (holes in it), not to the slots
    after the decoding rows' (where every other row took as many holes, and the cache grew): the decoding rows' block
    widens them by its own width only, a prompt longer than the cache widens it to the prompt. The new row holds its
    prompt at positions 0 .. L - 1, in slots 0 .. L - 1; both rows finish exactly."""
    target, draft = models
    stream = RequestStream(target, assistant_model=draft, max_batch_size=2, prefill_chunk=64, eos_token_id=None,
                           num_assistant_tokens=3, tetris_strategy="fixed")
    first = stream.add(list(range(5, 35)), max_new_tokens=30)
    stream.step()
    slots = stream.loop.core.target_slots
    before = slots.pointer
    prompt = list(range(3, 3 + prompt_length))
    second = stream.add(prompt, max_new_tokens=12)
    stream.step()
    record = stream.loop.core.records[-1]
    width = record.target_tokens  # (one row: its block, the last token and the verified drafts)
    assert slots.block_start <= before and slots.pointer == max(slots.block_start + width, prompt_length)
    new_row = stream.loop.batch.num_rows - 1
    assert slots.slot_mask[new_row, :prompt_length].all() and not slots.slot_mask[new_row, prompt_length:].any()
    assert slots.slot_positions[new_row, :prompt_length].tolist() == list(range(prompt_length))
    outputs = {output.request_id: output for output in stream.run()}
    assert outputs[first].generated_tokens == alone(target, list(range(5, 35)), 30)
    assert outputs[second].generated_tokens == alone(target, prompt, 12)


def test_prompts_riding_in_plain_steps_leave_no_span_behind(models):
    """A prompt riding in a step that verifies nothing (speculation off, or ``adaptive``'s plain steps) writes a block
    as wide as itself into every row's slots; the step hands the cache the batch's bound on the rows' lengths, so the
    holes it leaves are repacked as a drafting step's are, and every later step attends over at most that bound plus
    the holes allowed (before: each ride widened every later step by the prompt's width, 1.6-1.9x the attention of a
    plain step on the extraction stream). Outputs stay exact."""
    target, _ = models
    stream = RequestStream(target, max_batch_size=4, prefill_chunk=64, eos_token_id=None, prompt_lookup_num_tokens=3,
                           tetris_budget=0)
    settings = [([5, 6, 7], 40, None)] + [(list(range(3 + i, 48 + i)), 6, None) for i in range(5)]
    ids = [stream.add(settings[0][0], max_new_tokens=settings[0][1])]
    stream.step()
    slots, spans, forwards = stream.loop.core.target_slots, [], []
    handle = target.model.embed_tokens.register_forward_hook(lambda module, args, out: forwards.append(1))
    try:
        for prompt, max_new, _ in settings[1:]:
            ids.append(stream.add(prompt, max_new_tokens=max_new))
            forwards.clear()
            stream.step()
            assert len(forwards) == 1  # the prompt rode in the step's one forward
            spans.append(slots.pointer - stream.loop.batch.longest)
    finally:
        handle.remove()
    outputs = {output.request_id: output for output in stream.run()}
    assert max(spans) <= slots.max_holes, spans
    for request_id, (prompt, max_new, eos) in zip(ids, settings):
        assert outputs[request_id].generated_tokens == alone(target, prompt, max_new, eos)


def test_a_bad_request_fails_alone(models):
    target, draft = models
    stream = RequestStream(target, assistant_model=draft, max_batch_size=3, max_length=64, eos_token_id=None)
    good = requests(target, 4, seed=7, max_prompt=20)
    ids = {}
    for index, (prompt, max_new, eos) in enumerate(good):
        ids[stream.add(prompt, max_new_tokens=max_new, eos_token_id=eos)] = (prompt, max_new, eos)
        if index == 1:
            empty = stream.add([])
            too_long = stream.add(list(range(3, 63)) * 2)
            out_of_vocab = stream.add([3, 4, 10_000])
            negative = stream.add([3, -1])
            bad_budget = stream.add([3, 4], max_new_tokens=0)
    outputs = {output.request_id: output for output in stream.run()}
    for request_id, reason in ((empty, "empty"), (too_long, "max_length"), (out_of_vocab, "vocabulary"),
                               (negative, "vocabulary"), (bad_budget, "max_new_tokens")):
        assert outputs[request_id].status == RequestStatus.FAILED and reason in outputs[request_id].error
    for request_id, (prompt, max_new, eos) in ids.items():
        assert outputs[request_id].generated_tokens == alone(target, prompt, max_new, eos)


def test_a_request_too_long_for_its_new_tokens_stops_at_the_capacity(models):
    target, draft = models
    stream = RequestStream(target, assistant_model=draft, max_batch_size=2, max_length=30, eos_token_id=None)
    [output] = [stream.add(list(range(3, 28)), max_new_tokens=20)] and stream.run()
    assert len(output.generated_tokens) == 5  # up to 30 tokens in all
    assert output.generated_tokens == alone(target, list(range(3, 28)), 5)


def test_cancelling_frees_the_row_for_the_next_request(models):
    target, draft = models
    stream = RequestStream(target, assistant_model=draft, max_batch_size=1, eos_token_id=None)
    first = stream.add([5, 6, 7], max_new_tokens=200)
    second = stream.add([8, 9], max_new_tokens=6)
    stream.step()
    stream.step()
    stream.cancel(first)
    outputs = {output.request_id: output for output in stream.run()}
    cancelled = outputs[first]
    assert cancelled.status == RequestStatus.FAILED and cancelled.error == "cancelled"
    assert 0 < len(cancelled.generated_tokens) < 200
    assert cancelled.generated_tokens == alone(target, [5, 6, 7], 200)[: len(cancelled.generated_tokens)]
    assert outputs[second].generated_tokens == alone(target, [8, 9], 6)


def test_a_failing_step_fails_the_requests_in_flight_and_the_stream_goes_on(models):
    target, draft = models
    steps = []

    def fail_on_third_step(record, loop):
        steps.append(record)
        if len(steps) == 3:
            raise RuntimeError("injected fault")

    stream = RequestStream(target, assistant_model=draft, max_batch_size=2, eos_token_id=None,
                           tetris_step_callback=fail_on_third_step)
    first = [stream.add([5, 6, 7], max_new_tokens=40), stream.add([8, 9], max_new_tokens=40)]
    waiting = stream.add([10, 11, 12], max_new_tokens=5)
    with pytest.raises(RuntimeError, match="injected fault"):
        while stream.has_work:
            stream.step()
    failed = {output.request_id: output for output in stream.done}
    assert set(failed) == set(first)
    assert all(output.status == RequestStatus.FAILED and "injected fault" in output.error for output in failed.values())
    stream.done.clear()
    outputs = {output.request_id: output for output in stream.run()}  # the waiting request runs on a fresh loop
    assert outputs[waiting].generated_tokens == alone(target, [10, 11, 12], 5)


def test_refuses_what_it_cannot_stream(models):
    target, draft = models
    with pytest.raises(ValueError, match="needs a draft"):
        RequestStream(target)
    with pytest.raises(ValueError, match="max_batch_size"):
        RequestStream(target, assistant_model=draft, max_batch_size=0)
    with pytest.raises(TypeError, match="unknown arguments"):
        RequestStream(target, assistant_model=draft, not_an_option=1)


def test_generate_batch_returns_transformers_outputs_in_input_order(models):
    target, draft = models
    settings = requests(target, 7, seed=3)
    prompts = [prompt for prompt, _, _ in settings]
    results = tetris_hf.generate_batch(target, prompts, assistant_model=draft, max_new_tokens=9, max_batch_size=3,
                                       eos_token_id=None)
    assert list(results) == [f"req_{index}" for index in range(7)]
    for (request_id, output), prompt in zip(results.items(), prompts):
        assert isinstance(output, GenerationOutput) and output.request_id == request_id
        assert output.prompt_ids == prompt and output.is_finished()
        assert output.generated_tokens == alone(target, prompt, 9)
        assert output.lifespan[0] <= output.first_token_time <= output.lifespan[1]


def test_manager_serves_requests_from_other_threads(models):
    target, draft = models
    settings = requests(target, 6, seed=4)
    with tetris_hf.init_continuous_batching(target, assistant_model=draft, max_batch_size=2,
                                            eos_token_id=None) as manager:
        ids = {}

        def submit(chunk):
            for prompt, max_new, eos in chunk:
                ids[manager.add_request(prompt, max_new_tokens=max_new, eos_token_id=eos)] = (prompt, max_new, eos)

        threads = [threading.Thread(target=submit, args=(settings[i::2],)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        streamed = manager.add_request([7, 8, 9], max_new_tokens=12, streaming=True)
        partials = list(manager.request_id_iter(streamed))
        results = {request_id: manager.get_result(request_id, timeout=60) for request_id in ids}
    for request_id, (prompt, max_new, eos) in ids.items():
        assert results[request_id].generated_tokens == alone(target, prompt, max_new, eos)
    expected = alone(target, [7, 8, 9], 12)
    assert partials[-1].is_finished() and partials[-1].generated_tokens == expected
    assert len(partials) > 2 and all(not partial.is_finished() for partial in partials[:-1])
    for partial in partials[:-1]:  # each a prefix of the final output, growing
        assert partial.generated_tokens == expected[: len(partial.generated_tokens)]
    assert not manager.is_running()


def test_manager_cancel_and_a_failing_step_do_not_hang(models):
    target, draft = models
    calls = []

    def fail_once(record, loop):
        calls.append(record)
        if len(calls) == 4:
            raise RuntimeError("injected fault")

    manager = tetris_hf.init_continuous_batching(target, assistant_model=draft, max_batch_size=2, eos_token_id=None,
                                                 tetris_step_callback=fail_once)
    manager.start()
    try:
        long = manager.add_request([5, 6, 7], max_new_tokens=300)
        victim = manager.add_request([8, 9], max_new_tokens=300)
        time.sleep(0.05)
        manager.cancel_request(long)
        outputs = {request_id: manager.get_result(request_id, timeout=60) for request_id in (long, victim)}
        assert outputs[long].status == RequestStatus.FAILED
        assert outputs[victim].status == RequestStatus.FAILED  # cancelled too, or failed by the injected fault
        after = manager.add_request([10, 11], max_new_tokens=5)
        assert manager.get_result(after, timeout=60).generated_tokens == alone(target, [10, 11], 5)
    finally:
        manager.stop(block=True, timeout=60)
    assert not manager.is_running()
    leftover = tetris_hf.init_continuous_batching(target, assistant_model=draft, max_batch_size=1, eos_token_id=None)
    leftover.start()
    pending = leftover.add_request([5, 6], max_new_tokens=500)
    leftover.stop(block=True, timeout=60)
    output = leftover.get_result(pending, timeout=5)
    assert output is not None and output.status == RequestStatus.FAILED  # stopping fails it, nobody waits forever


def test_soak_many_small_requests_exact_and_memory_flat():
    """500 small requests through a 4-row stream: every output exact, and the live tensors do not grow."""
    target = tiny_llama(seed=3, hidden_size=16)
    draft = noisy_copy(target, 0.3)
    stream = RequestStream(target, assistant_model=draft, max_batch_size=4, eos_token_id=None)
    settings = [(prompt, 2 + index % 5) for index, prompt in
                enumerate(random_prompts(500, target.config.vocab_size, seed=9, min_length=1, max_length=12))]
    counts = []
    outputs = {}
    for start in range(0, 500, 100):
        ids = [stream.add(prompt, max_new_tokens=max_new) for prompt, max_new in settings[start : start + 100]]
        outputs.update({output.request_id: output for output in stream.run()})
        gc.collect()
        with warnings.catch_warnings():  # (isinstance on every object touches deprecated torch names)
            warnings.simplefilter("ignore")
            counts.append(sum(int(obj.numel()) for obj in gc.get_objects() if isinstance(obj, torch.Tensor)))
        assert len(ids) == 100
    assert counts[-1] <= counts[1] * 1.1, counts  # after warm-up, nothing piles up
    expected = {}
    for (prompt, max_new), request_id in zip(settings, sorted(outputs, key=lambda name: int(name.split("_")[1]))):
        expected[request_id] = alone(target, prompt, max_new)
    assert all(outputs[request_id].generated_tokens == tokens for request_id, tokens in expected.items())


SAMPLED_REQUESTS = 8000


def sampled_stream(target, draft, groups=((None, None),), seed=0):
    """The first 3 tokens of many sampled requests of one prompt through a stream whose rows join mid-stream (half
    the requests run 5 tokens, so the others join while they decode); a budget below the drafted cells. ``groups``:
    each request's own ``(temperature, top_p)`` in turn (``None``: the stream's, 1.0). Counts per group."""
    torch.manual_seed(seed)
    stream = RequestStream(target, assistant_model=draft, max_batch_size=500, do_sample=True, temperature=1.0,
                           top_p=1.0, top_k=0, eos_token_id=EOS, pad_token_id=PAD, num_assistant_tokens=1,
                           tetris_extra_tokens=1, tetris_budget=250)
    group_of = {}
    for index in range(SAMPLED_REQUESTS * len(groups)):
        temperature, top_p = groups[index % len(groups)]
        request_id = stream.add(PROMPT, max_new_tokens=3 if index % 2 else 5, temperature=temperature, top_p=top_p)
        group_of[request_id] = index % len(groups)
    counts = [{} for _ in groups]
    for output in stream.run():
        assert output.error is None, output.error
        first = (output.generated_tokens[:3] + [PAD] * 3)[:3]
        if EOS in first:
            first = first[: first.index(EOS) + 1] + [PAD] * (2 - first.index(EOS))
        group = counts[group_of[output.request_id]]
        group[tuple(first)] = group.get(tuple(first), 0) + 1
    return counts


@pytest.fixture(scope="module")
def sampling_pair():
    target = sharpen(tiny_llama(VOCAB, num_layers=2, seed=21, hidden_size=16), 12)
    draft = sharpen(tiny_llama(VOCAB, num_layers=1, seed=22, hidden_size=16), 12)
    return target, draft


def test_sampled_requests_joining_mid_stream_follow_the_target(sampling_pair, monkeypatch):
    target, draft = sampling_pair
    monkeypatch.setattr("test_sampling_distribution.ROWS", SAMPLED_REQUESTS)
    [counts] = sampled_stream(target, draft)
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0)) > 1e-3


def test_chi_square_catches_a_biased_verifier_in_the_stream(sampling_pair, monkeypatch):
    target, draft = sampling_pair
    monkeypatch.setattr("test_sampling_distribution.ROWS", SAMPLED_REQUESTS)
    monkeypatch.setattr(verification, "residual_distribution", lambda target_probs, draft_probs: (target_probs, None))
    [counts] = sampled_stream(target, draft)
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0)) < 1e-3


SETTINGS = ((0.7, None), (1.3, 0.8))  # two requests' own (temperature, top_p), interleaved in one stream


def test_each_request_samples_with_its_own_settings(sampling_pair, monkeypatch):
    target, draft = sampling_pair
    monkeypatch.setattr("test_sampling_distribution.ROWS", SAMPLED_REQUESTS)
    cool, hot = sampled_stream(target, draft, SETTINGS)
    assert chi_square_p_value(cool, exact_joint(target, 0.7, 1.0)) > 1e-3
    assert chi_square_p_value(hot, exact_joint(target, 1.3, 0.8)) > 1e-3


def test_chi_square_catches_settings_that_do_not_reach_their_rows(sampling_pair, monkeypatch):
    """Teeth: a warper that keeps the stream's settings for every row samples the cool requests too hot."""
    from tetris_hf.logits.row_sampling import RowSamplingWarper

    target, draft = sampling_pair
    monkeypatch.setattr("test_sampling_distribution.ROWS", SAMPLED_REQUESTS)
    monkeypatch.setattr(RowSamplingWarper, "set_row", lambda self, row, *settings: None)
    cool, _ = sampled_stream(target, draft, SETTINGS)
    assert chi_square_p_value(cool, exact_joint(target, 0.7, 1.0)) < 1e-3


def test_sampling_settings_are_checked_per_request(models):
    target, draft = models
    greedy = RequestStream(target, assistant_model=draft, eos_token_id=None)
    refused = greedy.add([3, 4], request_id="greedy", max_new_tokens=2, temperature=0.5)
    sampling = RequestStream(target, assistant_model=draft, eos_token_id=None, do_sample=True)
    bad = [sampling.add([3, 4], max_new_tokens=2, **setting) for setting in
           ({"temperature": 0.0}, {"top_k": -1}, {"top_p": 1.5})]
    fine = sampling.add([3, 4], max_new_tokens=2, temperature=0.9, top_k=5, top_p=0.9)
    outputs = {output.request_id: output for output in greedy.run() + sampling.run()}
    assert "greedily" in outputs[refused].error
    for request_id, name in zip(bad, ("temperature", "top_k", "top_p")):
        assert name in outputs[request_id].error
    assert outputs[fine].error is None and len(outputs[fine].generated_tokens) == 2


# -- EAGLE heads: a joining row's prompt features reach the head ------------------------------------------------------

@pytest.mark.parametrize("head_format,max_batch_size", [("eagle1", 1), ("eagle3", 3), ("eagle3", 8)])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stream_rows_equal_target_alone_eagle(tmp_path, head_format, max_batch_size, strategy, monkeypatch):
    """Prompts up to 20 tokens in chunks of 6: with rows decoding, some ride in a verification forward (the head takes
    their features from it), the others are read in forwards of their own."""
    from test_eagle_loop import load_pair

    from tetris_hf.loop_core import LoopCore

    rode = []
    core_step = LoopCore.step
    monkeypatch.setattr(LoopCore, "step", lambda core, joining=None: rode.append(
        0 if joining is None else joining.count) or core_step(core, joining))
    target, head = load_pair(tmp_path, "llama", head_format)
    stream = RequestStream(target, assistant_model=head, max_batch_size=max_batch_size, prefill_chunk=6,
                           eos_token_id=None, tetris_strategy=strategy, num_assistant_tokens=3)
    check_exact(target, stream, requests(target, 10, seed=20 + max_batch_size, max_prompt=20))
    assert sum(rode) < 10  # (the first rows join an empty stream: read at once)
    if max_batch_size == 3:  # (with one lane every row joins an empty batch; with 8, the two that join mid-stream
        assert sum(rode) > 0  # have long prompts)


@pytest.mark.parametrize("strategy", ["tetris", "fixed"])
def test_stream_rows_equal_target_alone_eagle_trees(tmp_path, strategy):
    from test_eagle_loop import load_pair

    target, head = load_pair(tmp_path, "llama", "eagle3")
    stream = RequestStream(target, assistant_model=head, max_batch_size=3, prefill_chunk=6, eos_token_id=None,
                           tetris_strategy=strategy, num_assistant_tokens=3, tetris_tree_width=2)
    check_exact(target, stream, requests(target, 10, seed=40, max_prompt=20))


def test_every_eagle_proposal_in_the_stream_equals_the_head_from_scratch(tmp_path, monkeypatch):
    """Rows join mid-stream with prompts read in several chunks; every row's drafts equal the head run alone on the
    row's tokens so far with the target's features: the prompt's features were queued in order."""
    from test_eagle_loop import accept_two_drafts, drafts_from_scratch, load_pair, record_proposals

    target, head = load_pair(tmp_path, "qwen2", "eagle3", dtype=torch.float64)
    proposals = record_proposals(monkeypatch)
    accept_two_drafts(monkeypatch)
    stream = RequestStream(target, assistant_model=head, max_batch_size=3, prefill_chunk=4, eos_token_id=None,
                           tetris_strategy="fixed", num_assistant_tokens=3, tetris_extra_tokens=0,
                           tetris_step_callback=lambda record, loop: None)  # (so that the drafts' log q are kept)
    for index, prompt in enumerate(random_prompts(6, 40, seed=8, min_length=2, max_length=13)):
        stream.add([3 + token for token in prompt], max_new_tokens=4 + 3 * index)
    stream.run()
    assert len(proposals) >= 6
    for tokens, log_q, context, lengths, rows in proposals:
        for row in range(tokens.shape[0]):
            row_context = context[row, : int(lengths[row])].tolist()
            expected, expected_log_q = drafts_from_scratch(target, head, row_context, tokens.shape[1])
            assert tokens[row].tolist() == expected, (row, row_context)
            torch.testing.assert_close(log_q[row].double(), expected_log_q.double(), atol=1e-4, rtol=1e-4)
