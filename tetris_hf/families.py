"""Which models the batched loop can serve (:func:`unsupported_reason`, :func:`check_supported`), decided before
anything runs: a decoder-only causal LM whose only per-token state is a KV cache of one token's keys and values a slot,
masked causally (optionally within a window of positions), since the loop rolls rows back by masking slots and hands
the model each token's real position. The families refused: README.md, "Supported models".
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
