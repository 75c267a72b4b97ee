"""The loop's core, below both loops (``generate()``'s and a request stream's): :class:`LoopCore` owns the strategy,
the drafter, the target's cache, the rows, the clock and the step records, and calls neither loop back. Design:
docs/design.md, "The loop and its core".
"""

from __future__ import annotations

import contextlib
import time
from typing import NamedTuple

import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from .attention import AttentionLayout, check_tree_layout
from .batch import Batch, Retired
from .candidate_generators import build_drafter
from .chain_step import ChainStep, StepContext
from .compile_choice import compile_later
from .compiled import check_compilable, compiled_forward, compiles_on_eager_shapes, eager_shapes_forward
from .kv import SlotCache, slots_needed
from .logits import PositionwiseLogitsProcessor
from .options import TetrisOptions
from .packed_probe import packs_exactly
from .static_shapes import block_width
from .routing import routed_attention
from .step import JoiningPrompts, JoiningRows, PromptChunk, StepRecord, run_step
from .stopping import RowStopper
from .strategies import make_strategy
from .timing import StepClock
from .tree_step import TreeStep


class LoopStep(NamedTuple):
    """What one step of a :class:`LoopCore` did: ``record`` the step's :class:`~tetris_hf.step.StepRecord`;
    ``retired`` the rows that stopped in it and left the batch (``None``: none left); ``joining_tokens`` ``(M,)`` the
    first tokens of the rows whose prompts rode in it (:class:`~tetris_hf.step.JoiningPrompts`; ``None``: none)."""

    record: StepRecord
    retired: Retired | None
    joining_tokens: torch.Tensor | None = None


