"""``run_step`` runs the phases in order, marks the clock between them, hands each phase's product to the next, and
sends a step that drafts nothing through the plain phases without a catch-up."""

import torch

from tetris_hf.step import Emission, Observation, Proposal, StepPhases, TargetBlock, Verdict, run_step
from tetris_hf.step_strategy import DraftPlan
from tetris_hf.timing import Mark, StepSeconds

ROWS = 3


class Journal(list):
    """What was called, in order."""


class RecordingPhases(StepPhases):
    """Phases that note each call and pass on products that name their phase."""

    def __init__(self, journal: Journal, name: str = "chain", plain: StepPhases | None = None,
                 reads_prompts: bool = False):
        self.journal, self.name, self._plain, self._reads_prompts = journal, name, plain, reads_prompts
        self.rows = torch.arange(ROWS)

    @property
    def plain(self) -> StepPhases:
        return self if self._plain is None else self._plain

    @property
    def reads_prompts(self) -> bool:
        return self._reads_prompts

    def catch_up(self) -> None:
        self.journal.append("catch_up")

    def draft(self, num_drafted: int, confidences: bool, lookup_only: bool = False) -> Proposal:
        self.journal.append(f"{self.name}.draft({num_drafted}, {confidences})")
        tokens = torch.arange(ROWS * num_drafted).view(ROWS, num_drafted)
        return Proposal(tokens, torch.zeros(ROWS, num_drafted), None)

    def select(self, strategy, proposal: Proposal, plan: DraftPlan) -> torch.Tensor:
        self.journal.append(f"{self.name}.select")
        return torch.full((ROWS,), proposal.tokens.shape[1])

    def verify(self, proposal: Proposal, selection: torch.Tensor):
        self.journal.append(f"{self.name}.verify({selection.tolist()})")
        accepted = selection // 2
        return Verdict(accepted, torch.full((ROWS,), 7), selection), TargetBlock(10, 4, None, 5)

    def roll_back(self, proposal, verdict: Verdict, block: TargetBlock) -> None:
        self.journal.append(f"{self.name}.roll_back({block.first_slot})")

    def emit(self, verdict: Verdict) -> Emission:
        self.journal.append(f"{self.name}.emit")
        return Emission(verdict.num_accepted + 1, torch.zeros(ROWS, dtype=torch.bool))

    def observation(self, proposal: Proposal, selection: torch.Tensor, verdict: Verdict) -> Observation:
        self.journal.append(f"{self.name}.observation")
        return Observation(proposal.log_probs, selection)


class RecordingStrategy:
    def __init__(self, journal: Journal, plan: DraftPlan):
        self.journal, self._plan = journal, plan

    def plan(self, num_rows: int) -> DraftPlan:
        self.journal.append("plan")
        return self._plan

    def observe(self, token_log_probs, verify_lengths, num_accepted, seconds=None, num_drafted=None,
                lookup_rows=None) -> None:
        self.journal.append(f"observe({verify_lengths.tolist()}, {num_accepted.tolist()}, {seconds}, {num_drafted})")


class RecordingClock:
    def __init__(self, journal: Journal):
        self.journal = journal

    def mark(self, phase: Mark) -> None:
        self.journal.append(phase)

    def finish_step(self, read_prompts: bool = False) -> tuple[StepSeconds, bool]:
        self.journal.append("finish_step")
        return StepSeconds(1.0, 2.0, 3.0), read_prompts


def test_a_drafting_step_runs_every_phase_in_order_and_records_their_products():
    journal = Journal()
    strategy = RecordingStrategy(journal, DraftPlan(num_draft_tokens=4, budget=6, needs_confidences=False))
    step = run_step(strategy, RecordingPhases(journal), ROWS, max_draft=3, clock=RecordingClock(journal))
    assert journal == [
        Mark.START, "plan", Mark.CATCH_UP_START, "catch_up", Mark.CATCH_UP_END, Mark.DRAFT_START,
        "chain.draft(3, False)", Mark.DRAFT_END, "chain.select", "chain.verify([3, 3, 3])", "chain.roll_back(10)",
        Mark.VERIFY_END, "chain.emit", Mark.END, "finish_step", "chain.observation",
        "observe([3, 3, 3], [1, 1, 1], StepSeconds(draft=1.0, verify=2.0, other=3.0, catch_up=0.0), 3)",
    ]
    assert step.num_drafted == 3 and step.plan.budget == 6
    assert step.selection.tolist() == [3, 3, 3] and step.verdict.num_accepted.tolist() == [1, 1, 1]
    record = step.record
    assert record.num_drafted == 3 and record.budget == 6
    assert record.rows.tolist() == [0, 1, 2] and record.emitted.tolist() == [2, 2, 2]
    assert record.verify_lengths is step.verdict.verify_lengths
    assert record.seconds == StepSeconds(1.0, 2.0, 3.0)
    assert record.target_tokens == 5  # what the target's forward computed, from the verify phase's block


def test_a_step_that_also_read_joining_prompts_is_observed_untimed_its_record_keeping_the_time():
    """A stream's step whose forward also read joining rows' prompts took their time too: the strategy observes it
    without seconds (it prices such a step by its cost model instead of learning costs, probe prices or the guard's
    verdict from it); the step's record keeps what the clock measured."""
    journal = Journal()
    strategy = RecordingStrategy(journal, DraftPlan(num_draft_tokens=2, budget=6))
    step = run_step(strategy, RecordingPhases(journal, reads_prompts=True), ROWS, max_draft=3,
                    clock=RecordingClock(journal))
    assert journal[-1] == "observe([2, 2, 2], [1, 1, 1], None, 2)"
    assert step.record.seconds == StepSeconds(1.0, 2.0, 3.0)


def test_a_step_that_drafts_nothing_takes_the_plain_phases_without_a_catch_up():
    journal = Journal()
    plain = RecordingPhases(journal, "plain")
    strategy = RecordingStrategy(journal, DraftPlan(num_draft_tokens=4, budget=0))
    step = run_step(strategy, RecordingPhases(journal, "tree", plain=plain), ROWS, max_draft=3)
    assert journal == ["plan", "plain.draft(0, True)", "plain.select", "plain.verify([0, 0, 0])",
                       "plain.roll_back(10)", "plain.emit", "plain.observation",
                       "observe([0, 0, 0], [0, 0, 0], None, 0)"]
    assert step.num_drafted == 0 and step.record.seconds == StepSeconds(0.0, 0.0, 0.0)
