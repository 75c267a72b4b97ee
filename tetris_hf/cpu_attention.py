"""Decode and verify attention on the CPU, each row over its own keys: :func:`row_attention`, a small C kernel
(:mod:`tetris_hf.row_attention_source`) compiled at first use with the system's C compiler and called through
``ctypes``.

A step's attention reads the cache's written prefix, which every row shares: the CPU's sdpa kernel reads all of it for
every row, masked, so a row holding 80 real tokens beside one holding 450 reads 450 keys (docs/benchmarks.md,
"Attention over long contexts"). The kernel reads only the slots a row's mask lets it see, each key-value head once for
its group of query heads (what vLLM's CPU engine reads over its paged cache). fp32 on the CPU only; where no compiler
is found, or ``TETRIS_HF_CPU_KERNELS=0``, attention stays on sdpa. Measurements: docs/benchmarks.md, "Each row over
its own keys".
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .kernel_build import built, switched_on
from .ops import define
from .row_attention_source import SOURCE

MAX_QUERIES = 32  # queries a key-value head (query heads x block length) this kernel takes; longer blocks: sdpa


def load(library: Path) -> ctypes.CDLL:
    """A built kernel (:func:`tetris_hf.kernel_build.built`), its functions ``row_attention``, ``write_packed`` and
    ``prompt_attention`` typed as the C source declares them."""
    loaded = ctypes.CDLL(str(library))
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    loaded.row_attention.argtypes = [pointer, size, size, size, pointer, size, size, size, pointer, size, size, size,
                                     pointer, size, size, size, pointer, size, size, size, size, size, size,
                                     ctypes.c_float, ctypes.c_int, pointer, pointer, size]
    loaded.row_attention.restype = None
    loaded.write_packed.argtypes = [pointer, size, size, size, pointer, size, size, size, pointer, size, size,
                                    pointer, size, size, pointer, pointer, size, size, size, size, size]
    loaded.write_packed.restype = None
    if hasattr(loaded, "prompt_attention"):  # (an earlier commit's build has none: examples/attention_kernel_alone.py)
        loaded.prompt_attention.argtypes = [pointer, size, size, pointer, size, size, size, pointer, size, size, size,
                                            pointer, size, size, size, pointer, size, size, size, ctypes.c_float,
                                            pointer, ctypes.c_int]
        loaded.prompt_attention.restype = None
    return loaded


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, loaded (built first if no matching build is kept); ``None`` where it cannot be."""
    library = built("row_attention", SOURCE, "CPU attention stays on sdpa")
    return None if library is None else load(library)


def available() -> bool:
    """Whether :func:`row_attention` runs here (building the kernel at the first call)."""
    return _library() is not None


def row_attention_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None) -> bool:
    """Whether :func:`row_attention` takes these tensors: fp32 on the CPU, a 4D bool mask, at most
    :data:`MAX_QUERIES` queries a key-value head, the last dimension contiguous, no gradient wanted (the kernel has
    no backward), and the kernel built."""
    return (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
            and attention_mask.shape[0] in (1, query.shape[0]) and attention_mask.shape[2] in (1, query.shape[2])
            and _kernel_takes(query, key, value, attention_mask, query.shape[2]))


def packed_row_attention_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask: torch.Tensor | None, width: int) -> bool:
    """Whether :func:`packed_row_attention` takes a packed block (``query`` ``(1, H, N, D)``, rows of at most
    ``width`` tokens), as :func:`row_attention_applies` says for the block unpacked."""
    return (query.shape[0] == 1 and isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4
            and attention_mask.shape[0] in (1, key.shape[0]) and attention_mask.shape[2] in (1, width)
            and _kernel_takes(query, key, value, attention_mask, width))


def _kernel_takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                  length: int) -> bool:
    """The kernel's own conditions, a block's rows ``length`` queries long (see :func:`row_attention_applies`)."""
    return (attention_mask.dtype == torch.bool and attention_mask.shape[1] == 1
            and attention_mask.shape[3] >= key.shape[2]
            and query.shape[1] // key.shape[1] * length <= MAX_QUERIES
            and _tensors_taken(query, key, value))


