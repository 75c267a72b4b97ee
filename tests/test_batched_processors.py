"""The prefix-reading processors transformers ships run batched (every row and position at once, no host read) and
give exactly what each processor gives on each row's own prefix alone: the per-row path is the reference."""

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

import tetris_hf  # noqa: F401  (registers custom_generate="tetris")
from tetris_hf.logits import PositionwiseLogitsProcessor
from tetris_hf.logits.batched_processors import batched_form, prefix_ends
from tetris_hf.logits.processing import _for_one_row
from tiny_models import PAD, left_pad, noisy_copy, random_prompts, sharpen, tiny_llama

VOCAB, WIDTH, COLUMNS = 12, 8, 24  # prompts left-padded to WIDTH; sequences hold COLUMNS
PADDING = torch.tensor([0, 3, 1, 5, 2, 6])  # left padding of the original batch's six rows
ROWS = torch.tensor([4, 1, 5, 2])  # the rows still active, by original index


def block(seed: int, offset: int, num_positions: int):
    """A left-padded block of the active rows: ``(sequences (B, T), prefix_lengths (B,), scores (B, L, V))``.

    Tokens come from a few ids (repeats and n-grams recur), PAD only in the padding, one prompt holds an id past
    the vocabulary, and the columns past the last prefix hold garbage (PAD and ids past the vocabulary).
    """
    generator = torch.Generator().manual_seed(seed)
    num_rows = len(ROWS)
    sequences = torch.randint(1, 6, (num_rows, COLUMNS), generator=generator)
    sequences[:, :WIDTH].masked_fill_(torch.arange(WIDTH) < PADDING[ROWS][:, None], PAD)
    sequences[1, WIDTH - 1] = VOCAB + 1
    prefix_lengths = WIDTH + torch.randint(0, 6, (num_rows,), generator=generator)
    prefix_lengths[0] = WIDTH  # a row at the end of its prompt
    ends = prefix_lengths + offset + num_positions - 1
    past = torch.arange(COLUMNS) > ends[:, None]
    garbage = torch.where(torch.rand(num_rows, COLUMNS, generator=generator) < 0.5, PAD, VOCAB + 3)
    sequences = torch.where(past, garbage, sequences)
    scores = torch.randn(num_rows, num_positions, VOCAB, generator=generator) * 3
    return sequences, prefix_lengths, scores


def per_row_reference(processors, sequences, prefix_lengths, scores, rows, offset):
    """Each processor list applied to each row and position alone, on its exact prefix."""
    processed = torch.empty_like(scores)
    for index, row in enumerate(rows.tolist()):
        row_processors = LogitsProcessorList(_for_one_row(processor, row) for processor in processors)
        for position in range(scores.shape[1]):
            prefix = sequences[index : index + 1, : int(prefix_lengths[index]) + offset + position]
            processed[index, position] = row_processors(prefix, scores[index, position][None].clone())[0]
    return processed


BATCHED_CASES = {  # name -> processor (each covers an edge case the reference must agree on)
    "penalty>1, padding ignored per original row": lambda: RepetitionPenaltyLogitsProcessor(1.5, PADDING),
    "penalty<1, padding ignored per original row": lambda: RepetitionPenaltyLogitsProcessor(0.7, PADDING),
    "penalty, no prompt ignored (padding counts)": lambda: RepetitionPenaltyLogitsProcessor(1.5),
    "penalty, an int prompt to ignore": lambda: RepetitionPenaltyLogitsProcessor(1.3, prompt_ignore_length=WIDTH),
    "min length, two eos, boundary inside the block": lambda: MinLengthLogitsProcessor(WIDTH + 3, [1, 3]),
    "min new tokens, boundary inside the block": lambda: MinNewTokensLengthLogitsProcessor(WIDTH, 3, 1),
    "no-repeat 1-gram": lambda: NoRepeatNGramLogitsProcessor(1),
    "no-repeat 2-gram": lambda: NoRepeatNGramLogitsProcessor(2),
    "no-repeat 3-gram": lambda: NoRepeatNGramLogitsProcessor(3),
    "no-repeat n-gram longer than some prefixes": lambda: NoRepeatNGramLogitsProcessor(11),
    "no-repeat n-gram longer than every sequence": lambda: NoRepeatNGramLogitsProcessor(COLUMNS + 1),
    "bad words: one and several tokens, eos dropped": lambda: NoBadWordsLogitsProcessor(
        [[4], [1], [2, 3], [3, 3], [5, 2, 4]], eos_token_id=1),
    "bad word longer than some prefixes": lambda: NoBadWordsLogitsProcessor([[2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]]),
    "sequence bias: shared last tokens add up": lambda: SequenceBiasLogitsProcessor(
        [[[4], -2.0], [[5, 2], 1.5], [[3, 2], 0.5], [[1, 5, 2], 3.0], [[2], 0.25]]),
}


