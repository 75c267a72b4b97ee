"""Stopping criteria on rows that emitted different numbers of tokens: the tensor fast path for EOS and max length
equals calling ``generate()``'s criteria after every token of every row; other criteria still apply exactly."""

import torch
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)

from tetris_hf.stopping import RowStopper


class StopAfterToken(StoppingCriteria):
    """A user's own criterion (not one the fast path knows): stop when the last token is ``token``."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def one_by_one(criteria, sequences, lengths, new_counts):
    """The reference: each row, each new token, the whole list, exactly as ``generate()`` would see it."""
    kept, stopped = new_counts.clone(), torch.zeros_like(new_counts, dtype=torch.bool)
    for row in range(sequences.shape[0]):
        for offset in range(1, int(new_counts[row]) + 1):
            if bool(criteria(sequences[row : row + 1, : int(lengths[row]) + offset], None).any()):
                kept[row], stopped[row] = offset, True
                break
    return kept, stopped


def test_fast_path_equals_calling_the_criteria_token_by_token():
    generator = torch.Generator().manual_seed(0)
    lists = [
        [MaxLengthCriteria(14), EosTokenCriteria(3)],
        [EosTokenCriteria([3, 5])],
        [MaxLengthCriteria(12)],
        [MaxLengthCriteria(16), EosTokenCriteria(torch.tensor([2])), StopAfterToken(7)],
        [StopAfterToken(4)],
    ]
    hits = 0
    for trial in range(200):
        criteria = StoppingCriteriaList(lists[trial % len(lists)])
        batch, max_new = 6, (1 if trial % 3 == 0 else 5)  # 1: a plain step (one new token per row)
        sequences = torch.randint(0, 10, (batch, 18), generator=generator)
        lengths = torch.randint(4, 11, (batch,), generator=generator)
        new_counts = torch.randint(1, max_new + 1, (batch,), generator=generator)
        expected_kept, expected_stopped = one_by_one(criteria, sequences, lengths, new_counts)
        stopper = RowStopper(criteria, sequences.device)
        # with no bound on the lengths, and with the true one (which skips the length check where it cannot hit)
        for longest in (None, int(lengths.max())):
            kept, stopped = stopper(sequences, lengths, new_counts, max_new, longest=longest)
            assert torch.equal(kept, expected_kept) and torch.equal(stopped, expected_stopped), (trial, longest)
        hits += int(stopped.sum())
    assert hits > 100  # the criteria did stop rows, at many different offsets


def test_nothing_stops_without_criteria():
    sequences = torch.arange(20).reshape(2, 10)
    stopper = RowStopper(StoppingCriteriaList(), sequences.device)
    kept, stopped = stopper(sequences, torch.tensor([3, 4]), torch.tensor([2, 1]), 2)
    assert kept.tolist() == [2, 1] and stopped.tolist() == [False, False] and stopper.only_length


def test_a_limit_of_the_callers_own_stops_rows_as_a_length_criterion_would():
    # generate() always builds MaxLengthCriteria; a loop given none still stops rows at its own limit, the tighter one
    generator = torch.Generator().manual_seed(1)
    sequences = torch.randint(0, 10, (6, 18), generator=generator)
    lengths, new_counts = torch.randint(4, 11, (6,), generator=generator), torch.randint(1, 6, (6,), generator=generator)
    for given, own in ((None, 12), (14, 12), (12, 14)):
        criteria = StoppingCriteriaList([EosTokenCriteria(3)] + ([MaxLengthCriteria(given)] if given else []))
        stopper = RowStopper(criteria, sequences.device, max_length=own)
        assert stopper.max_length == 12
        reference = StoppingCriteriaList([EosTokenCriteria(3), MaxLengthCriteria(12)])
        kept, stopped = stopper(sequences, lengths, new_counts, 5)
        expected_kept, expected_stopped = one_by_one(reference, sequences, lengths, new_counts)
        assert torch.equal(kept, expected_kept) and torch.equal(stopped, expected_stopped)
