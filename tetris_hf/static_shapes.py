"""The few shapes a compiled step sees (``tetris_compile=True``): block widths, padded batches, cache capacities.

On CUDA the compiled step forwards (:mod:`tetris_hf.compiled`) run as CUDA graphs, which record one graph per distinct
input shape. So the step forwards see a few shapes only (:class:`~tetris_hf.kv.SlotCache` in static mode):

- the KV width: the cache's whole capacity, fixed for the call (:func:`static_capacity`), unwritten slots masked;
- the block: the target's verify block padded to a power of two on CUDA (:func:`block_width`, by the loop; a CPU
  compiles each of its at most ``k + e + 1`` widths), the draft's 1 or 2;
- the batch: padded with dummy rows to :func:`batch_bucket` of the rows the cache holds (the call's batch size, a
  request stream's ``max_batch_size``; then 16, 4: powers of four), so rows retiring, and in a stream rows joining,
  change the shape only when the live count crosses a bucket, never once per row count.

On CUDA a call with batch ``B`` and blocks up to ``2^j`` gives the target at most ``(j + 1) * len(batch_buckets(B))``
shapes, however many tokens it generates (B = 16 drafting up to 5 tokens a row, blocks of up to 8: 4 x 2 = 8); on a
CPU, with ``K = k + e`` drafts a row, at most ``(K + 1) * len(batch_buckets(B))`` (6 x 2 = 12). The draft sees at
most ``2 * len(batch_buckets(B))``. Calls whose caches round to the same capacity, and batches that share buckets,
reuse them. A request stream (``B = max_batch_size``) has the same bound per capacity; its caches start at the
capacity of a few chunks and double when a row needs more, each capacity its own set of shapes.
"""

from __future__ import annotations

import torch

CAPACITY_STEP = 256  # a static cache's capacity is a multiple of this
BATCH_BUCKET_BASE = 4  # below the call's batch size, padded batches are powers of this (4, 16, 64, ...)


def bucket(length: int) -> int:
    """The padded length of a block of ``length`` tokens: the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(length - 1, 0).bit_length()


def records_graphs(device: torch.device) -> bool:
    """Whether compiled forwards on ``device`` run as CUDA graphs (``mode="reduce-overhead"``, see
    :func:`~tetris_hf.compiled.compiled_forward`), which record one graph per shape: then blocks are padded to
    :func:`bucket` widths."""
    return device.type == "cuda"


def block_width(length: int, compiled: bool, device: torch.device) -> int:
    """The width of a step's target block of ``length`` tokens: padded to a power of two where compiled forwards
    record CUDA graphs (few shapes matter more than the filler's cost, which a GPU hardly notices), else ``length``.

    Elsewhere (inductor on a CPU) each width is compiled once, and a block has at most ``k + e + 1`` widths however
    long the call, while filler tokens cost what real ones cost: padding a fixed ``k = 2`` block of 3 to 4 would add a
    third to every verify forward.
    """
    return bucket(length) if compiled and records_graphs(device) else length


def batch_bucket(rows: int, batch_size: int) -> int:
    """The padded batch of a compiled step with ``rows`` active rows in a call of ``batch_size`` rows (a stream's
    ``max_batch_size``): the least power of four (4, 16, 64, ...) that holds them, at most ``batch_size``.

    E.g. ``batch_size`` 16: 5..16 rows run as 16, 1..4 as 4. On a GPU a decoding forward reads the weights whatever
    its batch, so a few padded rows cost little, and fewer buckets mean fewer graphs.
    """
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
    """``tensor``, copied if its strides are not those of a new tensor of its shape: graphs are specialised on
    strides too (e.g. a ``(B, 1)`` column of a wider block has strides ``(T, 1)``, not ``(1, 1)``)."""
    strides, step = [], 1
    for size in reversed(tensor.shape):
        strides.append(step)
        step *= size
    if tensor.stride() == tuple(reversed(strides)):
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