@pytest.mark.parametrize("name", BATCHED_CASES)
@pytest.mark.parametrize("offset,num_positions", [(0, 1), (0, 5), (3, 4)])
def test_batched_processor_equals_the_processor_on_each_rows_own_prefix(name, offset, num_positions):
    sequences, prefix_lengths, scores = block(seed=offset * 10 + num_positions, offset=offset,
                                              num_positions=num_positions)
    processor = BATCHED_CASES[name]()
    expected = per_row_reference([processor], sequences, prefix_lengths, scores, ROWS, offset)
    form = batched_form(processor)
    assert form is not None
    original = scores.clone()
    batched = form(sequences, prefix_ends(prefix_lengths, offset, num_positions), ROWS, scores)
    assert torch.equal(batched, expected)
    assert torch.equal(scores, original), "the input scores were modified"
    positionwise = PositionwiseLogitsProcessor(LogitsProcessorList([processor]))
    assert positionwise.per_row == [] and not positionwise.prefix_free
    assert torch.equal(positionwise(sequences, prefix_lengths, scores, ROWS, offset=offset), expected)


def test_padding_tokens_are_penalized_only_where_transformers_counts_them():
    """PAD occurs only in the padding here: with each row's padding length (what ``generate()`` passes when there is
    an attention mask) it keeps its score; without, rows with padding penalize it."""
    sequences, prefix_lengths, scores = block(seed=1, offset=0, num_positions=3)
    ends = prefix_ends(prefix_lengths, 0, 3)
    ignoring = batched_form(RepetitionPenaltyLogitsProcessor(1.5, PADDING))(sequences, ends, ROWS, scores)
    counting = batched_form(RepetitionPenaltyLogitsProcessor(1.5))(sequences, ends, ROWS, scores)
    assert torch.equal(ignoring[..., PAD], scores[..., PAD])
    padded = PADDING[ROWS] > 0
    assert not torch.equal(counting[padded][..., PAD], scores[padded][..., PAD])


def test_min_new_tokens_boundary_falls_inside_the_block():
    """Row 0 is at the end of its prompt: positions 0..2 have 0..2 new tokens (EOS banned), position 3 has 3."""
    sequences, prefix_lengths, scores = block(seed=2, offset=0, num_positions=5)
    processed = batched_form(MinNewTokensLengthLogitsProcessor(WIDTH, 3, 1))(
        sequences, prefix_ends(prefix_lengths, 0, 5), ROWS, scores)
    assert torch.isinf(processed[0, :3, 1]).all()
    assert torch.equal(processed[0, 3:, 1], scores[0, 3:, 1])


class Custom(LogitsProcessor):
    """An unknown processor that reads the prefix: adds the last token's id to token 0."""

    def __call__(self, input_ids, scores):
        return scores + torch.nn.functional.one_hot(torch.tensor(0), scores.shape[-1]) * input_ids[:, -1:]


class Penalty(RepetitionPenaltyLogitsProcessor):
    """A subclass: it may read the prefix otherwise, so it keeps the per-row path."""


