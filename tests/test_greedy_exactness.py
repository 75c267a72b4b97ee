"""Greedy TETRIS and fixed-k output equals the target alone, row by row, token for token."""

import pytest
import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tiny_models import target_and_draft, EOS, PAD, left_pad, noisy_copy, random_prompts, tiny_llama

NEW_TOKENS = 18


def target_alone(target, prompts, eos):
    """Each row generated on its own, without padding: the reference."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def pick_eos(target, prompts):
    """A token that the target emits mid-way in some (not all) rows, so those rows stop early."""
    continuations = target_alone(target, prompts, eos=EOS)
    for continuation in continuations:
        for token in continuation[3:8]:
            if sum(token in other for other in continuations) < len(continuations) or len(prompts) == 1:
                return token
    return EOS


def assert_rows_equal(sequences, input_ids, mask, references):
    width = mask.shape[1]
    for row, reference in enumerate(references):
        generated = sequences[row, width:].tolist()
        assert generated[: len(reference)] == reference, f"row {row} differs from the target alone"
        assert all(token == PAD for token in generated[len(reference):]), f"row {row} is not padded after it stopped"
    assert sequences.shape[1] == width + max(len(reference) for reference in references)
    assert torch.equal(sequences[:, :width], input_ids), "the prompt part differs from the input"


def generate_checked(target, draft, input_ids, mask, references, eos, **options):
    """TETRIS greedy output for ``options``, asserted equal to the references row by row; returns its stats."""
    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                          do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD,
                          return_dict_in_generate=True, **options)
    assert_rows_equal(out.sequences, input_ids, mask, references)
    stats = out.tetris_stats
    assert stats.emitted_tokens == sum(len(reference) for reference in references), options
    return stats


CASES = [  # (vocab, batch, seed, draft)
    (32, 1, 0, "noisy"),
    (32, 8, 1, "noisy"),
    (100, 3, 2, "independent"),
    (100, 8, 3, "same"),
    (1000, 4, 4, "noisy"),
    (1000, 8, 5, "noisy"),
    (257, 5, 6, "independent"),
]


@pytest.mark.parametrize("vocab,batch,seed,draft_kind", CASES)
def test_greedy_rows_equal_target_alone(vocab, batch, seed, draft_kind):
    target, draft = target_and_draft(vocab, seed, draft_kind, noise=0.4)
    prompts = random_prompts(batch, vocab, seed)
    eos = pick_eos(target, prompts)
    references = target_alone(target, prompts, eos)
    input_ids, mask = left_pad(prompts)
    k = 3
    runs = [dict(tetris_strategy="fixed", num_assistant_tokens=kk) for kk in (1, 3, 4)]
    for extra in range(4):
        for budget in (0, 1, batch, k * batch, batch * (k + extra) + 5):
            runs.append(dict(tetris_strategy="tetris", num_assistant_tokens=k, tetris_extra_tokens=extra,
                             tetris_budget=budget))
    runs.append(dict(num_assistant_tokens=k))  # default budget k x active rows
    accepted = 0
    for options in runs:
        stats = generate_checked(target, draft, input_ids, mask, references, eos, **options)
        if options.get("tetris_budget") == 0:
            assert stats.verified_tokens == 0 and stats.drafted_tokens == 0
        accepted += stats.accepted_tokens
    if draft_kind != "independent":
        assert accepted > 0  # the accept paths were exercised, not only rejections


def test_rows_that_reach_eos_stop_costing_verification():
    target = tiny_llama(64, seed=11)
    prompts = random_prompts(6, 64, seed=11)
    eos = pick_eos(target, prompts)
    references = target_alone(target, prompts, eos)
    assert min(map(len, references)) < NEW_TOKENS, "the test needs a row that stops early"
    input_ids, mask = left_pad(prompts)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=noisy_copy(target, 0.3),
                          custom_generate="tetris", max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD,
                          do_sample=False, return_dict_in_generate=True, tetris_strategy="fixed")
    assert_rows_equal(out.sequences, input_ids, mask, references)
    for row, reference in enumerate(references):
        steps_active = sum(1 for step in out.tetris_stats.verified_per_step if step[row] >= 0)
        assert steps_active <= len(reference)  # a row is never verified after it stopped


def test_unpadded_batch_without_attention_mask():
    target = tiny_llama(50, seed=3)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    references = target_alone(target, prompts, EOS)
    input_ids = torch.tensor(prompts)
    out = target.generate(input_ids, assistant_model=noisy_copy(target, 0.3), custom_generate="tetris",
                          do_sample=False, max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    assert_rows_equal(out, input_ids, torch.ones_like(input_ids), references)


def test_repetition_penalty_and_min_new_tokens_apply_per_row():
    target = tiny_llama(40, seed=8)
    prompts = random_prompts(4, 40, seed=8)
    eos = pick_eos(target, prompts)
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD,
                  repetition_penalty=1.7, min_new_tokens=5, no_repeat_ngram_size=3)
    references = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        references.append(target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)[0, len(prompt):].tolist())
    input_ids, mask = left_pad(prompts)
    out = target.generate(input_ids, attention_mask=mask, assistant_model=noisy_copy(target, 0.3),
                          custom_generate="tetris", **kwargs)
    assert_rows_equal(out, input_ids, mask, references)


def test_sequences_equal_plain_batched_generate():
    target = tiny_llama(80, seed=9)
    prompts = random_prompts(5, 80, seed=9)
    input_ids, mask = left_pad(prompts)
    eos = pick_eos(target, prompts)
    plain = target.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS,
                            eos_token_id=eos, pad_token_id=PAD)
    ours = target.generate(input_ids, attention_mask=mask, assistant_model=noisy_copy(target, 0.3),
                           custom_generate="tetris", do_sample=False, max_new_tokens=NEW_TOKENS,
                           eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(plain, ours)


def test_step_callback_sees_every_step_and_the_growing_outputs():
    target = tiny_llama(50, seed=12)
    prompts = random_prompts(3, 50, seed=12)
    input_ids, mask = left_pad(prompts)
    seen = []

    def callback(record, loop):
        seen.append((record.verify_lengths.tolist(), [len(row) for row in loop.partial_outputs()]))

    out = target.generate(input_ids, attention_mask=mask, assistant_model=noisy_copy(target, 0.3),
                          custom_generate="tetris", do_sample=False, max_new_tokens=10, pad_token_id=PAD,
                          eos_token_id=None, return_dict_in_generate=True, tetris_step_callback=callback)
    assert len(seen) == out.tetris_stats.steps
    lengths = [step[1] for step in seen]
    assert all(a <= b for before, after in zip(lengths, lengths[1:]) for a, b in zip(before, after))
    assert lengths[-1] == [input_ids.shape[1] + 10] * 3
