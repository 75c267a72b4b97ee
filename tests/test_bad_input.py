"""Bad input is refused with a message naming the problem, before either model runs a forward."""

import pytest
import torch

import tetris_hf  # noqa: F401
from tiny_models import PAD, tiny_llama


@pytest.fixture(scope="module")
def models():
    return tiny_llama(40, seed=1), tiny_llama(40, num_layers=1, seed=2)


class ForwardCounter:
    def __init__(self, *models):
        self.count = 0
        self.handles = [model.register_forward_hook(self._hook) for model in models]

    def _hook(self, *_):
        self.count += 1

    def remove(self):
        for handle in self.handles:
            handle.remove()


def refused(models, error, match, input_ids=None, draft=..., **kwargs):
    target, default_draft = models
    draft = default_draft if draft is ... else draft
    input_ids = torch.tensor([[5, 6, 7], [8, 9, 10]]) if input_ids is None else input_ids
    counter = ForwardCounter(target, default_draft)
    try:
        with pytest.raises(error, match=match):
            target.generate(input_ids, assistant_model=draft, custom_generate="tetris", max_new_tokens=5,
                            pad_token_id=PAD, **kwargs)
    finally:
        counter.remove()
    assert counter.count == 0, "a model ran before the error"


def test_missing_draft(models):
    refused(models, ValueError, "assistant_model", draft=None)


def test_draft_with_another_vocabulary(models):
    refused(models, ValueError, r"vocabularies differ \(target 40 tokens, draft 41\)", draft=tiny_llama(41, seed=3))


@pytest.mark.parametrize("name,value,error", [
    ("tetris_budget", -1, ValueError),
    ("tetris_budget", 2.5, TypeError),
    ("num_assistant_tokens", 0, ValueError),
    ("num_assistant_tokens", "4", TypeError),
    ("tetris_extra_tokens", -2, ValueError),
    ("tetris_extra_tokens", 1.0, TypeError),
    ("tetris_strategy", "beam", ValueError),
])
def test_bad_option_values(models, name, value, error):
    refused(models, error, name, **{name: value})


def test_right_padded_batch(models):
    input_ids = torch.tensor([[5, 6, 7], [8, 9, PAD]])
    refused(models, ValueError, "left-padded", input_ids=input_ids, attention_mask=torch.tensor([[1, 1, 1], [1, 1, 0]]))


def test_all_padding_row(models):
    input_ids = torch.tensor([[5, 6, 7], [PAD, PAD, PAD]])
    refused(models, ValueError, r"row\(s\) \[1\].*all padding", input_ids=input_ids,
            attention_mask=torch.tensor([[1, 1, 1], [0, 0, 0]]))


def test_empty_prompt(models):
    refused(models, ValueError, "empty", input_ids=torch.zeros(2, 0, dtype=torch.long))


def test_static_cache(models):
    refused(models, ValueError, "cache", cache_implementation="static")


def test_beam_search(models):
    refused(models, ValueError, "beam", num_beams=2)


def test_output_scores(models):
    refused(models, ValueError, "output_scores", output_scores=True, return_dict_in_generate=True)


def test_greedy_with_several_return_sequences(models):
    refused(models, ValueError, "num_return_sequences", num_return_sequences=2, do_sample=False)


def test_streamer_with_batch(models):
    from transformers.generation.streamers import BaseStreamer

    refused(models, ValueError, "batch size 1", streamer=BaseStreamer())


def test_sampling_with_several_return_sequences_works(models):
    target, draft = models
    torch.manual_seed(0)
    out = target.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), assistant_model=draft, custom_generate="tetris",
                          do_sample=True, num_return_sequences=3, max_new_tokens=6, pad_token_id=PAD)
    assert out.shape == (6, 9)


def test_streamer_gets_every_token_once(models):
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks, self.ended = [], False

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.ended = True

    target, draft = models
    streamer = Collect()
    out = target.generate(torch.tensor([[5, 6, 7]]), assistant_model=draft, custom_generate="tetris",
                          do_sample=False, max_new_tokens=12, pad_token_id=PAD, eos_token_id=None, streamer=streamer)
    assert streamer.chunks[0] == [5, 6, 7] and streamer.ended
    assert sum(streamer.chunks[1:], []) == out[0, 3:].tolist()