def test_a_list_with_unknown_processors_runs_them_per_row_and_the_rest_batched_in_order(monkeypatch):
    sequences, prefix_lengths, scores = block(seed=3, offset=2, num_positions=4)
    processors = LogitsProcessorList([
        RepetitionPenaltyLogitsProcessor(1.5, PADDING), Custom(), Penalty(0.5), NoRepeatNGramLogitsProcessor(2),
        MinNewTokensLengthLogitsProcessor(WIDTH, 4, 1), TemperatureLogitsWarper(0.7), TopKLogitsWarper(5), Custom(),
    ])
    expected = per_row_reference(processors, sequences, prefix_lengths, scores, ROWS, offset=2)
    positionwise = PositionwiseLogitsProcessor(processors)
    assert positionwise.per_row == [1, 2, 7]
    calls = []
    per_row = PositionwiseLogitsProcessor._apply_per_row

    def counted(self, indices, *args):
        calls.append(list(indices))
        return per_row(self, indices, *args)

    monkeypatch.setattr(PositionwiseLogitsProcessor, "_apply_per_row", counted)
    assert torch.equal(positionwise(sequences, prefix_lengths, scores, ROWS, offset=2), expected)
    assert calls == [[1, 2], [7]]


def test_a_whole_generate_list_runs_batched_and_equals_the_per_row_path():
    sequences, prefix_lengths, scores = block(seed=4, offset=1, num_positions=4)
    processors = LogitsProcessorList([
        SequenceBiasLogitsProcessor([[[4], -2.0], [[5, 2], 1.5]]), RepetitionPenaltyLogitsProcessor(1.2, PADDING),
        NoRepeatNGramLogitsProcessor(3), NoBadWordsLogitsProcessor([[3], [2, 4]], 1), MinLengthLogitsProcessor(12, 1),
        MinNewTokensLengthLogitsProcessor(WIDTH, 2, 1), TemperatureLogitsWarper(0.7), TopKLogitsWarper(5),
    ])
    positionwise = PositionwiseLogitsProcessor(processors)
    assert positionwise.per_row == [] and not positionwise.prefix_free
    expected = per_row_reference(processors, sequences, prefix_lengths, scores, ROWS, offset=1)
    assert torch.equal(positionwise(sequences, prefix_lengths, scores, ROWS, offset=1), expected)


# End to end: plain batched generate() is the reference, row for row.

E2E_SETTINGS = {  # each changes plain generate()'s output for this pair (asserted)
    "repetition_penalty": dict(repetition_penalty=1.8),
    "repetition_reward": dict(repetition_penalty=0.3),
    "min_new_tokens": dict(min_new_tokens=6),
    "min_length": dict(min_length=14),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids, one token": dict(bad_words_ids=[[7]]),
    "bad_words_ids, several tokens": dict(bad_words_ids=[[3, 18], [11, 18, 3]]),
    "sequence_bias": dict(sequence_bias=[[[7], -3.0], [[3, 18], -5.0], [[5, 9], 4.0]]),
    "all": dict(repetition_penalty=1.3, min_new_tokens=5, no_repeat_ngram_size=3, bad_words_ids=[[7], [3, 18]]),
}


@pytest.fixture(scope="module")
def greedy_pair():
    target = tiny_llama(24, num_layers=2, seed=32)
    prompts = random_prompts(3, 24, seed=32, min_length=2, max_length=8)
    input_ids, mask = left_pad(prompts)
    plain = target.generate(input_ids, attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD)
    # an EOS the target emits early in some rows, so that the length rules matter
    eos = int(plain[0, input_ids.shape[1] + 2])
    return target, noisy_copy(target, 0.3), input_ids, mask, eos


@pytest.mark.parametrize("name", E2E_SETTINGS)
def test_greedy_rows_equal_plain_batched_generate(greedy_pair, name, monkeypatch):
    target, draft, input_ids, mask, eos = greedy_pair
    common = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD, eos_token_id=eos)
    plain = target.generate(input_ids, **common, **E2E_SETTINGS[name])
    unprocessed = target.generate(input_ids, **common)
    assert not torch.equal(plain, unprocessed), f"{name} does not change this output: the case proves nothing"

    def per_row_path(*args):
        raise AssertionError("a processor transformers ships ran per row")

    monkeypatch.setattr(PositionwiseLogitsProcessor, "_apply_per_row", per_row_path)
    ours = target.generate(input_ids, assistant_model=draft, custom_generate="tetris", num_assistant_tokens=3,
                           **common, **E2E_SETTINGS[name])
    assert torch.equal(ours, plain)


