"""Verification on hand-built scores: exact accepted counts and next tokens (greedy and sampling), exact residuals.

Terms as in ``tetris_hf/logits/verification.py``: a row accepts a prefix of its verified drafts, then the target adds
one token, its correction (after a rejection) or a bonus token (after every verified draft was accepted). Target
position ``j`` predicts the token after draft ``j``; position 0 the token after the row's last emitted one.
"""

import pytest
import torch

from tetris_hf.logits import residual_distribution, verify_greedy, verify_sampling

V = 8  # vocabulary


def greedy_scores(target_tokens: list[list[int]]) -> torch.Tensor:
    """``(B, L + 1, V)`` scores whose argmax at row ``i``, position ``j`` is ``target_tokens[i][j]``."""
    scores = torch.randn(len(target_tokens), len(target_tokens[0]), V, generator=torch.Generator().manual_seed(0))
    return scores.scatter(2, torch.tensor(target_tokens)[..., None], 10.0)


# (name, drafts, verify_length, target's argmax at positions 0..L, num_accepted, next_token)
GREEDY_CASES = [
    ("all accepted: bonus from the last position", [3, 4, 5], 3, [3, 4, 5, 6], 3, 6),
    ("first draft rejected: correction at 0", [3, 4, 5], 3, [7, 4, 5, 6], 0, 7),
    ("mismatch in the middle, later match ignored", [3, 4, 5], 3, [3, 2, 5, 6], 1, 2),
    ("mismatch at the last draft", [3, 4, 5], 3, [3, 4, 1, 6], 2, 1),
    ("verifies nothing: target's position 0", [3, 4, 5], 0, [3, 4, 5, 6], 0, 3),
    ("drafts past verify_lengths ignored though equal", [3, 4, 5], 2, [3, 4, 5, 6], 2, 5),
    ("one verified, rejected", [3, 4, 5], 1, [2, 4, 5, 6], 0, 2),
]


@pytest.mark.parametrize("name,drafts,length,target,accepted,next_token", GREEDY_CASES,
                         ids=[c[0] for c in GREEDY_CASES])
def test_greedy_accepts_the_prefix_equal_to_the_target_then_adds_its_token(name, drafts, length, target, accepted,
                                                                          next_token):
    num_accepted, next_tokens = verify_greedy(torch.tensor([drafts]), torch.tensor([length]), greedy_scores([target]))
    assert num_accepted.tolist() == [accepted]
    assert next_tokens.tolist() == [next_token]


def test_greedy_rows_of_different_lengths_in_one_batch_verify_independently():
    drafts = torch.tensor([case[1] for case in GREEDY_CASES])
    lengths = torch.tensor([case[2] for case in GREEDY_CASES])
    num_accepted, next_tokens = verify_greedy(drafts, lengths, greedy_scores([case[3] for case in GREEDY_CASES]))
    assert num_accepted.tolist() == [case[4] for case in GREEDY_CASES]
    assert next_tokens.tolist() == [case[5] for case in GREEDY_CASES]


def test_greedy_without_drafts_emits_the_targets_position_0_token():
    drafts = torch.zeros(3, 0, dtype=torch.long)
    num_accepted, next_tokens = verify_greedy(drafts, torch.zeros(3, dtype=torch.long), greedy_scores([[6], [0], [3]]))
    assert num_accepted.tolist() == [0, 0, 0]
    assert next_tokens.tolist() == [6, 0, 3]


# Sampling. Distributions are written as {token: probability}; probabilities are powers of two, so that
# softmax(log p) == p exactly and every accept/reject decision below is certain (u * q(x) < p(x) with u in [0, 1)).

def dist(spec: dict[int, float]) -> torch.Tensor:
    probs = torch.zeros(V)
    for token, prob in spec.items():
        probs[token] = prob
    return probs


def sampling_inputs(rows):
    """rows: ``(drafts, verify_length, [p_0 .. p_L], [q_0 .. q_{L-1}])`` -> the arguments of ``verify_sampling``."""
    drafts = torch.tensor([row[0] for row in rows]).reshape(len(rows), -1)
    lengths = torch.tensor([row[1] for row in rows])
    target_scores = torch.stack([torch.stack([dist(p) for p in row[2]]) for row in rows]).log()  # log 0 = -inf
    draft_probs = torch.stack([torch.stack([dist(q) for q in row[3]]) if row[3] else torch.zeros(0, V)
                               for row in rows])
    return drafts, lengths, target_scores, draft_probs


HALF = {1: 0.5, 2: 0.5}
SAMPLING_CASES = [
    # p(x) = q(x) everywhere: every draft accepted; bonus from a one-hot p_L.
    ("all accepted: bonus from one-hot p_L", [1, 2], 2, [HALF, HALF, {6: 1.0}], [HALF, HALF], 2, 6),
    # p(x_0) = 0: rejected at once; the residual max(p_0 - q_0, 0) is one-hot at 3 although p_0 is not (and against
    # q_1 it would be one-hot at 2).
    ("p(x)=0 at 0: correction from the residual", [1, 3], 2,
     [{2: 0.5, 3: 0.5}, HALF, {6: 1.0}], [{1: 0.5, 2: 0.5}, {3: 1.0}], 0, 3),
    # Accepted at 0 (p = q), rejected at 1 (p(x_1) = 0): residual of p_1 against q_1 is one-hot at 5.
    ("rejected in the middle", [1, 2], 2,
     [HALF, {4: 0.5, 5: 0.5}, {6: 1.0}], [HALF, {2: 0.5, 4: 0.5}], 1, 5),
    # verify_lengths 0: nothing is judged; the token comes from p_0 (one-hot), not a residual.
    ("verifies nothing: token from p_0", [1, 2], 0, [{7: 1.0}, HALF, {6: 1.0}], [{7: 1.0}, HALF], 0, 7),
    # Draft 1 would be accepted (p = q) but only one draft is verified: bonus from p_1.
    ("drafts past verify_lengths ignored", [1, 2], 1, [HALF, {2: 1.0}, {6: 1.0}], [HALF, {2: 1.0}], 1, 2),
]


