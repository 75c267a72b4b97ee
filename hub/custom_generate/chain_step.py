# Exported from tetris_hf/chain_step.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""A step's phases when every row drafts a chain: ``K`` drafts per row, a verified prefix of each, one target forward
over ``[last token, verified drafts]`` per row, each row keeping its accepted prefix plus the target's token."""

from __future__ import annotations

from typing import Callable, NamedTuple, Protocol

import torch

from .candidate_generators_drafter import Drafter
from .kv import SlotCache
from .logits import PositionwiseLogitsProcessor
from .packing import BlockSplit
from .static_shapes import block_width
from .step import Emission, JoiningPrompts, Observation, Proposal, ReadHints, StepPhases, TargetBlock, Verdict
from .step_strategy import DraftPlan, StepStrategy


class StepRead(NamedTuple):
    """What a drafting step's one device read gave (host ints): the cells verified over all rows, the most any row
    verifies, and the most real tokens any row holds in the target's and the drafter's caches (``None``: the drafter
    keeps no cache)."""

    num_verified: int
    block_length: int
    target_longest: int
    drafter_longest: int | None


class LoopState(Protocol):
    """What a step's phases use of the loop (:class:`~tetris_hf.decoding.BatchedSpeculativeLoop`): its rows, models
    and caches, and the three things every step shape does alike. Rows are the active ones, ``(B,)`` per row."""

    model: torch.nn.Module
    drafter: Drafter
    target_slots: SlotCache
    logits_processor: PositionwiseLogitsProcessor
    sequences: torch.Tensor  # (B, capacity) prompt, emitted tokens, then scratch where drafts are written
    lengths: torch.Tensor  # (B,) tokens each row holds
    rows: torch.Tensor  # (B,) original batch indices
    last_tokens: torch.Tensor  # (B,) each row's last token (the next block starts with it)
    num_rows: int
    longest: int  # host bound on the rows' lengths
    max_length: int
    row_limits: torch.Tensor | None  # (B,) each row's own length limit (a request stream's rows), else None
    joining: JoiningPrompts | None  # prompts of rows joining at the end of this step (a request stream's), else None
    pad_value: int
    do_sample: bool
    compile: bool
    step_callback: Callable | None

    def read_step(self, verified: torch.Tensor) -> StepRead:
        """The step's one device read (``verified``: ``(B,)`` cells each row verifies)."""

    def acceptance(self, drafts: torch.Tensor, verify_lengths: torch.Tensor, target_scores: torch.Tensor,
                   draft_probs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy or sampling verification: ``(num_accepted, next_tokens)``."""

    def emit(self, verdict: Verdict) -> Emission:
        """The target's token after each row's accepted drafts; stopping criteria."""

    def read_joining(self, logits: torch.Tensor) -> None:
        """With :attr:`joining`: the target's ``(M, V)`` logits at each joining prompt's last token (this step's
        forward read them), for their rows' first tokens."""


class ChainStep(StepPhases):
    """A step's phases when every row drafts a chain: ``K`` drafts, a verified prefix of each, one target forward over
    ``[last token, verified drafts]`` per row (:func:`~tetris_hf.step.run_step` calls them in order). Reads and writes
    the loop's public state (:class:`LoopState`)."""

    def __init__(self, loop: LoopState):
        self.loop = loop

    @property
    def rows(self) -> torch.Tensor:
        return self.loop.rows

    def catch_up(self) -> None:
        self.loop.drafter.catch_up()

    def draft(self, num_drafted: int, confidences: bool, lookup_only: bool = False) -> Proposal:
        loop = self.loop
        # (lookup_only: a hybrid drafter's lookup part alone, the model running no forward)
        propose = loop.drafter.propose_lookup if lookup_only else loop.drafter.propose
        # Confidences may cost a softmax per draft token: only for plans and callbacks that read them.
        return propose(loop.sequences, loop.lengths, num_drafted, loop.rows,
                       confidences or loop.step_callback is not None)

    def select(self, strategy: StepStrategy, proposal: Proposal, plan: DraftPlan) -> torch.Tensor:
        """``(B,)`` drafts each row verifies: the strategy's pick, within what each row may verify (a target token
        always follows: rows near the length limit verify fewer; rows that drafted fewer cells, at most those)."""
        loop, num_drafted = self.loop, proposal.tokens.shape[1]
        if num_drafted == 0:  # a plain step: no row verifies anything
            return torch.zeros_like(loop.lengths)
        max_lengths = self.room(num_drafted)
        if max_lengths is None:  # no row is near its limit
            max_lengths = torch.full_like(loop.lengths, num_drafted)
        if proposal.lengths is not None:
            max_lengths = torch.minimum(max_lengths, proposal.lengths)
        return strategy.select(proposal.log_probs, max_lengths, plan)

    def room(self, depth: int) -> torch.Tensor | None:
        """``(B,)`` drafts each row may still verify, at most ``depth``: a target token always follows them, so a row
        near the length limit verifies fewer. ``None`` when no row is near it (every row may take ``depth``), known on
        the host."""
        loop = self.loop
        if loop.row_limits is not None:  # a stream's rows each have their own limit
            return (loop.row_limits - 1 - loop.lengths).clamp(min=0, max=depth)
        if loop.longest + depth < loop.max_length:
            return None
        return (loop.max_length - 1 - loop.lengths).clamp(min=0, max=depth)

    def verify(self, proposal: Proposal, verify_lengths: torch.Tensor) -> tuple[Verdict, TargetBlock]:
        """One target forward over every row's ``[last token, verified drafts]`` (and after them the prompts of rows
        that join after this step, :attr:`LoopState.joining`), then acceptance."""
        loop = self.loop
        if proposal.tokens.shape[1] == 0:
            # Nothing to verify: the target reads each row's last token (no read, no filler, no holes).
            read, block_length, width, block, real_lengths = None, 0, 1, loop.last_tokens[:, None], None
        else:
            read = loop.read_step(verify_lengths)  # the block length sizes the target's input
            block_length = read.block_length
            # [last emitted token, drafts 1..l_i] per row, padded to one length with masked drafts (compiled on CUDA:
            # padded with masked filler to a power of two, so that block shapes repeat)
            width = block_width(block_length + 1, loop.compile, loop.lengths.device)
            block = torch.cat([loop.last_tokens[:, None], proposal.tokens[:, :block_length]], dim=1)
            if width > block_length + 1:
                block = torch.nn.functional.pad(block, (0, width - block_length - 1), value=loop.pad_value)
            real_lengths = verify_lengths + 1  # [last token, verified drafts], then filler
        target = loop.target_slots
        num_real = None if read is None else read.num_verified + loop.num_rows  # (packed where the target can be)
        forward_block, split, joining = block, None, loop.joining
        if joining is not None:  # rows joining after this step: their prompts are read in this forward, after ours
            if real_lengths is None:
                real_lengths = torch.ones_like(loop.lengths)
            split = BlockSplit(loop.num_rows, width, loop.num_rows if num_real is None else num_real)
            forward_block, real_lengths = joining.after(block, real_lengths, loop.pad_value)
            num_real = split.tokens + joining.num_tokens
            target.add_rows(joining.count)
        logits = target.forward(loop.model, forward_block, None, step=True, real_lengths=real_lengths,
                                num_real=num_real, split=split)
        if joining is not None:
            loop.read_joining(logits[loop.num_rows :, 0])
            logits = logits[: loop.num_rows]
        if width > block_length + 1:
            logits = logits[:, : block_length + 1]
        target_scores = loop.logits_processor(loop.sequences, loop.lengths, logits, loop.rows)
        num_accepted, next_tokens = loop.acceptance(block[:, 1 : block_length + 1], verify_lengths, target_scores,
                                                    proposal.probs)
        hints = ReadHints(block_length, None if read is None else read.drafter_longest)
        # after the block, no row holds more real slots than its longest row held plus the block
        longest = None if read is None else read.target_longest + block_length + 1
        computed = target.tokens_read
        if joining is not None:  # (a prompt's read is not a step's work)
            computed -= joining.num_tokens
            longest = None if longest is None else max(longest, joining.width)
        forward_width = forward_block.shape[1]
        return Verdict(num_accepted, next_tokens, verify_lengths, hints=hints), \
            TargetBlock(target.length - forward_width, forward_width, longest, computed)

    def roll_back(self, proposal: Proposal, verdict: Verdict, block: TargetBlock) -> None:
        """The target keeps ``[last token, accepted drafts]`` of its block; the drafter keeps its accepted drafts."""
        target, joining = self.loop.target_slots, self.loop.joining
        if block.longest is not None:  # drafts were verified (joining rows keep their prompts)
            keep = verdict.num_accepted + 1
            target.keep_prefix(block.first_slot, keep if joining is None else torch.cat([keep, joining.lengths]))
        target.compact(block.longest)
        self.loop.drafter.accept(verdict)

    def emit(self, verdict: Verdict) -> Emission:
        return self.loop.emit(verdict)  # the accepted drafts already sit in place: they were drafted there

    def observation(self, proposal: Proposal, selection: torch.Tensor, verdict: Verdict) -> Observation:
        return Observation(proposal.log_probs, selection, proposal.lengths)
