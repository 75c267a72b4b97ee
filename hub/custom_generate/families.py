# Exported from tetris_hf/families.py by `python -m tetris_hf.tools.hub_export`: edit the package, not this copy.
"""Which models the batched loop can serve, decided from the model and its config before anything runs.

The loop needs a decoder-only causal LM whose only per-token state is an attention KV cache: it rolls every row back
by masking cache slots, and it hands the model each token's real position. That rules out

- encoder-decoder models (the loop feeds one token stream to a decoder-only forward);
- multimodal models (load their text-only causal LM instead);
- recurrent and state-space layers (Mamba, RWKV, xLSTM, RecurrentGemma's RG-LRU, gated linear attention, short
  convolutions, and hybrids that mix them with attention): their state summarises every token read, so a rejected
  draft cannot be taken back per row. transformers marks such models ``_is_stateful`` and gives their layers the
  cache layer types ``"linear_attention"``, ``"conv"``, ``"hybrid"`` or ``"hybrid_sliding"``;
- attention whose cache holds more than keys and values per slot, or whose mask is not "causal, optionally within a
  window of positions": chunked attention (Llama 4), indexer-based sparse attention (DeepSeek V3.2), compressed
  attention (DeepSeek V4), and GPT-Neo's local layers (their window is a fixed mask over cache slots).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    LinearAttentionCacheLayerMixin,
    get_layer_types_and_kwargs,
)

# Cache layer types whose every slot is one token's keys and values, masked causally (optionally within a window of
# positions). "dummy": a layer that stores nothing (it reuses another layer's keys and values, e.g. Gemma 3n).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "dummy")
OTHER_MODALITIES = ("vision", "audio", "image", "video", "speech", "vq")


def _is_recurrent(layer_type: str) -> bool:
    """The cache layer transformers makes for ``layer_type`` keeps a recurrent (or convolution) state."""
    layer_class = DYNAMIC_LAYER_TYPE_MAPPING.get(layer_type)
    return layer_class is not None and issubclass(layer_class, LinearAttentionCacheLayerMixin)


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why the loop cannot serve ``model`` (a sentence), or ``None`` when it can."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model; tetris_hf drafts and verifies with decoder-only causal LMs"
    modalities = [name for name in (getattr(config, "sub_configs", None) or {})
                  if getattr(config, name, None) is not None and any(word in name for word in OTHER_MODALITIES)]
    if modalities or config.get_text_config(decoder=True) is not config:
        return (f"it is a multimodal model ({', '.join(modalities) or 'a wrapped text_config'}); load its text-only "
                "causal LM instead (the *ForCausalLM class of its language model, e.g. Gemma3ForCausalLM)")
    recurrent = ("it keeps a recurrent state (state-space, recurrent or convolution layers) that summarises every "
                 "token read, so rejected drafts cannot be rolled back row by row")
    if getattr(model, "_is_stateful", False):
        return recurrent
    if "past_key_values" not in inspect.signature(model.forward).parameters:
        return "its forward takes no `past_key_values`: it has no KV cache to roll back"
    layer_types, _ = get_layer_types_and_kwargs(config)
    if any(_is_recurrent(layer_type) for layer_type in layer_types):
        return f"{recurrent} (layer types {sorted(set(layer_types))})"
    if "local" in (getattr(config, "attention_layers", None) or []):
        return ("its local attention layers (GPT-Neo) take their window from cache slots, inside the model, and the "
                "holes tetris_hf leaves in the cache would move that window")
    unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        return (f"it has {', '.join(unsupported)} layers; tetris_hf masks attention by position, causally or within a "
                f"sliding window, and supports the layer types {list(SUPPORTED_LAYER_TYPES)}")
    return None


def check_supported(model: torch.nn.Module, role: str) -> None:
    """Refuse a ``role`` (``"target"`` or ``"draft"``) model the loop cannot serve, naming its family and why."""
    reason = unsupported_reason(model)
    if reason is not None:
        family = getattr(model.config, "model_type", None) or type(model).__name__
        raise ValueError(f"tetris_hf cannot use the {role} model {type(model).__name__} ({family}): {reason}")
