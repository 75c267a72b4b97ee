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
    seconds = clock.finish_step()
    assert seconds == StepSeconds(draft=1.0, verify=4.0, other=9.0 - 2.0 - 1.0 - 4.0, catch_up=2.0)
    assert sum(seconds) == 9.0  # the whole step
    assert clock.points == {}


def test_a_step_without_catch_up(monkeypatch):
    ticks = itertools.count()
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(ticks)))
    clock = timing.StepClock("cpu")
    for phase in ("start", "draft_start", "draft_end", "verify_end", "end"):
        clock.mark(phase)
    assert clock.finish_step() == StepSeconds(draft=1.0, verify=1.0, other=2.0, catch_up=0.0)
