"""The half-precision check: rows that differ from the target alone only at near-ties pass, wrong tokens fail."""

import pytest
import torch

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf.tools.divergence import compare_outputs, first_difference, logit_tolerance, split_sequences
from tiny_models import PAD, greedy_alone, left_pad, noisy_copy, random_prompts, tiny_llama

VOCAB, NEW_TOKENS = 64, 12



def speculative(target, draft, prompts: list[list[int]]) -> list[list[int]]:
    input_ids, mask = left_pad(prompts)
    sequences = target.generate(input_ids, attention_mask=mask, assistant_model=draft, custom_generate="tetris",
                                do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                pad_token_id=PAD, num_assistant_tokens=3, tetris_extra_tokens=1)
    assert split_sequences(sequences, mask)[0] == prompts
    return split_sequences(sequences, mask)[1]


def test_tolerance_is_a_few_units_in_the_last_place_in_half_precision_and_zero_in_fp32():
    assert logit_tolerance(torch.bfloat16, 20.0) == 8 * 2**-7 * 16
    assert logit_tolerance(torch.bfloat16, -3.0) == 8 * 2**-7 * 2
    assert logit_tolerance(torch.float16, 20.0) == 8 * 2**-10 * 16
    assert logit_tolerance(torch.float32, 20.0) == 0.0


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # the speculative row ended early


def test_fp32_speculative_rows_are_identical():
    target = tiny_llama(VOCAB, num_layers=2, seed=31)
    prompts = random_prompts(4, VOCAB, seed=31, min_length=3)
    checks = compare_outputs(target, prompts, speculative(target, noisy_copy(target, 0.3), prompts),
                             greedy_alone(target, prompts, NEW_TOKENS))
    assert all(check.identical for check in checks)


def test_bf16_speculative_rows_equal_the_target_or_differ_at_near_ties():
    target = tiny_llama(VOCAB, num_layers=2, seed=32).to(torch.bfloat16)
    draft = noisy_copy(target, 0.3)
    prompts = random_prompts(6, VOCAB, seed=32, min_length=3)
    reference = greedy_alone(target, prompts, NEW_TOKENS)
    checks = compare_outputs(target, prompts, speculative(target, draft, prompts), reference)
    assert all(check.within_tolerance for check in checks), [check.describe() for check in checks]


def near_tie(dtype: torch.dtype):
    """A target whose first token after ``prompt`` has a twin one bf16 ulp of the head's scale away, the reference
    output, and the same output with the first token swapped for its twin (what rounding could have chosen)."""
    target = tiny_llama(VOCAB, num_layers=2, seed=33).to(dtype)
    prompt = [5, 9, 17, 4]
    first = greedy_alone(target, [prompt], NEW_TOKENS)[0][0]
    twin = (first + 1) % VOCAB
    with torch.no_grad():
        row = target.lm_head.weight[first]
        target.lm_head.weight[twin] = row + torch.finfo(torch.bfloat16).eps * row.abs().max() * torch.sign(row)
    reference = greedy_alone(target, [prompt], NEW_TOKENS)[0]
    assert reference[0] in (first, twin)
    return target, prompt, reference, [twin if reference[0] == first else first] + reference[1:]


def test_a_constructed_near_tie_passes_in_bf16():
    target, prompt, reference, flipped = near_tie(torch.bfloat16)
    (check,) = compare_outputs(target, [prompt], [flipped], [reference])
    assert check.position == 0 and check.speculative_token == flipped[0]
    assert 0 < check.gap == check.margin <= check.tolerance and check.within_tolerance, check.describe()


def test_a_draft_accepted_against_the_targets_clear_argmax_fails_in_bf16(monkeypatch):
    """Verification that accepts every draft: the output takes the draft's tokens where the target clearly disagrees."""

    def accept_every_draft(draft_tokens, verify_lengths, target_scores):
        return verify_lengths, target_scores.argmax(dim=-1).gather(1, verify_lengths[:, None]).squeeze(1)

    target = tiny_llama(VOCAB, num_layers=2, seed=34).to(torch.bfloat16)
    draft = tiny_llama(VOCAB, num_layers=1, seed=35).to(torch.bfloat16)  # agrees by chance only
    prompts = random_prompts(4, VOCAB, seed=34, min_length=3)
    reference = greedy_alone(target, prompts, NEW_TOKENS)
    monkeypatch.setattr("tetris_hf.logits.verification.verify_greedy", accept_every_draft)
    checks = compare_outputs(target, prompts, speculative(target, draft, prompts), reference)
    failing = [check for check in checks if not check.within_tolerance]
    assert failing, [check.describe() for check in checks]
    for check in failing:
        assert check.gap > check.tolerance > 0 and "NOT a near-tie" in check.describe()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_bench_fails_on_a_wrong_token_and_on_a_near_tie_only_in_fp32(dtype):
    import tetris_hf.tools.bench as bench

    class SpaceSeparatedIds:  # the bench encodes each differing row's text alone; here a text is its token ids
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [int(token) for token in text.split()]}

    target, prompt, reference, flipped = near_tie(dtype)
    with torch.no_grad():
        least_likely = int(target(torch.tensor([prompt + reference[:3]])).logits[0, -1].argmin())
    wrong = reference[:3] + [least_likely] + reference[4:]

    def run(name, outputs):
        return bench.RunResult(name, name, {}, 1, 1, 1.0, [], 0, 0, 0, 0, 0, 0.0, outputs)

    results = [run("generate", [reference]), run("tied", [flipped]), run("wrong", [wrong])]
    problems = bench.check_greedy_outputs(results, target, SpaceSeparatedIds(), [" ".join(map(str, prompt))])
    failed = [line.split(":")[0] for line in problems]
    assert failed == (["tied", "wrong"] if dtype == torch.float32 else ["wrong"])
    assert [results[i].agreement["divergences"][0]["position"] for i in (1, 2)] == [0, 3]
