"""A model's KV cache shared by a batch whose rows advance by different amounts each step.

Every row writes the same number of slots per forward (blocks are padded to one length); a 0/1 mask per row and slot
says which slots hold real tokens. Rejected drafts and block padding become holes (mask 0). Keys are cached after
RoPE and every forward gets each row's true ``position_ids``, so holes and moved slots change nothing the model
computes. :meth:`SlotCache.compact` repacks each row's real slots to the right end when holes pile up, which bounds
the cache at the longest row's live tokens plus ``max_holes``.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class SlotCache:
    """``DynamicCache`` + ``slot_mask`` ``(B, T)`` (1 = real token) for one model.

    Args:
        batch_size: rows at the start.
        device: where the mask lives (the model's input device).
        max_holes: repack once the cache is longer than its longest row's real tokens by more than this.
    """

    def __init__(self, batch_size: int, device: torch.device, max_holes: int = 32):
        self.cache = DynamicCache()
        self.slot_mask = torch.zeros(batch_size, 0, dtype=torch.long, device=device)
        self.max_holes = max_holes

    @property
    def length(self) -> int:
        """Slots per row, holes included."""
        return self.slot_mask.shape[1]

    def forward(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        input_mask: torch.Tensor,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Run ``model`` on a block appended to every row, and cache it.

        Each real token's position is the number of real tokens before it in its row (cached ones included); filler
        gets its row's last real position, which nothing ever sees (it is masked out as a key, its output unused).

        Args:
            model: a causal LM whose forward takes ``attention_mask``, ``position_ids``, ``past_key_values``.
            input_ids: ``(B, L)`` the block (filler where ``input_mask`` is 0).
            input_mask: ``(B, L)`` 1 for real tokens, 0 for filler.
            logits_to_keep: keep logits for the last this-many positions only (0 = all).

        Returns:
            ``(B, L or logits_to_keep, V)`` logits.
        """
        position_ids = self.live_lengths()[:, None] + (input_mask.cumsum(dim=1) - 1).clamp(min=0)
        attention_mask = torch.cat([self.slot_mask, input_mask.to(self.slot_mask.dtype)], dim=1)
        kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        outputs = model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            **kwargs,
        )
        self.slot_mask = attention_mask
        self._check_layers()
        return outputs.logits

    def prefill(self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Cache a left-padded block ``(B, T)`` (a prompt, or tokens a draft skipped) but its last column, which
        opens the next block."""
        if input_ids.shape[1] > 1:
            self.forward(model, input_ids[:, :-1], attention_mask[:, :-1], logits_to_keep=1)

    def _check_layers(self) -> None:
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise TypeError(
                    f"tetris_hf needs full-attention dynamic cache layers; this model uses {type(layer).__name__} "
                    "(sliding-window, quantized or static caches are not supported)"
                )

    def drop_slots(self, start: int, keep: torch.Tensor) -> None:
        """Turn slots ``start + keep[i]`` onwards of row ``i`` into holes (rejected drafts, block filler).

        Args:
            start: first slot of the block this applies to.
            keep: ``(B,)`` how many slots of the block row ``i`` keeps.
        """
        offsets = torch.arange(self.length - start, device=self.slot_mask.device)
        block = self.slot_mask[:, start:]
        self.slot_mask[:, start:] = block * (offsets[None, :] < keep[:, None]).to(block.dtype)

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (a ``(B',)`` index tensor), in that order."""
        self.slot_mask = self.slot_mask[rows]
        for layer in self.cache.layers:  # layers may sit on different devices (a model split by accelerate)
            if layer.is_initialized and layer.keys.numel() > 0:
                layer.batch_select_indices(rows.to(layer.keys.device))

    def live_lengths(self) -> torch.Tensor:
        """``(B,)`` real tokens per row."""
        return self.slot_mask.sum(dim=1)

    def compact(self, force: bool = False) -> None:
        """Repack each row's real slots to the right end, in order, and drop the columns no row needs.

        Runs only when the cache holds more than ``max_holes`` slots beyond its longest row (or ``force``).
        """
        if self.length == 0:
            return
        longest = int(self.live_lengths().max())
        if not force and self.length - longest <= self.max_holes:
            return
        # A stable ascending sort puts holes (0) first and real slots (1) last, each group in its original order.
        sorted_mask, order = torch.sort(self.slot_mask, dim=1, stable=True)
        order = order[:, self.length - longest :]
        self.slot_mask = sorted_mask[:, self.length - longest :].contiguous()
        for layer in self.cache.layers:
            if not layer.is_initialized or layer.keys.numel() == 0:
                continue
            batch, heads, _, head_dim = layer.keys.shape
            index = order.to(layer.keys.device)[:, None, :, None].expand(batch, heads, longest, head_dim)
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
