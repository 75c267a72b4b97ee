# Exported from tetris_hf/timing.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""Device-correct step timing that adds no device read of its own.

On the CPU a step's phases are timed with ``time.perf_counter`` as they happen. On CUDA, kernels run after the host
has moved on, so host clocks would put the draft's time in whatever interval the host next waits in; instead the loop
records CUDA events at the phase boundaries and reads them a step later, once that step's own device read has
synchronised them (reading an event that has completed does not stall).
"""

from __future__ import annotations

import time

import torch

from .step_strategy import StepSeconds

PHASES = ("start", "catch_up_start", "catch_up_end", "draft_start", "draft_end", "verify_end", "end")


class StepClock:
    """Marks a step's phase boundaries (:data:`PHASES`; the catch-up pair is optional) and turns them into
    :class:`~tetris_hf.step_strategy.StepSeconds`.

    Args:
        device: the target's input device (CUDA events there, the host clock elsewhere).
    """

    def __init__(self, device: torch.device):
        self.on_cuda = torch.device(device).type == "cuda"
        self.points: dict[str, object] = {}
        self._waiting: dict[str, object] | None = None  # CUDA: the last step's events, read at the next step

    def mark(self, phase: str) -> None:
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points[phase] = event
        else:
            self.points[phase] = time.perf_counter()

    def finish_step(self) -> StepSeconds | None:
        """Close the step (after ``"end"``): on the CPU its seconds; on CUDA the previous step's (``None`` at the
        first), whose events the current step's device read has completed."""
        points, self.points = self.points, {}
        if not self.on_cuda:
            return _step_seconds(points, lambda a, b: b - a)
        waiting, self._waiting = self._waiting, points
        if waiting is None:
            return None
        return _step_seconds(waiting, lambda a, b: a.elapsed_time(b) / 1000.0)


def _step_seconds(points: dict, interval) -> StepSeconds:
    """Draft, verify and other seconds from the marked points; a catch-up counts in none of them."""
    draft = interval(points["draft_start"], points["draft_end"])
    verify = interval(points["draft_end"], points["verify_end"])
    total = interval(points["start"], points["end"])
    if "catch_up_start" in points:
        total -= interval(points["catch_up_start"], points["catch_up_end"])
    return StepSeconds(draft, verify, total - draft - verify)