def _tensors_taken(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """What every attention function here asks of its tensors: fp32 on the CPU, ``H`` a multiple of ``H_kv``, the last
    dimension contiguous, no gradient wanted (the kernels have no backward), and the kernels on
    (:func:`_kernels_on`)."""
    return (query.device.type == "cpu" and query.dtype == key.dtype == value.dtype == torch.float32
            and query.shape[1] % key.shape[1] == 0
            and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
            and not (torch.is_grad_enabled() and any(tensor.requires_grad for tensor in (query, key, value)))
            and _kernels_on())


def _kernels_on() -> bool:
    """Outside a compiled graph, not switched off (``TETRIS_HF_CPU_KERNELS=0``, read at every call, before any build),
    and the kernels built."""
    return not torch.compiler.is_compiling() and switched_on() and available()


def _mask_arguments(attention_mask: torch.Tensor) -> tuple[int, int, int, int]:
    """A bool mask ``(B or 1, 1, L or 1, S)`` as the C function reads it: its memory, then its strides along ``B``,
    ``L`` and ``S`` (0 where broadcast)."""
    mask = attention_mask.view(torch.uint8)
    return (mask.data_ptr(), mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(2) if mask.shape[2] > 1 else 0,
            mask.stride(3))


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                  scaling: float | None = None) -> torch.Tensor:
    """Softmax attention of each row's queries over the keys its mask lets them see, read row by row (the operator
    ``tetris_hf::row_attention``: a profile names it among the attention ops).

    Args:
        query: ``(B, H, L, D)``.
        key, value: ``(B, H_kv, S, D)`` (views of a cache's buffers read in place), ``H`` a multiple of ``H_kv``;
            query head ``i`` reads key-value head ``i // (H // H_kv)``.
        attention_mask: ``(B or 1, 1, L or 1, S)`` bool, True = attend.
        scaling: the softmax scale (``None``: ``D ** -0.5``).

    Returns:
        ``(B, L, H, D)``; zeros for a query that sees no key.
    """
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return _row_attention_op(query, key, value, attention_mask[..., : key.shape[2]], float(scale))


def _row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """:func:`row_attention`'s kernel: the C function on the tensors' memory (``attention_mask`` ``S`` slots wide)."""
    batch, heads, length, dim = query.shape
    key_heads, slots = key.shape[1], key.shape[2]
    output = query.new_empty(batch, length, heads, dim)
    _library().row_attention(
        query.data_ptr(), *query.stride()[:3], key.data_ptr(), *key.stride()[:3], value.data_ptr(), *value.stride()[:3],
        *_mask_arguments(attention_mask), output.data_ptr(), batch, heads, key_heads, length, slots, dim, scale,
        torch.get_num_threads(), None, None, 0)
    return output


_row_attention_op = define("row_attention(Tensor query, Tensor key, Tensor value, Tensor attention_mask, float scale) "
                           "-> Tensor", _row_attention,
                           lambda query, *_: query.new_empty(query.shape[0], query.shape[2], query.shape[1],
                                                             query.shape[3]))


def packed_row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                         ends: torch.Tensor, columns: torch.Tensor, first_token: int, width: int,
                         scaling: float | None = None) -> torch.Tensor:
    """:func:`row_attention` on a packed block, read where it lies (no rows of padded queries, no packing of the
    output): the operator ``tetris_hf::packed_row_attention``.

    Args:
        query: ``(1, H, N, D)`` the rows' tokens, one row after another.
        key, value: ``(B, H_kv, S, D)``.
        attention_mask: ``(B or 1, 1, width or 1, S)`` bool, True = attend, in the block's padded layout (row ``b``'s
            token at column ``c`` reads mask row ``c``).
        ends: ``(B,)`` int64, the index after each row's last token, counted from ``first_token`` (a
            :class:`~tetris_hf.packing.Packing`'s ``ends`` for rows after the first); a row's tokens stand at
            consecutive columns.
        columns: ``(N,)`` int64, each token's column.
        width: the longest row's tokens at most.
        scaling: the softmax scale (``None``: ``D ** -0.5``).

    Returns:
        ``(N, H, D)``; zeros for a query that sees no key.
    """
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return _packed_row_attention_op(query, key, value, attention_mask[..., : key.shape[2]], ends, columns,
                                    int(first_token), int(width), float(scale))


def _packed_row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                          ends: torch.Tensor, columns: torch.Tensor, first_token: int, width: int,
                          scale: float) -> torch.Tensor:
    """:func:`packed_row_attention`'s kernel: the C function on the tensors' memory."""
    _, heads, tokens, dim = query.shape
    batch, key_heads, slots = key.shape[:3]
    ends, columns = ends.contiguous(), columns.contiguous()
    output = query.new_empty(tokens, heads, dim)
    _library().row_attention(
        query.data_ptr(), 0, query.stride(1), query.stride(2), key.data_ptr(), *key.stride()[:3], value.data_ptr(),
        *value.stride()[:3], *_mask_arguments(attention_mask), output.data_ptr(), batch, heads, key_heads, width,
        slots, dim, scale, torch.get_num_threads(), ends.data_ptr(), columns.data_ptr(), first_token)
    return output


