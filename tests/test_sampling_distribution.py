"""Sampled TETRIS output follows the target's own distribution exactly (chi-square against the exact law)."""


import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

import tetris_hf  # noqa: F401
import tetris_hf.logits.verification as verification
from tiny_models import EOS, PAD, noisy_copy, sharpen, tiny_llama

VOCAB, NEW_TOKENS, ROWS = 6, 3, 12000
PROMPT = [3, 4, 5, 2]


def exact_joint(target, temperature, top_p):
    """P(first NEW_TOKENS tokens) under the processed target, EOS ending a row (later cells then hold PAD)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))

    def next_probs(prefix):
        ids = torch.tensor([PROMPT + list(prefix)])
        logits = target(ids).logits[:, -1].float()
        return warpers(ids, logits).softmax(-1)[0]

    joint = {}
    with torch.no_grad():
        def expand(prefix, probability):
            if len(prefix) == NEW_TOKENS or (prefix and prefix[-1] == EOS):
                joint[tuple(prefix) + (PAD,) * (NEW_TOKENS - len(prefix))] = probability
                return
            for token, p in enumerate(next_probs(prefix).tolist()):
                if p > 0:
                    expand(prefix + [token], probability * p)
        expand([], 1.0)
    return joint


def sampled_joint(target, draft, temperature, top_p, strategy, seed=0):
    torch.manual_seed(seed)
    input_ids = torch.tensor([PROMPT] * ROWS)
    out = target.generate(input_ids, assistant_model=draft, custom_generate="tetris", do_sample=True,
                          temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=NEW_TOKENS,
                          eos_token_id=EOS, pad_token_id=PAD, num_assistant_tokens=2, tetris_extra_tokens=1,
                          tetris_strategy=strategy, return_dict_in_generate=True)
    generated = out.sequences[:, len(PROMPT):]
    generated = torch.nn.functional.pad(generated, (0, NEW_TOKENS - generated.shape[1]), value=PAD)
    counts = {}
    for row in generated.tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts, out.tetris_stats


def chi_square_p_value(counts, joint):
    """Cells with an expected count below 5 are pooled into one bin."""
    unexpected = set(counts) - set(joint)
    assert not unexpected, f"sampled sequences of probability 0: {sorted(unexpected)[:3]}"
    observed, expected, pooled_observed, pooled_expected = [], [], 0, 0.0
    for cell, probability in joint.items():
        if probability * ROWS >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(probability * ROWS)
        else:
            pooled_observed += counts.get(cell, 0)
            pooled_expected += probability * ROWS
    if pooled_expected > 0:
        observed.append(pooled_observed)
        expected.append(pooled_expected)
    total = sum(expected)
    expected = [value * ROWS / total for value in expected]
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module")
def pair():
    target = sharpen(tiny_llama(VOCAB, num_layers=2, seed=21, hidden_size=16), 12)
    draft = sharpen(tiny_llama(VOCAB, num_layers=1, seed=22, hidden_size=16), 12)  # disagrees often
    return target, draft


@pytest.mark.parametrize("temperature,top_p,strategy", [
    (1.0, 1.0, "tetris"),
    (0.7, 1.0, "tetris"),
    (1.0, 0.8, "tetris"),
    (1.3, 1.0, "fixed"),
])
def test_sampled_sequences_follow_the_target_distribution(pair, temperature, top_p, strategy):
    target, draft = pair
    counts, stats = sampled_joint(target, draft, temperature, top_p, strategy)
    assert stats.accepted_tokens > 0 and stats.accepted_tokens < stats.verified_tokens  # both branches taken
    assert chi_square_p_value(counts, exact_joint(target, temperature, top_p)) > 1e-3


def test_chi_square_catches_a_verifier_that_skips_the_residual(pair, monkeypatch):
    """Teeth: sampling the correction from p instead of norm(max(p - q, 0)) is biased, and the test sees it."""
    target, draft = pair
    monkeypatch.setattr(verification, "residual_distribution", lambda target_probs, draft_probs: target_probs)
    counts, _ = sampled_joint(target, draft, 1.0, 1.0, "tetris")
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0)) < 1e-3


def test_high_acceptance_draft_is_also_lossless():
    target = sharpen(tiny_llama(VOCAB, num_layers=2, seed=23, hidden_size=16), 12)
    draft = noisy_copy(target, 0.3, seed=5)
    counts, stats = sampled_joint(target, draft, 1.0, 1.0, "tetris", seed=1)
    assert stats.verification_success_rate > 0.5
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0)) > 1e-3
