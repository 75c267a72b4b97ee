"""examples/lookup_occurrence.py replays greedy lookup exactly as the loop would verify it."""

import importlib.util
import itertools
from pathlib import Path

import torch

from tetris_hf.candidate_generators.prompt_lookup import OCCURRENCES
from test_prompt_lookup import lookup_one_row

_spec = importlib.util.spec_from_file_location(
    "lookup_occurrence", Path(__file__).resolve().parents[1] / "examples" / "lookup_occurrence.py")
lookup_occurrence = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lookup_occurrence)


def replay_one_row(tokens: list[int], prompt_length: int, k: int, sizes: range, occurrence: str) -> tuple[int, int]:
    """The reference: (row-steps, tokens emitted) of greedy lookup on one row's known continuation."""
    length, steps = prompt_length, 0
    while length < len(tokens):
        drafts, _ = lookup_one_row(tokens[:length], k, sizes, occurrence)
        drafts = drafts[: len(tokens) - length - 1]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == tokens[length + accepted]:
            accepted += 1
        length += accepted + 1
        steps += 1
    return steps, len(tokens) - prompt_length


def test_batched_replay_equals_a_row_by_row_replay():
    generator = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 7, (int(n),), generator=generator).tolist() for n in (12, 20, 7, 30)]
    prompt_lengths = [5, 9, 3, 10]
    width = max(map(len, rows))
    sequences = torch.zeros(len(rows), width, dtype=torch.long)
    starts = []
    for index, tokens in enumerate(rows):
        sequences[index, width - len(tokens):] = torch.tensor(tokens)
        starts.append(width - len(tokens))
    starts = torch.tensor(starts)
    prompt_ends = starts + torch.tensor(prompt_lengths)
    for k, occurrence in itertools.product((1, 3), OCCURRENCES):
        totals = lookup_occurrence.replay_lookup(sequences, starts, prompt_ends, torch.full((4,), width), k,
                                                 range(1, 4), occurrence)
        expected = [replay_one_row(tokens, length, k, range(1, 4), occurrence)
                    for tokens, length in zip(rows, prompt_lengths)]
        assert (totals["steps"], totals["tokens"]) == tuple(map(sum, zip(*expected)))
        assert totals["tokens"] == sum(len(tokens) - length for tokens, length in zip(rows, prompt_lengths))
