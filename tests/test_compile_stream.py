"""``tetris_compile=True`` in a request stream: rows join and retire between compiled steps, every request's greedy
output equals the target alone, sampled ones follow the target's law, and the compiled forwards see a few shapes.

A stream's static caches hold ``max_batch_size`` rows; a step pads its live rows to the batch buckets of that size
(:func:`~tetris_hf.static_shapes.batch_bucket`), so rows joining and leaving change the shape only when the live count
crosses a bucket, never once per row count. Prompts are read eagerly, in forwards of their own. Real compiles (inductor
on the CPU) are few and small: one batch bucket (3 rows) in the exactness tests, two (16 rows) in the sampling one."""

import weakref

import pytest
import torch
from torch._dynamo.utils import counters

import tetris_hf
import tetris_hf.compiled as compiled
import tetris_hf.logits.verification as verification
from tetris_hf.static_shapes import batch_buckets
from tetris_hf.stream import RequestStream
from test_host_reads import host_reads
from test_sampling_distribution import PROMPT, VOCAB, chi_square_p_value, exact_joint
from test_static_shapes import (assert_static, block_widths, recorder,  # noqa: F401  (fixtures)
                               static_shapes_on_the_cpu)  # (autouse: the static path, pinned on the CPU)
from test_stream import alone, check_exact, requests
from tiny_models import EOS, PAD, noisy_copy, sharpen, tiny_llama

# (target block widths on the CPU: k + e + 1 at most)
STRATEGIES = {"tetris": dict(tetris_strategy="tetris", num_assistant_tokens=2, tetris_extra_tokens=1),
              "fixed": dict(tetris_strategy="fixed", num_assistant_tokens=2),
              "adaptive": dict(tetris_strategy="adaptive", num_assistant_tokens=2),
              "plain": dict(tetris_budget=0)}


@pytest.fixture
def fresh_dynamo():
    """Each compiled test counts its own graphs (and never meets dynamo's cache limit filled by earlier tests)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_compiled_stream_rows_equal_target_alone(name, fresh_dynamo):
    """10 requests through 3 rows (prompts of 1-40 tokens, 3-13 new tokens, every third stopping at an end token on
    its way): each equals the target alone. Graphs per call: 3 rows are one batch bucket, so at most the target's
    k + e + 1 block widths and the draft's 2 (its pending block, then one token), however the rows come and go."""
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.3)
    options = STRATEGIES[name]
    stream = RequestStream(target, assistant_model=draft, max_batch_size=3, prefill_chunk=7, eos_token_id=None,
                           tetris_compile=True, **options)
    check_exact(target, stream, requests(target, 10, seed=60))
    widths = options.get("num_assistant_tokens", 0) + options.get("tetris_extra_tokens", 0) + 1
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1 if name == "plain" else 0 < graphs <= widths + 2, (name, dict(counters["stats"]))


def test_generate_batch_and_the_manager_run_compiled(fresh_dynamo):
    """transformers' call shapes over the compiled stream: ``generate_batch`` on this thread and the manager on its
    own (dynamo compiling there), every output the target alone's."""
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.3)
    options = dict(assistant_model=draft, max_batch_size=3, eos_token_id=None, tetris_compile=True,
                   **STRATEGIES["fixed"])
    settings = requests(target, 5, seed=62)
    results = tetris_hf.generate_batch(target, [prompt for prompt, _, _ in settings], max_new_tokens=6, **options)
    for (prompt, _, _), output in zip(settings, results.values()):
        assert output.error is None and output.generated_tokens == alone(target, prompt, 6)
    with tetris_hf.init_continuous_batching(target, **options) as manager:
        ids = {manager.add_request(prompt, max_new_tokens=max_new, eos_token_id=eos): (prompt, max_new, eos)
               for prompt, max_new, eos in settings}
        outputs = {request_id: manager.get_result(request_id, timeout=300) for request_id in ids}
    for request_id, (prompt, max_new, eos) in ids.items():
        assert outputs[request_id].generated_tokens == alone(target, prompt, max_new, eos)
    assert counters["stats"]["unique_graphs"] > 0