@pytest.mark.parametrize("name,drafts,length,p,q,accepted,next_token", SAMPLING_CASES,
                         ids=[c[0] for c in SAMPLING_CASES])
@pytest.mark.parametrize("seed", range(5))
def test_sampling_decisions_that_are_certain_come_out_exactly(name, drafts, length, p, q, accepted, next_token, seed):
    arguments = sampling_inputs([(drafts, length, p, q)])
    num_accepted, next_tokens = verify_sampling(*arguments, generator=torch.Generator().manual_seed(seed))
    assert num_accepted.tolist() == [accepted]
    assert next_tokens.tolist() == [next_token]


def test_sampling_rows_of_different_lengths_in_one_batch_verify_independently():
    arguments = sampling_inputs([case[1:5] for case in SAMPLING_CASES])
    num_accepted, next_tokens = verify_sampling(*arguments, generator=torch.Generator().manual_seed(0))
    assert num_accepted.tolist() == [case[5] for case in SAMPLING_CASES]
    assert next_tokens.tolist() == [case[6] for case in SAMPLING_CASES]


def test_sampling_without_drafts_draws_from_p_0():
    drafts, lengths, target_scores, draft_probs = sampling_inputs([([], 0, [{5: 1.0}], []), ([], 0, [{0: 1.0}], [])])
    assert drafts.shape == (2, 0) and draft_probs.shape == (2, 0, V)
    num_accepted, next_tokens = verify_sampling(drafts, lengths, target_scores, draft_probs)
    assert num_accepted.tolist() == [0, 0]
    assert next_tokens.tolist() == [5, 0]


def test_a_row_that_accepts_all_it_verified_draws_from_p_not_the_residual():
    # Draft 1 is not verified; p_1 = {1: .5, 2: .5} and its residual against q_1 would be one-hot at 1. 32 rows all
    # drawing 1 would mean the residual was used (probability 2**-32 under p).
    rows = [([1, 3], 1, [HALF, HALF, {6: 1.0}], [HALF, {2: 0.5, 3: 0.5}])] * 32
    num_accepted, next_tokens = verify_sampling(*sampling_inputs(rows), generator=torch.Generator().manual_seed(0))
    assert num_accepted.tolist() == [1] * 32
    assert set(next_tokens.tolist()) == {1, 2}


def random_sampling_inputs(batch_size=16, block=4):
    generator = torch.Generator().manual_seed(123)
    target_scores = torch.randn(batch_size, block + 1, V, generator=generator)
    draft_probs = torch.randn(batch_size, block, V, generator=generator).softmax(dim=-1)
    drafts = torch.multinomial(draft_probs.view(-1, V), 1, generator=generator).view(batch_size, block)
    lengths = torch.randint(0, block + 1, (batch_size,), generator=generator)
    return drafts, lengths, target_scores, draft_probs


def test_sampling_is_deterministic_given_the_generators_seed():
    arguments = random_sampling_inputs()
    first = verify_sampling(*arguments, generator=torch.Generator().manual_seed(7))
    again = verify_sampling(*arguments, generator=torch.Generator().manual_seed(7))
    other = verify_sampling(*arguments, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not (torch.equal(first[0], other[0]) and torch.equal(first[1], other[1]))
    assert (first[0] <= arguments[1]).all()


def test_residual_is_the_normalised_positive_part_of_p_minus_q_with_its_mass():
    p = torch.tensor([[0.5, 0.25, 0.25, 0.0], [0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.25, 0.5, 0.0, 0.25], [0.0, 0.0, 0.5, 0.5], [0.25, 0.25, 0.25, 0.25]])
    residual, mass = residual_distribution(p, q)
    assert torch.equal(residual, torch.tensor([[0.5, 0.0, 0.5, 0.0],  # max(p - q, 0) = [.25, 0, .25, 0]
                                               [0.5, 0.5, 0.0, 0.0],  # disjoint supports: p itself, mass 1
                                               [0.25, 0.25, 0.25, 0.25]]))  # p == q: falls back to p
    assert torch.equal(mass, torch.tensor([0.5, 1.0, 0.0]))


def test_residual_keeps_leading_dimensions():
    p = torch.tensor([0.5, 0.25, 0.25, 0.0]).expand(2, 3, 4)
    q = torch.tensor([0.25, 0.5, 0.0, 0.25]).expand(2, 3, 4)
    residual, mass = residual_distribution(p, q)
    assert residual.shape == (2, 3, 4) and mass.shape == (2, 3)
    assert torch.equal(residual[1, 2], torch.tensor([0.5, 0.0, 0.5, 0.0]))
    assert torch.equal(mass, torch.full((2, 3), 0.5))
