"""Attention over a slot cache: a model's attention layout (:class:`AttentionLayout`), masks from real positions
(:func:`position_masks`), and :func:`grouped_sdpa_attention` (each key-value head read in place). Design:
docs/design.md, "The slot cache".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .cpu_attention import prompt_attention, prompt_attention_applies, row_attention, row_attention_applies

FULL, SLIDING = "full_attention", "sliding_attention"
MASK_IMPLEMENTATIONS = ("sdpa", "eager")  # attention implementations that take a prepared 4D mask
ALIBI_FAMILIES = ("bloom", "mpt")  # their ALiBi biases come from the 2D mask's cumulative sum
ROUTED_PREFIX = "tetris_"  # the loop's own attention function is registered as f"tetris_{base}:{module}"


def routed_implementation(base: str, owner: str) -> str:
    """The name :func:`tetris_hf.routing.loop_attention_forward` is registered under for models on ``base`` by the
    module named ``owner`` (a process may hold several copies of this package: the Hub folder's, a Space's)."""
    return f"{ROUTED_PREFIX}{base}:{owner}"


def base_implementation(name: str) -> str:
    """The attention implementation a model runs under the loop's routing: ``"sdpa"`` for ``"tetris_sdpa:..."``,
    any other name as it is."""
    if name.startswith(ROUTED_PREFIX) and ":" in name:
        return name[len(ROUTED_PREFIX) : name.index(":")]
    return name


@dataclass(frozen=True)
class AttentionLayout:
    """Which attention a model's layers use, and how to hand it masks.

    Args:
        windows: ``{layer type: window}``, ``None`` for full attention.
        keyed: the model's forward takes a dict of masks keyed by layer type (hybrid models: ``config.layer_types``).
        implementation: ``config._attn_implementation``.
        prepared: the cache hands the model prepared 4D masks (else the 2D mask of real slots).
    """

    windows: dict
    keyed: bool
    implementation: str
    prepared: bool

    @classmethod
    def of(cls, model: torch.nn.Module) -> "AttentionLayout":
        config = model.config.get_text_config(decoder=True)
        window = getattr(config, "sliding_window", None)
        window = window if isinstance(window, int) and window > 0 else None
        layer_types = getattr(config, "layer_types", None)
        implementation = base_implementation(config._attn_implementation or "eager")
        alibi = config.model_type in ALIBI_FAMILIES or bool(getattr(config, "alibi", False))
        prepared = implementation in MASK_IMPLEMENTATIONS and not alibi
        if isinstance(layer_types, (list, tuple)) and layer_types:
            windows = {kind: (window if kind == SLIDING else None) for kind in dict.fromkeys(layer_types)}
            layout = cls(windows, True, implementation, prepared)
        else:
            layout = cls({FULL if window is None else SLIDING: window}, False, implementation, prepared)
        if layout.windowed:
            unknown = [kind for kind in layout.windows if kind not in (FULL, SLIDING)]
            if unknown:
                raise ValueError(f"{config.model_type}: layer types {unknown} are not supported by tetris_hf (it can "
                                 f"build masks for {FULL!r} and {SLIDING!r} layers)")
            if SLIDING in layout.windows and layout.windows[SLIDING] is None:
                raise ValueError(f"{config.model_type}: sliding-attention layers without a `sliding_window` size")
            if not prepared:
                raise ValueError(f"{config.model_type} with attn_implementation={implementation!r}: tetris_hf builds "
                                 f"sliding-window masks from real positions, which needs one of "
                                 f"{MASK_IMPLEMENTATIONS}; load the model with attn_implementation='sdpa'")
        return layout

    @cached_property  # (properties of a frozen layout, asked for at every forward)
    def windowed(self) -> bool:
        """Some layer attends through a sliding window (masks must come from real positions)."""
        return any(window is not None for window in self.windows.values())

    @cached_property
    def plain_sdpa(self) -> bool:
        """One boolean 4D mask for every layer, no window (the mask of a single new token is its row's real slots)."""
        return self.implementation == "sdpa" and self.prepared and not self.keyed and not self.windowed

    @cached_property
    def reach(self) -> int | None:
        """How far back any layer sees (``None``: unbounded). Older slots are never read again."""
        windows = list(self.windows.values())
        return None if any(window is None for window in windows) else max(windows)


def check_tree_layout(layout: AttentionLayout, model: torch.nn.Module) -> None:
    """Refuse draft trees (``tetris_tree_width > 1``) on a model that cannot take a prepared 4D mask: a tree's nodes
    see only their ancestors, which a 2D mask of real slots cannot say."""
    if not layout.prepared:
        config = model.config.get_text_config(decoder=True)
        why = ("its ALiBi biases come from the 2D attention mask" if config.model_type in ALIBI_FAMILIES
               or getattr(config, "alibi", False) else
               f"attn_implementation={layout.implementation!r} takes no prepared 4D mask (use 'sdpa' or 'eager')")
        raise ValueError(f"tetris_tree_width > 1 needs a 4D ancestor mask, which {config.model_type} cannot take: "
                         f"{why}; use tetris_tree_width=1 (draft chains)")


def position_masks(layout: AttentionLayout, key_positions: torch.Tensor, key_valid: torch.Tensor,
                   query_positions: torch.Tensor, dtype: torch.dtype, visibility: torch.Tensor | None = None):
    """Prepared 4D masks: query ``i`` sees key ``j`` iff slot ``j`` is real, ``pos_j <= pos_i`` and, on sliding
    layers, ``pos_i - pos_j < window``.

    Args:
        key_positions, key_valid: ``(B, S)`` every slot's position, and whether it holds a real token.
        query_positions: ``(B, L)``.
        dtype: the model's dtype (eager attention adds the mask to its scores).
        visibility: ``(B, L, W)`` bool or ``None``: for the last ``W`` slots (a draft tree's), query ``i`` sees slot
            ``S - W + j`` iff ``visibility[:, i, j]`` (its ancestors and itself) and the slot is real, in place of
            ``pos_j <= pos_i``; windows still count real positions.

    Returns:
        ``(B, 1, L, S)``: boolean (True = attend) for sdpa, additive float for eager; a dict of them keyed by layer
        type when ``layout.keyed``.
    """
    distance = query_positions[:, :, None] - key_positions[:, None, :]  # (B, L, S)
    visible = key_valid[:, None, :] & (distance >= 0)
    if visibility is not None:
        tree = visibility.shape[-1]
        visible = torch.cat([visible[..., : visible.shape[-1] - tree],
                             visibility & key_valid[:, None, key_valid.shape[1] - tree :]], dim=-1)
    masks = {}
    for kind, window in layout.windows.items():
        allowed = visible if window is None else visible & (distance < window)
        allowed = allowed[:, None]
        if layout.implementation == "eager":
            allowed = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
                ~allowed, torch.finfo(dtype).min)
        masks[kind] = allowed
    return masks if layout.keyed else next(iter(masks.values()))


