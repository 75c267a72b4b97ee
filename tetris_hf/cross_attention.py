"""An encoder-decoder's per-row cross-attention state inside a :class:`~tetris_hf.kv.SlotCache`: keys and values
computed once per row and never rolled back; only their row axis moves, with the rows (:meth:`CrossAttention.select`).
Design: docs/design.md, "Encoder-decoder targets (Whisper)".
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache


class CrossAttention:
    """The memory a decoder attends to, one row per cache row (in its order): the encoder outputs ``memory``
    ``(B, S, d)`` until the first forward, whose cross-attention turns them into keys and values ``(B, H, S, D)`` per
    layer (:attr:`cache`); then a ``(B, 0, d)`` placeholder stands for them (transformers reads the cached keys once
    ``is_updated``)."""

    def __init__(self, memory: torch.Tensor):
        self.memory = memory
        self.cache = DynamicCache()

    @property
    def computed(self) -> bool:
        """The keys and values exist (a host check of the layers' shapes, no device read)."""
        return self.cache.get_seq_length() > 0

    def inputs(self, self_attention: Cache) -> tuple[EncoderDecoderCache, dict]:
        """``past_key_values`` for a forward (the slot cache's ``self_attention`` layers beside the cross-attention
        keys and values) and the keyword arguments that carry the memory (``encoder_hidden_states``)."""
        if self.computed and self.memory.shape[1]:
            self.memory = self.memory[:, :0]  # read once; the keys and values stand for it from now on
        return EncoderDecoderCache(self_attention, self.cache), {"encoder_hidden_states": self.memory}

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` ``(B',)`` in that order (the slot cache's rows after a ``fill_rows``)."""
        self.memory = self.memory[rows.to(self.memory.device)]
        for layer in self.cache.layers:
            if layer.is_initialized:
                index = rows.to(layer.keys.device)
                layer.keys, layer.values = layer.keys[index], layer.values[index]
