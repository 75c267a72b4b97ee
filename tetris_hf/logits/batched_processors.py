"""transformers' prefix-reading logits processors (the exact types in :data:`BATCHED_FORMS`) for every row and
position of a block at once, each position ``j`` of row ``i`` on its own prefix ``sequences[i, :ends[i, j]]``, in one
pass on the device (:func:`batched_form`). Design: docs/design.md, "Verification".
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from transformers.generation.logits_process import (
    LogitsProcessor, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
    SuppressTokensAtBeginLogitsProcessor,
)

from .row_sampling import RowSamplingWarper

# (sequences (B, T), ends (B, L), rows (B,), scores (B, L, V)) -> processed scores (B, L, V)
BatchedProcessor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def prefix_ends(prefix_lengths: torch.Tensor, offset: int, num_positions: int) -> torch.Tensor:
    """``(B, L)`` the prefix length at each position: ``prefix_lengths[i] + offset + j``."""
    steps = torch.arange(num_positions, device=prefix_lengths.device)
    return prefix_lengths[:, None] + offset + steps


def tails(sequences: torch.Tensor, ends: torch.Tensor, width: int) -> torch.Tensor:
    """``(B, L, width)`` the ``width`` tokens before each end, ``sequences[i, ends[i, j] - width : ends[i, j]]``
    (arbitrary where the prefix is shorter: callers mask those positions)."""
    # E.g. ends [[5, 6]], width 2 -> columns [[[3, 4], [4, 5]]]
    columns = ends[:, :, None] - width + torch.arange(width, device=ends.device)
    columns = columns.clamp(0, sequences.shape[1] - 1)
    return sequences.gather(1, columns.flatten(1)).view(*columns.shape)


def penalize_repeats(sequences: torch.Tensor, ends: torch.Tensor, scores: torch.Tensor, penalty: float,
                     ignore_before: torch.Tensor) -> torch.Tensor:
    """Repetition penalty: every token seen in ``sequences[i, ignore_before[i] : ends[i, j]]`` has its score divided
    by ``penalty`` (multiplied where negative), once however often it occurs.

    Args:
        sequences: ``(B, T)`` tokens; ids past the vocabulary are never penalized (as transformers drops them).
        ends: ``(B, L)`` prefix length at each position.
        scores: ``(B, L, V)``.
        penalty: transformers' ``penalty``.
        ignore_before: ``(B,)`` leading columns not counted (left padding, or a prompt to ignore).

    Returns:
        ``(B, L, V)`` processed scores.
    """
    batch_size, num_columns = sequences.shape
    vocab_size = scores.shape[-1]
    # Each token's first counted column (a token is in a prefix when that column is before its end); tokens never
    # counted stay at num_columns, which no end exceeds. Ignored columns and ids past the vocab go to a spare column V.
    columns = torch.arange(num_columns, device=sequences.device).expand(batch_size, num_columns)
    ids = torch.where(columns >= ignore_before[:, None], sequences.clamp(0, vocab_size), vocab_size)
    first_seen = columns.new_full((batch_size, vocab_size + 1), num_columns)
    first_seen.scatter_reduce_(1, ids, columns, reduce="amin")
    seen = first_seen[:, None, :vocab_size] < ends[:, :, None]  # (B, L, V)
    penalized = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalized, scores)


def suppress_eos_below(lengths: torch.Tensor, minimum: int, eos_token_id: torch.Tensor, scores: torch.Tensor
                       ) -> torch.Tensor:
    """Min length: the EOS scores are ``-inf`` where ``lengths < minimum``.

    Args:
        lengths: ``(B, L)`` the length the rule counts at each position (the prefix, or the new tokens in it).
        minimum: the threshold.
        eos_token_id: ``(E,)`` the EOS ids.
        scores: ``(B, L, V)``.
    """
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    is_eos = torch.isin(vocab, eos_token_id.to(scores.device))
    return scores.masked_fill((lengths < minimum)[:, :, None] & is_eos, -math.inf)


def ban_repeated_ngrams(sequences: torch.Tensor, ends: torch.Tensor, scores: torch.Tensor, ngram_size: int
                        ) -> torch.Tensor:
    """No-repeat n-gram: a token that would complete an n-gram already in the prefix gets ``-inf`` (e.g. n = 2,
    prefix [7 8 7]: the window [7 8] starts with the suffix [7], so 8 is banned).

    Args:
        sequences: ``(B, T)``.
        ends: ``(B, L)`` prefix length at each position.
        scores: ``(B, L, V)``.
        ngram_size: ``n >= 1``.
    """
    num_columns = sequences.shape[1]
    vocab_size = scores.shape[-1]
    if num_columns < ngram_size:  # no prefix holds a whole n-gram
        return scores
    windows = sequences.unfold(1, ngram_size, 1)  # (B, S, n), S = T - n + 1
    starts = torch.arange(windows.shape[1], device=sequences.device)
    matches = starts[None, None, :] <= (ends - ngram_size)[:, :, None]  # (B, L, S) windows inside the prefix
    suffix = tails(sequences, ends, ngram_size - 1)  # (B, L, n - 1)
    for k in range(ngram_size - 1):
        matches = matches & (windows[:, None, :, k] == suffix[:, :, k, None])
    # Windows that do not match ban the spare column V, so they cannot unban another window's token.
    last_tokens = windows[:, None, :, -1].clamp(max=vocab_size).expand_as(matches)
    banned = matches.new_zeros(*matches.shape[:2], vocab_size + 1)
    banned.scatter_(2, torch.where(matches, last_tokens, vocab_size), True)
    return scores.masked_fill(banned[..., :vocab_size], -math.inf)


def bias_sequences(sequences: torch.Tensor, ends: torch.Tensor, scores: torch.Tensor, length_1_bias: torch.Tensor,
                   multi_token_biases: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Sequence bias (and bad words, a bias of ``-inf``): a biased sequence's bias goes to its last token where the
    prefix ends with the rest of it; one-token sequences always.

    Args:
        sequences: ``(B, T)``.
        ends: ``(B, L)`` prefix length at each position.
        scores: ``(B, L, V)``.
        length_1_bias: ``(V,)`` the one-token sequences' biases.
        multi_token_biases: per prefix length ``P``: ``prefixes (G, P)``, ``last_tokens (G,)``, ``biases (G,)``,
            as ``SequenceBiasLogitsProcessor`` prepares them.
    """
    batch_size, num_positions, vocab_size = scores.shape
    # Summed in transformers' order: zeros, one-token biases, then each prefix length's group.
    bias = scores.new_zeros(batch_size * num_positions, vocab_size)
    bias += length_1_bias
    for prefixes, last_tokens, biases in multi_token_biases:
        prefix_length = prefixes.shape[1]
        tail = tails(sequences, ends, prefix_length)  # (B, L, P)
        matching = (tail[:, :, None, :] == prefixes).all(dim=-1) & (ends >= prefix_length)[:, :, None]  # (B, L, G)
        bias.index_add_(1, last_tokens, torch.where(matching, biases, 0.0).view(-1, len(biases)).to(bias.dtype))
    return scores + bias.view(batch_size, num_positions, vocab_size)


