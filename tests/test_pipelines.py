"""``pipeline("text-generation", assistant_model=draft, custom_generate="tetris", batch_size=n)`` runs batches through
the TETRIS loop and returns what the plain pipeline returns (greedy), with no glue code in tetris_hf."""

import pytest
import torch
from transformers import TextStreamer, pipeline
from transformers.generation.streamers import BaseStreamer

import tetris_hf.generation
from tiny_models import noisy_copy, sharpen, tiny_llama
from tiny_tokenizer import tiny_tokenizer

PROMPTS = [
    "the quick brown fox",
    "hello",
    "what is the capital of france ?",
    "a speculative decoder drafts tokens and the target",
    "i am",
    "batched decoding runs many",
]
CHATS = [
    [{"role": "user", "content": "tell me a story"}],
    [{"role": "system", "content": "hello"}, {"role": "user", "content": "what is the capital of france ?"}],
    [{"role": "user", "content": "how are you today ?"}],
]


@pytest.fixture(scope="module")
def pair():
    tokenizer = tiny_tokenizer()
    target = sharpen(tiny_llama(len(tokenizer), seed=71), 4.0)
    draft = noisy_copy(target, 0.3, seed=72)
    return target, draft, tokenizer


@pytest.fixture
def loop_calls(monkeypatch):
    """Rows, options and (with ``return_dict_in_generate``) stats of every call into the TETRIS loop."""
    calls = []
    original = tetris_hf.generation.tetris_decoding

    def spy(model, input_ids, *args, **kwargs):
        calls.append({"rows": input_ids.shape[0], "options": kwargs["options"]})
        output = original(model, input_ids, *args, **kwargs)
        calls[-1]["stats"] = getattr(output, "tetris_stats", None)
        return output

    monkeypatch.setattr(tetris_hf.generation, "tetris_decoding", spy)
    return calls


def test_prompt_list_is_batched_through_loop_and_equals_plain_pipeline(pair, loop_calls):
    target, draft, tokenizer = pair
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft,
                           custom_generate="tetris", batch_size=4)
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer, batch_size=4)
    kwargs = dict(max_new_tokens=10, do_sample=False)
    outputs = speculative(PROMPTS, **kwargs, return_dict_in_generate=True)
    assert [call["rows"] for call in loop_calls] == [4, 2]  # batch_size=4 over 6 prompts
    assert all(call["stats"].accepted_tokens > 0 for call in loop_calls)  # drafts were really accepted
    assert outputs == plain(PROMPTS, **kwargs)
    assert outputs == pipeline("text-generation", model=target, tokenizer=tokenizer)(PROMPTS, **kwargs)  # unbatched
    assert all(len(output) == 1 and set(output[0]) == {"generated_text"} for output in outputs)


def test_chat_messages_are_batched_and_equal_plain_pipeline(pair, loop_calls):
    target, draft, tokenizer = pair
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft,
                           custom_generate="tetris", batch_size=3)
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer, batch_size=3)
    kwargs = dict(max_new_tokens=8, do_sample=False)
    outputs = speculative(CHATS, **kwargs)
    assert [call["rows"] for call in loop_calls] == [3]
    assert outputs == plain(CHATS, **kwargs)
    for chat, output in zip(CHATS, outputs):
        messages = output[0]["generated_text"]
        assert messages[:-1] == chat and messages[-1]["role"] == "assistant"


def test_token_ids_and_new_text_only_equal_plain_pipeline(pair):
    target, draft, tokenizer = pair
    kwargs = dict(max_new_tokens=8, do_sample=False, batch_size=8)
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft,
                           custom_generate="tetris")
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer)
    for extra in (dict(return_tensors=True), dict(return_full_text=False)):
        assert speculative(PROMPTS, **kwargs, **extra) == plain(PROMPTS, **kwargs, **extra)


def test_tetris_options_reach_the_loop_from_init_and_call(pair, loop_calls):
    target, draft, tokenizer = pair
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft,
                           custom_generate="tetris", batch_size=8, num_assistant_tokens=3, tetris_strategy="fixed")
    plain = pipeline("text-generation", model=target, tokenizer=tokenizer, batch_size=8)
    outputs = speculative(PROMPTS, max_new_tokens=8, do_sample=False, tetris_extra_tokens=1, tetris_budget=5)
    options = loop_calls[0]["options"]
    assert (options.num_assistant_tokens, options.tetris_strategy) == (3, "fixed")
    assert (options.tetris_extra_tokens, options.tetris_budget) == (1, 5)
    assert outputs == plain(PROMPTS, max_new_tokens=8, do_sample=False)


def test_right_padding_tokenizer_is_switched_to_left(pair):
    target, draft, tokenizer = pair
    tokenizer.padding_side = "right"
    try:
        speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft,
                               custom_generate="tetris", batch_size=8)
        assert tokenizer.padding_side == "left"  # TextGenerationPipeline does this itself
        plain = pipeline("text-generation", model=target, tokenizer=tokenizer, batch_size=8)
        assert speculative(PROMPTS, max_new_tokens=6, do_sample=False) == plain(PROMPTS, max_new_tokens=6,
                                                                                  do_sample=False)
    finally:
        tokenizer.padding_side = "left"


def test_sampling_with_several_return_sequences_works(pair, loop_calls):
    target, draft, tokenizer = pair
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft,
                           custom_generate="tetris", batch_size=4)
    torch.manual_seed(0)
    outputs = speculative(PROMPTS[:4], max_new_tokens=6, do_sample=True, num_return_sequences=3)
    assert [call["rows"] for call in loop_calls] == [12]  # 4 prompts x 3 sequences in one loop
    assert [len(output) for output in outputs] == [3, 3, 3, 3]
    for prompt, output in zip(PROMPTS, outputs):
        assert all(item["generated_text"].startswith(prompt) for item in output)


def test_greedy_with_several_return_sequences_is_refused(pair):
    target, draft, tokenizer = pair
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft,
                           custom_generate="tetris", batch_size=4)
    with pytest.raises(ValueError, match="num_return_sequences"):
        speculative(PROMPTS, max_new_tokens=4, do_sample=False, num_return_sequences=2)


class _Collect(BaseStreamer):
    """A streamer that accepts any batch (so only tetris_hf's own check can refuse it)."""

    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value)

    def end(self):
        pass


def test_streamer_with_batch_above_one_is_refused(pair):
    target, draft, tokenizer = pair
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft,
                           custom_generate="tetris", batch_size=4)
    for streamer in (TextStreamer(tokenizer), _Collect()):
        with pytest.raises(ValueError, match="a streamer needs batch size 1, got 4 rows"):
            speculative(PROMPTS, max_new_tokens=4, do_sample=False, streamer=streamer)


def test_streamer_at_batch_one_streams_the_generated_text(pair, capsys):
    target, draft, tokenizer = pair
    speculative = pipeline("text-generation", model=target, tokenizer=tokenizer, assistant_model=draft,
                           custom_generate="tetris")
    output = speculative(PROMPTS[0], max_new_tokens=8, do_sample=False, streamer=TextStreamer(tokenizer,
                                                                                              skip_prompt=True))
    streamed = capsys.readouterr().out.strip()
    new_text = output[0]["generated_text"][len(PROMPTS[0]):].strip()
    assert streamed and streamed == new_text
