"""A layer's cache write and attention as one opaque op, ``tetris_hf::slot_attention``, for forwards compiled on the
shapes as they come (:func:`~tetris_hf.compiled.eager_shapes_forward`): ``torch.compile`` then traces the rest of the
forward (embeddings, norms, rotary, MLPs, residuals; the linears) into one graph over dynamic shapes, while each layer's
attention runs the eager kernels of a packed forward over the written slots (every block is read packed then, one
without filler too, so that one graph serves them all). What the op needs to know on the host (where the block is
written, how it is packed) travels in a small CPU tensor the op reads itself, so that no host number becomes a constant
of the graph. Design: docs/design.md, "Compiled steps on eager shapes".
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .attention import grouped_sdpa_attention
from .cpu_attention import LayerCalls, write_packed_applies
from .ops import define
from .packing import BlockSplit, Packing, kernel_groups, packed_attention

NONE = -1  # an absent host number in :func:`describe`'s tensor


class SlotArguments(NamedTuple):
    """What a compiled step's attention layers read besides their queries, keys and values: each layer's key and value
    buffers (``(R, H_kv, capacity, D)``, indexed by ``layer_idx``), the block's packing (``rows``, ``columns`` ``(N,)``,
    ``ends`` ``(B,)``) and ``host``, :func:`describe`'s CPU tensor."""

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]
    rows: torch.Tensor
    columns: torch.Tensor
    ends: torch.Tensor
    host: torch.Tensor


def describe(start: int, num_rows: int, packing: Packing) -> torch.Tensor:
    """The host numbers of a block read packed, as a CPU ``int64`` tensor: its first slot ``start``, the cache's active
    rows ``num_rows`` and the :class:`~tetris_hf.packing.Packing`'s width, first row, split, new rows, later rows' slot
    and prompt lengths (:data:`NONE` where absent)."""
    split = packing.split or (NONE, NONE, NONE)
    new_from, later_slot = (NONE if number is None else number for number in (packing.new_from, packing.later_slot))
    return torch.tensor([start, num_rows, packing.width, packing.first_row, *split, new_from, later_slot,
                         *packing.prompt_lengths])


def _packing_of(host: list[int], rows: torch.Tensor, columns: torch.Tensor, ends: torch.Tensor) -> Packing:
    """The :class:`~tetris_hf.packing.Packing` :func:`describe` described (``host``: its numbers, read)."""
    _, num_rows, width, first_row, split_rows, split_width, split_tokens, new_from, later_slot, *prompt_lengths = host
    split = None if split_rows == NONE else BlockSplit(split_rows, split_width, split_tokens)
    return Packing(rows, columns, num_rows, width, ends, first_row, split, None if new_from == NONE else new_from,
                   tuple(prompt_lengths), None if later_slot == NONE else later_slot)


class _ForwardPlan(NamedTuple):
    """What every attention layer of one forward shares, worked out at its first layer: the block's packing, where it
    is written (``start``, ``end``: slots), the cache's active rows, and, where the CPU kernels take the whole block
    (a decode or verify block), the calls each layer makes (:class:`~tetris_hf.cpu_attention.LayerCalls`).
    ``rows`` and ``mask`` are the forward's own tensors; ``shapes`` the layer's tensors' shapes and strides (and the
    scale) the calls were worked out on."""

    rows: torch.Tensor
    mask: torch.Tensor | None
    shapes: tuple
    packing: Packing
    start: int
    num_rows: int
    end: int
    calls: LayerCalls | None


# each live forward's plan, under its host tensor (describe's, made once a forward): gone with the forward
_PLANS: "WeakIdKeyDictionary[torch.Tensor, _ForwardPlan]" = WeakIdKeyDictionary()


def _shapes(scaling: float, *tensors: torch.Tensor) -> tuple:
    return scaling, *((tensor.shape, tensor.stride(), tensor.dtype) for tensor in tensors)