def _repetition_penalty(processor: RepetitionPenaltyLogitsProcessor) -> BatchedProcessor:
    def apply(sequences, ends, rows, scores):
        ignore = processor.prompt_ignore_length
        if isinstance(ignore, torch.Tensor):  # per original row: index it by each row's original index
            # moved once, in place, as transformers does on its first call
            processor.prompt_ignore_length = ignore = ignore.to(sequences.device)
            ignore_before = ignore[rows]
        else:
            ignore_before = torch.full_like(rows, ignore or 0, device=sequences.device)
        return penalize_repeats(sequences, ends, scores, processor.penalty, ignore_before)

    return apply


def _min_length(processor: MinLengthLogitsProcessor) -> BatchedProcessor:
    return lambda sequences, ends, rows, scores: suppress_eos_below(ends, processor.min_length,
                                                                    processor.eos_token_id, scores)


def _min_new_tokens(processor: MinNewTokensLengthLogitsProcessor) -> BatchedProcessor:
    def apply(sequences, ends, rows, scores):
        new_tokens = ends - processor.prompt_length_to_skip
        return suppress_eos_below(new_tokens, processor.min_new_tokens, processor.eos_token_id, scores)

    return apply


def _suppress_at_begin(processor: SuppressTokensAtBeginLogitsProcessor) -> BatchedProcessor:
    """Whisper's: ``begin_suppress_tokens`` may not be the first generated token (the position whose prefix is
    ``begin_index`` tokens long)."""
    def apply(sequences, ends, rows, scores):
        banned = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
        banned[processor.begin_suppress_tokens.to(scores.device)] = True
        at_begin = (ends == processor.begin_index)[:, :, None]
        return scores.masked_fill(at_begin & banned, -math.inf)

    return apply


def _no_repeat_ngram(processor: NoRepeatNGramLogitsProcessor) -> BatchedProcessor:
    return lambda sequences, ends, rows, scores: ban_repeated_ngrams(sequences, ends, scores, processor.ngram_size)


def _sequence_bias(processor: SequenceBiasLogitsProcessor) -> BatchedProcessor:
    def apply(sequences, ends, rows, scores):
        if not processor.prepared_bias_variables:  # transformers prepares them on the first call, from the scores
            processor._prepare_bias_variables(scores.flatten(0, 1))
        return bias_sequences(sequences, ends, scores, processor.length_1_bias, processor.multi_token_biases)

    return apply


def _row_sampling(processor) -> BatchedProcessor:
    return lambda sequences, ends, rows, scores: processor.apply(rows, scores)


BATCHED_FORMS: dict[type, Callable[[LogitsProcessor], BatchedProcessor]] = {
    RowSamplingWarper: _row_sampling,
    RepetitionPenaltyLogitsProcessor: _repetition_penalty,
    MinLengthLogitsProcessor: _min_length,
    MinNewTokensLengthLogitsProcessor: _min_new_tokens,
    NoRepeatNGramLogitsProcessor: _no_repeat_ngram,
    SequenceBiasLogitsProcessor: _sequence_bias,
    NoBadWordsLogitsProcessor: _sequence_bias,
    SuppressTokensAtBeginLogitsProcessor: _suppress_at_begin,
}


def batched_form(processor: LogitsProcessor) -> BatchedProcessor | None:
    """``processor`` for every row and position at once (reading its attributes at each call, so state transformers
    sets later is seen), or ``None`` when its exact type has no batched form."""
    make = BATCHED_FORMS.get(type(processor))
    return None if make is None else make(processor)
