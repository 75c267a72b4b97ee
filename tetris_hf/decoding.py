"""The batched speculative loop of one ``generate()`` call (:func:`tetris_decoding`): its rows stepped, through a
:class:`~tetris_hf.loop_core.LoopCore`, until every one stops. What is ``generate()``'s own lives here: the prompt's
read as the first step, the finished rows by original index, the streamer, the output. Design: docs/design.md, "The
loop and its core".
"""

from __future__ import annotations

import time

import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from .batch import Retired
from .checks import check_generation_config, check_prompt_mask, check_streamer
from .logits import verify
from .loop_core import HoldsCore, LoopCore, LoopStep
from .options import TetrisOptions
from .outputs import TetrisGenerateOutput, TetrisStats
from .step import ReadHints, StepRecord, Verdict
from .timing import StepSeconds


class BatchedSpeculativeLoop(HoldsCore):
    """State of one batched speculative ``generate()`` call; :meth:`step` runs one step of its
    :class:`~tetris_hf.loop_core.LoopCore` (:attr:`core`) and keeps the rows that stopped (a steady step reads the
    device at most twice: docs/gpu.md, "Device reads per step"). A step callback gets this loop: :attr:`batch`,
    :attr:`stats`, :attr:`strategy`, :attr:`drafter`, :attr:`target_slots`, :meth:`partial_outputs`.

    Args:
        model: the target causal LM.
        assistant_model: the draft causal LM (same vocabulary), or ``None`` for prompt lookup.
        input_ids: ``(B, T)`` left-padded prompts.
        attention_mask: ``(B, T)`` 0 on left padding.
        logits_processor, stopping_criteria, generation_config: as ``generate()`` prepared them.
        options: :class:`~tetris_hf.options.TetrisOptions`.
        streamer: optional ``BaseStreamer`` (batch size 1, see :func:`~tetris_hf.checks.check_streamer`): the loop puts
            each step's new tokens.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        assistant_model: torch.nn.Module | None,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor,
        logits_processor: LogitsProcessorList,
        stopping_criteria: StoppingCriteriaList,
        generation_config,
        options: TetrisOptions,
        streamer=None,
    ):
        self.core = LoopCore(model, assistant_model, logits_processor, stopping_criteria, generation_config, options,
                             int(generation_config.max_length), input_ids, attention_mask)
        self.batch_size = input_ids.shape[0]
        self.streamer = streamer
        self.step_callback = options.tetris_step_callback
        self.input_ids = input_ids
        self.prompt_mask = None if self.core.prompts_all_real else attention_mask  # (None: every token real)
        self.prompt_read = False  # the first step reads the prompt and emits the first token, as generate() does
        self.outputs = self.core.batch.sequences.clone()  # finished rows, by original index
        self.output_lengths = self.core.batch.lengths.clone()
        self._stats: TetrisStats | None = None

    @property
    def done(self) -> bool:
        return self.core.batch.num_rows == 0

    def step(self) -> StepRecord:
        """One speculative step for every active row (the first one reads the prompts, as ``generate()``'s own first
        forward does); finished rows leave the batch, their tokens into :attr:`outputs`; then the step callback."""
        if self.prompt_read:
            result = self.core.step()
        else:
            result = self._read_prompt()
            self.prompt_read = True
        self._stream_tokens(result)
        if result.retired is not None:
            self._store_finished(result.retired)
        self._stats = None
        if self.step_callback is not None:
            self.step_callback(result.record, self)
        return result.record

    def _read_prompt(self) -> LoopStep:
        """The first step: the target reads every prompt (its cache had nothing) and adds one token per row."""
        started = time.perf_counter()
        core = self.core
        batch = core.batch
        num_rows = batch.num_rows
        logits, features = core.target_slots.forward(core.model, self.input_ids, self.prompt_mask, logits_to_keep=1,
                                                     hidden_states=core.context.feature_layers)
        target_scores = core.logits_processor(batch.sequences, batch.lengths, logits, batch.rows)
        no_drafts = self.input_ids.new_zeros(num_rows, 0)
        verify_lengths = torch.zeros(num_rows, dtype=torch.long, device=batch.lengths.device)
        num_accepted, next_tokens = verify(no_drafts, verify_lengths, target_scores, None, core.do_sample)
        drafter_read = core.drafter.accept(Verdict(num_accepted, next_tokens, verify_lengths,
                                                   hints=ReadHints(max_accepted=0), features=features))
        emission = batch.emit(num_accepted, next_tokens, 0, core.stopper)
        no_log_probs = target_scores.new_zeros(num_rows, 0)
        record = StepRecord(batch.rows, 0, 0, no_log_probs, verify_lengths, num_accepted, emission.emitted,
                            StepSeconds(0.0, time.perf_counter() - started, 0.0))
        return core.end_step(record, emission.stopped, drafter_read=drafter_read)

    def _stream_tokens(self, result: LoopStep) -> None:
        """The streamer (one row) gets the tokens the step emitted (its row still decoding, or just retired)."""
        if self.streamer is not None:
            rows = self.core.batch if result.retired is None else result.retired
            end = rows.lengths[0]
            self.streamer.put(rows.sequences[0, end - result.record.emitted[0] : end].cpu())

    def close(self) -> None:
        """The models' attention back to their own (the call is over)."""
        self.core.close()

    def _store_finished(self, retired: Retired) -> None:
        """Keep the tokens of the rows that left the batch: into ``outputs``, by original index."""
        self.outputs.index_copy_(0, retired.rows, retired.sequences)
        self.output_lengths.index_copy_(0, retired.rows, retired.lengths)

    def partial_outputs(self) -> list[list[int]]:
        """Every original row's tokens so far (prompt with its left padding, then what it generated)."""
        sequences, lengths, batch = self.outputs.clone(), self.output_lengths.clone(), self.core.batch
        sequences[batch.rows], lengths[batch.rows] = batch.sequences, batch.lengths
        return [row[:length] for row, length in zip(sequences.tolist(), lengths.tolist())]

    @property
    def stats(self) -> TetrisStats:
        """The call's :class:`~tetris_hf.outputs.TetrisStats` so far (read from the device when asked for)."""
        if self._stats is None:
            self._stats = TetrisStats.from_steps(self.core.records, self.batch_size)
        return self._stats

    def output(self) -> torch.LongTensor:
        """``(B, T + new)`` sequences, rows that stopped early right-padded with the pad token (as ``generate()``)."""
        if not self.done:
            raise RuntimeError("generation has not finished")
        total_length = int(self.output_lengths.max())
        columns = torch.arange(total_length, device=self.outputs.device)
        written = columns[None, :] < self.output_lengths[:, None]
        return torch.where(written, self.outputs[:, :total_length], self.core.pad_value)