class LoopCore:
    """The strategy, the drafter, the target's :class:`~tetris_hf.kv.SlotCache`, the rows (:attr:`batch`), the clock
    and the step records (:attr:`records`) of one loop, with what a step needs fixed in :attr:`context`.

    Args:
        model: the target causal LM.
        assistant_model: the draft causal LM (same vocabulary), an EAGLE head, or ``None`` (prompt lookup, suffix
            drafts).
        logits_processor, stopping_criteria, generation_config: as ``generate()`` prepared them.
        options: :class:`~tetris_hf.options.TetrisOptions`.
        max_length: the longest any row may grow.
        input_ids, attention_mask: ``(B, T)`` left-padded prompts, the rows to start with (``generate()``'s; the
            first step is theirs to run, :meth:`end_step`); ``None``: no rows yet, they join with :meth:`add_rows`
            or ride in a step (a request stream's).
        max_rows: with no prompts, the most rows the caches will hold.
        cache_length: with no prompts, the tokens a row's cache holds at first (it grows as rows need).
    """

    def __init__(self, model: torch.nn.Module, assistant_model: torch.nn.Module | None,
                 logits_processor: LogitsProcessorList, stopping_criteria: StoppingCriteriaList, generation_config,
                 options: TetrisOptions, max_length: int, input_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, max_rows: int = 0, cache_length: int | None = None):
        if input_ids is None:
            device = model.get_input_embeddings().weight.device
            num_rows, prompt_length = 0, cache_length
        else:
            device = input_ids.device
            num_rows, prompt_length = input_ids.shape
        self._build(model, assistant_model, logits_processor, stopping_criteria, generation_config, options, device,
                    num_rows, prompt_length, max_length, cache_length, max_rows)
        try:
            self._start(model, options, device, input_ids, attention_mask)
        except BaseException:
            self.close()  # (the models' attention back to their own)
            raise
        self.records: list[StepRecord] = []  # the steps since the user last took them (take_records)
        self.clock = StepClock(device)

    def _start(self, model: torch.nn.Module, options: TetrisOptions, device: torch.device,
               input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> None:
        """The drafter on the prompts (or on no rows yet), the rows, and the target's compiled steps if asked."""
        if input_ids is None:
            empty = torch.zeros(0, 1, dtype=torch.long, device=device)
            self.drafter.prefill(empty, empty, all_real=True)
            self.prompts_all_real = True
            self.batch = Batch.empty(self.sequence_capacity, self.pad_value, self.max_length, device)
        else:  # (lazy: a draft model reads the prompts when it first drafts)
            self.prompts_all_real = bool(attention_mask.all())  # (a read once a call: unpadded prompts read unmasked)
            self.drafter.prefill(input_ids, attention_mask, all_real=self.prompts_all_real)
            self.batch = Batch.of_prompts(input_ids, self.sequence_capacity, self.pad_value, self.max_length)
        if options.tetris_compile:
            check_compilable(model, "target")
            if self.on_eager_shapes:  # (the cache stays as eager: it packs; the attention op writes it)
                self.target_slots.eager_shapes_forward = eager_shapes_forward(model)
            else:
                self.target_slots.step_forward = compiled_forward(model)

    def _build(self, model: torch.nn.Module, assistant_model: torch.nn.Module | None,
               logits_processor: LogitsProcessorList, stopping_criteria: StoppingCriteriaList, generation_config,
               options: TetrisOptions, device: torch.device, num_rows: int, prompt_length: int, max_length: int,
               cache_length: int | None, max_rows: int) -> None:
        """The models' roles, the drafter, the strategy, the target's cache (for ``num_rows`` rows of prompts up to
        ``prompt_length`` and lengths up to ``max_length``; sized for ``cache_length`` tokens a row instead, when
        given, growing as rows need; up to ``max_rows`` rows where they join later) and the step's context."""
        self.model = model
        self.logits_processor = PositionwiseLogitsProcessor(logits_processor)
        # generate()'s length limit (also a criterion, which a stopper applies with any other given)
        self.stopper = RowStopper(stopping_criteria, device, max_length)
        self.max_length = self.stopper.max_length
        self.do_sample = bool(generation_config.do_sample)
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
                                                  max_rows, cache_capacity)

        # blocks with filler read packed: the target computes only the real tokens; eager verify blocks too (priced so
        # by the cost-aware strategies), and compiled ones on eager shapes; static compiled ones keep their shapes
        # (prompts are still read packed)
        pack = options.tetris_pack and packs_exactly(model)
        # compiled on the CPU, the target's forwards keep their eager shapes where they can (compiled.py)
        self.on_eager_shapes = options.tetris_compile and compiles_on_eager_shapes(model, pack)
        if self.tree_width > 1 and options.tetris_compile and not self.on_eager_shapes:
            raise ValueError("`tetris_tree_width` > 1 with tetris_compile=True compiles a target on its eager shapes "
                             "only (on the CPU, reading packed, on plain sdpa): this one would take the static path, "
                             "whose forwards do not take a tree's masks; use tetris_compile=False")
        self.strategy = make_strategy(options, model, draft_model, sampling=self.do_sample,
                                      packed=pack and (not options.tetris_compile or self.on_eager_shapes))
        self.target_slots = SlotCache(num_rows, device, options.tetris_max_holes, capacity=cache_capacity(model))
        self.target_slots.max_rows = max(num_rows, max_rows)
        self.target_slots.pack = pack
        # the models that read packed run the loop's attention for the call (until close); others keep theirs
        routed = [part for part, packs in ((model, pack), (draft_model, self.drafter.pack)) if packs]
        self._routing = contextlib.ExitStack()
        self._routing.enter_context(routed_attention(*routed))
        self.context = StepContext(model, self.target_slots, self.drafter, self.logits_processor, self.stopper,
                                   self.do_sample, bool(options.tetris_compile), self.pad_value,
                                   options.tetris_step_callback is not None)
        # tetris_compile=None: eager until the eager steps' time would have paid for the compile (compile_choice.py)
        self.compile_later = compile_later(model, assistant_model, options)

    # -- stepping ----------------------------------------------------------------------------------------------------

    def step(self, joining: JoiningPrompts | None = None) -> LoopStep:
        """One speculative step for every row (:func:`~tetris_hf.step.run_step`); the rows that stopped leave the
        batch. ``joining``: prompts the step's target forward reads after the rows' blocks (chain steps, a target
        read packed: :attr:`prompts_can_ride`); their rows join at the end of the step with their first tokens (and
        may stop at them)."""
        batch = self.batch
        room = max(self.max_length - batch.shortest - 1, 0)  # no row may verify more than this
        step = run_step(self.strategy, self.phases(joining), batch.num_rows, min(room, self.max_draft), self.clock)
        stopped, joining_tokens, drafter_read = step.emission.stopped, None, step.drafter_read
        if joining is not None:
            joining_tokens = step.block.joining_tokens
            joined, drafter_read = self._join(joining, joining_tokens, step.block.features)
            stopped = torch.cat([stopped, joined])
        return self.end_step(step.record, stopped, joining_tokens, drafter_read)

    def phases(self, joining: JoiningPrompts | None = None) -> ChainStep | TreeStep:
        """A step's phases: every row drafts a chain (the forward reading ``joining``'s prompts too), or a tree."""
        if self.tree_width == 1:
            return ChainStep(self.context, self.batch, joining)
        return TreeStep(self.context, self.batch, self.tree_width)

    def end_step(self, record: StepRecord, stopped: torch.Tensor, joining_tokens: torch.Tensor | None = None,
                 drafter_read: torch.Tensor | None = None) -> LoopStep:
        """Keep the step's ``record`` and retire the rows that ``stopped`` ``(B,)`` (counted in one read with
        ``drafter_read``, what the drafter asked to read, or known on the host). A step a user ran itself
        (``generate()``'s prompt read) ends here too."""
        self.records.append(record)
        if self.compile_later is not None:
            self._count_eager(sum(record.seconds))
        batch, read = self.batch, None
        if batch.shortest >= self.max_length:
            num_stopped = batch.num_rows  # every row is at the length limit
        elif self.stopper.only_length and batch.row_limits is None and batch.longest < self.max_length:
            num_stopped = 0  # no row can have stopped: no need to ask the device
        elif drafter_read is None:
            num_stopped = int(stopped.sum())
        else:  # a read the step makes anyway: what the drafter asked for comes along
            num_stopped, read = torch.stack([stopped.sum(), drafter_read]).tolist()
        if num_stopped:
            return LoopStep(record, self.retire(stopped, num_stopped, read), joining_tokens)
        self.drafter.settle(read)
        return LoopStep(record, None, joining_tokens)

    def _count_eager(self, seconds: float) -> None:
        """``tetris_compile=None``: count an eager step's (or prompt read's) ``seconds``; once they have paid for the
        compile (:class:`~tetris_hf.compile_choice.CompileLater`), the target's forwards from the next one on run
        compiled on their eager shapes (where the choice, measured now if it was not, says so), else eager for good."""
        if self.compile_later.count(seconds):
            later, self.compile_later = self.compile_later, None
            if later.decide():
                self.on_eager_shapes = True
                self.target_slots.eager_shapes_forward = eager_shapes_forward(self.model)

    def take_records(self) -> list[StepRecord]:
        """The step records kept since the last call, which the core then forgets (a stream folds them)."""
        records, self.records = self.records, []
        return records

    # -- rows --------------------------------------------------------------------------------------------------------

    def retire(self, stopped: torch.Tensor, num_stopped: int, drafter_read: int | None = None) -> Retired:
        """Move the ``num_stopped`` rows that ``stopped`` ``(B,)`` marks out of the batch, both caches' rows moving as
        the batch's (:meth:`~tetris_hf.batch.Batch.retire`; the drafter settles ``drafter_read`` first); returns them
        (for the user to keep)."""
        retired, moves = self.batch.retire(stopped, num_stopped)
        self.target_slots.fill_rows(*moves)
        self.drafter.settle(drafter_read, retired, moves)  # (a suffix cache keeps the retired rows)
        return retired

    def remove(self, rows: list[int]) -> Retired | None:
        """Take the rows whose original indices are ``rows`` (active ones) out of the batch now; returns them."""
        if not rows:
            return None
        batch = self.batch
        return self.retire(torch.isin(batch.rows, torch.tensor(rows, device=batch.rows.device)), len(rows))

    @property
    def prompts_can_ride(self) -> bool:
        """Whether a prompt can be read in a step's verification forward (:class:`~tetris_hf.step.JoiningPrompts`):
        the target reads packed, and the step drafts chains (a tree's verification reads ancestor masks)."""
        return self.target_slots.packs and self.tree_width == 1

    def prompt_rows(self, prompts: list[list[int]]) -> torch.Tensor:
        """``(M, capacity)`` the prompts from column 0, pad after them (rows to join)."""
        rows = torch.full((len(prompts), self.sequence_capacity), self.pad_value, dtype=torch.long)
        for index, prompt in enumerate(prompts):
            rows[index, : len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        return rows.to(self.batch.lengths.device)

    def add_rows(self, rows: list[int], prompts: list[list[int]], limits: list[int],
                 eos_token_ids: list[tuple[int, ...]], chunk: int) -> None:
        """New rows join after the active ones now: row ``rows[i]`` (its original index) holds ``prompts[i]`` (at
        least one token), stops at length ``limits[i]`` or at one of ``eos_token_ids[i]``. Both caches read the
        prompts but their last tokens, ``chunk`` tokens a forward, in forwards of their own; each last token opens its
        row's first verified block at the next step."""
        old_rows = self.batch.num_rows
        sequences = self.prompt_rows(prompts)
        lengths = [len(prompt) for prompt in prompts]
        device = sequences.device
        last_tokens = sequences.gather(1, torch.tensor(lengths, device=device)[:, None] - 1)[:, 0]
        self.batch.add(torch.tensor(rows, device=device), sequences, lengths, last_tokens, limits, eos_token_ids)
        self.target_slots.add_rows(len(prompts))
        self.drafter.join(JoiningRows(last_tokens, lengths))
        self._read_prompts(old_rows, prompts, chunk)

    def _read_prompts(self, old_rows: int, prompts: list[list[int]], chunk: int) -> None:
        """Both caches read the prompts of the rows from ``old_rows`` on but their last tokens, ``chunk`` tokens a
        forward; the other rows' blocks are empty (packed, they cost nothing; padded, they compute filler)."""
        device, batch = self.batch.lengths.device, self.batch
        to_read = [len(prompt) - 1 for prompt in prompts]
        started = time.perf_counter()  # (the host clock: only a CPU target compiles later)
        for start in range(0, max(to_read), chunk):
            sizes = [min(max(length - start, 0), chunk) for length in to_read]
            width = max(sizes)
            block = torch.full((batch.num_rows, width), self.pad_value, dtype=torch.long)
            successors = block.clone()  # each real token's successor in its prompt (an EAGLE head's pairs)
            for index, (prompt, size) in enumerate(zip(prompts, sizes)):
                if size:
                    block[old_rows + index, :size] = torch.tensor(prompt[start : start + size])
                    successors[old_rows + index, :size] = torch.tensor(prompt[start + 1 : start + size + 1])
            block, successors = block.to(device), successors.to(device)
            real_lengths = torch.tensor([0] * old_rows + sizes, device=device)
            num_real = sum(sizes)
            _, features = self.target_slots.forward(self.model, block, None, real_lengths=real_lengths,
                                                    num_real=num_real, discard_logits=True, first_row=old_rows,
                                                    hidden_states=self.context.feature_layers,
                                                    prompt_lengths=tuple(sizes))
            # no row holds more real tokens than the longest row's length (a row's last token is never cached)
            self.target_slots.compact(batch.longest)
            self.drafter.join(chunk=PromptChunk(block, real_lengths, num_real, batch.longest, successors, old_rows,
                                                features))
        if self.compile_later is not None:
            self._count_eager(time.perf_counter() - started)

    def _join(self, joining: JoiningPrompts, first_tokens: torch.Tensor,
              features: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The rows of ``joining``, whose prompts the step's target forward just read (its hidden states for the
        drafter: ``features``), join with their first tokens ``first_tokens`` ``(M,)``: the drafter reads the prompts
        too. Returns ``(M,)`` which of them stopped at that token, and what the drafter now asks the loop to read."""
        batch = self.batch
        old_rows, rows = batch.num_rows, joining.sequences
        lengths = [length + 1 for length in joining.prompt_lengths]  # each prompt and its first token
        batch.add(joining.lanes, rows, lengths, first_tokens, list(joining.limits), list(joining.eos_token_ids))
        stopped = ((batch.row_eos[old_rows:] == first_tokens[:, None]).any(dim=1)
                   | (batch.lengths[old_rows:] >= batch.row_limits[old_rows:]))
        # the block as the target read it (the decoding rows' part empty), and each token's successor in its row (an
        # EAGLE head's pairs): the prompt's next token, the first token after the last
        successors = rows[:, 1 : joining.width + 1]
        old = joining.tokens.new_full((old_rows, joining.width), self.pad_value)
        real_lengths = torch.cat([joining.lengths.new_zeros(old_rows), joining.lengths])
        chunk = PromptChunk(torch.cat([old, joining.tokens]), real_lengths, joining.num_tokens, batch.longest,
                            torch.cat([old, successors]), old_rows, features)
        return stopped, self.drafter.join(JoiningRows(first_tokens, lengths), chunk)

    def close(self) -> None:
        """The models' attention back to their own (the loop is over)."""
        self._routing.close()


class HoldsCore:
    """What a step callback (``fn(record, loop)``) reads of a loop that holds a :class:`LoopCore` in :attr:`core`:
    the rows, the strategy, the drafter and the target's cache."""

    core: LoopCore

    @property
    def batch(self) -> Batch:
        return self.core.batch

    @property
    def strategy(self):
        return self.core.strategy

    @property
    def drafter(self):
        return self.core.drafter

    @property
    def target_slots(self) -> SlotCache:
        return self.core.target_slots
