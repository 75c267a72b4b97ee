"""Writing an :class:`~tetris_hf.candidate_generators.eagle.EagleDraft` in the published EAGLE checkpoint format (what
``tetris-hf train-eagle`` saves; :meth:`EagleDraft.from_pretrained` reads it back). The library only reads heads."""

from __future__ import annotations

import json
import os

import torch

from ..candidate_generators.eagle import (CONFIG_NAME, EAGLE3, WEIGHTS_NAMES, EagleDraft, published_name,
                                          rope_fields)


def save_head(head: EagleDraft, directory: str | os.PathLike, dtype: torch.dtype | None = None) -> str:
    """Write ``head`` in the published format :meth:`EagleDraft.from_pretrained` reads: ``config.json`` and
    ``model.safetensors`` (tensor names and config keys of ``shared/facts/eagle-formats.md``; EAGLE-3 in SpecForge's
    layout: ``architectures: ["LlamaForCausalLMEagle3"]``, ``eagle_config`` with output-of-layer ids, ``d2t``
    int64 and ``t2d`` bool for a reduced vocabulary). The target's embedding and head are not written (an own
    embedding is). ``dtype``: of the weights written (default: the head's). Returns the directory."""
    config = head.config
    rope = getattr(config, "rope_parameters", None)
    fields = {
        "architectures": ["LlamaForCausalLMEagle3" if head.feature_kind == EAGLE3 else "LlamaForCausalLM"],
        "model_type": "llama", "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "hidden_act": config.hidden_act, "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings, **rope_fields(rope), "num_hidden_layers": 1,
        "vocab_size": head.vocab_size, "tie_word_embeddings": False,
    }
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, name, None) is not None:
            fields[name] = getattr(config, name)
    if head.feature_kind == EAGLE3:
        fields.update(draft_vocab_size=head.draft_vocab_size,
                      target_hidden_size=head.feature_size // len(head.aux_layer_ids),
                      eagle_config={"use_aux_hidden_state": True,
                                    "eagle_aux_hidden_state_layer_ids": [i - 1 for i in head.aux_layer_ids]})
    else:
        fields["bias"] = head.fc.bias is not None
        if head.layer.self_attn.q_proj.bias is not None:
            fields["qkv_bias"] = True
    fields["torch_dtype"] = str(dtype or head.dtype).removeprefix("torch.")
    tensors = {published_name(name, head.feature_kind): tensor.detach().to("cpu", dtype or tensor.dtype)
               .contiguous() for name, tensor in head.state_dict().items()}
    if head.feature_kind == EAGLE3 and head.target_ids is not None:
        target_ids = head.target_ids.to("cpu", torch.long)
        tensors["d2t"] = target_ids - torch.arange(target_ids.numel())
        tensors["t2d"] = torch.zeros(head.vocab_size, dtype=torch.bool).index_fill_(0, target_ids, True)
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, CONFIG_NAME), "w", encoding="utf-8") as file:
        json.dump(fields, file, indent=2)
    save_file(tensors, os.path.join(directory, WEIGHTS_NAMES[0]), metadata={"format": "pt"})
    return os.fspath(directory)
