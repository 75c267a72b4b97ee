"""Apply transformers' logits processors to many positions at once, as plain ``generate()`` would at each of them.

Plain ``generate()`` calls its ``LogitsProcessorList`` once per step on ``(input_ids (B, T), scores (B, V))`` with the
sequence so far. Speculative decoding needs the processed distribution at several positions of several rows at once,
each with its own prefix. Processors that ignore ``input_ids`` (temperature, top-k, top-p, ...) are applied to every
position in one call; any other processor is called per row and per position on exactly the prefix plain
``generate()`` would have passed it.
"""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MinPLogitsWarper,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

# Processors whose output depends on the scores alone, never on the tokens so far.
PREFIX_FREE_PROCESSORS = (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TopHLogitsWarper,
    MinPLogitsWarper,
    TypicalLogitsWarper,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    SuppressTokensLogitsProcessor,
)


def is_prefix_free(logits_processor: LogitsProcessorList) -> bool:
    """True when no processor in the list looks at the tokens so far (exact types only: subclasses may)."""
    return all(type(processor) in PREFIX_FREE_PROCESSORS for processor in logits_processor)


def process_logits(
    logits_processor: LogitsProcessorList,
    sequences: torch.Tensor,
    prefix_lengths: torch.Tensor,
    logits: torch.Tensor,
) -> torch.Tensor:
    """Processed scores at ``L`` consecutive positions of each row, in float32.

    Position ``j`` of row ``i`` predicts the token after ``sequences[i, :prefix_lengths[i] + j]``: that prefix is
    exactly what plain batched ``generate()`` would pass the processors there (left padding included).

    Args:
        logits_processor: the processors ``generate()`` prepared (may be empty).
        sequences: ``(B, T)`` each row's tokens, followed by the tokens being scored (drafts);
            ``T >= prefix_lengths + L - 1``.
        prefix_lengths: ``(B,)`` prefix length at position 0.
        logits: ``(B, L, V)`` raw model logits.

    Returns:
        ``(B, L, V)`` float32 processed scores.
    """
    scores = logits.float()
    if len(logits_processor) == 0:
        return scores
    batch_size, num_positions, vocab_size = scores.shape
    if is_prefix_free(logits_processor):
        # No processor here reads input_ids: process every position in one call.
        flat = scores.reshape(batch_size * num_positions, vocab_size)
        dummy_ids = torch.zeros(flat.shape[0], 1, dtype=torch.long, device=flat.device)
        return logits_processor(dummy_ids, flat).view(batch_size, num_positions, vocab_size)
    processed = torch.empty_like(scores)
    for row in range(batch_size):
        length = int(prefix_lengths[row])
        for position in range(num_positions):
            prefix = sequences[row : row + 1, : length + position]
            processed[row, position] = logits_processor(prefix, scores[row, position].unsqueeze(0).clone())[0]
    return processed
