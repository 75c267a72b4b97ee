"""One speculative step, top to bottom, and what each of its phases produces.

:func:`run_step` is the whole step (plan -> draft -> select -> verify -> roll back -> emit -> observe) over the phases
of a :class:`StepPhases`; :class:`Proposal`, :class:`Verdict`, :class:`Emission`, :class:`Observation` and
:class:`StepRecord` are the phases' products, :class:`Step` all of them. Design: docs/design.md, "The step".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from .step_strategy import DraftPlan, StepStrategy
from .timing import NO_SECONDS, Mark, NoClock, StepClock, StepSeconds

if TYPE_CHECKING:
    from .trees import DraftTree, GrownTree


class Proposal(NamedTuple):
    """What a drafter proposed for every active row (``B`` rows, ``K`` cells)."""

    tokens: torch.Tensor  # (B, K) drafted tokens, also written into the loop's sequences past each row's end
    # (B, K) confidences TETRIS ranks cells by: the log of how likely the drafter thinks the cell is right, never
    # depending on a random draw at that cell (None: not asked for)
    log_probs: torch.Tensor | None
    # (B, K, V) the distributions sampled drafts were drawn from (None: deterministic drafts, or a greedy loop)
    probs: torch.Tensor | None
    lengths: torch.Tensor | None = None  # (B,) cells each row really drafted, filler after (None: all K)
    # (B,) bool, rows prompt lookup drafted (prompt lookup: every row; hybrid: the rows that matched; None: no row)
    lookup_rows: torch.Tensor | None = None
    # (B,) tokens the drafter's cache holds per row after drafting, read with the step's one read and handed back in
    # the verdict's hints (None: it keeps no cache)
    cached_lengths: torch.Tensor | None = None


class StepTree(NamedTuple):
    """A tree step's trees and what the target made of them (rows: the step's active rows)."""

    tree: DraftTree  # the drafted tree, (B, N) per node
    selected: torch.Tensor  # (B, N) bool, the verified nodes
    roots: torch.Tensor  # (B,) each row's last token before the step
    path_nodes: torch.Tensor  # (B, D) the accepted path's node indices (-1 past it)
    num_accepted: torch.Tensor  # (B,)
    next_tokens: torch.Tensor  # (B,) the target's token after the path
    path_slots: torch.Tensor | None = None  # (B, D) the path's slots in the target's block (root 0, -1 past the path)


class ReadHints(NamedTuple):
    """Host numbers the step's one device read gave, which spare a drafter reads of its own (``None``: unknown).

    ``max_accepted``: no row accepted more drafts (the longest verified block, or the deepest path that could be
    accepted). ``cached_longest``: the most real tokens any row held in the drafter's cache when the loop read the
    proposal's ``cached_lengths`` this step.
    """

    max_accepted: int | None = None
    cached_longest: int | None = None


class Verdict(NamedTuple):
    """What the target decided about a proposal, per active row (``(B,)``): drafts accepted, the target's token after
    them, and cells verified. ``tree``: the tree step's trees and accepted paths (``None`` for a chain). ``hints``:
    host bounds from the step's read (none by default). ``features``: ``(B, W, F)`` the target's hidden states the
    drafter asked for (its ``feature_layers``) at every position of the block the target's forward read (``None``:
    none asked). What the drafter rolls back by (:meth:`~tetris_hf.candidate_generators.drafter.Drafter.accept`)."""

    num_accepted: torch.Tensor
    next_tokens: torch.Tensor
    verify_lengths: torch.Tensor
    tree: StepTree | None = None
    hints: ReadHints = ReadHints()
    features: torch.Tensor | None = None


class JoiningRows(NamedTuple):
    """Rows that join after the active ones (a request stream's): ``last_tokens`` ``(M,)`` the last token of each
    one's prompt (or its first generated token, when its prompt rode in a step), which opens its first proposal, and
    ``prompt_lengths`` (host ints) the tokens each row holds then. Their prompts follow in :class:`PromptChunk`."""

    last_tokens: torch.Tensor
    prompt_lengths: list[int]


class PromptChunk(NamedTuple):
    """A chunk of joining rows' prompts the target just read: ``tokens`` ``(B, L)``, row ``i``'s first
    ``real_lengths[i]`` real (0 for rows not joining), ``num_real`` their sum; ``longest`` bounds any row's tokens;
    ``next_tokens`` ``(B, L)`` each real token's successor in its row (what an EAGLE head pairs with the target's
    feature there); ``first_row``: no row before it has a real token; ``features`` ``(B, L', F)``, ``L' >= L``, the
    target's hidden states over the block its forward read (the drafter's ``feature_layers``; ``None``: none asked)."""

    tokens: torch.Tensor
    real_lengths: torch.Tensor
    num_real: int
    longest: int
    next_tokens: torch.Tensor
    first_row: int = 0
    features: torch.Tensor | None = None


class JoiningPrompts(NamedTuple):
    """Prompts of rows that join the batch at the end of this step (a request stream's), read in the step's target
    forward after the decoding rows' blocks, the target's logits at each one's last token giving its row's first
    token: ``tokens`` ``(M, W)`` the prompts, then filler; ``lengths`` ``(M,)`` how many are real; ``num_tokens``
    their sum and ``width`` the longest (host ints); ``sequences`` ``(M, capacity)`` the rows they will be (each
    prompt from column 0) and ``lanes`` ``(M,)`` their original indices (which row's settings the processors
    apply); on the host, ``prompt_lengths`` each prompt's length, ``limits`` each row's length limit and
    ``eos_token_ids`` its end tokens (what the rows join the batch with)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    num_tokens: int
    width: int
    sequences: torch.Tensor
    lanes: torch.Tensor
    prompt_lengths: tuple[int, ...] = ()
    limits: tuple[int, ...] = ()
    eos_token_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def count(self) -> int:
        return self.tokens.shape[0]

    def after(self, block: torch.Tensor, real_lengths: torch.Tensor, pad_value: int) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
        """``block`` ``(B, L)`` with its ``real_lengths`` ``(B,)``, these prompts' rows after it: ``(B + M,
        max(L, W))`` and ``(B + M,)``."""
        width = max(block.shape[1], self.width)
        rows = [torch.nn.functional.pad(part, (0, width - part.shape[1]), value=pad_value)
                for part in (block, self.tokens)]
        return torch.cat(rows), torch.cat([real_lengths, self.lengths])


class TargetBlock(NamedTuple):
    """Where the target's verification block went in its cache: the first slot and the width (host ints), a host
    bound on the real slots any row holds after it, and the tokens the target's forward computed (packed: the real
    ones; padded: every row to the width).
    ``joining_tokens``: ``(M,)`` the first tokens of the rows whose prompts the forward read after the block
    (:class:`JoiningPrompts`; ``None``: none). ``features``: ``(B + M, W, F)`` the hidden states the forward returned
    for the drafter, joining rows' included (``None``: none asked)."""

    first_slot: int
    width: int
    longest: int
    computed: int
    joining_tokens: torch.Tensor | None = None
    features: torch.Tensor | None = None


class Emission(NamedTuple):
    """What emitting did, per active row (``(B,)``): tokens kept (accepted + the target's, fewer where a row
    stopped) and rows now finished."""

    emitted: torch.Tensor
    stopped: torch.Tensor


class Observation(NamedTuple):
    """What a strategy learns from, per active row, as a chain: ``(B, K)`` confidences (``None`` when nothing asked
    for them), ``(B,)`` how many of the chain's first cells were verified, and ``(B,)`` cells drafted (``None``: all
    ``K``)."""

    log_probs: torch.Tensor | None
    verified: torch.Tensor
    drafted: torch.Tensor | None = None


@dataclass
class StepRecord:
    """What one step did, per active row (shapes ``(B_active,)``; ``rows`` are original batch indices).

    ``seconds``: the step's measured draft, target and other time (:class:`~tetris_hf.timing.StepClock`; on CUDA
    the previous step's, zeros at the first drafting step), the drafter's catch-up excluded.
    """

    rows: torch.Tensor
    num_drafted: int
    budget: int
    token_log_probs: torch.Tensor | None  # (B_active, K) the draft's confidences (None: nothing needed them)
    verify_lengths: torch.Tensor
    num_accepted: torch.Tensor
    emitted: torch.Tensor
    seconds: StepSeconds = NO_SECONDS
    proposed: torch.Tensor | None = None  # (B_active,) cells each row drafted, where fewer than num_drafted
    tree: StepTree | None = None  # tetris_tree_width > 1: the step's trees, selection and accepted paths
    target_tokens: int = 0  # tokens the target's forward computed (the prompt's read: not counted)
    lookup_rows: torch.Tensor | None = None  # (B_active,) bool: rows prompt lookup drafted for (None: no row)
    probe: bool = False  # the strategy drafted this step to learn what drafts are worth (``DraftPlan.probe``)

    @property
    def drafted_lengths(self) -> torch.Tensor:
        """``(B_active,)`` cells each row drafted."""
        if self.proposed is not None:
            return self.proposed
        return torch.full_like(self.verify_lengths, self.num_drafted)

    @property
    def by_lookup(self) -> torch.Tensor:
        """``(B_active,)`` 1 where prompt lookup drafted the row's cells, 0 where a draft model (or nothing) did."""
        if self.lookup_rows is not None:
            return self.lookup_rows.long()
        return torch.zeros_like(self.verify_lengths)


class Step(NamedTuple):
    """Everything one step produced: the plan, ``K`` drafted, each phase's product and the step's record;
    ``drafter_read``: what the drafter asked the loop to read at the step's end (its ``accept``'s answer)."""

    plan: DraftPlan
    num_drafted: int
    proposal: Proposal | GrownTree
    selection: torch.Tensor
    verdict: Verdict
    emission: Emission
    record: StepRecord
    block: TargetBlock | None = None
    drafter_read: torch.Tensor | None = None


class StepPhases:
    """The phases :func:`run_step` calls, in order. ``rows``: ``(B,)`` the active rows' original indices.
    :meth:`catch_up` and :meth:`roll_back` do nothing unless overridden; :attr:`plain` is the phases a step that drafts
    nothing goes through (itself here; a tree step's are a chain's)."""

    rows: torch.Tensor

    @property
    def plain(self) -> StepPhases:
        return self

    @property
    def reads_prompts(self) -> bool:
        """The step's forward also reads joining rows' prompts (a request stream's), so its time is not a step's."""
        return False

    def catch_up(self) -> None:
        """One-off work the drafter skipped while the loop decoded plainly (kept out of the step's timings)."""

    def draft(self, num_drafted: int, confidences: bool, lookup_only: bool = False) -> Proposal | GrownTree:
        """``K = num_drafted`` cells per row (0: a plain step), with confidences when ``confidences``;
        ``lookup_only``: hybrid drafting by prompt lookup alone (:attr:`DraftPlan.lookup_only`)."""
        raise NotImplementedError

    def select(self, strategy: StepStrategy, proposal, plan: DraftPlan) -> torch.Tensor:
        """The cells the target verifies, as ``strategy`` picks them under ``plan``."""
        raise NotImplementedError

    def verify(self, proposal, selection: torch.Tensor) -> tuple[Verdict, TargetBlock | None]:
        """The target's forward over the selected cells and acceptance: the verdict, and where the block went."""
        raise NotImplementedError

    def roll_back(self, proposal, verdict: Verdict, block: TargetBlock | None) -> torch.Tensor | None:
        """Both caches drop what was rejected; returns what the drafter asks the loop to read at the step's end."""

    def emit(self, verdict: Verdict) -> Emission:
        """The accepted tokens and the target's token join the rows; stopping criteria apply."""
        raise NotImplementedError

    def observation(self, proposal, selection: torch.Tensor, verdict: Verdict) -> Observation:
        """What the strategy learns from this step."""
        raise NotImplementedError


def run_step(strategy: StepStrategy, phases: StepPhases, num_rows: int, max_draft: int,
             clock: StepClock | NoClock = NoClock()) -> Step:
    """One step: plan -> draft -> select -> verify -> roll back -> emit -> observe.

    Args:
        strategy: the step strategy (its plan, selection and learning).
        phases: how this step drafts, verifies, rolls back and emits.
        num_rows: ``B`` active rows.
        max_draft: at most this many drafts per row this step (length limits, recorded traces).
        clock: marks the phase boundaries (the loop's :class:`~tetris_hf.timing.StepClock`).

    Returns:
        :class:`Step`.
    """
    clock.mark(Mark.START)
    plan = strategy.plan(num_rows)
    num_drafted = min(plan.num_draft_tokens, max_draft) if plan.budget > 0 else 0
    if num_drafted == 0:
        phases = phases.plain
    elif not plan.lookup_only:  # (a step by lookup alone runs no model forward: what the model has not read waits)
        clock.mark(Mark.CATCH_UP_START)
        phases.catch_up()
        clock.mark(Mark.CATCH_UP_END)
    clock.mark(Mark.DRAFT_START)
    proposal = phases.draft(num_drafted, plan.needs_confidences, plan.lookup_only)
    clock.mark(Mark.DRAFT_END)
    if isinstance(proposal, Proposal):  # (a chain a confidence threshold stopped early drafted fewer)
        num_drafted = proposal.tokens.shape[1]
    selection = phases.select(strategy, proposal, plan)
    verdict, block = phases.verify(proposal, selection)
    drafter_read = phases.roll_back(proposal, verdict, block)
    clock.mark(Mark.VERIFY_END)
    emission = phases.emit(verdict)
    clock.mark(Mark.END)
    seconds, time_shared = clock.finish_step(phases.reads_prompts)  # on CUDA the previous step's
    observed = phases.observation(proposal, selection, verdict)
    lookup_rows = proposal.lookup_rows if isinstance(proposal, Proposal) else None
    # (a step that also read joining prompts, or compiled, took their time too: the strategy prices it as a step it
    # has no time for, by its cost model, and learns no step cost, probe price or guard's verdict from that time)
    strategy.observe(observed.log_probs, observed.verified, verdict.num_accepted,
                     None if time_shared else seconds, num_drafted, lookup_rows=lookup_rows)
    record = StepRecord(phases.rows, num_drafted, plan.budget, observed.log_probs, verdict.verify_lengths,
                        verdict.num_accepted, emission.emitted, seconds or NO_SECONDS, observed.drafted, verdict.tree,
                        0 if block is None else block.computed, lookup_rows, plan.probe and num_drafted > 0)
    return Step(plan, num_drafted, proposal, selection, verdict, emission, record, block, drafter_read)