def real_prefix_mask(cached_valid: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """The ``(B, 1, L, S + L)`` bool mask (True = attend) of a block whose real tokens come first in every row, on a
    plain sdpa layout: a real token sees the real cached slots (``cached_valid`` ``(B, 1, 1, S)``) and the block up to
    itself (``causal`` ``(L, L)``, True on and below the diagonal); what filler sees does not matter."""
    batch, cached = cached_valid.shape[0], cached_valid.shape[-1]
    block = causal.shape[0]
    return torch.cat([cached_valid.expand(batch, 1, block, cached), causal.expand(batch, 1, block, block)], dim=-1)


def grouped_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, but with a mask too a key-value head is read in place by its group of query
    heads (``enable_gqa``), where transformers would copy the keys and values to every query head first (docs/gpu.md).
    ``query`` ``(B, H, L, D)``, ``key``/``value`` ``(B, H_kv, W, D)``; returns ``(B, L, H, D)``."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    unusual = any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux", "sinks"))
    if not unusual and not dropout and row_attention_applies(query, key, value, attention_mask):
        # (CPU, a few queries a row: each row over its own keys, docs/benchmarks.md, "Each row over its own keys")
        return row_attention(query, key, value, attention_mask, scaling), None
    # (one query outside a compiled graph: transformers folds the query heads onto the key-value heads, no copy)
    single = query.shape[2] == 1 and not torch.compiler.is_compiling()
    if getattr(module, "num_key_value_groups", 1) == 1 or unusual or attention_mask is None or single:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    batch, heads, length, dim = query.shape
    if fold_queries(query, heads // key.shape[1], attention_mask):
        # each key-value head's group of query heads as one block of queries: (B, H_kv, G * L, D), row g * L + l
        # the query head g's query l, its mask row l; the kernel reads the head once for them all
        query = query.reshape(batch, key.shape[1], heads // key.shape[1] * length, dim)
        if attention_mask.shape[2] > 1:
            attention_mask = attention_mask.repeat(1, 1, heads // key.shape[1], 1)
        output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                                  dropout_p=dropout, scale=scaling)
        return output.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                              dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


FOLDED_QUERIES = 32  # a masked block is folded onto its key-value heads where this holds each head's queries


def fold_queries(query: torch.Tensor, groups: int, attention_mask: torch.Tensor) -> bool:
    """Whether :func:`grouped_sdpa_attention` folds a block's query heads onto their key-value head (``query``
    ``(B, H, L, D)``, ``groups`` query heads a key-value head): on the CPU, outside compiled graphs, a 4D bool mask,
    more than :data:`SMALL_BLOCK` queries a head and at most :data:`FOLDED_QUERIES` a key-value head. The CPU sdpa
    kernel then reads each key-value head once for its ``groups * L`` queries in one product (where ``enable_gqa``
    reads it per query head, ``L`` queries each), with the same sums bit for bit: both are one block of more than
    :data:`SMALL_BLOCK` queries (see :func:`queries_read`; smaller blocks round otherwise). E.g. a verified block of
    5 tokens, 9 query heads on 3: 3 blocks of 15 queries in place of 9 of 5 (docs/benchmarks.md, "Attention over long
    contexts")."""
    length = query.shape[2]
    return (query.device.type == "cpu" and not torch.compiler.is_compiling() and attention_mask.dim() == 4
            and attention_mask.dtype == torch.bool and length > SMALL_BLOCK
            and groups * length <= min(FOLDED_QUERIES, QUERY_BLOCK))


ROW_BY_ROW_WIDTH = 16  # prompt blocks at least this wide are attended row by row (prompt_rows_attention)
KEY_MULTIPLE = 16  # a row's causal keys are cut at a multiple of this (the widest CPU vector of fp32, AVX-512)
QUERY_BLOCK = 32  # the CPU sdpa kernel's blocks of queries are multiples of this
KEY_BLOCK = 512  # and its blocks of keys this long
# and a last block of at most this many queries takes another product whose sums round differently (the count
# depends on the CPU: tests/test_packing.py checks it on the machine it runs on; docs/benchmarks.md has the measures)
SMALL_BLOCK = 3


def queries_read(length: int, width: int) -> int:
    """How many of a row's ``width`` queries :func:`prompt_rows_attention` computes for its ``length`` real ones: at
    least ``length``, where the CPU sdpa kernel computes each real one as in the padded block. The kernel splits the
    queries into blocks (multiples of :data:`QUERY_BLOCK`); a last block of at most :data:`SMALL_BLOCK` queries takes
    another product (a vector one) whose sums round differently, so a row read alone does not end in one unless the
    padded block did (its last queries: the row reads the whole width then). E.g. width 256: 33 -> 36, 40 -> 40,
    255 -> 256."""
    if length >= width - SMALL_BLOCK:
        return width
    return next(end for end in range(length, length + SMALL_BLOCK + 1) if not 1 <= end % QUERY_BLOCK <= SMALL_BLOCK)


def prompt_rows_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: tuple[int, ...],
                          attention_mask: torch.Tensor | None, width: int, key_start: int = 0,
                          scaling: float | None = None) -> torch.Tensor:
    """sdpa over rows that read prompts, one row at a time at its own length, each key-value head read in place
    (``enable_gqa``): the rows of a block padded to its longest prompt computed every row to that width (and rows with
    no token in it, all of them), where a row reads only its own tokens here (docs/benchmarks.md, "Attention over long
    contexts"). The same sums as the padded block, row by row, on the CPU's sdpa kernel (bit for bit on the Intel
    CPUs measured, within rounding on an AMD EPYC: tests/test_packing.py). Causal rows (``attention_mask=None``)
    go to :func:`~tetris_hf.cpu_attention.prompt_attention` where it applies (fp32 on the CPU, the kernel built):
    1.4-3.0x faster, within fp32 rounding of sdpa's sums.

    Args:
        query: ``(1, H, N, D)`` the rows' tokens packed in row order (``lengths[i]`` of row ``i``).
        key, value: ``(R, H_kv, S, D)`` the rows' slots, the block's written from ``key_start`` on.
        lengths: ``R`` host ints, each row's tokens (0: the row is left out).
        attention_mask: ``(R or 1, 1, W or 1, S)`` bool (True = attend) over every slot; ``None``: the rows hold
            nothing real before the block and their real tokens come first in it, so each attends causally to its
            own first slots from ``key_start`` on, cut at a multiple of :data:`KEY_MULTIPLE` (at most ``width``, the
            block's width; all ``width`` past :data:`KEY_BLOCK`): the keys a padded block's causal mask would leave
            to it, in the same vector lanes.
        width: ``W``, the block's width.
        scaling: the layer's softmax scale (``None``: ``D ** -0.5``).

    Returns:
        ``(N, H, D)`` in the packed order.
    """
    if attention_mask is None and prompt_attention_applies(query, key, value):
        end = key_start + max(lengths)
        return prompt_attention(query, key[:, :, key_start:end], value[:, :, key_start:end], lengths, scaling)
    outputs, token = [], 0
    grouped = query.shape[1] != key.shape[1]
    for row, length in enumerate(lengths):
        if not length:
            continue
        read = queries_read(length, width)
        queries = query[:, :, token : token + length]  # (1, H, length, D)
        if read > length:  # (filler after the real queries, as in the padded block: computed, then dropped)
            queries = torch.nn.functional.pad(queries, (0, 0, 0, read - length))
        token += length
        if attention_mask is None:
            # (a block wider than the kernel's blocks of keys keeps them all: cut, its blocks would split otherwise)
            keys_end = key_start + (width if width > KEY_BLOCK else min(width, -(-read // KEY_MULTIPLE) * KEY_MULTIPLE))
            keys, values = key[row : row + 1, :, key_start:keys_end], value[row : row + 1, :, key_start:keys_end]
            output = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, is_causal=True,
                                                                      scale=scaling, enable_gqa=grouped)
        else:
            mask = attention_mask[row : row + 1] if attention_mask.shape[0] > 1 else attention_mask
            mask = mask[:, :, :read] if mask.shape[2] > 1 else mask
            output = torch.nn.functional.scaled_dot_product_attention(queries, key[row : row + 1],
                                                                      value[row : row + 1], attn_mask=mask,
                                                                      scale=scaling, enable_gqa=grouped)
        outputs.append(output[0, :, :length].transpose(0, 1))  # (length, H, D)
    return torch.cat(outputs)