def test_prefix_allowed_tokens_fn_runs_per_row_among_batched_processors_and_equals_plain_generate(greedy_pair):
    """A processor with per-row state and no batched form (``batch_id``) between batched ones, end to end."""
    target, draft, input_ids, mask, eos = greedy_pair

    def allowed(batch_id, tokens):  # row 1 may not use 18; others may not use the token before last
        return [token for token in range(24) if token != (18 if batch_id == 1 else int(tokens[-2]))]

    common = dict(attention_mask=mask, do_sample=False, max_new_tokens=16, pad_token_id=PAD, eos_token_id=eos,
                  prefix_allowed_tokens_fn=allowed, **E2E_SETTINGS["all"])
    plain = target.generate(input_ids, **common)
    common.pop("prefix_allowed_tokens_fn")
    assert not torch.equal(plain, target.generate(input_ids, **common)), "the function changes nothing here"
    ours = target.generate(input_ids, assistant_model=draft, custom_generate="tetris", num_assistant_tokens=3,
                           prefix_allowed_tokens_fn=allowed, **common)
    assert torch.equal(ours, plain)


def test_sampling_with_repetition_penalty_and_no_repeat_ngram_follows_the_target_distribution():
    from scipy.stats import chisquare

    vocab, prompt, new_tokens, rows = 6, [3, 4, 5, 2], 3, 6000
    target = sharpen(tiny_llama(vocab, num_layers=2, seed=21, hidden_size=16), 12)
    draft = sharpen(tiny_llama(vocab, num_layers=1, seed=22, hidden_size=16), 12)
    settings = dict(repetition_penalty=3.0, no_repeat_ngram_size=2)

    def exact_joint(processors):
        joint = {}

        def expand(prefix, probability):
            if len(prefix) == new_tokens:
                joint[tuple(prefix)] = probability
                return
            ids = torch.tensor([prompt + prefix])
            probs = processors(ids, target(ids).logits[:, -1].float()).softmax(-1)[0]
            for token, p in enumerate(probs.tolist()):
                if p > 0:
                    expand(prefix + [token], probability * p)

        with torch.no_grad():
            expand([], 1.0)
        return joint

    def p_value(counts, joint):
        assert set(counts) <= set(joint), "a sequence of probability 0 was sampled"
        cells = [cell for cell in joint if joint[cell] * rows >= 5]
        rest = [cell for cell in joint if joint[cell] * rows < 5]
        observed = [counts.get(cell, 0) for cell in cells] + [sum(counts.get(cell, 0) for cell in rest)]
        expected = [joint[cell] * rows for cell in cells] + [sum(joint[cell] for cell in rest) * rows]
        expected = [value * rows / sum(expected) for value in expected]
        return chisquare(observed, expected).pvalue

    torch.manual_seed(0)
    out = target.generate(torch.tensor([prompt] * rows), assistant_model=draft, custom_generate="tetris",
                          do_sample=True, top_k=0, max_new_tokens=new_tokens, eos_token_id=None, pad_token_id=PAD,
                          num_assistant_tokens=2, return_dict_in_generate=True, **settings)
    assert 0 < out.tetris_stats.accepted_tokens < out.tetris_stats.verified_tokens
    counts = {}
    for row in out.sequences[:, len(prompt):].tolist():
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    processed = exact_joint(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(3.0),
                                                 NoRepeatNGramLogitsProcessor(2)]))
    assert p_value(counts, processed) > 1e-3
    assert p_value(counts, exact_joint(LogitsProcessorList())) < 1e-3  # teeth: the processors changed the law


def test_a_draft_that_is_the_target_sees_its_own_drafts_so_every_draft_is_accepted(greedy_pair):
    """The batched forms read ``sequences``: the draft must write each draft token before it scores the next. With
    the target as its own draft every draft is then accepted; scored on stale tokens, some would not be."""
    target, _, input_ids, mask, eos = greedy_pair
    out = target.generate(input_ids, attention_mask=mask, assistant_model=target, custom_generate="tetris",
                          do_sample=False, max_new_tokens=16, pad_token_id=PAD, eos_token_id=eos,
                          num_assistant_tokens=4, return_dict_in_generate=True, **E2E_SETTINGS["all"])
    stats = out.tetris_stats
    assert stats.verified_tokens > 0 and stats.accepted_tokens == stats.verified_tokens
