"""Attention over a slot cache: a model's attention layout (:class:`AttentionLayout`), masks from real positions
(:func:`position_masks`), and :func:`grouped_sdpa_attention` (each key-value head read in place). Design:
docs/design.md, "The slot cache".
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

FULL, SLIDING = "full_attention", "sliding_attention"
MASK_IMPLEMENTATIONS = ("sdpa", "eager")  # attention implementations that take a prepared 4D mask
ALIBI_FAMILIES = ("bloom", "mpt")  # their ALiBi biases come from the 2D mask's cumulative sum
ROUTED_PREFIX = "tetris_"  # the loop's own attention function is registered as f"tetris_{base}:{module}"


def routed_implementation(base: str, owner: str) -> str:
    """The name :func:`tetris_hf.packing.loop_attention_forward` is registered under for models on ``base`` by the
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
    # (one query outside a compiled graph: transformers folds the query heads onto the key-value heads, no copy)
    single = query.shape[2] == 1 and not torch.compiler.is_compiling()
    if getattr(module, "num_key_value_groups", 1) == 1 or unusual or attention_mask is None or single:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if attention_mask.dim() == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                              dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None
