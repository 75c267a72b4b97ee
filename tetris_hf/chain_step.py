"""A step's phases when every row drafts a chain: ``K`` drafts per row, a verified prefix of each, one target forward
over ``[last token, verified drafts]`` per row, each row keeping its accepted prefix plus the target's token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .batch import Batch
from .candidate_generators.drafter import Drafter
from .kv import SlotCache
from .logits import PositionwiseLogitsProcessor, verify as accept
from .packing import BlockSplit
from .static_shapes import block_width
from .step import Emission, JoiningPrompts, Observation, Proposal, ReadHints, StepPhases, TargetBlock, Verdict
from .step_strategy import DraftPlan, StepStrategy
from .stopping import RowStopper


class StepRead(NamedTuple):
    """What a drafting step's one device read gave (host ints): the cells verified over all rows, the most any row
    verifies, and the most real tokens any row holds in the target's and the drafter's caches (``None``: the drafter
    keeps no cache)."""

    num_verified: int
    block_length: int
    target_longest: int
    drafter_longest: int | None


@dataclass(frozen=True)
class StepContext:
    """What a call's steps work with besides its rows (:class:`~tetris_hf.batch.Batch`), fixed for the call: built
    once by the loop and handed to each step's phases, which reach nothing else.

    ``wants_confidences``: every step computes the drafts' confidences (a step callback reads them)."""

    model: torch.nn.Module
    target_slots: SlotCache
    drafter: Drafter
    logits_processor: PositionwiseLogitsProcessor
    stopper: RowStopper
    do_sample: bool
    compile: bool
    pad_value: int
    wants_confidences: bool

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target's hidden states every target forward returns for the drafter (an EAGLE head's; none for
        others): what :meth:`~tetris_hf.kv.SlotCache.forward` takes as ``hidden_states``."""
        return self.drafter.feature_layers or ()


def read_step(context: StepContext, batch: Batch, verified: torch.Tensor,
              drafter_lengths: torch.Tensor | None) -> StepRead:
    """A drafting step's one device read: ``verified`` ``(B,)`` cells each row verifies (their maximum sizes the
    target's block), with the caches' fill levels (``drafter_lengths`` ``(B,)``: the proposal's ``cached_lengths``)
    and the rows' lengths (which tighten ``batch.longest``)."""
    read = [verified, context.target_slots.live_lengths(), batch.lengths]
    if drafter_lengths is not None:
        read.append(drafter_lengths)
    maxima = torch.stack(read).amax(dim=1)
    num_verified, block_length, target_longest, batch.longest, *drafter_longest = \
        torch.cat([verified.sum()[None], maxima]).tolist()
    return StepRead(num_verified, block_length, target_longest, drafter_longest[0] if drafter_longest else None)


class ChainStep(StepPhases):
    """A step's phases when every row drafts a chain: ``K`` drafts, a verified prefix of each, one target forward over
    ``[last token, verified drafts]`` per row (:func:`~tetris_hf.step.run_step` calls them in order). Works on
    ``batch`` with what ``context`` holds; ``joining``: prompts the step's forward reads too (a request stream's rows
    joining after it)."""

    def __init__(self, context: StepContext, batch: Batch, joining: JoiningPrompts | None = None):
        self.context, self.batch, self.joining = context, batch, joining

    @property
    def reads_prompts(self) -> bool:
        return self.joining is not None

    @property
    def rows(self) -> torch.Tensor:
        return self.batch.rows

    def catch_up(self) -> None:
        self.context.drafter.catch_up()

    def draft(self, num_drafted: int, confidences: bool, lookup_only: bool = False) -> Proposal:
        drafter, batch = self.context.drafter, self.batch
        # (confidences may cost a softmax per draft token: only for plans and callbacks that read them)
        return drafter.propose(batch.sequences, batch.lengths, num_drafted, batch.rows,
                               confidences or self.context.wants_confidences, lookup_only=lookup_only)

    def select(self, strategy: StepStrategy, proposal: Proposal, plan: DraftPlan) -> torch.Tensor:
        """``(B,)`` drafts each row verifies: the strategy's pick, within what each row may verify (a target token
        always follows: rows near the length limit verify fewer; rows that drafted fewer cells, at most those)."""
        batch, num_drafted = self.batch, proposal.tokens.shape[1]
        if num_drafted == 0:  # a plain step: no row verifies anything
            return torch.zeros_like(batch.lengths)
        max_lengths = batch.room(num_drafted)
        if max_lengths is None:  # no row is near its limit
            max_lengths = torch.full_like(batch.lengths, num_drafted)
        if proposal.lengths is not None:
            max_lengths = torch.minimum(max_lengths, proposal.lengths)
        return strategy.select(proposal.log_probs, max_lengths, plan)

    def verify(self, proposal: Proposal, verify_lengths: torch.Tensor) -> tuple[Verdict, TargetBlock]:
        """One target forward over every row's ``[last token, verified drafts]`` (and after them the prompts of rows
        that join after this step, :attr:`joining`), then acceptance."""
        context, batch = self.context, self.batch
        if proposal.tokens.shape[1] == 0:
            # nothing to verify: the target reads each row's last token (no read, no filler, no holes)
            read, block_length, width, block, real_lengths = None, 0, 1, batch.last_tokens[:, None], None
        else:
            read = read_step(context, batch, verify_lengths, proposal.cached_lengths)  # (sizes the target's input)
            block_length = read.block_length
            # [last emitted token, drafts 1..l_i] per row, padded with masked filler (compiled on CUDA: to a power of 2)
            width = block_width(block_length + 1, context.compile, batch.lengths.device)
            block = torch.cat([batch.last_tokens[:, None], proposal.tokens[:, :block_length]], dim=1)
            if width > block_length + 1:
                block = torch.nn.functional.pad(block, (0, width - block_length - 1), value=context.pad_value)
            real_lengths = verify_lengths + 1  # [last token, verified drafts], then filler
        target = context.target_slots
        num_real = None if read is None else read.num_verified + batch.num_rows  # (packed where the target can be)
        forward_block, split, joining, prompt_lengths = block, None, self.joining, ()
        if joining is not None:  # rows joining after this step: their prompts are read in this forward, after ours
            if real_lengths is None:
                real_lengths = torch.ones_like(batch.lengths)
            split = BlockSplit(batch.num_rows, width, batch.num_rows if num_real is None else num_real)
            forward_block, real_lengths = joining.after(block, real_lengths, context.pad_value)
            num_real = split.tokens + joining.num_tokens
            prompt_lengths = joining.prompt_lengths  # (host ints: their attention reads them row by row)
            target.add_rows(joining.count)
        logits, features = target.forward(context.model, forward_block, None, step=True, real_lengths=real_lengths,
                                          num_real=num_real, split=split, hidden_states=context.feature_layers,
                                          prompt_lengths=prompt_lengths)
        joining_tokens = None
        if joining is not None:
            joining_tokens = self.first_tokens(joining, logits[batch.num_rows :, 0])
            logits = logits[: batch.num_rows]
        if width > block_length + 1:
            logits = logits[:, : block_length + 1]
        target_scores = context.logits_processor(batch.sequences, batch.lengths, logits, batch.rows)
        num_accepted, next_tokens = accept(block[:, 1 : block_length + 1], verify_lengths, target_scores,
                                           proposal.probs, context.do_sample)
        hints = ReadHints(block_length, None if read is None else read.drafter_longest)
        # after the block, no row holds more real slots than its longest row held plus the block; a step that verified
        # nothing read nothing, and each row holds its length (its last token now cached): the batch's bound holds
        longest = batch.longest if read is None else read.target_longest + block_length + 1
        computed = target.tokens_read
        if joining is not None:  # (a prompt's read is not a step's work)
            computed -= joining.num_tokens
            longest = max(longest, joining.width)
        forward_width = forward_block.shape[1]
        return Verdict(num_accepted, next_tokens, verify_lengths, hints=hints, features=features), \
            TargetBlock(target.block_start, forward_width, longest, computed, joining_tokens, features)

    def first_tokens(self, joining: JoiningPrompts, logits: torch.Tensor) -> torch.Tensor:
        """``(M,)`` the joining rows' first tokens, from the target's ``(M, V)`` logits at their prompts' last tokens:
        processed and chosen as every target token is (greedy, or sampled), and written after each prompt in
        ``joining.sequences``."""
        context, rows, lengths = self.context, joining.sequences, joining.lengths
        scores = context.logits_processor(rows, lengths, logits[:, None], joining.lanes)
        _, first_tokens = accept(rows[:, :0], torch.zeros_like(lengths), scores, None, context.do_sample)
        rows.scatter_(1, lengths[:, None], first_tokens[:, None])
        return first_tokens

    def roll_back(self, proposal: Proposal, verdict: Verdict, block: TargetBlock) -> torch.Tensor | None:
        """The target keeps ``[last token, accepted drafts]`` of its block; the drafter keeps its accepted drafts."""
        target = self.context.target_slots
        if proposal.tokens.shape[1] > 0:  # drafts were verified (the joining rows after them keep their prompts)
            target.keep_prefix(block.first_slot, verdict.num_accepted + 1)
        target.compact(block.longest)
        return self.context.drafter.accept(verdict)

    def emit(self, verdict: Verdict) -> Emission:
        # (the accepted drafts already sit in place: they were drafted there)
        return self.batch.emit(verdict.num_accepted, verdict.next_tokens, verdict.hints.max_accepted,
                               self.context.stopper)

    def observation(self, proposal: Proposal, selection: torch.Tensor, verdict: Verdict) -> Observation:
        return Observation(proposal.log_probs, selection, proposal.lengths)