_packed_row_attention_op = define(
    "packed_row_attention(Tensor query, Tensor key, Tensor value, Tensor attention_mask, Tensor ends, Tensor columns, "
    "int first_token, int width, float scale) -> Tensor", _packed_row_attention,
    lambda query, *_: query.new_empty(query.shape[2], query.shape[1], query.shape[3]))


def write_packed_applies(buffer: torch.Tensor, states: torch.Tensor) -> bool:
    """Whether :func:`write_packed` writes ``states`` ``(1, H, N, D)`` into ``buffer`` ``(R, H, capacity, D)``: both
    on the CPU, of one dtype, their last dimension contiguous, no gradient wanted, outside a compiled graph, the
    kernel built."""
    return (buffer.device.type == states.device.type == "cpu" and buffer.dtype == states.dtype
            and buffer.stride(-1) == states.stride(-1) == 1 and states.shape[0] == 1
            and not (torch.is_grad_enabled() and states.requires_grad) and _kernels_on())


def write_packed(keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                 rows: torch.Tensor, columns: torch.Tensor, start: int) -> None:
    """Write a packed block's keys and values into a cache's buffers, in place: token ``t`` of ``key_states`` and
    ``value_states`` ``(1, H, N, D)`` to row ``rows[t]``, slot ``start + columns[t]`` of ``keys`` and ``values``
    ``(R, H, capacity, D)`` (``rows``, ``columns``: ``(N,)`` int64 on the CPU). What
    :meth:`~tetris_hf.packing.Packing.scatter_heads` does twice, in one call without index tensors."""
    rows, columns = rows.contiguous(), columns.contiguous()
    _library().write_packed(keys.data_ptr(), *keys.stride()[:3], values.data_ptr(), *values.stride()[:3],
                            key_states.data_ptr(), *key_states.stride()[1:3], value_states.data_ptr(),
                            *value_states.stride()[1:3], rows.data_ptr(), columns.data_ptr(), int(start),
                            key_states.shape[2], key_states.shape[1], key_states.shape[3], key_states.element_size())


class LayerCalls:
    """One forward's cache write and row attention, alike in every layer, as the C calls a layer makes: their
    arguments worked out once (at the forward's first layer), so that a layer passes only its tensors' memory.

    Args (the first layer's, every later one shaped and strided alike):
        query: ``(1, H, N, D)``; key_states, value_states: ``(1, H_kv, N, D)``; key_cache, value_cache:
            ``(R, H_kv, capacity, D)``, all fp32 on the CPU, where :func:`write_packed_applies` and the row kernel
            (:func:`packed_row_attention_applies`) hold.
        rows, columns: ``(N,)`` int64, each token's row and column (written to slot ``start + column``).
        start: the block's first slot; slots: the slots attention reads (``S``).
        groups: the row groups the kernel reads, each with ``first`` (row), ``width``, ``first_token``, ``mask``
            (bool, ``(B_g or 1, 1, width or 1, S)``), ``ends`` and ``columns`` as :func:`packed_row_attention` takes
            them (:class:`~tetris_hf.packing.KernelGroup`).
        scale: the softmax scale.
    """

    def __init__(self, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor,
                 start: int, slots: int, groups, scale: float):
        self.keep = [rows.contiguous(), columns.contiguous()]  # (tensors whose memory the calls read: kept alive)
        _, heads, tokens, dim = query.shape
        self.output_shape = (tokens, heads, dim)
        size = query.element_size()
        self.write = (*key_cache.stride()[:3], *value_cache.stride()[:3], *key_states.stride()[1:3],
                      *value_states.stride()[1:3], self.keep[0].data_ptr(), self.keep[1].data_ptr(), int(start),
                      tokens, key_states.shape[1], dim, size)
        threads = torch.get_num_threads()
        self.groups = []
        for group in groups:
            ends, group_columns = group.ends.contiguous(), group.columns.contiguous()
            self.keep += [group.mask, ends, group_columns]
            self.groups.append((
                group.first_token * query.stride(2) * size, query.stride(1), query.stride(2),
                group.first * key_cache.stride(0) * size, key_cache.stride()[:3],
                group.first * value_cache.stride(0) * size, value_cache.stride()[:3], _mask_arguments(group.mask),
                group.first_token * heads * dim * size,
                (group.ends.shape[0], heads, key_cache.shape[1], group.width, slots, dim, scale, threads,
                 ends.data_ptr(), group_columns.data_ptr(), group.first_token)))

    def __call__(self, query: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor,
                 key_cache: torch.Tensor, value_cache: torch.Tensor) -> torch.Tensor:
        """Write this layer's ``key_states``/``value_states`` into its caches and attend: ``(1, N, H, D)``."""
        library = _library()
        keys, values, write = key_cache.data_ptr(), value_cache.data_ptr(), self.write
        library.write_packed(keys, *write[:3], values, *write[3:6], key_states.data_ptr(), *write[6:8],
                             value_states.data_ptr(), *write[8:])
        output = query.new_empty(self.output_shape)
        queries, out = query.data_ptr(), output.data_ptr()
        for (query_at, q_h, q_l, key_at, key_strides, value_at, value_strides, mask, out_at, rest) in self.groups:
            library.row_attention(queries + query_at, 0, q_h, q_l, keys + key_at, *key_strides, values + value_at,
                                  *value_strides, *mask, out + out_at, *rest)
        return output[None]


