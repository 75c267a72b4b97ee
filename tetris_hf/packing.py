"""Packed forwards: the model reads only the real tokens of a block, as one ``(1, N)`` sequence, each at its own
position, and attention puts each back in its row (:func:`packed_attention`). The packing (:class:`Packing`) travels as
the forward argument ``tetris_packing=`` to :func:`~tetris_hf.routing.loop_attention_forward`. Design: docs/design.md,
"Packed steps".
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .attention import ROW_BY_ROW_WIDTH, grouped_sdpa_attention, prompt_rows_attention
from .cpu_attention import packed_row_attention, packed_row_attention_applies, write_packed, write_packed_applies


class BlockSplit(NamedTuple):
    """A block whose first ``rows`` rows hold at most ``width`` tokens each, ``tokens`` in all (host ints): a request
    stream's decoding rows, then the prompts of rows joining. Attention runs on the two groups apart, each at its own
    width; e.g. 16 rows verifying up to 3 tokens (40 in all), then 2 prompts of 200: ``BlockSplit(16, 3, 40)``."""

    rows: int
    width: int
    tokens: int


class Packing(NamedTuple):
    """Where each of a packed forward's ``N`` tokens sits in the ``(B, L)`` block: ``rows`` and ``columns``, ``(N,)``
    each, in row order; ``ends``: ``(B,)`` the index after each row's last packed token; ``first_row``: rows before
    it hold no token, so attention runs on the rows from it on only; ``split``: the block's rows in two groups
    (:class:`BlockSplit`), or ``None``; ``new_from``: rows from it on hold nothing real before the block and their
    real tokens first, so they attend causally among their own block, unmasked (plain sdpa layouts; ``None``: none);
    ``prompt_lengths``: host ints, the real tokens of each of the block's last ``len(prompt_lengths)`` rows, where
    those rows read prompts and the caller knows their lengths (attention then reads them row by row, each at its own
    length: :func:`prompt_rows_attention`); ``later_slot``: with a split whose later rows are all new, the slot their
    tokens are written from, their own first slots (``0``: holes in them, so the block widens no other row), instead
    of the block's first slot with the other rows' (``None``).

    E.g. real lengths ``[3, 1, 2]``, ``L = 3``: the model reads ``[a0 a1 a2 b0 c0 c1]``, ``rows = [0 0 0 1 2 2]``,
    ``columns = [0 1 2 0 0 1]``."""

    rows: torch.Tensor
    columns: torch.Tensor
    batch_size: int
    width: int
    ends: torch.Tensor
    first_row: int = 0
    split: BlockSplit | None = None
    new_from: int | None = None
    prompt_lengths: tuple[int, ...] = ()
    later_slot: int | None = None

    @classmethod
    def of(cls, real_lengths: torch.Tensor, num_tokens: int, width: int,
           first_columns: torch.Tensor | None = None, first_row: int = 0, split: BlockSplit | None = None,
           new_from: int | None = None, prompt_lengths: tuple[int, ...] = (),
           later_slot: int | None = None) -> Packing:
        """The packing of a block whose row ``i`` has ``real_lengths[i]`` ``(B,)`` consecutive real tokens, its first
        ones or from column ``first_columns[i]`` ``(B,)`` on; ``num_tokens``: their sum, known on the host; ``width``:
        ``L``; ``first_row``, ``split``, ``new_from``, ``prompt_lengths``, ``later_slot``: as in :class:`Packing`
        (``new_from``, ``prompt_lengths`` and ``later_slot`` kept without ``first_columns`` only)."""
        ends = real_lengths.cumsum(dim=0)
        tokens = torch.arange(num_tokens, device=real_lengths.device)
        rows = torch.searchsorted(ends, tokens, right=True)
        starts = ends - real_lengths if first_columns is None else ends - real_lengths - first_columns
        if first_columns is not None:
            new_from, prompt_lengths, later_slot = None, (), None
        if later_slot is not None and (split is None or new_from != split.rows):
            raise ValueError("later_slot places a split's later rows, which must be its new ones")
        return cls(rows, tokens - starts[rows], real_lengths.shape[0], width, ends, first_row, split, new_from,
                   tuple(prompt_lengths), later_slot)

    @classmethod
    def of_left_padded(cls, input_mask: torch.Tensor, num_tokens: int) -> Packing:
        """The packing of a left-padded block: ``input_mask`` ``(B, L)``, each row's real tokens (1) its last ones;
        ``num_tokens``: their sum, known on the host.

        E.g. mask ``[[0 1 1], [1 1 1], [0 0 1]]``: the model reads ``[a1 a2 b0 b1 b2 c2]``, ``columns [1 2 0 1 2 2]``.
        """
        real_lengths = input_mask.sum(dim=1)
        return cls.of(real_lengths, num_tokens, input_mask.shape[1], input_mask.shape[1] - real_lengths)

    @property
    def num_tokens(self) -> int:
        return self.rows.shape[0]

    def pack(self, block: torch.Tensor) -> torch.Tensor:
        """``(B, L, ...)`` -> ``(N, ...)``: the real tokens, in row order."""
        return block[self.rows, self.columns]

    def scatter_heads(self, buffer: torch.Tensor, packed: torch.Tensor, first_column: int = 0) -> None:
        """Write ``packed`` ``(1, H, N, D)`` (an attention layer's layout) into ``buffer`` ``(B, H, W, D)``, each token
        at its row and at column ``first_column`` plus its own (a cache's slots; 0 for a block of its own)."""
        buffer[self.rows, :, first_column + self.columns] = packed[0].transpose(0, 1)

    def slots_end(self, first_slot: int) -> int:
        """The slot after the last one a block written from ``first_slot`` reaches (the later rows' own, where
        :attr:`later_slot` places them)."""
        if self.later_slot is None:
            return first_slot + self.width
        return max(first_slot + self.split.width, self.later_slot + self.width)

    def new_rows_slot(self, first_slot: int) -> int:
        """The slot the new rows' (:attr:`new_from`) tokens are written from, in a block written from
        ``first_slot``."""
        return first_slot if self.later_slot is None else self.later_slot

    def write(self, keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
              first_column: int = 0) -> None:
        """:meth:`scatter_heads` of a layer's ``key_states`` and ``value_states`` into its ``keys`` and ``values``
        buffers, from slot ``first_column`` (a split's later rows from :attr:`later_slot`, where set); on the CPU one
        call of the kernel beside the attention's (:func:`~tetris_hf.cpu_attention.write_packed`, no index tensors)."""
        if self.later_slot is not None:  # (two writes: the first rows' tokens, then the later rows' at their slot)
            tokens = self.split.tokens
            for part, first, end, column in ((self.first_rows(), 0, tokens, first_column),
                                             (self.later_rows(), tokens, self.num_tokens, self.later_slot)):
                part._write(keys, values, key_states[:, :, first:end], value_states[:, :, first:end], column)
            return
        self._write(keys, values, key_states, value_states, first_column)

    def _write(self, keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
               first_column: int) -> None:
        if write_packed_applies(keys, key_states) and write_packed_applies(values, value_states) and \
                self.rows.device.type == "cpu" and self.rows.dtype == self.columns.dtype == torch.long:
            write_packed(keys, values, key_states, value_states, self.rows, self.columns, first_column)
            return
        self.scatter_heads(keys, key_states, first_column)
        self.scatter_heads(values, value_states, first_column)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """``(N, ...)`` -> ``(B, L, ...)``, zeros at filler."""
        rows = packed.new_zeros((self.batch_size, self.width, *packed.shape[1:]))
        rows[self.rows, self.columns] = packed
        return rows

    def groups(self) -> list[tuple[int, int, int, int, int]]:
        """The groups of rows attention runs on apart: ``(first row, end row, width, first token, end token)`` each
        (host ints): rows from :attr:`first_row` on, in the two groups of :attr:`split` if any."""
        if self.split is None:
            return [(self.first_row, self.batch_size, self.width, 0, self.num_tokens)]
        split = self.split
        return [(self.first_row, split.rows, split.width, 0, split.tokens),
                (split.rows, self.batch_size, self.width, split.tokens, self.num_tokens)]

    def lengths_of(self, first: int, end: int) -> tuple[int, ...] | None:
        """Rows ``first..end - 1``'s real tokens, host ints, where :attr:`prompt_lengths` covers them (else
        ``None``)."""
        known_from = self.batch_size - len(self.prompt_lengths)
        return self.prompt_lengths[first - known_from : end - known_from] if first >= known_from else None

    def first_rows(self) -> Packing:
        """The packing of :attr:`split`'s first rows alone (their tokens come first: logits are computed there)."""
        split = self.split
        return Packing(self.rows[: split.tokens], self.columns[: split.tokens], split.rows, split.width,
                       self.ends[: split.rows])

    def later_rows(self) -> Packing:
        """The packing of :attr:`split`'s later rows' tokens, their rows still numbered in the whole block (what a
        cache write needs: the rows index the cache's)."""
        tokens = self.split.tokens
        return Packing(self.rows[tokens:], self.columns[tokens:], self.batch_size, self.width, self.ends)


class KernelGroup(NamedTuple):
    """A group of a packed block's rows (:meth:`Packing.groups`) that the CPU row kernel reads where it lies: rows
    ``first..end - 1``, tokens ``first_token..end_token - 1``, at most ``width`` a row, under ``mask`` ``(B_g or 1, 1,
    width or 1, S)`` (the block's mask cut to the group's rows, columns and the keys' slots) with the packing's
    ``ends`` and ``columns`` cut to it. Host ints and views, the same for every layer of a forward."""

    first: int
    end: int
    width: int
    first_token: int
    end_token: int
    mask: torch.Tensor
    ends: torch.Tensor
    columns: torch.Tensor


def _kernel_group(attention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                  packing: Packing, group: tuple[int, int, int, int, int], prompt_rows: bool,
                  plain: bool) -> KernelGroup | None:
    """The :class:`KernelGroup` of one of :meth:`Packing.groups` where the CPU row kernel takes it (a decode or verify
    group on grouped sdpa: :func:`~tetris_hf.cpu_attention.packed_row_attention_applies`), else ``None`` (prompts
    read row by row, rows that just joined, or another attention)."""
    first, end, width, first_token, end_token = group
    new = packing.new_from is not None and first >= packing.new_from
    if new or not plain or attention is not grouped_sdpa_attention or not isinstance(attention_mask, torch.Tensor):
        return None
    if prompt_rows and width >= ROW_BY_ROW_WIDTH and packing.lengths_of(first, end) is not None \
            and attention_mask.dtype == torch.bool:
        return None  # (prompts whose lengths the packing knows: row by row)
    mask = attention_mask[first:end] if attention_mask.shape[0] > 1 else attention_mask  # (B or 1, 1, L, S)
    mask = mask[:, :, :width] if mask.shape[2] > 1 else mask
    if not packed_row_attention_applies(query, key[first:end], value[first:end], mask, width):
        return None
    return KernelGroup(first, end, width, first_token, end_token, mask[..., : key.shape[-2]], packing.ends[first:end],
                       packing.columns[first_token:end_token])


def kernel_groups(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask,
                  packing: Packing) -> tuple[KernelGroup, ...] | None:
    """Every group of a packed block on grouped sdpa as the CPU row kernel reads it, or ``None`` where some group
    takes another route; arguments as :func:`packed_attention`'s (``prompt_rows`` on). What
    :class:`~tetris_hf.cpu_attention.LayerCalls` then computes for any layer whose tensors are shaped as these."""
    groups = [_kernel_group(grouped_sdpa_attention, query, key, value, attention_mask, packing, group, True, True)
              for group in packing.groups()]
    return None if any(group is None for group in groups) else tuple(groups)


def packed_attention(attention, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, packing: Packing, prompt_rows: bool = False,
                     **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``attention`` (the model's own) for a packed forward: ``query`` ``(1, H, N, D)`` is unpacked to its rows
    ``(B, H, L, D)``, attends to ``key``/``value`` ``(B, H_kv, S, D)`` (each row's cache, the block written in it)
    under the row-layout ``attention_mask`` ``(B, 1, L, S)``, and the output is packed again: ``(1, N, H, D)``.
    ``prompt_rows``: ``attention`` is sdpa, and a group of rows whose prompt lengths the packing knows on the host, at
    least :data:`~tetris_hf.attention.ROW_BY_ROW_WIDTH` wide, is read row by row instead
    (:func:`~tetris_hf.attention.prompt_rows_attention`: the same sums, without the padding). On grouped sdpa where
    the CPU kernel takes the block (:func:`~tetris_hf.cpu_attention.packed_row_attention_applies`: a decode or
    verify block), it reads the packed queries and writes the packed output itself, nothing unpacked."""
    outputs, weights = [], None
    plain = not kwargs.get("dropout") and all(kwargs.get(name) is None
                                              for name in ("softcap", "position_bias", "s_aux", "sinks"))
    # each group of rows at its own width (rows before first_row have no query: they attend to nothing, left out)
    for first, end, width, first_token, end_token in packing.groups():
        group = _kernel_group(attention, query, key, value, attention_mask, packing,
                              (first, end, width, first_token, end_token), prompt_rows, plain)
        if group is not None:  # (the CPU kernel reads the block where it lies: nothing unpacked)
            outputs.append(packed_row_attention(query[:, :, first_token:end_token], key[first:end], value[first:end],
                                                group.mask, group.ends, group.columns, first_token, width,
                                                kwargs.get("scaling")))
            continue
        lengths = packing.lengths_of(first, end) if prompt_rows and plain and width >= ROW_BY_ROW_WIDTH else None
        new = packing.new_from is not None and first >= packing.new_from
        mask = attention_mask
        if lengths is not None and (new or isinstance(mask, torch.Tensor) and mask.dtype == torch.bool):
            queries = query[:, :, first_token:end_token]
            if new:  # (causal over the block's own slots, as below)
                output = prompt_rows_attention(queries, key[first:end], value[first:end], lengths, None, width,
                                               packing.new_rows_slot(key.shape[-2] - packing.width),
                                               kwargs.get("scaling"))
            else:
                mask = mask[first:end] if mask.shape[0] > 1 else mask
                output = prompt_rows_attention(queries, key[first:end], value[first:end], lengths,
                                               mask[..., : key.shape[-2]], width, scaling=kwargs.get("scaling"))
            outputs.append(output)
            continue
        if isinstance(mask, torch.Tensor):  # (B or 1, 1, L, S)
            mask = mask[first:end] if mask.shape[0] > 1 else mask
            mask = mask[:, :, :width] if mask.shape[2] > 1 else mask
        keys, values = key[first:end], value[first:end]
        rows, columns = packing.rows[first_token:end_token] - first, packing.columns[first_token:end_token]
        queries = query.new_zeros(end - first, query.shape[1], width, query.shape[-1])
        queries[rows, :, columns] = query[0, :, first_token:end_token].transpose(0, 1)
        if new:  # (set on plain sdpa layouts only)
            # rows that just joined: causality over the block's own slots is exact (filler follows the real tokens)
            start = packing.new_rows_slot(key.shape[-2] - packing.width)
            keys, values = key[first:end, :, start : start + width], value[first:end, :, start : start + width]
            output, weights = attention(module, queries, keys, values, None, **{**kwargs, "is_causal": True})
            outputs.append(output[rows, columns])
            continue
        output, weights = attention(module, queries, keys, values, mask, **kwargs)  # (B, L, H, D)
        outputs.append(output[rows, columns])
    return (outputs[0] if len(outputs) == 1 else torch.cat(outputs))[None], weights
