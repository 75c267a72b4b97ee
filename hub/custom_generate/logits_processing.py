# Exported from tetris_hf/logits/processing.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""Apply transformers' logits processors to many positions at once, as plain ``generate()`` would at each of them.

Plain ``generate()`` calls its ``LogitsProcessorList`` once per step on ``(input_ids (B, T), scores (B, V))`` with the
sequence so far. Speculative decoding needs the processed distribution at several positions of several rows at once,
each with its own prefix. Processors that ignore ``input_ids`` (temperature, top-k, top-p, ...) are applied to every
position in one call; any other processor is called per row and per position on exactly the prefix plain
``generate()`` would have passed it.
"""

from __future__ import annotations

import copy

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MinPLogitsWarper,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
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


def _for_one_row(processor, row: int):
    """``processor`` as it applies to original batch row ``row`` when called on that row alone (a batch of one).

    Two of transformers' processors hold per-row state indexed by batch position: the repetition penalty's
    per-row prompt offsets (left padding to ignore) and ``prefix_allowed_tokens_fn``'s ``batch_id``.
    """
    if isinstance(processor, RepetitionPenaltyLogitsProcessor) and isinstance(
        processor.prompt_ignore_length, torch.Tensor
    ):
        adapted = copy.copy(processor)
        adapted.prompt_ignore_length = processor.prompt_ignore_length[row : row + 1]
        return adapted
    if isinstance(processor, PrefixConstrainedLogitsProcessor):
        if processor._num_beams != 1:
            raise ValueError("prefix_allowed_tokens_fn with num_beams > 1 is not supported by tetris_hf")
        adapted = copy.copy(processor)
        allowed = processor._prefix_allowed_tokens_fn
        adapted._prefix_allowed_tokens_fn = lambda _batch_id, tokens: allowed(row, tokens)
        return adapted
    return processor


class PositionwiseLogitsProcessor:
    """``generate()``'s logits processors applied at many positions of many rows, each with its own prefix.

    Args:
        logits_processor: the processors ``generate()`` prepared for the whole batch (may be empty).
    """

    def __init__(self, logits_processor: LogitsProcessorList):
        self.logits_processor = logits_processor
        self.prefix_free = is_prefix_free(logits_processor)
        self._row_lists: dict[int, LogitsProcessorList] = {}

    def _row_list(self, row: int) -> LogitsProcessorList:
        if row not in self._row_lists:
            self._row_lists[row] = LogitsProcessorList(_for_one_row(p, row) for p in self.logits_processor)
        return self._row_lists[row]

    def __call__(
        self, sequences: torch.Tensor, prefix_lengths: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor,
        offset: int = 0,
    ) -> torch.Tensor:
        """Processed scores at ``L`` consecutive positions of each row, in float32.

        Position ``j`` of row ``i`` predicts the token after ``sequences[i, :prefix_lengths[i] + offset + j]``: that
        prefix is what plain batched ``generate()`` would pass the processors there (left padding included).

        Args:
            sequences: ``(B, T)`` each row's tokens, followed by the tokens being scored (drafts);
                ``T >= prefix_lengths + L - 1``.
            prefix_lengths: ``(B,)`` prefix length at position 0, before ``offset``.
            logits: ``(B, L, V)`` raw model logits.
            rows: ``(B,)`` each row's index in the batch ``generate()`` was called with.

        Returns:
            ``(B, L, V)`` float32 processed scores.
        """
        scores = logits if logits.dtype == torch.float32 else logits.float()
        if len(self.logits_processor) == 0:
            return scores
        batch_size, num_positions, vocab_size = scores.shape
        if self.prefix_free:
            # No processor here reads input_ids: process every position in one call.
            flat = scores.reshape(batch_size * num_positions, vocab_size)
            dummy_ids = torch.zeros(flat.shape[0], 1, dtype=torch.long, device=flat.device)
            return self.logits_processor(dummy_ids, flat).view(batch_size, num_positions, vocab_size)
        processed = torch.empty_like(scores)
        for index, (row, length) in enumerate(zip(rows.tolist(), prefix_lengths.tolist())):
            row_processors = self._row_list(row)
            for position in range(num_positions):
                prefix = sequences[index : index + 1, : length + offset + position]
                processed[index, position] = row_processors(prefix, scores[index, position].unsqueeze(0).clone())[0]
        return processed
