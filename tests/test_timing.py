"""The step clock splits a step into draft, verify, other and the draft's catch-up time, the catch-up kept apart."""

import itertools

from tetris_hf import timing
from tetris_hf.step_strategy import StepSeconds


def test_phases_become_step_seconds_the_catch_up_kept_apart(monkeypatch):
    ticks = iter([0.0, 1.0, 3.0, 3.5, 4.5, 8.5, 9.0])  # start, catch-up 1-3, draft 3.5-4.5, verify to 8.5, end 9
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(ticks))
    clock = timing.StepClock("cpu")
    for phase in timing.PHASES:
        clock.mark(phase)
    seconds, read_prompts = clock.finish_step()
    assert not read_prompts and seconds == StepSeconds(draft=1.0, verify=4.0, other=9.0 - 2.0 - 1.0 - 4.0, catch_up=2.0)
    assert sum(seconds) == 9.0  # the whole step
    assert clock.points == {}


class FakeEvent:
    """A CUDA event on the host clock: ``elapsed_time`` in milliseconds, as CUDA's."""

    ticks = itertools.count()

    def __init__(self, enable_timing: bool):
        self.at = None

    def record(self) -> None:
        self.at = float(next(FakeEvent.ticks))

    def elapsed_time(self, other: "FakeEvent") -> float:
        return 1000.0 * (other.at - self.at)


def test_on_cuda_a_step_reads_the_previous_steps_seconds_and_whether_that_step_read_prompts(monkeypatch):
    """On CUDA a step's events are read at the next step: the seconds a step closes with are its predecessor's, and so
    is the flag saying the timed forward also read joining prompts (its time then is not a step's)."""
    monkeypatch.setattr(timing.torch.cuda, "Event", FakeEvent)
    clock = timing.StepClock("cuda")
    closed = []
    for read_prompts in (True, False, False):
        for phase in ("start", "draft_start", "draft_end", "verify_end", "end"):
            clock.mark(phase)
        closed.append(clock.finish_step(read_prompts))
    assert closed[0] == (None, False)  # nothing measured yet
    assert closed[1] == (StepSeconds(draft=1.0, verify=1.0, other=2.0, catch_up=0.0), True)  # the first step's
    assert closed[2][1] is False


def test_a_step_without_catch_up(monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(ticks)))
    clock = timing.StepClock("cpu")
    for phase in ("start", "draft_start", "draft_end", "verify_end", "end"):
        clock.mark(phase)
    assert clock.finish_step() == (StepSeconds(draft=1.0, verify=1.0, other=2.0, catch_up=0.0), False)


def test_a_step_that_compiled_a_graph_shares_its_time():
    """A graph compiled during a step (``tetris_compile=True`` meeting a shape) makes its seconds shared: no strategy
    learns a step cost from the compiler's time (a compiled ``adaptive`` call stopped drafting so); the next step,
    which compiles nothing, is a step's alone."""
    import torch

    add_one = torch.compile(lambda tensor: tensor + 1)
    clock = timing.StepClock("cpu")
    shared = []
    for _ in range(2):
        for phase in timing.PHASES:
            clock.mark(phase)
            if phase is timing.Mark.DRAFT_END:
                add_one(torch.ones(3))  # (compiles the first time only)
        seconds, time_shared = clock.finish_step()
        assert seconds.verify > 0
        shared.append(time_shared)
    assert shared == [True, False]