def test_rows_joining_and_leaving_keep_the_shapes_few(recorder, block_widths):
    """40 requests through 16 rows, the live count going up and down all along: the target sees at most its block
    widths x the 2 batch buckets (16, 4), the draft 2 x 2, one KV width; every row exact. (Compiling replaced by a
    recorder: the shapes are the point here.)"""
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.3)
    stream = RequestStream(target, assistant_model=draft, max_batch_size=16, prefill_chunk=9, eos_token_id=None,
                           tetris_compile=True, num_assistant_tokens=3, tetris_extra_tokens=2)
    check_exact(target, stream, requests(target, 40, seed=61))
    widths = block_widths(3 + 2 + 1)
    assert_static(recorder.of(target), widths, 16)
    assert_static(recorder.of(draft), {1, 2}, 16)
    assert {shape[0][0] for shape in recorder.of(target)} == set(batch_buckets(16)) == {16, 4}
    assert len(recorder.of(target)) <= len(widths) * 2 and len(recorder.of(draft)) <= 4


@pytest.mark.parametrize("drafts", ["lookup", "draft model"])
def test_joining_prompts_are_read_packed_not_padded_over_the_live_rows(recorder, drafts):
    """A compiled stream reads a joining prompt eagerly, in forwards of its own: packed, the target (and a draft
    model) computes the prompt's tokens only, not a block as wide as the prompt for every live row (which made each
    join cost up to ``max_batch_size`` times its prompt on the CPU); every row exact. (Compiled forwards replaced by
    the recorder, which calls the forward function past the hooks that count the eager forwards' tokens here.)"""
    target = tiny_llama(seed=0)
    settings = requests(target, 24, seed=62)
    speculative = dict(prompt_lookup_num_tokens=2)
    counted = {"target": target}
    if drafts == "draft model":
        counted["draft"] = noisy_copy(target, 0.3)
        speculative = dict(assistant_model=counted["draft"], num_assistant_tokens=2)
    tokens = {name: [] for name in counted}
    hooks = [model.register_forward_pre_hook(
        lambda module, args, kwargs, read=tokens[name]: read.append(kwargs["input_ids"].numel()), with_kwargs=True)
        for name, model in counted.items()]
    stream = RequestStream(target, max_batch_size=8, prefill_chunk=64, eos_token_id=None, tetris_compile=True,
                           **speculative)
    try:
        ids = [stream.add(prompt, max_new_tokens=max_new, eos_token_id=eos) for prompt, max_new, eos in settings]
        outputs = {output.request_id: output.generated_tokens for output in stream.run()}
    finally:
        for hook in hooks:
            hook.remove()
    # each prompt is read but its last token (which opens the row's first step), some with rows decoding beside it
    prompt_tokens = sum(len(prompt) - 1 for prompt, _, _ in settings)
    for name, read in tokens.items():
        assert len(read) > 1 and sum(read) == prompt_tokens, (name, read)
    for request_id, (prompt, max_new, eos) in zip(ids, settings):
        assert outputs[request_id] == alone(target, prompt, max_new, eos)


def test_a_row_outgrowing_the_static_capacity_doubles_it_and_stays_exact(recorder):
    """A stream's caches start small (256 slots when static): a row that needs more doubles it (a second KV width, so
    new graphs, once), exactly."""
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.3)
    stream = RequestStream(target, assistant_model=draft, max_batch_size=2, eos_token_id=None, tetris_compile=True,
                           num_assistant_tokens=2)
    long_prompt = [3 + index % 60 for index in range(200)]
    check_exact(target, stream, [(long_prompt, 80, None), ([5, 6, 7], 20, None)])
    assert {shape[1][-1] for shape in recorder.of(target)} == {256, 512}


def test_a_steady_compiled_stream_step_reads_the_device_at_most_twice(monkeypatch):
    """Rows of their own lengths and limits, none joining or leaving: the block length (with the caches' fill levels)
    and how many rows stopped. (The compiled forwards stand in by the eager ones on the same static shapes.)"""
    monkeypatch.setattr(compiled, "_COMPILED", weakref.WeakKeyDictionary())
    monkeypatch.setattr(compiled.torch, "compile", lambda forward, **options: forward)
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.3)
    rows_left = []

    def step_done(record, loop):
        rows_left.append(bool(loop.finished))  # (rows leaving: their tokens to the host, not a steady step)
        reads.step_done()

    with host_reads.HostReads() as reads:
        stream = RequestStream(target, assistant_model=draft, max_batch_size=4, eos_token_id=None,
                               tetris_compile=True, tetris_step_callback=step_done)
        for length in (3, 5, 8, 13):
            stream.add(list(range(3, 3 + length)), max_new_tokens=30)
        stream.run()
    steady = [count for count, left in zip(reads.per_step, rows_left) if not left][1:]  # (after the first)
    assert len(steady) >= 5 and max(steady) <= 2, (reads.per_step, rows_left)


