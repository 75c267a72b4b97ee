"""Device-correct step timing that adds no device read of its own: host clocks on the CPU; on CUDA, events recorded at
the phase boundaries and read a step later, once that step's own device read has synchronised them.
"""

from __future__ import annotations

import time
from enum import StrEnum
from typing import NamedTuple

import torch


class StepSeconds(NamedTuple):
    """Time of one loop step, as the loop measured it: the ``K`` draft forwards, the target side (selection,
    verification forward, acceptance, roll back), the rest (planning, emitting, stopping), and the drafter's catch-up
    on what it skipped while the loop decoded plainly (one-off work before a drafting step; ``sum`` counts it)."""

    draft: float
    verify: float
    other: float
    catch_up: float = 0.0


NO_SECONDS = StepSeconds(0.0, 0.0, 0.0)


class Mark(StrEnum):
    """A step's phase boundaries, in the order :func:`~tetris_hf.step.run_step` marks them (the catch-up pair only
    in steps that draft)."""

    START = "start"
    CATCH_UP_START = "catch_up_start"
    CATCH_UP_END = "catch_up_end"
    DRAFT_START = "draft_start"
    DRAFT_END = "draft_end"
    VERIFY_END = "verify_end"
    END = "end"


PHASES = tuple(Mark)


class StepClock:
    """Marks a step's phase boundaries (:class:`Mark`) and turns them into :class:`StepSeconds`: CUDA events on a
    CUDA ``device`` (the target's input device), the host clock elsewhere."""

    def __init__(self, device: torch.device):
        self.on_cuda = torch.device(device).type == "cuda"
        self.points: dict[Mark, object] = {}
        self._waiting: dict[Mark, object] | None = None  # CUDA: the last step's events, read at the next step
        self._waiting_shared = False  # CUDA: whether that step's time also paid for other work (see finish_step)
        self._graphs = 0  # graphs compiled in the process when this step started

    def mark(self, phase: Mark) -> None:
        if phase == Mark.START:  # (a StrEnum: callers may mark by name)
            self._graphs = compiled_graphs()
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points[phase] = event
        else:
            self.points[phase] = time.perf_counter()

    def finish_step(self, read_prompts: bool = False) -> tuple[StepSeconds | None, bool]:
        """Close the step (after :attr:`Mark.END`; ``read_prompts``: its forward also read joining prompts). Returns
        seconds and whether their time also paid for other work, so that no step cost is learnt from them: joining
        prompts read, or a graph compiled (``tetris_compile=True``, a shape first met: the compiler's time, which no
        later step pays; an ``adaptive`` call learning from it stopped drafting). On the CPU this step's; on CUDA the
        previous step's (``None`` at the first), whose events the current step's device read has completed."""
        points, self.points = self.points, {}
        shared = read_prompts or compiled_graphs() != self._graphs
        if not self.on_cuda:
            return _step_seconds(points, lambda a, b: b - a), shared
        waiting, self._waiting = self._waiting, points
        waiting_shared, self._waiting_shared = self._waiting_shared, shared
        if waiting is None:
            return None, False
        return _step_seconds(waiting, lambda a, b: a.elapsed_time(b) / 1000.0), waiting_shared


def compiled_graphs() -> int:
    """Graphs ``torch.compile`` made so far in this process (dynamo's own count, a dictionary read)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


class NoClock:
    """A clock for steps that are not run on models (the simulator's replay): marks nothing, measures nothing."""

    def mark(self, phase: Mark) -> None:
        pass

    def finish_step(self, read_prompts: bool = False) -> tuple[None, bool]:
        return None, False


def _step_seconds(points: dict, interval) -> StepSeconds:
    """Draft, verify, other and catch-up seconds from the marked points (a catch-up counts in none of the others)."""
    draft = interval(points[Mark.DRAFT_START], points[Mark.DRAFT_END])
    verify = interval(points[Mark.DRAFT_END], points[Mark.VERIFY_END])
    total = interval(points[Mark.START], points[Mark.END])
    catch_up = 0.0
    if Mark.CATCH_UP_START in points:
        catch_up = interval(points[Mark.CATCH_UP_START], points[Mark.CATCH_UP_END])
    return StepSeconds(draft, verify, total - draft - verify - catch_up, catch_up)
