"""The loop's own attention, routed into transformers' ``AttentionInterface`` for the models of a call
(:func:`routed_attention`): :func:`loop_attention_forward` runs a model's attention as it would, or a packed block
(:mod:`tetris_hf.packing`), a static step's grouped sdpa, or a compiled step's cache write and attention
(:mod:`tetris_hf.slot_attention`), as the forward's arguments say.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from functools import cache, partial

import torch

from .attention import MASK_IMPLEMENTATIONS, grouped_sdpa_attention, routed_implementation
from .packing import Packing, packed_attention
from .slot_attention import SlotArguments, layer_slot_attention


def loop_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask, *, base: str, tetris_packing: Packing | None = None,
                           tetris_grouped: bool = False, tetris_slots: SlotArguments | None = None,
                           **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention a routed model runs (:func:`routed_attention`): its own (``base``: transformers' sdpa, or its
    family's eager attention) unless the forward's arguments ask otherwise: ``tetris_packing``, a packed block
    (:func:`~tetris_hf.packing.packed_attention`); ``tetris_grouped``, a static step on sdpa
    (:func:`~tetris_hf.attention.grouped_sdpa_attention`, which every sdpa forward on the CPU runs too);
    ``tetris_slots``, a forward compiled on its eager shapes, whose cache write is this call's too
    (:func:`~tetris_hf.slot_attention.slot_attention`)."""
    if tetris_slots is not None:
        return layer_slot_attention(module, query, key, value, attention_mask, tetris_slots,
                                    kwargs.get("scaling")), None
    # (CPU: docs/benchmarks.md, "Keys read in place"; elsewhere static steps only, where no fused kernel is lost)
    grouped = base == "sdpa" and (tetris_grouped or query.device.type == "cpu")
    attention = grouped_sdpa_attention if grouped else row_attention(module, base)
    if tetris_packing is not None:
        # (CPU: prompt rows one by one, docs/benchmarks.md, "Attention over long contexts"; elsewhere as before)
        return packed_attention(attention, module, query, key, value, attention_mask, tetris_packing,
                                prompt_rows=grouped and query.device.type == "cpu", **kwargs)
    return attention(module, query, key, value, attention_mask, **kwargs)


def row_attention(module: torch.nn.Module, implementation: str):
    """The attention function ``module`` runs on ``implementation``: transformers' sdpa, or its family's eager
    attention (``eager_attention_forward`` of its modeling module)."""
    if implementation == "sdpa":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if implementation != "eager" or eager is None:
        raise ValueError(f"{type(module).__name__} on {implementation!r} attention cannot be read packed")
    return eager


@cache
def _register(base: str) -> str:
    """Register :func:`loop_attention_forward` for models on ``base`` (and ``base``'s masks), once; its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    name = routed_implementation(base, __name__)
    AttentionInterface.register(name, partial(loop_attention_forward, base=base))
    AttentionMaskInterface.register(name, sdpa_mask if base == "sdpa" else eager_mask)
    return name


class _OpenRouting:
    """A config routed by one or more open :func:`routed_attention` contexts: its own implementation (``base``),
    restored when the last of them closes."""

    def __init__(self, config, base: str):
        self.config, self.base, self.count = config, base, 0


_OPEN: dict[int, _OpenRouting] = {}  # id(config) -> its open routing (the config is kept: no id reused while open)
_OPEN_LOCK = threading.Lock()  # (a stream's contexts may close on its worker thread)


@contextlib.contextmanager
def routed_attention(*models: torch.nn.Module) -> Iterator[None]:
    """While it is open, ``models`` on ``"sdpa"`` or ``"eager"`` attention run :func:`loop_attention_forward` (their
    settings restored after; a model on another implementation stays as it is). Contexts may overlap on one model
    (two streams over one target): its setting is restored when the last of them closes."""
    entered = []
    with _OPEN_LOCK:
        for model in models:
            config = model.config.get_text_config(decoder=True)
            routing = _OPEN.get(id(config))
            if routing is None and config._attn_implementation in MASK_IMPLEMENTATIONS:
                routing = _OPEN[id(config)] = _OpenRouting(config, config._attn_implementation)
                config._attn_implementation = _register(routing.base)
            if routing is not None:
                routing.count += 1
                entered.append(routing)
    try:
        yield
    finally:
        with _OPEN_LOCK:
            for routing in reversed(entered):
                routing.count -= 1
                if routing.count == 0:
                    routing.config._attn_implementation = routing.base
                    del _OPEN[id(routing.config)]


def is_routed(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs this module's :func:`loop_attention_forward` now (:func:`routed_attention`)."""
    implementation = model.config.get_text_config(decoder=True)._attn_implementation or ""
    return implementation.endswith(f":{__name__}")