def sampled_compiled_stream(target, draft, requests: int) -> dict:
    """The first 3 tokens of ``requests`` sampled requests of one prompt through a compiled stream of 16 rows (half
    run 5 tokens, so the others join while they decode; a budget below the drafted cells): counts per sequence."""
    torch.manual_seed(0)
    stream = RequestStream(target, assistant_model=draft, max_batch_size=16, do_sample=True, temperature=1.0,
                           top_p=1.0, top_k=0, eos_token_id=EOS, pad_token_id=PAD, num_assistant_tokens=1,
                           tetris_extra_tokens=1, tetris_budget=8, tetris_compile=True)
    for index in range(requests):
        stream.add(PROMPT, max_new_tokens=3 if index % 2 else 5)
    counts = {}
    for output in stream.run():
        assert output.error is None, output.error
        first = (output.generated_tokens[:3] + [PAD] * 3)[:3]
        if EOS in first:
            first = first[: first.index(EOS) + 1] + [PAD] * (2 - first.index(EOS))
        counts[tuple(first)] = counts.get(tuple(first), 0) + 1
    return counts


SAMPLED_REQUESTS = 2000


@pytest.mark.parametrize("skip_residual", [False, True])
def test_compiled_stream_samples_the_target_distribution(monkeypatch, fresh_dynamo, skip_residual):
    """Chi-square of the first 3 sampled tokens against the exact target law; its negative control (the correction
    sampled from p instead of norm(max(p - q, 0))) fails it."""
    target = sharpen(tiny_llama(VOCAB, num_layers=2, seed=21, hidden_size=16), 12)
    draft = sharpen(tiny_llama(VOCAB, num_layers=1, seed=22, hidden_size=16), 12)
    monkeypatch.setattr("test_sampling_distribution.ROWS", SAMPLED_REQUESTS)
    if skip_residual:
        monkeypatch.setattr(verification, "residual_distribution", lambda target, draft: (target, None))
    counts = sampled_compiled_stream(target, draft, SAMPLED_REQUESTS)
    p_value = chi_square_p_value(counts, exact_joint(target, 1.0, 1.0))
    assert 0 < counters["stats"]["unique_graphs"] <= (3 + 2) * len(batch_buckets(16))
    assert (p_value < 1e-3) if skip_residual else (p_value > 1e-3), p_value


def test_a_compiled_stream_refuses_a_quantized_target():
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.3)
    target.config.quantization_config = {"load_in_4bit": True}
    with pytest.raises(ValueError, match="quantized"):
        RequestStream(target, assistant_model=draft, tetris_compile=True)


def test_a_failing_compiled_step_fails_its_requests_and_the_stream_goes_on(recorder, monkeypatch):
    """A fault in a compiled step fails the requests decoding in it, with the error; a later request runs on a fresh
    loop, exactly."""
    target = tiny_llama(seed=0)
    draft = noisy_copy(target, 0.3)
    stream = RequestStream(target, assistant_model=draft, max_batch_size=2, eos_token_id=None, tetris_compile=True)
    first = [stream.add([5, 6, 7], max_new_tokens=8), stream.add([9, 10], max_new_tokens=8)]
    stream.step()
    slots = stream.loop.target_slots
    monkeypatch.setattr(slots, "_step_forward", lambda **inputs: (_ for _ in ()).throw(RuntimeError("injected")))
    with pytest.raises(RuntimeError, match="injected"):
        stream.step()
    failed = {output.request_id: output for output in stream.done}
    assert set(failed) == set(first) and all("injected" in output.error for output in failed.values())
    stream.done.clear()
    later = stream.add([11, 12, 13], max_new_tokens=6)
    outputs = {output.request_id: output for output in stream.run()}
    assert outputs[later].generated_tokens == alone(target, [11, 12, 13], 6)
