"""Sampled TETRIS output follows the target's own distribution exactly (chi-square against the exact law)."""


import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

import tetris_hf  # noqa: F401
import tetris_hf.logits.verification as verification
from tetris_hf.candidate_generators import BatchedDraftCandidateGenerator
from tetris_hf.cost_model import CostProfile
from tiny_models import EOS, PAD, noisy_copy, sharpen, tiny_llama

VOCAB, NEW_TOKENS, ROWS = 6, 3, 12000
PROMPT = [3, 4, 5, 2]
# verification costs a little per token: adaptive drafts and verifies part of what it drafted
CHEAP_VERIFY = CostProfile({(r, t): 10.0 + 0.001 * r * t for r in (1, 1024, 16384) for t in (1, 2, 4)},
                           {r: 0.01 for r in (1, 1024, 16384)})


def exact_joint(target, temperature, top_p, new_tokens=NEW_TOKENS):
    """P(first ``new_tokens`` tokens) under the processed target, EOS ending a row (later cells then hold PAD)."""
    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))

    def next_probs(prefix):
        ids = torch.tensor([PROMPT + list(prefix)])
        logits = target(ids).logits[:, -1].float()
        return warpers(ids, logits).softmax(-1)[0]

    return enumerated_joint(next_probs, new_tokens, EOS, PAD)


def enumerated_joint(next_probs, new_tokens: int, eos: int, pad: int) -> dict:
    """Every continuation of ``new_tokens`` tokens with its probability, ``next_probs(prefix)`` ``(V,)`` giving each
    next token's: a row ends at ``eos`` (its later cells then hold ``pad``)."""
    joint = {}
    with torch.no_grad():
        def expand(prefix, probability):
            if len(prefix) == new_tokens or (prefix and prefix[-1] == eos):
                joint[tuple(prefix) + (pad,) * (new_tokens - len(prefix))] = probability
                return
            for token, p in enumerate(next_probs(prefix).tolist()):
                if p > 0:
                    expand(prefix + [token], probability * p)
        expand([], 1.0)
    return joint


def sampled_joint(target, draft, temperature, top_p, strategy, seed=0, new_tokens=NEW_TOKENS, **options):
    torch.manual_seed(seed)
    input_ids = torch.tensor([PROMPT] * ROWS)
    options = {"num_assistant_tokens": 2, "tetris_extra_tokens": 1, **options}
    out = target.generate(input_ids, assistant_model=draft, custom_generate="tetris", do_sample=True,
                          temperature=temperature, top_p=top_p, top_k=0, max_new_tokens=new_tokens,
                          eos_token_id=EOS, pad_token_id=PAD, tetris_strategy=strategy, return_dict_in_generate=True,
                          **options)
    generated = out.sequences[:, len(PROMPT):]
    generated = torch.nn.functional.pad(generated, (0, new_tokens - generated.shape[1]), value=PAD)
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


# A budget below the drafted cells makes selection choose which drafts are verified. That choice must not depend on
# the sampled draft tokens themselves (a row verifying its draft more often when the draft sampled a likely token
# is biased towards that token); it may depend on the draft's distributions and on earlier tokens. Four new tokens:
# the second step drafts two per row, so selection also decides how deep a row goes.
@pytest.mark.parametrize("strategy,options", [
    ("tetris", {"num_assistant_tokens": 1, "tetris_extra_tokens": 0, "tetris_budget": ROWS // 2}),
    ("tetris", {"num_assistant_tokens": 1, "tetris_extra_tokens": 1, "tetris_budget": ROWS}),
    ("adaptive", {"num_assistant_tokens": 1, "tetris_extra_tokens": 1, "tetris_budget": ROWS,
                  "tetris_cost_profile": CHEAP_VERIFY}),
])
def test_a_partial_budget_is_still_lossless(pair, strategy, options):
    target, draft = pair
    counts, stats = sampled_joint(target, draft, 1.0, 1.0, strategy, new_tokens=4, **options)
    assert 0 < stats.verified_tokens < stats.drafted_tokens  # selection left drafts out
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0, new_tokens=4)) > 1e-3


def test_chi_square_catches_selection_by_the_sampled_tokens_probability(pair, monkeypatch):
    """Teeth: ranking cells by the probability of the token the draft happened to sample is biased."""
    target, draft = pair
    real_propose = BatchedDraftCandidateGenerator.propose

    def rank_by_sampled_token(self, sequences, lengths, num_tokens, rows=None, confidences=True, **options):
        proposal = real_propose(self, sequences, lengths, num_tokens, rows, confidences, **options)
        if proposal.probs is None:  # nothing drafted
            return proposal
        return proposal._replace(log_probs=proposal.probs.gather(2, proposal.tokens[..., None]).squeeze(2).log())

    monkeypatch.setattr(BatchedDraftCandidateGenerator, "propose", rank_by_sampled_token)
    counts, _ = sampled_joint(target, draft, 1.0, 1.0, "tetris", new_tokens=4, num_assistant_tokens=1,
                              tetris_extra_tokens=0, tetris_budget=ROWS // 2)
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0, new_tokens=4)) < 1e-3


def test_chi_square_catches_a_verifier_that_skips_the_residual(pair, monkeypatch):
    """Teeth: sampling the correction from p instead of norm(max(p - q, 0)) is biased, and the test sees it."""
    target, draft = pair
    monkeypatch.setattr(verification, "residual_distribution", lambda target_probs, draft_probs: (target_probs, None))
    counts, _ = sampled_joint(target, draft, 1.0, 1.0, "tetris")
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0)) < 1e-3


def test_high_acceptance_draft_is_also_lossless():
    target = sharpen(tiny_llama(VOCAB, num_layers=2, seed=23, hidden_size=16), 12)
    draft = noisy_copy(target, 0.3, seed=5)
    counts, stats = sampled_joint(target, draft, 1.0, 1.0, "tetris", seed=1)
    assert stats.verification_success_rate > 0.5
    assert chi_square_p_value(counts, exact_joint(target, 1.0, 1.0)) > 1e-3
