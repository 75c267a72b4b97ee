"""The draft's roll back after verification, on hand-built outcomes: after a proposal of K drafts its cache keeps
exactly the accepted drafts among drafts 1..K-1 (draft K is never read), and the pending block holds [draft K if all K
were accepted] + the target's token, left-packed.

The draft is a stand-in model that predicts token + 1 and caches token ids as keys, so every draft and every cached
slot is known in advance. ``_`` is left padding, ``.`` a hole, ``-1`` a hole in ``cached_tokens``."""

import pytest
import torch
from transformers.generation.logits_process import LogitsProcessorList

from tetris_hf.candidate_generators.batched_draft import BatchedDraftCandidateGenerator, split_pending_read
from tetris_hf.logits import PositionwiseLogitsProcessor
from tetris_hf.batch import RowMoves
from tetris_hf.step import ReadHints, Verdict
from test_slot_cache import RecordingModel, cached_tokens
from tiny_models import left_pad

PROMPTS = [[3, 4], [5, 6, 7], [8], [9, 10, 11]]  # left-padded to [_ 3 4], [5 6 7], [_ _ 8], [9 10 11]


def verdict(accepted, max_accepted: int | None = None, cached_longest: int | None = None) -> Verdict:
    """The target's verdict on the last proposal: ``accepted`` drafts per row, then its tokens 20, 21, 22, 23."""
    accepted = torch.as_tensor(accepted)
    return Verdict(accepted, torch.tensor([20, 21, 22, 23]), accepted, hints=ReadHints(max_accepted, cached_longest))


def drafter_after_proposal(num_tokens: int, max_holes: int = 100):
    """A drafter that read ``PROMPTS`` and proposed ``num_tokens`` drafts; also the proposal and the sequences."""
    drafter = BatchedDraftCandidateGenerator(RecordingModel(), PositionwiseLogitsProcessor(LogitsProcessorList()),
                                             do_sample=False, max_holes=max_holes, capacity=32)
    input_ids, mask = left_pad(PROMPTS)
    drafter.prefill(input_ids, mask)
    sequences = torch.cat([input_ids, torch.zeros(len(PROMPTS), 8, dtype=torch.long)], dim=1)
    lengths = torch.full((len(PROMPTS),), input_ids.shape[1])
    drafts = drafter.propose(sequences, lengths, num_tokens).tokens
    return drafter, drafts


def test_a_proposal_caches_the_pending_block_and_all_drafts_but_the_last():
    drafter, drafts = drafter_after_proposal(3)
    assert drafts.tolist() == [[5, 6, 7], [8, 9, 10], [9, 10, 11], [12, 13, 14]]
    assert cached_tokens(drafter.slots).tolist() == [[-1, 3, 4, 5, 6], [5, 6, 7, 8, 9], [-1, -1, 8, 9, 10],
                                                     [9, 10, 11, 12, 13]]
    assert drafter.slots.next_positions.tolist() == [4, 5, 3, 5]


# K = 3 drafts per row; (num_accepted per row, cache afterwards, next_positions, pending tokens, pending mask).
# Rows before: [_ 3 4 | 5 6], [5 6 7 | 8 9], [_ _ 8 | 9 10], [9 10 11 | 12 13] (prompt | drafts 1, 2), drafts 3 = 7,
# 10, 11, 14; the target's tokens 20, 21, 22, 23.
ROLLBACK_CASES = [
    ("none accepted", [0, 0, 0, 0],
     [[-1, 3, 4, -1, -1], [5, 6, 7, -1, -1], [-1, -1, 8, -1, -1], [9, 10, 11, -1, -1]], [2, 3, 1, 3],
     [[7, 20], [10, 21], [11, 22], [14, 23]], [[0, 1]] * 4),
    ("all accepted: draft 3 joins the pending block", [3, 3, 3, 3],
     [[-1, 3, 4, 5, 6], [5, 6, 7, 8, 9], [-1, -1, 8, 9, 10], [9, 10, 11, 12, 13]], [4, 5, 3, 5],
     [[7, 20], [10, 21], [11, 22], [14, 23]], [[1, 1]] * 4),
    ("mixed: none, one, two, all", [0, 1, 2, 3],
     [[-1, 3, 4, -1, -1], [5, 6, 7, 8, -1], [-1, -1, 8, 9, 10], [9, 10, 11, 12, 13]], [2, 4, 3, 5],
     [[7, 20], [10, 21], [11, 22], [14, 23]], [[0, 1], [0, 1], [0, 1], [1, 1]]),
]


@pytest.mark.parametrize("name,accepted,cached,next_positions,pending,pending_mask", ROLLBACK_CASES,
                         ids=[c[0] for c in ROLLBACK_CASES])
def test_accept_keeps_accepted_drafts_and_queues_what_the_draft_has_not_read(name, accepted, cached, next_positions,
                                                                             pending, pending_mask):
    drafter, _ = drafter_after_proposal(3)
    drafter.accept(verdict(accepted))
    assert drafter.slots.pointer == 5
    assert cached_tokens(drafter.slots).tolist() == cached
    assert drafter.slots.slot_mask[:, :5].tolist() == [[int(token >= 0) for token in row] for row in cached]
    assert drafter.slots.next_positions.tolist() == next_positions
    assert drafter.pending_tokens.tolist() == pending
    assert drafter.pending_mask.tolist() == pending_mask


