# Exported from tetris_hf/decoding.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""The batched speculative loop: the state of one ``generate()`` call, stepped until every row stops.

Rows advance independently. Each step, every active row drafts ``K`` tokens; a strategy picks how many of them each
row verifies (TETRIS: the top-``C`` cells of the batch); the target reads every row's block in one forward; each row
keeps its accepted prefix plus one target token; both KV caches drop what was rejected. Finished rows leave the batch,
so they cost nothing afterwards. The step itself is :func:`~tetris_hf.step.run_step`, through the phases of
:class:`~tetris_hf.chain_step.ChainStep` (or, with ``tetris_tree_width > 1``, :class:`~tetris_hf.tree_step.TreeStep`,
every row drafting a tree); this module holds what they share: the rows, the caches, the step's device read, the
acceptance rule, emission and retiring rows.
"""

from __future__ import annotations

import time

import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from .attention import AttentionLayout, check_tree_layout
from .batch import Batch, Retired
from .candidate_generators import build_drafter
from .checks import check_generation_config, check_prompt_mask, check_streamer
from .compiled import check_compilable, compiled_forward
from .kv import SlotCache, slots_needed
from .logits import PositionwiseLogitsProcessor, verify
from .options import TetrisOptions
from .packed_probe import packs_exactly
from .outputs import TetrisGenerateOutput, TetrisStats
from .static_shapes import block_width
from .chain_step import ChainStep, StepContext
from .step import JoiningPrompts, ReadHints, StepRecord, Verdict, run_step
from .stopping import RowStopper
from .strategies import make_strategy
from .timing import StepClock, StepSeconds
from .tree_step import TreeStep


class BatchedSpeculativeLoop:
    """State of one batched speculative ``generate()`` call; :meth:`step` runs one step (draft -> select -> verify ->
    roll back -> emit).

    The step reads the device once to size the target's block (:meth:`read_step`: the longest verified prefix, read
    together with the caches' fill levels and the longest row's length), and once more only when a row may have
    stopped (an EOS or another criterion than the length limit, or a row near that limit), which also tells the draft
    how wide its next block must be. Everything else it
    needs on the host is an upper bound it keeps itself: every active row grows by at least one and at most
    ``block + 1`` tokens a step, and no row accepted more drafts than the longest verified block. Counts stay on the
    device until :attr:`stats` turns them into a :class:`~tetris_hf.outputs.TetrisStats`.

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
        batch_size, prompt_length = input_ids.shape
        self._setup(model, assistant_model, logits_processor, stopping_criteria, generation_config, options,
                    input_ids.device, batch_size, prompt_length, int(generation_config.max_length))
        self.streamer = streamer
        self.input_ids = input_ids
        self.prompt_mask = attention_mask
        self.prompt_read = False  # the first step reads the prompt and emits the first token, as generate() does
        # lazy: a draft model reads the prompt when it first drafts
        self.drafter.prefill(input_ids, attention_mask, all_real=bool(attention_mask.all()))
        self._compile_and_attach()
        self.batch = Batch.of_prompts(input_ids, self.sequence_capacity, self.pad_value, self.max_length)
        self.outputs = self.batch.sequences.clone()  # finished rows, by original index
        self.output_lengths = self.batch.lengths.clone()
        self._records: list[StepRecord] = []
        self.clock = StepClock(input_ids.device)
        self._stats: TetrisStats | None = None

    def _setup(self, model: torch.nn.Module, assistant_model: torch.nn.Module | None,
               logits_processor: LogitsProcessorList, stopping_criteria: StoppingCriteriaList, generation_config,
               options: TetrisOptions, device: torch.device, batch_size: int, prompt_length: int,
               max_length: int, cache_length: int | None = None) -> None:
        """What every loop needs before its rows: the models' roles, the drafter, the strategy, the target's cache
        (for ``batch_size`` rows of prompts up to ``prompt_length`` and lengths up to ``max_length``; caches sized
        for ``cache_length`` tokens a row instead, when given, grow as rows need)."""
        self.model = model
        self.logits_processor = PositionwiseLogitsProcessor(logits_processor)
        # generate()'s length limit (also a criterion, which a stopper applies with any other given)
        self.stopper = RowStopper(stopping_criteria, device, max_length)
        self.max_length = self.stopper.max_length
        self.joining: JoiningPrompts | None = None  # prompts of rows joining after the step (a stream's), read in it
        self.do_sample = bool(generation_config.do_sample)
        self.streamer = None
        self.step_callback = options.tetris_step_callback
        self.batch_size = batch_size
        pad_token = getattr(generation_config, "_pad_token_tensor", None)
        if pad_token is None:
            pad_token = generation_config.pad_token_id
        self.pad_value = int(pad_token) if pad_token is not None else 0

        # Drafts are written past each row's end (scratch that accepted tokens overwrite): room for the longest block.
        self.max_draft = options.num_assistant_tokens + options.tetris_extra_tokens
        self.sequence_capacity = self.max_length + self.max_draft + 1
        block = block_width(self.max_draft + 1, options.tetris_compile, device)
        self.tree_width = options.tetris_tree_width
        if self.tree_width > 1:  # a tree writes up to w K nodes (the target's block) and reads ancestor masks
            block = 1 + self.tree_width * self.max_draft
            check_tree_layout(AttentionLayout.of(model), model)

        def cache_capacity(layout_model: torch.nn.Module) -> int:  # (its layout also refuses what it cannot mask)
            return slots_needed(AttentionLayout.of(layout_model), prompt_length, cache_length or self.max_length,
                                block, options.tetris_max_holes)

        self.drafter, draft_model = build_drafter(assistant_model, options, self.logits_processor, self.do_sample,
                                                  cache_capacity)
        # verify blocks packed: the target computes only the selected tokens (priced so by the cost-aware strategies)
        pack = options.tetris_pack and not options.tetris_compile and packs_exactly(model)
        self.strategy = make_strategy(options, model, draft_model, sampling=self.do_sample, packed=pack)
        self.target_slots = SlotCache(batch_size, device, options.tetris_max_holes, capacity=cache_capacity(model))
        self.target_slots.pack = pack
        self.compile = options.tetris_compile
        self.context = StepContext(model, self.target_slots, self.drafter, self.logits_processor, self.stopper,
                                   self.do_sample, self.compile, self.pad_value, self.step_callback is not None)

    def _compile_and_attach(self) -> None:
        """After the drafter's :meth:`~.Drafter.prefill`: compiled step forwards if asked for, then the drafter's
        hooks on the target (the last setup)."""
        if self.compile:
            check_compilable(self.model, "target")
            self.target_slots.step_forward = compiled_forward(self.model)
            self.drafter.compile()
        self.drafter.attach(self.model)  # hooks on the target, if it reads its forwards (an EAGLE head)

    @property
    def done(self) -> bool:
        return self.batch.num_rows == 0

    def step(self) -> StepRecord:
        """One speculative step for every active row; finished rows leave the batch.

        The first step reads the prompt into the target's cache and emits the token after it (no drafts), as
        ``generate()``'s own first forward does; every later step is :func:`~tetris_hf.step.run_step`.
        """
        if not self.prompt_read:
            return self._read_prompt()
        batch = self.batch
        room = max(self.max_length - batch.shortest - 1, 0)  # no row may verify more than this
        step = run_step(self.strategy, self.phases(), batch.num_rows, min(room, self.max_draft), self.clock)
        self._stream_tokens(step.emission.emitted)
        return self._finish(step.record, step.emission.stopped, step.block)

    def phases(self) -> ChainStep | TreeStep:
        """This step's phases: every row drafts a chain (reading the prompts of rows joining after it, a stream's), or
        a tree."""
        if self.tree_width == 1:
            return ChainStep(self.context, self.batch, self.joining)
        return TreeStep(self.context, self.batch, self.tree_width)

    def _read_prompt(self) -> StepRecord:
        """The first step: the target reads every prompt (its cache had nothing) and adds one token per row."""
        started = time.perf_counter()
        batch = self.batch
        num_rows = batch.num_rows
        logits = self.target_slots.forward(self.model, self.input_ids, self.prompt_mask, logits_to_keep=1)
        target_scores = self.logits_processor(batch.sequences, batch.lengths, logits, batch.rows)
        no_drafts = self.input_ids.new_zeros(num_rows, 0)
        verify_lengths = torch.zeros(num_rows, dtype=torch.long, device=batch.lengths.device)
        num_accepted, next_tokens = verify(no_drafts, verify_lengths, target_scores, None, self.do_sample)
        verdict = Verdict(num_accepted, next_tokens, verify_lengths, hints=ReadHints(max_accepted=0))
        self.drafter.accept(verdict)
        self.prompt_read = True
        emission = batch.emit(num_accepted, next_tokens, 0, self.stopper)
        self._stream_tokens(emission.emitted)
        no_log_probs = target_scores.new_zeros(num_rows, 0)
        record = StepRecord(batch.rows, 0, 0, no_log_probs, verify_lengths, num_accepted, emission.emitted,
                            StepSeconds(0.0, time.perf_counter() - started, 0.0))
        return self._finish(record, emission.stopped)

    def _stream_tokens(self, emitted: torch.Tensor) -> None:
        """The streamer (one row) gets the tokens this step emitted, ``emitted`` ``(B,)`` of them per row."""
        if self.streamer is not None:
            end = self.batch.lengths[0]
            self.streamer.put(self.batch.sequences[0, end - emitted[0] : end].cpu())

    def close(self) -> None:
        """Remove what the drafter put on the target (the call is over)."""
        self.drafter.detach()

    def _finish(self, record: StepRecord, stopped: torch.Tensor, block=None) -> StepRecord:
        """Keep the step's record, retire the rows that ``stopped`` ``(B_active,)``, call the user's step callback.
        (``block``: where the step's verification went, :class:`~tetris_hf.step.TargetBlock`; ``None`` for the
        prompt's read.)"""
        self._records.append(record)
        self._stats = None
        batch = self.batch
        if batch.shortest >= self.max_length:
            num_stopped = batch.num_rows  # every row is at the length limit
        elif self.stopper.only_length and batch.row_limits is None and batch.longest < self.max_length:
            num_stopped = 0  # no row can have stopped: no need to ask the device
        elif (pending_width := self.drafter.pending_width()) is None:  # nothing for the drafter to trim
            num_stopped = int(stopped.sum())
        else:  # a read the step makes anyway: how wide the draft's next block must be comes along
            num_stopped, width = torch.stack([stopped.sum(), pending_width]).tolist()
            self.drafter.trim_pending(width)
        if num_stopped:
            self._retire(stopped, num_stopped)
        if self.step_callback is not None:
            self.step_callback(record, self)
        return record

    def _retire(self, stopped: torch.Tensor, num_stopped: int) -> None:
        """Move the ``num_stopped`` rows that ``stopped`` ``(B_active,)`` out of the batch (their tokens into
        ``outputs``), both caches' rows moving as the batch's (:meth:`~tetris_hf.batch.Batch.retire`)."""
        retired, moves = self.batch.retire(stopped, num_stopped)
        self._store_finished(retired)
        self.drafter.remember(retired.rows, retired.sequences, retired.lengths)  # (a suffix cache keeps them)
        self.target_slots.fill_rows(*moves)
        self.drafter.fill_rows(*moves)

    def _store_finished(self, retired: Retired) -> None:
        """Keep the tokens of the rows that left the batch: into ``outputs``, by original index."""
        self.outputs.index_copy_(0, retired.rows, retired.sequences)
        self.output_lengths.index_copy_(0, retired.rows, retired.lengths)

    def partial_outputs(self) -> list[list[int]]:
        """Every original row's tokens so far (prompt with its left padding, then what it generated)."""
        sequences, lengths, batch = self.outputs.clone(), self.output_lengths.clone(), self.batch
        sequences[batch.rows], lengths[batch.rows] = batch.sequences, batch.lengths
        return [row[:length] for row, length in zip(sequences.tolist(), lengths.tolist())]

    @property
    def stats(self) -> TetrisStats:
        """The call's :class:`~tetris_hf.outputs.TetrisStats` so far (read from the device when asked for)."""
        if self._stats is None:
            self._stats = TetrisStats.from_steps(self._records, self.batch_size)
        return self._stats

    def output(self) -> torch.LongTensor:
        """``(B, T + new)`` sequences, rows that stopped early right-padded with the pad token (as ``generate()``)."""
        if not self.done:
            raise RuntimeError("generation has not finished")
        total_length = int(self.output_lengths.max())
        columns = torch.arange(total_length, device=self.outputs.device)
        written = columns[None, :] < self.output_lengths[:, None]
        return torch.where(written, self.outputs[:, :total_length], self.pad_value)


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
