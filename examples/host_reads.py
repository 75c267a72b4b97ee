"""Count device -> host reads per decoding step (on a GPU each one stalls kernel launches until the device drains).

A read is any call of ``Tensor.item / __int__ / __bool__ / __float__ / __index__ / tolist / cpu`` while the counter
is active. Steps are closed by a callback: ``tetris_step_callback`` for the speculative loop, or
:meth:`HostReads.logits_processor` for plain ``generate()`` (called once per generated token)::

    with HostReads() as reads:
        target.generate(..., custom_generate="tetris", tetris_step_callback=reads.step_done)
    reads.per_step  # reads made during each step, in order

Used by ``tests/test_host_reads.py`` (the bound) and ``examples/gpu_check.py`` (the numbers on a GPU).
"""

from __future__ import annotations

import sys

import torch

READS = ("item", "__int__", "__bool__", "__float__", "__index__", "tolist", "cpu")


class HostReads:
    """While active (a context manager), counts every read in :data:`READS`; ``step_done`` closes a step.

    Args:
        host_files: reads made directly by code in files whose names end so are not counted: code that works on host
            copies it made itself (a strategy's arithmetic after its one transfer), not on device tensors.
    """

    def __init__(self, host_files: tuple[str, ...] = ()):
        self.host_files = host_files
        self.count = 0  # reads since the last closed step
        self.per_step: list[int] = []
        self._originals: dict[str, object] = {}

    def __enter__(self) -> HostReads:
        for name in READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            def counted(tensor, *args, _original=original, **kwargs):
                if not (self.host_files and sys._getframe(1).f_code.co_filename.endswith(self.host_files)):
                    self.count += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()

    def step_done(self, *_args) -> None:
        """Close a step: record the reads since the last one (signature fits ``tetris_step_callback``)."""
        self.per_step.append(self.count)
        self.count = 0

    def logits_processor(self):
        """A logits processor that closes a step each time ``generate()`` calls it (once per token), scores kept."""
        from transformers import LogitsProcessor

        counter = self

        class StepMarker(LogitsProcessor):
            def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
                counter.step_done()
                return scores

        return StepMarker()