PROMPT_DIM = 64  # prompt_attention takes heads of a multiple of this many dimensions (its tiles' width)


def prompt_attention_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :func:`prompt_attention` takes these tensors: fp32 on the CPU, heads of a multiple of
    :data:`PROMPT_DIM` dimensions, ``H`` a multiple of ``H_kv``, the last dimension contiguous, no gradient wanted,
    outside a compiled graph, the kernel built."""
    return query.shape[0] == 1 and query.shape[-1] % PROMPT_DIM == 0 and _tensors_taken(query, key, value)


def prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: tuple[int, ...],
                     scaling: float | None = None) -> torch.Tensor:
    """Causal softmax attention of rows that read prompts, each over its own keys (the operator
    ``tetris_hf::prompt_attention``): tiles of queries against transposed keys, as a GEMM multiplies, where torch's
    flash kernel, row by row, took 1.4-3.0x the time (one prompt of 147-1,300 tokens; 16 of 144-282)
    (docs/benchmarks.md, "Prompts' attention in tiles"). Each row's outputs depend on its own tokens alone (not on the
    rows beside it); within fp32 rounding of sdpa's, not bit for bit.

    Args:
        query: ``(1, H, N, D)`` the rows' tokens packed in row order (``lengths[i]`` of row ``i``).
        key, value: ``(R, H_kv, S, D)`` each row's keys from slot 0 (the row's ``j``-th token sees slots ``0..j``),
            ``H`` a multiple of ``H_kv``: query head ``i`` reads key-value head ``i // (H // H_kv)``.
        lengths: ``R`` host ints, each row's tokens (0: the row is left out), at most ``S``.
        scaling: the softmax scale (``None``: ``D ** -0.5``).

    Returns:
        ``(N, H, D)`` in the packed order.

    Raises:
        ValueError: ``lengths`` do not fit the tensors (more rows than ``key`` holds, a row longer than its slots, a
            sum other than ``N``): the kernel would read past them.
    """
    if (len(lengths) > key.shape[0] or sum(lengths) != query.shape[2] or min(lengths, default=0) < 0
            or max(lengths, default=0) > min(key.shape[2], value.shape[2]) or value.shape[:2] != key.shape[:2]):
        raise ValueError(f"prompt_attention: lengths {tuple(lengths)} do not fit queries {tuple(query.shape)} and "
                         f"keys {tuple(key.shape)} / values {tuple(value.shape)}")
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return _prompt_attention_op(query, key, value, [int(length) for length in lengths], float(scale))


def _prompt_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int],
                      scale: float) -> torch.Tensor:
    """:func:`prompt_attention`'s kernel: the C function on the tensors' memory."""
    _, heads, tokens, dim = query.shape
    key_heads = key.shape[1]
    output = query.new_empty(tokens, heads, dim)
    counts = torch.tensor(lengths, dtype=torch.int64)
    # (room for each row's keys transposed: panels of 16 keys, an even count of them a key-value head)
    panels = query.new_empty(sum(key_heads * -(-length // 32) * 2 for length in lengths) * dim * 16)
    _library().prompt_attention(query.data_ptr(), query.stride(2), query.stride(1), key.data_ptr(), *key.stride()[:3],
                                value.data_ptr(), *value.stride()[:3], output.data_ptr(), heads * dim, dim,
                                len(lengths), counts.data_ptr(), heads, key_heads, dim, scale, panels.data_ptr(),
                                torch.get_num_threads())
    return output


_prompt_attention_op = define(
    "prompt_attention(Tensor query, Tensor key, Tensor value, int[] lengths, float scale) -> Tensor",
    _prompt_attention, lambda query, *_: query.new_empty(query.shape[2], query.shape[1], query.shape[3]))
