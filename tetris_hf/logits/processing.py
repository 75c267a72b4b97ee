"""Apply transformers' logits processors at many positions of many rows at once, each on its own prefix, as plain
``generate()`` would at each of them (:class:`PositionwiseLogitsProcessor`). Design: docs/design.md, "Verification".
"""

from __future__ import annotations

import copy
import itertools

import torch
from transformers.generation.logits_process import (
    EpsilonLogitsWarper, EtaLogitsWarper, InfNanRemoveLogitsProcessor, LogitNormalization, LogitsProcessorList,
    MinPLogitsWarper, PrefixConstrainedLogitsProcessor, RepetitionPenaltyLogitsProcessor, SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper, TopHLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TypicalLogitsWarper,
)

from .batched_processors import BATCHED_FORMS, batched_form, prefix_ends
from .row_sampling import RowSamplingWarper

# Processors whose output depends on the scores alone, never on the tokens so far.
PREFIX_FREE_PROCESSORS = (
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, TopHLogitsWarper, MinPLogitsWarper,
    TypicalLogitsWarper, EpsilonLogitsWarper, EtaLogitsWarper, InfNanRemoveLogitsProcessor, LogitNormalization,
    SuppressTokensLogitsProcessor,
)


def is_prefix_free(logits_processor: LogitsProcessorList) -> bool:
    """True when no processor in the list looks at the tokens so far (exact types only: subclasses may); a row's own
    sampling settings read its row, not its tokens."""
    return all(type(processor) in PREFIX_FREE_PROCESSORS or type(processor) is RowSamplingWarper
               for processor in logits_processor)


def _for_one_row(processor, row: int):
    """``processor`` as it applies to original batch row ``row`` when called on that row alone (a batch of one): the
    repetition penalty's per-row prompt offsets and ``prefix_allowed_tokens_fn``'s ``batch_id`` are re-indexed."""
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


# How a processor runs on a (B, L, V) block: on every position flattened into one batch (it ignores the prefix), in
# its batched form (it reads the prefix, batched_processors has its exact type), or per row and position (the rest).
FLAT, BATCHED, PER_ROW = "flat", "batched", "per_row"


def _kind(processor) -> str:
    if type(processor) in PREFIX_FREE_PROCESSORS:
        return FLAT
    return BATCHED if type(processor) in BATCHED_FORMS else PER_ROW


def _runs(logits_processor: LogitsProcessorList) -> list[tuple[str, list[int]]]:
    """The list in order as runs of consecutive processors of one kind: ``(kind, indices)``. E.g. [repetition
    penalty, custom, temperature, top-k] -> [(batched, [0]), (per_row, [1]), (flat, [2, 3])]."""
    grouped = itertools.groupby(enumerate(logits_processor), key=lambda item: _kind(item[1]))
    return [(kind, [index for index, _ in run]) for kind, run in grouped]


def _apply_flat(processors: LogitsProcessorList, scores: torch.Tensor) -> torch.Tensor:
    """Processors that ignore ``input_ids``, on every position of ``scores (B, L, V)`` in one call."""
    batch_size, num_positions, vocab_size = scores.shape
    flat = scores.reshape(batch_size * num_positions, vocab_size)
    dummy_ids = torch.zeros(flat.shape[0], 1, dtype=torch.long, device=flat.device)
    return processors(dummy_ids, flat).view(batch_size, num_positions, vocab_size)


class PositionwiseLogitsProcessor:
    """``generate()``'s logits processors applied at many positions of many rows, each with its own prefix.

    Args:
        logits_processor: the processors ``generate()`` prepared for the whole batch (may be empty).

    Attributes:
        prefix_free: no processor reads the tokens so far (a draft need not write each token into ``sequences``
            before scoring the next).
        per_row: the processors that run per row and position (no batched form): their indices in the list.
    """

    def __init__(self, logits_processor: LogitsProcessorList):
        self.logits_processor = logits_processor
        self.prefix_free = is_prefix_free(logits_processor)
        runs = _runs(logits_processor)
        self.per_row = [index for kind, indices in runs if kind == PER_ROW for index in indices]
        # (FLAT, the run's LogitsProcessorList) | (BATCHED, the run's batched forms) | (PER_ROW, the run's indices)
        self._stages: list[tuple[str, object]] = []
        for kind, indices in runs:
            if kind == FLAT:
                self._stages.append((kind, LogitsProcessorList(logits_processor[i] for i in indices)))
            elif kind == BATCHED:
                self._stages.append((kind, [batched_form(logits_processor[i]) for i in indices]))
            else:
                self._stages.append((kind, indices))
        self._row_lists: dict[tuple[int, tuple[int, ...]], LogitsProcessorList] = {}

    def _row_list(self, row: int, indices: list[int]) -> LogitsProcessorList:
        key = (row, tuple(indices))
        if key not in self._row_lists:
            self._row_lists[key] = LogitsProcessorList(_for_one_row(self.logits_processor[i], row) for i in indices)
        return self._row_lists[key]

    def __call__(self, sequences: torch.Tensor, prefix_lengths: torch.Tensor, logits: torch.Tensor, rows: torch.Tensor,
                 offset: int = 0) -> torch.Tensor:
        """Processed scores at ``L`` consecutive positions of each row: position ``j`` of row ``i`` predicts the token
        after ``sequences[i, :prefix_lengths[i] + offset + j]``. Reads nothing from the device unless :attr:`per_row`.

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
        ends = None if self.prefix_free else prefix_ends(prefix_lengths, offset, scores.shape[1])
        for kind, stage in self._stages:
            if kind == FLAT:
                scores = _apply_flat(stage, scores)
            elif kind == BATCHED:
                for form in stage:
                    scores = form(sequences, ends, rows, scores)
            else:
                scores = self._apply_per_row(stage, sequences, prefix_lengths, scores, rows, offset)
        return scores

    def _apply_per_row(self, indices: list[int], sequences: torch.Tensor, prefix_lengths: torch.Tensor,
                       scores: torch.Tensor, rows: torch.Tensor, offset: int) -> torch.Tensor:
        """The processors at ``indices`` called on each row and position alone, on its exact prefix (host reads)."""
        processed = torch.empty_like(scores)
        for index, (row, length) in enumerate(zip(rows.tolist(), prefix_lengths.tolist())):
            row_processors = self._row_list(row, indices)
            for position in range(scores.shape[1]):
                prefix = sequences[index : index + 1, : length + offset + position]
                processed[index, position] = row_processors(prefix, scores[index, position].unsqueeze(0).clone())[0]
        return processed