def test_the_next_proposal_reads_the_pending_block_at_the_rolled_back_positions():
    drafter, _ = drafter_after_proposal(3)
    drafter.accept(verdict([0, 1, 2, 3]))
    sequences = torch.zeros(4, 16, dtype=torch.long)
    drafts = drafter.propose(sequences, torch.full((4,), 6), 2).tokens
    assert drafts.tolist() == [[21, 22], [22, 23], [23, 24], [24, 25]]
    assert cached_tokens(drafter.slots)[:, 5:].tolist() == [[-1, 20, 21], [-1, 21, 22], [-1, 22, 23], [14, 23, 24]]
    assert drafter.slots.slot_positions[:, 6:8].tolist() == [[2, 3], [4, 5], [3, 4], [6, 7]]
    assert drafter.slots.slot_positions[3, 5] == 5  # draft 3 of row 3, read one step late at its own position


def test_a_host_bound_below_k_queues_only_the_targets_token():
    """No row verified all K drafts (the longest verified block was 2 < 3): the pending block is one column wide."""
    drafter, _ = drafter_after_proposal(3)
    drafter.accept(verdict([0, 1, 2, 0], max_accepted=2))
    assert cached_tokens(drafter.slots).tolist() == [[-1, 3, 4, -1, -1], [5, 6, 7, 8, -1], [-1, -1, 8, 9, 10],
                                                     [9, 10, 11, -1, -1]]
    assert drafter.pending_tokens.tolist() == [[20], [21], [22], [23]]
    assert drafter.pending_mask.tolist() == [[1]] * 4


@pytest.mark.parametrize("accepted,width", [([0, 1, 2, 0], 1), ([0, 1, 2, 3], 2)])
@pytest.mark.parametrize("plain_width", [False, True], ids=["read", "plain-width"])
def test_the_pending_read_trims_columns_that_are_filler_in_every_row_and_counts_the_rest(accepted, width,
                                                                                        plain_width):
    """The loop reads what ``accept`` returned with its end-of-step read and hands it back (``settle``): the block
    loses the columns that are filler in every row, and the drafter learns how many tokens wait (its next forward
    reads them packed); a plain width trims alike and leaves the count unknown."""
    drafter, _ = drafter_after_proposal(3)
    to_read = drafter.accept(verdict(accepted))  # no host bound: two columns
    assert drafter.pending_tokens.shape[1] == 2 and drafter.pending_count is None
    real = 4 + sum(a == 3 for a in accepted)
    read = int(to_read)
    assert split_pending_read(read, 2) == (width, real)
    drafter.settle(width if plain_width else read)
    assert drafter.pending_tokens[:, -1].tolist() == [20, 21, 22, 23]
    assert drafter.pending_tokens.shape[1] == drafter.pending_mask.shape[1] == width
    assert drafter.pending_mask.sum().item() == real
    assert drafter.pending_real == (width == 1)  # one column left: all real, the next forward needs no mask
    assert drafter.pending_count == (None if plain_width and width > 1 else real)


def test_a_single_draft_leaves_the_cache_alone_and_queues_it_only_if_accepted():
    drafter, drafts = drafter_after_proposal(1)
    assert drafts.tolist() == [[5], [8], [9], [12]]
    before = drafter.slots.slot_mask.clone()
    drafter.accept(verdict([0, 1, 0, 1]))
    assert torch.equal(drafter.slots.slot_mask, before)
    assert drafter.slots.next_positions.tolist() == [2, 3, 1, 3]
    assert drafter.pending_tokens.tolist() == [[5, 20], [8, 21], [9, 22], [12, 23]]
    assert drafter.pending_mask.tolist() == [[0, 1], [1, 1], [0, 1], [1, 1]]


def test_a_step_without_drafts_appends_the_targets_token_to_the_pending_block():
    drafter, _ = drafter_after_proposal(0)
    assert drafter.slots.pointer == 0  # nothing read yet
    drafter.accept(verdict([0, 0, 0, 0]))
    assert drafter.pending_tokens.tolist() == [[0, 3, 4, 20], [5, 6, 7, 21], [0, 0, 8, 22], [9, 10, 11, 23]]
    assert drafter.pending_mask.tolist() == [[0, 1, 1, 1], [1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]


def test_rolled_back_holes_are_repacked_once_they_exceed_max_holes():
    drafter, _ = drafter_after_proposal(3, max_holes=0)
    # with a bound the loop knows for after this roll back: row 1 keeps 4 real slots
    drafter.accept(verdict([0, 1, 2, 0], cached_longest=4))
    # [_ 3 4 . . | 5 6 7 8 . | _ _ 8 9 10 | 9 10 11 . .] -> width 4, what lies past it in each row's first hole
    assert drafter.slots.pointer == 4
    assert cached_tokens(drafter.slots).tolist() == [[-1, 3, 4, -1], [5, 6, 7, 8], [10, -1, 8, 9], [9, 10, 11, -1]]
    assert drafter.slots.next_positions.tolist() == [2, 4, 3, 3]
    assert drafter.pending_tokens.tolist() == [[7, 20], [10, 21], [11, 22], [14, 23]]


def test_fill_rows_moves_pending_blocks_with_their_rows():
    drafter, _ = drafter_after_proposal(3)
    drafter.accept(verdict([0, 1, 2, 3]))
    # rows 1 and 2 finished: row 3 takes row 1's place
    drafter.settle(None, moves=RowMoves(torch.tensor([1]), torch.tensor([3]), 2))
    assert drafter.pending_tokens.tolist() == [[7, 20], [14, 23]]
    assert drafter.pending_mask.tolist() == [[0, 1], [1, 1]]
    assert cached_tokens(drafter.slots).tolist() == [[-1, 3, 4, -1, -1], [9, 10, 11, 12, 13]]