def _plan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
          value_cache: torch.Tensor, attention_mask: torch.Tensor | None, rows: torch.Tensor, columns: torch.Tensor,
          ends: torch.Tensor, host: torch.Tensor, scaling: float) -> _ForwardPlan:
    """The forward's :class:`_ForwardPlan`: the one kept under ``host`` where ``rows`` and ``attention_mask`` are its
    tensors and the layer's are shaped as its first layer's were, else worked out anew (and kept under ``host``)."""
    shapes = _shapes(scaling, query, key, value, key_cache, value_cache)
    plan = _PLANS.get(host)
    if plan is not None and plan.rows is rows and plan.mask is attention_mask and plan.shapes == shapes:
        return plan
    numbers = host.tolist()
    packing = _packing_of(numbers, rows, columns, ends)
    start, num_rows = numbers[:2]
    end = packing.slots_end(start)
    keys, values = key_cache[:num_rows, :, :end], value_cache[:num_rows, :, :end]
    groups = kernel_groups(query, keys, values, attention_mask, packing)
    direct = (groups is not None and packing.later_slot is None and write_packed_applies(keys, key)
              and write_packed_applies(values, value) and rows.dtype == columns.dtype == torch.long)
    calls = LayerCalls(query, key, value, key_cache, value_cache, rows, columns, start, end, groups,
                       scaling) if direct else None
    plan = _ForwardPlan(rows, attention_mask, shapes, packing, start, num_rows, end, calls)
    _PLANS[host] = plan
    return plan


def _slot_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, attention_mask: torch.Tensor | None, rows: torch.Tensor,
                   columns: torch.Tensor, ends: torch.Tensor, host: torch.Tensor, scaling: float) -> torch.Tensor:
    """Write a packed block's ``key``/``value`` into the cache's buffers and attend: what a layer of a packed forward
    does eagerly (the cache's :class:`~tetris_hf.kv.SlotLayer` write, then
    :func:`~tetris_hf.routing.loop_attention_forward` on sdpa). The host numbers and, where the CPU kernels take the
    block, their calls' arguments are worked out once a forward (:func:`_plan`), not once a layer.

    Args:
        query: ``(1, H, N, D)`` the block's real tokens.
        key, value: ``(1, H_kv, N, D)``.
        key_cache, value_cache: ``(R, H_kv, capacity, D)`` the layer's buffers, ``R`` at least the active rows.
        attention_mask: ``(B or 1, 1, L, S)`` bool over the written slots and the block (True = attend), or ``None``
            where every slot is real.
        rows, columns, ends: the block's packing (see :class:`~tetris_hf.packing.Packing`).
        host: :func:`describe`'s numbers.
        scaling: the layer's softmax scale.

    Returns:
        ``(1, N, H, D)``.
    """
    plan = _plan(query, key, value, key_cache, value_cache, attention_mask, rows, columns, ends, host, scaling)
    if plan.calls is not None:
        return plan.calls(query, key, value, key_cache, value_cache)
    keys, values = key_cache[: plan.num_rows], value_cache[: plan.num_rows]
    plan.packing.write(keys, values, key, value, plan.start)
    keys, values = keys[:, :, : plan.end], values[:, :, : plan.end]
    layer = SimpleNamespace(num_key_value_groups=query.shape[1] // key.shape[1], is_causal=True)
    output, _ = packed_attention(grouped_sdpa_attention, layer, query, keys, values, attention_mask, plan.packing,
                                 prompt_rows=query.device.type == "cpu", scaling=scaling)
    return output.contiguous()


slot_attention = define("slot_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) key_cache, "
                        "Tensor(b!) value_cache, Tensor? attention_mask, Tensor rows, Tensor columns, Tensor ends, "
                        "Tensor host, float scaling) -> Tensor", _slot_attention,
                        lambda query, *_: query.new_empty(query.shape[0], query.shape[2], query.shape[1],
                                                          query.shape[3]))


def layer_slot_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, slots: SlotArguments,
                         scaling: float | None = None) -> torch.Tensor:
    """:func:`slot_attention` for the attention layer ``module`` (its buffers: ``slots.keys[module.layer_idx]``)."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    index = module.layer_idx
    return slot_attention(query, key, value, slots.keys[index], slots.values[index], attention_mask, slots.rows,
                          slots.columns, slots.ends, slots.host, float(scaling))