@torch.no_grad()
def tetris_decoding(
    model: torch.nn.Module,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config,
    *,
    assistant_model: torch.nn.Module | None,
    options: TetrisOptions,
    streamer=None,
    **model_kwargs,
) -> torch.LongTensor | TetrisGenerateOutput:
    """Batched speculative decoding, called by ``generate()`` after its usual preparation.

    Args:
        model: the target causal LM.
        input_ids: ``(B, T)`` left-padded prompts (expanded for ``num_return_sequences``).
        logits_processor, stopping_criteria, generation_config: as ``generate()`` prepared them.
        assistant_model: the draft causal LM (same vocabulary: :func:`~tetris_hf.generation.generate` checked the pair),
            or ``None`` with ``options.prompt_lookup_num_tokens``.
        options: :class:`~tetris_hf.options.TetrisOptions`.
        streamer: optional ``BaseStreamer`` (batch size 1 only): gets the prompt, then each step's new tokens.
        model_kwargs: ``attention_mask`` ``(B, T)`` or ``None`` (no padding); the cache ``generate()`` prepared is
            not used (both models get their own :class:`~tetris_hf.kv.SlotCache`).

    Returns:
        ``(B, T + new)`` sequences, finished rows right-padded with the pad token, or a
        :class:`~tetris_hf.outputs.TetrisGenerateOutput` when ``return_dict_in_generate=True``.
    """
    check_generation_config(generation_config, model_kwargs)
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    check_prompt_mask(attention_mask)  # the mask the loop reads: transformers may have inferred it from padding
    check_streamer(streamer, input_ids.shape[0])
    if streamer is not None:
        streamer.put(input_ids.cpu())  # the prompt first, as generate() streams it
    loop = BatchedSpeculativeLoop(
        model, assistant_model, input_ids, attention_mask, logits_processor, stopping_criteria,
        generation_config, options, streamer,
    )
    try:
        while not loop.done:
            loop.step()
    finally:
        loop.close()
    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return TetrisGenerateOutput(sequences=loop.output(), tetris_stats=loop.stats)
    return loop.output()
