"""An encoder-decoder's per-row cross-attention state inside a :class:`~tetris_hf.kv.SlotCache`.

A decoder that attends to an encoder's outputs (Whisper's, or the target's encoder outputs read by a
``WhisperForCausalLM`` draft) has two caches per layer: self-attention, which grows by the rows' tokens and is what a
rejected draft rolls back (the slot cache's layers, with their holes and repacking), and cross-attention, whose keys
and values the model computes once per row from that row's encoder outputs and never changes. Only the row axis of
cross-attention moves: when finished rows leave the batch, the same moves as the self-attention rows
(:meth:`CrossAttention.select`). Nothing is masked or repacked along its ``S`` encoder positions.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache


class CrossAttention:
    """The memory a decoder attends to, one row per cache row: the encoder outputs ``memory`` ``(B, S, d)`` until the
    first forward, in which the model's own cross-attention projections turn them into keys and values
    ``(B, H, S, D)`` per layer (stored in :attr:`cache` through transformers' ``EncoderDecoderCache``); the encoder
    outputs are then dropped (a zero-length ``(B, 0, d)`` placeholder tells the decoder layers that cross-attention
    exists, and the cached keys are read instead, as transformers does once ``is_updated``).

    Args:
        memory: ``(B, S, d)`` encoder outputs, rows in the cache's row order.
    """

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
