"""``tetris_confidence_threshold``: a draft model's (or EAGLE head's) chain stops once every row's last draft is less
sure than the threshold, as transformers' ``assistant_confidence_threshold`` does at B = 1. Rows stay the target's own
(greedy, sampling), the chain is shorter where the draft is unsure, and bad settings are refused."""

import pytest
import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
import test_sampling_distribution as sampling
from test_eagle_loop import load_pair, prompts_for
from test_greedy_exactness import assert_rows_equal, pick_eos, target_alone
from tiny_models import EOS, PAD, left_pad, noisy_copy, random_prompts, sharpen, tiny_llama

VOCAB = 32


@pytest.fixture(scope="module")
def pair():
    target = sharpen(tiny_llama(vocab_size=VOCAB, num_layers=2, seed=7), 3.0)
    return target, noisy_copy(target, 0.4, seed=8)


def draft_forwards(draft) -> list:
    """Counts the draft's forwards (one per drafted token, plus catch-ups) as the loop runs."""
    calls = []
    draft.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("strategy", ["fixed", "tetris"])
def test_greedy_rows_equal_the_target_alone_and_unsure_chains_stop(pair, batch_size, strategy):
    target, draft = pair
    prompts = random_prompts(batch_size, VOCAB, seed=batch_size, min_length=2, max_length=8)
    eos = pick_eos(target, prompts) if batch_size > 1 else EOS
    references = target_alone(target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    outs = {}
    for threshold in (None, 0.6):
        outs[threshold] = target.generate(input_ids, attention_mask=mask, assistant_model=draft,
                                          custom_generate="tetris", do_sample=False, max_new_tokens=18,
                                          eos_token_id=eos, pad_token_id=PAD, num_assistant_tokens=4,
                                          tetris_strategy=strategy, tetris_confidence_threshold=threshold,
                                          return_dict_in_generate=True)
        assert_rows_equal(outs[threshold].sequences, input_ids, mask, references)
    full, stopped = outs[None].tetris_stats, outs[0.6].tetris_stats
    drafted_per_step = [k for k in stopped.num_drafted_per_step if k > 0]
    assert min(drafted_per_step) < max(full.num_drafted_per_step)  # some chains stopped early
    assert stopped.drafted_tokens < full.drafted_tokens * stopped.steps / full.steps


def test_an_eagle_heads_chain_stops_too(tmp_path):
    target, head = load_pair(tmp_path, "llama", "eagle1")
    prompts = prompts_for(3, seed=2)
    references = target_alone(target, prompts, EOS)
    input_ids, mask = left_pad(prompts)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=head, custom_generate="tetris",
                          do_sample=False, max_new_tokens=18, eos_token_id=EOS, pad_token_id=PAD,
                          tetris_confidence_threshold=0.999, return_dict_in_generate=True)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    assert max(out.tetris_stats.num_drafted_per_step) == 1  # a random head is never that sure: one draft a step


def test_a_stopped_chain_reads_fewer_draft_forwards(pair):
    target, draft = pair
    input_ids = torch.tensor([[3, 4, 5, 6]])
    forwards = draft_forwards(draft)
    target.generate(input_ids, assistant_model=draft, custom_generate="tetris", do_sample=False, max_new_tokens=12,
                    eos_token_id=None, pad_token_id=PAD, num_assistant_tokens=4, tetris_confidence_threshold=0.9999)
    stopped = len(forwards)
    forwards.clear()
    target.generate(input_ids, assistant_model=draft, custom_generate="tetris", do_sample=False, max_new_tokens=12,
                    eos_token_id=None, pad_token_id=PAD, num_assistant_tokens=4)
    assert stopped < len(forwards)


def test_sampled_sequences_follow_the_target_distribution_when_chains_stop():
    """Every chain stops after its first draft (no draft is that sure): lossless all the same, ``q`` of the one
    drafted cell against ``p``."""
    target = sharpen(tiny_llama(sampling.VOCAB, num_layers=2, seed=21, hidden_size=16), 12)
    draft = sharpen(tiny_llama(sampling.VOCAB, num_layers=1, seed=22, hidden_size=16), 12)
    counts, stats = sampling.sampled_joint(target, draft, 1.0, 1.0, "fixed", tetris_confidence_threshold=1 - 1e-9)
    assert max(stats.num_drafted_per_step) == 1 and 0 < stats.accepted_tokens < stats.verified_tokens
    assert sampling.chi_square_p_value(counts, sampling.exact_joint(target, 1.0, 1.0)) > 1e-3


@pytest.mark.parametrize("options,message", [
    ({"tetris_confidence_threshold": 1.0}, "in \\(0, 1\\)"),
    ({"tetris_confidence_threshold": 0}, "in \\(0, 1\\)"),
    ({"tetris_confidence_threshold": "0.4"}, "in \\(0, 1\\)"),
    ({"tetris_confidence_threshold": 0.4, "prompt_lookup_num_tokens": 3}, "prompt lookup"),
    ({"tetris_confidence_threshold": 0.4, "tetris_tree_width": 2}, "stops chains"),
])
def test_bad_settings_are_refused(pair, options, message):
    target, draft = pair
    with pytest.raises(ValueError, match=message):
        target.generate(torch.tensor([[3, 4, 5]]), assistant_model=draft, custom_generate="tetris",
                        max_new_tokens=4, pad_token_id=PAD, **options)
