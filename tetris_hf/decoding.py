"""The batched speculative loop: draft -> select -> verify -> accept -> roll back, until every row stops.

Rows advance independently. Each step, every active row drafts ``K`` tokens; a strategy picks how many of them each
row verifies (TETRIS: the top-``C`` cells of the batch); the target reads every row's block in one forward; each row
keeps its accepted prefix plus one target token; both KV caches drop what was rejected. Finished rows leave the batch,
so they cost nothing afterwards. With ``tetris_tree_width > 1`` every row drafts a tree instead of a chain, and a step
is :func:`~tetris_hf.tree_step.tree_step`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from .attention import AttentionLayout, check_tree_layout
from .candidate_generators import build_drafter
from .candidate_generators.drafter import Proposal
from .checks import check_generation_config, check_prompt_mask, check_streamer
from .compiled import check_compilable, compiled_forward
from .kv import SlotCache, slots_needed
from .logits import PositionwiseLogitsProcessor, verify_greedy, verify_sampling
from .options import TetrisOptions
from .outputs import TetrisGenerateOutput, TetrisStats
from .static_shapes import block_width
from .step_strategy import StepSeconds, run_step
from .stopping import RowStopper
from .strategies import make_strategy
from .timing import StepClock
from .tree_step import StepTree, tree_step


class StepVerdict(NamedTuple):
    """What the target's side of a step did, per active row (``(B_active,)``): drafts accepted, tokens kept
    (accepted + the target's, fewer where a row stopped), rows now finished; and the step's measured seconds."""

    num_accepted: torch.Tensor
    emitted: torch.Tensor
    stopped: torch.Tensor
    seconds: StepSeconds | None


@dataclass
class StepRecord:
    """What one step did, per active row (shapes ``(B_active,)``; ``rows`` are original batch indices).

    ``seconds``: the step's measured draft, target and other time (:class:`~tetris_hf.timing.StepClock`; on CUDA
    the previous step's, read once this step has synchronised it, and zeros at the first drafting step). The draft
    reading tokens it skipped while the loop decoded plainly is in none of them: it is a one-off catch-up, not a cost
    of drafting.
    """

    rows: torch.Tensor
    num_drafted: int
    budget: int
    token_log_probs: torch.Tensor | None  # (B_active, K) the draft's confidences (None: nothing needed them)
    verify_lengths: torch.Tensor
    num_accepted: torch.Tensor
    emitted: torch.Tensor
    seconds: StepSeconds = StepSeconds(0.0, 0.0, 0.0)
    proposed: torch.Tensor | None = None  # (B_active,) cells each row drafted, where fewer than num_drafted
    tree: StepTree | None = None  # tetris_tree_width > 1: the step's trees, selection and accepted paths

    @property
    def drafted_lengths(self) -> torch.Tensor:
        """``(B_active,)`` cells each row drafted."""
        if self.proposed is not None:
            return self.proposed
        return torch.full_like(self.verify_lengths, self.num_drafted)


class BatchedSpeculativeLoop:
    """State of one batched speculative ``generate()`` call; :meth:`step` runs draft -> select -> verify -> accept.

    The step reads the device once to size the target's block (the longest verified prefix, read together with the
    caches' fill levels and the longest row's length), and once more only when a row may have stopped (an EOS or another criterion than the length
    limit, or a row near that limit), which also tells the draft how wide its next block must be. Everything else it
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
        self.model = model
        self.logits_processor = PositionwiseLogitsProcessor(logits_processor)
        # generate()'s length limit (also a criterion, which a stopper applies with any other given)
        self.stopper = RowStopper(stopping_criteria, input_ids.device, int(generation_config.max_length))
        self.max_length = self.stopper.max_length
        self.do_sample = bool(generation_config.do_sample)
        self.streamer = streamer
        self.step_callback = options.tetris_step_callback
        self.batch_size = batch_size
        self.input_ids = input_ids
        device = input_ids.device
        pad_token = getattr(generation_config, "_pad_token_tensor", None)
        if pad_token is None:
            pad_token = generation_config.pad_token_id
        self.pad_value = int(pad_token) if pad_token is not None else 0

        # Drafts are written past each row's end (scratch that accepted tokens overwrite): room for the longest block.
        self.max_draft = options.num_assistant_tokens + options.tetris_extra_tokens
        capacity = self.max_length + self.max_draft + 1
        block = block_width(self.max_draft + 1, options.tetris_compile, device)
        self.tree_width = options.tetris_tree_width
        if self.tree_width > 1:  # a tree writes up to w K nodes (the target's block) and reads ancestor masks
            block = 1 + self.tree_width * self.max_draft
            check_tree_layout(AttentionLayout.of(model), model)

        def cache_capacity(layout_model: torch.nn.Module) -> int:  # (its layout also refuses what it cannot mask)
            return slots_needed(AttentionLayout.of(layout_model), prompt_length, self.max_length, block,
                                options.tetris_max_holes)

        self.drafter, draft_model = build_drafter(assistant_model, options, self.logits_processor, self.do_sample,
                                                  cache_capacity)
        self.strategy = make_strategy(options, model, draft_model, sampling=self.do_sample)  # profiles draft_model
        self.target_slots = SlotCache(batch_size, device, options.tetris_max_holes, capacity=cache_capacity(model))
        self.prompt_mask = attention_mask
        self.prompt_read = False  # the first step reads the prompt and emits the first token, as generate() does
        # lazy: a draft model reads the prompt when it first drafts
        self.drafter.prefill(input_ids, attention_mask, all_real=bool(attention_mask.all()))
        self.compile = options.tetris_compile
        if self.compile:
            check_compilable(model, "target")
            self.target_slots.step_forward = compiled_forward(model)
            if draft_model is not None:
                check_compilable(draft_model, "draft")
                self.drafter.slots.step_forward = compiled_forward(draft_model)
        self.feature_tap = self.drafter.feature_tap(model)  # hooks on the target: what an EAGLE head reads (last)

        self.sequences = input_ids.new_full((batch_size, capacity), self.pad_value)
        self.sequences[:, :prompt_length] = input_ids
        self.lengths = torch.full((batch_size,), prompt_length, dtype=torch.long, device=device)
        self.rows = torch.arange(batch_size, device=device)  # original index of each active row
        self.last_tokens = input_ids[:, -1]  # each active row's last token (the next block starts with it)
        self.num_rows = batch_size  # active rows, known on the host
        self.shortest, self.longest = prompt_length, prompt_length  # host bounds on the active rows' lengths
        self.outputs = self.sequences.clone()  # finished rows, by original index
        self.output_lengths = self.lengths.clone()
        self._records: list[StepRecord] = []
        self.clock = StepClock(device)
        self._stats: TetrisStats | None = None

    @property
    def done(self) -> bool:
        return self.num_rows == 0

    def step(self) -> StepRecord:
        """One speculative step for every active row; finished rows leave the batch.

        The first step reads the prompt into the target's cache and emits the token after it (no drafts), as
        ``generate()``'s own first forward does; every later step drafts, selects, verifies, accepts and rolls back
        (the order is :func:`~tetris_hf.step_strategy.run_step`'s).
        """
        if not self.prompt_read:
            return self._read_prompt()
        self.clock.mark("start")
        if self.tree_width > 1:  # draft trees: tree_step.py
            tree = tree_step(self, self.tree_width)
            record = StepRecord(self.rows, tree.num_drafted, tree.budget, tree.token_log_probs, tree.verify_lengths,
                                tree.num_accepted, tree.emitted, tree.seconds or StepSeconds(0.0, 0.0, 0.0),
                                tree.proposed, tree.trees)
            return self._finish(record, tree.stopped)
        room = max(self.max_length - self.shortest - 1, 0)  # no row may verify more than this
        drafted: list[Proposal] = []  # the draft phase's proposal, for the verify phase
        verified: list[StepVerdict] = []

        def draft(num_drafted: int, needs_confidences: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
            proposal, max_lengths = self._draft(num_drafted, needs_confidences)
            drafted.append(proposal)
            return proposal.log_probs, max_lengths

        def verify(verify_lengths: torch.Tensor) -> tuple[torch.Tensor, StepSeconds | None]:
            verified.append(self._verify(drafted[0], verify_lengths))
            return verified[0].num_accepted, verified[0].seconds

        outcome = run_step(self.strategy, self.num_rows, min(room, self.max_draft), draft, verify)
        verdict = verified[0]
        record = StepRecord(self.rows, outcome.num_drafted, outcome.plan.budget, drafted[0].log_probs,
                            outcome.verify_lengths, outcome.num_accepted, verdict.emitted,
                            verdict.seconds or StepSeconds(0.0, 0.0, 0.0), drafted[0].lengths)
        return self._finish(record, verdict.stopped)

    def _draft(self, num_drafted: int, needs_confidences: bool) -> tuple[Proposal, torch.Tensor]:
        """Draft ``K = num_drafted`` cells per row; returns the proposal and ``(B,)`` cells each row may verify."""
        clock, lengths = self.clock, self.lengths
        if num_drafted > 0:
            clock.mark("catch_up_start")
            self.drafter.catch_up()  # what it skipped during plain steps: a one-off, kept out of the timings
            clock.mark("catch_up_end")
        clock.mark("draft_start")
        # Confidences may cost a softmax per draft token: only for plans and callbacks that read them.
        proposal = self.drafter.propose(self.sequences, lengths, num_drafted, self.rows,
                                        needs_confidences or self.step_callback is not None)
        clock.mark("draft_end")
        if num_drafted == 0:  # a plain step: no row may verify anything
            max_lengths = torch.zeros_like(lengths)
        elif self.longest + num_drafted < self.max_length:  # no row is near its limit
            max_lengths = torch.full_like(lengths, num_drafted)
        else:  # a target token is always added
            max_lengths = (self.max_length - 1 - lengths).clamp_(min=0, max=num_drafted)
        if proposal.lengths is not None:  # rows that drafted fewer cells
            max_lengths = torch.minimum(max_lengths, proposal.lengths)
        return proposal, max_lengths

    def _verify(self, proposal: Proposal, verify_lengths: torch.Tensor) -> "StepVerdict":
        """The target's side of a step: one forward over every row's block, acceptance, roll back, emission."""
        clock, lengths = self.clock, self.lengths
        if proposal.tokens.shape[1] == 0:
            # Nothing to verify: the target reads each row's last token (no read, no filler, no holes).
            block_length, width, block, real_lengths = 0, 1, self.last_tokens[:, None], None
            drafter_longest = target_bound = None  # nothing read: the caches keep their own bounds
        else:
            # The step's one read: the block length sizes the target's input; the caches' fill levels come along.
            drafter_lengths = self.drafter.live_lengths()
            read = [verify_lengths, self.target_slots.live_lengths(), lengths]
            if drafter_lengths is not None:
                read.append(drafter_lengths)
            block_length, target_longest, self.longest, *drafter_longest = torch.stack(read).amax(dim=1).tolist()
            drafter_longest = drafter_longest[0] if drafter_longest else None
            target_bound = target_longest + block_length + 1  # real slots any row can hold after this block
            # verify: [last emitted token, drafts 1..l_i] per row, padded to one length with masked drafts
            # (compiled on CUDA: padded with masked filler to a power of two, so that block shapes repeat)
            width = block_width(block_length + 1, self.compile, self.lengths.device)
            block = torch.cat([self.last_tokens[:, None], proposal.tokens[:, :block_length]], dim=1)
            if width > block_length + 1:
                block = torch.nn.functional.pad(block, (0, width - block_length - 1), value=self.pad_value)
            real_lengths = verify_lengths + 1  # [last token, verified drafts], then filler
        verified_drafts = block[:, 1 : block_length + 1]
        logits = self.target_slots.forward(self.model, block, None, step=True, real_lengths=real_lengths)
        if width > block_length + 1:
            logits = logits[:, : block_length + 1]
        target_scores = self.logits_processor(self.sequences, lengths, logits, self.rows)

        num_accepted, next_tokens = self._accept(verified_drafts, verify_lengths, target_scores, proposal.probs)

        # roll back: the target keeps [last token, accepted drafts]; the drafter keeps its accepted drafts
        if real_lengths is not None:
            self.target_slots.keep_prefix(self.target_slots.length - width, num_accepted + 1)
        self.target_slots.compact(target_bound)
        self.drafter.accept(num_accepted, next_tokens, verify_lengths, max_accepted=block_length,
                            cached_longest=drafter_longest, features=self._target_features())
        clock.mark("verify_end")

        emitted, stopped = self._emit(num_accepted, next_tokens, block_length + 1)
        clock.mark("end")
        return StepVerdict(num_accepted, emitted, stopped, clock.finish_step())  # on CUDA the previous step's

    def _read_prompt(self) -> StepRecord:
        """The first step: the target reads every prompt (its cache had nothing) and adds one token per row."""
        started = time.perf_counter()
        num_rows = self.num_rows
        logits = self.target_slots.forward(self.model, self.input_ids, self.prompt_mask, logits_to_keep=1)
        target_scores = self.logits_processor(self.sequences, self.lengths, logits, self.rows)
        no_drafts = self.input_ids.new_zeros(num_rows, 0)
        verify_lengths = torch.zeros(num_rows, dtype=torch.long, device=self.lengths.device)
        num_accepted, next_tokens = self._accept(no_drafts, verify_lengths, target_scores, None)
        self.drafter.accept(num_accepted, next_tokens, verify_lengths, features=self._target_features())
        self.prompt_read = True
        emitted, stopped = self._emit(num_accepted, next_tokens, 1)
        no_log_probs = target_scores.new_zeros(num_rows, 0)
        record = StepRecord(self.rows, 0, 0, no_log_probs, verify_lengths, num_accepted, emitted,
                            StepSeconds(0.0, time.perf_counter() - started, 0.0))
        return self._finish(record, stopped)

    def _target_features(self) -> torch.Tensor | None:
        """``(B, W, F)`` what the drafter's tap kept of the target's last forward (``None``: it has no tap)."""
        return None if self.feature_tap is None else self.feature_tap.features

    def close(self) -> None:
        """Remove the hooks the drafter put on the target (the call is over)."""
        if self.feature_tap is not None:
            self.feature_tap.remove()
            self.feature_tap = None

    def _accept(self, drafts: torch.Tensor, verify_lengths: torch.Tensor, target_scores: torch.Tensor,
                draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Verification (greedy or rejection sampling): ``(num_accepted, next_tokens)``, both ``(B_active,)``."""
        if not self.do_sample:
            return verify_greedy(drafts, verify_lengths, target_scores)
        if draft_probs is not None:
            draft_probs = draft_probs[:, : drafts.shape[1]]
        return verify_sampling(drafts, verify_lengths, target_scores, draft_probs)

    def _emit(self, num_accepted: torch.Tensor, next_tokens: torch.Tensor,
              max_new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's target token after its accepted drafts (those already sit in place: they were drafted
        into the scratch space past the row's end), apply the stopping criteria, advance ``lengths``.

        Args:
            num_accepted, next_tokens: ``(B_active,)``.
            max_new: a bound on the tokens any row emits (known without a device sync).

        Returns:
            ``emitted`` ``(B_active,)`` tokens kept per row and ``stopped`` ``(B_active,)`` rows now finished.
        """
        lengths = self.lengths
        self.sequences.scatter_(1, (lengths + num_accepted)[:, None], next_tokens[:, None])
        self.last_tokens = next_tokens  # a row that stops here leaves the batch: its last token is not needed
        kept, stopped = self.stopper(self.sequences, lengths, num_accepted + 1, max_new, longest=self.longest)
        if self.streamer is not None:
            self.streamer.put(self.sequences[0, lengths[0] : lengths[0] + kept[0]].cpu())
        self.lengths = lengths + kept
        self.shortest = min(self.shortest + 1, self.max_length)
        self.longest = min(self.longest + max_new, self.max_length)
        return kept, stopped

    def _finish(self, record: StepRecord, stopped: torch.Tensor) -> StepRecord:
        """Keep the step's record, retire the rows that ``stopped`` ``(B_active,)``, call the user's step callback."""
        self._records.append(record)
        self._stats = None
        if self.shortest >= self.max_length:
            num_stopped = self.num_rows  # every row is at the length limit
        elif self.stopper.only_length and self.longest < self.max_length:
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
        ``outputs``), without reading which rows they are: active rows from the end of the batch take the places of
        finished rows before it, and the batch ends after ``B_active - num_stopped`` rows. Only moved rows are
        copied, in place (the caches' buffers stay where they are).

        E.g. rows ``[a b c d e]`` with ``b`` and ``e`` stopped: 3 remain; ``b`` is the finished row among the first
        3 and ``d`` the active row after them, so ``d`` moves to 1: ``[a d c]``.
        """
        gone = torch.argsort(stopped.long(), descending=True, stable=True)[:num_stopped]
        self.outputs.index_copy_(0, self.rows[gone], self.sequences[gone])
        self.output_lengths.index_copy_(0, self.rows[gone], self.lengths[gone])
        num_rows = self.num_rows - num_stopped
        self.num_rows = num_rows
        if num_rows == 0:
            return
        # There are as many finished rows among the first num_rows as active rows after them; they pair up in
        # order. That count is not read: min(num_stopped, num_rows) pairs are formed, and those past it move nothing.
        moves = min(num_stopped, num_rows)
        targets = torch.argsort(stopped[:num_rows].long(), descending=True, stable=True)[:moves]  # finished first
        sources = num_rows + torch.argsort(stopped[num_rows:].long(), stable=True)[:moves]  # active first
        sources = torch.where(stopped[targets], sources, targets)
        rows = self.target_slots.fill_rows(targets, sources, num_rows)
        self.drafter.fill_rows(targets, sources, num_rows)
        self.rows, self.sequences, self.lengths = self.rows[rows], self.sequences[rows], self.lengths[rows]
        self.last_tokens = self.last_tokens[rows]

    def partial_outputs(self) -> list[list[int]]:
        """Every original row's tokens so far (prompt with its left padding, then what it generated)."""
        sequences, lengths = self.outputs.clone(), self.output_lengths.clone()
        sequences[self.rows], lengths[self.rows] = self.sequences, self.lengths
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
