"""The few shapes a compiled step sees (``tetris_compile=True``): block widths (:func:`block_width`), padded batches
(:func:`batch_bucket`) and cache capacities (:func:`static_capacity`), so that CUDA graphs, recorded one per shape, stay
few. The bounds on the number of shapes: docs/gpu.md, "The compiled path".
"""

from __future__ import annotations

import torch

CAPACITY_STEP = 256  # a static cache's capacity is a multiple of this
BATCH_BUCKET_BASE = 4  # below the call's batch size, padded batches are powers of this (4, 16, 64, ...)


def bucket(length: int) -> int:
    """The padded length of a block of ``length`` tokens: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(length - 1, 0).bit_length()


def records_graphs(device: torch.device) -> bool:
    """Whether compiled forwards on ``device`` run as CUDA graphs (:func:`~tetris_hf.compiled.compiled_forward`),
    which record one graph per shape: then blocks are padded to :func:`bucket` widths."""
    return device.type == "cuda"


def block_width(length: int, compiled: bool, device: torch.device) -> int:
    """The width of a step's target block of ``length`` tokens: padded to a power of two where compiled forwards
    record CUDA graphs, else ``length`` (on a CPU filler costs what a real token costs, and widths are few anyway)."""
    return bucket(length) if compiled and records_graphs(device) else length


def batch_bucket(rows: int, batch_size: int) -> int:
    """The padded batch of a compiled step with ``rows`` active rows in a call of ``batch_size`` rows (a stream's
    ``max_batch_size``): the least power of four (4, 16, 64, ...) that holds them, at most ``batch_size``; e.g.
    ``batch_size`` 16: 5..16 rows run as 16, 1..4 as 4."""
    padded = BATCH_BUCKET_BASE
    while padded < rows:
        padded *= BATCH_BUCKET_BASE
    return min(padded, batch_size)


def batch_buckets(batch_size: int) -> list[int]:
    """Every padded batch :func:`batch_bucket` gives in a call of ``batch_size`` rows, largest first."""
    return sorted({batch_bucket(rows, batch_size) for rows in range(1, batch_size + 1)}, reverse=True)


def static_capacity(slots: int) -> int:
    """Slots per row of a cache whose steps are compiled: ``slots`` rounded up to a multiple of
    :data:`CAPACITY_STEP`, so that calls of nearby lengths give the compiled forwards the same shapes."""
    return -(-slots // CAPACITY_STEP) * CAPACITY_STEP


def standard_strides(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied if it is a view or its strides are not those of a new tensor of its shape: graphs are
    specialised on strides (e.g. a ``(B, 1)`` column of a wider block has strides ``(T, 1)``, not ``(1, 1)``) and on
    whether an input is a view of another (its base's strides are guarded too)."""
    strides, step = [], 1
    for size in reversed(tensor.shape):
        strides.append(step)
        step *= size
    if tensor.stride() == tuple(reversed(strides)) and tensor._base is None:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
